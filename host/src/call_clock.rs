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
//!
//! Waits are not free, though, when other requests queue for a call slot,
//! which a waiting call holds. While any do, a call ends at the latest
//! [`WALL_FACTOR`] deadlines after it began, waits included: a plugin that
//! runs to its deadline on every slot at once (a loop that some requests
//! trigger) holds each slot that long at most, not a deadline for every
//! call sharing its thread. Without a queue, a burst is only slowed.

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The clock of the current call in one store, shared between the store's
/// epoch callback (which reads it and records yields) and the future that
/// drives the call (which records resumptions). Times are nanoseconds
/// since the clock was made, in atomics: the poll of a call that never
/// yielded reads one of them and nothing else.
#[derive(Debug)]
pub(crate) struct CallClock {
    origin: Instant,
    /// When the call must end ([`NONE`] before any call began).
    deadline: AtomicU64,
    /// The latest the deadline may move to while other requests queue for
    /// a call slot: [`WALL_FACTOR`] deadlines after the call began.
    latest: AtomicU64,
    /// From when an async call yields at every epoch tick ([`NONE`]:
    /// never).
    yield_from: AtomicU64,
    /// When the call last yielded, until its first poll after that
    /// ([`NONE`]: it has not yielded since).
    yielded_at: AtomicU64,
}

/// No time: the atomics' "none".
const NONE: u64 = u64::MAX;

/// How many deadlines of wall time a call may take in all, waits included.
pub(crate) const WALL_FACTOR: u32 = 4;

impl Default for CallClock {
    fn default() -> Self {
        CallClock {
            origin: Instant::now(),
            deadline: AtomicU64::new(NONE),
            latest: AtomicU64::new(NONE),
            yield_from: AtomicU64::new(NONE),
            yielded_at: AtomicU64::new(NONE),
        }
    }
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
    /// `at` in nanoseconds since the origin (times before it count as 0,
    /// times past 584 years as [`NONE`]).
    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.origin).as_nanos()).unwrap_or(NONE)
    }

    /// Starts a call at `now`: it ends `deadline` later (plus the time it
    /// waits after yielding; while requests queue for a call slot, up to
    /// [`WALL_FACTOR`] deadlines in all), and yields from `yield_after` on
    /// (`Duration::MAX`: never).
    ///
    /// Every call runs this: `now` is turned into nanoseconds once, and the
    /// three times are sums of integers (a time past 584 years is
    /// [`NONE`]), not three `Instant` sums and differences.
    pub(crate) fn begin(&self, now: Instant, deadline: Duration, yield_after: Duration) {
        let start = self.nanos(now);
        let after = |span: Duration| {
            u64::try_from(span.as_nanos()).map_or(NONE, |span| start.saturating_add(span))
        };
        self.deadline.store(after(deadline), Ordering::Relaxed);
        self.latest.store(
            after(deadline.saturating_mul(WALL_FACTOR)),
            Ordering::Relaxed,
        );
        self.yield_from.store(after(yield_after), Ordering::Relaxed);
        self.yielded_at.store(NONE, Ordering::Relaxed);
    }

    /// When the current call must end, as it stands now.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        match self.deadline.load(Ordering::Relaxed) {
            NONE => None,
            nanos => self.origin.checked_add(Duration::from_nanos(nanos)),
        }
    }

    /// The decision at an epoch tick at `now`; a yield is recorded.
    pub(crate) fn on_tick(&self, now: Instant) -> OnTick {
        let now = self.nanos(now);
        let deadline = self.deadline.load(Ordering::Relaxed);
        if deadline == NONE || now >= deadline {
            OnTick::Interrupt
        } else if now >= self.yield_from.load(Ordering::Relaxed) {
            self.yielded_at.store(now, Ordering::Relaxed);
            OnTick::Yield
        } else {
            OnTick::Continue
        }
    }

    /// The call's future is being polled: if the call had yielded, the
    /// wait since then (to `now()`) is not the plugin's, and the deadline
    /// moves on; if `queued()`, requests wait for a call slot, and it moves
    /// no further than [`WALL_FACTOR`] deadlines after the call began (back
    /// to there, if earlier waits took it further). Reads the time and the
    /// queue only after a yield.
    pub(crate) fn resumed(&self, now: impl FnOnce() -> Instant, queued: impl FnOnce() -> bool) {
        // A plain load first: the usual poll, of a call that has not
        // yielded, writes nothing.
        let yielded_at = self.yielded_at.load(Ordering::Relaxed);
        if yielded_at == NONE {
            return;
        }
        self.yielded_at.store(NONE, Ordering::Relaxed);
        let waited = self.nanos(now()).saturating_sub(yielded_at);
        let deadline = self.deadline.load(Ordering::Relaxed);
        if deadline != NONE {
            let mut moved = deadline.saturating_add(waited).min(NONE - 1);
            if queued() {
                moved = moved.min(self.latest.load(Ordering::Relaxed));
            }
            self.deadline.store(moved, Ordering::Relaxed);
        }
    }
}

/// Drives `future`, a call in the store that owns `clock`, telling the
/// clock whenever it is polled; `queued` counts the requests waiting for a
/// call slot.
pub(crate) async fn excluding_waits<F: Future>(
    clock: &CallClock,
    queued: &AtomicUsize,
    future: F,
) -> F::Output {
    let mut future = std::pin::pin!(future);
    std::future::poll_fn(|cx| {
        clock.resumed(Instant::now, || queued.load(Ordering::Relaxed) > 0);
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
        // Another request held the thread for 200 ms.
        clock.resumed(|| t0 + 203 * MS, || false);
        assert_eq!(clock.deadline(), Some(t0 + 300 * MS));
        assert_eq!(clock.on_tick(t0 + 204 * MS), OnTick::Yield);
        clock.resumed(|| t0 + 204 * MS, || false);
        // 99 ms of running time later it is over.
        assert_eq!(clock.on_tick(t0 + 299 * MS), OnTick::Yield);
        clock.resumed(|| t0 + 299 * MS, || false);
        assert_eq!(clock.on_tick(t0 + 300 * MS), OnTick::Interrupt);
    }

    /// While requests queue for a call slot, waits move the deadline on
    /// no further than four deadlines after the call began: a call cannot
    /// hold its slot for longer. Without a queue they move it freely.
    #[test]
    fn while_requests_queue_waits_move_the_deadline_at_most_to_four_deadlines() {
        let clock = CallClock::default();
        let t0 = Instant::now();
        clock.begin(t0, 100 * MS, 2 * MS);
        assert_eq!(clock.on_tick(t0 + 3 * MS), OnTick::Yield);
        // Another request held the thread for a second; nobody queued.
        clock.resumed(|| t0 + 1003 * MS, || false);
        assert_eq!(clock.deadline(), Some(t0 + 1100 * MS));
        assert_eq!(clock.on_tick(t0 + 1004 * MS), OnTick::Yield);
        // Then requests queue: the deadline comes back to the cap.
        clock.resumed(|| t0 + 1005 * MS, || true);
        assert_eq!(clock.deadline(), Some(t0 + 400 * MS));
        assert_eq!(clock.on_tick(t0 + 1006 * MS), OnTick::Interrupt);

        // Queued from the start: capped at once.
        clock.begin(t0, 100 * MS, 2 * MS);
        assert_eq!(clock.on_tick(t0 + 3 * MS), OnTick::Yield);
        clock.resumed(|| t0 + 203 * MS, || true);
        assert_eq!(clock.deadline(), Some(t0 + 300 * MS));
        assert_eq!(clock.on_tick(t0 + 204 * MS), OnTick::Yield);
        clock.resumed(|| t0 + 704 * MS, || true);
        assert_eq!(clock.deadline(), Some(t0 + 400 * MS));
        assert_eq!(clock.on_tick(t0 + 705 * MS), OnTick::Interrupt);

        // The longest deadline (a day, `MAX_DEADLINE`) works alike.
        let day = Duration::from_secs(24 * 60 * 60);
        clock.begin(t0, day, 2 * MS);
        assert_eq!(clock.on_tick(t0 + 3 * MS), OnTick::Yield);
        clock.resumed(|| t0 + 5 * day, || true);
        assert_eq!(clock.deadline(), Some(t0 + 4 * day));
        assert_eq!(clock.on_tick(t0 + 5 * day), OnTick::Interrupt);
    }

    /// What drives a call tells the clock of each poll, and whether
    /// requests queue for a call slot: a wait after a yield moves the
    /// deadline on by the whole wait without a queue, and no further than
    /// [`WALL_FACTOR`] deadlines with one.
    #[test]
    fn the_driver_moves_the_deadline_by_the_wait_capped_only_while_requests_queue() {
        let deadline = Duration::from_micros(10);
        for queued in [0, 1] {
            let clock = CallClock::default();
            let start = clock.origin;
            clock.begin(start, deadline, Duration::ZERO);
            assert_eq!(clock.on_tick(start), OnTick::Yield);
            // A wait of at least a millisecond after the yield, a hundred
            // deadlines.
            while start.elapsed() < MS {
                std::hint::spin_loop();
            }
            let queue = AtomicUsize::new(queued);
            let mut call = std::pin::pin!(excluding_waits(&clock, &queue, std::future::ready(())));
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            assert!(call.as_mut().poll(&mut cx).is_ready());
            let moved_to = clock.deadline().expect("a deadline") - start;
            if queued == 0 {
                assert!(moved_to >= MS + deadline, "{moved_to:?}");
            } else {
                assert_eq!(moved_to, deadline * WALL_FACTOR);
            }
        }
    }

    #[test]
    fn polls_without_a_yield_move_nothing() {
        // A WASI wait of the plugin's own ends in a poll, but no yield came
        // before it: the wait counts.
        let clock = CallClock::default();
        let t0 = Instant::now();
        clock.begin(t0, 100 * MS, 2 * MS);
        clock.resumed(|| t0 + 50 * MS, || false);
        clock.resumed(|| t0 + 99 * MS, || false);
        assert_eq!(clock.deadline(), Some(t0 + 100 * MS));
        assert_eq!(clock.on_tick(t0 + 100 * MS), OnTick::Interrupt);
    }

    #[test]
    fn only_the_first_poll_after_a_yield_counts_as_the_wait() {
        let clock = CallClock::default();
        let t0 = Instant::now();
        clock.begin(t0, 100 * MS, Duration::ZERO);
        assert_eq!(clock.on_tick(t0 + 10 * MS), OnTick::Yield);
        clock.resumed(|| t0 + 20 * MS, || false);
        // Then a WASI wait of 30 ms, ended by another poll: it counts.
        clock.resumed(|| t0 + 50 * MS, || false);
        assert_eq!(clock.deadline(), Some(t0 + 110 * MS));
    }

    #[test]
    fn a_sync_call_never_yields_and_still_ends_at_its_deadline() {
        // Sync calls begin with `yield_after` = `Duration::MAX`, past what
        // the nanosecond counts hold.
        let clock = CallClock::default();
        let t0 = Instant::now();
        let day = Duration::from_secs(24 * 60 * 60);
        clock.begin(t0 + day, 100 * MS, Duration::MAX);
        assert_eq!(clock.on_tick(t0 + day + 99 * MS), OnTick::Continue);
        assert_eq!(clock.deadline(), Some(t0 + day + 100 * MS));
        assert_eq!(clock.on_tick(t0 + day + 100 * MS), OnTick::Interrupt);
    }

    #[test]
    fn a_clock_with_no_call_interrupts() {
        let clock = CallClock::default();
        assert_eq!(clock.on_tick(Instant::now()), OnTick::Interrupt);
        assert_eq!(clock.deadline(), None);
    }
}
