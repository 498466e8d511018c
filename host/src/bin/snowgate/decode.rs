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
            println!(
                "timestamp:  {} ms ({})",
                parts.millis,
                snowgate_host::utc::format_millis(parts.millis)
            );
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
