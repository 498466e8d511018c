//! The machine id this process stamps into ids, and the layout it was
//! checked against; for a leased id, how long and up to which millisecond
//! it may be used; for a fixed id kept in a [high-water
//! file](crate::high_water_file), up to which millisecond.
//!
//! A leased id comes with two bounds the lease keeper (see
//! [`crate::lease`]) maintains: a deadline on the [boot clock](BootTime),
//! before which the lease is known to be alive in etcd, and a ceiling, the
//! high-water mark etcd has confirmed for the slot, which a successor on
//! the slot starts after. The request path enforces both itself, so a
//! keeper that is late to notice a loss (the process was frozen, etcd is
//! slow to answer) cannot let an id out that another replica may issue:
//! [`MachineIdentity::current`] refuses once the deadline has passed, and
//! [`MachineIdentity::confirm`] is asked after ids were made, before they
//! leave the process. A fixed id whose high-water mark is kept in a local
//! file has a ceiling too, and no deadline.

use std::sync::Arc;

use arc_swap::{ArcSwap, Guard};

use snowgate_plugin::{LayoutError, MachineId, SnowflakeLayout};
use tokio::sync::Notify;

use crate::boot_clock::BootTime;

/// The process's machine id. Fixed for a single gateway; a fleet lease can
/// withdraw it (then plugins refuse to make ids) and grant a new one.
#[derive(Debug)]
pub struct MachineIdentity {
    layout: SnowflakeLayout,
    /// Read on every plugin call that makes ids, written on every grant,
    /// withdrawal, renewal and raised mark: reads take no lock.
    current: ArcSwap<Held>,
    /// Woken when ids come near the ceiling, so that its keeper raises it
    /// before they reach it.
    ceiling_near: Notify,
}

#[derive(Debug, Clone)]
struct Held {
    /// Changes with every grant and withdrawal.
    generation: u64,
    id: Result<u32, String>,
    /// A leased id: until when its lease is known alive in etcd.
    alive_until: Option<BootTime>,
    /// The high-water mark no id may pass, where one is kept.
    ceiling: Option<Ceiling>,
}

/// A high-water mark that bounds the ids of a grant: kept ahead of them in
/// etcd (a leased id) or in a local file (a fixed id with a
/// [high-water file](crate::high_water_file)), so that whoever uses the
/// machine id next starts after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ceiling {
    /// The mark as last confirmed written: no id may use a later
    /// millisecond.
    pub millis: u64,
    /// From this millisecond on, ids are near the mark and its keeper is
    /// asked to raise it.
    pub raise_from_millis: u64,
    /// Where the mark is kept, for the refusal's message.
    pub kept_in: MarkStore,
}

impl Ceiling {
    /// Moves the mark up to `millis` (asking for a higher one from
    /// `raise_from_millis`); a lower or equal mark, a late answer, changes
    /// nothing.
    fn raise_to(&mut self, millis: u64, raise_from_millis: u64) {
        if millis > self.millis {
            self.millis = millis;
            self.raise_from_millis = raise_from_millis;
        }
    }
}

/// Where a [`Ceiling`] is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkStore {
    /// In etcd, with the leased slot.
    Etcd,
    /// In the gateway's high-water file.
    File,
}

/// The bounds of a leased machine id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseBounds {
    /// Until when the lease is known alive in etcd: a TTL (less a safety
    /// margin) after the last renewal etcd confirmed was sent.
    pub alive_until: BootTime,
    /// The slot's high-water mark as etcd last confirmed it: no id may use
    /// a later millisecond, because a successor starts right after it.
    pub ceiling_millis: u64,
    /// From this millisecond on, ids are near the ceiling and the keeper is
    /// asked to raise it.
    pub raise_from_millis: u64,
}

/// The machine id a call was given, and which grant it came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// The machine id and its layout.
    pub id: MachineId,
    /// Which grant: [`MachineIdentity::confirm`] checks it is still the
    /// one held.
    pub generation: u64,
}

impl MachineIdentity {
    fn new(layout: SnowflakeLayout, id: Result<u32, String>) -> MachineIdentity {
        MachineIdentity {
            layout,
            current: ArcSwap::from_pointee(Held {
                generation: 0,
                id,
                alive_until: None,
                ceiling: None,
            }),
            ceiling_near: Notify::new(),
        }
    }

    /// A fixed machine id, refused when out of range for `layout`.
    pub fn fixed(layout: SnowflakeLayout, machine_id: u32) -> Result<MachineIdentity, LayoutError> {
        layout.check_machine_id(machine_id)?;
        Ok(MachineIdentity::new(layout, Ok(machine_id)))
    }

    /// An identity that holds no machine id yet, for `reason`.
    pub fn unassigned(layout: SnowflakeLayout, reason: impl Into<String>) -> MachineIdentity {
        MachineIdentity::new(layout, Err(reason.into()))
    }

    /// The layout machine ids are checked against.
    pub fn layout(&self) -> SnowflakeLayout {
        self.layout
    }

    fn held(&self) -> Guard<Arc<Held>> {
        self.current.load()
    }

    fn change(&self, change: impl Fn(&mut Held)) {
        self.current.rcu(|held| {
            let mut held = Held::clone(held);
            change(&mut held);
            held
        });
    }

    /// The machine id to use now, or why there is none.
    pub fn current(&self) -> Result<MachineId, String> {
        self.grant().map(|grant| grant.id)
    }

    /// The machine id to use now and its grant, or why there is none (a
    /// leased id is refused once its lease may have expired, even if the
    /// keeper has not withdrawn it yet).
    pub fn grant(&self) -> Result<Grant, String> {
        let held = self.held();
        let value = held.id.clone()?;
        if let Some(alive_until) = held.alive_until {
            check_alive(alive_until, BootTime::now())?;
        }
        Ok(Grant {
            id: MachineId {
                value,
                layout: self.layout,
            },
            generation: held.generation,
        })
    }

    /// Which grant is current: it changes with every grant and withdrawal.
    pub fn generation(&self) -> u64 {
        self.held().generation
    }

    /// The high-water mark confirmed for the held id (by etcd for a leased
    /// id, written to the high-water file for a fixed one), if it has one.
    pub fn ceiling(&self) -> Option<u64> {
        self.held().ceiling.map(|ceiling| ceiling.millis)
    }

    /// Whether ids made up to millisecond `last_millis` under grant
    /// `generation` (when known) may leave the process: that grant is still
    /// held, a leased id's lease is still alive, and `last_millis` is not
    /// past its ceiling, if it has one. Asked after the ids were made, so a pause anywhere
    /// before it (the process frozen, a slow call) cannot let through an
    /// id made after the lease could have passed to another replica.
    pub fn confirm(&self, generation: Option<u64>, last_millis: u64) -> Result<(), String> {
        let held = self.held();
        if let Err(reason) = &held.id {
            return Err(reason.clone());
        }
        if generation.is_some_and(|generation| generation != held.generation) {
            return Err(GRANT_CHANGED.into());
        }
        if let Some(alive_until) = held.alive_until {
            check_alive(alive_until, BootTime::now())?;
        }
        let Some(ceiling) = held.ceiling else {
            return Ok(());
        };
        // A leased id's ids stay within the id clock's lead of this host's
        // wall clock as it reads now, not only as it read at its highest:
        // a replica that takes the slot after etcd lost its mark starts
        // that lead (and the fleet's other margins) ahead of its own clock,
        // and would meet ids this one made ahead of a clock that stepped
        // back by more. (A fixed id's mark stays in its file, which a
        // next start always reads.)
        if ceiling.kept_in == MarkStore::Etcd {
            let now = crate::utc::millis_of(std::time::SystemTime::now());
            let lead = crate::id_clock::MAX_LEAD.as_millis() as u64;
            if last_millis > now.saturating_add(lead) {
                return Err(format!(
                    "ids reached millisecond {last_millis}, more than {} s ahead of this host's \
                     wall clock ({now}): it stepped back while the gateway ran; stamping resumes \
                     once it catches up (a replica taking this slot after etcd lost its data \
                     would start too close to these ids)",
                    lead / 1000
                ));
            }
        }
        if last_millis > ceiling.millis {
            self.ceiling_near.notify_one();
            let mark = ceiling.millis;
            return Err(match ceiling.kept_in {
                MarkStore::Etcd => format!(
                    "ids reached millisecond {last_millis}, past the slot's high-water mark \
                     {mark} that etcd confirmed; stamping resumes once the mark is raised"
                ),
                MarkStore::File => format!(
                    "ids reached millisecond {last_millis}, past the high-water mark {mark} \
                     written to the high-water file; stamping resumes once the mark is raised"
                ),
            });
        }
        if last_millis >= ceiling.raise_from_millis {
            self.ceiling_near.notify_one();
        }
        Ok(())
    }

    /// Grants a fixed machine id (no lease), refused when out of range for
    /// the layout.
    pub fn assign(&self, machine_id: u32) -> Result<(), LayoutError> {
        self.grant_new(machine_id, None)
    }

    /// Grants a leased machine id with its bounds, refused when out of
    /// range for the layout.
    pub fn assign_leased(&self, machine_id: u32, lease: LeaseBounds) -> Result<(), LayoutError> {
        self.grant_new(machine_id, Some(lease))
    }

    /// A new grant of `machine_id`, with the bounds of its lease if leased.
    fn grant_new(&self, machine_id: u32, lease: Option<LeaseBounds>) -> Result<(), LayoutError> {
        self.layout.check_machine_id(machine_id)?;
        self.change(|held| {
            held.generation += 1;
            held.id = Ok(machine_id);
            held.alive_until = lease.map(|lease| lease.alive_until);
            held.ceiling = lease.map(|lease| Ceiling {
                millis: lease.ceiling_millis,
                raise_from_millis: lease.raise_from_millis,
                kept_in: MarkStore::Etcd,
            });
        });
        Ok(())
    }

    /// A renewal etcd confirmed: the lease is alive until `alive_until`.
    /// Bounds only move forward.
    pub fn lease_renewed(&self, alive_until: BootTime) {
        self.change(|held| {
            if let Some(held_until) = &mut held.alive_until {
                *held_until = (*held_until).max(alive_until);
            }
        });
    }

    /// A higher high-water mark was confirmed for the held id: ids may use
    /// milliseconds up to `ceiling_millis`, and ask for a higher one from
    /// `raise_from_millis`. Ignored when the id has no ceiling (it was
    /// withdrawn meanwhile) or a higher one (a late answer).
    pub fn ceiling_raised(&self, ceiling_millis: u64, raise_from_millis: u64) {
        self.change(|held| {
            if let Some(ceiling) = &mut held.ceiling {
                ceiling.raise_to(ceiling_millis, raise_from_millis);
            }
        });
    }

    /// Bounds the ids of the held fixed machine id by a high-water mark
    /// written to the high-water file: from now on none may use a
    /// millisecond past `ceiling_millis` (raised later by
    /// [`MachineIdentity::ceiling_raised`]); from `raise_from_millis` the
    /// file's keeper is asked to raise it. A ceiling the id already has is
    /// only ever raised.
    pub fn bound_by_file_mark(&self, ceiling_millis: u64, raise_from_millis: u64) {
        self.change(|held| {
            held.ceiling
                .get_or_insert(Ceiling {
                    millis: ceiling_millis,
                    raise_from_millis,
                    kept_in: MarkStore::File,
                })
                .raise_to(ceiling_millis, raise_from_millis);
        });
    }

    /// Waits until ids come near (or past) the ceiling.
    pub async fn ceiling_near(&self) {
        self.ceiling_near.notified().await
    }

    /// Withdraws the machine id: until the next `assign`, no ids are made.
    pub fn withdraw(&self, reason: impl Into<String>) {
        let reason = reason.into();
        self.change(|held| {
            held.generation += 1;
            held.id = Err(reason.clone());
            held.alive_until = None;
            held.ceiling = None;
        });
    }
}

/// Why ids made under one grant may not leave once another is current.
pub(crate) const GRANT_CHANGED: &str = "the machine id changed while the request was being stamped";

/// An error once the lease's deadline, `alive_until`, has passed at `now`.
fn check_alive(alive_until: BootTime, now: BootTime) -> Result<(), String> {
    if now < alive_until {
        return Ok(());
    }
    Err(format!(
        "the machine id lease may have expired: etcd has confirmed no renewal in time (the \
         deadline passed {} ms ago)",
        now.since(alive_until).as_millis()
    ))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn refuses_an_out_of_range_machine_id() {
        let err = MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 1023).unwrap_err();
        assert!(err.to_string().contains("0..=1022"), "{err}");
        assert!(MachineIdentity::fixed(SnowflakeLayout::TrtllmV2, 16383).is_ok());
    }

    #[test]
    fn withdrawn_identity_reports_the_reason_until_reassigned() {
        let identity = MachineIdentity::fixed(SnowflakeLayout::TrtllmV2, 5).expect("in range");
        identity.withdraw("lease lost");
        assert_eq!(identity.current(), Err("lease lost".to_string()));
        identity.assign(9).expect("in range");
        assert_eq!(
            identity.current(),
            Ok(MachineId {
                value: 9,
                layout: SnowflakeLayout::TrtllmV2
            })
        );
    }

    fn leased(alive_for: Duration, ceiling_millis: u64) -> MachineIdentity {
        let identity = MachineIdentity::unassigned(SnowflakeLayout::TrtllmV1, "acquiring");
        identity
            .assign_leased(
                4,
                LeaseBounds {
                    alive_until: BootTime::now().after(alive_for),
                    ceiling_millis,
                    raise_from_millis: ceiling_millis - 100,
                },
            )
            .expect("in range");
        identity
    }

    fn woken(identity: &MachineIdentity) -> bool {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime");
        runtime.block_on(async {
            tokio::time::timeout(Duration::from_millis(1), identity.ceiling_near())
                .await
                .is_ok()
        })
    }

    #[test]
    fn a_leased_id_is_refused_once_its_deadline_has_passed() {
        let identity = leased(Duration::ZERO, 1_000);
        let refused = identity.current().expect_err("the deadline has passed");
        assert!(refused.contains("may have expired"), "{refused}");
        let refused = identity
            .confirm(None, 10)
            .expect_err("the deadline has passed");
        assert!(refused.contains("may have expired"), "{refused}");
        // A confirmed renewal brings it back.
        identity.lease_renewed(BootTime::now().after(Duration::from_secs(60)));
        assert_eq!(identity.current().map(|id| id.value), Ok(4));
        assert_eq!(identity.confirm(None, 10), Ok(()));
    }

    #[test]
    fn ids_past_the_ceiling_are_refused_and_ask_for_a_higher_one() {
        let identity = leased(Duration::from_secs(60), 1_000);
        let grant = identity.grant().expect("held").generation;
        assert_eq!(identity.confirm(Some(grant), 899), Ok(()));
        assert!(!woken(&identity), "far from the ceiling");
        assert_eq!(identity.confirm(Some(grant), 900), Ok(()));
        assert!(woken(&identity), "near the ceiling");
        assert_eq!(identity.confirm(Some(grant), 1_000), Ok(()));
        // Near the ceiling again: the permit it left is taken here, so
        // that the one below must come from the refusal itself.
        assert!(woken(&identity), "near the ceiling");
        assert!(!woken(&identity), "one permit only");
        let refused = identity.confirm(Some(grant), 1_001).expect_err("past it");
        assert!(
            refused.contains("millisecond 1001, past the slot's high-water mark 1000"),
            "{refused}"
        );
        assert!(woken(&identity), "past the ceiling");
        // Raised by the keeper: the same ids may leave. A lower mark
        // (a late answer) does not lower it.
        identity.ceiling_raised(5_000, 4_000);
        identity.ceiling_raised(2_000, 1_500);
        assert_eq!(identity.confirm(Some(grant), 4_999), Ok(()));
        assert!(identity.confirm(Some(grant), 5_001).is_err());
    }

    /// A leased id's ids more than the id clock's lead ahead of the wall
    /// clock as it reads now (after it stepped back) are refused, even
    /// under the mark etcd confirmed; a fixed id's under its file's mark
    /// are not.
    #[test]
    fn leased_ids_far_ahead_of_the_wall_clock_now_are_refused() {
        let now = crate::utc::millis_of(std::time::SystemTime::now());
        let lead = crate::id_clock::MAX_LEAD.as_millis() as u64;
        let identity = leased(Duration::from_secs(60), now + 60_000);
        let grant = identity.grant().expect("held").generation;
        assert_eq!(identity.confirm(Some(grant), now + lead - 1_000), Ok(()));
        let refused = identity
            .confirm(Some(grant), now + 30_000)
            .expect_err("30 s ahead of the wall clock");
        assert!(refused.contains("stepped back"), "{refused}");

        let fixed = MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 4).expect("in range");
        fixed.bound_by_file_mark(now + 60_000, now + 50_000);
        let grant = fixed.grant().expect("held").generation;
        assert_eq!(fixed.confirm(Some(grant), now + 30_000), Ok(()));
    }

    #[test]
    fn ids_made_under_an_earlier_grant_are_refused() {
        let identity = leased(Duration::from_secs(60), u64::MAX);
        let grant = identity.grant().expect("held").generation;
        identity.withdraw("lease lost");
        assert_eq!(
            identity.confirm(Some(grant), 1),
            Err("lease lost".to_string())
        );
        identity
            .assign_leased(
                4,
                LeaseBounds {
                    alive_until: BootTime::now().after(Duration::from_secs(60)),
                    ceiling_millis: u64::MAX,
                    raise_from_millis: u64::MAX,
                },
            )
            .expect("in range");
        // The same machine id again, but from a new claim: the earlier
        // call's ids predate it.
        let refused = identity.confirm(Some(grant), 1).expect_err("old grant");
        assert!(refused.contains("changed"), "{refused}");
        let now = identity.grant().expect("held").generation;
        assert_eq!(identity.confirm(Some(now), 1), Ok(()));
    }

    #[test]
    fn a_file_mark_bounds_a_fixed_id_and_only_rises() {
        let identity = MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 3).expect("in range");
        let grant = identity.grant().expect("held").generation;
        identity.bound_by_file_mark(1_000, 900);
        assert_eq!(identity.ceiling(), Some(1_000));
        assert_eq!(identity.confirm(Some(grant), 899), Ok(()));
        assert!(!woken(&identity), "far from the mark");
        assert_eq!(identity.confirm(Some(grant), 1_000), Ok(()));
        assert!(woken(&identity), "near the mark");
        let refused = identity.confirm(Some(grant), 1_001).expect_err("past it");
        assert!(
            refused.contains("past the high-water mark 1000 written to the high-water file"),
            "{refused}"
        );
        // No deadline: a fixed id is not leased.
        assert_eq!(identity.current().map(|id| id.value), Ok(3));
        // Raised by either call; never lowered.
        identity.bound_by_file_mark(500, 400);
        identity.ceiling_raised(800, 700);
        assert_eq!(identity.ceiling(), Some(1_000));
        identity.ceiling_raised(3_000, 2_000);
        assert_eq!(identity.confirm(Some(grant), 1_001), Ok(()));
        identity.bound_by_file_mark(4_000, 3_000);
        assert_eq!(identity.ceiling(), Some(4_000));
        // A withdrawal takes the mark with the id.
        identity.withdraw("stopping");
        assert_eq!(identity.ceiling(), None);
    }

    #[test]
    fn a_fixed_id_has_no_deadline_and_no_ceiling() {
        let identity = MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 3).expect("in range");
        let grant = identity.grant().expect("held").generation;
        assert_eq!(identity.confirm(Some(grant), u64::MAX), Ok(()));
        assert_eq!(identity.confirm(None, u64::MAX), Ok(()));
    }
}
