//! `snowgate check`: the self-check a gateway runs on every new plugin
//! build before it serves, run on its own, for a build pipeline or an
//! operator to try a build before rolling it out.

use std::sync::Arc;

use anyhow::Context as _;
use clap::Args;
use snowgate_host::gateway::slot::load_checked;
use snowgate_host::{HostServices, IdClock, MachineIdentity, PluginEngine};

use crate::plugin_flags::PluginFlags;
use crate::{write_stdout, Failure};

/// Flags of `snowgate check`.
#[derive(Args)]
pub struct CheckArgs {
    #[command(flatten)]
    plugin: PluginFlags,
    /// The machine id the build's ids must carry, as a gateway's would:
    /// any in the layout's range checks the same (0..=1022 for trtllm-v1,
    /// 0..=16383 for trtllm-v2). The check's ids go nowhere, so it may
    /// run beside a gateway of the same machine id.
    #[arg(long, default_value_t = 0, value_name = "N")]
    machine_id: u32,
}

/// Loads the build as `serve` does (compiled, checked against the
/// contract, configured with the settings), runs the self-check on it,
/// and says on stdout that it passed, or on stderr why not (exit status 1;
/// 2 for a flag or a setting the plugin refuses).
pub fn run(args: CheckArgs) -> Result<(), Failure> {
    let identity = MachineIdentity::fixed(args.plugin.layout, args.machine_id)
        .map_err(|e| Failure::BadInput(format!("--machine-id: {e}")))?;
    let services = HostServices {
        clock: Arc::new(IdClock::system()),
        identity: Arc::new(identity),
    };
    let engine = PluginEngine::new(services, args.plugin.limits()?)?;
    let build = args.plugin.build()?;
    let plugin = load_checked(&engine, &build, &args.plugin.plugin_settings)
        .with_context(|| format!("checking {}", args.plugin.named()))?;
    let info = plugin.info();
    let passed = format!(
        "{} {} (sha256 {}) passed the self-check: a context-only request, the same again on the \
         same instance, and a batch of two\n",
        info.name, info.version, info.sha256
    );
    write_stdout(passed.as_bytes())?;
    Ok(())
}
