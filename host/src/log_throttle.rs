//! Warnings that a flood of requests could repeat thousands of times a
//! second (every request refused for the same reason) are written at most
//! once a second, with a count of the ones left out.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Lets one warning through per second.
#[derive(Debug)]
pub(crate) struct LogThrottle {
    /// The millisecond (of the process's monotonic time, plus one) before
    /// which warnings are held back; 0 until one is written.
    next: AtomicU64,
    /// Warnings held back since the last one written.
    held_back: AtomicU64,
}

/// How many warnings were held back before one that is written; shown as
/// `(N more since the last such warning)`, the end of its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HeldBack(u64);

impl std::fmt::Display for HeldBack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "({} more since the last such warning)", self.0)
    }
}

/// How often a throttled warning is written.
const EVERY: Duration = Duration::from_secs(1);

impl LogThrottle {
    /// A throttle that lets the first warning through.
    pub(crate) const fn new() -> LogThrottle {
        LogThrottle {
            next: AtomicU64::new(0),
            held_back: AtomicU64::new(0),
        }
    }

    /// Whether to write this warning now; if so, how many were held back
    /// since the last one written, to end its message with.
    pub(crate) fn admit(&self) -> Option<HeldBack> {
        self.admit_at(since_start()).ok().map(HeldBack)
    }

    /// [`LogThrottle::admit`], and for warnings held back, a note of how
    /// many (`note`, given the count) once the second in which they were
    /// ends: otherwise a burst's count waits for the next warning written,
    /// which may never come (a review saw 4,000 plugin log lines dropped
    /// and told as none). The note is written by a task of the caller's
    /// runtime; without one, the next warning written counts them.
    pub(crate) fn admit_noting_the_rest(&'static self, note: fn(u64)) -> Option<HeldBack> {
        self.admit_noting_the_rest_at(since_start(), note)
    }

    /// [`LogThrottle::admit_noting_the_rest`] at `now`, the process's
    /// monotonic time.
    fn admit_noting_the_rest_at(&'static self, now: Duration, note: fn(u64)) -> Option<HeldBack> {
        let admitted = self.admit_at(now);
        // The first held back since the last written: its second's note.
        if admitted == Err(0) {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let now_ms = now.as_millis() as u64 + 1;
                let until_next = self.next.load(Ordering::Relaxed).saturating_sub(now_ms);
                runtime.spawn(async move {
                    tokio::time::sleep(Duration::from_millis(until_next)).await;
                    let held_back = self.held_back.swap(0, Ordering::Relaxed);
                    if held_back > 0 {
                        note(held_back);
                    }
                });
            }
        }
        admitted.ok().map(HeldBack)
    }

    /// `Ok` with how many were held back since the last one written, to
    /// write this one; `Err` with how many were before this one, to hold
    /// it back.
    fn admit_at(&self, now: Duration) -> Result<u64, u64> {
        let now = now.as_millis() as u64 + 1;
        let next = self.next.load(Ordering::Relaxed);
        if now >= next
            && self
                .next
                .compare_exchange(
                    next,
                    now + EVERY.as_millis() as u64,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            return Ok(self.held_back.swap(0, Ordering::Relaxed));
        }
        Err(self.held_back.fetch_add(1, Ordering::Relaxed))
    }
}

/// The process's monotonic time, from the first time anyone asks.
fn since_start() -> Duration {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed()
}

/// Lets at most a number of log lines through in each second, whoever
/// writes them: for lines that many callers write (every plugin call may
/// log), where one a second would hide too much and none too few would
/// let a plugin fill the disk.
#[derive(Debug)]
pub(crate) struct LineBudget {
    per_second: u64,
    /// The second (of the process's monotonic time, plus one) that `used`
    /// counts; 0 before the first line.
    second: AtomicU64,
    used: AtomicU64,
}

impl LineBudget {
    /// A budget of `per_second` lines a second.
    pub(crate) const fn new(per_second: u64) -> LineBudget {
        LineBudget {
            per_second,
            second: AtomicU64::new(0),
            used: AtomicU64::new(0),
        }
    }

    /// Whether one more line fits this second's budget.
    pub(crate) fn admit(&self) -> bool {
        self.admit_at(since_start())
    }

    fn admit_at(&self, now: Duration) -> bool {
        let now = now.as_secs() + 1;
        let second = self.second.load(Ordering::Relaxed);
        // The first caller in a new second starts its count; lines counted
        // by others in that moment may fall in either second.
        if second != now
            && self
                .second
                .compare_exchange(second, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.used.store(0, Ordering::Relaxed);
        }
        self.used.fetch_add(1, Ordering::Relaxed) < self.per_second
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_budget_lets_its_lines_through_each_second_and_no_more() {
        let budget = LineBudget::new(3);
        let at = Duration::from_millis;
        let admitted =
            |from: u64, to: u64| (from..to).filter(|&ms| budget.admit_at(at(ms))).count();
        assert_eq!(admitted(0, 10), 3);
        assert_eq!(admitted(500, 999), 0);
        assert_eq!(admitted(1_000, 1_002), 2);
        assert_eq!(admitted(1_500, 1_600), 1);
        assert_eq!(admitted(7_000, 7_100), 3);
    }

    #[test]
    fn one_warning_a_second_goes_through_with_a_count_of_the_rest() {
        let throttle = LogThrottle::new();
        let at = Duration::from_millis;
        assert_eq!(throttle.admit_at(at(5_000)), Ok(0));
        assert_eq!(throttle.admit_at(at(5_001)), Err(0));
        assert_eq!(throttle.admit_at(at(5_998)), Err(1));
        assert_eq!(throttle.admit_at(at(5_999)), Err(2));
        assert_eq!(throttle.admit_at(at(6_000)), Ok(3));
        assert_eq!(throttle.admit_at(at(9_000)), Ok(0));
        // The very first moment of the clock counts too.
        assert_eq!(LogThrottle::new().admit_at(at(0)), Ok(0));
        assert_eq!(
            HeldBack(3).to_string(),
            "(3 more since the last such warning)"
        );
    }

    /// Warnings held back after one written are noted, with their count,
    /// once their second ends, without a later warning to carry the count;
    /// once each second, and the next warning written then counts from 0.
    #[tokio::test(start_paused = true)]
    async fn warnings_held_back_are_noted_when_their_second_ends() {
        static THROTTLE: LogThrottle = LogThrottle::new();
        static NOTED: std::sync::Mutex<Vec<u64>> = std::sync::Mutex::new(Vec::new());
        let note = |held_back: u64| NOTED.lock().unwrap().push(held_back);
        let at = Duration::from_millis;
        assert!(THROTTLE.admit_noting_the_rest_at(at(0), note).is_some());
        for ms in [1, 2, 3] {
            assert!(THROTTLE.admit_noting_the_rest_at(at(ms), note).is_none());
        }
        // The paused clock moves on to the note's timer.
        tokio::time::sleep(EVERY * 2).await;
        assert_eq!(*NOTED.lock().unwrap(), vec![3]);
        // Still within the second of the warning written: the next is held
        // back too, and noted alone.
        assert!(THROTTLE.admit_noting_the_rest_at(at(500), note).is_none());
        tokio::time::sleep(EVERY * 2).await;
        assert_eq!(*NOTED.lock().unwrap(), vec![3, 1]);
        // Its second over, the next is written, counting none held back.
        assert_eq!(
            THROTTLE.admit_noting_the_rest_at(at(1_000), note),
            Some(HeldBack(0))
        );
        tokio::time::sleep(EVERY * 2).await;
        assert_eq!(*NOTED.lock().unwrap(), vec![3, 1]);
    }
}
