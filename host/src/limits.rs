//! What one plugin call may use.

use std::time::Duration;

/// Limits applied to every plugin call. Hitting one is an error value for
/// the caller, never a crash of the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PluginLimits {
    /// The most linear memory one instance may grow to. The body is copied in
    /// and a new body built inside, so allow a few times the largest body.
    pub memory_bytes: usize,
    /// Time for instantiation, configuration and the handler together
    /// (the handler alone on a reused instance), enforced by epoch
    /// interruption; a WASI wait that would end after it ends the call.
    /// An async call (the gateway's) does not count the time it waits for
    /// its next turn after yielding its thread to other requests.
    /// At most [`MAX_DEADLINE`](crate::engine::MAX_DEADLINE) (a day): the
    /// engine takes longer ones, `Duration::MAX` included, as that.
    pub deadline: Duration,
    /// The largest body a plugin may answer with. The gateway and
    /// `snowgate rewrite` raise it to twice the largest body they take (see
    /// [`PluginLimits::answering_bodies_of`]).
    pub max_output_body_bytes: usize,
    /// How many plugin instances may be alive at once in one engine: the
    /// number of slots in the engine's pooling allocator. Every call holds
    /// one instance for its duration (so do load-time checks and the
    /// plugin a reload is replacing, while it finishes its calls); a call
    /// that finds every slot taken fails at once with
    /// [`CallError::Busy`](crate::CallError::Busy) instead of waiting. The
    /// gateway runs at most [`PluginLimits::concurrent_calls`] at once and
    /// keeps at most [`PluginLimits::kept_instances`] idle per plugin, so
    /// its calls wait for a turn instead.
    ///
    /// Each slot reserves about 4 GiB of virtual address space (not memory)
    /// for its linear memory, and keeps up to a few MiB of it resident
    /// between calls, so this also bounds the plugin memory of the process:
    /// at most `max_instances * memory_bytes` in use at once. 0 is taken
    /// as 1.
    pub max_instances: u32,
    /// How many requests one instance may serve in the gateway before it
    /// is dropped for a fresh one; 1 is a fresh instance per request.
    ///
    /// An instance is used by one request at a time, and given back for
    /// reuse only after a call that ended normally (an answer or the
    /// plugin's own error): one that trapped, ran past its deadline, hit
    /// the memory limit, wrote to stderr or grew its memory by more than a
    /// few MiB after `configure` is dropped. The host resets what is a
    /// call's own at each call (its clock, its ids, its log lines). What a
    /// reused instance keeps is its own linear memory, so a plugin must not
    /// keep one request's data for the next (the bundled plugin keeps
    /// nothing: see the WIT `handler` docs). 0 is taken as 1.
    pub calls_per_instance: u32,
}

impl PluginLimits {
    /// 256 MiB of memory, 1 second, and a 64 MiB answer: enough to stamp a
    /// 32 MiB body (a long `prompt_token_ids` list) several times over; and
    /// 64 instances at once, far more calls than a small gateway's cores run
    /// at a time (a 1 KiB body takes microseconds), with room for bursts of
    /// large bodies and a reload in flight; and up to 1000 requests per
    /// instance, which makes instantiation a thousandth of its cost while
    /// still recycling instances often.
    pub const DEFAULT: PluginLimits = PluginLimits {
        memory_bytes: 256 << 20,
        deadline: Duration::from_secs(1),
        max_output_body_bytes: 64 << 20,
        max_instances: 64,
        calls_per_instance: 1000,
    };

    /// How many idle instances of one plugin the gateway keeps for reuse:
    /// a quarter of `max_instances`, at most 16 (enough for every worker
    /// thread and calls that overlap on one); none below 4 slots, where
    /// every slot is needed for calls and reloads.
    pub fn kept_instances(&self) -> u32 {
        if self.calls_per_instance <= 1 {
            return 0;
        }
        (self.max_instances / 4).min(16)
    }

    /// These limits with an answer limit of at least twice `body_bytes`,
    /// so that a body that is accepted is never refused for the size of
    /// its stamped answer: each id the bundled plugin stamps adds at most
    /// 40 bytes (`,"disagg_request_id":` and 19 digits) to a params object
    /// that takes at least 54 bytes of the body. The answer limit is never
    /// lowered.
    pub fn answering_bodies_of(self, body_bytes: usize) -> PluginLimits {
        PluginLimits {
            max_output_body_bytes: self.max_output_body_bytes.max(body_bytes.saturating_mul(2)),
            ..self
        }
    }

    /// How many plugin calls the gateway runs at once (more wait their
    /// turn): the slots left when the serving plugin keeps its kept
    /// instances and a reload checks a new build in one more. Calls still
    /// running on a replaced build count among these calls (a replaced
    /// build keeps no instances: see [`Plugin::retire`](crate::Plugin::retire)).
    /// So with at least 2 slots a call never finds the pool full; with one
    /// slot, a call and a reload's check cannot run at once, and whichever
    /// comes second fails as busy.
    pub fn concurrent_calls(&self) -> u32 {
        self.max_instances
            .saturating_sub(self.kept_instances())
            .saturating_sub(1)
            .max(1)
    }
}

impl Default for PluginLimits {
    fn default() -> Self {
        PluginLimits::DEFAULT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Calls in flight, the instances a replaced plugin still keeps, and a
    /// reload's check never need more slots than the pool has.
    #[test]
    fn calls_kept_instances_and_a_reload_fit_in_the_pool() {
        for max_instances in [1, 2, 3, 4, 5, 8, 16, 63, 64, 65, 100, 1000] {
            for calls_per_instance in [1, 2, 1000] {
                let limits = PluginLimits {
                    max_instances,
                    calls_per_instance,
                    ..PluginLimits::DEFAULT
                };
                let calls = limits.concurrent_calls();
                let kept = limits.kept_instances();
                assert!(calls >= 1);
                if max_instances >= 2 {
                    assert!(
                        calls + kept < max_instances,
                        "{max_instances} slots: {calls} calls + {kept} kept + 1 for a reload"
                    );
                }
            }
        }
        assert_eq!(PluginLimits::DEFAULT.kept_instances(), 16);
        assert_eq!(PluginLimits::DEFAULT.concurrent_calls(), 47);
    }

    #[test]
    fn the_answer_limit_follows_the_body_limit_and_is_never_lowered() {
        let limits = PluginLimits::default();
        assert_eq!(
            limits.answering_bodies_of(32 << 20).max_output_body_bytes,
            64 << 20
        );
        assert_eq!(
            limits.answering_bodies_of(1 << 10).max_output_body_bytes,
            64 << 20
        );
        assert_eq!(
            limits.answering_bodies_of(100 << 20).max_output_body_bytes,
            200 << 20
        );
        assert_eq!(
            limits.answering_bodies_of(usize::MAX).max_output_body_bytes,
            usize::MAX
        );
        let raised = limits.answering_bodies_of(100 << 20);
        assert_eq!(
            raised,
            PluginLimits {
                max_output_body_bytes: 200 << 20,
                ..limits
            }
        );
    }
}
