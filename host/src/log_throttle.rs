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
        self.admit_at(since_start()).map(HeldBack)
    }

    fn admit_at(&self, now: Duration) -> Option<u64> {
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
            return Some(self.held_back.swap(0, Ordering::Relaxed));
        }
        self.held_back.fetch_add(1, Ordering::Relaxed);
        None
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
        assert_eq!(throttle.admit_at(at(5_000)), Some(0));
        assert_eq!(throttle.admit_at(at(5_001)), None);
        assert_eq!(throttle.admit_at(at(5_998)), None);
        assert_eq!(throttle.admit_at(at(5_999)), None);
        assert_eq!(throttle.admit_at(at(6_000)), Some(3));
        assert_eq!(throttle.admit_at(at(9_000)), Some(0));
        // The very first moment of the clock counts too.
        assert_eq!(LogThrottle::new().admit_at(at(0)), Some(0));
        assert_eq!(
            HeldBack(3).to_string(),
            "(3 more since the last such warning)"
        );
    }
}
