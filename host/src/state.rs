//! The host state of one instance's `Store`: an empty WASI context, the
//! memory limiter, and the host's implementations of the plugin's
//! imports. An instance may serve several calls in turn; what is the
//! call's own is reset at each call's start ([`HostState::begin_call`]).

use std::sync::Arc;

use wasmtime::component::ResourceTable;
use wasmtime::ResourceLimiter;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::bindings::snowgate::middleware::{clock, identity, log, types};
use crate::call_clock::{CallClock, OnTick};
use crate::engine::{HostServices, MAX_PLUGIN_HANDLES, MAX_TABLE_ELEMENTS};
use crate::header_edits::HeaderEdits;
use crate::id_clock::{NoTick, TicksTaken};
use crate::log_throttle::{LineBudget, LogThrottle};
use crate::request::Headers;
use crate::text_limits::{
    plugin_text_of, MAX_LOG_LINES_PER_CALL, MAX_LOG_LINES_PER_SECOND, MAX_PLUGIN_TEXT,
};
use snowgate_plugin::SnowflakeLayout;

/// Everything one `Store` holds: one instance, over the calls it serves.
/// The memory limiter's peak and the stderr pipe carry over from call to
/// call (the instance is not reused once they show a fault); the call's
/// clock, ids and log lines do not.
pub struct HostState {
    /// The WASI context, built on the plugin's first WASI call: most calls
    /// make none (a plugin reaches WASI only to report a panic, or for what
    /// its standard library does on its behalf), and building one costs
    /// about as much as running a small request.
    wasi: Option<Wasi>,
    table: ResourceTable,
    services: HostServices,
    pub(crate) memory: MemoryLimiter,
    plugin_name: Arc<str>,
    /// When the current call must end, and when it yields: checked at
    /// epoch ticks by async calls (see `Plugin::handle_async`), and by
    /// every call's WASI waits (see `sleeps`).
    pub(crate) clock: Arc<CallClock>,
    /// What the current call took from the id services, for the check
    /// before its ids may leave (see `MachineIdentity::confirm`).
    pub(crate) issued: Issued,
    /// The machine id grant current when the instance was made: a plugin
    /// that kept a machine id from an earlier call has one of this grant
    /// at the latest (instances of an older grant are not reused).
    pub(crate) created_under: u64,
    /// How many log lines the current call wrote.
    log_lines: u32,
    /// The headers of the request being handled, for the
    /// `request-headers` import; `None` outside `handle`.
    headers: Option<Headers>,
    /// The changes the plugin asked for through the `header-edits`
    /// import; `None` outside `handle`.
    header_edits: Option<HeaderEdits>,
    /// Every tick the current call took, up to [`MAX_RECORDED_TICKS`],
    /// where the self-check asks for them (see
    /// [`crate::SelfCheckInstance::handle`]); `None` elsewhere.
    pub(crate) recorded_ticks: Option<Vec<crate::id_clock::Tick>>,
}

/// The most ticks of one call [`HostState::recorded_ticks`] holds.
pub(crate) const MAX_RECORDED_TICKS: usize = 16;

/// What one call took from the id services.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Issued {
    /// The grant of the machine id it was first given, if it asked for one.
    pub(crate) grant: Option<u64>,
    /// Whether it was given machine ids of more than one grant.
    pub(crate) mixed: bool,
    /// Why the clock refused a tick it asked for, if it did.
    pub(crate) refused: Option<NoTick>,
    /// Whether it asked for the machine id and was told there is none.
    pub(crate) no_machine_id: bool,
    /// The ticks the clock gave it (its refusals not counted).
    pub(crate) taken: Option<TicksTaken>,
    /// Whether the host takes a tick of its own, and drops it, before the
    /// call's first (see [`crate::SelfCheckInstance::handle`]).
    pub(crate) spare_first: bool,
}

impl Issued {
    /// Whether it asked the clock for a tick, given or refused.
    pub(crate) fn asked_for_ticks(&self) -> bool {
        self.taken.is_some() || self.refused.is_some()
    }

    /// Whether the host refused it what ids are made of: a tick, or the
    /// machine id.
    pub(crate) fn refused_ids(&self) -> bool {
        self.refused.is_some() || self.no_machine_id
    }
}

/// The most random bytes one WASI call may ask for (`get-random-bytes`,
/// `get-insecure-random-bytes`); more traps. Making 256 KiB takes well
/// under a millisecond, the longest a host call should hold a worker.
pub const MAX_RANDOM_BYTES: u64 = 256 << 10;

/// An empty WASI context whose only stream is a bounded `stderr` capture
/// (for panic messages).
struct Wasi {
    ctx: WasiCtx,
    stderr: MemoryOutputPipe,
}

impl Wasi {
    fn new() -> Wasi {
        let stderr = MemoryOutputPipe::new(MAX_PLUGIN_TEXT);
        let ctx = WasiCtx::builder()
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .stderr(stderr.clone())
            .monotonic_clock(crate::sleeps::PluginMonotonicClock)
            // Made a byte at a time inside the host call, which no
            // deadline interrupts: wasmtime's 64 MiB held a worker thread
            // some 150 ms.
            .max_random_size(MAX_RANDOM_BYTES)
            .build();
        Wasi { ctx, stderr }
    }
}

impl HostState {
    /// State for one call: the memory cap, and (when the plugin first
    /// needs it) an empty WASI context whose only stream is a bounded
    /// `stderr` capture.
    pub(crate) fn new(
        services: HostServices,
        memory_bytes: usize,
        plugin_name: Arc<str>,
    ) -> HostState {
        let created_under = services.identity.generation();
        let mut table = ResourceTable::new();
        table.set_max_capacity(MAX_PLUGIN_HANDLES);
        HostState {
            wasi: None,
            table,
            services,
            memory: MemoryLimiter {
                limit: memory_bytes,
                hit: false,
                peak: 0,
            },
            plugin_name,
            clock: Arc::default(),
            issued: Issued::default(),
            created_under,
            log_lines: 0,
            headers: None,
            header_edits: None,
            recorded_ticks: None,
        }
    }

    /// The plugin's name, as its log lines are tagged.
    pub(crate) fn plugin_name(&self) -> &Arc<str> {
        &self.plugin_name
    }

    /// Tags the plugin's log lines with `name` from now on: the load-time
    /// check learns the name only from the instance it then configures.
    pub(crate) fn set_plugin_name(&mut self, name: Arc<str>) {
        self.plugin_name = name;
    }

    /// Starts the clock of a call, sync or async: it ends at `deadline` from now,
    /// and yields to the event loop at every tick once it has run for
    /// `yield_after`.
    pub(crate) fn begin_call(
        &mut self,
        deadline: std::time::Duration,
        yield_after: std::time::Duration,
    ) {
        self.clock
            .begin(std::time::Instant::now(), deadline, yield_after);
        self.issued = Issued::default();
        self.log_lines = 0;
    }

    /// Makes `headers` what the `request-headers` import reads, for the
    /// `handle` call about to start.
    /// The call starts with no header changes.
    pub(crate) fn lend_headers(&mut self, headers: &Headers) {
        self.headers = Some(headers.clone());
        self.header_edits = Some(HeaderEdits::default());
    }

    /// Ends what [`HostState::lend_headers`] began: the import reads no
    /// headers until the next `handle`, and the request's are not kept.
    /// Returns the changes the call made to them.
    pub(crate) fn take_back_headers(&mut self) -> HeaderEdits {
        self.headers = None;
        self.header_edits.take().unwrap_or_default()
    }

    /// Whether a `handle` call is running, whose request the plugin may
    /// change the headers of.
    pub(crate) fn takes_header_edits(&self) -> bool {
        self.header_edits.is_some()
    }

    /// The header changes of the request being handled, if a `handle`
    /// call is running.
    pub(crate) fn header_edits_mut(&mut self) -> Option<&mut HeaderEdits> {
        self.header_edits.as_mut()
    }

    /// The headers the `request-headers` import reads, if a `handle`
    /// call is running.
    pub(crate) fn request_headers(&self) -> Option<&Headers> {
        self.headers.as_ref()
    }

    /// The resource table the plugin's WASI resources live in.
    pub(crate) fn resources(&mut self) -> &mut ResourceTable {
        &mut self.table
    }

    /// What an async call does when the epoch ticks: go on, yield, or stop.
    ///
    /// A yield goes through `tokio::task::yield_now`, which wakes the call
    /// only after the event loop has polled its sockets and timers. A
    /// plain yield wakes the call at once, so a long call is always ready
    /// to run, and tokio's event loop then reads its sockets only every
    /// 61 task polls, with a 1 ms slice of the call in each: every other
    /// connection of the worker waited 30 to 80 ms per read or write.
    /// Outside a tokio runtime `yield_now` is a plain yield.
    pub(crate) fn on_epoch_tick(&self) -> wasmtime::UpdateDeadline {
        match self.clock.on_tick(std::time::Instant::now()) {
            OnTick::Interrupt => wasmtime::UpdateDeadline::Interrupt,
            OnTick::Yield => {
                wasmtime::UpdateDeadline::YieldCustom(1, Box::pin(tokio::task::yield_now()))
            }
            OnTick::Continue => wasmtime::UpdateDeadline::Continue(1),
        }
    }

    /// Whether the plugin wrote anything to stderr (a panic message, as a
    /// rule).
    pub(crate) fn wrote_stderr(&self) -> bool {
        self.wasi
            .as_ref()
            .is_some_and(|wasi| !wasi.stderr.contents().is_empty())
    }

    /// What the plugin wrote to stderr, lossily decoded.
    pub(crate) fn stderr_text(&self) -> String {
        match &self.wasi {
            Some(wasi) => String::from_utf8_lossy(&wasi.stderr.contents()).into_owned(),
            None => String::new(),
        }
    }
}

/// Caps linear memory and remembers whether the cap was hit, so that the
/// trap that follows is reported as the memory limit.
pub(crate) struct MemoryLimiter {
    limit: usize,
    pub(crate) hit: bool,
    /// The largest size a linear memory has grown to (0 if none grew).
    pub(crate) peak: usize,
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
        if allowed {
            self.peak = self.peak.max(desired);
        }
        Ok(allowed)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= MAX_TABLE_ELEMENTS)
    }
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi.get_or_insert_with(Wasi::new).ctx,
            table: &mut self.table,
        }
    }
}

impl types::Host for HostState {}

impl clock::Host for HostState {
    fn next_tick(&mut self, sequence_space: u32) -> clock::Tick {
        // At most the layout's own space: sequences past it do not fit the
        // ids' sequence bits, and would spill into the machine id's (the
        // ids of another machine). Fewer is the plugin's to choose.
        let sequence_space = sequence_space.min(self.services.identity.layout().sequence_space());
        // A clock that refuses gives a tick it may have given before, and
        // the call's ids are withheld (see `Plugin::fence`). After a refusal
        // the call takes no more ticks: those it would take as the wall
        // clock moves on are the ones other requests need, and under a
        // flood of large batches every batch would be refused.
        let refused_tick = crate::id_clock::Tick {
            millis: u64::MAX,
            sequence: 0,
        };
        if std::mem::take(&mut self.issued.spare_first) {
            // Where it refuses, so does the call's own tick, next.
            let _dropped = self.services.clock.next_tick(sequence_space);
        }
        let tick = match self.issued.refused {
            Some(_) => refused_tick,
            None => match self.services.clock.next_tick(sequence_space) {
                Ok(tick) => {
                    if let Some(recorded) = &mut self.recorded_ticks {
                        if recorded.len() < MAX_RECORDED_TICKS {
                            recorded.push(tick);
                        }
                    }
                    self.issued.taken = Some(match self.issued.taken {
                        None => TicksTaken {
                            first: tick,
                            last: tick,
                            count: 1,
                        },
                        Some(taken) => TicksTaken {
                            last: tick,
                            count: taken.count + 1,
                            ..taken
                        },
                    });
                    tick
                }
                Err(refused) => {
                    self.issued.refused = Some(refused);
                    refused_tick
                }
            },
        };
        clock::Tick {
            millis: tick.millis,
            sequence: tick.sequence,
        }
    }
}

impl identity::Host for HostState {
    fn current_machine_id(&mut self) -> Result<identity::MachineId, String> {
        let grant = self
            .services
            .identity
            .grant()
            .inspect_err(|_| self.issued.no_machine_id = true)?;
        match self.issued.grant {
            None => self.issued.grant = Some(grant.generation),
            Some(first) => self.issued.mixed |= first != grant.generation,
        }
        let id = grant.id;
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
    // Never called by the engine: `in_place_imports` links a version that
    // reads the text in the plugin's memory, with the same checks.
    fn write(&mut self, level: types::LogLevel, message: String) {
        if self.log_line_admitted(level) {
            self.write_log_line(level, &message);
        }
    }
}

impl HostState {
    /// Whether the plugin's log line at `level` goes to the log: one the
    /// log leaves out, or past the call's or the second's line limits (said
    /// once), does not. Asked before the line is read out of the plugin's
    /// memory.
    pub(crate) fn log_line_admitted(&mut self, level: types::LogLevel) -> bool {
        let plugin = &*self.plugin_name;
        let enabled = match level {
            types::LogLevel::Debug => {
                tracing::enabled!(target: "snowgate::plugin", tracing::Level::DEBUG)
            }
            types::LogLevel::Info => {
                tracing::enabled!(target: "snowgate::plugin", tracing::Level::INFO)
            }
            types::LogLevel::Warn => {
                tracing::enabled!(target: "snowgate::plugin", tracing::Level::WARN)
            }
            types::LogLevel::Error => {
                tracing::enabled!(target: "snowgate::plugin", tracing::Level::ERROR)
            }
        };
        // Lines the log leaves out count for neither limit below.
        if !enabled {
            return false;
        }
        // A plugin that logs in a loop must not flood the gateway's log
        // from one request.
        self.log_lines = self.log_lines.saturating_add(1);
        if self.log_lines > MAX_LOG_LINES_PER_CALL {
            // Once a call, and once a second across calls: a plugin that
            // does this does it on every request.
            static OVER_PER_CALL: LogThrottle = LogThrottle::new();
            let note = |calls: u64| {
                tracing::warn!(
                    target: "snowgate::plugin",
                    "{calls} more plugin calls wrote more than {MAX_LOG_LINES_PER_CALL} log lines \
                     each in the second after the last such warning; the rest of their lines \
                     were dropped"
                );
            };
            if self.log_lines == MAX_LOG_LINES_PER_CALL + 1 {
                if let Some(held_back) = OVER_PER_CALL.admit_noting_the_rest(note) {
                    tracing::warn!(
                        target: "snowgate::plugin",
                        plugin,
                        "the plugin wrote more than {MAX_LOG_LINES_PER_CALL} log lines in one \
                         call; the rest of this call's lines are dropped {held_back}"
                    );
                }
            }
            return false;
        }
        static BUDGET: LineBudget = LineBudget::new(MAX_LOG_LINES_PER_SECOND);
        static OVER_BUDGET: LogThrottle = LogThrottle::new();
        let note = |lines: u64| {
            tracing::warn!(
                target: "snowgate::plugin",
                "{lines} more plugin log lines were dropped in the second after the last such \
                 warning: plugins may write {MAX_LOG_LINES_PER_SECOND} lines a second in all"
            );
        };
        if !BUDGET.admit() {
            if let Some(held_back) = OVER_BUDGET.admit_noting_the_rest(note) {
                tracing::warn!(
                    target: "snowgate::plugin",
                    "a plugin log line was dropped: plugins may write \
                     {MAX_LOG_LINES_PER_SECOND} lines a second in all {held_back}"
                );
            }
            return false;
        }
        true
    }

    /// Writes the plugin's log line `message` at `level`, at most
    /// [`MAX_PLUGIN_TEXT`] bytes of it, escaped (see [`plugin_text_of`]).
    pub(crate) fn write_log_line(&self, level: types::LogLevel, message: &str) {
        let plugin = &*self.plugin_name;
        let message = plugin_text_of(message, MAX_PLUGIN_TEXT);
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

#[cfg(test)]
mod tests {
    use snowgate_plugin::SnowflakeLayout;

    use super::*;
    use crate::id_clock::{FixedClock, IdClock};
    use crate::identity::MachineIdentity;

    /// A plugin that asks for more sequence numbers a millisecond than its
    /// layout's ids hold gets the layout's: a millisecond's ticks end at
    /// the last sequence its ids can carry, and the next tick is in the
    /// next millisecond. Fewer, it gets as it asked.
    #[test]
    fn a_tick_never_holds_a_sequence_past_the_layouts() {
        const MS: u64 = 1_796_448_728_439;
        for layout in [SnowflakeLayout::TrtllmV1, SnowflakeLayout::TrtllmV2] {
            let services = HostServices {
                clock: Arc::new(IdClock::new(FixedClock(MS))),
                identity: Arc::new(MachineIdentity::fixed(layout, 1).expect("a machine id")),
            };
            let mut state = HostState::new(services, 1 << 20, Arc::from("test"));
            let space = layout.sequence_space();
            let ticks: Vec<_> = (0..space + 1)
                .map(|_| clock::Host::next_tick(&mut state, u32::MAX))
                .collect();
            assert!(ticks[..space as usize]
                .iter()
                .enumerate()
                .all(|(n, t)| t.millis == MS && t.sequence == n as u32));
            let next = &ticks[space as usize];
            assert_eq!((next.millis, next.sequence), (MS + 1, 0), "{layout}");
            // Two a millisecond, as asked.
            let small: Vec<_> = (0..3)
                .map(|_| clock::Host::next_tick(&mut state, 2))
                .map(|t| (t.millis, t.sequence))
                .collect();
            assert_eq!(small, [(MS + 1, 1), (MS + 2, 0), (MS + 2, 1)], "{layout}");
        }
    }
}
