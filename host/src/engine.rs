//! The one wasmtime engine of the process, its epoch ticker, and the linker
//! that gives plugins the host's imports and nothing else of use.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use wasmtime::component::{HasSelf, Linker};
use wasmtime::error::Context as _;
use wasmtime::{Config, Engine};

use crate::bindings::Middleware;
use crate::clock::IdClock;
use crate::identity::MachineIdentity;
use crate::limits::PluginLimits;
use crate::state::HostState;

/// How often the epoch advances: the granularity of call deadlines.
pub(crate) const EPOCH_TICK: Duration = Duration::from_millis(1);

/// The process-wide plugin runtime: one engine, one linker, and the shared
/// id services every plugin instance sees. Reloads reuse it.
#[derive(Clone)]
pub struct PluginEngine {
    pub(crate) engine: Engine,
    pub(crate) linker: Arc<Linker<HostState>>,
    pub(crate) services: HostServices,
    pub(crate) limits: PluginLimits,
}

/// The id services shared by every plugin instance in the process.
#[derive(Clone, Debug)]
pub struct HostServices {
    /// The process-wide id clock.
    pub clock: Arc<IdClock>,
    /// The process's machine id.
    pub identity: Arc<MachineIdentity>,
}

impl PluginEngine {
    /// Creates the engine and starts its epoch ticker thread (which ends when
    /// the last clone of the engine is dropped).
    pub fn new(services: HostServices, limits: PluginLimits) -> anyhow::Result<PluginEngine> {
        let mut config = Config::new();
        config.wasm_component_model(true);
        config.epoch_interruption(true);
        let engine = Engine::new(&config).context("creating the wasmtime engine")?;

        let mut linker = Linker::new(&engine);
        // WASI is linked so that std-using plugins load, but the context each
        // call gets is empty: no files, no environment, no sockets, no stdio.
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)
            .context("linking WASI into the plugin linker")?;
        Middleware::add_to_linker::<HostState, HasSelf<HostState>>(&mut linker, |state| state)
            .context("linking the snowgate:middleware imports")?;

        let weak = engine.weak();
        thread::Builder::new()
            .name("snowgate-epoch".into())
            .spawn(move || {
                while let Some(engine) = weak.upgrade() {
                    engine.increment_epoch();
                    drop(engine);
                    thread::sleep(EPOCH_TICK);
                }
            })
            .map_err(|e| anyhow::anyhow!("starting the epoch ticker thread: {e}"))?;

        Ok(PluginEngine {
            engine,
            linker: Arc::new(linker),
            services,
            limits,
        })
    }

    /// The shared id services.
    pub fn services(&self) -> &HostServices {
        &self.services
    }

    /// The limits every call gets.
    pub fn limits(&self) -> PluginLimits {
        self.limits
    }
}
