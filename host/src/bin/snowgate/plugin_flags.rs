//! The flags that say which plugin build a one-shot command runs, and
//! under which limits: shared by `rewrite` and `check`.

use std::borrow::Cow;
use std::path::PathBuf;

use clap::Args;
use snowgate_host::gateway::config::{plugin_deadline, plugin_memory_bytes};
use snowgate_host::gateway::plugin_file::read_plugin_file;
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
    /// (1.3.0rc22 and later).
    #[arg(long, default_value = "trtllm-v1", value_name = "LAYOUT")]
    pub layout: SnowflakeLayout,
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
    /// The default limits, with the memory limit and deadline the flags
    /// give.
    pub fn limits(&self) -> Result<PluginLimits, Failure> {
        let bad_flag = |e: anyhow::Error| Failure::BadInput(format!("--{e:#}"));
        let mut limits = PluginLimits::default();
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
        MachineIdentity::fixed(self.layout, machine_id)
            .map_err(|e| Failure::BadInput(format!("--machine-id: {e}")))
    }

    /// The build's bytes: `--plugin`'s file, read with the same checks as
    /// `serve` makes (a regular file of a bounded size, not a FIFO or
    /// /dev/zero), or the bundled plugin.
    pub fn build(&self) -> anyhow::Result<Cow<'static, [u8]>> {
        Ok(match &self.plugin {
            Some(path) => Cow::Owned(read_plugin_file(path)?),
            None => Cow::Borrowed(snowgate_plugin_bundle::PLUGIN_WASM),
        })
    }

    /// The build as messages name it: `the plugin PATH`, or `the bundled
    /// plugin`.
    pub fn named(&self) -> String {
        match &self.plugin {
            Some(path) => format!("the plugin {}", path.display()),
            None => "the bundled plugin".to_string(),
        }
    }
}
