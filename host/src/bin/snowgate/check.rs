//! `snowgate check`: the self-check a gateway runs on every new plugin
//! build before it serves, run on its own, for a build pipeline or an
//! operator to try a build before rolling it out.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Args;
use snowgate_host::gateway::self_check::SELF_CHECK_CALLS;
use snowgate_host::gateway::slot::{load_checked_telling, may_pass};
use snowgate_host::gateway::{plugin_engine, GatewayConfig};
use snowgate_host::{HostServices, IdClock};

use crate::compile_flags::CompileFlags;
use crate::gateway_config::{check_plugin, check_whole, layered};
use crate::plugin_flags::{self, PluginFlags};
use crate::{write_stdout, Failure};

/// Flags of `snowgate check`.
#[derive(Args)]
pub struct CheckArgs {
    /// A gateway's TOML file (as `serve --config` reads it): the build is
    /// loaded as that gateway would load it, with its plugin, settings,
    /// layout, machine id, call limits and compile settings; the flags
    /// override it, as `serve`'s do. Its other settings are not used, but
    /// checked as `serve` checks them at start (with SNOWGATE_ADMIN_TOKEN,
    /// as `serve` reads it): a warning says what `serve` would refuse to
    /// start with, where its own flags do not supply it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(flatten)]
    plugin: PluginFlags,
    #[command(flatten)]
    compile: CompileFlags,
    /// The machine id the build's ids must carry, as a gateway's would
    /// [default: the config file's, or 0]: any in the layout's range checks
    /// the same (0..=1022 for trtllm-v1, 0..=16383 for trtllm-v2). The
    /// check's ids go nowhere, so it may run beside a gateway of the same
    /// machine id.
    #[arg(long, value_name = "N")]
    machine_id: Option<u32>,
}

/// Where `serve` takes its admin token from when no flag gives one (see
/// its `--admin-token`).
const ADMIN_TOKEN_VARIABLE: &str = "SNOWGATE_ADMIN_TOKEN";

/// Why `serve` would refuse to start with `config`, read from `file`, and
/// no flags but the environment's admin token; `None` if it would not.
fn whole_file_problem(config: &GatewayConfig, file: &Path) -> Option<String> {
    let mut config = config.clone();
    if let Some(token) = std::env::var_os(ADMIN_TOKEN_VARIABLE) {
        match token.into_string() {
            Ok(token) => config.admin_token = Some(token),
            Err(_) => {
                return Some(format!(
                    "{ADMIN_TOKEN_VARIABLE} is not UTF-8; a bearer token is visible ASCII"
                ))
            }
        }
    }
    match check_whole(&config, Some(file)) {
        Ok(()) => None,
        Err(Failure::BadInput(problem)) => Some(problem),
        Err(Failure::Failed(e)) => Some(format!("{e:#}")),
    }
}

/// Loads the build as `serve` does (compiled in a child process under the
/// compile limits, checked against the contract, configured with the
/// settings) and runs the self-check on it. Says on stdout that it passed,
/// or that a gateway would take it though the check could not see
/// everything (a build that rejects the canned request for want of
/// credentials, or takes no batches); or on stderr why not (exit status 1,
/// with a note where the same build may pass on a less busy machine, and
/// for a file that is not a component of the world; 2 for a flag or a
/// setting of the config file that the build is loaded with, a plugin path
/// that cannot be read as a file, or a setting the plugin refuses). What
/// else in the config file `serve` would refuse to start with is a warning.
pub fn run(args: CheckArgs) -> Result<(), Failure> {
    let flags = args.compile.over(args.plugin.as_settings(args.machine_id));
    let mut config = layered(args.config.as_deref(), flags, args.plugin.plugin_settings)?;
    check_plugin(&config, args.config.as_deref())?;
    if let Some(file) = args.config.as_deref() {
        // The rest of the file, as `serve` checks it at start, is told of,
        // not refused: `serve`'s flags may complete a file that hosts share
        // (its `--upstream` for the file's `max-upstream-requests`, its
        // `--admin-token` for an exposed `admin-listen`). Before, a file
        // with an ftp:// upstream passed here without a word.
        if let Some(problem) = whole_file_problem(&config, file) {
            tracing::warn!(
                "serve would not start with the config file {} and no flags: {problem}",
                file.display()
            );
        }
    }
    // The self-check's calls, one at a time, need no more; the slots do
    // not change how a build is judged.
    config.plugin_limits.max_instances = plugin_flags::ONE_SHOT_INSTANCES;
    let settings: Vec<(String, String)> = config.plugin_settings.clone().into_iter().collect();
    // A gateway that leases its machine id checks with 0 too.
    let identity = plugin_flags::identity(config.layout, config.machine_id.unwrap_or(0))?;
    let services = HostServices {
        clock: Arc::new(IdClock::system()),
        identity: Arc::new(identity),
    };
    let engine = plugin_engine(&config, services)?;
    let path = config.plugin.as_deref();
    let build = plugin_flags::build(path).map_err(|e| Failure::BadInput(format!("{e:#}")))?;
    let named = plugin_flags::named(path);
    let (plugin, unchecked) = match load_checked_telling(&engine, &build, &settings) {
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
