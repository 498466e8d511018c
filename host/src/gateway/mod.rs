//! The gateway: a reverse proxy with the plugin in its request path, hot
//! plugin reloads, and an admin listener.
//!
//! A request enters in [`server`], which takes its headers in
//! ([`hop_by_hop`]), passes the plugin in [`middleware`] (which calls it
//! through [`slot`]), and goes on to the [`upstream`]. The serving plugin
//! lives in a [`slot`] that reloads it when [`watch`] sees the file change
//! or gets SIGHUP, or when [`admin`] is asked (`POST /reload`); [`admin`]
//! and [`metrics`] show what happens.

pub(crate) mod access_log;
pub(crate) mod activity;
pub mod admin;
pub(crate) mod body_digests;
pub(crate) mod body_limit;
pub mod body_memory;
pub mod body_pace;
pub(crate) mod client_body;
pub(crate) mod client_gone;
pub mod config;
mod dot_segments;
pub(crate) mod echo;
pub(crate) mod error_chain;
pub mod header_order;
pub mod hop_by_hop;
pub(crate) mod lingering_close;
pub mod metrics;
pub mod middleware;
pub mod plugin_file;
pub(crate) mod process_metrics;
mod queued;
pub(crate) mod read_body;
pub(crate) mod reclaim;
pub(crate) mod responses;
pub mod self_check;
pub(crate) mod send_timeout;
pub mod server;
pub mod slot;
pub(crate) mod starting;
pub(crate) mod stream_resets;
mod transfer_coding;
pub mod upstream;
pub(crate) mod upstream_pool;
pub(crate) mod upstream_read_timeout;
pub(crate) mod upstream_resolve;
pub(crate) mod upstream_turns;
pub(crate) mod wait_timer;
pub mod watch;
pub(crate) mod workers;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context as _;
use snowgate_plugin_bundle::{memory_needed, IdDensity};
use tokio::net::TcpListener;

pub use config::{
    parse_listen_address, ConfigFile, ConnectionLimits, FailurePolicy, GatewayConfig,
    UpstreamTimeouts,
};
pub use metrics::{Metrics, Outcome};
pub use middleware::{Snowgate, SnowgateLayer};
pub use slot::{DeferredReload, NoReload, PluginSlot, ReloadError, Reloaded};
pub use upstream::Upstream;

use crate::compile_cache::CompileCache;
use crate::engine::{HostServices, PluginEngine};
use crate::gateway::starting::WhileStarting;
use crate::high_water_file::keeper::{wait_for_mark, MarkKeeper, START_LEAD};
use crate::high_water_file::HighWaterFile;
use crate::id_clock::{IdClock, MAX_CATCH_UP};
use crate::identity::MachineIdentity;
use crate::lease;
use crate::utc::{format_millis, millis_of};

/// A gateway with its listeners bound, ready to serve.
pub struct Gateway {
    config: GatewayConfig,
    listener: TcpListener,
    admin_listener: TcpListener,
    slot: Arc<PluginSlot>,
    services: HostServices,
    /// Keeps the fixed machine id's high-water file, when there is one.
    high_water: Option<MarkKeeper>,
    metrics: Arc<Metrics>,
    upstream: Upstream,
    /// Watches the plugin file while the gateway lives.
    _watcher: Option<watch::PluginWatch>,
    /// Ends reloads (and with them the SIGHUP task, which holds the slot)
    /// however the gateway ends: served to the end, failed on its way to
    /// serving, or never served.
    _reloads_end: ReloadsEnd,
}

/// Stops its slot's reloads when dropped.
struct ReloadsEnd(Arc<PluginSlot>);

impl Drop for ReloadsEnd {
    fn drop(&mut self) {
        self.0.stop_reloads();
    }
}

impl Gateway {
    /// Checks the configuration, loads the plugin and binds both listeners.
    ///
    /// From its first step the process catches SIGHUP (and reloads the
    /// plugin on it once bound), so a hangup while the plugin loads does
    /// not end it. tokio never gives the signal its default action back:
    /// if `bind` fails, SIGHUP stays ignored in the process; with two
    /// gateways in one process, one SIGHUP reloads both.
    pub async fn bind(config: GatewayConfig) -> anyhow::Result<Gateway> {
        let hangups = watch::catch_sighup()?;
        ConfigFile::check(&config)?;
        // First, so that probes hear from a start that waits (a high-water
        // mark far ahead, a plugin compiling), and a port in use is told
        // at once.
        let admin_listener = TcpListener::bind(config.admin_listen)
            .await
            .with_context(|| format!("listening for admin requests on {}", config.admin_listen))?;
        let starting = WhileStarting::answer_on(
            admin_listener,
            config.connections.header_read_timeout,
            "checking the configuration",
        );
        let machine_id = match (&config.lease, config.machine_id) {
            // Only for the plugin's self-check at load, whose ids never
            // leave the process: `serve` withdraws it before it serves a
            // request, and the lease keeper claims one.
            (Some(_), _) => 0,
            (None, Some(machine_id)) => machine_id,
            (None, None) => {
                tracing::warn!("no --machine-id given: using 0; every replica behind one router needs a distinct machine id");
                0
            }
        };
        let identity = MachineIdentity::fixed(config.layout, machine_id).context("--machine-id")?;
        let services = HostServices {
            clock: Arc::new(IdClock::system()),
            identity: Arc::new(identity),
        };
        // Before the plugin's self-check stamps: its ids, too, come after
        // the ids of the last gateway on the file.
        let high_water = match &config.high_water_file {
            Some(path) => {
                starting.now("reading the high-water file");
                let (file, stored) = open_high_water_file(path, config.layout, machine_id).await?;
                let now = millis_of(std::time::SystemTime::now());
                starting.now(match stored {
                    Some(mark) if wait_for_mark(mark, now).is_some() => {
                        format!(
                            "waiting for the wall clock to come within {} s of the high-water \
                             file's mark {} (ids of the last gateway on this machine id reach \
                             that far; see the log)",
                            START_LEAD.as_secs(),
                            format_millis(mark)
                        )
                    }
                    _ => "writing the first high-water mark".to_string(),
                });
                let keeper = MarkKeeper::start(file, stored, services.clone())
                    .await
                    .with_context(|| format!("--high-water-file {}", path.display()))?;
                Some(keeper)
            }
            None => None,
        };
        warn_unless_memory_holds(config.max_body_bytes, config.plugin_limits.memory_bytes);
        let mut engine = plugin_engine(&config, services.clone())?;
        if let Some(dir) = &config.plugin_cache_dir {
            let cache = CompileCache::open(dir).context("--plugin-cache-dir")?;
            engine = engine.with_compile_cache(cache);
        }
        let metrics = Arc::new(Metrics::default());
        let settings = config
            .plugin_settings
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        // Loading runs the plugin through the sync call path, whose WASI
        // bindings block on a runtime of their own: not on an async thread.
        let plugin_path = config.plugin.clone();
        let slot_metrics = metrics.clone();
        starting.now("loading the plugin (compiling it, where no cache holds it)");
        let slot = tokio::task::spawn_blocking(move || {
            PluginSlot::load(engine, plugin_path, settings, slot_metrics)
        })
        .await
        .context("the plugin loading task failed")??;
        let slot = Arc::new(slot);
        let upstream = match &config.upstream {
            Some(url) => {
                let upstream = Upstream::http(url, config.upstream_timeouts, metrics.clone())?;
                match config.max_upstream_requests {
                    Some(max) => upstream.bounded(max),
                    None => upstream,
                }
            }
            None => {
                tracing::warn!("no --upstream given: the built-in echo upstream answers every request with the request itself, headers included; give --upstream URL to proxy to a server");
                Upstream::Echo
            }
        };
        let listener = server::listen(config.listen)
            .with_context(|| format!("listening on {}", config.listen))?;
        let admin_listener = starting.hand_over().await?;
        // Reload triggers are in place before anyone learns the gateway is up.
        let _watcher = watch::watch_plugin_file(slot.clone(), config.reload_debounce)?;
        watch::reload_on_sighup(hangups, slot.clone());
        Ok(Gateway {
            config,
            listener,
            admin_listener,
            _reloads_end: ReloadsEnd(slot.clone()),
            slot,
            services,
            high_water,
            metrics,
            upstream,
            _watcher,
        })
    }

    /// Where clients connect.
    pub fn local_addr(&self) -> anyhow::Result<SocketAddr> {
        self.listener
            .local_addr()
            .context("reading the listener's address")
    }

    /// Where the admin endpoints are.
    pub fn admin_addr(&self) -> anyhow::Result<SocketAddr> {
        self.admin_listener
            .local_addr()
            .context("reading the admin listener's address")
    }

    /// The serving plugin's slot.
    pub fn slot(&self) -> &Arc<PluginSlot> {
        &self.slot
    }

    /// Serves until `shutdown` resolves, then drains in-flight requests.
    /// Reloads on plugin file changes, SIGHUP and `POST /reload`.
    ///
    /// After the drain it ends reloads and gives up its machine id: with
    /// a lease, by recording its last id in etcd and revoking the lease;
    /// with a high-water file, by writing its last id's millisecond there.
    /// With either or neither, it also waits (up to [`MAX_CATCH_UP`]) until
    /// the wall clock has passed its last id, which after a burst can add
    /// to the stop: a next start may come without the mark's store (a
    /// fixed `--machine-id` after `--etcd` or after the file).
    pub async fn serve(self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        self.serve_until(shutdown, std::future::pending()).await
    }

    /// [`Gateway::serve`], with the drain cut short when `cut_short`
    /// resolves (the `snowgate` binary: a second SIGTERM or SIGINT): the
    /// requests still in flight are dropped then, as at the end of the
    /// grace period, and a compile cache write under way is not waited
    /// for. The machine id is given up as after any drain.
    pub async fn serve_until(
        self,
        shutdown: impl Future<Output = ()>,
        cut_short: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        // Heard for the whole stop, the drain and what comes after it.
        let (cut, _) = tokio::sync::watch::channel(false);
        let cut = Arc::new(cut);
        let cutting = cut.clone();
        let told = tokio::spawn(async move {
            cut_short.await;
            cutting.send_replace(true);
        });
        let cut_short = {
            let mut cut = cut.subscribe();
            async move {
                let _ = cut.wait_for(|cut| *cut).await;
            }
        };
        let lease = match &self.config.lease {
            Some(config) => Some(lease::start(config.clone(), self.services.clone())?),
            None => None,
        };
        // Readiness ends as soon as the stop begins, before the drain; so
        // do reloads, as README promises (a compile would only take the
        // drain's CPU).
        let stopping = Arc::new(AtomicBool::new(false));
        let shutdown = {
            let stopping = stopping.clone();
            let slot = self.slot.clone();
            async move {
                shutdown.await;
                // Reloads first: whoever sees readiness end finds them
                // refused too.
                slot.stop_reloads();
                stopping.store(true, Ordering::Release);
            }
        };
        let admin = Arc::new(admin::Admin {
            slot: self.slot.clone(),
            services: self.services.clone(),
            upstream: self.upstream.describe(),
            token: self.config.admin_token.clone(),
            lease: lease.as_ref().map(|(status, _)| status.clone()),
            high_water_file: self.high_water.as_ref().map(MarkKeeper::status),
            stopping: stopping.clone(),
            header_read_timeout: self.config.connections.header_read_timeout,
            failure_policy: match self.config.failure_policy {
                FailurePolicy::FailClosed => "fail-closed",
                FailurePolicy::FailOpen => "fail-open",
            },
        });
        let workers = workers::Workers::start(self.config.worker_count())?;
        // Made before the admin listener serves: the layer registers the
        // gauges of its call slots and body memory in the metrics, and the
        // connection gauges are registered here (a scrape in between found
        // no `snowgate_connections_open`, and failed a test's wait on it).
        self.metrics
            .gauge_connections(self.config.connections.max_connections);
        let layer = SnowgateLayer::new(
            self.slot.clone(),
            self.metrics.clone(),
            self.config.failure_policy,
            self.config.max_body_bytes,
        )
        .with_body_memory(
            self.config.body_memory_limit(),
            self.config.connections.body_read_timeout,
        )?;
        // Served once the workers and the layer exist: an admin answer
        // means the gateway is wholly set up (tests and probes count on it).
        let admin_task = tokio::spawn(admin.serve(self.admin_listener));
        let drained = server::serve(
            self.listener,
            layer,
            self.upstream,
            self.config.connections,
            workers,
            server::Stop {
                begins: shutdown,
                grace: self.config.shutdown_grace,
                cut_short,
            },
        )
        .await;
        admin_task.abort();
        // Reload triggers (the file watcher, SIGHUP, an admin request
        // already accepted) outlive the server; a reload's self-check
        // stamps an id. None may run once the last id is accounted for.
        self.slot.close().await;
        let services = &self.services;
        let ids_given_up = async move {
            // The wait for the wall clock to pass the last id issued is
            // for a next start without the mark's store: a fixed
            // `--machine-id` after `--etcd` (a replica moved off the
            // fleet's etcd) or after the file (a rollback). Usually no
            // wait at all, at most the id clock's lead (9 s, as after a
            // lease's claim). Side by side with the store's last write, so
            // that a stop takes at most 10 s more (for the file, 5 s for a
            // write under way and 5 s for its own, on a disk that hangs).
            // Each gives up the machine id first.
            match (lease, self.high_water) {
                (Some((_, handle)), _) => {
                    tokio::join!(handle.release(drained), outlast_the_clock(services));
                }
                (None, Some(file)) => {
                    tokio::join!(file.release(), outlast_the_clock(services));
                }
                (None, None) => outlast_the_clock(services).await,
            }
        };
        // Meanwhile, a compile cache write under way: a restart soon after a
        // reload reads the new build instead of compiling it again. Not
        // once told to stop at once.
        if self.slot.storing() {
            tracing::info!(
                "waiting up to {} s for the compile cache write under way",
                STORE_WAIT.as_secs()
            );
        }
        let mut told_to_hurry = cut.subscribe();
        let stored = async {
            tokio::select! {
                stored = self.slot.stores_done(STORE_WAIT) => stored,
                _ = told_to_hurry.wait_for(|cut| *cut) => !self.slot.storing(),
            }
        };
        let ((), stored) = tokio::join!(ids_given_up, stored);
        told.abort();
        if !stored {
            tracing::warn!(
                "a compile cache write still under way after {} s was cut short: the next start \
                 compiles the build again",
                STORE_WAIT.as_secs()
            );
        }
        Ok(())
    }

    /// The id clock every plugin call of this gateway reads.
    pub fn clock(&self) -> &Arc<IdClock> {
        &self.services.clock
    }
}

/// The longest a stop waits for a compile cache write under way.
const STORE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Opens and locks the high-water file off the async threads, and at most
/// [`HIGH_WATER_OPEN_WAIT`]: a hung disk fails the start, naming the file.
async fn open_high_water_file(
    path: &std::path::Path,
    layout: snowgate_plugin::SnowflakeLayout,
    machine_id: u32,
) -> anyhow::Result<(HighWaterFile, Option<u64>)> {
    let owned = path.to_path_buf();
    let opening =
        tokio::task::spawn_blocking(move || HighWaterFile::open(&owned, layout, machine_id));
    match tokio::time::timeout(HIGH_WATER_OPEN_WAIT, opening).await {
        Ok(opened) => opened
            .context("the high-water file's opening task failed")?
            .context("--high-water-file"),
        Err(_) => anyhow::bail!(
            "--high-water-file: opening and reading {} did not end within {} s: the disk is hung \
             or very slow",
            path.display(),
            HIGH_WATER_OPEN_WAIT.as_secs()
        ),
    }
}

/// The longest a start waits to open and read the high-water file.
const HIGH_WATER_OPEN_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// At every stop, whatever keeps the machine id's mark (a lease, a
/// high-water file, or nothing), the gateway stops stamping and then
/// waits until the wall clock has passed every id it issued: a next
/// process on this machine id without the mark's store (a fixed
/// `--machine-id`) starts its id clock at the wall clock, and must not
/// start inside a millisecond this one used.
async fn outlast_the_clock(services: &HostServices) {
    services.identity.withdraw("the gateway is stopping");
    let clock = services.clock.clone();
    let waited = tokio::task::spawn_blocking(move || clock.wait_for_wall_clock(MAX_CATCH_UP)).await;
    match waited {
        Ok(Ok(waited)) if waited.is_zero() => {}
        Ok(Ok(waited)) => tracing::info!(
            waited_ms = waited.as_millis() as u64,
            "waited for the wall clock to pass the last id issued"
        ),
        Ok(Err(too_far)) => tracing::warn!("{too_far}"),
        Err(e) => tracing::warn!(error = %e, "waiting for the wall clock failed"),
    }
}

/// The engine a gateway of `config` loads, checks and calls its plugin
/// builds in, with `services`: its limits, answering bodies as large as
/// the gateway takes, and the process builds compile in. Without the
/// compile cache, which [`Gateway::bind`] adds where `config` names one;
/// `snowgate check` runs its self-check in this engine, so that it loads a
/// build as the gateway would.
pub fn plugin_engine(
    config: &GatewayConfig,
    services: HostServices,
) -> anyhow::Result<PluginEngine> {
    let limits = config
        .plugin_limits
        .answering_bodies_of(config.max_body_bytes);
    let slots = limits.max_instances;
    let engine = PluginEngine::new(services, limits).with_context(|| {
        format!(
            "starting the plugin engine with {slots} instance slots, each reserving about 4 GiB \
             of address space: where that is limited (ulimit -v), raise the limit, or lower \
             --plugin-instances (at least 2)"
        )
    })?;
    Ok(match &config.compile_process {
        Some(process) => engine.with_compile_process(process.clone()),
        None => engine,
    })
}

/// Warns at start when a plugin instance's memory (`memory_bytes`) cannot
/// hold what the bundled plugin needs to stamp the largest body the
/// gateway takes (`max_body_bytes`): such bodies would fail as
/// `memory_limit`, a 503 (or go through unstamped with fail-open).
fn warn_unless_memory_holds(max_body_bytes: usize, memory_bytes: usize) {
    let (body, memory) = (max_body_bytes as u64, memory_bytes as u64);
    let few = memory_needed(body, IdDensity::Few);
    let densest = memory_needed(body, IdDensity::Densest);
    if memory >= densest {
        return;
    }
    let which = if memory < few {
        "even with one id"
    } else {
        "when they are dense with ids (a batch of bare context-only params)"
    };
    let (few, densest) = (few.div_ceil(1 << 20), densest.div_ceil(1 << 20));
    let advice = config::memory_advice(few, densest, "lower --max-body-bytes");
    tracing::warn!(
        "--max-body-bytes {body} with a plugin memory limit of {} MiB: the largest bodies will \
         fail as memory_limit {which}; the bundled plugin needs {few} MiB for a body of that \
         size with few ids, and up to {densest} MiB for one dense with ids: {advice}",
        memory >> 20,
    );
}
