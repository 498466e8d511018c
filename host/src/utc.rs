//! Formatting instants as RFC 3339 UTC text, without a date-time crate.

use std::time::{SystemTime, UNIX_EPOCH};

/// `millis` since the Unix epoch as RFC 3339 UTC, e.g.
/// `2025-11-24T16:00:00.000Z`.
pub fn format_millis(millis: u64) -> String {
    let (days, ms_of_day) = (millis / 86_400_000, millis % 86_400_000);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s, ms) = (
        ms_of_day / 3_600_000,
        ms_of_day / 60_000 % 60,
        ms_of_day / 1000 % 60,
        ms_of_day % 1000,
    );
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{ms:03}Z")
}

/// Milliseconds since the Unix epoch of `time` (0 before 1970).
pub fn millis_of(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    #[test]
    fn formats_utc_times() {
        assert_eq!(super::format_millis(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            super::format_millis(1_764_000_000_000),
            "2025-11-24T16:00:00.000Z"
        );
        assert_eq!(
            super::format_millis(951_782_400_123),
            "2000-02-29T00:00:00.123Z"
        );
    }
}
