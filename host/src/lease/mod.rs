//! Fleet-unique machine ids, leased in etcd.
//!
//! Each replica claims the lowest free machine id of its layout with a key
//! `<prefix>/<layout>/slots/<id>` bound to an etcd lease, created in a
//! transaction only if absent, and keeps the lease alive. So two live
//! replicas never hold the same id, by construction (not by chance, as with
//! `lease_id % 1021`).
//!
//! If the lease may have expired (no renewal confirmed for a TTL minus a
//! safety margin, counted from when the renewal was *sent*), or etcd says it
//! is gone, the replica withdraws its machine id at once: requests that need
//! an id get 503, others pass. It then claims an id again, first asking
//! etcd whether a lease it could not renew in time is alive after all (then
//! its slot is still its own, and stamping resumes with it). The keeper can
//! be late to notice (the process was frozen, etcd answers slowly), so the
//! request path enforces the same deadline itself, on the boot clock: see
//! [`MachineIdentity::confirm`](crate::MachineIdentity::confirm).
//!
//! A new holder of an id must not repeat an id its previous holder issued in
//! the same millisecond. Each slot has a high-water key
//! `<prefix>/<layout>/high-water/<id>` (not leased, so it outlives holders):
//! while serving, the holder keeps it a TTL plus a margin ahead of its
//! clock (but never more than 10 s plus the margin, whatever the TTL: see
//! `LONGEST_MARK_LEAD`); on a clean stop it writes the exact last
//! millisecond it used. A new holder starts
//! its clock after that mark ([`IdClock::advance_past`](crate::IdClock::advance_past)) instead of waiting.
//! No id past the mark etcd confirmed may leave the process (the request
//! path checks that too), and marks are written only while the slot's key
//! is bound to this holder's lease, and only over the mark read just
//! before (so a write that reaches etcd late cannot undo a later one).
//! A mark no holder could have written (not a number, or more than a day
//! past the furthest a holder sets it) makes a replica skip the slot (or
//! give it back, if the mark changed after the claim) and take another.

mod claim;
mod high_water;
mod hold;
mod status;

pub use status::{LeaseState, LeaseStatus};

use claim::Claim;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::Client;
use snowgate_plugin::SnowflakeLayout;
use tokio::sync::watch;

use crate::boot_clock::BootTime;
use crate::engine::HostServices;

/// Renewals happen this many times per TTL.
const RENEWALS_PER_TTL: u32 = 3;

/// The shortest machine-id lease: renewals come a third of it apart.
pub const MIN_TTL: Duration = Duration::from_secs(3);

/// The longest machine-id lease: a day. A dead replica's machine id stays
/// taken for that long; and a longer one would overflow the TTL etcd is
/// asked for (seconds in an `i64`) and the deadlines counted from it.
pub const MAX_TTL: Duration = Duration::from_secs(86_400);
/// The id is withdrawn this long before the lease could expire.
const SAFETY_MARGIN: Duration = Duration::from_millis(1000);
/// Pause between attempts to reach etcd or claim an id.
const RETRY_PAUSE: Duration = Duration::from_millis(500);
/// How far below [`MAX_LEAD`] ahead of the wall clock a slot's floor must
/// be before the slot is used: room for the first bursts.
const ROOM_FOR_BURSTS: Duration = Duration::from_millis(200);
/// How long a stopping replica waits for etcd to take its last mark and
/// the revocation of its lease: a stop must not hang on an unreachable
/// etcd (the lease then expires after its TTL).
const RELEASE_WAIT: Duration = Duration::from_secs(1);
/// A holder keeps its slot's high-water mark its TTL plus [`SAFETY_MARGIN`]
/// ahead of its clock, but never more than this plus the margin: a holder
/// with a longer TTL raises its mark more often than it renews. So how far
/// ahead any holder's mark can be is one bound for the whole fleet, whatever
/// TTL each replica was given. A replica that takes a slot whose mark etcd
/// lost (restarted empty) must start past every id the slot's last holder
/// may still issue, which its confirmed mark bounds; with marks a holder's
/// own TTL ahead, a replica with a short TTL started inside the ids of one
/// with a long TTL that had not noticed yet (a review measured 12,941
/// shared ids, TTL 30 s against 3 s).
const LONGEST_MARK_LEAD: Duration = Duration::from_secs(10);
/// How far apart two hosts' wall clocks may be for a new holder of a slot
/// whose mark etcd lost to start past every id its last holder may still
/// issue (see `floor_without_mark`). The fleet's clocks must agree within
/// this (NTP or chrony keep them within milliseconds). Without it, the
/// bound had no room at all: a holder fresh on a slot without a mark runs
/// its id clock 8.8 s ahead, so its mark lies 19.8 s ahead of its wall
/// clock, and a successor's floor 20 s ahead of its own; a review measured
/// 118,250 ids issued twice by two replicas whose clocks were 0.9 s apart.
const CLOCK_AGREEMENT: Duration = Duration::from_secs(1);
/// The longest the keeper waits for one etcd member to answer one call
/// (a connect, a renewal, a read or write of a mark) before it gives up on
/// that call and, with several endpoints, tries another member: a third
/// of the TTL, but never more than this, whatever the TTL. A healthy
/// member answers within milliseconds. Waits of a third of the TTL let a
/// review's replica with a TTL of 240 s stop stamping for 99 s behind one
/// hung member, and a hung first endpoint delay its readiness by 40 s.
const MEMBER_ANSWER_WAIT: Duration = Duration::from_secs(2);
/// How many times a holder reads and writes its slot's high-water mark
/// before it gives up on a write because the mark keeps changing in
/// between (see `Keeper::put_mark`).
const MARK_WRITE_ATTEMPTS: u32 = 3;
/// How much further than a holder sets it a slot's high-water mark may lie
/// ahead of this host's wall clock. A holder keeps its mark at most
/// [`LONGEST_MARK_LEAD`] plus [`SAFETY_MARGIN`] ahead of its clock, and
/// bursts add seconds; a mark a day beyond that was not written by a holder
/// whose clock agrees with this one, and ids that far ahead would leave the
/// layout's timestamp range early. Such a slot is skipped.
const MAX_MARK_AHEAD: Duration = Duration::from_secs(24 * 60 * 60);

/// Where and how to lease machine ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    /// etcd endpoints, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Lease time to live: [`MIN_TTL`] to [`MAX_TTL`].
    pub ttl: Duration,
    /// Key prefix, e.g. `/snowgate`.
    pub prefix: String,
}

impl LeaseConfig {
    /// No endpoints yet, a 10 second TTL and the prefix `/snowgate`.
    pub fn default_for_endpoints() -> LeaseConfig {
        LeaseConfig {
            endpoints: Vec::new(),
            ttl: Duration::from_secs(10),
            prefix: "/snowgate".to_string(),
        }
    }
}

/// Runs the lease keeper: claims a machine id, keeps it alive, withdraws it
/// when it may be lost and claims again. Returns its status and a handle to
/// stop it cleanly (revoking the lease).
pub fn start(
    config: LeaseConfig,
    services: HostServices,
) -> anyhow::Result<(Arc<LeaseStatus>, LeaseHandle)> {
    anyhow::ensure!(
        !config.endpoints.is_empty(),
        "--etcd needs at least one endpoint URL"
    );
    anyhow::ensure!(
        (MIN_TTL..=MAX_TTL).contains(&config.ttl),
        "--machine-id-ttl must be between {} and {} seconds (a day), not {:?}",
        MIN_TTL.as_secs(),
        MAX_TTL.as_secs(),
        config.ttl
    );
    let status = Arc::new(LeaseStatus::new(config.clone()));
    services
        .identity
        .withdraw("acquiring a machine id lease from etcd");
    let (stop_tx, stop_rx) = watch::channel(Stop::No);
    let keeper = Keeper {
        config,
        services,
        status: status.clone(),
        stop: stop_rx,
        reported: HashMap::new(),
        next_endpoint: 0,
        current_endpoint: 0,
        granted: None,
        unconfirmed: None,
        marks_sent: std::sync::Mutex::new(high_water::MarksSent::default()),
    };
    let task = tokio::spawn(keeper.run());
    Ok((
        status,
        LeaseHandle {
            stop: stop_tx,
            task,
        },
    ))
}

/// Stops the lease keeper.
pub struct LeaseHandle {
    stop: watch::Sender<Stop>,
    task: tokio::task::JoinHandle<()>,
}

/// Whether the keeper should stop, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    No,
    /// No plugin call is running: the exact last millisecond is final.
    Drained,
    /// Calls may still be running: keep the reserved high-water mark.
    NotDrained,
}

impl LeaseHandle {
    /// Withdraws the machine id and revokes the lease, so the slot is free
    /// at once. With `drained` (no request in flight) it records the exact
    /// last millisecond used as the high-water mark, so a successor starts
    /// right after it; otherwise it keeps the reserved mark.
    pub async fn release(self, drained: bool) {
        let _ = self.stop.send(if drained {
            Stop::Drained
        } else {
            Stop::NotDrained
        });
        let _ = self.task.await;
    }
}

/// What ended a period of holding an id.
enum Ended {
    Stopped,
    /// The lease is gone, or the slot's key is no longer bound to it; why.
    Lost(String),
    /// etcd confirmed no renewal before the deadline: the lease may still
    /// be alive (etcd extends every lease by its TTL when it elects a
    /// leader, after a restart for example); why.
    Unconfirmed(String),
}

struct Keeper {
    config: LeaseConfig,
    services: HostServices,
    status: Arc<LeaseStatus>,
    stop: watch::Receiver<Stop>,
    /// Bad high-water marks already logged as errors: the value, by id.
    reported: HashMap<u32, String>,
    /// The endpoint [`Keeper::connect`] tries first.
    next_endpoint: usize,
    /// The endpoint of the client [`Keeper::connect`] gave last.
    current_endpoint: usize,
    /// The lease of a claim under way, and a client to revoke it with if
    /// the gateway stops before the claim ends.
    granted: Option<(Client, i64)>,
    /// The last hold's lease and id, when it ended for want of a confirmed
    /// renewal: the next claim tries to [resume](Keeper::resume) it first.
    unconfirmed: Option<Unconfirmed>,
    /// The high-water marks this keeper sent to etcd: a higher one found
    /// there is someone else's, and is kept (see `Keeper::put_mark`).
    marks_sent: std::sync::Mutex<high_water::MarksSent>,
}

/// A lease whose renewal etcd did not confirm in time, and the machine id
/// it held: etcd may still hold both.
struct Unconfirmed {
    /// A client to revoke the lease with if the gateway stops first.
    client: Client,
    lease_id: i64,
    machine_id: u32,
}

/// When a request to etcd was sent, on both clocks: `Instant` for the
/// keeper's timers, the [boot clock](BootTime) for the deadline the
/// request path enforces (it counts a suspend, as etcd's clock does).
#[derive(Debug, Clone, Copy)]
struct Sent {
    at: Instant,
    boot: BootTime,
}

impl Sent {
    fn now() -> Sent {
        Sent {
            boot: BootTime::now(),
            at: Instant::now(),
        }
    }
}

/// Renews `lease_id` once, waiting at most `within`; returns when the
/// renewal was sent. An error if etcd does not confirm the lease alive in
/// time (opening etcd-client's keep-alive stream sends one renewal and
/// reads its answer; a TTL of 0 or less is an error).
async fn renew_once(client: &mut Client, lease_id: i64, within: Duration) -> anyhow::Result<Sent> {
    let sent = Sent::now();
    match tokio::time::timeout(within, client.lease_keep_alive(lease_id)).await {
        Ok(Ok(_stream)) => Ok(sent),
        Ok(Err(e)) => {
            Err(anyhow::Error::new(e).context("renewing the lease while claiming a machine id"))
        }
        Err(_) => anyhow::bail!(
            "renewing the lease while claiming a machine id: no answer within {} ms",
            within.as_millis()
        ),
    }
}

/// `work`, unless the gateway is told to stop first (then `None`).
async fn unless_stopped<T>(
    stop: &mut watch::Receiver<Stop>,
    work: impl std::future::Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        done = work => Some(done),
        _ = stop.changed() => None,
    }
}

impl Keeper {
    fn layout(&self) -> SnowflakeLayout {
        self.services.identity.layout()
    }

    fn slots_prefix(&self) -> String {
        format!(
            "{}/{}/slots/",
            self.config.prefix.trim_end_matches('/'),
            self.layout().name()
        )
    }

    fn high_water_prefix(&self) -> String {
        format!(
            "{}/{}/high-water/",
            self.config.prefix.trim_end_matches('/'),
            self.layout().name()
        )
    }

    fn high_water_key(&self, id: u32) -> String {
        format!("{}{id}", self.high_water_prefix())
    }

    fn stopping(&self) -> bool {
        *self.stop.borrow() != Stop::No
    }

    async fn pause(&mut self, how_long: Duration) {
        let _ = tokio::time::timeout(how_long, self.stop.changed()).await;
    }

    async fn run(mut self) {
        let mut stop = self.stop.clone();
        while !self.stopping() {
            // A stop does not wait for a claim that waits on etcd; a lease
            // it was granted is revoked if etcd answers within a second (or
            // runs out after its TTL), which frees a slot claimed under it.
            let Some(claimed) = unless_stopped(&mut stop, self.claim()).await else {
                break;
            };
            self.granted = None;
            let Claim {
                mut client,
                lease_id,
                machine_id,
                alive_since,
            } = match claimed {
                Ok(claim) => claim,
                Err(_) if self.stopping() => break,
                Err(e) => {
                    // The endpoint may be what failed (it can hang after
                    // answering the connect): the next claim tries the
                    // others first.
                    self.try_others_first();
                    let message = format!("{e:#}");
                    // Retried twice a second: a failure is logged as a
                    // warning when it is new, and at debug level after.
                    if self.status.snapshot().last_error.as_deref() == Some(message.as_str()) {
                        tracing::debug!(error = %message, "claiming a machine id in etcd failed again; retrying");
                    } else {
                        tracing::warn!(error = %message, "claiming a machine id in etcd failed; retrying");
                    }
                    self.waiting(message);
                    self.pause(RETRY_PAUSE).await;
                    continue;
                }
            };
            match self
                .hold(&mut client, lease_id, machine_id, alive_since)
                .await
            {
                Ended::Stopped => {
                    self.release(&mut client, lease_id, machine_id).await;
                    return;
                }
                Ended::Lost(reason) => {
                    tracing::error!(machine_id, reason = %reason, "machine id lease lost; stamping stopped until a new claim");
                    self.lost(reason);
                    // The old lease may still be alive in etcd: let go of it
                    // if etcd answers, so the slot frees up sooner.
                    let _ = tokio::time::timeout(RETRY_PAUSE, client.lease_revoke(lease_id)).await;
                }
                Ended::Unconfirmed(reason) => {
                    // Not lost yet: the next claim first asks etcd whether
                    // the lease is alive.
                    tracing::error!(machine_id, reason = %reason, "machine id lease unconfirmed; stamping stopped until etcd confirms it alive (stamping then resumes with the same id) or a new claim succeeds");
                    self.lost(reason);
                    // Kept, not revoked: if etcd confirms the lease alive
                    // when it answers again, the replica stamps with the
                    // same id at once (see `Keeper::resume`).
                    self.unconfirmed = Some(Unconfirmed {
                        client,
                        lease_id,
                        machine_id,
                    });
                }
            }
        }
        self.services.identity.withdraw("the gateway is stopping");
        // A lease granted for a claim under way, or kept to resume: let go
        // of it if etcd answers within a second (it runs out after its TTL
        // otherwise), which frees a slot bound to it.
        let leftovers = [
            self.granted.take(),
            self.unconfirmed.take().map(|u| (u.client, u.lease_id)),
        ];
        for (mut client, lease_id) in leftovers.into_iter().flatten() {
            let _ = tokio::time::timeout(RELEASE_WAIT, client.lease_revoke(lease_id)).await;
        }
        self.status.update(|s| s.state = LeaseState::Released);
    }

    /// Why no machine id is held yet, as a claim goes on (a claim that
    /// failed, every slot taken, a slot's floor waited for): in the lease's
    /// `last_error`, and as why the machine id is withdrawn, which
    /// `/readyz` and `/status`'s `machine_id_error` say. Those kept the
    /// first reason, "acquiring", or the loss before it, for as long as
    /// the claim went on.
    fn waiting(&self, why: String) {
        self.services
            .identity
            .withdraw(format!("acquiring a machine id lease from etcd: {why}"));
        self.status.update(|s| s.last_error = Some(why));
    }

    /// A hold ended for `reason` without a stop: withdraws the machine id
    /// (requests that need one get 503) until a claim succeeds.
    fn lost(&self, reason: String) {
        self.services
            .identity
            .withdraw(format!("the machine id lease was lost ({reason})"));
        self.status.losses.fetch_add(1, Ordering::Relaxed);
        self.status.update(|s| {
            s.state = LeaseState::Lost;
            s.machine_id = None;
            s.lease_id = None;
            s.last_error = Some(reason);
        });
    }

    /// Until when a lease renewed at `sent` is known alive, less the
    /// safety margin.
    fn alive_until(&self, sent: Sent) -> BootTime {
        sent.boot.after(self.config.ttl - SAFETY_MARGIN)
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TTL out of range is refused before anything starts: one too long
    /// would overflow the seconds asked of etcd and the deadlines.
    #[test]
    fn a_ttl_out_of_range_is_refused() {
        let services = HostServices {
            clock: Arc::new(crate::IdClock::system()),
            identity: Arc::new(crate::MachineIdentity::unassigned(
                snowgate_plugin::SnowflakeLayout::TrtllmV1,
                "a test",
            )),
        };
        for ttl in [
            Duration::from_secs(2),
            MAX_TTL + Duration::from_secs(1),
            Duration::from_secs(u64::MAX),
        ] {
            let config = LeaseConfig {
                endpoints: vec!["http://127.0.0.1:1".to_string()],
                ttl,
                ..LeaseConfig::default_for_endpoints()
            };
            let error = start(config, services.clone())
                .err()
                .unwrap_or_else(|| panic!("{ttl:?} was taken"));
            assert!(
                error.to_string().contains("between 3 and 86400 seconds"),
                "{error}"
            );
        }
    }
}
