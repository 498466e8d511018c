//! Claiming a machine id: connecting to a member that answers, taking the
//! lowest free slot under a new lease (or resuming the last hold's lease,
//! if etcd still holds it), and waiting for the slot's high-water mark.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use etcd_client::{Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp};
use snowgate_plugin::SnowflakeLayout;

use super::high_water::{fleet_mark_ahead, floor_without_mark, parse_high_water, quoted, Reserved};
use super::hold::gone;
use super::{
    hostname, renew_once, Keeper, LeaseState, Sent, Unconfirmed, MAX_MARK_AHEAD,
    MEMBER_ANSWER_WAIT, RENEWALS_PER_TTL, RETRY_PAUSE, ROOM_FOR_BURSTS,
};
use crate::id_clock::MAX_LEAD;
use crate::identity::LeaseBounds;
use crate::utc::{format_millis, millis_of};

/// The slots a claim may try, from one read.
#[derive(Default)]
pub(super) struct Candidates {
    /// Free slots whose high-water mark is not bad, lowest first.
    pub(super) free: Vec<u32>,
    /// Free slots skipped for a bad high-water mark.
    pub(super) skipped: Vec<u32>,
}

/// A machine id claimed under a lease.
pub(super) struct Claim {
    pub(super) client: Client,
    pub(super) lease_id: i64,
    pub(super) machine_id: u32,
    /// When the last renewal etcd confirmed was sent, or the grant asked
    /// for: the lease expires no sooner than a TTL after this.
    pub(super) alive_since: Sent,
}

/// `ids` as text, the first few then how many more.
pub(super) fn list_ids(ids: &[u32]) -> String {
    const SHOWN: usize = 8;
    let mut text = ids
        .iter()
        .take(SHOWN)
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    if ids.len() > SHOWN {
        text.push_str(&format!(" and {} more", ids.len() - SHOWN));
    }
    text
}

impl Keeper {
    /// Connects, grants a lease and claims the lowest free id; sets the
    /// clock past the slot's high-water mark and reserves ahead. Returns
    /// the client, the lease, the id, and when the last renewal etcd
    /// confirmed was sent: the lease expires no sooner than a TTL after it.
    /// When no slot is free, no lease is granted: a replica waiting for
    /// one only reads.
    pub(super) async fn claim(&mut self) -> anyhow::Result<Claim> {
        let mut client = self.connect().await?;
        if let Some(earlier) = self.unconfirmed.take() {
            if let Some(resumed) = self.resume(&mut client, earlier).await? {
                return Ok(resumed);
            }
        }
        let mut candidates = self.candidates(&mut client).await?;
        if candidates.free.is_empty() {
            return Err(self.none_free(candidates));
        }
        let mut alive_since = Sent::now();
        let lease = client
            .lease_grant(self.config.ttl.as_secs() as i64, None)
            .await
            .context("granting an etcd lease")?;
        let lease_id = lease.id();
        self.granted = Some((client.clone(), lease_id));
        match self
            .claim_under(&mut client, lease_id, &mut alive_since, &mut candidates)
            .await
        {
            Ok(id) => Ok(Claim {
                client,
                lease_id,
                machine_id: id,
                alive_since,
            }),
            Err(e) => {
                // Let go of the lease (and any slot bound to it) at once,
                // rather than block that slot for a TTL.
                let _ = tokio::time::timeout(RETRY_PAUSE, client.lease_revoke(lease_id)).await;
                Err(e)
            }
        }
    }

    /// Takes the machine id of a hold that ended for want of a confirmed
    /// renewal back, if etcd now confirms its lease alive (it extends every
    /// lease by its TTL when it elects a leader, as after a restart). The
    /// slot's key is then still bound to the lease: no other replica can
    /// have held the slot meanwhile, and this process's id clock is past
    /// every id it issued, so ids go on at once. A new slot would first
    /// wait for its floor: after an etcd outage longer than the TTL, a
    /// review's replicas stayed unready about 15 s instead of about 1 s.
    ///
    /// `None` if the lease is gone or its key is no longer bound to it: a
    /// new claim is due. An error if etcd did not answer; the lease is kept
    /// for the next attempt, so that this replica never holds two slots.
    pub(super) async fn resume(
        &mut self,
        client: &mut Client,
        earlier: Unconfirmed,
    ) -> anyhow::Result<Option<Claim>> {
        let (lease_id, id) = (earlier.lease_id, earlier.machine_id);
        // Revoked if the gateway stops during the attempt.
        self.granted = Some((client.clone(), lease_id));
        // Whether the lease is alive: when a renewal etcd confirms was
        // sent, `None` if the lease is gone.
        let wait = self.call_wait();
        let alive = |client: &mut Client| {
            let mut client = client.clone();
            async move {
                match renew_once(&mut client, lease_id, wait).await {
                    Ok(sent) => Ok(Some(sent)),
                    Err(e) if gone(&e) => {
                        tracing::info!(
                            machine_id = id,
                            lease_id,
                            "the lease etcd did not confirm in time is gone; claiming a machine \
                             id anew"
                        );
                        Ok(None)
                    }
                    Err(e) => Err(e.context(format!(
                        "checking whether the lease of machine id {id} is still alive"
                    ))),
                }
            }
        };
        match alive(client).await {
            Ok(Some(_)) => {}
            Ok(None) => return Ok(None),
            Err(e) => {
                self.unconfirmed = Some(earlier);
                return Err(e);
            }
        }
        let ceiling = match self.reserve(client, id, lease_id, 0).await {
            Ok(Reserved::Raised(mark)) => mark,
            Ok(Reserved::NotOurs) => {
                tracing::info!(machine_id = id, lease_id, "the lease is alive, but the key of its machine id is no longer bound to it; claiming a machine id anew");
                let _ = tokio::time::timeout(RETRY_PAUSE, client.lease_revoke(lease_id)).await;
                return Ok(None);
            }
            Err(e) => {
                self.unconfirmed = Some(earlier);
                return Err(e.context(format!(
                    "raising the high-water mark of machine id {id} to resume it"
                )));
            }
        };
        // Renewed again once the mark is written, as a claim does: the
        // hold's deadline counts from here. Counted from the first renewal,
        // a slow etcd (writes of a second each, with a 3 s TTL) left the
        // hold no time at all: it ended unconfirmed at once, and resumed
        // again, round after round, never stamping.
        let alive_since = match alive(client).await {
            Ok(Some(sent)) => sent,
            Ok(None) => return Ok(None),
            Err(e) => {
                self.unconfirmed = Some(earlier);
                return Err(e);
            }
        };
        self.start_holding(id, lease_id, alive_since, ceiling)?;
        self.status.resumptions.fetch_add(1, Ordering::Relaxed);
        tracing::info!(machine_id = id, lease_id, "etcd confirmed the machine id lease alive after all; stamping resumed with the same id");
        Ok(Some(Claim {
            client: client.clone(),
            lease_id,
            machine_id: id,
            alive_since,
        }))
    }

    /// Lets the request path stamp with machine id `id` under `lease_id`,
    /// alive since the renewal sent at `alive_since`, up to the high-water
    /// mark `ceiling` that etcd confirmed; `/status` shows it held.
    pub(super) fn start_holding(
        &self,
        id: u32,
        lease_id: i64,
        alive_since: Sent,
        ceiling: u64,
    ) -> anyhow::Result<()> {
        self.services
            .identity
            .assign_leased(
                id,
                LeaseBounds {
                    alive_until: self.alive_until(alive_since),
                    ceiling_millis: ceiling,
                    raise_from_millis: self.raise_from(ceiling),
                },
            )
            .context("taking the leased machine id")?;
        self.status.update(|s| {
            s.state = LeaseState::Held;
            s.machine_id = Some(id);
            s.lease_id = Some(lease_id);
            s.last_renewed = Some(SystemTime::now());
            s.last_error = None;
        });
        Ok(())
    }

    /// A client of one etcd endpoint that answers: the endpoints are tried
    /// in turn, from the one after the last that failed. One endpoint at a
    /// time, because etcd-client's balanced channel over several goes on
    /// sending requests to one that is down, so that with one member of
    /// three down, most claims failed and the rest were lost at once. Any
    /// member serves every call (leases are the cluster's).
    pub(super) async fn connect(&mut self) -> anyhow::Result<Client> {
        let timeout = self.call_wait();
        let options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(timeout);
        let endpoints = &self.config.endpoints;
        let mut failures = Vec::new();
        for _ in 0..endpoints.len() {
            let index = self.next_endpoint % endpoints.len();
            let endpoint = &endpoints[index];
            let attempt = async {
                let mut client = Client::connect([endpoint], Some(options.clone())).await?;
                // Connecting is lazy: one call shows the endpoint answers.
                client.status().await?;
                Ok::<_, etcd_client::Error>(client)
            };
            match tokio::time::timeout(timeout, attempt).await {
                Ok(Ok(client)) => {
                    if !failures.is_empty() {
                        // Said once per connect: a member that is down or
                        // hangs costs each connect up to a call's wait.
                        tracing::warn!(
                            failed = %failures.join("; "),
                            "etcd endpoints did not answer; using {endpoint}"
                        );
                    }
                    self.current_endpoint = index;
                    self.next_endpoint = index;
                    return Ok(client);
                }
                Ok(Err(e)) => failures.push(format!("{endpoint}: {e}")),
                Err(_) => failures.push(format!(
                    "{endpoint}: no answer within {} ms",
                    timeout.as_millis()
                )),
            }
            self.next_endpoint = index + 1;
        }
        anyhow::bail!("no etcd endpoint answered ({})", failures.join("; "))
    }

    /// How long one call to an etcd member may take: a third of the TTL,
    /// at most [`MEMBER_ANSWER_WAIT`].
    pub(super) fn call_wait(&self) -> Duration {
        (self.config.ttl / RENEWALS_PER_TTL).min(MEMBER_ANSWER_WAIT)
    }

    /// Makes the next [`Keeper::connect`] try the current endpoint last:
    /// it failed, and may hang rather than refuse.
    pub(super) fn try_others_first(&mut self) {
        self.next_endpoint = self.current_endpoint + 1;
    }

    /// The slots a claim may try, from one read of the claimed slots and
    /// one of the marks: a slot whose mark is bad now is skipped without a
    /// claim (and reported). A claimed slot's mark is read again, so a mark
    /// written in between is still seen.
    pub(super) async fn candidates(&mut self, client: &mut Client) -> anyhow::Result<Candidates> {
        let slots = self.slots_prefix();
        let taken: BTreeSet<u32> = client
            .get(
                slots.as_str(),
                Some(GetOptions::new().with_prefix().with_keys_only()),
            )
            .await
            .context("listing the claimed machine ids")?
            .kvs()
            .iter()
            .filter_map(|kv| {
                kv.key_str()
                    .ok()?
                    .strip_prefix(slots.as_str())?
                    .parse()
                    .ok()
            })
            .collect();
        // Only a shortcut: each claimed slot's mark is read on its own too.
        // So a read of every mark that fails (etcd answers, but the answer
        // is over the client's 4 MiB message limit: values of 1.5 MiB,
        // etcd's largest, under three keys) does not stop every claim.
        let bad_marks = match self.bad_marks(client).await {
            Ok(bad) => bad,
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "reading every high-water mark at once failed; checking each slot's on its own");
                HashMap::new()
            }
        };
        let mut candidates = Candidates::default();
        for id in (0..=self.layout().max_machine_id()).filter(|id| !taken.contains(id)) {
            match bad_marks.get(&id) {
                Some((value, problem)) => {
                    self.report_bad_mark(id, value, problem);
                    candidates.skipped.push(id);
                }
                None => candidates.free.push(id),
            }
        }
        Ok(candidates)
    }

    /// Why no slot could be claimed; forgets the bad marks no longer seen,
    /// so the map stays as small as the slots and a mark fixed and broken
    /// again is reported again.
    pub(super) fn none_free(&mut self, mut candidates: Candidates) -> anyhow::Error {
        // Skipped before the claim, or after claiming: sorted, for a
        // binary search rather than a scan per id.
        candidates.skipped.sort_unstable();
        let skipped = candidates.skipped;
        self.reported
            .retain(|id, _| skipped.binary_search(id).is_ok());
        // Every slot not skipped is taken: by others when read, or by
        // others first when claimed.
        let slots = self.layout().max_machine_id() as usize + 1;
        if skipped.is_empty() {
            // Not another `--etcd-prefix`: replicas of one cluster under
            // two prefixes would lease the same machine ids.
            let wider = match self.layout() {
                SnowflakeLayout::TrtllmV1 => {
                    "; or, with TensorRT-LLM 1.3.0rc22 or later, use --layout trtllm-v2 (16384 \
                     machine ids)"
                }
                SnowflakeLayout::TrtllmV2 => "",
            };
            return anyhow::anyhow!(
                "every machine id of layout {} (0..={}) is taken: the fleet has as many \
                 replicas as the layout has machine ids; stop a replica{wider}",
                self.layout(),
                self.layout().max_machine_id()
            );
        }
        anyhow::anyhow!(
            "no machine id of layout {} (0..={}) is free: {} taken, and {} skipped for a bad \
             high-water mark (ids {}; see the errors logged for each)",
            self.layout(),
            self.layout().max_machine_id(),
            slots - skipped.len(),
            skipped.len(),
            list_ids(&skipped)
        )
    }

    /// Claims the lowest of the `candidates` under `lease_id` whose
    /// high-water mark can be trusted. The lease is renewed on the way if
    /// the round runs long, and once more before the id is used, so that
    /// `alive_since` is recent and the lease (so the slot) provably never
    /// lapsed.
    pub(super) async fn claim_under(
        &mut self,
        client: &mut Client,
        lease_id: i64,
        alive_since: &mut Sent,
        candidates: &mut Candidates,
    ) -> anyhow::Result<u32> {
        let renew_every = self.config.ttl / RENEWALS_PER_TTL;
        let slots = self.slots_prefix();
        let holder = format!("{}:{}", hostname(), std::process::id());
        for id in std::mem::take(&mut candidates.free) {
            anyhow::ensure!(!self.stopping(), "the gateway is stopping");
            if alive_since.at.elapsed() >= renew_every {
                *alive_since = renew_once(client, lease_id, self.call_wait()).await?;
            }
            let key = format!("{slots}{id}");
            let txn = Txn::new()
                .when(vec![Compare::create_revision(
                    key.as_str(),
                    CompareOp::Equal,
                    0,
                )])
                .and_then(vec![TxnOp::put(
                    key.as_str(),
                    holder.as_str(),
                    Some(PutOptions::new().with_lease(lease_id)),
                )]);
            if !client
                .txn(txn)
                .await
                .context("claiming a machine id")?
                .succeeded()
            {
                continue; // another replica took it first
            }
            let read = self.read_high_water(client, id).await?;
            let high_water = match read.and_then(|mark| self.within_reach(mark)) {
                Ok(mark) => mark,
                Err((value, problem)) => {
                    // Without a mark it can trust, the slot's previous ids
                    // are unknown: give it back and take another.
                    self.report_bad_mark(id, &value, &problem);
                    candidates.skipped.push(id);
                    // Only while the key is still ours: had our lease run
                    // out meanwhile, another replica may hold it now.
                    let give_back = Txn::new()
                        .when(vec![Compare::lease(
                            key.as_str(),
                            CompareOp::Equal,
                            lease_id,
                        )])
                        .and_then(vec![TxnOp::delete(key.as_str(), None)]);
                    client
                        .txn(give_back)
                        .await
                        .context("giving back a machine id with a bad high-water mark")?;
                    continue;
                }
            };
            let floor = match high_water {
                Some(ms) => ms,
                // No mark: a slot never held, or one whose mark etcd lost
                // with its data.
                None => floor_without_mark(millis_of(SystemTime::now())),
            };
            // The mark is moved only once the wait is over, and the clock
            // only once nothing can fail before the slot is used: a claim
            // abandoned (a stop, a lost lease, a failed write) leaves the
            // clock where it was, for the next slot this replica takes.
            self.wait_for_the_floor(client, lease_id, alive_since, id, floor)
                .await?;
            let ceiling = match self.reserve(client, id, lease_id, floor).await? {
                Reserved::Raised(mark) => mark,
                Reserved::NotOurs => anyhow::bail!(
                    "the lease expired while claiming machine id {id}: its key is no longer ours"
                ),
            };
            // A confirmed renewal now proves the lease, and so the slot,
            // never lapsed during the claim, and starts the hold afresh.
            *alive_since = renew_once(client, lease_id, self.call_wait()).await?;
            self.services.clock.advance_past(floor);
            self.start_holding(id, lease_id, *alive_since, ceiling)?;
            self.reported.clear();
            self.status.acquisitions.fetch_add(1, Ordering::Relaxed);
            tracing::info!(machine_id = id, lease_id, high_water = ?high_water, "machine id leased from etcd");
            return Ok(id);
        }
        Err(self.none_free(std::mem::take(candidates)))
    }

    /// `mark`, unless it is further ahead of this host's clock than any
    /// takeover waits for (see [`Keeper::wait_for_the_floor`]): a mark a
    /// holder set is at most [`fleet_mark_ahead`] plus [`MAX_LEAD`] ahead of
    /// that holder's clock, so a mark further ahead (allowing [`MAX_LEAD`]
    /// again for clocks that disagree) means this host's clock is behind
    /// the fleet's, or the mark was set by hand. Holding the slot until
    /// this clock caught up would keep it and this replica out of service
    /// that long: the slot is skipped instead, as for a bad mark.
    pub(super) fn within_reach(&self, mark: Option<u64>) -> Result<Option<u64>, (String, String)> {
        let Some(ms) = mark else { return Ok(None) };
        let now = millis_of(SystemTime::now());
        let reach = fleet_mark_ahead() + 2 * MAX_LEAD.as_millis() as u64;
        if ms <= now.saturating_add(reach) {
            return Ok(Some(ms));
        }
        Err((
            quoted(ms.to_string().as_bytes()),
            format!(
                "high-water mark {} is {} s ahead of this host's clock, more than a takeover \
                 waits for ({} s): this host's clock is behind the fleet's, or the mark was set \
                 by hand",
                format_millis(ms),
                (ms - now) / 1000,
                reach / 1000
            ),
        ))
    }

    /// Waits, keeping the lease alive, until the id clock can tick past
    /// `floor`: it issues no tick more than [`MAX_LEAD`] ahead of the wall
    /// clock, so a slot whose floor is further ahead would have every
    /// request refused. Taking over after a crash waits up to about the
    /// last holder's mark lead (a TTL and a second, at most
    /// [`fleet_mark_ahead`]); a slot without a mark [`fleet_mark_ahead`]
    /// and [`CLOCK_AGREEMENT`] (see [`floor_without_mark`]).
    pub(super) async fn wait_for_the_floor(
        &mut self,
        client: &mut Client,
        lease_id: i64,
        alive_since: &mut Sent,
        id: u32,
        floor: u64,
    ) -> anyhow::Result<()> {
        let renew_every = self.config.ttl / RENEWALS_PER_TTL;
        let usable_from = floor
            .saturating_add(ROOM_FOR_BURSTS.as_millis() as u64)
            .saturating_sub(MAX_LEAD.as_millis() as u64);
        let now = millis_of(SystemTime::now());
        if now >= usable_from {
            return Ok(());
        }
        let wait = format!(
            "holding machine id {id}, waiting {} ms until the wall clock is near its \
             high-water mark {}",
            usable_from - now,
            format_millis(floor)
        );
        tracing::info!(machine_id = id, "{wait}");
        self.waiting(wait);
        loop {
            let now = millis_of(SystemTime::now());
            if now >= usable_from {
                return Ok(());
            }
            anyhow::ensure!(!self.stopping(), "the gateway is stopping");
            let until_renewal = renew_every.saturating_sub(alive_since.at.elapsed());
            if until_renewal.is_zero() {
                *alive_since = renew_once(client, lease_id, self.call_wait()).await?;
                continue;
            }
            tokio::time::sleep(Duration::from_millis(usable_from - now).min(until_renewal)).await;
        }
    }

    /// Every high-water mark of this layout that no holder could have
    /// written: the id, the value and what is wrong with it.
    pub(super) async fn bad_marks(
        &self,
        client: &mut Client,
    ) -> anyhow::Result<HashMap<u32, (String, String)>> {
        let prefix = self.high_water_prefix();
        let furthest = self.furthest_mark();
        let response = client
            .get(prefix.as_str(), Some(GetOptions::new().with_prefix()))
            .await
            .context("reading the high-water marks")?;
        Ok(response
            .kvs()
            .iter()
            .filter_map(|kv| {
                let key = kv.key_str().ok()?;
                let id = key.strip_prefix(prefix.as_str())?.parse().ok()?;
                match parse_high_water(key, kv.value(), furthest) {
                    Err(problem) => Some((id, (quoted(kv.value()), problem))),
                    Ok(ms) => self.within_reach(Some(ms)).err().map(|bad| (id, bad)),
                }
            })
            .collect())
    }

    /// The latest high-water mark a holder could have written, by this
    /// host's clock, plus [`MAX_MARK_AHEAD`].
    pub(super) fn furthest_mark(&self) -> u64 {
        millis_of(SystemTime::now())
            .saturating_add(fleet_mark_ahead())
            .saturating_add(MAX_MARK_AHEAD.as_millis() as u64)
    }

    /// Logs a bad high-water mark as an error when it is new (a slot not
    /// reported, or a value it did not hold before), and at debug level
    /// after that: a replica that finds no good slot retries every half
    /// second.
    pub(super) fn report_bad_mark(&mut self, id: u32, value: &str, problem: &str) {
        let advice = format!(
            "{problem}: skipping machine id {id}; set the key to the last millisecond any \
             holder of id {id} may have used (a mark too far ahead may be right: then wait until \
             this host's clock passes it, or set the clock right). Deleting the key is safe only \
             once every holder of id {id} has been stopped for longer than its clock was ahead"
        );
        if self.reported.get(&id).map(String::as_str) != Some(value) {
            self.reported.insert(id, value.to_string());
            tracing::error!(machine_id = id, "{advice}");
        } else {
            tracing::debug!(machine_id = id, "{advice}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skipped_ids_are_listed_the_first_few_then_a_count() {
        assert_eq!(list_ids(&[0, 1]), "0, 1");
        let many: Vec<u32> = (0..20).collect();
        assert_eq!(list_ids(&many), "0, 1, 2, 3, 4, 5, 6, 7 and 12 more");
    }
}
