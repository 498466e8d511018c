//! `snowgate check`: the self-check a gateway runs on every new plugin
//! build before it serves, run on its own, for a build pipeline or an
//! operator to try a build before rolling it out.

use std::sync::Arc;

use clap::Args;
use snowgate_host::gateway::self_check::SELF_CHECK_CALLS;
use snowgate_host::gateway::slot::{load_checked_telling, may_pass};
use snowgate_host::{HostServices, IdClock, PluginEngine};

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
/// contract, configured with the settings) and runs the self-check on it.
/// Says on stdout that it passed, or that a gateway would take it though
/// the check could not see everything (a build that rejects the canned
/// request for want of credentials, or takes no batches); or on stderr
/// why not (exit status 1, with a note where the same build may pass on a
/// less busy machine; 2 for a flag, a file that cannot be read as a
/// plugin, or a setting the plugin refuses).
pub fn run(args: CheckArgs) -> Result<(), Failure> {
    let identity = args.plugin.identity(args.machine_id)?;
    let services = HostServices {
        clock: Arc::new(IdClock::system()),
        identity: Arc::new(identity),
    };
    let engine = PluginEngine::new(services, args.plugin.limits()?)?;
    let build = args
        .plugin
        .build()
        .map_err(|e| Failure::BadInput(format!("{e:#}")))?;
    let named = args.plugin.named();
    let (plugin, unchecked) =
        match load_checked_telling(&engine, &build, &args.plugin.plugin_settings) {
            Ok(checked) => checked,
            Err(e) if may_pass(&e) => {
                return Err(Failure::Failed(e.context(format!(
                    "checking {named} (this may pass on a less busy machine, or with a longer \
                 --plugin-deadline-ms)"
                ))))
            }
            Err(e) => return Err(e.context(format!("checking {named}")).into()),
        };
    let info = plugin.info();
    let build = format!("{} {} (sha256 {})", info.name, info.version, info.sha256);
    let said = if unchecked.is_empty() {
        format!("{build} passed the self-check: {SELF_CHECK_CALLS}\n")
    } else {
        let mut said = format!(
            "{build} would serve, as a gateway lets it, but its self-check did not see all it \
             asks for:\n"
        );
        for what in unchecked {
            said.push_str(&format!("  {what}\n"));
        }
        said
    };
    write_stdout(said.as_bytes())?;
    Ok(())
}
