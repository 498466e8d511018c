//! Counting the requests that wait in a queue.

use std::sync::atomic::{AtomicUsize, Ordering};

/// One request counted in `queue` while it waits: counted out when dropped
/// (when its turn comes, its wait runs out, or its client goes away).
pub(crate) struct Queued<'a>(&'a AtomicUsize);

impl<'a> Queued<'a> {
    /// Counts one more request in `queue`.
    pub(crate) fn join(queue: &'a AtomicUsize) -> Queued<'a> {
        queue.fetch_add(1, Ordering::Relaxed);
        Queued(queue)
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
