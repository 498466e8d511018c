//! The gateway's settings as `serve` takes them, in layers: the defaults,
//! then `--config`'s file, then the flags. `check` takes a build's
//! settings the same way, so that it loads the build as a gateway of the
//! same file would.

use std::path::Path;

use anyhow::Context as _;
use snowgate_host::gateway::{ConfigFile, GatewayConfig};
use snowgate_host::{CompileLimits, CompileProcess};

use crate::Failure;

/// The defaults, with `file`'s settings over them where one is given, and
/// `flags` and the repeatable `--plugin-setting`s (`settings`, added to
/// the file's) over both. A bad setting is bad input (exit status 2),
/// named by its key (the file's key, which is the flag without its `--`)
/// and with the file's name where it came from the file.
/// Settings that are wrong only together are for [`check_whole`].
pub fn layered(
    file: Option<&Path>,
    flags: ConfigFile,
    settings: Vec<(String, String)>,
) -> Result<GatewayConfig, Failure> {
    let mut config = GatewayConfig {
        // The limits come from the defaults, the file and the flags.
        compile_process: Some(CompileProcess::this_binary(
            &["compile-plugin"],
            CompileLimits::default(),
        )),
        ..GatewayConfig::default()
    };
    if let Some(path) = file {
        let settings = ConfigFile::read(path).map_err(bad)?;
        if let Some((flag, keys)) = compile_conflict(&settings, &flags) {
            return Err(Failure::BadInput(format!(
                "{flag}, and the config file {} sets {keys}: remove one or the other",
                path.display(),
            )));
        }
        // A setting's error names its key; say which file it came from.
        settings
            .apply(&mut config)
            .with_context(|| format!("in the config file {}", path.display()))
            .map_err(bad)?;
    }
    flags.apply(&mut config).map_err(bad)?;
    config
        .plugin_settings
        .extend(crate::plugin_flags::settings_once_each(settings)?);
    Ok(config)
}

/// Where the flags and the file disagree on where builds compile:
/// in-process compiling from one and compile limits from the other, which
/// it would drop without a word (or refuse without naming the file). What
/// the flag does, and the keys the file sets; `None` where they agree.
fn compile_conflict(file: &ConfigFile, flags: &ConfigFile) -> Option<(&'static str, &'static str)> {
    let limits = |s: &ConfigFile| {
        s.plugin_compile_memory_mib.is_some() || s.plugin_compile_cpu_secs.is_some()
    };
    let in_process = |s: &ConfigFile| s.plugin_compile_in_process == Some(true);
    if in_process(flags) && limits(file) {
        Some((
            "--plugin-compile-in-process leaves out the process plugins are compiled in",
            "plugin-compile-memory-mib or plugin-compile-cpu-secs",
        ))
    } else if limits(flags) && in_process(file) {
        Some((
            "--plugin-compile-memory-mib and --plugin-compile-cpu-secs limit the process plugins \
             are compiled in",
            "plugin-compile-in-process",
        ))
    } else {
        None
    }
}

/// Checks the settings of a gateway to serve whole ([`ConfigFile::check`]):
/// those wrong together are bad input too (exit status 2), not a failure
/// to start. Named by their keys, and with `file`'s name where one was
/// read: the settings are merged by then, so where each came from is not
/// known.
pub fn check_whole(config: &GatewayConfig, file: Option<&Path>) -> Result<(), Failure> {
    ConfigFile::check(config).map_err(|e| in_flags_or(file, e))
}

/// Checks only the settings a plugin build is loaded and checked with
/// ([`ConfigFile::check_plugin`]), as [`check_whole`] does.
pub fn check_plugin(config: &GatewayConfig, file: Option<&Path>) -> Result<(), Failure> {
    ConfigFile::check_plugin(config).map_err(|e| in_flags_or(file, e))
}

/// A setting's error `e`, which may have come from the flags or from
/// `file`, as bad input.
fn in_flags_or(file: Option<&Path>, e: anyhow::Error) -> Failure {
    bad(match file {
        Some(path) => e.context(format!(
            "in the flags or the config file {}",
            path.display()
        )),
        None => e,
    })
}

/// A setting's error as bad input, with its causes.
fn bad(e: anyhow::Error) -> Failure {
    Failure::BadInput(format!("{e:#}"))
}
