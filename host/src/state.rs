//! The per-call host state: an empty WASI context, the memory limiter, and
//! the host's implementations of the plugin's imports.

use std::sync::Arc;

use wasmtime::component::ResourceTable;
use wasmtime::ResourceLimiter;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::bindings::snowgate::middleware::{clock, identity, log, types};
use crate::engine::HostServices;
use snowgate_plugin::SnowflakeLayout;

/// The longest log line a plugin may write; longer ones are cut.
const MAX_LOG_LINE: usize = 4096;

/// Everything one `Store` (one plugin call) holds.
pub struct HostState {
    wasi: WasiCtx,
    table: ResourceTable,
    services: HostServices,
    pub(crate) memory: MemoryLimiter,
    plugin_name: Arc<str>,
    stderr: MemoryOutputPipe,
}

impl HostState {
    /// State for one call: an empty WASI context whose only stream is a
    /// bounded `stderr` capture (for panic messages), and the memory cap.
    pub(crate) fn new(
        services: HostServices,
        memory_bytes: usize,
        plugin_name: Arc<str>,
        stderr: MemoryOutputPipe,
    ) -> HostState {
        let wasi = WasiCtx::builder()
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .stderr(stderr.clone())
            .build();
        HostState {
            wasi,
            table: ResourceTable::new(),
            services,
            memory: MemoryLimiter {
                limit: memory_bytes,
                hit: false,
            },
            plugin_name,
            stderr,
        }
    }

    /// What the plugin wrote to stderr, lossily decoded.
    pub(crate) fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr.contents()).into_owned()
    }
}

/// Caps linear memory and remembers whether the cap was hit, so that the
/// trap that follows is reported as the memory limit.
pub(crate) struct MemoryLimiter {
    limit: usize,
    pub(crate) hit: bool,
}

impl ResourceLimiter for MemoryLimiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let allowed = desired <= self.limit;
        self.hit |= !allowed;
        Ok(allowed)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 100_000)
    }
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl types::Host for HostState {}

impl clock::Host for HostState {
    fn next_tick(&mut self, sequence_space: u32) -> clock::Tick {
        let tick = self.services.clock.next_tick(sequence_space);
        clock::Tick {
            millis: tick.millis,
            sequence: tick.sequence,
        }
    }
}

impl identity::Host for HostState {
    fn current_machine_id(&mut self) -> Result<identity::MachineId, String> {
        let id = self.services.identity.current()?;
        let layout = match id.layout {
            SnowflakeLayout::TrtllmV1 => types::IdLayout::TrtllmV1,
            SnowflakeLayout::TrtllmV2 => types::IdLayout::TrtllmV2,
        };
        Ok(identity::MachineId {
            value: id.value,
            layout,
        })
    }
}

impl log::Host for HostState {
    fn write(&mut self, level: types::LogLevel, mut message: String) {
        if message.len() > MAX_LOG_LINE {
            let mut cut = MAX_LOG_LINE;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
            message.push_str("...");
        }
        let plugin = &*self.plugin_name;
        match level {
            types::LogLevel::Debug => {
                tracing::debug!(target: "snowgate::plugin", plugin, "{message}")
            }
            types::LogLevel::Info => {
                tracing::info!(target: "snowgate::plugin", plugin, "{message}")
            }
            types::LogLevel::Warn => {
                tracing::warn!(target: "snowgate::plugin", plugin, "{message}")
            }
            types::LogLevel::Error => {
                tracing::error!(target: "snowgate::plugin", plugin, "{message}")
            }
        }
    }
}
