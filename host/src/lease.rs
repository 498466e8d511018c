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
//! [`LONGEST_MARK_LEAD`]); on a clean stop it writes the exact last
//! millisecond it used. A new holder starts
//! its clock after that mark ([`IdClock::advance_past`](crate::IdClock::advance_past)) instead of waiting.
//! No id past the mark etcd confirmed may leave the process (the request
//! path checks that too), and marks are written only while the slot's key
//! is bound to this holder's lease, and only over the mark read just
//! before (so a write that reaches etcd late cannot undo a later one).
//! A mark no holder could have written (not a number, or more than a day
//! past the furthest a holder sets it) makes a replica skip the slot (or
//! give it back, if the mark changed after the claim) and take another.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, LeaseKeepAliveStream, LeaseKeeper,
    PutOptions, Txn, TxnOp, TxnOpResponse,
};
use snowgate_plugin::SnowflakeLayout;
use tokio::sync::watch;

use crate::boot_clock::BootTime;
use crate::clock::MAX_LEAD;
use crate::engine::HostServices;
use crate::identity::LeaseBounds;
use crate::utc::{format_millis, millis_of};

/// Renewals happen this many times per TTL.
const RENEWALS_PER_TTL: u32 = 3;
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
    /// Lease time to live; at least 3 seconds.
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

/// The lease as `/status` and `/metrics` show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseState {
    /// Looking for etcd or a free id.
    Acquiring,
    /// Holding a machine id.
    Held,
    /// The lease was lost; the id is withdrawn until a new claim succeeds.
    Lost,
    /// Stopped cleanly; the lease was revoked.
    Released,
}

/// Shared, observable state of the lease keeper.
#[derive(Debug)]
pub struct LeaseStatus {
    config: LeaseConfig,
    inner: Mutex<StatusInner>,
    losses: AtomicU64,
    acquisitions: AtomicU64,
    /// Leases taken back after etcd confirmed no renewal in time (see
    /// `Keeper::resume`).
    resumptions: AtomicU64,
}

#[derive(Debug, Clone)]
struct StatusInner {
    state: LeaseState,
    machine_id: Option<u32>,
    lease_id: Option<i64>,
    last_renewed: Option<SystemTime>,
    last_error: Option<String>,
}

impl LeaseStatus {
    fn update(&self, change: impl FnOnce(&mut StatusInner)) {
        change(&mut self.inner.lock().unwrap_or_else(|p| p.into_inner()));
    }

    fn snapshot(&self) -> StatusInner {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The current state.
    pub fn state(&self) -> LeaseState {
        self.snapshot().state
    }

    /// Leases lost so far, and machine ids acquired so far.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.losses.load(Ordering::Relaxed),
            self.acquisitions.load(Ordering::Relaxed),
        )
    }

    /// The `lease` object of `/status`.
    pub fn to_json(&self) -> serde_json::Value {
        let s = self.snapshot();
        let (losses, acquisitions) = self.counts();
        serde_json::json!({
            "state": match s.state {
                LeaseState::Acquiring => "acquiring",
                LeaseState::Held => "held",
                LeaseState::Lost => "lost",
                LeaseState::Released => "released",
            },
            "machine_id": s.machine_id,
            "lease_id": s.lease_id,
            "last_renewed": s.last_renewed.map(|t| format_millis(millis_of(t))),
            "last_error": s.last_error,
            "ttl_secs": self.config.ttl.as_secs(),
            "etcd": self.config.endpoints,
            "prefix": self.config.prefix,
            "losses": losses,
            "acquisitions": acquisitions,
            "resumptions": self.resumptions.load(Ordering::Relaxed),
        })
    }

    /// Lease metrics in Prometheus text format.
    pub fn render_metrics(&self) -> String {
        let (losses, acquisitions) = self.counts();
        let resumptions = self.resumptions.load(Ordering::Relaxed);
        let held = u8::from(self.state() == LeaseState::Held);
        format!(
            "# HELP snowgate_lease_losses_total Machine id leases lost (id withdrawn).\n\
             # TYPE snowgate_lease_losses_total counter\n\
             snowgate_lease_losses_total {losses}\n\
             # HELP snowgate_lease_acquisitions_total Machine ids claimed in etcd.\n\
             # TYPE snowgate_lease_acquisitions_total counter\n\
             snowgate_lease_acquisitions_total {acquisitions}\n\
             # HELP snowgate_lease_resumptions_total Machine id leases taken back after etcd confirmed no renewal in time.\n\
             # TYPE snowgate_lease_resumptions_total counter\n\
             snowgate_lease_resumptions_total {resumptions}\n\
             # HELP snowgate_lease_held Whether a machine id lease is held now.\n\
             # TYPE snowgate_lease_held gauge\n\
             snowgate_lease_held {held}\n"
        )
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
        config.ttl >= Duration::from_secs(3),
        "--machine-id-ttl must be at least 3 seconds, not {}",
        config.ttl.as_secs()
    );
    let status = Arc::new(LeaseStatus {
        config: config.clone(),
        inner: Mutex::new(StatusInner {
            state: LeaseState::Acquiring,
            machine_id: None,
            lease_id: None,
            last_renewed: None,
            last_error: None,
        }),
        losses: AtomicU64::new(0),
        acquisitions: AtomicU64::new(0),
        resumptions: AtomicU64::new(0),
    });
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

/// A high-water mark's value: milliseconds since the Unix epoch, as
/// decimal text, no later than `furthest`.
fn parse_high_water(key: &str, value: &[u8], furthest: u64) -> Result<u64, String> {
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
fn quoted(value: &[u8]) -> String {
    let text = String::from_utf8_lossy(value);
    let shown: String = text.chars().take(64).collect();
    let more = if shown.len() < text.len() { "..." } else { "" };
    format!("{shown:?}{more}")
}

/// Why a keep-alive stream could not be reopened.
enum Reopen {
    /// etcd answered that the lease does not exist.
    Gone,
    /// No endpoint answered; why.
    Failed(String),
}

impl From<etcd_client::Error> for Reopen {
    fn from(error: etcd_client::Error) -> Reopen {
        if lease_not_found(&error) {
            Reopen::Gone
        } else {
            Reopen::Failed(error.to_string())
        }
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
}

/// A lease whose renewal etcd did not confirm in time, and the machine id
/// it held: etcd may still hold both.
struct Unconfirmed {
    /// A client to revoke the lease with if the gateway stops first.
    client: Client,
    lease_id: i64,
    machine_id: u32,
}

/// The slots a claim may try, from one read.
#[derive(Default)]
struct Candidates {
    /// Free slots whose high-water mark is not bad, lowest first.
    free: Vec<u32>,
    /// Free slots skipped for a bad high-water mark.
    skipped: Vec<u32>,
}

/// A machine id claimed under a lease.
struct Claim {
    client: Client,
    lease_id: i64,
    machine_id: u32,
    /// When the last renewal etcd confirmed was sent, or the grant asked
    /// for: the lease expires no sooner than a TTL after this.
    alive_since: Sent,
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

/// What an attempt to raise the mark while holding the slot came to.
enum Raise {
    Done,
    /// The member answered with an error (etcd refuses writes: out of
    /// space, for example); another member would answer the same.
    Failed,
    /// The member did not answer in time, or the connection to it failed.
    Unanswered,
    /// The slot is no longer ours.
    Lost(Ended),
}

/// What raising a slot's high-water mark came to.
enum Reserved {
    /// etcd holds the new mark.
    Raised(u64),
    /// The slot's key is no longer bound to this replica's lease.
    NotOurs,
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

/// `ids` as text, the first few then how many more.
fn list_ids(ids: &[u32]) -> String {
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
                    self.status.update(|s| s.last_error = Some(message));
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
                    self.lost(machine_id, reason);
                    // The old lease may still be alive in etcd: let go of it
                    // if etcd answers, so the slot frees up sooner.
                    let _ = tokio::time::timeout(RETRY_PAUSE, client.lease_revoke(lease_id)).await;
                }
                Ended::Unconfirmed(reason) => {
                    self.lost(machine_id, reason);
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

    /// A hold ended for `reason` without a stop: withdraws the machine id
    /// (requests that need one get 503) until a claim succeeds.
    fn lost(&self, machine_id: u32, reason: String) {
        tracing::error!(machine_id, reason = %reason, "machine id lease lost; stamping stopped until a new claim");
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

    /// Connects, grants a lease and claims the lowest free id; sets the
    /// clock past the slot's high-water mark and reserves ahead. Returns
    /// the client, the lease, the id, and when the last renewal etcd
    /// confirmed was sent: the lease expires no sooner than a TTL after it.
    /// When no slot is free, no lease is granted: a replica waiting for
    /// one only reads.
    async fn claim(&mut self) -> anyhow::Result<Claim> {
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
    async fn resume(
        &mut self,
        client: &mut Client,
        earlier: Unconfirmed,
    ) -> anyhow::Result<Option<Claim>> {
        let (lease_id, id) = (earlier.lease_id, earlier.machine_id);
        // Revoked if the gateway stops during the attempt.
        self.granted = Some((client.clone(), lease_id));
        let alive_since = match renew_once(client, lease_id, self.call_wait()).await {
            Ok(sent) => sent,
            Err(e) if gone(&e) => {
                tracing::info!(
                    machine_id = id,
                    lease_id,
                    "the lease etcd did not confirm in time is gone; claiming a machine id anew"
                );
                return Ok(None);
            }
            Err(e) => {
                self.unconfirmed = Some(earlier);
                return Err(e.context(format!(
                    "checking whether the lease of machine id {id} is still alive"
                )));
            }
        };
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
            .context("the resumed machine id is out of range")?;
        self.status.resumptions.fetch_add(1, Ordering::Relaxed);
        self.status.update(|s| {
            s.state = LeaseState::Held;
            s.machine_id = Some(id);
            s.lease_id = Some(lease_id);
            s.last_renewed = Some(SystemTime::now());
            s.last_error = None;
        });
        tracing::info!(machine_id = id, lease_id, "etcd confirmed the machine id lease alive after all; stamping resumed with the same id");
        Ok(Some(Claim {
            client: client.clone(),
            lease_id,
            machine_id: id,
            alive_since,
        }))
    }

    /// A client of one etcd endpoint that answers: the endpoints are tried
    /// in turn, from the one after the last that failed. One endpoint at a
    /// time, because etcd-client's balanced channel over several goes on
    /// sending requests to one that is down, so that with one member of
    /// three down, most claims failed and the rest were lost at once. Any
    /// member serves every call (leases are the cluster's).
    async fn connect(&mut self) -> anyhow::Result<Client> {
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
    fn call_wait(&self) -> Duration {
        (self.config.ttl / RENEWALS_PER_TTL).min(MEMBER_ANSWER_WAIT)
    }

    /// Makes the next [`Keeper::connect`] try the current endpoint last:
    /// it failed, and may hang rather than refuse.
    fn try_others_first(&mut self) {
        self.next_endpoint = self.current_endpoint + 1;
    }

    /// The slots a claim may try, from one read of the claimed slots and
    /// one of the marks: a slot whose mark is bad now is skipped without a
    /// claim (and reported). A claimed slot's mark is read again, so a mark
    /// written in between is still seen.
    async fn candidates(&mut self, client: &mut Client) -> anyhow::Result<Candidates> {
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
    fn none_free(&mut self, mut candidates: Candidates) -> anyhow::Error {
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
            return anyhow::anyhow!(
                "every machine id of layout {} (0..={}) is taken",
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
    async fn claim_under(
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
            self.services
                .identity
                .assign_leased(
                    id,
                    LeaseBounds {
                        alive_until: self.alive_until(*alive_since),
                        ceiling_millis: ceiling,
                        raise_from_millis: self.raise_from(ceiling),
                    },
                )
                .context("the claimed machine id is out of range")?;
            self.reported.clear();
            self.status.acquisitions.fetch_add(1, Ordering::Relaxed);
            self.status.update(|s| {
                s.state = LeaseState::Held;
                s.machine_id = Some(id);
                s.lease_id = Some(lease_id);
                s.last_renewed = Some(SystemTime::now());
                s.last_error = None;
            });
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
    fn within_reach(&self, mark: Option<u64>) -> Result<Option<u64>, (String, String)> {
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
    async fn wait_for_the_floor(
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
        self.status.update(|s| s.last_error = Some(wait));
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
    async fn bad_marks(
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
    fn furthest_mark(&self) -> u64 {
        millis_of(SystemTime::now())
            .saturating_add(fleet_mark_ahead())
            .saturating_add(MAX_MARK_AHEAD.as_millis() as u64)
    }

    /// Logs a bad high-water mark as an error when it is new (a slot not
    /// reported, or a value it did not hold before), and at debug level
    /// after that: a replica that finds no good slot retries every half
    /// second.
    fn report_bad_mark(&mut self, id: u32, value: &str, problem: &str) {
        let advice = format!(
            "{problem}: skipping machine id {id}; delete the key, or set it to the last \
             millisecond any holder of id {id} may have used"
        );
        if self.reported.get(&id).map(String::as_str) != Some(value) {
            self.reported.insert(id, value.to_string());
            tracing::error!(machine_id = id, "{advice}");
        } else {
            tracing::debug!(machine_id = id, "{advice}");
        }
    }

    /// Reads the slot's high-water mark: none, a mark, or (the inner error)
    /// a value no holder could have written, quoted, with what is wrong
    /// with it (naming the key).
    async fn read_high_water(
        &self,
        client: &mut Client,
        id: u32,
    ) -> anyhow::Result<Result<Option<u64>, (String, String)>> {
        let key = self.high_water_key(id);
        let response = client
            .get(key.as_str(), None)
            .await
            .context("reading the slot's high-water mark")?;
        Ok(match response.kvs().first() {
            None => Ok(None),
            Some(kv) => parse_high_water(&key, kv.value(), self.furthest_mark())
                .map(Some)
                .map_err(|problem| (quoted(kv.value()), problem)),
        })
    }

    /// How far ahead of the clock this holder keeps its high-water mark:
    /// its TTL and [`SAFETY_MARGIN`], at most [`fleet_mark_ahead`].
    fn mark_ahead(&self) -> u64 {
        (self.config.ttl.min(LONGEST_MARK_LEAD) + SAFETY_MARGIN).as_millis() as u64
    }

    /// Until when a lease renewed at `sent` is known alive, less the
    /// safety margin.
    fn alive_until(&self, sent: Sent) -> BootTime {
        sent.boot.after(self.config.ttl - SAFETY_MARGIN)
    }

    /// From which millisecond ids count as near a mark of `ceiling`: half
    /// the lead below it.
    fn raise_from(&self, ceiling: u64) -> u64 {
        ceiling.saturating_sub(self.mark_ahead() / 2)
    }

    /// Raises the slot's high-water mark past every millisecond this holder
    /// may use before its lease could expire (its ids start after `floor`
    /// at the earliest), and returns it; only while the slot's key is bound
    /// to `lease_id`, so that a holder whose lease ran out cannot lower a
    /// successor's mark.
    async fn reserve(
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
        let mark = (now.max(last) + self.mark_ahead()).max(confirmed);
        if self.put_mark(client, id, lease_id, mark).await? {
            Ok(Reserved::Raised(mark))
        } else {
            Ok(Reserved::NotOurs)
        }
    }

    /// Writes `mark` as slot `id`'s high-water mark if the slot's key is
    /// bound to `lease_id`; whether it was.
    ///
    /// The write also requires the mark to be as it was read just before:
    /// a write that reaches etcd late (sent to a member that froze, and
    /// given up on) then finds a later one in its place and is refused,
    /// instead of putting back a lower mark after a higher one had let ids
    /// past it leave. When the mark did change in between, which only this
    /// holder can have done (a write of its own that etcd took but never
    /// confirmed), it is read again and written over.
    async fn put_mark(
        &self,
        client: &mut Client,
        id: u32,
        lease_id: i64,
        mark: u64,
    ) -> anyhow::Result<bool> {
        let slot = format!("{}{id}", self.slots_prefix());
        let key = self.high_water_key(id);
        for _ in 0..MARK_WRITE_ATTEMPTS {
            let read = client
                .get(key.as_str(), None)
                .await
                .context("reading the slot's high-water mark before writing it")?;
            // A key that does not exist has revision 0, and compares so.
            let revision = read.kvs().first().map_or(0, |kv| kv.mod_revision());
            let txn = Txn::new()
                .when(vec![
                    Compare::lease(slot.as_str(), CompareOp::Equal, lease_id),
                    Compare::mod_revision(key.as_str(), CompareOp::Equal, revision),
                ])
                .and_then(vec![TxnOp::put(key.as_str(), mark.to_string(), None)])
                .or_else(vec![TxnOp::get(slot.as_str(), None)]);
            let response = client
                .txn(txn)
                .await
                .context("writing the slot's high-water mark")?;
            if response.succeeded() {
                return Ok(true);
            }
            let still_ours = response.op_responses().iter().any(|op| {
                matches!(op, TxnOpResponse::Get(slot)
                    if slot.kvs().first().is_some_and(|kv| kv.lease() == lease_id))
            });
            if !still_ours {
                return Ok(false);
            }
        }
        anyhow::bail!(
            "the high-water mark {key} changed between reading and writing it {MARK_WRITE_ATTEMPTS} \
             times in a row: something other than its holder is writing it"
        )
    }

    /// Keeps the lease alive, and the slot's high-water mark ahead of the
    /// ids, until stopped or until the lease may be lost. `alive_since` is
    /// when the last renewal etcd confirmed was sent, or the grant asked
    /// for. Every renewal and mark etcd confirms extends the bounds the
    /// request path enforces (see [`MachineIdentity::confirm`](crate::MachineIdentity::confirm)),
    /// so that nothing here being late can let an id out that is no longer
    /// this replica's to issue.
    async fn hold(
        &mut self,
        client: &mut Client,
        lease_id: i64,
        id: u32,
        alive_since: Sent,
    ) -> Ended {
        let ttl = self.config.ttl;
        let every = ttl / RENEWALS_PER_TTL;
        let identity = self.services.identity.clone();
        // Every wait on etcd below also ends when the gateway stops.
        let mut stop = self.stop.clone();
        // The lease lives at least until a TTL after the last renewal that
        // etcd confirmed, counted from when it was sent; before the first,
        // a TTL after the claim's last renewal or grant (not after the
        // claim's end, which can be a while later).
        let mut confirmed_at = alive_since.at;
        let unconfirmed = || {
            Ended::Unconfirmed(format!(
                "no renewal confirmed by etcd within {} s",
                ttl.as_secs()
            ))
        };
        // Opening the stream renews once and waits for etcd to confirm it.
        // Retried until the deadline, through the next endpoint when one
        // fails or does not answer within a call's wait (the client's
        // timeout: the member may have gone since the claim).
        let mut first = true;
        let (mut keeper, mut responses) = loop {
            let attempt = Sent::now();
            let within = (confirmed_at + ttl - SAFETY_MARGIN).saturating_duration_since(attempt.at);
            // First through the endpoint the claim just used.
            let opening = tokio::time::timeout(within, async {
                if std::mem::take(&mut first) {
                    return client
                        .lease_keep_alive(lease_id)
                        .await
                        .map_err(Reopen::from);
                }
                self.reopen(client, lease_id).await
            });
            let Some(opened_stream) = unless_stopped(&mut stop, opening).await else {
                return Ended::Stopped;
            };
            let failure = match opened_stream {
                Ok(Ok(pair)) => {
                    confirmed_at = self.renewed(attempt);
                    break pair;
                }
                Ok(Err(Reopen::Gone)) => return Ended::Lost(LEASE_NOT_FOUND.to_string()),
                Ok(Err(Reopen::Failed(e))) => e,
                Err(_) => return unconfirmed(),
            };
            tracing::warn!(error = %failure, "opening the keep-alive stream failed; retrying until the deadline");
            let pause = tokio::time::sleep(RETRY_PAUSE.min(within));
            if unless_stopped(&mut stop, pause).await.is_none() {
                return Ended::Stopped;
            }
        };
        // Whether a request for a higher mark is answered before the next
        // renewal: not after a failed attempt, so that requests refused at
        // the mark while etcd refuses writes do not each cost a write.
        let mut raise_on_request = true;
        // When to raise the mark even if nothing asks: half its lead after
        // the last attempt. A renewal raises it too, and comes sooner with a
        // TTL up to `LONGEST_MARK_LEAD`; with a longer one, renewals alone
        // would let the wall clock reach the mark between them, and the
        // first request after a quiet spell would be refused at it.
        let raise_every = Duration::from_millis(self.mark_ahead() / 2);
        let mut raise_at = Instant::now() + raise_every;
        // When to renew next: moved only by a renewal attempt, so that
        // requests to raise the mark cannot put renewals off.
        let mut renew_at = confirmed_at + every;
        // Whether the keep-alive stream is open, as far as is known. It is
        // watched between renewals too: etcd going away (a restart, maybe
        // with its data lost) breaks it, and the lease is then checked at
        // once and every half second, not only at the next renewal. With
        // a long TTL, a holder whose lease went with etcd's data would
        // otherwise go on stamping for up to a third of it, while a
        // replica with a shorter TTL may already hold its slot.
        let mut stream_open = true;
        // Whether renewals are failing (warned once per episode).
        let mut failing = false;
        // How long a renewal on the open stream is waited for.
        let renewal_wait = (every / 2).min(self.call_wait());
        loop {
            let deadline = confirmed_at + ttl - SAFETY_MARGIN;
            let next = renew_at.min(deadline);
            let renew = tokio::select! {
                _ = stop.changed() => return Ended::Stopped,
                () = tokio::time::sleep_until(next.into()) => true,
                () = tokio::time::sleep_until(raise_at.into()) => false,
                // Ids came near the mark before the next renewal would
                // raise it (a burst ran the id clock ahead): raise it now.
                () = identity.ceiling_near(), if raise_on_request => false,
                // Nothing is asked between renewals: an answer now is a
                // late one to a renewal given up on (not counted), and
                // an end or an error is the stream breaking.
                message = responses.message(), if stream_open => match message {
                    Ok(Some(_late)) => continue,
                    Ok(None) | Err(_) => {
                        stream_open = false;
                        true
                    }
                },
            };
            if Instant::now() >= deadline {
                return unconfirmed();
            }
            if renew {
                let sent = Sent::now();
                renew_at = sent.at + every;
                // Waits half the time between renewals at most, and a
                // call's wait, so that a member that stopped answering
                // leaves time to renew through another before the deadline
                // (with the shortest TTL, 3 s, the deadline is a second
                // after the next renewal is due).
                let wait = deadline
                    .saturating_duration_since(sent.at)
                    .min(renewal_wait);
                // A stream that broke or went unanswered is not used again:
                // an answer still queued on it belongs to an earlier renewal
                // and would be counted for this one. It is reopened instead.
                let renewal = tokio::time::timeout(wait, async {
                    if !stream_open {
                        return Ok(None);
                    }
                    keeper.keep_alive().await?;
                    responses.message().await
                });
                let Some(renewed) = unless_stopped(&mut stop, renewal).await else {
                    return Ended::Stopped;
                };
                let failure = match renewed {
                    Ok(Ok(Some(response))) if response.ttl() > 0 => {
                        failing = false;
                        confirmed_at = self.renewed(sent);
                        self.status
                            .update(|s| s.last_renewed = Some(SystemTime::now()));
                        None
                    }
                    Ok(Ok(Some(_))) => {
                        return Ended::Lost(
                            "etcd says the lease expired or was revoked".to_string(),
                        )
                    }
                    Ok(Ok(None)) if !stream_open => Some("the keep-alive stream broke".to_string()),
                    Ok(Ok(None)) => Some("etcd closed the keep-alive stream".to_string()),
                    Ok(Err(e)) => Some(e.to_string()),
                    Err(_) => Some(format!("no answer within {} ms", wait.as_millis())),
                };
                if let Some(failure) = failure {
                    // Retried every half second while etcd is away: one
                    // warning when it starts, the rest at debug level.
                    if std::mem::replace(&mut failing, true) {
                        tracing::debug!(error = %failure, "renewing the lease failed again; retrying until the deadline");
                    } else {
                        tracing::warn!(error = %failure, "renewing the lease failed; retrying until the deadline");
                    }
                    stream_open = false;
                    // Tried again soon, not a third of the TTL later.
                    renew_at = Instant::now() + RETRY_PAUSE;
                    // Reopening renews once and waits for etcd to confirm
                    // it, through another endpoint if this one fails.
                    let reopening = self.reopen_by(client, lease_id, deadline);
                    let Some(reopened) = unless_stopped(&mut stop, reopening).await else {
                        return Ended::Stopped;
                    };
                    match reopened {
                        Err(lost) => return lost,
                        Ok(Some((pair, at))) => {
                            (keeper, responses) = pair;
                            stream_open = true;
                            failing = false;
                            confirmed_at = at;
                            renew_at = at + every;
                        }
                        Ok(None) => {}
                    }
                    continue;
                }
            }
            // After a confirmed renewal, or when ids came near the mark:
            // raise it, waiting no later than the next renewal is due (which
            // must not wait on a write).
            let until = renew_at.min(confirmed_at + ttl - SAFETY_MARGIN);
            let raising = self.raise_mark(client, id, lease_id, until);
            let Some(raised) = unless_stopped(&mut stop, raising).await else {
                return Ended::Stopped;
            };
            raise_at = Instant::now() + raise_every;
            raise_on_request = match raised {
                Raise::Done => true,
                Raise::Failed => false,
                // The member answers renewals but not writes: its disk may
                // have stalled (a follower forwards a renewal to the
                // leader, but answers a write only once it has applied it
                // itself). Renewals alone would keep this replica on it,
                // refusing ids at the old mark, for as long as the stall
                // lasts: the keeper moves to another member, and raises the
                // mark through it at once.
                Raise::Unanswered if self.config.endpoints.len() > 1 => {
                    tracing::warn!(
                        "the etcd member did not answer a high-water mark write in time; \
                         moving to another member"
                    );
                    // Moving renews the lease; if no other member answers
                    // in time, the stream on this one is still open, and
                    // the move leaves a renewal's wait to renew on it.
                    let by = (confirmed_at + ttl - SAFETY_MARGIN)
                        .checked_sub(renewal_wait)
                        .unwrap_or(confirmed_at);
                    let moving = self.reopen_by(client, lease_id, by);
                    let Some(moved) = unless_stopped(&mut stop, moving).await else {
                        return Ended::Stopped;
                    };
                    match moved {
                        Err(lost) => return lost,
                        Ok(Some((pair, at))) => {
                            (keeper, responses) = pair;
                            stream_open = true;
                            failing = false;
                            confirmed_at = at;
                            renew_at = at + every;
                            raise_at = Instant::now();
                        }
                        Ok(None) => {}
                    }
                    false
                }
                Raise::Unanswered => false,
                Raise::Lost(lost) => return lost,
            };
        }
    }

    /// Reopens the keep-alive stream (see [`Keeper::reopen`]), waiting no
    /// later than `deadline`. The stream, and when the renewal that opened
    /// it was sent (see [`Keeper::renewed`]); `None` if no member confirmed
    /// the renewal in time; the end of the hold if etcd says the lease is
    /// gone.
    async fn reopen_by(
        &mut self,
        client: &mut Client,
        lease_id: i64,
        deadline: Instant,
    ) -> Result<Option<((LeaseKeeper, LeaseKeepAliveStream), Instant)>, Ended> {
        let reopened = Sent::now();
        let within = deadline.saturating_duration_since(reopened.at);
        match tokio::time::timeout(within, self.reopen(client, lease_id)).await {
            Ok(Ok(pair)) => Ok(Some((pair, self.renewed(reopened)))),
            Ok(Err(Reopen::Gone)) => Err(Ended::Lost(LEASE_NOT_FOUND.to_string())),
            Ok(Err(Reopen::Failed(e))) => {
                tracing::debug!(error = %e, "reopening the keep-alive stream failed");
                Ok(None)
            }
            Err(_timeout) => Ok(None),
        }
    }

    /// Reopens the keep-alive stream for `lease_id` (which renews it once).
    /// With one endpoint, through `client`. With several, through the first
    /// that answers, the others before the current one (which just failed,
    /// and may hang rather than refuse: a call on it would wait for its
    /// timeout, and the deadline would come before another was tried); the
    /// new client replaces `client`.
    async fn reopen(
        &mut self,
        client: &mut Client,
        lease_id: i64,
    ) -> Result<(LeaseKeeper, LeaseKeepAliveStream), Reopen> {
        if self.config.endpoints.len() < 2 {
            return client
                .lease_keep_alive(lease_id)
                .await
                .map_err(Reopen::from);
        }
        self.try_others_first();
        let mut other = self
            .connect()
            .await
            .map_err(|e| Reopen::Failed(format!("{e:#}")))?;
        let pair = other.lease_keep_alive(lease_id).await?;
        *client = other;
        Ok(pair)
    }

    /// A renewal etcd confirmed, sent at `sent`: the request path may use
    /// the id until a TTL (less the margin) after it. Returns when it was
    /// sent, by the keeper's clock.
    fn renewed(&self, sent: Sent) -> Instant {
        self.services.identity.lease_renewed(self.alive_until(sent));
        sent.at
    }

    /// Raises the slot's high-water mark, waiting at most until `deadline`
    /// (no later than the next renewal is due), and lets the request path
    /// use milliseconds up to it. A mark that could not be written is
    /// logged: ids stop at the old one (the request path refuses later
    /// ones) until a later attempt succeeds.
    async fn raise_mark(
        &self,
        client: &mut Client,
        id: u32,
        lease_id: i64,
        deadline: Instant,
    ) -> Raise {
        let within = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(within, self.reserve(client, id, lease_id, 0)).await {
            Ok(Ok(Reserved::Raised(mark))) => {
                self.services
                    .identity
                    .ceiling_raised(mark, self.raise_from(mark));
                Raise::Done
            }
            Ok(Ok(Reserved::NotOurs)) => Raise::Lost(Ended::Lost(format!(
                "the key of machine id {id} is no longer bound to this replica's lease"
            ))),
            Ok(Err(e)) => {
                tracing::warn!(error = %format!("{e:#}"), "raising the high-water mark failed; ids stop at the old mark until it is raised");
                if unanswered(&e) {
                    Raise::Unanswered
                } else {
                    Raise::Failed
                }
            }
            Err(_timeout) => {
                tracing::warn!(
                    "raising the high-water mark failed: etcd did not answer within {} ms; ids \
                     stop at the old mark until it is raised",
                    within.as_millis()
                );
                Raise::Unanswered
            }
        }
    }

    /// Clean stop: withdraw, record the exact high-water mark, revoke;
    /// through another endpoint if the current one fails.
    async fn release(&mut self, client: &mut Client, lease_id: i64, id: u32) {
        self.services.identity.withdraw("the gateway is stopping");
        let exact = match *self.stop.borrow() {
            Stop::Drained => self.services.clock.last_tick().map(|last| last.millis),
            _ => None,
        };
        if !self.give_up(client, lease_id, id, exact).await && self.config.endpoints.len() > 1 {
            // The member may hang: once more through the others, within a
            // bounded time too.
            self.try_others_first();
            if let Ok(Ok(mut other)) = tokio::time::timeout(RELEASE_WAIT, self.connect()).await {
                self.give_up(&mut other, lease_id, id, exact).await;
            }
        }
        self.status.update(|s| {
            s.state = LeaseState::Released;
            s.machine_id = None;
            s.lease_id = None;
        });
    }

    /// Writes the exact mark `exact` (when the stop drained: only while
    /// the slot is still ours, see `put_mark`; if not, or etcd does not
    /// answer, the reserved mark stays) and revokes the lease, waiting at
    /// most [`RELEASE_WAIT`] for each. Whether the revocation went through.
    async fn give_up(
        &self,
        client: &mut Client,
        lease_id: i64,
        id: u32,
        exact: Option<u64>,
    ) -> bool {
        if let Some(millis) = exact {
            let write = self.put_mark(client, id, lease_id, millis);
            let _ = tokio::time::timeout(RELEASE_WAIT, write).await;
        }
        match tokio::time::timeout(RELEASE_WAIT, client.lease_revoke(lease_id)).await {
            Ok(Ok(_)) => {
                tracing::info!(machine_id = id, "machine id lease revoked");
                true
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "revoking the lease failed; it expires after its TTL");
                false
            }
            Err(_) => {
                tracing::warn!(
                    "revoking the lease failed: etcd did not answer within {} s; it expires after its TTL",
                    RELEASE_WAIT.as_secs()
                );
                false
            }
        }
    }
}

/// How far ahead of its clock any holder, whatever its TTL, keeps its
/// slot's high-water mark: [`LONGEST_MARK_LEAD`] and [`SAFETY_MARGIN`].
fn fleet_mark_ahead() -> u64 {
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
fn floor_without_mark(now: u64) -> u64 {
    now.saturating_add(fleet_mark_ahead())
        .saturating_add(MAX_LEAD.as_millis() as u64)
        .saturating_add(CLOCK_AGREEMENT.as_millis() as u64)
}

/// Why a lease ended that etcd no longer knows.
const LEASE_NOT_FOUND: &str =
    "etcd no longer knows the lease (it expired, was revoked, or etcd lost its data)";

/// Whether `error` says that an etcd member did not answer (in time, or
/// at all), rather than answered with a refusal: then another member may
/// answer.
fn unanswered(error: &anyhow::Error) -> bool {
    error
        .chain()
        .filter_map(|cause| cause.downcast_ref::<etcd_client::Error>())
        .any(|cause| match cause {
            etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
            etcd_client::Error::GRpcStatus(status) => matches!(
                status.code(),
                tonic::Code::Cancelled | tonic::Code::DeadlineExceeded | tonic::Code::Unavailable
            ),
            _ => false,
        })
}

/// Whether `error` says etcd answered that the lease does not exist (see
/// [`lease_not_found`]).
fn gone(error: &anyhow::Error) -> bool {
    error
        .chain()
        .filter_map(|cause| cause.downcast_ref::<etcd_client::Error>())
        .any(lease_not_found)
}

/// Whether opening a keep-alive stream failed because etcd answered that
/// the lease does not exist (or has expired): then it is gone for good,
/// unlike a failure to reach etcd. etcd-client reports that answer, a TTL
/// of 0 or less, only by this message.
fn lease_not_found(error: &etcd_client::Error) -> bool {
    matches!(error, etcd_client::Error::LeaseKeepAliveError(m) if m == "lease not found")
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn skipped_ids_are_listed_the_first_few_then_a_count() {
        assert_eq!(list_ids(&[0, 1]), "0, 1");
        let many: Vec<u32> = (0..20).collect();
        assert_eq!(list_ids(&many), "0, 1, 2, 3, 4, 5, 6, 7 and 12 more");
    }
}
