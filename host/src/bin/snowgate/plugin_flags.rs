//! The flags that say which plugin build a one-shot command runs, and
//! under which limits: shared by `rewrite` and `check`.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use clap::Args;
use snowgate_host::gateway::config::{plugin_deadline, plugin_memory_bytes};
use snowgate_host::gateway::plugin_file::read_plugin_file;
use snowgate_host::gateway::ConfigFile;
use snowgate_host::{MachineIdentity, PluginLimits};
use snowgate_plugin::SnowflakeLayout;

use crate::Failure;

/// Which plugin build, its settings and layout, and its call's limits.
#[derive(Args)]
pub struct PluginFlags {
    /// Plugin component (.wasm) to run; the bundled plugin when absent.
    #[arg(long, value_name = "PATH")]
    pub plugin: Option<PathBuf>,
    /// A setting handed to the plugin's configure export, after `id-layout`;
    /// repeatable.
    #[arg(long = "plugin-setting", value_name = "NAME=VALUE", value_parser = crate::serve::parse_setting)]
    pub plugin_settings: Vec<(String, String)>,
    /// Id layout: trtllm-v1 (TensorRT-LLM up to 1.3.0rc21) or trtllm-v2
    /// (1.3.0rc22 and later) [default: trtllm-v1].
    #[arg(long, value_name = "LAYOUT")]
    layout: Option<SnowflakeLayout>,
    /// Memory limit of a plugin call, in MiB; a request's body is copied
    /// in and the answer built inside, so a body needs a few times its size
    /// [default: 256].
    #[arg(long, value_name = "MIB")]
    plugin_memory_mib: Option<usize>,
    /// Deadline of a plugin call, instantiation included, in milliseconds
    /// of wall-clock running time [default: 1000].
    #[arg(long, value_name = "MS")]
    plugin_deadline_ms: Option<u64>,
}

impl PluginFlags {
    /// `--layout`, or the default layout.
    pub fn layout(&self) -> SnowflakeLayout {
        self.layout.unwrap_or_default()
    }

    /// The flags given, with `machine_id`, as a layer of a gateway's
    /// settings over a config file's (see [`crate::gateway_config::layered`],
    /// which takes the `--plugin-setting`s apart).
    pub fn as_settings(&self, machine_id: Option<u32>) -> ConfigFile {
        ConfigFile {
            plugin: self.plugin.clone(),
            layout: self.layout.map(|layout| layout.name().to_string()),
            machine_id,
            plugin_memory_mib: self.plugin_memory_mib,
            plugin_deadline_ms: self.plugin_deadline_ms,
            ..ConfigFile::default()
        }
    }

    /// The default limits with [`ONE_SHOT_INSTANCES`] slots, and the
    /// memory limit and deadline the flags give.
    pub fn limits(&self) -> Result<PluginLimits, Failure> {
        let bad_flag = |e: anyhow::Error| Failure::BadInput(format!("--{e:#}"));
        let mut limits = PluginLimits {
            max_instances: ONE_SHOT_INSTANCES,
            ..PluginLimits::default()
        };
        if let Some(mib) = self.plugin_memory_mib {
            limits.memory_bytes = plugin_memory_bytes(mib).map_err(bad_flag)?;
        }
        if let Some(ms) = self.plugin_deadline_ms {
            limits.deadline = plugin_deadline(ms).map_err(bad_flag)?;
        }
        Ok(limits)
    }

    /// Machine id `machine_id` (the command's `--machine-id`) in the
    /// layout `--layout` gives, or bad input saying why not.
    pub fn identity(&self, machine_id: u32) -> Result<MachineIdentity, Failure> {
        identity(self.layout(), machine_id)
    }

    /// The bytes of `--plugin`'s build, or of the bundled plugin (see
    /// [`build`]).
    pub fn build(&self) -> anyhow::Result<Cow<'static, [u8]>> {
        build(self.plugin.as_deref())
    }

    /// The build as messages name it (see [`named`]).
    pub fn named(&self) -> String {
        named(self.plugin.as_deref())
    }
}

/// Machine id `machine_id` in `layout`, or bad input saying why not, named
/// as `--machine-id` (which a config file's `machine-id` is named as too).
pub fn identity(layout: SnowflakeLayout, machine_id: u32) -> Result<MachineIdentity, Failure> {
    MachineIdentity::fixed(layout, machine_id)
        .map_err(|e| Failure::BadInput(format!("--machine-id: {e}")))
}

/// The bytes of the build at `path`, read with the same checks as `serve`
/// makes (a regular file of a bounded size, not a FIFO or /dev/zero), or
/// of the bundled plugin.
pub fn build(path: Option<&Path>) -> anyhow::Result<Cow<'static, [u8]>> {
    Ok(match path {
        Some(path) => Cow::Owned(read_plugin_file(path)?),
        None => Cow::Borrowed(snowgate_plugin_bundle::PLUGIN_WASM),
    })
}

/// The build at `path` as messages name it: `the plugin PATH`, or `the
/// bundled plugin`.
pub fn named(path: Option<&Path>) -> String {
    match path {
        Some(path) => format!("the plugin {}", path.display()),
        None => "the bundled plugin".to_string(),
    }
}

/// The plugin instance slots of a command that runs a build once or a few
/// times (`rewrite`, `check`), where a gateway has 64: each reserves about
/// 4 GiB of address space, which a limited one (`ulimit -v`) may not have.
pub const ONE_SHOT_INSTANCES: u32 = 2;

/// The `--plugin-setting`s given, each name once: a name given twice is
/// bad input (which one the plugin would see depended on the command: the
/// last for `serve` and `check`, both, in turn, for `rewrite`). The values
/// are not shown: a setting may be a credential, which would go to the log.
pub(crate) fn settings_once_each(
    settings: Vec<(String, String)>,
) -> Result<Vec<(String, String)>, Failure> {
    // A set of the names, not a look back at each: 40,000 settings took a
    // fuzz review's `check` 16 s.
    let mut names = std::collections::HashSet::with_capacity(settings.len());
    if let Some((name, _)) = settings.iter().find(|(name, _)| !names.insert(name)) {
        return Err(Failure::BadInput(format!(
            "--plugin-setting {name} is given twice: give it once"
        )));
    }
    Ok(settings)
}
