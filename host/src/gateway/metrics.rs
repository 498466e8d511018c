//! Counters and the plugin-call latency histogram, in Prometheus text format.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::compile_cache::Compiled;

/// How a request through the gateway ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Went upstream without passing through the plugin (not JSON).
    PassedThrough,
    /// The plugin let it through unchanged.
    Forwarded,
    /// The plugin changed its body (stamped ids).
    Rewritten,
    /// The plugin rejected it.
    Rejected,
    /// The body was over the size limit.
    TooLarge,
    /// The plugin failed and the policy refused the request (fail-closed).
    FailedClosed,
    /// The plugin failed and the policy forwarded it unchanged (fail-open).
    FailedOpen,
    /// The body could not be read from the client.
    ClientError,
}

impl Outcome {
    const ALL: [Outcome; 8] = [
        Outcome::PassedThrough,
        Outcome::Forwarded,
        Outcome::Rewritten,
        Outcome::Rejected,
        Outcome::TooLarge,
        Outcome::FailedClosed,
        Outcome::FailedOpen,
        Outcome::ClientError,
    ];

    fn label(self) -> &'static str {
        match self {
            Outcome::PassedThrough => "passed_through",
            Outcome::Forwarded => "forwarded",
            Outcome::Rewritten => "rewritten",
            Outcome::Rejected => "rejected",
            Outcome::TooLarge => "too_large",
            Outcome::FailedClosed => "failed_closed",
            Outcome::FailedOpen => "failed_open",
            Outcome::ClientError => "client_error",
        }
    }
}

/// Plugin failure kinds, as `CallError::kind` names them.
const FAILURE_KINDS: [&str; 6] = [
    "deadline",
    "memory_limit",
    "trap",
    "plugin_error",
    "invalid_answer",
    "busy",
];

/// Upper bounds of the plugin-call latency buckets, in seconds: finest
/// around 100 µs, where a call's added latency is judged.
const LATENCY_BUCKETS: [f64; 19] = [
    0.000005, 0.00001, 0.000025, 0.00005, 0.000075, 0.0001, 0.00015, 0.0002, 0.00025, 0.0005,
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0,
];

/// The gateway's metrics. Lock-free: every update is one atomic add.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: [AtomicU64; Outcome::ALL.len()],
    upstream_errors: AtomicU64,
    upstream_cut_offs: AtomicU64,
    reloads_succeeded: AtomicU64,
    reloads_failed: AtomicU64,
    /// Builds loaded (at start and by reloads): compiled now, read from
    /// the compile cache.
    loads: [AtomicU64; 2],
    plugin_failures: [AtomicU64; FAILURE_KINDS.len()],
    call_buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    call_count: AtomicU64,
    call_nanos: AtomicU64,
}

impl Metrics {
    /// Counts one request by how it ended.
    pub fn request(&self, outcome: Outcome) {
        self.requests[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request that got no upstream response (answered 502 or 504).
    pub fn upstream_error(&self) {
        self.upstream_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a response cut off after its headers because of its
    /// upstream: it paused longer than the upstream read timeout, or its
    /// connection failed within the body.
    pub fn upstream_cut_off(&self) {
        self.upstream_cut_offs.fetch_add(1, Ordering::Relaxed);
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

    /// Counts a plugin failure of `kind` (see `CallError::kind`).
    pub fn plugin_failure(&self, kind: &str) {
        if let Some(i) = FAILURE_KINDS.iter().position(|k| *k == kind) {
            self.plugin_failures[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records the duration of one plugin call.
    pub fn plugin_call(&self, took: Duration) {
        let seconds = took.as_secs_f64();
        if let Some(i) = LATENCY_BUCKETS.iter().position(|&le| seconds <= le) {
            self.call_buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.call_count.fetch_add(1, Ordering::Relaxed);
        self.call_nanos
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
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
            "# HELP snowgate_requests_total Requests through the gateway, by how they ended.\n",
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
            "# HELP snowgate_ids_stamped_total Request ids the plugin took from the clock, one per loaded build's self-check included (that id never leaves the process).\n",
        );
        out.push_str("# TYPE snowgate_ids_stamped_total counter\n");
        let _ = writeln!(out, "snowgate_ids_stamped_total {ids_issued}");
        out.push_str(
            "# HELP snowgate_upstream_errors_total Requests that got no upstream response: 502 (unreachable, failed) or 504 (timed out).\n",
        );
        out.push_str("# TYPE snowgate_upstream_errors_total counter\n");
        let _ = writeln!(
            out,
            "snowgate_upstream_errors_total {}",
            load(&self.upstream_errors)
        );
        out.push_str(
            "# HELP snowgate_upstream_cut_offs_total Responses cut off after their headers because of the upstream: it paused within the body longer than --upstream-read-timeout-ms, or its connection failed within the body.\n",
        );
        out.push_str("# TYPE snowgate_upstream_cut_offs_total counter\n");
        let _ = writeln!(
            out,
            "snowgate_upstream_cut_offs_total {}",
            load(&self.upstream_cut_offs)
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
        for (kind, counter) in FAILURE_KINDS.iter().zip(&self.plugin_failures) {
            let _ = writeln!(
                out,
                "snowgate_plugin_failures_total{{kind=\"{kind}\"}} {}",
                load(counter)
            );
        }
        out.push_str("# HELP snowgate_plugin_call_seconds Time of one plugin call, instantiation included.\n");
        out.push_str("# TYPE snowgate_plugin_call_seconds histogram\n");
        let mut cumulative = 0;
        for (le, counter) in LATENCY_BUCKETS.iter().zip(&self.call_buckets) {
            cumulative += load(counter);
            let _ = writeln!(
                out,
                "snowgate_plugin_call_seconds_bucket{{le=\"{le}\"}} {cumulative}"
            );
        }
        let count = load(&self.call_count);
        let _ = writeln!(
            out,
            "snowgate_plugin_call_seconds_bucket{{le=\"+Inf\"}} {count}"
        );
        let _ = writeln!(
            out,
            "snowgate_plugin_call_seconds_sum {}",
            load(&self.call_nanos) as f64 / 1e9
        );
        let _ = writeln!(out, "snowgate_plugin_call_seconds_count {count}");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_a_cumulative_histogram() {
        let metrics = Metrics::default();
        metrics.request(Outcome::Rewritten);
        metrics.request(Outcome::Rewritten);
        metrics.plugin_failure("deadline");
        metrics.plugin_call(Duration::from_micros(30));
        metrics.plugin_call(Duration::from_millis(2));
        let text = metrics.render(3);
        assert!(
            text.contains("snowgate_requests_total{outcome=\"rewritten\"} 2\n"),
            "{text}"
        );
        assert!(text.contains("snowgate_ids_stamped_total 3\n"));
        assert!(text.contains("snowgate_plugin_failures_total{kind=\"deadline\"} 1\n"));
        assert!(text.contains("snowgate_plugin_call_seconds_bucket{le=\"0.00005\"} 1\n"));
        assert!(text.contains("snowgate_plugin_call_seconds_bucket{le=\"0.0025\"} 2\n"));
        assert!(text.contains("snowgate_plugin_call_seconds_count 2\n"));
    }
}
