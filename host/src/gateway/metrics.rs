//! Counters and latency histograms (plugin calls, responses), in Prometheus
//! text format.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use tokio::sync::Semaphore;

use crate::compile_cache::Compiled;
use crate::gateway::body_memory::BodyMemory;
use crate::CallError;

/// How a request through the gateway ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Went upstream without passing through the plugin (not JSON).
    PassedThrough,
    /// The plugin let it through unchanged.
    Forwarded,
    /// The plugin changed its body (stamped ids).
    Rewritten,
    /// The plugin rejected it (for a reason of its own: see
    /// [`Outcome::IdsUnavailable`]).
    Rejected,
    /// No id could be issued for it, so it was answered 503: the host
    /// withheld the ids the plugin made (the machine id was no longer this
    /// process's to use, the id clock refused, or an id could repeat one
    /// made before), or the plugin rejected it after the host refused it
    /// the machine id or a tick. An outage of ids (a lease lost, a
    /// high-water file that cannot be written, ids asked for faster than
    /// the layout makes them), not a fault of the request.
    IdsUnavailable,
    /// The body was over the size limit.
    TooLarge,
    /// The plugin failed and the policy refused the request (fail-closed).
    FailedClosed,
    /// The plugin failed and the policy forwarded it unchanged (fail-open).
    FailedOpen,
    /// The request could not be read from the client: its head did not
    /// parse (hyper's own 400, 414 or 431), was refused (an unsupported
    /// transfer coding, a bad target), or its body failed.
    ClientError,
    /// No room came free for the body in the gateway's body memory
    /// (`--body-memory-mib`) in time: answered 503.
    BodyMemoryFull,
    /// No plugin call slot came free for it within the wait for room for a
    /// body (`--body-read-timeout-ms`): answered 503 `plugin_busy`.
    PluginBusy,
    /// Its client went away (closed its connection, reset its HTTP/2
    /// stream) before the gateway had decided what to do with it: at once,
    /// before the request ran at all, or, for one read for the plugin,
    /// while it waited for room for its body or for a plugin call slot, or
    /// during the call. Requests the gateway drops itself when a
    /// shutdown's grace period ends count here too. nginx logs such a
    /// request as 499.
    Abandoned,
}

impl Outcome {
    const ALL: [Outcome; 12] = [
        Outcome::PassedThrough,
        Outcome::Forwarded,
        Outcome::Rewritten,
        Outcome::Rejected,
        Outcome::IdsUnavailable,
        Outcome::TooLarge,
        Outcome::FailedClosed,
        Outcome::FailedOpen,
        Outcome::ClientError,
        Outcome::BodyMemoryFull,
        Outcome::PluginBusy,
        Outcome::Abandoned,
    ];

    fn label(self) -> &'static str {
        match self {
            Outcome::PassedThrough => "passed_through",
            Outcome::Forwarded => "forwarded",
            Outcome::Rewritten => "rewritten",
            Outcome::Rejected => "rejected",
            Outcome::IdsUnavailable => "ids_unavailable",
            Outcome::TooLarge => "too_large",
            Outcome::FailedClosed => "failed_closed",
            Outcome::FailedOpen => "failed_open",
            Outcome::ClientError => "client_error",
            Outcome::BodyMemoryFull => "body_memory_full",
            Outcome::PluginBusy => "plugin_busy",
            Outcome::Abandoned => "abandoned",
        }
    }
}

/// Why a request got no upstream response (see
/// [`Metrics::upstream_error`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamError {
    /// No connection could be opened (502): the upstream is down.
    Unreachable,
    /// The connection failed after the request was sent (502).
    Failed,
    /// The upstream answered what the gateway cannot pass on (502).
    Unusable,
    /// A timeout ran out: connecting, or waiting for the response's
    /// headers (504).
    TimedOut,
}

impl UpstreamError {
    const ALL: [UpstreamError; 4] = [
        UpstreamError::Unreachable,
        UpstreamError::Failed,
        UpstreamError::Unusable,
        UpstreamError::TimedOut,
    ];

    fn label(self) -> &'static str {
        match self {
            UpstreamError::Unreachable => "unreachable",
            UpstreamError::Failed => "failed",
            UpstreamError::Unusable => "unusable",
            UpstreamError::TimedOut => "timed_out",
        }
    }
}

/// Upper bounds of the plugin-call latency buckets, in seconds: finest
/// around 100 µs, where a call's added latency is judged, and on to a
/// minute, for a `--plugin-deadline-ms` raised for bodies of many ids (with
/// buckets ending at 1 s, the default deadline, every longer call was in
/// `+Inf`, and a quantile over them read 1 s).
const LATENCY_BUCKETS: [f64; 24] = [
    0.000005, 0.00001, 0.000025, 0.00005, 0.000075, 0.0001, 0.00015, 0.0002, 0.00025, 0.0005,
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Upper bounds of the response-headers latency buckets, in seconds: from
/// a proxied request's fraction of a millisecond to a non-streaming
/// completion's minutes.
const RESPONSE_BUCKETS: [f64; 19] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0, 300.0, 600.0,
];

/// Response status classes, `1xx` to `5xx`.
const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

/// A latency histogram with fixed buckets. Lock-free: a record is two
/// atomic adds.
///
/// The count is not a counter of its own but the sum of the buckets read
/// in one scrape (one more bucket holds what is over the last bound): a
/// scrape that came between a record's bucket and a separate count saw
/// `+Inf` below the last finite bucket (a review caught 1 to 4 such
/// scrapes in 10,000 under load), which Prometheus takes as a broken
/// histogram.
#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    /// One per bound, and the last for what is over every bound.
    buckets: Box<[AtomicU64]>,
    nanos: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            nanos: AtomicU64::new(0),
        }
    }

    fn record(&self, took: Duration) {
        let seconds = took.as_secs_f64();
        let i = self
            .bounds
            .iter()
            .position(|&le| seconds <= le)
            .unwrap_or(self.bounds.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Appends the histogram as `name`, cumulative, to `out`.
    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cumulative = 0;
        for (le, counter) in self.bounds.iter().zip(self.buckets.iter()) {
            cumulative += counter.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let over = self.buckets[self.bounds.len()].load(Ordering::Relaxed);
        let count = cumulative + over;
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = self.nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {count}");
    }
}

/// How much of a bounded resource is in use, read from the semaphore that
/// bounds it when `/metrics` is scraped: the request path counts nothing
/// more for it.
#[derive(Debug)]
struct InUse {
    permits: Arc<Semaphore>,
    total: usize,
}

impl InUse {
    fn now(&self) -> usize {
        self.total.saturating_sub(self.permits.available_permits())
    }
}

/// A client connection counted as open; dropping it counts it closed.
#[derive(Debug)]
pub(crate) struct OpenConnection(Arc<AtomicUsize>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A plugin call being timed (see [`Metrics::time_plugin_call`]).
#[derive(Debug)]
pub(crate) struct PluginCallTimer<'a> {
    metrics: &'a Metrics,
    started: std::time::Instant,
    record: bool,
}

impl PluginCallTimer<'_> {
    /// The plugin did not run (no instance was free): nothing to record.
    pub(crate) fn did_not_run(mut self) {
        self.record = false;
    }
}

impl Drop for PluginCallTimer<'_> {
    fn drop(&mut self) {
        if self.record {
            self.metrics.plugin_call(self.started.elapsed());
        }
    }
}

/// The gateway's metrics. Lock-free: every update is an atomic add or a few.
#[derive(Debug)]
pub struct Metrics {
    requests: [AtomicU64; Outcome::ALL.len()],
    upstream_errors: [AtomicU64; UpstreamError::ALL.len()],
    upstream_cut_offs: AtomicU64,
    /// Requests that found no turn for the upstream in time.
    upstream_busy: AtomicU64,
    /// Idle connections closed to make room at the connection limit.
    connections_reclaimed: AtomicU64,
    /// HTTP/2 connections closed for their requests cut short.
    connections_closed_for_resets: AtomicU64,
    reloads_succeeded: AtomicU64,
    reloads_failed: AtomicU64,
    /// Builds loaded (at start and by reloads): compiled now, read from
    /// the compile cache.
    loads: [AtomicU64; 2],
    plugin_failures: [AtomicU64; CallError::KINDS.len()],
    plugin_calls: Histogram,
    responses: [AtomicU64; STATUS_CLASSES.len()],
    response_headers: Histogram,
    /// Client connections open now.
    connections_open: Arc<AtomicUsize>,
    /// The server's connection limit, once it serves.
    connections_max: OnceLock<usize>,
    /// Plugin call slots, and the requests waiting for one, once the
    /// middleware has them.
    plugin_calls_in_use: OnceLock<(InUse, Arc<AtomicUsize>)>,
    /// The memory bodies read whole hold, once the middleware has it (the
    /// last one given).
    body_memory: ArcSwapOption<BodyMemory>,
    /// Turns for requests to the upstream, and the requests waiting for
    /// one, when `--max-upstream-requests` bounds them.
    upstream_requests: OnceLock<(InUse, Arc<AtomicUsize>)>,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics {
            requests: Default::default(),
            upstream_errors: Default::default(),
            upstream_cut_offs: AtomicU64::new(0),
            upstream_busy: AtomicU64::new(0),
            connections_reclaimed: AtomicU64::new(0),
            connections_closed_for_resets: AtomicU64::new(0),
            reloads_succeeded: AtomicU64::new(0),
            reloads_failed: AtomicU64::new(0),
            loads: Default::default(),
            plugin_failures: Default::default(),
            plugin_calls: Histogram::new(&LATENCY_BUCKETS),
            responses: Default::default(),
            response_headers: Histogram::new(&RESPONSE_BUCKETS),
            connections_open: Arc::default(),
            connections_max: OnceLock::new(),
            plugin_calls_in_use: OnceLock::new(),
            body_memory: ArcSwapOption::empty(),
            upstream_requests: OnceLock::new(),
        }
    }
}

impl Metrics {
    /// Counts one request by how it ended.
    pub fn request(&self, outcome: Outcome) {
        self.requests[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Sets the connection limit `/metrics` reports (the first call
    /// counts; later ones are ignored).
    pub(crate) fn gauge_connections(&self, max: usize) {
        let _ = self.connections_max.set(max);
    }

    /// Counts a client connection as open until the guard is dropped.
    pub(crate) fn connection_opened(&self) -> OpenConnection {
        self.connections_open.fetch_add(1, Ordering::Relaxed);
        OpenConnection(self.connections_open.clone())
    }

    /// Reports running plugin calls from the middleware's call slots
    /// (`total` permits of `permits`, one held per call) and the requests
    /// `waiting` for one. The first call counts; later ones are ignored.
    pub(crate) fn gauge_plugin_calls(
        &self,
        permits: Arc<Semaphore>,
        total: usize,
        waiting: Arc<AtomicUsize>,
    ) {
        let _ = self
            .plugin_calls_in_use
            .set((InUse { permits, total }, waiting));
    }

    /// Reports the memory bodies read whole hold from `memory`; a later
    /// call replaces an earlier one.
    pub(crate) fn gauge_body_memory(&self, memory: Arc<BodyMemory>) {
        self.body_memory.store(Some(memory));
    }

    /// Reports requests in flight to the upstream from their turns (`total`
    /// permits of `permits`, one held per request) and the requests
    /// `waiting` for one. The first call counts; later ones are ignored.
    pub(crate) fn gauge_upstream_requests(
        &self,
        permits: Arc<Semaphore>,
        total: usize,
        waiting: Arc<AtomicUsize>,
    ) {
        let _ = self
            .upstream_requests
            .set((InUse { permits, total }, waiting));
    }

    /// Counts a request that found no turn for the upstream in time
    /// (answered 503 `upstream_busy`).
    pub fn upstream_busy(&self) {
        self.upstream_busy.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request that got no upstream response (answered 502 or
    /// 504), by why.
    pub fn upstream_error(&self, why: UpstreamError) {
        self.upstream_errors[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a response cut off after its headers because of its
    /// upstream: it paused longer than the upstream read timeout, or its
    /// connection failed within the body.
    pub fn upstream_cut_off(&self) {
        self.upstream_cut_offs.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts an idle connection closed to make room for a new client at
    /// the connection limit.
    pub(crate) fn connection_reclaimed(&self) {
        self.connections_reclaimed.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts an HTTP/2 connection closed because its client cut short too
    /// many of its requests (see
    /// [`stream_resets`](crate::gateway::stream_resets)).
    pub(crate) fn connection_closed_for_resets(&self) {
        self.connections_closed_for_resets
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a build the gateway loaded and serves, by where its compiled
    /// code came from.
    pub fn loaded(&self, compiled: Compiled) {
        self.loads[compiled as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a reload, good or bad.
    pub fn reload(&self, succeeded: bool) {
        let counter = if succeeded {
            &self.reloads_succeeded
        } else {
            &self.reloads_failed
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a plugin failure, by its kind.
    pub fn plugin_failure(&self, failure: &CallError) {
        self.plugin_failures[failure.kind_index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Records the duration of one plugin call.
    pub fn plugin_call(&self, took: Duration) {
        self.plugin_calls.record(took);
    }

    /// Times a plugin call from now: recorded when the timer is dropped,
    /// so that a call whose request is dropped before it ends (its client
    /// went away) is recorded too, up to then. A plugin slower than its
    /// clients' patience was otherwise missing from the histogram, the one
    /// place it shows.
    pub(crate) fn time_plugin_call(&self) -> PluginCallTimer<'_> {
        PluginCallTimer {
            metrics: self,
            started: std::time::Instant::now(),
            record: true,
        }
    }

    /// Counts a response by its status class (600 and up, which HTTP does
    /// not define but an upstream may send, in none), and records how
    /// long after its request arrived its headers were ready.
    pub fn response(&self, status: http::StatusCode, took: Duration) {
        self.response_status(status.as_u16());
        self.response_headers.record(took);
    }

    /// Counts a response by its status class only: one hyper answered by
    /// itself, for a request that never reached the gateway's code.
    pub fn response_status(&self, status: u16) {
        let class = usize::from(status / 100);
        if let Some(counter) = class.checked_sub(1).and_then(|i| self.responses.get(i)) {
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The number of requests that ended with `outcome`.
    pub fn requests(&self, outcome: Outcome) -> u64 {
        self.requests[outcome as usize].load(Ordering::Relaxed)
    }

    /// Successful and failed reloads so far.
    pub fn reloads(&self) -> (u64, u64) {
        (
            self.reloads_succeeded.load(Ordering::Relaxed),
            self.reloads_failed.load(Ordering::Relaxed),
        )
    }

    /// All metrics in Prometheus text exposition format; `ids_issued` is
    /// the id clock's count of ids handed out.
    pub fn render(&self, ids_issued: u64) -> String {
        let mut out = String::new();
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        out.push_str(
            "# HELP snowgate_requests_total Requests through the gateway, by what the gateway made of them: rewritten and forwarded count what the plugin answered, whatever the upstream then did (see snowgate_upstream_errors_total); abandoned, a client gone before its answer, its body's end included.\n",
        );
        out.push_str("# TYPE snowgate_requests_total counter\n");
        for outcome in Outcome::ALL {
            let _ = writeln!(
                out,
                "snowgate_requests_total{{outcome=\"{}\"}} {}",
                outcome.label(),
                self.requests(outcome)
            );
        }
        out.push_str(
            "# HELP snowgate_ids_stamped_total Request ids taken from the id clock: more than leave it, since it counts those of calls whose ids the host withheld, and those of each loaded build's self-check, five for a build that stamps each request (the build's and one the host takes just before it, more where the check is asked again, then one of the same request again and the two of its batch).\n",
        );
        out.push_str("# TYPE snowgate_ids_stamped_total counter\n");
        let _ = writeln!(out, "snowgate_ids_stamped_total {ids_issued}");
        out.push_str(
            "# HELP snowgate_upstream_errors_total Requests that got no upstream response, by why: 502 when it could not be connected to (unreachable), its connection failed after the request was sent (failed), or it answered what the gateway cannot pass on (unusable); 504 when a timeout ran out (timed_out).\n",
        );
        out.push_str("# TYPE snowgate_upstream_errors_total counter\n");
        for why in UpstreamError::ALL {
            let _ = writeln!(
                out,
                "snowgate_upstream_errors_total{{kind=\"{}\"}} {}",
                why.label(),
                load(&self.upstream_errors[why as usize])
            );
        }
        out.push_str(
            "# HELP snowgate_upstream_cut_offs_total Responses cut off after their headers because of the upstream: it paused within the body longer than --upstream-read-timeout-ms, or its connection failed within the body.\n",
        );
        out.push_str("# TYPE snowgate_upstream_cut_offs_total counter\n");
        let _ = writeln!(
            out,
            "snowgate_upstream_cut_offs_total {}",
            load(&self.upstream_cut_offs)
        );
        if self.upstream_requests.get().is_some() {
            out.push_str(
                "# HELP snowgate_upstream_busy_total Requests answered 503 upstream_busy: --max-upstream-requests were in flight, and none ended within --upstream-connect-timeout-ms.\n",
            );
            out.push_str("# TYPE snowgate_upstream_busy_total counter\n");
            let _ = writeln!(
                out,
                "snowgate_upstream_busy_total {}",
                load(&self.upstream_busy)
            );
        }
        out.push_str(
            "# HELP snowgate_connections_reclaimed_total Idle client connections closed to make room for a new client at --max-connections.\n",
        );
        out.push_str("# TYPE snowgate_connections_reclaimed_total counter\n");
        let _ = writeln!(
            out,
            "snowgate_connections_reclaimed_total {}",
            load(&self.connections_reclaimed)
        );
        out.push_str(
            "# HELP snowgate_connections_closed_for_resets_total HTTP/2 client connections closed because their client ended 100 requests within 1 s of sending them, before their answers, as a rapid-reset attack does.\n",
        );
        out.push_str("# TYPE snowgate_connections_closed_for_resets_total counter\n");
        let _ = writeln!(
            out,
            "snowgate_connections_closed_for_resets_total {}",
            load(&self.connections_closed_for_resets)
        );
        out.push_str("# HELP snowgate_reloads_total Plugin reloads, by result.\n");
        out.push_str("# TYPE snowgate_reloads_total counter\n");
        let (ok, failed) = self.reloads();
        let _ = writeln!(out, "snowgate_reloads_total{{result=\"succeeded\"}} {ok}");
        let _ = writeln!(out, "snowgate_reloads_total{{result=\"failed\"}} {failed}");
        out.push_str("# HELP snowgate_plugin_loads_total Builds loaded to serve (at start and by reloads), by where their compiled code came from: compiled now, or read from --plugin-cache-dir.\n");
        out.push_str("# TYPE snowgate_plugin_loads_total counter\n");
        for compiled in [Compiled::Now, Compiled::FromCache] {
            let _ = writeln!(
                out,
                "snowgate_plugin_loads_total{{compiled=\"{}\"}} {}",
                compiled.name(),
                load(&self.loads[compiled as usize])
            );
        }
        out.push_str(
            "# HELP snowgate_plugin_failures_total Plugin calls that gave no answer, by kind.\n",
        );
        out.push_str("# TYPE snowgate_plugin_failures_total counter\n");
        for (kind, counter) in CallError::KINDS.iter().zip(&self.plugin_failures) {
            let _ = writeln!(
                out,
                "snowgate_plugin_failures_total{{kind=\"{kind}\"}} {}",
                load(counter)
            );
        }
        self.plugin_calls.render(
            &mut out,
            "snowgate_plugin_call_seconds",
            "Time of one plugin call, instantiation included; of a call its client gave up on (counted in snowgate_requests_total{outcome=\"abandoned\"}), until then.",
        );
        out.push_str("# HELP snowgate_responses_total Responses to clients, by status class: the upstream's, and the gateway's own (400, 413, 502, 503, ...).\n");
        out.push_str("# TYPE snowgate_responses_total counter\n");
        for (class, counter) in STATUS_CLASSES.iter().zip(&self.responses) {
            let _ = writeln!(
                out,
                "snowgate_responses_total{{code=\"{class}\"}} {}",
                load(counter)
            );
        }
        self.response_headers.render(
            &mut out,
            "snowgate_response_headers_seconds",
            "Time from a request's arrival to its response's headers (a streamed body goes on after), plugin and upstream included.",
        );
        if let Some(&max) = self.connections_max.get() {
            gauge(
                &mut out,
                "snowgate_connections_open",
                "Client connections open now (an HTTP/2 connection counts once).",
                self.connections_open.load(Ordering::Relaxed),
            );
            gauge(
                &mut out,
                "snowgate_connections_max",
                "Client connections served at once (--max-connections); more wait in the listen backlog.",
                max,
            );
        }
        if let Some((calls, waiting)) = self.plugin_calls_in_use.get() {
            gauge(
                &mut out,
                "snowgate_plugin_calls_running",
                "Plugin calls running now, a call that gave its thread back to other requests included.",
                calls.now(),
            );
            gauge(
                &mut out,
                "snowgate_plugin_calls_max",
                "Plugin calls the gateway runs at once; more wait for a turn.",
                calls.total,
            );
            gauge(
                &mut out,
                "snowgate_plugin_calls_waiting",
                "Requests with a body read, waiting for a plugin call slot.",
                waiting.load(Ordering::Relaxed),
            );
        }
        if let Some((requests, waiting)) = self.upstream_requests.get() {
            gauge(
                &mut out,
                "snowgate_upstream_requests_in_flight",
                "Requests sent to the upstream whose response has not ended yet.",
                requests.now(),
            );
            gauge(
                &mut out,
                "snowgate_upstream_requests_max",
                "Requests in flight to the upstream at once (--max-upstream-requests); more wait for a turn.",
                requests.total,
            );
            gauge(
                &mut out,
                "snowgate_upstream_requests_waiting",
                "Requests waiting for a turn to go to the upstream.",
                waiting.load(Ordering::Relaxed),
            );
        }
        if let Some(memory) = &*self.body_memory.load() {
            gauge(
                &mut out,
                "snowgate_body_memory_bytes",
                "Memory taken now in the body memory by request bodies read whole (for the plugin) and not yet sent upstream, in whole KiB per body: the room each took (its declared length, or, for a body that declared none, 1 MiB at first (--max-body-bytes where that is less) and more as it arrives), and what the request first in line for room has gathered.",
                memory.held(),
            );
            gauge(
                &mut out,
                "snowgate_body_memory_overdrawn_bytes",
                "Memory that bodies the plugin rewrote hold beyond their room, where no more room was free when the plugin answered (they are sent anyway, each holding at most its room again), in whole KiB per body: on top of snowgate_body_memory_bytes, which with it may pass the max.",
                memory.overdrawn(),
            );
            gauge(
                &mut out,
                "snowgate_body_memory_max_bytes",
                "The most memory such bodies may hold at once (--body-memory-mib), beside the small bodies' lane (snowgate_body_memory_lane_max_bytes).",
                memory.limit(),
            );
            gauge(
                &mut out,
                "snowgate_body_memory_lane_max_bytes",
                "Memory beside snowgate_body_memory_max_bytes where bodies of up to 64 KiB take room when none is free in it (a sixteenth of it, at least 64 KiB), so that they need not wait behind large ones; snowgate_body_memory_bytes counts what they take there too.",
                memory.lane(),
            );
            gauge(
                &mut out,
                "snowgate_body_memory_waiting",
                "Requests waiting for room for their body in that memory.",
                memory.waiting(),
            );
        }
        out
    }
}

/// One gauge with its help and type lines.
fn gauge(out: &mut String, name: &str, help: &str, value: usize) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} gauge");
    let _ = writeln!(out, "{name} {value}");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scraped while other threads record, every scrape's `+Inf` bucket
    /// and count are at least its last finite bucket, and equal.
    #[test]
    fn a_histogram_scraped_while_recording_stays_cumulative() {
        let histogram = Histogram::new(&LATENCY_BUCKETS);
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            let recorders: Vec<_> = (0..2)
                .map(|_| {
                    scope.spawn(|| {
                        for _ in 0..200_000 {
                            histogram.record(Duration::from_millis(900));
                        }
                    })
                })
                .collect();
            let scrapes = scope.spawn(|| {
                let mut scrapes = 0;
                while !done.load(Ordering::Relaxed) {
                    let mut out = String::new();
                    histogram.render(&mut out, "h", "help");
                    let value = |prefix: &str| -> u64 {
                        let line = out.lines().find(|l| l.starts_with(prefix)).expect(prefix);
                        line.rsplit(' ').next().unwrap().parse().unwrap()
                    };
                    let last = value("h_bucket{le=\"1\"}");
                    let infinity = value("h_bucket{le=\"+Inf\"}");
                    assert!(infinity >= last, "+Inf {infinity} below le=1 {last}");
                    assert_eq!(value("h_count"), infinity);
                    scrapes += 1;
                }
                scrapes
            });
            for recorder in recorders {
                recorder.join().unwrap();
            }
            done.store(true, Ordering::Relaxed);
            assert!(scrapes.join().unwrap() > 0);
        });
    }

    /// A call is timed when its timer is dropped, however it ends (a
    /// request dropped mid-call drops it too), and not when the plugin did
    /// not run; calls longer than the default deadline land in buckets of
    /// their own, up to a minute.
    #[test]
    fn a_plugin_call_is_timed_when_its_timer_drops_unless_it_did_not_run() {
        let metrics = Metrics::default();
        drop(metrics.time_plugin_call());
        metrics.time_plugin_call().did_not_run();
        metrics.plugin_call(Duration::from_secs(20));
        metrics.plugin_call(Duration::from_secs(90));
        let text = metrics.render(0);
        assert!(
            text.contains("snowgate_plugin_call_seconds_count 3\n"),
            "{text}"
        );
        assert!(text.contains("snowgate_plugin_call_seconds_bucket{le=\"1\"} 1\n"));
        assert!(text.contains("snowgate_plugin_call_seconds_bucket{le=\"10\"} 1\n"));
        assert!(text.contains("snowgate_plugin_call_seconds_bucket{le=\"30\"} 2\n"));
        assert!(text.contains("snowgate_plugin_call_seconds_bucket{le=\"60\"} 2\n"));
        assert!(text.contains("snowgate_plugin_call_seconds_bucket{le=\"+Inf\"} 3\n"));
    }

    #[test]
    fn renders_counters_and_a_cumulative_histogram() {
        let metrics = Metrics::default();
        metrics.request(Outcome::Rewritten);
        metrics.request(Outcome::Rewritten);
        metrics.plugin_failure(&CallError::Deadline(Duration::from_secs(1)));
        metrics.upstream_error(UpstreamError::TimedOut);
        metrics.upstream_error(UpstreamError::Unreachable);
        metrics.upstream_error(UpstreamError::TimedOut);
        metrics.plugin_call(Duration::from_micros(30));
        metrics.plugin_call(Duration::from_millis(2));
        metrics.response(http::StatusCode::OK, Duration::from_millis(3));
        metrics.response(
            http::StatusCode::SERVICE_UNAVAILABLE,
            Duration::from_secs(20),
        );
        metrics.response(http::StatusCode::CREATED, Duration::from_secs(700));
        let unassigned = http::StatusCode::from_u16(799).expect("a status http allows");
        metrics.response(unassigned, Duration::from_millis(1));
        let text = metrics.render(3);
        assert!(
            text.contains("snowgate_requests_total{outcome=\"rewritten\"} 2\n"),
            "{text}"
        );
        assert!(text.contains("snowgate_ids_stamped_total 3\n"));
        for (kind, count) in [
            ("unreachable", 1),
            ("failed", 0),
            ("unusable", 0),
            ("timed_out", 2),
        ] {
            let line = format!("snowgate_upstream_errors_total{{kind=\"{kind}\"}} {count}\n");
            assert!(text.contains(&line), "{text}");
        }
        assert!(text.contains("snowgate_plugin_failures_total{kind=\"deadline\"} 1\n"));
        assert!(text.contains("snowgate_plugin_call_seconds_bucket{le=\"0.00005\"} 1\n"));
        assert!(text.contains("snowgate_plugin_call_seconds_bucket{le=\"0.0025\"} 2\n"));
        assert!(text.contains("snowgate_plugin_call_seconds_count 2\n"));
        assert!(
            text.contains("snowgate_plugin_call_seconds_sum 0.00203\n"),
            "{text}"
        );
        assert!(
            text.contains("snowgate_responses_total{code=\"2xx\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("snowgate_responses_total{code=\"5xx\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("snowgate_responses_total{code=\"4xx\"} 0\n"),
            "{text}"
        );
        // A 799 is in no class, but timed.
        for class in ["1xx", "3xx"] {
            let line = format!("snowgate_responses_total{{code=\"{class}\"}} 0\n");
            assert!(text.contains(&line), "{text}");
        }
        assert!(text.contains("snowgate_response_headers_seconds_bucket{le=\"0.0005\"} 0\n"));
        assert!(text.contains("snowgate_response_headers_seconds_bucket{le=\"0.001\"} 1\n"));
        assert!(text.contains("snowgate_response_headers_seconds_bucket{le=\"0.005\"} 2\n"));
        assert!(text.contains("snowgate_response_headers_seconds_bucket{le=\"30\"} 3\n"));
        assert!(text.contains("snowgate_response_headers_seconds_bucket{le=\"600\"} 3\n"));
        assert!(text.contains("snowgate_response_headers_seconds_bucket{le=\"+Inf\"} 4\n"));
        assert!(text.contains("snowgate_response_headers_seconds_count 4\n"));
    }
}
