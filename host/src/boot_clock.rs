//! A monotonic clock that keeps counting while the machine is suspended.
//!
//! Lease deadlines are measured on it. etcd counts a lease's time to live
//! on its own clock, which does not stop when this machine (or its VM) is
//! suspended; `Instant` (`CLOCK_MONOTONIC` on Linux) does stop, so a
//! deadline measured with it would end late after a suspend, by as long as
//! the suspend lasted. On Linux this is `CLOCK_BOOTTIME`; elsewhere it
//! falls back to `Instant`.

use std::time::Duration;

/// A reading of the boot clock: time since an arbitrary fixed point,
/// suspends included.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct BootTime(Duration);

impl BootTime {
    /// The clock now.
    pub fn now() -> BootTime {
        BootTime(read())
    }

    /// This reading plus `span`, saturating.
    pub fn after(self, span: Duration) -> BootTime {
        BootTime(self.0.saturating_add(span))
    }

    /// How long from `earlier` to this reading (zero if `earlier` is later).
    pub fn since(self, earlier: BootTime) -> Duration {
        self.0.saturating_sub(earlier.0)
    }
}

/// The boot clock; should a reading of it ever fail, the last good
/// reading before the first failure plus the time since by `Instant`, so
/// that the clock never jumps back. (Falling back to the time since the
/// first fallback reading, near zero, jumped it back by the machine's
/// uptime, and made an expired lease deadline look alive.)
#[cfg(target_os = "linux")]
fn read() -> Duration {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    use std::time::Instant;
    static LAST_GOOD_NANOS: AtomicU64 = AtomicU64::new(0);
    static AFTER_FAILURE: OnceLock<(Duration, Instant)> = OnceLock::new();
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid, writable timespec; CLOCK_BOOTTIME exists on
    // every Linux since 2.6.39.
    let status = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut now) };
    if status != 0 {
        let (base, at) = AFTER_FAILURE.get_or_init(|| {
            let nanos = LAST_GOOD_NANOS.load(Ordering::Relaxed);
            (Duration::from_nanos(nanos), Instant::now())
        });
        return after_failure(*base, at.elapsed());
    }
    let reading = Duration::new(now.tv_sec as u64, now.tv_nsec as u32);
    LAST_GOOD_NANOS.store(reading.as_nanos() as u64, Ordering::Relaxed);
    reading
}

/// A reading after the boot clock failed: the last good reading
/// (`last_good`) plus the time since the first failure, so that it never
/// goes back.
#[cfg(any(target_os = "linux", test))]
fn after_failure(last_good: Duration, since_failure: Duration) -> Duration {
    last_good.saturating_add(since_failure)
}

#[cfg(not(target_os = "linux"))]
fn read() -> Duration {
    fallback()
}

/// Time since the first reading, by `Instant`: where there is no boot
/// clock, suspends are not counted.
#[cfg(not(target_os = "linux"))]
fn fallback() -> Duration {
    use std::sync::OnceLock;
    use std::time::Instant;
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readings_never_go_back_and_keep_up_with_instant() {
        // Two monotonic spans, one around the boot span and one inside it:
        // the boot clock counts the same time (the machine does not
        // suspend within the test), so its span lies between them,
        // whatever runs between the readings.
        let outer = std::time::Instant::now();
        let start = BootTime::now();
        let inner = std::time::Instant::now();
        let mut last = start;
        while inner.elapsed() < Duration::from_millis(20) {
            let now = BootTime::now();
            assert!(now >= last, "{now:?} after {last:?}");
            last = now;
        }
        let inner = inner.elapsed();
        let boot = BootTime::now().since(start);
        let outer = outer.elapsed();
        let tick = Duration::from_millis(1);
        assert!(
            inner <= boot + tick && boot <= outer + tick,
            "{inner:?} <= {boot:?} <= {outer:?}"
        );
    }

    /// The clock is the boot clock, which `/proc/uptime` reads too, and not
    /// one that counts from the process's start or stops in a suspend
    /// (the spans above cannot tell them apart).
    #[cfg(target_os = "linux")]
    #[test]
    fn reads_the_boot_clock_as_proc_uptime_does() {
        let uptime = || -> Duration {
            let text = std::fs::read_to_string("/proc/uptime").expect("/proc/uptime");
            let seconds: f64 = text
                .split_whitespace()
                .next()
                .and_then(|s| s.parse().ok())
                .expect("/proc/uptime's first field");
            Duration::from_secs_f64(seconds)
        };
        let before = uptime();
        let boot = BootTime::now().0;
        let after = uptime();
        // `/proc/uptime` is cut to hundredths of a second on Linux, and
        // rounded, or kept by another clock, in sandboxes such as gVisor:
        // a second either way, where a clock counted from the process's
        // start is the machine's uptime off.
        let slack = Duration::from_secs(1);
        assert!(
            before.saturating_sub(slack) <= boot && boot <= after + slack,
            "{before:?} - 1 s <= {boot:?} <= {after:?} + 1 s"
        );
    }

    /// Should the boot clock fail, readings go on from the last good one.
    #[test]
    fn a_reading_after_a_failure_goes_on_from_the_last_good_one() {
        let last_good = Duration::from_secs(1_000);
        assert_eq!(after_failure(last_good, Duration::ZERO), last_good);
        assert_eq!(
            after_failure(last_good, Duration::from_millis(5)),
            last_good + Duration::from_millis(5)
        );
        assert_eq!(
            after_failure(Duration::MAX, Duration::from_secs(1)),
            Duration::MAX
        );
    }

    #[test]
    fn spans_saturate() {
        let now = BootTime::now();
        assert_eq!(now.since(now.after(Duration::from_secs(1))), Duration::ZERO);
        assert_eq!(
            now.after(Duration::from_secs(1)).since(now),
            Duration::from_secs(1)
        );
        assert_eq!(now.after(Duration::MAX).since(now), Duration::MAX - now.0);
    }
}
