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
    let mut out = format!("id:         {}\nlayout:     {}\n", args.id, args.layout);
    match args.layout {
        SnowflakeLayout::TrtllmV1 => {
            let utc = snowgate_host::utc::format_millis(parts.millis);
            out += &format!("timestamp:  {} ms ({utc})\n", parts.millis);
            out += &format!("machine id: {}\n", parts.machine_id);
        }
        SnowflakeLayout::TrtllmV2 => {
            out += &format!("timestamp:  {} ms modulo 2^39\n", parts.millis);
            let (node, process) = (parts.machine_id / 64, parts.machine_id % 64);
            out += &format!(
                "machine id: {} (node {node}, process {process})\n",
                parts.machine_id
            );
        }
    }
    out += &format!("sequence:   {}\n", parts.sequence);
    crate::write_stdout(out.as_bytes())?;
    Ok(())
}
