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
//! Closing an idle keep-alive connection races with its client sending a
//! request on it, as any keep-alive timeout does: a client that reuses
//! connections must retry a request whose connection closed before any
//! answer (HTTP clients do for idempotent requests).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::Notify;

use crate::gateway::activity::Activity;

/// The client connections open now, for choosing one to close.
#[derive(Default)]
pub struct OpenConnections {
    connections: Mutex<HashMap<u64, Open>>,
    next_id: AtomicU64,
}

/// One open connection as [`OpenConnections`] knows it.
struct Open {
    activity: Activity,
    /// Told when the connection is chosen to close.
    close: Arc<Notify>,
}

/// A connection's place in [`OpenConnections`], left when dropped.
pub struct Registration {
    id: u64,
    connections: Arc<OpenConnections>,
    close: Arc<Notify>,
}

impl OpenConnections {
    /// Adds the connection whose requests `activity` counts.
    pub fn register(self: &Arc<Self>, activity: &Activity) -> Registration {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let close = Arc::new(Notify::new());
        let open = Open {
            activity: activity.clone(),
            close: close.clone(),
        };
        self.lock().insert(id, open);
        Registration {
            id,
            connections: self.clone(),
            close,
        }
    }

    /// Tells the connection that has been idle longest to close, and
    /// forgets it (it is not chosen twice); whether there was one. The
    /// scan is over every open connection, which is done only at the limit.
    pub fn close_longest_idle(&self) -> bool {
        let mut connections = self.lock();
        // Of two idle equally long, the one opened first.
        let longest = connections
            .iter()
            .filter_map(|(id, open)| open.activity.idle_for_micros().map(|idle| (idle, *id)))
            .max_by_key(|&(idle, id)| (idle, std::cmp::Reverse(id)));
        match longest.and_then(|(_, id)| connections.remove(&id)) {
            Some(open) => {
                open.close.notify_one();
                true
            }
            None => false,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Open>> {
        self.connections
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl Registration {
    /// Resolves once the connection has been chosen to close.
    pub async fn chosen(&self) {
        self.close.notified().await;
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.connections.lock().remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::Version;

    use super::*;

    fn ready(future: impl std::future::Future<Output = ()>) -> bool {
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        std::pin::pin!(future).poll(&mut cx).is_ready()
    }

    #[test]
    fn the_longest_idle_connection_is_chosen_and_a_busy_one_never() {
        let connections = Arc::new(OpenConnections::default());
        let (oldest, older, newer) = (
            Activity::default(),
            Activity::default(),
            Activity::default(),
        );
        let busy_request = oldest.begin(Version::HTTP_11);
        let oldest_place = connections.register(&oldest);
        let older_place = connections.register(&older);
        std::thread::sleep(Duration::from_millis(20));
        drop(newer.begin(Version::HTTP_2));
        let newer_place = connections.register(&newer);

        // `oldest` is busy; `older` has been idle since it opened, longer
        // than `newer`, whose request just ended.
        assert!(connections.close_longest_idle());
        assert!(ready(older_place.chosen()));
        assert!(!ready(oldest_place.chosen()));
        assert!(!ready(newer_place.chosen()));
        assert!(connections.close_longest_idle());
        assert!(ready(newer_place.chosen()));
        assert!(!connections.close_longest_idle(), "the busy one was chosen");
        assert!(!ready(oldest_place.chosen()));

        drop(busy_request);
        assert!(connections.close_longest_idle());
        assert!(ready(oldest_place.chosen()));
        drop((oldest_place, older_place, newer_place));
        assert!(connections.lock().is_empty());
    }
}
