//! What one plugin call may use.

use std::time::Duration;

/// Limits applied to every plugin call. Hitting one is an error value for
/// the caller, never a crash of the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PluginLimits {
    /// The most linear memory one instance may grow to. The body is copied in
    /// and a new body built inside, so allow a few times the largest body.
    pub memory_bytes: usize,
    /// Wall time for instantiation, configuration and the handler together,
    /// enforced by epoch interruption.
    pub deadline: Duration,
    /// The largest body a plugin may answer with.
    pub max_output_body_bytes: usize,
}

impl PluginLimits {
    /// 256 MiB of memory, 1 second, and a 64 MiB answer: enough to stamp a
    /// 32 MiB body (a long `prompt_token_ids` list) several times over.
    pub const DEFAULT: PluginLimits = PluginLimits {
        memory_bytes: 256 << 20,
        deadline: Duration::from_secs(1),
        max_output_body_bytes: 64 << 20,
    };
}

impl Default for PluginLimits {
    fn default() -> Self {
        PluginLimits::DEFAULT
    }
}
