//! The bound on requests in flight to the upstream
//! (`--max-upstream-requests`), shared by every worker's connection pool:
//! a request waits for its turn, in the order requests came, for at most a
//! given time, and holds it until its response body has ended or gone.
//! Each request in flight holds one upstream connection, so the bound is
//! also one on the connections in use (each worker keeps its own idle
//! ones, for the idle timeout, beside them).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::gateway::metrics::Metrics;

/// The most requests `--max-upstream-requests` may allow in flight.
pub const MAX_UPSTREAM_REQUESTS: usize = 1_000_000;

/// Turns for requests to the upstream: at most `max` at once.
pub struct UpstreamTurns {
    permits: Arc<Semaphore>,
    max: usize,
    /// Requests waiting for a turn now.
    waiting: Arc<AtomicUsize>,
}

/// A request's turn: held until dropped.
pub type Turn = OwnedSemaphorePermit;

impl UpstreamTurns {
    /// `max` turns, reported in `metrics`; 0 is taken as 1 (none would
    /// refuse every request).
    pub fn new(max: usize, metrics: &Metrics) -> Arc<UpstreamTurns> {
        let max = max.max(1);
        let turns = UpstreamTurns {
            permits: Arc::new(Semaphore::new(max)),
            max,
            waiting: Arc::default(),
        };
        metrics.gauge_upstream_requests(turns.permits.clone(), max, turns.waiting.clone());
        Arc::new(turns)
    }

    /// How many requests may be in flight at once.
    pub fn max(&self) -> usize {
        self.max
    }

    /// A turn, waited for at most `within`, after the requests that began
    /// to wait before this one; `None` when none came in time.
    pub async fn take(&self, within: Duration) -> Option<Turn> {
        if let Ok(turn) = self.permits.clone().try_acquire_owned() {
            return Some(turn);
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let _counted = Waiting(&self.waiting);
        match tokio::time::timeout(within, self.permits.clone().acquire_owned()).await {
            Ok(Ok(turn)) => Some(turn),
            // Timed out; the semaphore is never closed.
            Ok(Err(_)) | Err(_) => None,
        }
    }
}

/// Counts a request as waiting until dropped (the wait ends, or its
/// request is dropped while it waits).
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Turns go in the order requests asked, a request that waited too
    /// long gets none, and one that stops waiting is no longer counted.
    #[tokio::test(start_paused = true)]
    async fn turns_go_in_order_and_waits_are_bounded() {
        let metrics = Metrics::default();
        let turns = UpstreamTurns::new(1, &metrics);
        let first = turns.take(Duration::ZERO).await.expect("a free turn");
        assert!(turns.take(Duration::from_millis(100)).await.is_none());
        assert_eq!(turns.waiting.load(Ordering::Relaxed), 0);

        let (a, b) = (turns.clone(), turns.clone());
        let second = tokio::spawn(async move { a.take(Duration::from_secs(5)).await });
        tokio::task::yield_now().await;
        let third = tokio::spawn(async move { b.take(Duration::from_secs(5)).await });
        tokio::task::yield_now().await;
        assert_eq!(turns.waiting.load(Ordering::Relaxed), 2);
        drop(first);
        let second = second.await.expect("joined").expect("the next turn");
        assert!(!third.is_finished());
        drop(second);
        assert!(third.await.expect("joined").is_some());
        assert_eq!(turns.waiting.load(Ordering::Relaxed), 0);
    }
}
