//! Where the plugin is called: one request at a time in an instance (a
//! fresh one, or one kept from earlier calls, up to
//! `calls_per_instance`), under the memory limit and the deadline of
//! running time.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use wasmtime::component::{Instance, TypedFunc};
use wasmtime::{PoolConcurrencyLimitError, Store, Trap};

use crate::bindings::exports::snowgate::middleware::handler::{Action, PluginError, Setting};
use crate::bindings::Middleware;
use crate::call_clock::{excluding_waits, CallClock};
use crate::engine::EPOCH_TICK;
use crate::header_edits::HeaderEdits;
use crate::id_clock::Tick;
use crate::id_fence::Fenced;
use crate::limits::PluginLimits;
use crate::log_throttle::LogThrottle;
use crate::plugin::Plugin;
use crate::request::{Request, RequestRecord};
use crate::state::HostState;
use crate::text_limits::{cut, plugin_text, MAX_PLUGIN_TEXT, MAX_REJECT_CODE};

/// The typed `handle` export of one instance.
type HandleFunc = TypedFunc<(RequestRecord<'static>,), (Result<Action, PluginError>,)>;

/// The typed `configure` export of one instance.
type ConfigureFunc = TypedFunc<(&'static [Setting],), (Result<(), String>,)>;

/// An instance that may serve more than one request, one at a time.
pub(crate) struct Reusable {
    store: Store<HostState>,
    handle: HandleFunc,
    calls: u32,
    /// The instance's memory once configured, before its first request.
    configured_memory: usize,
    /// The store's call clock, held here so that a call need not clone it.
    clock: Arc<CallClock>,
}

/// An instance in a sync store, configured, called one request at a time.
struct SyncInstance<'p> {
    plugin: &'p Plugin,
    store: Store<HostState>,
    handle: HandleFunc,
    calls: u32,
}

impl SyncInstance<'_> {
    /// Calls `handle` on `request`: the fenced answer and the changes to
    /// the request's headers the call asked for. With `spare_first`, the
    /// host drops a tick before the call's first (see
    /// [`SelfCheckInstance::handle`]).
    fn call(
        &mut self,
        request: &Request,
        spare_first: bool,
    ) -> Result<(Fenced, HeaderEdits), CallError> {
        let plugin = self.plugin;
        let store = &mut self.store;
        if self.calls > 0 {
            plugin.start_sync_call(store);
        }
        self.calls += 1;
        store.data_mut().lend_headers(&request.headers);
        store.data_mut().issued.spare_first = spare_first;
        let answer = self.handle.call(&mut *store, (RequestRecord::of(request),));
        let header_edits = store.data_mut().take_back_headers();
        let answer = match answer {
            Ok((answer,)) => answer,
            Err(e) => return Err(plugin.classify(e, store)),
        };
        let action = answer.map_err(|e| plugin_error(e.message))?;
        let action = plugin.check(action)?;
        Ok((plugin.fence(action, store), header_edits))
    }
}

/// An instance of the gateway's self-check (see
/// [`Plugin::instance_for_self_check`]).
pub struct SelfCheckInstance<'p> {
    instance: SyncInstance<'p>,
}

/// A self-check call's answer, with the ticks it took.
#[derive(Debug)]
pub struct SelfCheckAnswer {
    /// The answer, after the host's check of its ids.
    pub fenced: Fenced,
    /// Each tick of the host's id clock the call took, in order: all of
    /// them where they are as many as `fenced.ticks` counts, which holds
    /// for up to 16.
    pub ticks: Vec<Tick>,
    /// Why the host's id clock refused the call a tick it asked for, if it
    /// did (ids asked for faster than the layout makes them): a plugin's
    /// 503 then is the host's doing, which passes.
    pub clock_refused: Option<crate::id_clock::NoTick>,
}

impl SelfCheckInstance<'_> {
    /// [`Plugin::handle`] on this instance, as the self-check needs it:
    /// telling also whether the host withheld the ids the call made (its
    /// answer is then the host's 503 in place of the plugin's; by the time
    /// the check asks the host again, the reason may have passed), and
    /// which ticks of the id clock the call took, each of them. Each call
    /// has its own deadline.
    ///
    /// Before the plugin's first tick in the instance's first call, the
    /// host takes one of its own and drops it, so that the plugin's is not
    /// the first of its millisecond (sequence 0) but by the rarest chance:
    /// a build that stamps the millisecond and drops the sequence then
    /// shows it.
    pub fn handle(&mut self, request: &Request) -> Result<SelfCheckAnswer, CallError> {
        let spare_first = self.instance.calls == 0;
        self.instance.store.data_mut().recorded_ticks = Some(Vec::new());
        let answer = self.instance.call(request, spare_first);
        let ticks = self.instance.store.data_mut().recorded_ticks.take();
        let clock_refused = self.instance.store.data().issued.refused;
        answer.map(|(fenced, _)| SelfCheckAnswer {
            fenced,
            ticks: ticks.unwrap_or_default(),
            clock_refused,
        })
    }
}

/// How long an async call runs before it starts giving its thread back at
/// every epoch tick. Yielding sends the call to the back of the event
/// loop's queue, behind every ready connection: worth it for a call that
/// would hold the thread for long, not for the ordinary sub-millisecond
/// one that happens to span a tick.
pub const YIELD_AFTER: Duration = Duration::from_millis(2);

/// An instance whose memory grew by more than this since `configure` (or
/// past it in all) is not reused: its pages go back to the system, rather
/// than a large call's memory being kept by an idle instance. Measured
/// from `configure`, so that a plugin whose language runtime starts larger
/// (CPython, a JavaScript engine) is reused too.
const REUSE_MAX_GROWTH: usize = crate::engine::MEMORY_KEEP_RESIDENT;

/// Why a plugin call gave no answer. The gateway applies its failure policy
/// to every kind alike.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallError {
    /// The call ran past its deadline (wall-clock running time, less the
    /// time it waited for its turn after yielding).
    Deadline(Duration),
    /// The plugin tried to grow its memory past the limit.
    MemoryLimit(usize),
    /// The plugin trapped (a Rust plugin's panic is a trap), with the trap
    /// and whatever the plugin wrote to stderr.
    Trap(String),
    /// The plugin reported its own failure.
    PluginError(String),
    /// The plugin answered something the host cannot use.
    InvalidAnswer(String),
    /// Every instance slot was taken (see
    /// [`PluginLimits::max_instances`](crate::PluginLimits::max_instances),
    /// which this carries): the plugin did not run.
    Busy(u32),
}

impl CallError {
    /// Every [`CallError::kind`], in the order of
    /// [`CallError::kind_index`].
    pub const KINDS: [&'static str; 6] = [
        "deadline",
        "memory_limit",
        "trap",
        "plugin_error",
        "invalid_answer",
        "busy",
    ];

    /// A short label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        CallError::KINDS[self.kind_index()]
    }

    /// Where this error's kind is in [`CallError::KINDS`]: for a counter
    /// or a log throttle per kind.
    pub fn kind_index(&self) -> usize {
        match self {
            CallError::Deadline(_) => 0,
            CallError::MemoryLimit(_) => 1,
            CallError::Trap(_) => 2,
            CallError::PluginError(_) => 3,
            CallError::InvalidAnswer(_) => 4,
            CallError::Busy(_) => 5,
        }
    }

    /// Whether the same request would fail the same way again: the plugin
    /// ran out of memory, trapped, or answered what the host cannot use,
    /// none of which a retry changes. A deadline (the machine may have been
    /// busy), the plugin's own error, and no free instance may pass.
    pub fn fails_again(&self) -> bool {
        matches!(
            self,
            CallError::MemoryLimit(_) | CallError::Trap(_) | CallError::InvalidAnswer(_)
        )
    }

    /// What a client may be told: the kind of failure and the host's own
    /// limits, but not what the plugin said or wrote. A trap's panic text
    /// and stderr, or a plugin's error message, can hold its internals or
    /// another request's data; the full error is for the gateway's log.
    pub fn public_message(&self) -> String {
        match self {
            CallError::Trap(_) => "the plugin trapped (the gateway's log has the details)".into(),
            CallError::PluginError(_) => {
                "the plugin reported an error (the gateway's log has it)".into()
            }
            _ => self.to_string(),
        }
    }
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CallError::Deadline(limit) => write!(
                f,
                "the plugin ran past its {} ms deadline",
                limit.as_millis()
            ),
            CallError::MemoryLimit(limit) => {
                write!(
                    f,
                    "the plugin tried to use more than its {} MiB memory limit",
                    limit >> 20
                )
            }
            CallError::Trap(detail) => write!(f, "the plugin trapped: {detail}"),
            CallError::PluginError(message) => write!(f, "the plugin failed: {message}"),
            CallError::InvalidAnswer(detail) => {
                write!(f, "the plugin gave an unusable answer: {detail}")
            }
            CallError::Busy(slots) => write!(
                f,
                "the plugin could not run: all {slots} plugin instance slots are in use"
            ),
        }
    }
}

impl std::error::Error for CallError {}

/// What a plugin answered about a request, with the changes it made to the
/// request's headers.
#[derive(Debug)]
pub struct Answer {
    /// What to do with the request.
    pub action: Action,
    /// The changes to make on the request's headers if it is forwarded, in
    /// order; none when `action` rejects it.
    pub header_edits: HeaderEdits,
    /// Whether `action` rejects the request because no id could be issued
    /// for it (see [`Fenced::ids_unavailable`]).
    pub ids_unavailable: bool,
}

impl Answer {
    /// `fenced`'s action, with `header_edits` unless it rejects the
    /// request.
    fn new(fenced: Fenced, header_edits: HeaderEdits) -> Answer {
        let rejects = matches!(fenced.action, Action::Reject(_));
        Answer {
            ids_unavailable: fenced.ids_unavailable,
            header_edits: if rejects {
                HeaderEdits::default()
            } else {
                header_edits
            },
            action: fenced.action,
        }
    }
}

impl Plugin {
    /// Runs the plugin on one request in a fresh instance and returns its
    /// answer. Nothing of the instance outlives the call.
    ///
    /// For sync callers: the plugin's WASI calls (a panic message on
    /// stderr) block on a runtime of their own, which cannot be done on an
    /// async runtime's thread. From async code use
    /// [`Plugin::handle_async`]. The changes the plugin made to the
    /// request's headers are dropped (see [`Plugin::answer`]).
    pub fn handle(&self, request: &Request) -> Result<Action, CallError> {
        self.call_once(request).map(|(fenced, _)| fenced.action)
    }

    /// Like [`Plugin::handle`], with the changes the plugin made to the
    /// request's headers (`header-edits`): none when the answer rejects
    /// it. The sync counterpart of [`Plugin::answer_async`], for a tool
    /// that shows a plugin's answer (`snowgate rewrite`).
    pub fn answer(&self, request: &Request) -> Result<Answer, CallError> {
        self.call_once(request)
            .map(|(fenced, header_edits)| Answer::new(fenced, header_edits))
    }

    /// A fresh instance for the gateway's self-check of a new build, to
    /// call once or more, one request after another, as the gateway's kept
    /// instances are called: a build that keeps an id, or what it made one
    /// of, from one call to the next shows it on the second.
    pub fn instance_for_self_check(&self) -> Result<SelfCheckInstance<'_>, CallError> {
        Ok(SelfCheckInstance {
            instance: self.sync_instance()?,
        })
    }

    /// One call in a fresh instance: the fenced answer and the changes to
    /// the request's headers the call asked for.
    fn call_once(&self, request: &Request) -> Result<(Fenced, HeaderEdits), CallError> {
        self.sync_instance()?.call(request, false)
    }

    /// A fresh instance in a fresh sync store, configured: the deadline of
    /// its first call covers instantiation and `configure` too.
    fn sync_instance(&self) -> Result<SyncInstance<'_>, CallError> {
        let (mut store, instance) = self.instantiate()?;
        match self.configure(&mut store, instance) {
            Ok(Ok(handle)) => Ok(SyncInstance {
                plugin: self,
                store,
                handle,
                calls: 0,
            }),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(self.classify(e, &store)),
        }
    }

    /// Like [`Plugin::handle`], for async callers (the gateway), and on an
    /// instance that may have served earlier requests (up to
    /// [`PluginLimits::calls_per_instance`](crate::PluginLimits::calls_per_instance)).
    ///
    /// The call runs on a fiber on the calling thread: no hand-off to
    /// another thread. A call that has run for [`YIELD_AFTER`] gives the
    /// thread back to the executor at every epoch tick (1 ms), so a slow or
    /// runaway plugin delays other requests by at most that much each time,
    /// until its deadline ends it.
    ///
    /// It gives the thread back with `tokio::task::yield_now`, which on a
    /// tokio runtime wakes the call only after the runtime has polled its
    /// sockets and timers. Poll the returned future from a tokio task, or
    /// from a thread that runs no tokio runtime at all; not from another
    /// executor nested inside a tokio task (`futures::executor::block_on`
    /// there), where a long call would wait for a wake that comes only
    /// once that tokio worker parks.
    ///
    /// The changes the plugin made to the request's headers are dropped:
    /// a host that forwards requests uses [`Plugin::answer_async`].
    pub async fn handle_async(&self, request: &Request) -> Result<Action, CallError> {
        self.answer_async(request).await.map(|answer| answer.action)
    }

    /// Like [`Plugin::handle_async`], with the changes the plugin made to
    /// the request's headers (`header-edits`), to make on the request it
    /// forwards: none when the answer rejects it.
    pub async fn answer_async(&self, request: &Request) -> Result<Answer, CallError> {
        let mut held = match self.take_idle() {
            Some(mut held) => {
                self.start_async_call(&mut held.store);
                held
            }
            // Its clock started before instantiation: one deadline covers
            // instantiation, `configure` and this first call.
            None => self.new_reusable().await?,
        };
        held.store.data_mut().lend_headers(&request.headers);
        let answer = excluding_waits(
            &held.clock,
            &self.engine.queued_calls,
            held.handle
                .call_async(&mut held.store, (RequestRecord::of(request),)),
        )
        .await;
        let header_edits = held.store.data_mut().take_back_headers();
        held.calls += 1;
        let answer = match answer {
            Ok((answer,)) => answer,
            // The instance is dropped with the error: never used again.
            Err(e) => return Err(self.classify(e, &held.store)),
        };
        let checked = match answer {
            Ok(action) => self
                .check(action)
                .map(|action| Answer::new(self.fence(action, &held.store), header_edits)),
            Err(e) => Err(plugin_error(e.message)),
        };
        if !matches!(checked, Err(CallError::InvalidAnswer(_))) {
            self.give_back(held);
        }
        checked
    }

    /// Starts the clock of the next async call in `store`: its deadline
    /// and when it starts yielding, checked at the next epoch tick.
    fn start_async_call(&self, store: &mut Store<HostState>) {
        store
            .data_mut()
            .begin_call(self.engine.limits.deadline, YIELD_AFTER);
        store.set_epoch_deadline(1);
    }

    /// An idle instance of this plugin, if one is kept. Instances made
    /// under an earlier machine id grant are dropped instead: a plugin may
    /// have kept that machine id in its memory.
    fn take_idle(&self) -> Option<Reusable> {
        let mut idle = self.idle.lock().ok()?;
        let kept = idle.as_mut()?;
        let held = kept.pop()?;
        if self.of_current_grant(&held.store) {
            return Some(held);
        }
        // Only instances of the grant current when they were given back
        // are kept (see `give_back`), newest on top: below a stale one,
        // all are stale.
        let stale = std::mem::take(kept);
        drop(idle);
        // Dropped outside the lock: returning slots to the pool takes time.
        drop((held, stale));
        None
    }

    /// Whether the instance in `store` was made under the machine id grant
    /// that is current.
    fn of_current_grant(&self, store: &Store<HostState>) -> bool {
        store.data().created_under == self.engine.services.identity.generation()
    }

    /// Keeps `held` for another request, unless it has served its share,
    /// grew its memory, left something in stderr, was made under an earlier
    /// machine id grant, or enough are kept.
    ///
    /// Where the plugin's own doing (its memory's growth, stderr) is why,
    /// the log says so once per build: otherwise nothing told its author
    /// that every request paid a fresh instance.
    fn give_back(&self, held: Reusable) {
        let limits = self.engine.limits;
        let state = held.store.data();
        let grew = state.memory.peak.saturating_sub(held.configured_memory);
        let grew_too_much = grew > REUSE_MAX_GROWTH;
        let its_doing = grew_too_much || state.wrote_stderr();
        // Said once: the reason is put into words only then.
        if its_doing
            && !self
                .told_not_kept
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            let why = if grew_too_much {
                format!(
                    "its memory grew by {grew} bytes after configure, more than {} MiB",
                    REUSE_MAX_GROWTH >> 20
                )
            } else {
                "it wrote to stderr".to_string()
            };
            tracing::info!(
                target: "snowgate::plugin",
                plugin = %self.name,
                "an instance of this build was not kept for another request: {why}; each \
                 call that does so runs on a fresh instance, which costs a plugin of a large \
                 runtime most (said once per build)"
            );
        }
        let reusable = held.calls < limits.calls_per_instance
            && !its_doing
            && !state.memory.hit
            && self.of_current_grant(&held.store);
        if !reusable {
            return;
        }
        if let Ok(mut idle) = self.idle.lock() {
            if let Some(kept) = idle.as_mut() {
                if kept.len() < limits.kept_instances() as usize {
                    kept.push(held);
                }
            }
        }
    }

    /// Frees the instances kept for reuse, and keeps none from now on:
    /// for a plugin that a newer build replaced, so that the instance
    /// slots it held serve the new one. Calls already running finish, and
    /// later calls still work, each on a fresh instance.
    pub fn retire(&self) {
        let dropped = self.idle.lock().ok().and_then(|mut idle| idle.take());
        // Dropped outside the lock: returning slots to the pool takes time.
        drop(dropped);
    }

    /// A fresh instance in a fresh store, configured, for async calls.
    async fn new_reusable(&self) -> Result<Reusable, CallError> {
        let mut store = self.new_store();
        // Each call sets its own deadline in the state, checked at every
        // epoch tick.
        store.epoch_deadline_callback(|store| Ok(store.data().on_epoch_tick()));
        self.start_async_call(&mut store);
        let clock = store.data().clock.clone();
        let instance = match excluding_waits(
            &clock,
            &self.engine.queued_calls,
            self.pre_async.instantiate_async(&mut store),
        )
        .await
        {
            Ok(instance) => instance,
            Err(e) => return Err(self.classify(e, &store)),
        };
        let configuring = self.configure_async(&mut store, instance);
        match excluding_waits(&clock, &self.engine.queued_calls, configuring).await {
            Ok(Ok(handle)) => Ok(Reusable {
                configured_memory: store.data().memory.peak,
                clock,
                store,
                handle,
                calls: 0,
            }),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(self.classify(e, &store)),
        }
    }

    /// `configure` on a new instance made by `pre_async`; then the typed
    /// `handle` export for its requests.
    async fn configure_async(
        &self,
        store: &mut Store<HostState>,
        instance: Instance,
    ) -> wasmtime::Result<Result<HandleFunc, CallError>> {
        let configure = self.configure_export(store, instance)?;
        let (answer,) = configure.call_async(&mut *store, (&self.settings,)).await?;
        self.handle_export(store, instance, answer)
    }

    /// `configure` on a new instance made by `pre`; then the typed `handle`
    /// export for its request.
    fn configure(
        &self,
        store: &mut Store<HostState>,
        instance: Instance,
    ) -> wasmtime::Result<Result<HandleFunc, CallError>> {
        let configure = self.configure_export(store, instance)?;
        let (answer,) = configure.call(&mut *store, (&self.settings,))?;
        self.handle_export(store, instance, answer)
    }

    /// The typed `configure` export of `instance`.
    fn configure_export(
        &self,
        store: &mut Store<HostState>,
        instance: Instance,
    ) -> wasmtime::Result<ConfigureFunc> {
        instance.get_typed_func(&mut *store, self.exports.configure)
    }

    /// After `configure` answered `answer`: its refusal as a plugin error,
    /// or the typed `handle` export of `instance`.
    fn handle_export(
        &self,
        store: &mut Store<HostState>,
        instance: Instance,
        answer: Result<(), String>,
    ) -> wasmtime::Result<Result<HandleFunc, CallError>> {
        if let Err(refusal) = answer {
            return Ok(Err(plugin_error(format!("configure: {refusal}"))));
        }
        let handle = instance.get_typed_func(&mut *store, self.exports.handle)?;
        Ok(Ok(handle))
    }

    /// A fresh store under the memory limit, with no deadline set yet.
    pub(crate) fn new_store(&self) -> Store<HostState> {
        let state = HostState::new(
            self.engine.services.clone(),
            self.engine.limits.memory_bytes,
            self.name.clone(),
        );
        let mut store = Store::new(&self.engine.engine, state);
        store.limiter(|state| &mut state.memory);
        store.set_hostcall_fuel(hostcall_fuel(&self.engine.limits));
        store.set_max_component_handles(crate::engine::MAX_PLUGIN_HANDLES);
        store
    }

    /// A fresh store under the limits, with the deadline of a sync call.
    fn new_sync_store(&self) -> Store<HostState> {
        let mut store = self.new_store();
        store.epoch_deadline_trap();
        self.start_sync_call(&mut store);
        store
    }

    /// Starts the deadline of the next sync call in `store`.
    fn start_sync_call(&self, store: &mut Store<HostState>) {
        let limits = self.engine.limits;
        // One tick may be nearly over already: allow one extra.
        let ticks = limits.deadline.as_micros().div_ceil(EPOCH_TICK.as_micros()) as u64 + 1;
        store.set_epoch_deadline(ticks);
        // For the plugin's WASI waits (see `sleeps`); a call that never
        // yields counts wall time.
        store.data_mut().begin_call(limits.deadline, Duration::MAX);
    }

    /// A fresh store under the limits, and the plugin instantiated in it.
    pub(crate) fn instantiate(&self) -> Result<(Store<HostState>, Instance), CallError> {
        let mut store = self.new_sync_store();
        match self.pre.instance_pre().instantiate(&mut store) {
            Ok(instance) => Ok((store, instance)),
            Err(e) => Err(self.classify(e, &store)),
        }
    }

    /// Like [`Plugin::instantiate`], for the load-time check: instantiates
    /// without the typed bindings and checks the type of each handler
    /// export first, so that a build whose function has another signature
    /// than the world's is refused naming that function.
    pub(crate) fn instantiate_checked(&self) -> anyhow::Result<(Store<HostState>, Middleware)> {
        let mut store = self.new_sync_store();
        let instance = self
            .pre
            .instance_pre()
            .instantiate(&mut store)
            .map_err(|e| anyhow::Error::new(self.classify(e, &store)))?;
        let exports = &self.exports;
        fn wrong(
            function: &'static str,
            signature: &'static str,
        ) -> impl FnOnce(wasmtime::Error) -> anyhow::Error {
            let contract = crate::plugin::PACKAGE;
            move |e: wasmtime::Error| {
                anyhow::anyhow!(
                    "the plugin's {function} export has another type than the {contract} contract's \
                     `{function}: {signature}`: {}",
                    e.root_cause()
                )
            }
        }
        instance
            .get_typed_func::<(), (String,)>(&mut store, &exports.name)
            .map_err(wrong("name", "func() -> string"))?;
        instance
            .get_typed_func::<(), (String,)>(&mut store, &exports.version)
            .map_err(wrong("version", "func() -> string"))?;
        instance
            .get_typed_func::<(&[Setting],), (Result<(), String>,)>(&mut store, &exports.configure)
            .map_err(wrong(
                "configure",
                "func(settings: list<setting>) -> result<_, string>",
            ))?;
        instance
            .get_typed_func::<(RequestRecord,), (Result<Action, PluginError>,)>(
                &mut store,
                &exports.handle,
            )
            .map_err(wrong(
                "handle",
                "func(request: request) -> result<action, plugin-error>",
            ))?;
        let bindings = Middleware::new(&mut store, &instance)
            .map_err(|e| anyhow::Error::from(e).context("binding the plugin's exports"))?;
        Ok((store, bindings))
    }

    /// What went wrong in a call into the plugin, from wasmtime's error and
    /// what the store saw: the limit it hit, or the trap and the plugin's
    /// stderr (the full error goes to the log).
    pub(crate) fn classify(&self, error: wasmtime::Error, store: &Store<HostState>) -> CallError {
        if store.data().memory.hit {
            return CallError::MemoryLimit(self.engine.limits.memory_bytes);
        }
        if let Some(Trap::Interrupt) = error.downcast_ref::<Trap>() {
            return CallError::Deadline(self.engine.limits.deadline);
        }
        if error.is::<PoolConcurrencyLimitError>() {
            return CallError::Busy(self.engine.limits.max_instances.max(1));
        }
        if is_out_of_hostcall_fuel(&error) {
            return CallError::InvalidAnswer(format!(
                "the plugin handed the host more than {} bytes at once (the largest answer \
                 body is {} bytes)",
                hostcall_fuel(&self.engine.limits),
                self.engine.limits.max_output_body_bytes
            ));
        }
        // The full error (with the wasm backtrace and the plugin's symbol
        // names, escaped) goes to the log; the caller gets the trap and the
        // panic. A flood of requests can make a plugin trap on each: once a
        // second.
        static TRAPPED: LogThrottle = LogThrottle::new();
        if let Some(held_back) = TRAPPED.admit() {
            tracing::warn!(
                plugin = %store.data().plugin_name(),
                error = %plugin_text(format!("{error:?}"), MAX_PLUGIN_TEXT),
                "the plugin trapped {held_back}"
            );
        }
        let mut detail = match error.downcast_ref::<Trap>() {
            Some(trap) => trap.to_string(),
            None => error.root_cause().to_string(),
        };
        let stderr = store.data().stderr_text();
        if !stderr.is_empty() {
            detail.push_str("; plugin stderr: ");
            detail.push_str(&plugin_text(stderr.trim_end().to_string(), MAX_PLUGIN_TEXT));
        }
        CallError::Trap(detail)
    }

    /// Refuses an answer the host cannot use (a body over the limit, a
    /// status that is not an error, a code that is not a short name), and
    /// cuts a reject message to [`MAX_PLUGIN_TEXT`].
    fn check(&self, action: Action) -> Result<Action, CallError> {
        match action {
            Action::ForwardWithBody(body)
                if body.len() > self.engine.limits.max_output_body_bytes =>
            {
                Err(CallError::InvalidAnswer(format!(
                    "a {} byte body is over the {} byte limit",
                    body.len(),
                    self.engine.limits.max_output_body_bytes
                )))
            }
            Action::Reject(r) if !(400..=599).contains(&r.status) => Err(CallError::InvalidAnswer(
                format!("reject status {} is not in 400..=599", r.status),
            )),
            Action::Reject(r) if r.code.len() > MAX_REJECT_CODE => {
                Err(CallError::InvalidAnswer(format!(
                    "a {} byte reject code is over the {MAX_REJECT_CODE} byte limit",
                    r.code.len()
                )))
            }
            // The message goes to the client: bounded, whatever its size.
            Action::Reject(mut r) => {
                r.message = cut(r.message, MAX_PLUGIN_TEXT);
                Ok(Action::Reject(r))
            }
            action => Ok(action),
        }
    }
}

/// The most bytes a plugin may hand the host in one go (an answer, or one
/// call of an import such as `log.write`): wasmtime's own bound of 128 MiB,
/// raised to the largest answer body the limits allow and 1 MiB for the
/// rest of the answer. Without it, a body the limits accept but wasmtime's
/// default refuses trapped with wasmtime's words for it.
fn hostcall_fuel(limits: &PluginLimits) -> usize {
    const WASMTIME_DEFAULT: usize = 128 << 20;
    WASMTIME_DEFAULT.max(limits.max_output_body_bytes.saturating_add(1 << 20))
}

/// Whether `error` is wasmtime's refusal of more data than
/// [`hostcall_fuel`] from the plugin. wasmtime does not export its type, so
/// its message tells; a test pins it (`an_answer_past_the_hostcall_fuel_…`
/// in `tests/hostile.rs`).
fn is_out_of_hostcall_fuel(error: &wasmtime::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .to_string()
            .contains("fuel allocated for hostcalls has been exhausted")
    })
}

/// A plugin's own failure, its message bounded and escaped: it goes to the
/// log.
fn plugin_error(message: String) -> CallError {
    CallError::PluginError(plugin_text(message, MAX_PLUGIN_TEXT))
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;

    use snowgate_plugin::SnowflakeLayout;

    use super::*;
    use crate::engine::{HostServices, PluginEngine};
    use crate::id_clock::{FixedClock, IdClock};
    use crate::identity::MachineIdentity;
    use crate::limits::PluginLimits;

    pub(crate) fn plugin(limits: PluginLimits) -> Plugin {
        plugin_on(IdClock::new(FixedClock(1_764_000_000_000)), limits)
    }

    /// None of these tests is about the deadline, so it is generous: a
    /// debug host on a loaded machine once took more than the default
    /// second over a 5 MiB body.
    pub(crate) fn plugin_on(clock: IdClock, limits: PluginLimits) -> Plugin {
        let limits = PluginLimits {
            deadline: std::time::Duration::from_secs(30),
            ..limits
        };
        let services = HostServices {
            clock: Arc::new(clock),
            identity: Arc::new(
                MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 7).expect("in range"),
            ),
        };
        let engine = PluginEngine::new(services, limits).expect("engine");
        Plugin::load(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[]).expect("bundled plugin")
    }

    /// A body of about `size` bytes that needs an id.
    fn request(size: usize) -> Request {
        let mut body = br#"{"prompt":""#.to_vec();
        body.resize(size, b'a');
        body.extend_from_slice(br#"","disaggregated_params":{"request_type":"context_only"}}"#);
        Request {
            method: "POST".into(),
            path: "/v1/completions".into(),
            headers: vec![("content-type".into(), b"application/json".to_vec())].into(),
            body,
        }
    }

    fn assert_stamps(plugin: &Plugin) {
        match plugin.handle(&request(100)) {
            Ok(Action::ForwardWithBody(body)) => {
                let body = String::from_utf8(body).expect("utf-8");
                assert!(body.contains(r#""disagg_request_id":"#), "{body}");
            }
            other => panic!("expected a stamped body, got {other:?}"),
        }
    }

    #[test]
    fn a_full_pool_is_a_busy_error_and_frees_up_when_calls_end() {
        let plugin = plugin(PluginLimits {
            max_instances: 2,
            ..PluginLimits::default()
        });
        let first = plugin.instantiate().expect("first slot");
        let second = plugin.instantiate().expect("second slot");

        let error = plugin.handle(&request(100)).err();
        assert_eq!(error, Some(CallError::Busy(2)));
        let error = error.unwrap();
        assert_eq!(error.kind(), "busy");
        assert!(error
            .to_string()
            .contains("all 2 plugin instance slots are in use"));

        drop(first);
        assert_stamps(&plugin);
        drop(second);
        assert_stamps(&plugin);
    }

    #[test]
    fn growing_past_the_memory_limit_is_a_memory_limit_error_with_the_pool() {
        // An exact number of wasm pages, and one that is not.
        for memory_bytes in [8 << 20, (8 << 20) + 1000] {
            let plugin = plugin(PluginLimits {
                memory_bytes,
                ..PluginLimits::default()
            });
            assert_eq!(
                plugin.handle(&request(16 << 20)).map(|_| ()),
                Err(CallError::MemoryLimit(memory_bytes))
            );
            // Below the limit is fine: 2 MiB in and out fits in 8 MiB.
            assert!(matches!(
                plugin.handle(&request(2 << 20)),
                Ok(Action::ForwardWithBody(_))
            ));
            assert_stamps(&plugin);
        }
    }

    #[test]
    fn calls_reuse_slots_and_leave_nothing_behind() {
        let plugin = plugin(PluginLimits {
            max_instances: 1,
            ..PluginLimits::default()
        });
        for size in [100, 2 << 20, 100, 5 << 20, 100] {
            match plugin.handle(&request(size)) {
                Ok(Action::ForwardWithBody(body)) => assert!(body.len() > size),
                other => panic!("a {size} byte body: {other:?}"),
            }
        }
    }

    /// A one-threaded runtime for `handle_async`, as a gateway worker runs.
    pub(crate) fn current_thread_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
    }

    /// The kept instance's calls so far and the largest its memory grew.
    fn kept_instance(plugin: &Plugin, after: &str) -> (u32, usize) {
        let idle = plugin.idle.lock().expect("idle list");
        let kept = idle.as_ref().and_then(|kept| kept.last());
        let kept = kept.unwrap_or_else(|| {
            panic!("{after}: no instance kept: the last one grew its memory too much or failed")
        });
        (kept.calls, kept.store.data().memory.peak)
    }

    /// The bundled plugin frees everything it allocates in a call, so its
    /// allocator (plugin/src/arena.rs) serves every call of a reused
    /// instance from the same pages: its memory stops growing after the
    /// first call of each size, and the instance is reused to the end of
    /// its share instead of being dropped for growing.
    #[test]
    fn the_bundled_plugin_serves_a_reused_instance_from_the_same_memory() {
        let plugin = plugin(PluginLimits::default());
        let runtime = current_thread_runtime();
        let sizes = [100, 1 << 10, 64 << 10, 1 << 20];
        let call = |size: usize| {
            let answer = runtime.block_on(plugin.handle_async(&request(size)));
            assert!(
                matches!(answer, Ok(Action::ForwardWithBody(_))),
                "{size} bytes: {answer:?}"
            );
        };
        for size in sizes {
            call(size);
        }
        let (calls, peak) = kept_instance(&plugin, "the first round");
        assert_eq!(calls, 4);
        for round in 0..200 {
            for size in sizes {
                call(size);
            }
            let (calls, now) = kept_instance(&plugin, &format!("round {round}"));
            assert_eq!(calls, 4 * (round + 2), "the same instance, reused");
            assert_eq!(
                now, peak,
                "round {round}: the memory grew from {peak} to {now} bytes"
            );
        }
    }

    fn idle_count(plugin: &Plugin) -> usize {
        plugin
            .idle
            .lock()
            .expect("idle list")
            .as_ref()
            .map_or(0, Vec::len)
    }

    /// What the plugin's `identity` import does when it asks for the
    /// machine id, as the host runs it.
    pub(crate) fn ask_machine_id(store: &mut Store<HostState>) -> u32 {
        use crate::bindings::snowgate::middleware::identity::Host;
        store
            .data_mut()
            .current_machine_id()
            .expect("a machine id")
            .value
    }

    /// What the plugin's `clock` import does when it makes an id.
    pub(crate) fn take_tick(store: &mut Store<HostState>) {
        use crate::bindings::snowgate::middleware::clock::Host;
        store.data_mut().next_tick(4096);
    }

    pub(crate) fn let_out(fenced: &Fenced) -> bool {
        !fenced.ids_withheld
            && !fenced.ids_unavailable
            && matches!(&fenced.action, Action::ForwardWithBody(body) if body == b"{}")
    }

    pub(crate) fn withheld(fenced: &Fenced) -> bool {
        fenced.ids_withheld
            && fenced.ids_unavailable
            && matches!(&fenced.action, Action::Reject(r) if r.status == 503 && r.code == "no_machine_id")
    }

    /// A request answered 503 because no id could be issued is told apart
    /// from one the plugin rejected for a reason of its own (the gateway
    /// counts the two apart): before, both counted as `rejected`, so an
    /// outage of ids looked like bad requests.
    #[test]
    fn a_request_refused_for_want_of_ids_is_told_from_a_plugins_own_reject() {
        let plugin = plugin(PluginLimits::default());
        let runtime = current_thread_runtime();
        let answer = |request: &Request| {
            runtime
                .block_on(plugin.answer_async(request))
                .expect("an answer")
        };
        let mut not_json = request(100);
        not_json.body = b"{not json".to_vec();

        let stamped = answer(&request(100));
        assert!(matches!(stamped.action, Action::ForwardWithBody(_)));
        assert!(!stamped.ids_unavailable);
        let rejected = answer(&not_json);
        assert!(matches!(&rejected.action, Action::Reject(r) if r.status == 400));
        assert!(!rejected.ids_unavailable, "{:?}", rejected.action);

        // No machine id: the plugin, told so, answers 503 itself.
        plugin.engine.services.identity.withdraw("lease lost");
        let refused = answer(&request(100));
        assert!(
            matches!(&refused.action, Action::Reject(r) if r.status == 503 && r.code == "no_machine_id"),
            "{:?}",
            refused.action
        );
        assert!(refused.ids_unavailable);
        // A request the plugin rejects before it asks for an id is still
        // its own reject.
        let rejected = answer(&not_json);
        assert!(matches!(&rejected.action, Action::Reject(r) if r.status == 400));
        assert!(!rejected.ids_unavailable, "{:?}", rejected.action);
    }

    /// Once the clock refuses a call a tick, the call takes no more, even
    /// after the wall clock moved on and freed some: they are for the other
    /// requests (under a flood of large batches, a refused batch that went
    /// on taking them left none for any other, and every batch failed).
    #[test]
    fn a_call_refused_a_tick_takes_no_more() {
        let (clock, wall) = crate::id_clock::tests::hand_clock(1_000);
        let clock = clock.with_max_lead(Duration::from_millis(1));
        let plugin = plugin_on(clock, PluginLimits::default());
        let clock = &plugin.engine.services.clock;
        let mut store = plugin.new_store();
        // Milliseconds 1000 and 1001; 1002 is past the bound.
        while store.data().issued.refused.is_none() {
            take_tick(&mut store);
        }
        assert_eq!(clock.issued(), 2 * 4096);
        wall.store(1_005, std::sync::atomic::Ordering::SeqCst);
        for _ in 0..10 {
            take_tick(&mut store);
        }
        assert_eq!(clock.issued(), 2 * 4096, "ticks taken after the refusal");
        assert!(clock.next_tick(4096).is_ok(), "another call gets one");
    }

    #[test]
    fn an_instance_made_under_an_earlier_machine_id_grant_is_not_reused() {
        let plugin = plugin(PluginLimits::default());
        let runtime = current_thread_runtime();
        let call = |plugin: &Plugin| {
            runtime
                .block_on(plugin.handle_async(&request(100)))
                .expect("an answer")
        };
        assert!(matches!(call(&plugin), Action::ForwardWithBody(_)));
        assert_eq!(idle_count(&plugin), 1, "kept for the next call");
        assert!(matches!(call(&plugin), Action::ForwardWithBody(_)));
        assert_eq!(idle_count(&plugin), 1, "the same one, reused");

        // A new grant (a lease lost, and a slot claimed again): the kept
        // instance may hold the old machine id, so it is dropped, and the
        // call runs on a fresh one.
        let identity = &plugin.engine.services.identity;
        identity.withdraw("lease lost");
        identity.assign(8).expect("in range");
        let Action::ForwardWithBody(body) = call(&plugin) else {
            panic!("expected a stamped body")
        };
        let body = String::from_utf8(body).expect("utf-8");
        let id: u64 = body
            .split(r#""disagg_request_id":"#)
            .nth(1)
            .and_then(|rest| rest.split('}').next())
            .and_then(|digits| digits.parse().ok())
            .expect("an id");
        let parts = SnowflakeLayout::TrtllmV1.decode(id).expect("decodes");
        assert_eq!(parts.machine_id, 8);
        assert_eq!(idle_count(&plugin), 1, "only the fresh instance is kept");
        let kept = plugin.idle.lock().expect("idle list");
        let kept = kept.as_ref().expect("kept instances");
        assert_eq!(
            kept[0].store.data().created_under,
            identity.generation(),
            "the kept instance is of the current grant"
        );
    }
}
