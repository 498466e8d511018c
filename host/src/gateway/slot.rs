//! The plugin that serves now, and how a new build replaces it: compiled
//! off the request path, checked, then swapped in atomically.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use anyhow::Context as _;
use arc_swap::ArcSwap;
use snowgate_plugin::SnowflakeLayout;

use crate::bindings::exports::snowgate::middleware::handler::{Action, Rejection};
use crate::call::{CallError, Fenced, SelfCheckAnswer};
use crate::clock::{Tick, TicksTaken};
use crate::compile_process::CompileFailure;
use crate::engine::PluginEngine;
use crate::gateway::metrics::Metrics;
use crate::gateway::plugin_file::{read_plugin_file, ReadFailed};
use crate::plugin::{hex_sha256, Plugin};
use crate::request::Request;
use crate::text_limits::{plugin_text, MAX_PLUGIN_TEXT};

/// The body of the canned request every new build must stamp (or reject
/// for want of credentials) before it may serve. The WIT's package docs describe this request.
const SELF_CHECK_BODY: &[u8] =
    br#"{"model":"snowgate-self-check","prompt":"","max_tokens":1,"disaggregated_params":{"request_type":"context_only"}}"#;

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
        self.deferred
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The last reload failure since the last success, if any.
    pub fn last_error(&self) -> Option<ReloadError> {
        self.last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
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
        let mut queued = self.queued.lock().unwrap_or_else(|p| p.into_inner());
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
            let mut queued = slot.queued.lock().unwrap_or_else(|p| p.into_inner());
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
        self.queued.lock().unwrap_or_else(|p| p.into_inner()).take();
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
        let self_checks = self.self_checks.clone();
        let stores = self.stores.clone();
        let file = path.display().to_string();
        // Reading and compiling take milliseconds to minutes: keep them off
        // the request threads.
        let outcome = tokio::task::spawn_blocking(move || -> anyhow::Result<Option<Loaded>> {
            let bytes = read_plugin_file(&path)?;
            let sha256 = hex_sha256(&bytes);
            if sha256 == current_sha {
                return Ok(None);
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
            *self.deferred.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
        match (outcome, put_off) {
            (Ok(Some((plugin, store, _unchecked_and_logged))), _) => {
                let sha = plugin.info().sha256.clone();
                let compiled = plugin.info().compiled.name();
                // Counted before the swap, and `/status` reads the serving
                // build first: whoever sees the new build sees its reload
                // counted and the last error cleared.
                *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = None;
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
                let cleared = self
                    .last_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .take();
                if cleared.is_some() {
                    tracing::info!(
                        "plugin reload: the file holds the build that serves again; the last \
                         reload error no longer holds"
                    );
                }
                Ok(Reloaded::Unchanged)
            }
            (Err(_), _) if overtaken => Err(NoReload::NotPossible(STOPPING.to_string())),
            (Err(e), Some(sha256)) => {
                let message =
                    format!("{e:#}; the file watch tries the build again once the host holds one");
                let mut deferred = self.deferred.lock().unwrap_or_else(|p| p.into_inner());
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
                *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(error.clone());
                self.metrics.reload(false);
                Err(NoReload::Failed(error))
            }
        }
    }
}

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
/// same way against that call's ticks, and then with a batch of two such
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

/// A self-check that cannot judge a build now: the host holds no machine
/// id it may use (why is inside), so the build's refusal for want of one
/// cannot be told from a build that refuses everything.
#[derive(Debug)]
struct CannotCheckNow {
    reason: String,
    /// The build's.
    sha256: String,
}

impl CannotCheckNow {
    /// `plugin`'s build cannot be checked now, for `reason`.
    fn of(plugin: &Plugin, reason: String) -> CannotCheckNow {
        CannotCheckNow {
            reason,
            sha256: plugin.info().sha256.clone(),
        }
    }
}

impl std::fmt::Display for CannotCheckNow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "self-check: the host holds no machine id it may use now ({}), so the build cannot \
             show that it stamps",
            self.reason
        )
    }
}

impl std::error::Error for CannotCheckNow {}

/// [`load_checked`], on a blocking thread; with `self_checks` (a
/// reload's), the self-check runs only while it is `false`, holding it.
fn load_gated(
    engine: &PluginEngine,
    bytes: &[u8],
    settings: &[(String, String)],
    gates: Option<(
        &tokio::sync::Mutex<bool>,
        &Arc<tokio::sync::watch::Sender<bool>>,
    )>,
) -> anyhow::Result<Loaded> {
    let plugin = Plugin::load(engine, bytes, settings)?;
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
    let identity = &engine.services().identity;
    let grant = identity.generation();
    let first_call = || {
        let mut instance = plugin.instance_for_self_check()?;
        let answer = instance.handle(&Canned::One.request())?;
        Ok::<_, CallError>((instance, answer))
    };
    let (mut instance, mut answer) = first_call().with_context(|| Canned::One.failed())?;
    // The build's one tick the first of its millisecond: the millisecond
    // turned between the host's spare tick and the build's, and a build
    // that drops the sequence would pass. Asked again, up to twice, each
    // time on a fresh instance.
    for _ in 0..SELF_CHECK_RETRIES {
        let first_of_its_millisecond = answer
            .fenced
            .ticks
            .is_some_and(|taken| taken.count == 1 && taken.first.sequence == 0);
        if !first_of_its_millisecond {
            break;
        }
        // Let go first: the check holds one of the pool's slots, not two.
        drop(instance);
        (instance, answer) = first_call().with_context(|| Canned::One.failed())?;
    }
    let made = HostIds {
        layout: identity.layout(),
        machine_id: identity.current().ok().map(|machine| machine.value),
    };
    let no_ids_now = || {
        why_no_ids_may_leave(engine).or_else(|| {
            // An id granted during the call: the plugin may have asked
            // before, and found none.
            (identity.generation() != grant)
                .then(|| "the machine id changed during the self-check".to_string())
        })
    };
    // A build that stamped the one request is called again on the same
    // instance, as kept instances are: with the same request, where one
    // that keeps an id (or what it made one of) from its instance's first
    // call shows it, and then with a batch, where one that repeats an id
    // within a call does.
    let judge = |canned, answer: SelfCheckAnswer| {
        judge_self_check(
            &plugin,
            canned,
            answer.fenced,
            &answer.ticks,
            &made,
            no_ids_now,
        )
    };
    let mut unchecked = Vec::new();
    match judge(Canned::One, answer)? {
        Judged::Unchecked(what) => unchecked.push(what),
        Judged::Stamped => {
            for canned in [Canned::Again, Canned::Batch] {
                let answer = instance
                    .handle(&canned.request())
                    .with_context(|| canned.failed())?;
                if let Judged::Unchecked(what) = judge(canned, answer)? {
                    unchecked.push(what);
                }
            }
        }
    }
    drop(instance);
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

/// How many times the self-check asks again when the build's one tick was
/// the first of its millisecond (see [`load_checked`]).
const SELF_CHECK_RETRIES: usize = 2;

/// The self-check's calls, as a tool that reports on it names them (see
/// [`Canned`]).
pub const SELF_CHECK_CALLS: &str =
    "a context-only request, the same again on the same instance, and a batch of two";

/// The canned requests of the self-check, one after another on one
/// instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Canned {
    /// One context-only request ([`SELF_CHECK_BODY`]), the instance's
    /// first call.
    One,
    /// The same again, the instance's second call.
    Again,
    /// A batch of two, the instance's third call: a JSON array of
    /// [`SELF_CHECK_BODY`] twice.
    Batch,
}

impl Canned {
    /// The request, `POST /v1/completions` of JSON.
    fn request(self) -> Request {
        let body = match self {
            Canned::One | Canned::Again => SELF_CHECK_BODY.to_vec(),
            Canned::Batch => [&b"["[..], SELF_CHECK_BODY, b",", SELF_CHECK_BODY, b"]"].concat(),
        };
        Request {
            method: "POST".into(),
            path: "/v1/completions".into(),
            headers: vec![("content-type".into(), b"application/json".to_vec())].into(),
            body,
        }
    }

    /// What the self-check's messages call it.
    fn named(self) -> &'static str {
        match self {
            Canned::One => "a canned context-only request",
            Canned::Again => "a canned context-only request again (its instance's second call)",
            Canned::Batch => {
                "a canned batch of two context-only requests (its instance's third call)"
            }
        }
    }

    /// The self-check's words for a call that failed.
    fn failed(self) -> String {
        format!("self-check: the plugin failed on {}", self.named())
    }

    /// The ids of the answer's body `value`, in order, or which one is
    /// missing.
    fn ids(self, value: &serde_json::Value) -> Result<Vec<u64>, &'static str> {
        let id = |request: &serde_json::Value| {
            request["disaggregated_params"]["disagg_request_id"].as_u64()
        };
        match self {
            Canned::One | Canned::Again => id(value).map(|id| vec![id]).ok_or("the request"),
            Canned::Batch => match value.as_array().map(Vec::as_slice) {
                Some([first, second]) => {
                    let first = id(first).ok_or("the batch's first request")?;
                    let second = id(second).ok_or("the batch's second request")?;
                    Ok(vec![first, second])
                }
                _ => Err("a batch of two (the body is no longer an array of two)"),
            },
        }
    }
}

/// What the self-check's id must carry besides a tick of the call: the
/// host's layout and machine id.
struct HostIds {
    layout: SnowflakeLayout,
    machine_id: Option<u32>,
}

impl HostIds {
    /// Why `id` was not made as the contract says (see [`load_checked`]),
    /// if it was not: of this layout and machine id, and of a tick the call
    /// took (`taken`, each of which is in `exact` where it holds them
    /// all). A build whose id is its own (a counter, a constant, another
    /// layout or machine id, the millisecond without the sequence, the
    /// tick after one it took) would repeat ids, and the host's check of
    /// each call's ids, which looks at the ticks it took, would not see it.
    fn misfit(&self, id: u64, taken: Option<TicksTaken>, exact: &[Tick]) -> Option<String> {
        let layout = self.layout;
        if let Err(e) = layout.decode(id) {
            return Some(format!("it is not an id of layout {layout}: {e}"));
        }
        let Some(taken) = taken else {
            return Some("the plugin took no tick of the host's id clock to make it".to_string());
        };
        // As the layout keeps the millisecond (39 bits of it in trtllm-v2).
        let kept = |tick: Tick| (layout.stamp(tick.millis), tick.sequence);
        let (first, last) = (kept(taken.first), kept(taken.last));
        // One tick taken: the id must be made of it. More: of one of them
        // where each is known; else of one from the first to the last
        // (other calls' ticks fall between), any across a 39-bit wrap
        // (2039).
        let all_known = taken.count == exact.len() as u64;
        let of_the_call = |made: (u64, u32)| match taken.count {
            1 => made == first,
            _ if all_known => exact.iter().any(|&tick| kept(tick) == made),
            _ => first > last || (first..=last).contains(&made),
        };
        // A v1 id from 2039 on reads two ways (see `readings`).
        let readings: Vec<_> = layout.readings(id).collect();
        let machine = |machine_id: u32| self.machine_id.is_none_or(|held| held == machine_id);
        if readings
            .iter()
            .any(|p| machine(p.machine_id) && of_the_call((p.millis, p.sequence)))
        {
            return None;
        }
        let read = readings[0];
        let ticks = match taken.count {
            1 => format!("the one it took, {first:?}"),
            n if all_known => {
                let each: Vec<_> = exact.iter().map(|&tick| kept(tick)).collect();
                format!("one of the {n} it took, {each:?}")
            }
            n => format!("from its first, {first:?}, to its last, {last:?} ({n} taken)"),
        };
        Some(
            match self.machine_id.filter(|&held| held != read.machine_id) {
                Some(held) => format!(
                    "it carries machine id {}, not the host's {held}",
                    read.machine_id
                ),
                None => format!(
                    "its (millisecond, sequence), ({}, {}), is not a tick the host's id clock \
                     gave the call: {ticks}",
                    read.millis, read.sequence
                ),
            },
        )
    }
}

/// How the self-check judged one answer that lets the build serve.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Judged {
    /// Stamped with ids made as the contract says.
    Stamped,
    /// Rejected, sending nothing on: what was not checked, and why.
    Unchecked(String),
}

/// Whether the self-check's answer to `canned` lets the build serve (see
/// [`load_checked`]), the call having taken `ticks` (all of them, or none
/// known); `made` is what its ids must be made of, and `no_ids_now` tells
/// why the host holds no machine id it may use now, if it holds none.
fn judge_self_check(
    plugin: &Plugin,
    canned: Canned,
    answer: Fenced,
    ticks: &[Tick],
    made: &HostIds,
    no_ids_now: impl Fn() -> Option<String>,
) -> anyhow::Result<Judged> {
    let asked = canned.named();
    match answer.action {
        Action::ForwardWithBody(body) => {
            let value: serde_json::Value = serde_json::from_slice(&body).with_context(|| {
                format!("self-check: the plugin answered {asked} with a body that is not JSON")
            })?;
            let ids = canned.ids(&value).map_err(|which| {
                anyhow::anyhow!(
                    "self-check: the plugin did not stamp an integer disagg_request_id on {which} \
                     of {asked}"
                )
            })?;
            for &id in &ids {
                if let Some(misfit) = made.misfit(id, answer.ticks, ticks) {
                    // The machine id changed after the host let the id out.
                    if let Some(reason) = no_ids_now() {
                        return Err(CannotCheckNow::of(plugin, reason).into());
                    }
                    anyhow::bail!(
                        "self-check: on {asked}, the plugin stamped the id {id}, which is not made \
                         of the host's clock and machine id, so it could repeat: {misfit}"
                    );
                }
            }
            if let [first, second] = ids[..] {
                if first == second {
                    anyhow::bail!(
                        "self-check: the plugin stamped the same id, {first}, on both requests of \
                         {asked}: it would repeat ids"
                    );
                }
            }
        }
        // The host withheld the self-check's id: the plugin took a tick,
        // and the refusal is the host's, so what the plugin would have
        // sent on is not known.
        Action::Reject(_) if answer.ids_withheld => {
            return Err(
                CannotCheckNow::of(plugin, "it withheld the id the self-check took".into()).into(),
            )
        }
        // The plugin refused for want of a machine id, or refuses
        // everything: which, cannot be told until the host holds one.
        Action::Reject(r) if r.status == 503 => {
            return Err(match no_ids_now() {
                Some(reason) => CannotCheckNow::of(plugin, reason).into(),
                None => refused(canned, r),
            });
        }
        // For want of credentials; or a plugin that takes no batches.
        Action::Reject(r)
            if matches!(r.status, 401 | 403) || (canned == Canned::Batch && r.status < 500) =>
        {
            let (sends, what) = match canned {
                Canned::Batch => ("no batch on", "it stamps batches"),
                _ => ("nothing on without an id", "it stamps"),
            };
            let unchecked = format!(
                "the plugin rejected {asked} ({} {}: {}); it may serve, as it sends {sends}, but \
                 whether {what} was not checked",
                r.status,
                plugin_text(r.code, MAX_PLUGIN_TEXT),
                plugin_text(r.message, MAX_PLUGIN_TEXT)
            );
            tracing::warn!(plugin = %plugin.info().name, "self-check: {unchecked}");
            return Ok(Judged::Unchecked(unchecked));
        }
        Action::Reject(r) => return Err(refused(canned, r)),
        Action::Forward => {
            anyhow::bail!("self-check: the plugin forwarded {asked} unstamped")
        }
    }
    Ok(Judged::Stamped)
}

/// The self-check's refusal of a build that rejected its valid `canned`
/// request.
fn refused(canned: Canned, r: Rejection) -> anyhow::Error {
    let (valid, may_pass) = match canned {
        Canned::One => (
            "context-only request",
            "only 401 and 403, for credentials the canned request cannot carry",
        ),
        Canned::Again => (
            "context-only request (its instance's second call)",
            "only 401 and 403, for credentials the canned request cannot carry",
        ),
        Canned::Batch => (
            "batch of two context-only requests (its instance's third call)",
            "only a status under 500, from a plugin that takes no batches",
        ),
    };
    anyhow::anyhow!(
        "self-check: the plugin rejected a valid {valid} with {} {}: {} ({may_pass}, may pass)",
        r.status,
        plugin_text(r.code, MAX_PLUGIN_TEXT),
        plugin_text(r.message, MAX_PLUGIN_TEXT)
    )
}

/// Why the host would not let an id made now out, if it would not (see
/// [`HostServices::ids_may_leave_now`]).
fn why_no_ids_may_leave(engine: &PluginEngine) -> Option<String> {
    engine.services().ids_may_leave_now().err()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use snowgate_plugin::SnowflakeLayout;

    use super::*;
    use crate::clock::IdClock;
    use crate::engine::HostServices;
    use crate::identity::MachineIdentity;
    use crate::limits::PluginLimits;
    use crate::utc::millis_of;

    /// An engine on the system clock with machine id 3 in trtllm-v1, and
    /// the bundled plugin loaded in it (not checked).
    fn bundled_with_machine_id_3() -> (PluginEngine, Plugin) {
        let identity = Arc::new(MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 3).unwrap());
        let services = HostServices {
            clock: Arc::new(IdClock::system()),
            identity,
        };
        let engine = PluginEngine::new(services, PluginLimits::default()).expect("an engine");
        let plugin =
            Plugin::load(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[]).expect("loads");
        (engine, plugin)
    }

    /// A plugin's own 503 (no tick taken) is judged only while the host
    /// holds a machine id: refused then, and while it holds none, neither
    /// passed nor refused but put off, naming why.
    #[test]
    fn a_plugins_503_is_put_off_while_the_host_holds_no_machine_id() {
        let (_engine, plugin) = bundled_with_machine_id_3();
        let refusal = || Fenced {
            action: Action::Reject(Rejection {
                status: 503,
                code: "no_machine_id".into(),
                message: "no machine id".into(),
            }),
            ids_withheld: false,
            ticks: None,
        };
        let error = judge_self_check(&plugin, Canned::One, refusal(), &[], &host_ids(), || {
            Some("the lease lapsed".into())
        })
        .expect_err("not passed");
        let put_off = error
            .downcast_ref::<CannotCheckNow>()
            .expect("put off, not refused");
        assert_eq!(put_off.sha256, plugin.info().sha256);
        assert!(
            format!("{error:#}").contains("(the lease lapsed)"),
            "{error:#}"
        );
        let error = judge_self_check(&plugin, Canned::One, refusal(), &[], &host_ids(), || None)
            .expect_err("refused");
        assert!(error.downcast_ref::<CannotCheckNow>().is_none());
        assert!(
            format!("{error:#}").contains("rejected a valid context-only request with 503"),
            "{error:#}"
        );
    }

    /// A host idle past its high-water mark (the disk stopped taking
    /// writes, no request since) holds no id it may let out, though no
    /// tick has passed the mark yet: a build is not checked then. Before,
    /// the question looked only at the last tick, the self-check's id was
    /// withheld, and a withheld id passed the build unseen. A withheld id is
    /// put off even once the mark is raised before the answer is judged (as
    /// the keeper raises it as soon as ids reach it), not refused as the
    /// plugin's own 503.
    #[test]
    fn a_build_is_not_checked_past_the_mark_even_before_any_id_passes_it() {
        let identity = Arc::new(MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 3).unwrap());
        let past = millis_of(SystemTime::now()) - 1_000;
        identity.bound_by_file_mark(past, past);
        let services = HostServices {
            clock: Arc::new(IdClock::system()),
            identity: identity.clone(),
        };
        let engine = PluginEngine::new(services, PluginLimits::default()).expect("an engine");
        let idle = why_no_ids_may_leave(&engine).expect("past the mark, idle");
        assert!(idle.contains("past the high-water mark"), "{idle}");
        let error = load_checked(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[])
            .expect_err("not checked past the mark");
        assert!(
            error.downcast_ref::<CannotCheckNow>().is_some(),
            "{error:#}"
        );

        let plugin =
            Plugin::load(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[]).expect("loads");
        let answer = plugin
            .instance_for_self_check()
            .and_then(|mut instance| instance.handle(&Canned::One.request()))
            .expect("answers")
            .fenced;
        assert!(answer.ids_withheld, "{:?}", answer.action);
        // The keeper raises the mark before the answer is judged.
        identity.ceiling_raised(past + 60_000, past + 30_000);
        assert_eq!(why_no_ids_may_leave(&engine), None, "the mark is raised");
        let error = judge_self_check(&plugin, Canned::One, answer, &[], &host_ids(), || {
            why_no_ids_may_leave(&engine)
        })
        .expect_err("put off");
        assert!(
            error
                .downcast_ref::<CannotCheckNow>()
                .is_some_and(|c| c.reason.contains("withheld")),
            "{error:#}"
        );
        // And with the mark raised, the build stamps.
        load_checked(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[]).expect("stamps");
    }

    /// In the 65.536 s before trtllm-v2's stamp wraps, where the plugin
    /// answers 503 `no_unique_id`, the host says no id may leave (so
    /// `/readyz` answers 503), and a build is put off, not refused as one
    /// that rejects valid requests.
    #[test]
    fn a_build_is_put_off_in_the_minute_before_the_v2_stamp_wraps() {
        let v2 = SnowflakeLayout::TrtllmV2;
        let wrap = 4u64 << 39;
        let services = |millis: u64| HostServices {
            clock: Arc::new(IdClock::new(crate::clock::FixedClock(millis))),
            identity: Arc::new(MachineIdentity::fixed(v2, 3).unwrap()),
        };
        let folding = services(wrap - 1000);
        let why = folding.ids_may_leave_now().expect_err("no unique id");
        assert!(
            why.contains("before the layout's 39-bit timestamp wraps"),
            "{why}"
        );
        let engine = PluginEngine::new(folding, PluginLimits::default()).expect("an engine");
        let error = load_checked(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[])
            .expect_err("not checked");
        assert!(
            error.downcast_ref::<CannotCheckNow>().is_some(),
            "{error:#}"
        );
        for millis in [wrap - (1 << 16) - 2, wrap] {
            let engine =
                PluginEngine::new(services(millis), PluginLimits::default()).expect("an engine");
            assert_eq!(engine.services().ids_may_leave_now(), Ok(()), "{millis}");
            load_checked(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[])
                .unwrap_or_else(|e| panic!("{millis}: {e:#}"));
        }
    }

    /// A wall clock a millisecond further at every reading: every tick
    /// of the id clock is the first of its millisecond.
    struct Racing(std::sync::atomic::AtomicU64);

    impl crate::clock::WallClock for Racing {
        fn now_millis(&self) -> u64 {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        }
    }

    /// Where the build's one tick is the first of its millisecond (the
    /// millisecond turned after the host's spare tick), the self-check asks
    /// again, twice at most, each time on a fresh instance: a build that
    /// drops the sequence would pass such a check. Where it is not, once.
    /// The same again and the batch are asked once, after the last. Each
    /// check lets its instance go before the next is made: the check holds
    /// one of the pool's slots, and here the pool has only one.
    #[test]
    fn a_self_check_whose_tick_began_a_millisecond_is_asked_again() {
        let ticks_taken = |clock: IdClock| {
            let clock = Arc::new(clock);
            let services = HostServices {
                clock: clock.clone(),
                identity: Arc::new(MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 3).unwrap()),
            };
            let one_slot = PluginLimits {
                max_instances: 1,
                ..PluginLimits::default()
            };
            let engine = PluginEngine::new(services, one_slot).expect("an engine");
            load_checked(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[]).expect("stamps");
            clock.issued()
        };
        let now = millis_of(SystemTime::now());
        // Two ticks a check of the one request (the host's spare, the
        // build's); then, once, one for the same again and two for the
        // batch.
        assert_eq!(
            ticks_taken(IdClock::new(crate::clock::FixedClock(now))),
            2 + 1 + 2
        );
        let racing = Racing(std::sync::atomic::AtomicU64::new(now));
        assert_eq!(
            ticks_taken(IdClock::new(racing)),
            2 * (1 + SELF_CHECK_RETRIES as u64) + 1 + 2
        );
    }

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
        // One asked for after it ends runs again.
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
            }),
        ];
        for error in for_good {
            let error = wrapped(error);
            assert!(!may_pass(&error), "{error:#}");
        }
    }

    /// Machine id 3 in trtllm-v1.
    fn host_ids() -> HostIds {
        HostIds {
            layout: SnowflakeLayout::TrtllmV1,
            machine_id: Some(3),
        }
    }

    /// The ticks of a call that took `count`, from `first` to `last`.
    fn took(first: (u64, u32), last: (u64, u32), count: u64) -> Option<TicksTaken> {
        let tick = |(millis, sequence)| Tick { millis, sequence };
        Some(TicksTaken {
            first: tick(first),
            last: tick(last),
            count,
        })
    }

    /// A self-check call records each tick it took (not the host's spare
    /// one), in order, so that the batch's ids are judged against those
    /// ticks, not against the range from the first to the last; up to 16,
    /// past which the range serves.
    #[test]
    fn a_self_check_call_records_each_tick_it_took() {
        let (_engine, plugin) = bundled_with_machine_id_3();
        let mut instance = plugin.instance_for_self_check().expect("an instance");
        let one = instance.handle(&Canned::One.request()).expect("answers");
        let taken = one.fenced.ticks.expect("a tick");
        assert_eq!(one.ticks, vec![taken.first]);
        let batch = instance.handle(&Canned::Batch.request()).expect("answers");
        let taken = batch.fenced.ticks.expect("ticks");
        assert_eq!(batch.ticks, vec![taken.first, taken.last]);
        let Action::ForwardWithBody(body) = batch.fenced.action else {
            panic!("stamped: {:?}", batch.fenced.action);
        };
        let value: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        let ids = Canned::Batch.ids(&value).expect("two ids");
        for (id, tick) in ids.into_iter().zip(&batch.ticks) {
            let read = SnowflakeLayout::TrtllmV1.decode(id).expect("an id");
            assert_eq!((read.millis, read.sequence), (tick.millis, tick.sequence));
        }
        let twenty = Request {
            body: format!(
                "[{}]",
                vec![std::str::from_utf8(SELF_CHECK_BODY).unwrap(); 20].join(",")
            )
            .into_bytes(),
            ..Canned::One.request()
        };
        let many = instance.handle(&twenty).expect("answers");
        assert_eq!(many.fenced.ticks.map(|taken| taken.count), Some(20));
        assert_eq!(many.ticks.len(), 16);
    }

    /// The batch, the instance's third call, passes only with two
    /// distinct ids made of its own ticks; a plugin that takes no batches
    /// may reject it with a status under 500 (it sends none on), but not
    /// forward it unstamped or fail it with a 5xx of its own. The same
    /// request again, the second call, is judged as the first: only 401
    /// and 403 pass unchecked.
    #[test]
    fn the_batch_passes_with_two_distinct_ids_or_a_plugins_4xx() {
        let (_engine, plugin) = bundled_with_machine_id_3();
        let v1 = SnowflakeLayout::TrtllmV1;
        let now = millis_of(SystemTime::now());
        let one = |id: u64| {
            format!(
                r#"{{"disaggregated_params":{{"request_type":"context_only","disagg_request_id":{id}}}}}"#
            )
        };
        let tick = |sequence| Tick {
            millis: now - 2,
            sequence,
        };
        // Two ticks, 7 and 9, another call's 8 between them.
        let judged_of = |canned, action: Action, exact: &[Tick]| {
            let answer = Fenced {
                action,
                ids_withheld: false,
                ticks: took((now - 2, 7), (now - 2, 9), 2),
            };
            judge_self_check(&plugin, canned, answer, exact, &host_ids(), || None)
                .map_err(|e| format!("{e:#}"))
        };
        let judged = |action| judged_of(Canned::Batch, action, &[tick(7), tick(9)]);
        let batch = |body: String| Action::ForwardWithBody(body.into_bytes());
        let reject = |status| {
            Action::Reject(Rejection {
                status,
                code: "no_batches".into(),
                message: "send one request at a time".into(),
            })
        };
        let id = |sequence| v1.compose(now - 2, 3, sequence).unwrap();
        let (a, b) = (id(7), id(9));
        assert_eq!(
            judged(batch(format!("[{},{}]", one(a), one(b)))),
            Ok(Judged::Stamped)
        );
        let Ok(Judged::Unchecked(what)) = judged(reject(400)) else {
            panic!("a batch rejected with 400 passes unchecked");
        };
        assert!(
            what.contains("whether it stamps batches was not checked"),
            "{what}"
        );
        let again = |status| judged_of(Canned::Again, reject(status), &[]);
        assert!(matches!(again(401), Ok(Judged::Unchecked(_))));
        let error = again(400).expect_err("the same request again rejected with 400");
        assert!(
            error.contains(
                "rejected a valid context-only request (its instance's second call) with 400"
            ),
            "{error}"
        );
        for (action, says) in [
            (
                batch(format!("[{},{}]", one(a), one(a))),
                format!("stamped the same id, {a}, on both requests of a canned batch of two"),
            ),
            (
                batch(format!("[{},{{}}]", one(a))),
                "did not stamp an integer disagg_request_id on the batch's second request".into(),
            ),
            (
                batch(one(a)),
                "the body is no longer an array of two".into(),
            ),
            (
                Action::Forward,
                "forwarded a canned batch of two context-only requests (its instance's third \
                 call) unstamped"
                    .into(),
            ),
            (
                reject(500),
                "rejected a valid batch of two context-only requests (its instance's third \
                 call) with 500"
                    .into(),
            ),
            // Made of a tick outside the call's: the instance kept it.
            (
                batch(format!(
                    "[{},{}]",
                    one(v1.compose(now - 9, 3, 7).unwrap()),
                    one(b)
                )),
                "on a canned batch of two context-only requests (its instance's third call), \
                 the plugin stamped the id"
                    .into(),
            ),
            // The tick after its first, assumed its own: another call's.
            (
                batch(format!("[{},{}]", one(a), one(id(8)))),
                "is not a tick the host's id clock gave the call: one of the 2 it took".into(),
            ),
        ] {
            let error = judged(action).expect_err(&says);
            assert!(error.contains(&says), "{says}: {error}");
        }
        // Where the call's ticks are not all known, any between its first
        // and last passes.
        let ranged = batch(format!("[{},{}]", one(a), one(id(8))));
        assert_eq!(judged_of(Canned::Batch, ranged, &[]), Ok(Judged::Stamped));
    }

    /// A build that stamps an id of its own, not made of a tick it took
    /// and the host's machine id, would repeat ids, and the host's check
    /// of each call, which looks at the ticks taken, does not see it: the
    /// self-check refuses it, saying what is wrong with the id. An id made
    /// of the call's tick and the host's machine id passes.
    #[test]
    fn a_build_that_stamps_an_id_of_its_own_is_refused() {
        let (engine, plugin) = bundled_with_machine_id_3();
        let v1 = SnowflakeLayout::TrtllmV1;
        let now = millis_of(SystemTime::now());
        let stamped = |id: u64, ticks: Option<TicksTaken>| {
            Fenced {
            action: Action::ForwardWithBody(
                format!(r#"{{"disaggregated_params":{{"request_type":"context_only","disagg_request_id":{id}}}}}"#)
                    .into_bytes(),
            ),
            ids_withheld: false,
            ticks,
        }
        };
        let judged = |id: u64, ticks: Option<TicksTaken>| {
            judge_self_check(
                &plugin,
                Canned::One,
                stamped(id, ticks),
                &[],
                &host_ids(),
                || None,
            )
            .map_err(|e| format!("{e:#}"))
        };
        let one = took((now - 2, 7), (now - 2, 7), 1);
        // Three ticks, with other calls' ticks between them.
        let three = took((now - 5, 0), (now, 2), 3);
        let good = v1.compose(now - 2, 3, 7).unwrap();
        assert_eq!(judged(good, one), Ok(Judged::Stamped));
        assert_eq!(judged(good, three), Ok(Judged::Stamped));
        for (id, ticks, says) in [
            // A constant, below the layout's smallest id.
            (1_099_511_628_800, one, "not an id of layout trtllm-v1"),
            (
                v1.compose(now - 2, 4, 7).unwrap(),
                one,
                "machine id 4, not the host's 3",
            ),
            (
                v1.compose(now - 60_000, 3, 7).unwrap(),
                one,
                "not a tick the host's id clock gave the call: the one it took",
            ),
            // The tick's millisecond, its sequence dropped.
            (
                v1.compose(now - 2, 3, 0).unwrap(),
                one,
                "is not a tick the host's id clock gave the call",
            ),
            // Another call's tick, between this one's.
            (
                v1.compose(now - 2, 3, 8).unwrap(),
                one,
                "is not a tick the host's id clock gave the call",
            ),
            (v1.compose(now + 1, 3, 0).unwrap(), three, "(3 taken)"),
            (good, None, "took no tick"),
        ] {
            let error = judged(id, ticks).expect_err(says);
            assert!(error.contains(says), "{error}");
            assert!(error.contains("could repeat"), "{error}");
        }
        // A v1 id from 2039-09-07 15:30:06.976 UTC on is folded by the
        // rotation, and decodes as a 1970 time: it passes, read as made.
        let late = (1u64 << 41) + 5;
        let folded = v1.compose_unique(late, 3, 7).unwrap();
        assert_ne!(v1.decode(folded).unwrap().millis, late);
        let in_2039 = took((late, 7), (late, 7), 1);
        assert_eq!(judged(folded, in_2039), Ok(Judged::Stamped));
        assert!(judged(v1.compose_unique(late, 4, 7).unwrap(), in_2039).is_err());
        // Where the machine id changed meanwhile, the build is put off.
        let other = v1.compose(now - 2, 4, 7).unwrap();
        let error = judge_self_check(
            &plugin,
            Canned::One,
            stamped(other, one),
            &[],
            &host_ids(),
            || Some("the machine id changed during the self-check".into()),
        )
        .expect_err("put off");
        assert!(
            error.downcast_ref::<CannotCheckNow>().is_some(),
            "{error:#}"
        );
        // The bundled plugin's id passes, through the real call.
        load_checked(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[]).expect("stamps");
    }
}
