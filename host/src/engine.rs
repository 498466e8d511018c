//! The one wasmtime engine of the process, its epoch ticker, and the linker
//! that gives plugins the host's imports and nothing else of use.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use wasmtime::component::{HasSelf, Linker};
use wasmtime::error::Context as _;
use wasmtime::{
    Config, Enabled, Engine, InstanceAllocationStrategy, OptLevel, PoolingAllocationConfig,
    ProfilingStrategy,
};

use crate::bindings::Middleware;
use crate::compile_cache::CompileCache;
use crate::compile_process::CompileProcess;
use crate::id_clock::IdClock;
use crate::identity::MachineIdentity;
use crate::limits::PluginLimits;
use crate::state::HostState;

/// How often the epoch advances: the granularity of call deadlines.
pub(crate) const EPOCH_TICK: Duration = Duration::from_millis(1);

/// The environment variable that, set to `1`, makes the engine write a perf
/// map of the plugin's compiled code (for profiling plugins with `perf`).
pub const PERFMAP_VARIABLE: &str = "SNOWGATE_WASM_PERFMAP";

/// The longest deadline a call gets; longer ones are taken as this.
pub const MAX_DEADLINE: Duration = Duration::from_secs(24 * 60 * 60);

/// The size of a 32-bit linear memory's index space, and so the most any
/// linear memory can grow to.
const MAX_32BIT_MEMORY: usize = 4 << 30;

/// The wasm page size: linear memories grow in these.
const WASM_PAGE: usize = 64 << 10;

/// How far a kept instance's memory may grow and the instance still be
/// called again: it must cover the plugin's stack (the first MiB of a Rust
/// plugin's memory), its data and its usual heap; 4 MiB covers a 1 MiB
/// body. (It was also how much of a memory stayed resident between
/// instances, reset in place where `PAGEMAP_SCAN` found pages written;
/// that is off, see `pooling_config`.)
pub(crate) const MEMORY_KEEP_RESIDENT: usize = 4 << 20;

/// The same for tables: a plugin's tables are a few hundred entries, and
/// giving their page back on every call costs as much as a whole small call.
const TABLE_KEEP_RESIDENT: usize = 16 << 10;

/// The largest table a plugin may have or grow to (the limiter's cap too).
pub(crate) const MAX_TABLE_ELEMENTS: usize = 100_000;

/// The most host resources (WASI streams, pollables) and component handles
/// a plugin instance may hold live at once; creating more traps. Each costs
/// host memory outside the plugin's memory limit (some 230 bytes), which an
/// instance kept for reuse holds across calls: under wasmtime's defaults
/// (100,000 handles), 47 instances held 1.1 GB of it. A request middleware
/// needs a handful.
pub(crate) const MAX_PLUGIN_HANDLES: usize = 1024;

/// Per plugin instance, how many core instances, tables and memories a
/// component may use; the pool holds this many for each of
/// `max_instances`, and a component that needs more is refused when it is
/// loaded, naming what it needs. Rust plugins built for `wasm32-wasip2` use
/// three core instances, two tables and one memory; runtimes linked from
/// many libraries use more core instances, which cost the pool nothing
/// until used (componentize-py 0.25.1's: 14, two tables and one memory;
/// componentize-js 0.23.0's: 3, 2 and 1). Before, a component was not bounded by these: one
/// of two memories (a composition of two plugins) passed its self-check,
/// then took two of the pool's memories an instance, and requests found
/// the pool full (503 `busy`) at half the instances it was sized for.
const CORE_INSTANCES_PER_PLUGIN: u32 = 32;
const TABLES_PER_PLUGIN: u32 = 8;
const MEMORIES_PER_PLUGIN: u32 = 1;

/// The process-wide plugin runtime: one engine, one linker, and the shared
/// id services every plugin instance sees. Reloads reuse it.
#[derive(Clone)]
pub struct PluginEngine {
    pub(crate) engine: Engine,
    pub(crate) linker: Arc<Linker<HostState>>,
    /// The same imports for calls made from async code (the gateway): WASI's
    /// async bindings, which never block the calling thread.
    pub(crate) async_linker: Arc<Linker<HostState>>,
    pub(crate) services: HostServices,
    pub(crate) limits: PluginLimits,
    /// Where compiled plugins are kept between loads, if anywhere.
    pub(crate) compile_cache: Option<Arc<CompileCache>>,
    /// The child process that compiles plugins, if not this one.
    pub(crate) compile_process: Option<Arc<CompileProcess>>,
    /// How many requests wait for a free call slot (the gateway counts
    /// them): while any do, a call's waits for its turn are bounded (see
    /// `call_clock`).
    pub(crate) queued_calls: Arc<AtomicUsize>,
}

/// The id services shared by every plugin instance in the process.
#[derive(Clone, Debug)]
pub struct HostServices {
    /// The process-wide id clock.
    pub clock: Arc<IdClock>,
    /// The process's machine id.
    pub identity: Arc<MachineIdentity>,
}

impl HostServices {
    /// Whether an id made now could leave the process, and if not, why: the
    /// machine id is held (its lease alive, if leased), the next tick's
    /// millisecond is within the id's high-water mark, if it has one, and
    /// the layout makes unique ids in it (not `trtllm-v2` in the 65.536 s
    /// before its stamp wraps, see [`SnowflakeLayout::compose_unique`]).
    ///
    /// [`SnowflakeLayout::compose_unique`]: snowgate_plugin::SnowflakeLayout::compose_unique
    pub fn ids_may_leave_now(&self) -> Result<(), String> {
        let next = self.clock.next_millis();
        self.identity.confirm(None, next)?;
        let layout = self.identity.layout();
        layout
            .compose_unique(next, layout.max_machine_id(), layout.sequence_space() - 1)
            .map(drop)
            .map_err(|e| e.to_string())
    }
}

impl PluginEngine {
    /// Creates the engine and starts its epoch ticker thread (which ends when
    /// the last clone of the engine is dropped).
    pub fn new(services: HostServices, limits: PluginLimits) -> anyhow::Result<PluginEngine> {
        // Deadlines are added to instants and counted in ticks: keep them
        // representable ("no limit", `Duration::MAX`, becomes a day).
        let limits = PluginLimits {
            deadline: limits.deadline.min(MAX_DEADLINE),
            ..limits
        };
        let mut config = compile_config();
        // Instantiation and teardown are on the request path (every call of
        // `Plugin::handle`, and every `calls_per_instance` calls in the
        // gateway): take instances from a pool of reusable slots instead of
        // mapping and unmapping memory for each one.
        config.allocation_strategy(InstanceAllocationStrategy::Pooling(pooling_config(&limits)));
        // `SNOWGATE_WASM_PERFMAP=1` names the plugin's compiled functions in
        // `/tmp/perf-PID.map`, so that `perf report` shows them instead of
        // bare `[JIT]` addresses.
        if std::env::var_os(PERFMAP_VARIABLE).is_some_and(|v| v == "1") {
            config.profiler(ProfilingStrategy::PerfMap);
        }
        let engine = Engine::new(&config).context("creating the wasmtime engine")?;

        // WASI is linked so that std-using plugins load, but the context each
        // call gets is empty: no files, no environment, no sockets, no stdio,
        // and its clock waits cannot outlast the call (see `sleeps`).
        // Two linkers with the same imports: WASI's sync bindings block on a
        // private runtime, which cannot happen on an async worker thread, so
        // calls made from the gateway's workers use the async bindings.
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)
            .context("linking WASI into the plugin linker")?;
        crate::sleeps::bound_by_the_deadline(&mut linker)?;
        Middleware::add_to_linker::<HostState, HasSelf<HostState>>(&mut linker, |state| state)
            .context("linking the snowgate:middleware imports")?;
        crate::in_place_imports::read_in_place(&mut linker)?;
        let mut async_linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut async_linker)
            .context("linking WASI into the async plugin linker")?;
        crate::sleeps::bound_by_the_deadline(&mut async_linker)?;
        Middleware::add_to_linker::<HostState, HasSelf<HostState>>(&mut async_linker, |state| {
            state
        })
        .context("linking the snowgate:middleware imports into the async linker")?;
        crate::in_place_imports::read_in_place(&mut async_linker)?;

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
            async_linker: Arc::new(async_linker),
            services,
            limits,
            compile_cache: None,
            compile_process: None,
            queued_calls: Arc::default(),
        })
    }

    /// Keeps compiled plugins in `cache`, and loads them from there: see
    /// [`CompileCache`].
    pub fn with_compile_cache(mut self, cache: CompileCache) -> PluginEngine {
        self.compile_cache = Some(Arc::new(cache));
        self
    }

    /// Compiles plugins in a child process under limits of its own, instead
    /// of in this one: see [`CompileProcess`].
    pub fn with_compile_process(mut self, process: CompileProcess) -> PluginEngine {
        self.compile_process = Some(Arc::new(process));
        self
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

/// The settings that decide what a compiled plugin is: the engine's, and a
/// [`CompileProcess`] child's, whose builds the engine loads (wasmtime
/// refuses a build compiled under other settings). Where instances come
/// from is not among them.
pub(crate) fn compile_config() -> Config {
    let mut config = Config::new();
    config.wasm_component_model(true);
    config.epoch_interruption(true);
    config.cranelift_opt_level(OptLevel::Speed);
    // Initial memory contents are mapped copy-on-write from the compiled
    // image rather than copied in (the default, stated because the pool
    // relies on it: a slot keeps its image mapped between calls).
    config.memory_init_cow(true);
    // The default 4 GiB reservation and 32 MiB guard per memory let
    // compiled code skip bounds checks (explicit checks make the plugin's
    // JSON walk about half again as slow); the pool reserves that address
    // space once per slot, see `PluginLimits::max_instances`.
    config
}

/// The instance pool: `max_instances` plugin instances at once, each memory
/// able to grow to the memory limit (the store's limiter refuses growth past
/// `memory_bytes` before the pool's own maximum is reached, so that is still
/// reported as the memory limit).
fn pooling_config(limits: &PluginLimits) -> PoolingAllocationConfig {
    let instances = limits.max_instances.max(1);
    let max_memory = limits
        .memory_bytes
        .min(MAX_32BIT_MEMORY)
        .next_multiple_of(WASM_PAGE);
    let mut pool = PoolingAllocationConfig::new();
    pool.total_component_instances(instances)
        .total_core_instances(instances.saturating_mul(CORE_INSTANCES_PER_PLUGIN))
        .total_memories(instances.saturating_mul(MEMORIES_PER_PLUGIN))
        .total_tables(instances.saturating_mul(TABLES_PER_PLUGIN))
        .max_core_instances_per_component(CORE_INSTANCES_PER_PLUGIN)
        .max_memories_per_component(MEMORIES_PER_PLUGIN)
        .max_tables_per_component(TABLES_PER_PLUGIN)
        // Async calls (the gateway's) run on a fiber stack from the pool.
        .total_stacks(instances)
        .max_memory_size(max_memory)
        .table_elements(MAX_TABLE_ELEMENTS)
        // Reuse a slot that last held an instance of the same module first
        // (its image is still mapped), and after a reload take over the old
        // module's slots rather than warming fresh ones, so that resident
        // memory stays bounded by the busiest moment, not by the reloads.
        .max_unused_warm_slots(0)
        .table_keep_resident(TABLE_KEEP_RESIDENT);
    // Linear memories are given back with `madvise` when an instance goes,
    // and faulted in again by the next one. Keeping them resident instead,
    // reset in place where `PAGEMAP_SCAN` finds the pages written, is off:
    // wasmtime 48's scan asks for pages written *and present*, so a written
    // page the kernel has swapped out is neither reset nor given back, and
    // the next instance in the slot reads the last one's bytes (another
    // user's request; bytecodealliance/wasmtime#14357). 48.0.11 resets such
    // pages too, by its source, but cannot be locked yet: the registry has
    // no `wasmtime-internal-wit-bindgen` 48.0.11, which its macros pin.
    // Without the scan, keeping memory resident would mean `memset`ting it
    // from address 0 up, the plugin's whole stack included, which costs
    // more than the page faults it saves. Tables are still kept resident: without the
    // scan that is a `memset` of their few pages, which a swapped-out page
    // does not escape.
    pool.pagemap_scan(Enabled::No);
    pool
}
