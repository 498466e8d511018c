//! The one timer behind every "may wait at most" limit on a stream: the
//! client's request body, the client taking its response, the upstream's
//! response body. Only time spent waiting counts: the timer starts when a
//! poll finds the other side not ready, and stops at the next poll that
//! finds it ready.

use std::future::Future;
use std::pin::Pin;
use std::task::Context;
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// The error of a wait that lasted its whole timeout.
#[derive(Debug, Clone)]
pub struct WaitedTooLong {
    /// What did not happen, as a clause ("the client sent no more of the
    /// request body").
    what: &'static str,
    /// The flag that sets the limit.
    flag: &'static str,
    timeout: Duration,
}

impl std::fmt::Display for WaitedTooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (what, ms, flag) = (self.what, self.timeout.as_millis(), self.flag);
        write!(f, "{what} for {ms} ms ({flag})")
    }
}

impl std::error::Error for WaitedTooLong {}

/// Times one wait at a time on a stream polled for progress.
pub struct WaitTimer {
    /// How a wait that lasts the timeout is reported; it holds the timeout.
    error: WaitedTooLong,
    /// Made the first time a poll waits, and reset for later waits: a
    /// stream that never waits costs no timer at all.
    sleep: Option<Pin<Box<Sleep>>>,
    /// Whether `sleep` times a wait now (rather than an old one).
    waiting: bool,
}

impl WaitTimer {
    /// A timer for waits of at most `timeout` each, set by `flag`; a wait
    /// that lasts it is reported as `what` (a clause: "the upstream sent
    /// no more of its response body") did not happen for that long.
    pub fn new(timeout: Duration, what: &'static str, flag: &'static str) -> WaitTimer {
        WaitTimer {
            error: WaitedTooLong {
                what,
                flag,
                timeout,
            },
            sleep: None,
            waiting: false,
        }
    }

    /// The error for a wait that lasted the whole timeout.
    pub fn error(&self) -> WaitedTooLong {
        self.error.clone()
    }

    /// A poll found the other side ready: the wait, if any, is over.
    pub fn progressed(&mut self) {
        self.waiting = false;
    }

    /// A poll found the other side not ready: whether it has now waited
    /// the whole timeout since it last made progress. If not, `cx` is woken
    /// when it will have.
    pub fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        let deadline = Instant::now() + self.error.timeout;
        let sleep = match &mut self.sleep {
            Some(sleep) => {
                if !self.waiting {
                    sleep.as_mut().reset(deadline);
                }
                sleep
            }
            None => self
                .sleep
                .insert(Box::pin(tokio::time::sleep_until(deadline))),
        };
        self.waiting = true;
        sleep.as_mut().poll(cx).is_ready()
    }
}

#[cfg(test)]
mod tests {
    use std::task::Poll;

    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(60);

    async fn expired(timer: &mut WaitTimer) -> bool {
        std::future::poll_fn(|cx| Poll::Ready(timer.expired(cx))).await
    }

    #[tokio::test(start_paused = true)]
    async fn only_a_wait_as_long_as_the_timeout_expires() {
        let mut timer = WaitTimer::new(TIMEOUT, "nothing came", "--test-timeout-ms");
        assert!(!expired(&mut timer).await);
        tokio::time::advance(TIMEOUT - Duration::from_millis(1)).await;
        assert!(
            !expired(&mut timer).await,
            "the wait goes on from its start"
        );
        timer.progressed();
        // Time while not waiting does not count.
        tokio::time::advance(2 * TIMEOUT).await;
        assert!(!expired(&mut timer).await, "a new wait starts afresh");
        tokio::time::advance(TIMEOUT - Duration::from_millis(1)).await;
        assert!(!expired(&mut timer).await);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(expired(&mut timer).await);
        assert_eq!(
            timer.error().to_string(),
            "nothing came for 60000 ms (--test-timeout-ms)"
        );
    }

    /// The task waiting is woken when the timeout runs out, without being
    /// polled meanwhile.
    #[tokio::test(start_paused = true)]
    async fn the_waiting_task_is_woken_at_the_timeout() {
        let mut timer = WaitTimer::new(TIMEOUT, "nothing came", "--test-timeout-ms");
        let started = Instant::now();
        std::future::poll_fn(|cx| {
            if timer.expired(cx) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        assert_eq!(started.elapsed(), TIMEOUT);
    }
}
