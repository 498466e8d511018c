//! Making room at the connection limit: when `--max-connections` are open
//! and another client connects, the connection that has been idle longest
//! (no request open on it: a keep-alive connection between requests, or
//! one that has not sent its first) is closed to make room, as nginx
//! reuses its idle keep-alive connections when its `worker_connections`
//! run out. Without this, a new client waited in the listen backlog until
//! an idle connection's header read timeout (10 s) ended it, while the
//! gateway had nothing to do. A connection with a request open is never
//! chosen.
//!
//! Only a connection idle for at least [`MIN_IDLE`] is chosen. A new
//! connection counts as idle until hyper has read its first request, and
//! one between two requests for the moment it takes to read the next: a
//! review saw connections whose request was already in the socket closed
//! unanswered (2 % of POSTs failed under `oha -c 100` at a limit of 50),
//! new clients evicting each other. While no connection has been idle
//! that long, a new client waits for a slot, as before.
//!
//! The connection chosen gives its slot to the new client at once, which
//! is served without waiting for it to close: an HTTP/2 client that does
//! not answer the GOAWAY's ping (a pooled client reads only while it has a
//! request out) keeps its connection for a second more, and new clients
//! that each waited for one such close were served one a second (a review
//! saw the tenth of ten wait 10 s). So connections told to close are over
//! `--max-connections` until they close, and there are at most
//! [`MAX_CLOSING`] of them at once (and no more than the limit): past that,
//! a new client waits for a slot as before. Each closes at once (HTTP/1
//! between requests), once its client answers the GOAWAY, or a second
//! later (HTTP/2); a client that keeps one open (it sent part of a request
//! head, or pings after the GOAWAY) holds it at most until a request it
//! started meanwhile is answered and another idle timeout has passed. An
//! earlier hand-over without the bound let such clients, chosen again and
//! again, take the gateway's descriptors.
//!
//! Closing an idle keep-alive connection still races with its client
//! sending a request on it, as any keep-alive timeout does: a client that
//! reuses connections must retry a request whose connection closed before
//! any answer (HTTP clients do for idempotent requests).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use atomic_waker::AtomicWaker;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::gateway::activity::Activity;
use crate::unpoisoned::LockUnpoisoned as _;

/// How long a connection must have had no request open to be chosen.
pub const MIN_IDLE: Duration = Duration::from_secs(1);

/// How often, at the connection limit with no connection idle, the open
/// ones are looked at again for one that turned idle.
const IDLE_RESCAN: Duration = Duration::from_millis(50);

/// The most connections told to close at the limit that may still be open
/// while their slots serve new clients (see the module's docs). The open
/// file cap's descriptors besides connections leave room for them.
pub const MAX_CLOSING: usize = 32;

/// How many connections told to close may still be open under a limit of
/// `max` connections: [`MAX_CLOSING`], and no more than the limit (at least
/// one).
pub const fn closing_at_most(max: usize) -> usize {
    if max < 1 {
        1
    } else if max < MAX_CLOSING {
        max
    } else {
        MAX_CLOSING
    }
}

/// A slot of `slots` for a client that came at the limit: the connection
/// of `open` idle longest is told to close (and `closed` called), and its
/// slot is taken at once; while none is idle, a slot another connection
/// gives back is waited for, and the open ones are looked at again every
/// `IDLE_RESCAN`. `None` if the slots are closed.
pub async fn room_at_the_limit(
    slots: &Arc<Semaphore>,
    open: &OpenConnections,
    closed: impl Fn(),
) -> Option<OwnedSemaphorePermit> {
    loop {
        if let Some(slot) = open.close_longest_idle() {
            closed();
            return Some(slot);
        }
        tokio::select! {
            permit = slots.clone().acquire_owned() => return permit.ok(),
            () = tokio::time::sleep(IDLE_RESCAN) => {}
        }
    }
}

/// The client connections open now, for choosing one to close.
pub struct OpenConnections {
    connections: Mutex<HashMap<u64, Open>>,
    next_id: AtomicU64,
    /// A permit for each connection chosen to close that is still open,
    /// having handed its slot on.
    closing: Arc<Semaphore>,
    /// How many permits `closing` has in all.
    max_closing: usize,
}

/// One open connection as [`OpenConnections`] knows it.
struct Open {
    activity: Activity,
    /// Told when the connection is to close.
    close: Arc<CloseSignal>,
    /// Its place under the connection limit: given back when it ends, or
    /// handed to a new client when it is chosen to close.
    slot: OwnedSemaphorePermit,
}

/// Whether a connection was told to close, and the task to wake when it
/// is. The connection's task polls it on every wake-up, so it is a flag and
/// an [`AtomicWaker`], not a [`tokio::sync::Notify`], whose every poll
/// takes a lock (400 instructions a request, measured with callgrind).
#[derive(Default)]
struct CloseSignal {
    told: AtomicBool,
    waker: AtomicWaker,
    /// Held from when the connection is chosen to close until it ends (see
    /// [`OpenConnections::closing`]).
    closing: Mutex<Option<OwnedSemaphorePermit>>,
}

impl CloseSignal {
    fn tell(&self) {
        self.told.store(true, Ordering::Release);
        self.waker.wake();
    }

    fn poll_told(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.told.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        self.waker.register(cx.waker());
        // Told between the load and the registration: seen now.
        if self.told.load(Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

/// A connection's place in [`OpenConnections`], left when dropped.
pub struct Registration {
    id: u64,
    connections: Arc<OpenConnections>,
    close: Arc<CloseSignal>,
}

impl OpenConnections {
    /// Connections under a limit of `max` at once: at most `max`, or
    /// [`MAX_CLOSING`] where that is fewer, may be closing with their
    /// slots handed on.
    pub fn new(max: usize) -> OpenConnections {
        let max_closing = closing_at_most(max);
        OpenConnections {
            connections: Mutex::default(),
            next_id: AtomicU64::new(0),
            closing: Arc::new(Semaphore::new(max_closing)),
            max_closing,
        }
    }

    /// Adds the connection whose requests `activity` counts, holding
    /// `slot` under the connection limit until it ends or is chosen to
    /// close.
    pub fn register(
        self: &Arc<Self>,
        activity: &Activity,
        slot: OwnedSemaphorePermit,
    ) -> Registration {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let close = Arc::new(CloseSignal::default());
        let open = Open {
            activity: activity.clone(),
            close: close.clone(),
            slot,
        };
        self.lock().insert(id, open);
        Registration {
            id,
            connections: self.clone(),
            close,
        }
    }

    /// Tells the connection that has been idle longest to close, and
    /// forgets it (it is not chosen twice); its slot, if there was one and
    /// fewer than the most connections are closing with their slots handed
    /// on. The scan is over every open connection, which is done only at
    /// the limit.
    pub fn close_longest_idle(&self) -> Option<OwnedSemaphorePermit> {
        let closing = self.closing.clone().try_acquire_owned().ok()?;
        let mut connections = self.lock();
        // Of two idle equally long, the one opened first.
        let longest = connections
            .iter()
            .filter_map(|(id, open)| open.activity.idle_for_micros().map(|idle| (idle, *id)))
            .filter(|&(idle, _)| idle >= MIN_IDLE.as_micros() as u64)
            .max_by_key(|&(idle, id)| (idle, std::cmp::Reverse(id)));
        let open = longest.and_then(|(_, id)| connections.remove(&id))?;
        *open.close.closing.lock_unpoisoned() = Some(closing);
        open.close.tell();
        Some(open.slot)
    }

    /// The connections chosen to close that are still open, their slots
    /// handed on: open connections besides those holding slots.
    pub fn closing(&self) -> usize {
        self.max_closing - self.closing.available_permits()
    }

    /// Tells every open connection to close: the gateway is stopping. A
    /// connection ends then as when it is chosen, at once if nothing is in
    /// flight on it. (One signal for both: the connection's task polls it
    /// on every wake-up, in place of a watch of the stop, whose every poll
    /// took a lock.)
    pub fn tell_all_to_close(&self) {
        for open in self.lock().values() {
            open.close.tell();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Open>> {
        self.connections.lock_unpoisoned()
    }
}

impl Registration {
    /// Resolves once the connection has been told to close: chosen at the
    /// connection limit, or the gateway stopping.
    pub async fn told_to_close(&self) {
        std::future::poll_fn(|cx| self.close.poll_told(cx)).await;
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.connections.lock().remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use http::Version;

    use super::*;

    fn ready(future: impl std::future::Future<Output = ()>) -> bool {
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        std::pin::pin!(future).poll(&mut cx).is_ready()
    }

    #[test]
    fn the_longest_idle_connection_is_chosen_and_a_busy_one_never() {
        let connections = Arc::new(OpenConnections::new(MAX_CLOSING));
        let (oldest, older, newer) = (
            Activity::default(),
            Activity::default(),
            Activity::default(),
        );
        let busy_request = oldest.begin(Version::HTTP_11);
        let slots = Arc::new(Semaphore::new(3));
        let slot = || slots.clone().try_acquire_owned().expect("a slot");
        let oldest_place = connections.register(&oldest, slot());
        let older_place = connections.register(&older, slot());
        let newer_place = connections.register(&newer, slot());
        let chosen = || connections.close_longest_idle().is_some();
        // None has been idle long enough yet.
        assert!(!chosen());
        std::thread::sleep(MIN_IDLE + Duration::from_millis(20));
        drop(newer.begin(Version::HTTP_2));

        // `oldest` is busy; `older` has been idle since it opened; `newer`'s
        // request just ended.
        assert!(chosen());
        assert!(ready(older_place.told_to_close()));
        assert!(!ready(oldest_place.told_to_close()));
        assert!(!ready(newer_place.told_to_close()));
        assert!(!chosen(), "chosen idle for 0 s");
        std::thread::sleep(MIN_IDLE);
        assert!(chosen());
        assert!(ready(newer_place.told_to_close()));
        assert!(!chosen(), "the busy one was chosen");
        assert!(!ready(oldest_place.told_to_close()));

        drop(busy_request);
        std::thread::sleep(MIN_IDLE);
        assert!(chosen());
        assert!(ready(oldest_place.told_to_close()));
        drop((oldest_place, older_place, newer_place));
        assert!(connections.lock().is_empty());
        assert_eq!(slots.available_permits(), 3);
    }

    /// At most as many connections as the bound may be closing with their
    /// slots handed on: past it, none is chosen, though idle ones are
    /// left, until a chosen one ends. Without the bound, clients that keep
    /// a chosen connection open (a partial head, pings after the GOAWAY),
    /// chosen again and again, took every descriptor the gateway had.
    #[test]
    fn connections_closing_with_their_slots_handed_on_are_bounded() {
        let connections = Arc::new(OpenConnections::new(2));
        let slots = Arc::new(Semaphore::new(4));
        let activities: Vec<_> = (0..4).map(|_| Activity::default()).collect();
        let mut places: Vec<_> = activities
            .iter()
            .map(|a| connections.register(a, slots.clone().try_acquire_owned().unwrap()))
            .collect();
        std::thread::sleep(MIN_IDLE + Duration::from_millis(20));
        let first = connections.close_longest_idle().expect("one chosen");
        let second = connections.close_longest_idle().expect("another chosen");
        let told = |places: &[Registration]| {
            places
                .iter()
                .filter(|place| ready(place.told_to_close()))
                .count()
        };
        assert_eq!(told(&places), 2);
        assert!(
            connections.close_longest_idle().is_none(),
            "a third chosen while two still close"
        );
        assert_eq!(connections.closing(), 2);
        assert_eq!(told(&places), 2);
        // One chosen ends: another may be chosen.
        let chosen = places
            .iter()
            .position(|place| ready(place.told_to_close()))
            .expect("a chosen one");
        drop(places.remove(chosen));
        assert!(connections.close_longest_idle().is_some());
        assert_eq!(told(&places), 2);
        drop((first, second, places));
        assert_eq!(slots.available_permits(), 4);
    }

    /// The slot of the connection chosen goes to the new client at once,
    /// not once that connection has closed; one that ends gives its slot
    /// back.
    #[test]
    fn the_chosen_connections_slot_is_handed_on_at_once() {
        let connections = Arc::new(OpenConnections::new(MAX_CLOSING));
        let slots = Arc::new(Semaphore::new(2));
        let (idle, busy) = (Activity::default(), Activity::default());
        let _request = busy.begin(Version::HTTP_11);
        let idle_place = connections.register(&idle, slots.clone().try_acquire_owned().unwrap());
        let busy_place = connections.register(&busy, slots.clone().try_acquire_owned().unwrap());
        assert_eq!(slots.available_permits(), 0);
        std::thread::sleep(MIN_IDLE + Duration::from_millis(20));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime");
        let slot = runtime.block_on(room_at_the_limit(&slots, &connections, || {}));
        let slot = slot.expect("the idle connection's slot");
        // The chosen connection has not ended yet: its slot moved.
        assert!(ready(idle_place.told_to_close()));
        assert_eq!(slots.available_permits(), 0);
        drop(idle_place);
        assert_eq!(slots.available_permits(), 0, "its slot was given twice");
        drop(slot);
        drop(busy_place);
        assert_eq!(slots.available_permits(), 2);
    }
}
