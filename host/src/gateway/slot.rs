//! The plugin that serves now, and how a new build replaces it: compiled
//! off the request path, checked, then swapped in atomically.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use anyhow::Context as _;
use arc_swap::ArcSwap;

use crate::call::CallError;
use crate::compile_process::CompileFailure;
use crate::engine::PluginEngine;
use crate::gateway::metrics::Metrics;
use crate::gateway::plugin_file::{read_plugin_file, ReadFailed};
use crate::gateway::self_check::{self, why_no_ids_may_leave, CannotCheckNow};
use crate::plugin::{hex_sha256, Plugin};
use crate::unpoisoned::LockUnpoisoned as _;

/// A failed reload, as `/status` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReloadError {
    /// What went wrong, naming the file.
    pub message: String,
    /// When.
    pub at: SystemTime,
    /// Whether the same build may load at another time (see
    /// [`may_pass`]); if not, the file watch does not try it again.
    pub may_pass: bool,
}

/// A new build in the plugin file whose reload is put off until the host
/// holds a machine id again ([`NoReload::Deferred`]), as `/status` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeferredReload {
    /// The build's SHA-256.
    pub sha256: String,
    /// Why, naming the file.
    pub message: String,
    /// When its reload was first put off.
    pub since: SystemTime,
}

/// Where the answer of a reload that runs next comes: `None` until it
/// ends.
type Answer = tokio::sync::watch::Receiver<Option<Result<Reloaded, NoReload>>>;

/// Why a reload swapped no new build in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoReload {
    /// No reload can run: the gateway is stopping, or the bundled plugin
    /// serves and has no file to read. Nothing was read, logged or counted,
    /// and `/status` keeps what it showed.
    NotPossible(String),
    /// The file holds a new build, but the host holds no machine id it may
    /// use now (a lease lapsed or being claimed, ids at the high-water
    /// file's mark), so the build cannot show in its self-check that it
    /// stamps. The previous build keeps serving; logged at WARN (once per
    /// build), not counted as a failure, and shown on `/status`; the file
    /// watch asks again at the first poll at which the host could check
    /// it. Why it could not is in the message.
    Deferred(String),
    /// The file was read and its build refused: it did not load or failed
    /// its self-check. Logged at ERROR, counted as a failed reload and
    /// shown on `/status` until a reload succeeds; the previous build keeps
    /// serving.
    Failed(ReloadError),
}

impl NoReload {
    /// What went wrong, in one line.
    pub fn message(&self) -> &str {
        match self {
            NoReload::NotPossible(message) | NoReload::Deferred(message) => message,
            NoReload::Failed(error) => &error.message,
        }
    }
}

impl std::fmt::Display for NoReload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for NoReload {}

/// What a reload did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reloaded {
    /// A new build now serves; its SHA-256.
    Swapped(String),
    /// The file holds the build that already serves; nothing changed.
    Unchanged,
}

/// Holds the serving plugin. Requests take an `Arc` of it, so a request that
/// started on the old build finishes on it while new requests use the new
/// one.
pub struct PluginSlot {
    current: ArcSwap<Plugin>,
    engine: PluginEngine,
    source: Option<PathBuf>,
    settings: Vec<(String, String)>,
    metrics: Arc<Metrics>,
    last_error: Mutex<Option<ReloadError>>,
    /// The build whose reload was last put off, until a reload ends
    /// otherwise.
    deferred: Mutex<Option<DeferredReload>>,
    /// The last build refused for what it is (one that would be refused
    /// again: see [`may_pass`]), by SHA-256, and why: a reload of the same
    /// bytes answers the same without compiling them again.
    refused: Mutex<Option<(String, String)>>,
    /// One reload at a time.
    reloading: tokio::sync::Mutex<()>,
    /// The reload asked for while another runs: it starts once that one
    /// ends, and every caller that asks before it starts gets its answer.
    queued: Mutex<Option<Answer>>,
    /// Held by a reload's self-check while it runs; `true` once the slot
    /// is closed (see [`PluginSlot::close`]).
    self_checks: Arc<tokio::sync::Mutex<bool>>,
    /// `true` once the gateway begins to stop: no reload starts after it,
    /// and callers waiting for one are answered then.
    reloads_over: tokio::sync::watch::Sender<bool>,
    /// Whether a compile cache write is under way (one at a time, see
    /// [`StoreUnderWay`]).
    stores: Arc<tokio::sync::watch::Sender<bool>>,
}

impl PluginSlot {
    /// Loads the first plugin: from `source`, or the bundled one. A bad
    /// first plugin is an error: the gateway does not start without one.
    pub fn load(
        engine: PluginEngine,
        source: Option<PathBuf>,
        settings: Vec<(String, String)>,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<PluginSlot> {
        let plugin = match &source {
            Some(path) => {
                let bytes = read_plugin_file(path)?;
                load_checked(&engine, &bytes, &settings)
                    .with_context(|| format!("loading the plugin {}", path.display()))?
            }
            None => load_checked(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &settings)
                .context("loading the bundled plugin")?,
        };
        metrics.loaded(plugin.info().compiled);
        let plugin = Arc::new(plugin);
        let slot = PluginSlot {
            current: ArcSwap::new(plugin.clone()),
            engine,
            source,
            settings,
            metrics,
            last_error: Mutex::new(None),
            deferred: Mutex::new(None),
            refused: Mutex::new(None),
            reloading: tokio::sync::Mutex::new(()),
            queued: Mutex::new(None),
            self_checks: Arc::new(tokio::sync::Mutex::new(false)),
            reloads_over: tokio::sync::watch::Sender::new(false),
            stores: Arc::new(tokio::sync::watch::Sender::new(false)),
        };
        let store = plugin
            .has_build_to_keep()
            .then(|| StoreUnderWay::try_begin(&slot.stores))
            .flatten();
        keep_compiled_meanwhile(plugin, store);
        Ok(slot)
    }

    /// Whether a compile cache write is under way.
    pub fn storing(&self) -> bool {
        *self.stores.borrow()
    }

    /// Waits, at most `within`, for the compile cache write under way to
    /// end, so that the next start reads the build it stores; whether it
    /// did (or none was under way).
    pub async fn stores_done(&self, within: std::time::Duration) -> bool {
        let mut stores = self.stores.subscribe();
        let done = tokio::time::timeout(within, stores.wait_for(|storing| !*storing)).await;
        done.is_ok()
    }

    /// The plugin serving now.
    pub fn current(&self) -> Arc<Plugin> {
        self.current.load_full()
    }

    /// The engine builds are loaded into, with the host services (the id
    /// clock, the machine id) their calls use.
    pub fn engine(&self) -> &PluginEngine {
        &self.engine
    }

    /// The file the plugin is loaded from (`None`: bundled).
    pub fn source(&self) -> Option<&Path> {
        self.source.as_deref()
    }

    /// The build whose reload is put off, if the last reload of the file
    /// was ([`NoReload::Deferred`]).
    pub fn deferred(&self) -> Option<DeferredReload> {
        self.deferred.lock_unpoisoned().clone()
    }

    /// Whether a reload runs now, or waits to run after the one that does.
    pub fn reload_under_way(&self) -> bool {
        self.reloading.try_lock().is_err() || self.queued.lock_unpoisoned().is_some()
    }

    /// The last reload failure since the last success, if any.
    pub fn last_error(&self) -> Option<ReloadError> {
        self.last_error.lock_unpoisoned().clone()
    }

    /// The metrics reloads are counted in.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Reads the plugin file again and, if it holds a new build that loads
    /// and passes the self-check, swaps it in. On any failure the old build
    /// keeps serving and the error is recorded for `/status`.
    ///
    /// The reload runs to the end on a task of its own even if the caller
    /// stops waiting (an admin client that hangs up): a reload half done
    /// would let the next one run beside its check, and drop a good build.
    ///
    /// Callers that ask while a reload runs share the one that runs next,
    /// which reads the file after they asked. Before, each queued a reload
    /// of its own: an admin client that retried `POST /reload` on a
    /// timeout while a large build compiled queued a full compile per try.
    pub async fn reload(self: &Arc<Self>) -> Result<Reloaded, NoReload> {
        if *self.reloads_over.borrow() {
            return Err(NoReload::NotPossible(STOPPING.to_string()));
        }
        let mut answer = self.ask_for_reload();
        let answered = answer.wait_for(Option::is_some).await;
        match answered.as_deref() {
            Ok(Some(result)) => result.clone(),
            // The runtime ended the reload's task: the gateway stops.
            Ok(None) | Err(_) => Err(NoReload::NotPossible(STOPPING.to_string())),
        }
    }

    /// Joins the reload that runs next, starting it if none waits: where
    /// its answer will come.
    fn ask_for_reload(self: &Arc<Self>) -> Answer {
        let mut queued = self.queued.lock_unpoisoned();
        if let Some(waiting) = queued.as_ref() {
            return waiting.clone();
        }
        let (tell, answer) = tokio::sync::watch::channel(None);
        *queued = Some(answer.clone());
        let slot = Arc::clone(self);
        let reload = tokio::spawn(async move { slot.reload_to_the_end().await });
        let slot = Arc::clone(self);
        let ours = answer.clone();
        tokio::spawn(async move {
            // A task that panicked recorded nothing: its callers say it.
            let result = reload.await.unwrap_or_else(|e| {
                Err(NoReload::NotPossible(format!(
                    "the reload task failed: {e}"
                )))
            });
            let _ = tell.send(Some(result));
            // Still queued if it ended before it began (a panic).
            let mut queued = slot.queued.lock_unpoisoned();
            if queued.as_ref().is_some_and(|q| q.same_channel(&ours)) {
                *queued = None;
            }
        });
        answer
    }

    /// Ends reloading for good: waits for a reload's self-check under way
    /// (up to three plugin calls, five where it is asked again, each within
    /// its deadline), and refuses every later
    /// one. A stopping gateway closes its slot before it gives up its
    /// machine id, so that no reload's self-check takes an id from the
    /// clock after the gateway's last one. A reload still compiling is not
    /// waited for: a compile may take minutes (up to
    /// `--plugin-compile-cpu-secs` of CPU), and a stop that waited for it
    /// could be cut short by a SIGKILL before its ids are accounted for.
    /// It ends without a self-check, refused.
    pub async fn close(&self) {
        self.stop_reloads();
        *self.self_checks.lock().await = true;
    }

    /// Refuses every reload that has not started yet, at once, as a
    /// stopping gateway does while it drains (a compile would only take
    /// the drain's CPU); callers waiting behind a reload under way are
    /// answered now. That reload runs on until [`PluginSlot::close`].
    pub fn stop_reloads(&self) {
        self.reloads_over.send_replace(true);
    }

    /// Resolves once reloads are over (see [`PluginSlot::stop_reloads`]).
    pub async fn reloads_stopped(&self) {
        let mut over = self.reloads_over.subscribe();
        // The sender lives as long as the slot.
        let _ = over.wait_for(|over| *over).await;
    }

    async fn reload_to_the_end(&self) -> Result<Reloaded, NoReload> {
        let mut over = self.reloads_over.subscribe();
        let _one_at_a_time = tokio::select! {
            one = self.reloading.lock() => one,
            _ = over.wait_for(|over| *over) => {
                return Err(NoReload::NotPossible(STOPPING.to_string()))
            }
        };
        // From here on, a caller waits for the reload after this one,
        // which reads the file after it asked.
        self.queued.lock_unpoisoned().take();
        if *self.reloads_over.borrow() || *self.self_checks.lock().await {
            return Err(NoReload::NotPossible(STOPPING.to_string()));
        }
        let Some(path) = self.source.clone() else {
            return Err(NoReload::NotPossible(
                "the bundled plugin has no file to reload from; start with --plugin PATH"
                    .to_string(),
            ));
        };
        let engine = self.engine.clone();
        let settings = self.settings.clone();
        let current_sha = self.current().info().sha256.clone();
        let refused_sha = self
            .refused
            .lock_unpoisoned()
            .as_ref()
            .map(|(sha256, _)| sha256.clone());
        let self_checks = self.self_checks.clone();
        let stores = self.stores.clone();
        let file = path.display().to_string();
        // The SHA-256 of the bytes read, for a refusal to be remembered by.
        let read = Arc::new(std::sync::OnceLock::<String>::new());
        let read_sha = read.clone();
        // Reading and compiling take milliseconds to minutes: keep them off
        // the request threads.
        let outcome = tokio::task::spawn_blocking(move || -> anyhow::Result<Option<Loaded>> {
            let bytes = read_plugin_file(&path)?;
            let sha256 = hex_sha256(&bytes);
            let _ = read_sha.set(sha256.clone());
            if sha256 == current_sha {
                return Ok(None);
            }
            if Some(&sha256) == refused_sha.as_ref() {
                return Err(anyhow::Error::new(RefusedBefore));
            }
            // Not compiled while the check could not judge it anyway.
            if let Some(reason) = why_no_ids_may_leave(&engine) {
                return Err(anyhow::Error::new(CannotCheckNow { reason, sha256 }))
                    .with_context(|| format!("loading the plugin {}", path.display()));
            }
            let loaded = load_gated(&engine, &bytes, &settings, Some((&self_checks, &stores)))
                .with_context(|| format!("loading the plugin {}", path.display()))?;
            Ok(Some(loaded))
        })
        .await
        .map_err(|e| anyhow::Error::new(e).context(format!("the reload task of {file} failed")))
        .and_then(|r| r);
        // A reload that ended without a verdict: a stop overtook it, or the
        // host could not check the build (whose SHA-256 this is).
        let overtaken =
            matches!(&outcome, Err(e) if e.chain().any(|cause| cause.is::<Overtaken>()));
        let put_off = outcome
            .as_ref()
            .err()
            .and_then(|e| {
                e.chain()
                    .find_map(|cause| cause.downcast_ref::<CannotCheckNow>())
            })
            .map(|cannot| cannot.sha256.clone());
        // One that ended otherwise (a swap, a refusal, the serving build
        // back in the file) ends the wait of a build put off.
        if !overtaken && put_off.is_none() {
            *self.deferred.lock_unpoisoned() = None;
        }
        match (outcome, put_off) {
            (Ok(Some((plugin, store, _unchecked_and_logged))), _) => {
                let sha = plugin.info().sha256.clone();
                let compiled = plugin.info().compiled.name();
                // Counted before the swap, and `/status` reads the serving
                // build first: whoever sees the new build sees its reload
                // counted and the last error cleared.
                *self.last_error.lock_unpoisoned() = None;
                self.metrics.reload(true);
                self.metrics.loaded(plugin.info().compiled);
                let plugin = Arc::new(plugin);
                let replaced = self.current.swap(plugin.clone());
                // Requests still on the old build finish on it, each on an
                // instance of its own; its kept instances go now.
                replaced.retire();
                keep_compiled_meanwhile(plugin, store);
                tracing::info!(sha256 = %sha, compiled, "plugin reloaded");
                Ok(Reloaded::Swapped(sha))
            }
            (Ok(None), _) => {
                // The file holds the serving build again: whatever failed
                // before is no longer true, and the log, which said it
                // failed, says so.
                let cleared = self.last_error.lock_unpoisoned().take();
                if cleared.is_some() {
                    tracing::info!(
                        "plugin reload: the file holds the build that serves again; the last \
                         reload error no longer holds"
                    );
                }
                Ok(Reloaded::Unchanged)
            }
            (Err(_), _) if overtaken => Err(NoReload::NotPossible(STOPPING.to_string())),
            (Err(e), _) if e.is::<RefusedBefore>() => Err(NoReload::Failed(self.refused_again())),
            (Err(e), Some(sha256)) => {
                let message =
                    format!("{e:#}; the file watch tries the build again once the host holds one");
                let mut deferred = self.deferred.lock_unpoisoned();
                // Warned once per build (a SIGHUP or `POST /reload` says
                // it again to whoever asked); the reason shown is the
                // latest, since when the first.
                let since = match deferred.take() {
                    Some(d) if d.sha256 == sha256 => d.since,
                    _ => {
                        tracing::warn!(
                            error = %message,
                            "plugin reload put off; the previous build keeps serving"
                        );
                        SystemTime::now()
                    }
                };
                *deferred = Some(DeferredReload {
                    sha256,
                    message: message.clone(),
                    since,
                });
                Err(NoReload::Deferred(message))
            }
            (Err(e), None) => {
                let error = ReloadError {
                    message: format!("{e:#}"),
                    at: SystemTime::now(),
                    may_pass: may_pass(&e),
                };
                tracing::error!(error = %error.message, "plugin reload failed; the previous build keeps serving");
                *self.last_error.lock_unpoisoned() = Some(error.clone());
                if let Some(sha256) = read.get().filter(|_| !error.may_pass) {
                    *self.refused.lock_unpoisoned() = Some((sha256.clone(), error.message.clone()));
                }
                self.metrics.reload(false);
                Err(NoReload::Failed(error))
            }
        }
    }

    /// The answer to a reload of the build refused last ([`RefusedBefore`]):
    /// its refusal. Counted and logged again, as of now, only where it is
    /// no longer the last reload error (another reload swapped in or
    /// failed since): the file watch and a `POST /reload` after the same
    /// `mv` each compiled, refused, logged and counted the build.
    fn refused_again(&self) -> ReloadError {
        let refused = self
            .refused
            .lock_unpoisoned()
            .as_ref()
            .map(|(_, message)| message.clone())
            .expect("a build refused before");
        let mut last = self.last_error.lock_unpoisoned();
        if let Some(error) = last.as_ref().filter(|error| error.message == refused) {
            tracing::debug!(
                "plugin reload: the file holds the build refused last; not compiled again"
            );
            return error.clone();
        }
        tracing::error!(error = %refused, "plugin reload failed (the build refused before, not compiled again); the previous build keeps serving");
        let error = ReloadError {
            message: refused,
            at: SystemTime::now(),
            may_pass: false,
        };
        *last = Some(error.clone());
        self.metrics.reload(false);
        error
    }
}

/// A reload read the build it refused last: answered with that refusal,
/// without compiling it again (see [`PluginSlot::refused_again`]).
#[derive(Debug)]
struct RefusedBefore;

impl std::fmt::Display for RefusedBefore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the build refused last")
    }
}

impl std::error::Error for RefusedBefore {}

/// Whether a reload that failed with `error` may pass with the same build
/// at another time: the file was there but could not be read, a call to
/// the build (the self-check, `configure`) ran out of time or found no
/// instance free, as on a busy machine, the compile may pass (see
/// [`CompileFailure::may_pass`]), or the reload's task was cancelled. A
/// build refused for what it is (not a component, not of the world, over
/// the compile's limits, its self-check's answer, a panic while loading
/// it) would be refused again, at the cost of compiling it again; a file
/// that is not there is read again once it is (its fingerprint changes).
pub fn may_pass(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<ReadFailed>()
            .is_some_and(ReadFailed::may_pass)
            || cause
                .downcast_ref::<tokio::task::JoinError>()
                .is_some_and(tokio::task::JoinError::is_cancelled)
            || matches!(
                cause.downcast_ref::<CallError>(),
                Some(CallError::Deadline(_) | CallError::Busy(_))
            )
            || cause
                .downcast_ref::<CompileFailure>()
                .is_some_and(CompileFailure::may_pass)
    })
}

/// Loads a plugin and runs the self-check: a canned context-only request
/// must not be forwarded without an integer `disagg_request_id` made of
/// the host's layout, its machine id and a tick the plugin took from the
/// host's id clock during the call, nor make the plugin fail.
///
/// A rejection for want of credentials (401, 403) passes, with a warning:
/// it sends nothing on unstamped, and a plugin that also checks what the
/// canned request cannot carry (an API key, a tenant's token) must be able
/// to serve. Any other rejection is refused as before: a build that
/// rejects valid requests (400 for the canned request's empty prompt, say)
/// does not replace a good one.
///
/// A build that stamped it is then called again on the same instance, as
/// the gateway's kept instances are: with the same request, judged the
/// same way against that call's ticks (but rejected, it is refused, 401
/// and 403 too: the first call showed it needs no credentials), and then
/// with a batch of two such
/// requests, which it must stamp with two different ids, each made of a
/// tick it took during that call. So a build that keeps an id (or the tick
/// it made one of) from one call to the next, or repeats an id within a
/// call, is refused; neither shows on one request in a fresh instance. A
/// build may reject the batch with a status under 500, with a warning: one
/// that takes no batches sends none on.
///
/// Where the host kept the build from showing what it does, it is neither
/// passed nor refused: the load fails saying it cannot be checked now, and
/// a reload is put off ([`NoReload::Deferred`]). That is when the host
/// withheld the id the self-check took (past the high-water mark, the
/// lease lapsed: the build's answer is not known), and when the plugin
/// answered 503 while the host held no machine id it may use, or one
/// granted during the call (the bundled plugin's answer for want of one,
/// which cannot be told from a build that refuses everything). An
/// embedder's [`PluginSlot::load`] fails so too, where its host holds no
/// machine id at the first load: the gateway gives its self-check a
/// placeholder id (see `Gateway::bind`).
pub fn load_checked(
    engine: &PluginEngine,
    bytes: &[u8],
    settings: &[(String, String)],
) -> anyhow::Result<Plugin> {
    load_checked_telling(engine, bytes, settings).map(|(plugin, _)| plugin)
}

/// [`load_checked`], telling also what the self-check of a build it lets
/// serve could not see: for each call the build rejected (401 or 403, or
/// the batch with a status under 500), what was not checked and why; none
/// where the build stamped all three.
pub fn load_checked_telling(
    engine: &PluginEngine,
    bytes: &[u8],
    settings: &[(String, String)],
) -> anyhow::Result<(Plugin, Vec<String>)> {
    load_gated(engine, bytes, settings, None).map(|(plugin, _, unchecked)| (plugin, unchecked))
}

/// A build loaded and checked by a reload, with its turn to be stored in
/// the compile cache, where it has one, and what its self-check could not
/// see (see [`load_checked_telling`]).
type Loaded = (Plugin, Option<StoreUnderWay>, Vec<String>);

/// Keeps `plugin`'s build in the compile cache, given its turn (`store`),
/// on a thread of its own: only a build that passed its check and serves
/// is kept, and its swap does not wait for the write (hundreds of MB,
/// synced, for a large build; a slow or hung cache volume). A stop waits
/// for it a while ([`PluginSlot::stores_done`]); a write it cuts short
/// leaves a temporary file, which a later store removes.
fn keep_compiled_meanwhile(plugin: Arc<Plugin>, store: Option<StoreUnderWay>) {
    let Some(store) = store else { return };
    let spawned = std::thread::Builder::new()
        .name("snowgate-compile-cache".into())
        .spawn(move || {
            plugin.keep_compiled();
            drop(store);
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "the compiled plugin was not stored in the compile cache: no thread to write it");
    }
}

/// Why a reload that a stop overtook swaps nothing in.
const STOPPING: &str = "the gateway is stopping: reloads are over";

/// A reload's self-check refused because the slot closed while the build
/// compiled: not the build's failure.
#[derive(Debug)]
struct Overtaken;

impl std::fmt::Display for Overtaken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(STOPPING)
    }
}

impl std::error::Error for Overtaken {}

/// [`load_checked`], on a blocking thread; with `self_checks` (a
/// reload's), the plugin's code (its configuration, then the self-check)
/// runs only while it is `false`, holding it: a stop waits for both, not
/// for the compile before them. The configuration ran before the gate, and
/// a stop that did not wait for it shut the runtime down under a plugin
/// that slept there (a panic in the log: "A Tokio 1.x context was found,
/// but it is being shutdown").
fn load_gated(
    engine: &PluginEngine,
    bytes: &[u8],
    settings: &[(String, String)],
    gates: Option<(
        &tokio::sync::Mutex<bool>,
        &Arc<tokio::sync::watch::Sender<bool>>,
    )>,
) -> anyhow::Result<Loaded> {
    let linked = Plugin::link(engine, bytes, settings)?;
    let open = match gates {
        Some((gate, _)) => {
            let closed = gate.blocking_lock();
            if *closed {
                return Err(Overtaken.into());
            }
            Some(closed)
        }
        None => None,
    };
    let plugin = linked.configure()?;
    let unchecked = self_check::run(engine, &plugin)?;
    // Its turn to be stored is taken while the gate is held: a stop that
    // closes the gate after it waits for the store too.
    let store = match gates {
        Some((_, stores)) if plugin.has_build_to_keep() => {
            let turn = StoreUnderWay::try_begin(stores);
            if turn.is_none() {
                tracing::info!("the new build is not stored in the compile cache: a write to it is still under way (a slow volume?); it is stored when it is next compiled");
            }
            turn
        }
        _ => None,
    };
    drop(open);
    Ok((plugin, store, unchecked))
}

/// The one compile cache write a slot lets run at a time (see
/// [`PluginSlot::stores_done`]), from before its build's swap to the
/// write's end. One at a time: on a volume that hangs, each reload would
/// otherwise leave a thread, and a build in memory, waiting for ever.
struct StoreUnderWay(Arc<tokio::sync::watch::Sender<bool>>);

impl StoreUnderWay {
    /// The turn to store, unless a write is under way.
    fn try_begin(stores: &Arc<tokio::sync::watch::Sender<bool>>) -> Option<StoreUnderWay> {
        let began = stores.send_if_modified(|storing| !std::mem::replace(storing, true));
        began.then(|| StoreUnderWay(stores.clone()))
    }
}

impl Drop for StoreUnderWay {
    fn drop(&mut self) {
        self.0.send_replace(false);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::gateway::self_check::tests::bundled_with_machine_id_3;

    /// A slot loaded from the bundled plugin's file in a new directory
    /// named for `tag` (to be removed by the test), with its metrics.
    fn slot_from_a_file(tag: &str) -> (PathBuf, Arc<PluginSlot>, Arc<Metrics>) {
        let dir = std::env::temp_dir().join(format!("snowgate-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory");
        let path = dir.join("plugin.wasm");
        std::fs::write(&path, snowgate_plugin_bundle::PLUGIN_WASM).expect("the plugin");
        let (engine, _) = bundled_with_machine_id_3();
        let metrics = Arc::new(Metrics::default());
        let slot = PluginSlot::load(engine, Some(path), Vec::new(), metrics.clone());
        (dir, Arc::new(slot.expect("loads")), metrics)
    }

    /// Reloads asked for while one runs share the one that runs next:
    /// five asked while a reload holds the lock are one reload, one
    /// failure counted, one answer for all. Before, each queued a reload
    /// (and a compile) of its own.
    #[tokio::test]
    async fn reloads_asked_for_while_one_runs_are_one() {
        let (dir, slot, metrics) = slot_from_a_file("queued");
        std::fs::write(dir.join("plugin.wasm"), b"not a component").expect("a bad build");
        let running = slot.reloading.lock().await;
        let answers: Vec<Answer> = (0..5).map(|_| slot.ask_for_reload()).collect();
        drop(running);
        for mut answer in answers {
            let answered = answer.wait_for(Option::is_some).await.expect("an answer");
            assert!(
                matches!(answered.as_ref(), Some(Err(NoReload::Failed(_)))),
                "{answered:?}"
            );
        }
        assert_eq!(metrics.reloads(), (0, 1));
        // One asked for after it ends runs again: on other bytes, another
        // refusal; on the same, that refusal, not counted again.
        std::fs::write(dir.join("plugin.wasm"), b"nor this").expect("a bad build");
        assert!(matches!(slot.reload().await, Err(NoReload::Failed(_))));
        assert_eq!(metrics.reloads(), (0, 2));
        assert!(matches!(slot.reload().await, Err(NoReload::Failed(_))));
        assert_eq!(metrics.reloads(), (0, 2));
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    /// Once reloads stop (a stop begins), callers waiting behind a reload
    /// under way are answered at once, and later ones without waiting:
    /// before, they waited for that reload to end, minutes for a large
    /// build's compile, and an admin client could get no answer at all.
    #[tokio::test]
    async fn callers_waiting_behind_a_reload_are_answered_when_reloads_stop() {
        let (dir, slot, metrics) = slot_from_a_file("stopped");
        // A reload under way, for as long as this test holds its lock.
        let running = slot.reloading.lock().await;
        let mut waiting = slot.ask_for_reload();
        slot.stop_reloads();
        // Bounded: before, this waited for the reload under way, for ever.
        let answered = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            waiting.wait_for(Option::is_some),
        )
        .await
        .expect("answered without waiting for the reload under way")
        .expect("an answer");
        assert!(
            matches!(answered.as_ref(), Some(Err(NoReload::NotPossible(m))) if m == STOPPING),
            "{answered:?}"
        );
        drop(answered);
        let later = slot.reload().await;
        assert!(
            matches!(&later, Err(NoReload::NotPossible(m)) if m == STOPPING),
            "{later:?}"
        );
        drop(running);
        assert_eq!(metrics.reloads(), (0, 0));
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    /// Only failures that may pass with the same build are retried by the
    /// file watch: a call out of time or without a free instance, a
    /// compile process that did not start or was killed; not a build
    /// refused for what it is.
    #[test]
    fn only_failures_that_may_pass_are_tried_again() {
        let wrapped = |error: anyhow::Error| error.context("self-check").context("reloading");
        let passing = [
            anyhow::Error::new(CallError::Deadline(std::time::Duration::from_millis(500))),
            anyhow::Error::new(CallError::Busy(64)),
            anyhow::Error::new(CompileFailure::Other("fork: EAGAIN".into())),
            anyhow::Error::new(ReadFailed::new(
                "reading the plugin p".into(),
                std::io::Error::from_raw_os_error(libc::EIO),
            )),
            anyhow::Error::new(CompileFailure::OutOfWallTime {
                limit: std::time::Duration::from_secs(1200),
                cpu_used: std::time::Duration::from_secs(100),
                starved: true,
                stopped: false,
            }),
            anyhow::Error::new(CompileFailure::OutOfCpuTime {
                limit: std::time::Duration::from_secs(600),
                killed: true,
            }),
        ];
        for error in passing {
            let error = wrapped(error);
            assert!(may_pass(&error), "{error:#}");
        }
        let for_good = [
            anyhow::Error::new(CallError::Trap("unreachable".into())),
            anyhow::Error::new(CallError::MemoryLimit(64 << 20)),
            anyhow::Error::new(CompileFailure::OutOfMemory {
                limit_bytes: 1 << 30,
            }),
            anyhow::Error::new(CompileFailure::OutOfCpuTime {
                limit: std::time::Duration::from_secs(600),
                killed: false,
            }),
            anyhow::anyhow!("self-check: the plugin stamped the id 1, which could repeat"),
            anyhow::Error::new(ReadFailed::new(
                "reading the plugin p".into(),
                std::io::Error::from(std::io::ErrorKind::NotFound),
            )),
            anyhow::Error::new(CompileFailure::OutOfWallTime {
                limit: std::time::Duration::from_secs(1200),
                cpu_used: std::time::Duration::from_secs(500),
                starved: false,
                stopped: false,
            }),
        ];
        for error in for_good {
            let error = wrapped(error);
            assert!(!may_pass(&error), "{error:#}");
        }
    }
}
