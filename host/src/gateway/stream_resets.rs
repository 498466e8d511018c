//! HTTP/2 requests cut short: streams that end before their responses do,
//! soon after they began. A client that resets each request just after the
//! gateway has sent it upstream (a paced rapid reset, CVE-2023-44487) frees
//! its stream at once and opens the next, so neither
//! `--max-streams-per-connection` nor `--max-upstream-requests` bounds what
//! it costs the upstream: each such request took an upstream connection,
//! which the gateway closes mid-request, while the upstream may go on
//! working on it. h2 closes a connection whose client resets streams before
//! the gateway has taken them; one that waits until it has is closed here,
//! as Envoy closes one whose "premature resets" pass half its streams.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

/// A request whose stream ends sooner than this after it began, before its
/// response has ended, counts as cut short: a client that gives up on a
/// slow answer gives up later than this.
pub const CUT_SHORT_WITHIN: Duration = Duration::from_secs(1);

/// How many requests cut short a connection may have before it is closed,
/// if they are at least half of its requests.
pub const MAX_CUT_SHORT: u64 = 100;

/// One connection's requests that ended, and those of them cut short.
#[derive(Debug, Default)]
pub struct StreamResets {
    ended: AtomicU64,
    cut_short: AtomicU64,
    /// Set once the connection has too many; told once.
    too_many: AtomicBool,
    told: Notify,
}

impl StreamResets {
    /// Counts a request that ended: `cut_short` if its stream ended before
    /// its response did, within [`CUT_SHORT_WITHIN`] of its start. Tells
    /// [`StreamResets::too_many`] once [`MAX_CUT_SHORT`] requests are cut
    /// short and they are at least half of those ended.
    pub fn ended(&self, cut_short: bool) {
        let ended = self.ended.fetch_add(1, Ordering::Relaxed) + 1;
        if !cut_short {
            return;
        }
        let cut = self.cut_short.fetch_add(1, Ordering::Relaxed) + 1;
        if cut >= MAX_CUT_SHORT
            && cut.saturating_mul(2) >= ended
            && !self.too_many.swap(true, Ordering::Relaxed)
        {
            // A permit, if the connection is not waiting yet.
            self.told.notify_one();
        }
    }

    /// Resolves once the connection has had too many requests cut short,
    /// with how many were, of how many that ended.
    pub async fn too_many(&self) -> (u64, u64) {
        self.told.notified().await;
        self.counts()
    }

    /// How many requests were cut short, of how many that ended.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.cut_short.load(Ordering::Relaxed),
            self.ended.load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;

    use super::*;

    /// Whether `too_many` has resolved, without waiting.
    fn told(resets: &StreamResets) -> Option<(u64, u64)> {
        let waiting = resets.too_many();
        tokio::pin!(waiting);
        let waker = std::task::Waker::noop();
        match waiting
            .as_mut()
            .poll(&mut std::task::Context::from_waker(waker))
        {
            std::task::Poll::Ready(counts) => Some(counts),
            std::task::Poll::Pending => None,
        }
    }

    #[test]
    fn a_connection_is_told_at_the_hundredth_request_cut_short() {
        let resets = StreamResets::default();
        for _ in 0..MAX_CUT_SHORT - 1 {
            resets.ended(true);
        }
        assert_eq!(told(&resets), None);
        resets.ended(true);
        assert_eq!(told(&resets), Some((100, 100)));
        // Once.
        resets.ended(true);
        assert_eq!(told(&resets), None);
    }

    #[test]
    fn requests_cut_short_among_twice_as_many_answered_are_let_be() {
        let resets = StreamResets::default();
        for _ in 0..1000 {
            resets.ended(false);
            resets.ended(false);
            resets.ended(true);
        }
        assert_eq!(told(&resets), None, "a third cut short");
        // Once they are half of them, it is told.
        for _ in 0..1000 {
            resets.ended(true);
        }
        assert_eq!(told(&resets), Some((2000, 4000)));
    }

    #[test]
    fn answered_requests_alone_never_tell() {
        let resets = StreamResets::default();
        for _ in 0..10_000 {
            resets.ended(false);
        }
        assert_eq!(told(&resets), None);
    }
}
