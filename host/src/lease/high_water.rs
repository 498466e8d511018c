//! A slot's high-water mark: the last millisecond any holder of the slot
//! may have used, kept ahead of the holder's ids while it serves, so that
//! a new holder starts past every id its predecessor may have issued.

use std::time::SystemTime;

use anyhow::Context as _;
use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp, TxnOpResponse};

use super::{Keeper, CLOCK_AGREEMENT, LONGEST_MARK_LEAD, MARK_WRITE_ATTEMPTS, SAFETY_MARGIN};
use crate::id_clock::MAX_LEAD;
use crate::unpoisoned::LockUnpoisoned as _;
use crate::utc::{format_millis, millis_of};

/// A high-water mark's value: milliseconds since the Unix epoch, as
/// decimal text, no later than `furthest`.
pub(super) fn parse_high_water(key: &str, value: &[u8], furthest: u64) -> Result<u64, String> {
    let text = String::from_utf8_lossy(value);
    let millis: u64 = text.trim().parse().map_err(|_| {
        format!(
            "the high-water mark {key} holds {}, not a count of milliseconds",
            quoted(value)
        )
    })?;
    if millis > furthest {
        return Err(format!(
            "the high-water mark {key} is {millis} ({}), later than {}: more than a day past \
             the furthest a holder sets it by this host's clock",
            format_millis(millis),
            format_millis(furthest)
        ));
    }
    Ok(millis)
}

/// An etcd value for a message: quoted, and only its start, since values
/// can be megabytes.
pub(super) fn quoted(value: &[u8]) -> String {
    let text = String::from_utf8_lossy(value);
    let shown: String = text.chars().take(64).collect();
    let more = if shown.len() < text.len() { "..." } else { "" };
    format!("{shown:?}{more}")
}

/// The high-water marks a keeper sent to etcd for the slot it holds (see
/// `Keeper::put_mark`).
#[derive(Debug, Default)]
pub(super) struct MarksSent {
    /// The slot.
    slot: Option<u32>,
    /// The highest mark of the keeper's own.
    own: u64,
    /// Someone else's mark, kept, once said.
    kept: Option<u64>,
}

impl MarksSent {
    /// What to write for slot `id` where the keeper means to write `mark`
    /// and read `found`: `mark`, unless `found` is above it and above every
    /// mark of the keeper's own for the slot (someone else's, kept); and
    /// whether that is a mark kept that was not kept before. `mark` is
    /// counted as the keeper's before it is sent: etcd may take a write
    /// whose answer never comes.
    fn choose(&mut self, id: u32, mark: u64, found: Option<u64>) -> (u64, bool) {
        if self.slot != Some(id) {
            *self = MarksSent {
                slot: Some(id),
                ..MarksSent::default()
            };
        }
        let (written, newly_kept) = match found {
            Some(found) if found > mark && found > self.own => {
                (found, self.kept.replace(found) != Some(found))
            }
            _ => (mark, false),
        };
        self.own = self.own.max(mark);
        (written, newly_kept)
    }
}

/// What raising a slot's high-water mark came to.
pub(super) enum Reserved {
    /// etcd holds the new mark.
    Raised(u64),
    /// The slot's key is no longer bound to this replica's lease.
    NotOurs,
}

impl Keeper {
    /// Reads the slot's high-water mark: none, a mark, or (the inner error)
    /// a value no holder could have written, quoted, with what is wrong
    /// with it (naming the key).
    pub(super) async fn read_high_water(
        &self,
        client: &mut Client,
        id: u32,
    ) -> anyhow::Result<Result<Option<u64>, (String, String)>> {
        let key = self.high_water_key(id);
        let response = client
            .get(key.as_str(), None)
            .await
            .with_context(|| format!("reading the high-water mark {key}"))?;
        Ok(match response.kvs().first() {
            None => Ok(None),
            Some(kv) => parse_high_water(&key, kv.value(), self.furthest_mark())
                .map(Some)
                .map_err(|problem| (quoted(kv.value()), problem)),
        })
    }

    /// How far ahead of the clock this holder keeps its high-water mark:
    /// its TTL and [`SAFETY_MARGIN`], at most [`fleet_mark_ahead`].
    pub(super) fn mark_ahead(&self) -> u64 {
        (self.config.ttl.min(LONGEST_MARK_LEAD) + SAFETY_MARGIN).as_millis() as u64
    }

    /// From which millisecond ids count as near a mark of `ceiling`: half
    /// the lead below it.
    pub(super) fn raise_from(&self, ceiling: u64) -> u64 {
        ceiling.saturating_sub(self.mark_ahead() / 2)
    }

    /// Raises the slot's high-water mark past every millisecond this holder
    /// may use before its lease could expire (its ids start after `floor`
    /// at the earliest), and returns it; only while the slot's key is bound
    /// to `lease_id`, so that a holder whose lease ran out cannot lower a
    /// successor's mark.
    pub(super) async fn reserve(
        &self,
        client: &mut Client,
        id: u32,
        lease_id: i64,
        floor: u64,
    ) -> anyhow::Result<Reserved> {
        let now = millis_of(SystemTime::now());
        let last = self
            .services
            .clock
            .last_tick()
            .map_or(0, |t| t.millis)
            .max(floor);
        // Never below the mark already confirmed (the wall clock may have
        // stepped back): ids up to that one may have left already.
        let confirmed = self.services.identity.ceiling().unwrap_or(0);
        let mut mark = (now.max(last) + self.mark_ahead()).max(confirmed);
        for _ in 0..MARK_WRITE_ATTEMPTS {
            match self.put_mark(client, id, lease_id, mark).await? {
                None => return Ok(Reserved::NotOurs),
                // Someone else's higher mark, kept: ids with this machine
                // id may have gone up to it, so this holder's go on past
                // it, and its mark is raised past it at once. Before, its
                // ids went on below it, and could repeat those.
                Some(written) if written > mark => {
                    self.services.clock.advance_past(written);
                    mark = written + self.mark_ahead();
                }
                Some(_) => return Ok(Reserved::Raised(mark)),
            }
        }
        anyhow::bail!(
            "the high-water mark of machine id {id} was raised past this holder's \
             {MARK_WRITE_ATTEMPTS} times in a row: something other than its holder is writing it"
        )
    }

    /// Writes `mark` as slot `id`'s high-water mark if the slot's key is
    /// bound to `lease_id`.
    ///
    /// The write also requires the mark to be as it was read just before:
    /// a write that reaches etcd late (sent to a member that froze, and
    /// given up on) then finds a later one in its place and is refused,
    /// instead of putting back a lower mark after a higher one had let ids
    /// past it leave. When the mark did change in between (a write of this
    /// holder's own that etcd took but never confirmed), it is read again
    /// and written over.
    ///
    /// A mark read above `mark` and above every mark this keeper sent for
    /// the slot was written by someone else (an operator moving a fixed
    /// id's history into etcd): it is kept, not lowered, so that the
    /// slot's next holder starts past it, and returned, for this holder's
    /// ids to go past it too (see [`Keeper::reserve`]).
    ///
    /// Returns the mark written, or `None` where the slot's key is no
    /// longer bound to `lease_id`.
    pub(super) async fn put_mark(
        &self,
        client: &mut Client,
        id: u32,
        lease_id: i64,
        mark: u64,
    ) -> anyhow::Result<Option<u64>> {
        let slot = format!("{}{id}", self.slots_prefix());
        let key = self.high_water_key(id);
        for _ in 0..MARK_WRITE_ATTEMPTS {
            let read = client
                .get(key.as_str(), None)
                .await
                .with_context(|| format!("reading the high-water mark {key} before writing it"))?;
            // A key that does not exist has revision 0, and compares so.
            let revision = read.kvs().first().map_or(0, |kv| kv.mod_revision());
            let found = read
                .kvs()
                .first()
                .and_then(|kv| parse_high_water(&key, kv.value(), u64::MAX).ok());
            let written = self.mark_to_write(id, mark, found, &key);
            let txn = Txn::new()
                .when(vec![
                    Compare::lease(slot.as_str(), CompareOp::Equal, lease_id),
                    Compare::mod_revision(key.as_str(), CompareOp::Equal, revision),
                ])
                .and_then(vec![TxnOp::put(key.as_str(), written.to_string(), None)])
                .or_else(vec![TxnOp::get(slot.as_str(), None)]);
            let response = client
                .txn(txn)
                .await
                .with_context(|| format!("writing the high-water mark {key}"))?;
            if response.succeeded() {
                return Ok(Some(written));
            }
            let still_ours = response.op_responses().iter().any(|op| {
                matches!(op, TxnOpResponse::Get(slot)
                    if slot.kvs().first().is_some_and(|kv| kv.lease() == lease_id))
            });
            if !still_ours {
                return Ok(None);
            }
        }
        anyhow::bail!(
            "the high-water mark {key} changed between reading and writing it {MARK_WRITE_ATTEMPTS} \
             times in a row: something other than its holder is writing it"
        )
    }

    /// What [`Keeper::put_mark`] writes for slot `id` (see
    /// [`MarksSent::choose`]); someone else's mark kept is said once.
    fn mark_to_write(&self, id: u32, mark: u64, found: Option<u64>, key: &str) -> u64 {
        let mut sent = self.marks_sent.lock_unpoisoned();
        let (written, newly_kept) = sent.choose(id, mark, found);
        if newly_kept {
            tracing::warn!(
                key,
                mark = %format_millis(written),
                "the slot's high-water mark is later than any this replica wrote, so someone \
                 else wrote it: it is kept, and the slot's next holder starts after it"
            );
        }
        written
    }
}

/// How far ahead of its clock any holder, whatever its TTL, keeps its
/// slot's high-water mark: [`LONGEST_MARK_LEAD`] and [`SAFETY_MARGIN`].
pub(super) fn fleet_mark_ahead() -> u64 {
    (LONGEST_MARK_LEAD + SAFETY_MARGIN).as_millis() as u64
}

/// Where a new holder of a slot without a high-water mark starts its id
/// clock, at `now` by its wall clock. A slot without a mark was never
/// held, or etcd lost its data; in the second case the slot's last holder
/// may not know yet, and go on issuing ids until it does or its lease
/// deadline comes, but none past the mark etcd last confirmed to it: one
/// it set at most [`fleet_mark_ahead`] ahead of a millisecond its id clock
/// had reached, which was at most [`MAX_LEAD`] ahead of its wall clock (its
/// id clock refuses more), whatever TTL it had. Its wall clock may be up
/// to [`CLOCK_AGREEMENT`] ahead of this one.
pub(super) fn floor_without_mark(now: u64) -> u64 {
    now.saturating_add(fleet_mark_ahead())
        .saturating_add(MAX_LEAD.as_millis() as u64)
        .saturating_add(CLOCK_AGREEMENT.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::ROOM_FOR_BURSTS;

    #[test]
    fn a_mark_someone_else_raised_is_kept_and_the_keepers_own_are_lowered() {
        let mut sent = MarksSent::default();
        assert_eq!(sent.choose(3, 1_000, None), (1_000, false));
        // Its own earlier mark, higher (a clean stop's exact one is lower):
        // written over.
        assert_eq!(sent.choose(3, 900, Some(1_000)), (900, false));
        // Someone else's, above every mark of its own: kept, said once.
        assert_eq!(sent.choose(3, 1_100, Some(5_000)), (5_000, true));
        assert_eq!(sent.choose(3, 1_200, Some(5_000)), (5_000, false));
        // Until its own pass it.
        assert_eq!(sent.choose(3, 6_000, Some(5_000)), (6_000, false));
        // A write of its own etcd took without answering: written over.
        assert_eq!(sent.choose(3, 6_100, Some(6_000)), (6_100, false));
        // Another slot starts afresh: its mark is not this keeper's.
        assert_eq!(sent.choose(4, 100, Some(2_000)), (2_000, true));
    }

    const KEY: &str = "/snowgate/trtllm-v1/high-water/3";
    const FURTHEST: u64 = 1_764_000_000_000;

    #[test]
    fn a_mark_is_decimal_milliseconds_with_optional_whitespace() {
        assert_eq!(
            parse_high_water(KEY, b"1763999999000", FURTHEST),
            Ok(1_763_999_999_000)
        );
        assert_eq!(
            parse_high_water(KEY, b" 1763999999000\n", FURTHEST),
            Ok(1_763_999_999_000)
        );
        // A mark in the past is simply passed already.
        assert_eq!(parse_high_water(KEY, b"5", FURTHEST), Ok(5));
    }

    #[test]
    fn a_mark_that_is_not_a_count_is_refused_naming_the_key_and_value() {
        for bad in [
            &b""[..],
            b"soon",
            b"-1",
            b"1.5e12",
            b"18446744073709551616",
            b"\xff\xfe",
        ] {
            let problem = parse_high_water(KEY, bad, FURTHEST).expect_err("not a mark");
            assert!(problem.contains(KEY), "{problem}");
            assert!(problem.contains("not a count of milliseconds"), "{problem}");
        }
        let problem = parse_high_water(KEY, b"soon", FURTHEST).unwrap_err();
        assert!(problem.contains("holds \"soon\","), "{problem}");
        // A huge value is quoted in part.
        let huge = "x".repeat(1 << 20);
        let problem = parse_high_water(KEY, huge.as_bytes(), FURTHEST).unwrap_err();
        assert!(problem.len() < 300, "{} bytes", problem.len());
        assert!(
            problem.contains(&format!("{:?}...", "x".repeat(64))),
            "{problem}"
        );
    }

    #[test]
    fn a_mark_past_the_furthest_a_holder_sets_it_is_refused() {
        assert_eq!(
            parse_high_water(KEY, FURTHEST.to_string().as_bytes(), FURTHEST),
            Ok(FURTHEST)
        );
        let problem = parse_high_water(KEY, (FURTHEST + 1).to_string().as_bytes(), FURTHEST)
            .expect_err("a millisecond too far");
        assert!(problem.contains("more than a day past"), "{problem}");
        assert!(problem.contains("2025-11-24T16:00:00.001Z"), "{problem}");
        assert!(parse_high_water(KEY, u64::MAX.to_string().as_bytes(), FURTHEST).is_err());
    }

    /// The furthest mark a holder could have had confirmed, by its wall
    /// clock at the time: its id clock at most `MAX_LEAD` ahead, its mark at
    /// most a fleet's mark lead past that.
    fn furthest_confirmed_mark(holder_wall: u64) -> u64 {
        holder_wall + MAX_LEAD.as_millis() as u64 + fleet_mark_ahead()
    }

    /// A new holder of a slot whose mark etcd lost starts past every id
    /// the last holder may still issue, when that holder's clock was
    /// ahead of the new holder's by anything short of `CLOCK_AGREEMENT`
    /// (and its mark was set as late as the new claim).
    #[test]
    fn a_floor_without_a_mark_is_past_a_holder_whose_clock_is_ahead_within_the_agreement() {
        let now = FURTHEST;
        let agreement = CLOCK_AGREEMENT.as_millis() as u64;
        for ahead in [0, 1, 500, 900, agreement - 1] {
            let mark = furthest_confirmed_mark(now + ahead);
            assert!(
                floor_without_mark(now) > mark,
                "a holder {ahead} ms ahead had mark {mark}, past the floor {}",
                floor_without_mark(now)
            );
        }
        // The allowance is what keeps them apart, no more.
        assert_eq!(
            floor_without_mark(now),
            furthest_confirmed_mark(now + agreement)
        );
        // A fresh holder on a slot without a mark waits its floor less
        // `MAX_LEAD` and the room for bursts: about 12 s.
        let wait = floor_without_mark(now) + ROOM_FOR_BURSTS.as_millis() as u64
            - MAX_LEAD.as_millis() as u64
            - now;
        assert_eq!(wait, 12_200);
    }
}
