//! The deadline of one plugin call, counted in the time the call runs.
//!
//! An async call gives its thread back to the event loop at every epoch
//! tick once it has run for a while, so that other requests on the thread
//! go on. While it waits for its next turn it is not running, and that
//! wait must not count against its deadline: otherwise a burst of large
//! requests on one thread, each well within the deadline on its own, all
//! ran past it together and were refused (16 concurrent 22 MiB bodies on
//! one worker: 14 of 16 got 503). Each wait after a yield, from the yield
//! to the first poll after it, moves the deadline on by its length. Time
//! the plugin spends in a WASI wait of its own still counts (see `sleeps`).

use std::future::Future;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The clock of the current call in one store, shared between the store's
/// epoch callback (which reads it and records yields) and the future that
/// drives the call (which records resumptions).
#[derive(Debug, Default)]
pub(crate) struct CallClock {
    state: Mutex<ClockState>,
}

#[derive(Debug, Default)]
struct ClockState {
    /// When the call must end; `None` before any call began.
    deadline: Option<Instant>,
    /// From when an async call yields at every epoch tick (`None`: never).
    yield_from: Option<Instant>,
    /// When the call last yielded, until its first poll after that.
    yielded_at: Option<Instant>,
}

/// What the epoch callback should do for the current call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OnTick {
    /// Keep running until the next tick.
    Continue,
    /// Give the thread back to the event loop, then go on.
    Yield,
    /// The deadline has passed: end the call.
    Interrupt,
}

impl CallClock {
    fn lock(&self) -> MutexGuard<'_, ClockState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a call at `now`: it ends `deadline` later (plus the time it
    /// waits after yielding), and yields from `yield_after` on
    /// (`Duration::MAX`: never).
    pub(crate) fn begin(&self, now: Instant, deadline: Duration, yield_after: Duration) {
        let mut state = self.lock();
        state.deadline = Some(now + deadline);
        state.yield_from = now.checked_add(yield_after);
        state.yielded_at = None;
    }

    /// When the current call must end, as it stands now.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        self.lock().deadline
    }

    /// The decision at an epoch tick at `now`; a yield is recorded.
    pub(crate) fn on_tick(&self, now: Instant) -> OnTick {
        let mut state = self.lock();
        if state.deadline.is_none_or(|d| now >= d) {
            OnTick::Interrupt
        } else if state.yield_from.is_some_and(|y| now >= y) {
            state.yielded_at = Some(now);
            OnTick::Yield
        } else {
            OnTick::Continue
        }
    }

    /// The call's future is polled at `now`: if the call had yielded, the
    /// wait since then is not the plugin's, and the deadline moves on.
    pub(crate) fn resumed(&self, now: Instant) {
        let mut state = self.lock();
        if let Some(yielded_at) = state.yielded_at.take() {
            let waited = now.saturating_duration_since(yielded_at);
            state.deadline = state.deadline.map(|d| d + waited);
        }
    }
}

/// Drives `future`, a call in the store that owns `clock`, telling the
/// clock whenever it is polled.
pub(crate) async fn excluding_waits<F: Future>(clock: &CallClock, future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    std::future::poll_fn(|cx| {
        clock.resumed(Instant::now());
        future.as_mut().poll(cx)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn time_waiting_after_a_yield_does_not_count() {
        let clock = CallClock::default();
        let t0 = Instant::now();
        clock.begin(t0, 100 * MS, 2 * MS);
        assert_eq!(clock.on_tick(t0 + MS), OnTick::Continue);
        assert_eq!(clock.on_tick(t0 + 3 * MS), OnTick::Yield);
        // Another request held the thread for a second.
        clock.resumed(t0 + 1003 * MS);
        assert_eq!(clock.deadline(), Some(t0 + 1100 * MS));
        assert_eq!(clock.on_tick(t0 + 1004 * MS), OnTick::Yield);
        clock.resumed(t0 + 1004 * MS);
        // 99 ms of running time later it is over.
        assert_eq!(clock.on_tick(t0 + 1099 * MS), OnTick::Yield);
        clock.resumed(t0 + 1099 * MS);
        assert_eq!(clock.on_tick(t0 + 1100 * MS), OnTick::Interrupt);
    }

    #[test]
    fn polls_without_a_yield_move_nothing() {
        // A WASI wait of the plugin's own ends in a poll, but no yield came
        // before it: the wait counts.
        let clock = CallClock::default();
        let t0 = Instant::now();
        clock.begin(t0, 100 * MS, 2 * MS);
        clock.resumed(t0 + 50 * MS);
        clock.resumed(t0 + 99 * MS);
        assert_eq!(clock.deadline(), Some(t0 + 100 * MS));
        assert_eq!(clock.on_tick(t0 + 100 * MS), OnTick::Interrupt);
    }

    #[test]
    fn only_the_first_poll_after_a_yield_counts_as_the_wait() {
        let clock = CallClock::default();
        let t0 = Instant::now();
        clock.begin(t0, 100 * MS, Duration::ZERO);
        assert_eq!(clock.on_tick(t0 + 10 * MS), OnTick::Yield);
        clock.resumed(t0 + 20 * MS);
        // Then a WASI wait of 30 ms, ended by another poll: it counts.
        clock.resumed(t0 + 50 * MS);
        assert_eq!(clock.deadline(), Some(t0 + 110 * MS));
    }

    #[test]
    fn a_clock_with_no_call_interrupts() {
        let clock = CallClock::default();
        assert_eq!(clock.on_tick(Instant::now()), OnTick::Interrupt);
        assert_eq!(clock.deadline(), None);
    }
}
