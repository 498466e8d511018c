//! HTTP/2 requests cut short: streams that end before their responses do,
//! soon after they began. A client that resets each request just after the
//! gateway has sent it upstream (a paced rapid reset, CVE-2023-44487) frees
//! its stream at once and opens the next, so neither
//! `--max-streams-per-connection` nor `--max-upstream-requests` bounds what
//! it costs the upstream: each such request took an upstream connection,
//! which the gateway closes mid-request, while the upstream may go on
//! working on it. h2 closes a connection whose client resets streams before
//! the gateway has taken them; one that waits until it has is closed here,
//! as Envoy closes one with too many "premature resets" (without Envoy's
//! ratio to the connection's other requests: see [`MAX_CUT_SHORT`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

/// A request whose stream ends sooner than this after it began, before its
/// response has ended, counts as cut short: a client that gives up on a
/// slow answer gives up later than this.
pub const CUT_SHORT_WITHIN: Duration = Duration::from_secs(1);

/// How many requests cut short a connection may have before it is closed
/// as at a stop (GOAWAY, its requests in flight answered). Counted over the
/// connection's life, whatever else it sent: a ratio to its answered
/// requests, as Envoy's, let a review's client reset without end by
/// sending two cheap requests for each. A client this closes for no fault
/// of its own pays a reconnection.
pub const MAX_CUT_SHORT: u64 = 100;

/// How many a connection may have before it is dropped at once: one that
/// goes on after the GOAWAY. h2 takes new streams until its client answers
/// the GOAWAY's ping, and a review's client that never did was never
/// closed.
pub const DROP_AFTER_CUT_SHORT: u64 = 2 * MAX_CUT_SHORT;

/// One connection's requests cut short.
#[derive(Debug, Default)]
pub struct StreamResets {
    cut_short: AtomicU64,
    /// Told once, at [`MAX_CUT_SHORT`].
    too_many: Notify,
    /// Told once, at [`DROP_AFTER_CUT_SHORT`].
    far_too_many: Notify,
}

impl StreamResets {
    /// Counts a request that ended: `cut_short` if its stream ended before
    /// its response did, within [`CUT_SHORT_WITHIN`] of its start. Tells
    /// [`StreamResets::too_many`] at the [`MAX_CUT_SHORT`]th, and
    /// [`StreamResets::far_too_many`] at the [`DROP_AFTER_CUT_SHORT`]th.
    pub fn ended(&self, cut_short: bool) {
        if !cut_short {
            return;
        }
        let cut = self.cut_short.fetch_add(1, Ordering::Relaxed) + 1;
        // A permit each, if the connection is not waiting yet.
        if cut == MAX_CUT_SHORT {
            self.too_many.notify_one();
        } else if cut == DROP_AFTER_CUT_SHORT {
            self.far_too_many.notify_one();
        }
    }

    /// Resolves once the connection has had [`MAX_CUT_SHORT`] requests cut
    /// short.
    pub async fn too_many(&self) {
        self.too_many.notified().await;
    }

    /// Resolves once the connection has had [`DROP_AFTER_CUT_SHORT`]
    /// requests cut short.
    pub async fn far_too_many(&self) {
        self.far_too_many.notified().await;
    }

    /// How many requests were cut short.
    #[cfg(test)]
    pub fn cut_short(&self) -> u64 {
        self.cut_short.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;

    use super::*;

    /// Whether `waiting` has resolved, without waiting.
    fn resolved(waiting: impl Future<Output = ()>) -> bool {
        tokio::pin!(waiting);
        let waker = std::task::Waker::noop();
        waiting
            .as_mut()
            .poll(&mut std::task::Context::from_waker(waker))
            .is_ready()
    }

    #[test]
    fn a_connection_is_told_at_the_hundredth_request_cut_short_and_again_at_twice_that() {
        let resets = StreamResets::default();
        for _ in 0..MAX_CUT_SHORT - 1 {
            resets.ended(true);
        }
        assert!(!resolved(resets.too_many()));
        resets.ended(true);
        assert!(resolved(resets.too_many()));
        assert!(!resolved(resets.far_too_many()));
        // Once each.
        resets.ended(true);
        assert!(!resolved(resets.too_many()));
        for _ in MAX_CUT_SHORT + 1..DROP_AFTER_CUT_SHORT - 1 {
            resets.ended(true);
        }
        assert!(!resolved(resets.far_too_many()));
        resets.ended(true);
        assert!(resolved(resets.far_too_many()));
        assert_eq!(resets.cut_short(), DROP_AFTER_CUT_SHORT);
    }

    /// Answered requests buy no resets: a review's client kept a ratio
    /// rule quiet with two cheap requests for each one it reset.
    #[test]
    fn answered_requests_among_them_change_nothing() {
        let resets = StreamResets::default();
        for _ in 0..MAX_CUT_SHORT {
            resets.ended(false);
            resets.ended(false);
            resets.ended(true);
        }
        assert!(resolved(resets.too_many()));
    }

    #[test]
    fn answered_requests_alone_never_tell() {
        let resets = StreamResets::default();
        for _ in 0..10_000 {
            resets.ended(false);
        }
        assert!(!resolved(resets.too_many()));
        assert_eq!(resets.cut_short(), 0);
    }
}
