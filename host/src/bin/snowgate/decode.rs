//! `snowgate decode`: the fields of an id.

use clap::Args;
use snowgate_plugin::SnowflakeLayout;

use crate::Failure;

/// Flags of `snowgate decode`.
#[derive(Args)]
pub struct DecodeArgs {
    /// The id, a decimal integer.
    #[arg(value_name = "ID")]
    id: u64,
    /// The layout the id was made with: trtllm-v1 or trtllm-v2.
    #[arg(long, default_value = "trtllm-v1", value_name = "LAYOUT")]
    layout: SnowflakeLayout,
}

pub fn run(args: DecodeArgs) -> Result<(), Failure> {
    let parts = args
        .layout
        .decode(args.id)
        .map_err(|e| Failure::BadInput(e.to_string()))?;
    println!("id:         {}", args.id);
    println!("layout:     {}", args.layout);
    match args.layout {
        SnowflakeLayout::TrtllmV1 => {
            println!("timestamp:  {} ms ({})", parts.millis, utc(parts.millis));
            println!("machine id: {}", parts.machine_id);
        }
        SnowflakeLayout::TrtllmV2 => {
            println!("timestamp:  {} ms modulo 2^39", parts.millis);
            println!(
                "machine id: {} (node {}, process {})",
                parts.machine_id,
                parts.machine_id / 64,
                parts.machine_id % 64
            );
        }
    }
    println!("sequence:   {}", parts.sequence);
    Ok(())
}

/// `millis` since the Unix epoch as an RFC 3339 UTC time.
fn utc(millis: u64) -> String {
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

#[cfg(test)]
mod tests {
    #[test]
    fn formats_utc_times() {
        assert_eq!(super::utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(super::utc(1_764_000_000_000), "2025-11-24T16:00:00.000Z");
        assert_eq!(super::utc(951_782_400_123), "2000-02-29T00:00:00.123Z");
    }
}
