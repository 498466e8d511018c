//! The lease as `/status` and `/metrics` show it: what the keeper holds,
//! and how often it lost, claimed and resumed a machine id.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::SystemTime;

use super::LeaseConfig;
use crate::unpoisoned::LockUnpoisoned as _;
use crate::utc::{format_millis, millis_of};

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
    pub(super) losses: AtomicU64,
    pub(super) acquisitions: AtomicU64,
    /// Leases taken back after etcd confirmed no renewal in time (see
    /// `Keeper::resume`).
    pub(super) resumptions: AtomicU64,
}

#[derive(Debug, Clone)]
pub(super) struct StatusInner {
    pub(super) state: LeaseState,
    pub(super) machine_id: Option<u32>,
    pub(super) lease_id: Option<i64>,
    pub(super) last_renewed: Option<SystemTime>,
    pub(super) last_error: Option<String>,
}

impl LeaseStatus {
    /// Acquiring, nothing counted yet.
    pub(super) fn new(config: LeaseConfig) -> LeaseStatus {
        LeaseStatus {
            config,
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
        }
    }

    pub(super) fn update(&self, change: impl FnOnce(&mut StatusInner)) {
        change(&mut self.inner.lock_unpoisoned());
    }

    pub(super) fn snapshot(&self) -> StatusInner {
        self.inner.lock_unpoisoned().clone()
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
