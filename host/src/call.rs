//! Where the plugin is called: one request, one fresh store, under the
//! memory limit and the CPU deadline.

use std::fmt;
use std::time::Duration;

use wasmtime::{Store, Trap};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;

use crate::bindings::exports::snowgate::middleware::handler::{Action, Request};
use crate::bindings::Middleware;
use crate::engine::EPOCH_TICK;
use crate::plugin::Plugin;
use crate::state::HostState;

/// How much of a failing plugin's stderr (a panic message) is kept.
const STDERR_CAPTURE: usize = 4096;

/// Why a plugin call gave no answer. The gateway applies its failure policy
/// to every kind alike.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallError {
    /// The call ran past the CPU deadline.
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
}

impl CallError {
    /// A short label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            CallError::Deadline(_) => "deadline",
            CallError::MemoryLimit(_) => "memory_limit",
            CallError::Trap(_) => "trap",
            CallError::PluginError(_) => "plugin_error",
            CallError::InvalidAnswer(_) => "invalid_answer",
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
        }
    }
}

impl std::error::Error for CallError {}

impl Plugin {
    /// Runs the plugin on one request in a fresh instance and returns its
    /// answer. Nothing of the instance outlives the call.
    pub fn handle(&self, request: &Request) -> Result<Action, CallError> {
        let (mut store, instance) = self.instantiate()?;
        let handler = instance.snowgate_middleware_handler();
        let configured = handler.call_configure(&mut store, &self.settings);
        match configured {
            Ok(Ok(())) => {}
            Ok(Err(refusal)) => {
                return Err(CallError::PluginError(format!("configure: {refusal}")))
            }
            Err(e) => return Err(self.classify(e, &store)),
        }
        let answer = match handler.call_handle(&mut store, request) {
            Ok(answer) => answer,
            Err(e) => return Err(self.classify(e, &store)),
        };
        let action = answer.map_err(|e| CallError::PluginError(e.message))?;
        self.check(&action)?;
        Ok(action)
    }

    /// A fresh store under the limits, and the plugin instantiated in it.
    pub(crate) fn instantiate(&self) -> Result<(Store<HostState>, Middleware), CallError> {
        let limits = self.engine.limits;
        let stderr = MemoryOutputPipe::new(STDERR_CAPTURE);
        let state = HostState::new(
            self.engine.services.clone(),
            limits.memory_bytes,
            self.name.clone(),
            stderr,
        );
        let mut store = Store::new(&self.engine.engine, state);
        store.limiter(|state| &mut state.memory);
        // One tick may be nearly over already: allow one extra.
        let ticks = limits.deadline.as_micros().div_ceil(EPOCH_TICK.as_micros()) as u64 + 1;
        store.set_epoch_deadline(ticks);
        store.epoch_deadline_trap();
        match self.pre.instantiate(&mut store) {
            Ok(instance) => Ok((store, instance)),
            Err(e) => Err(self.classify(e, &store)),
        }
    }

    fn classify(&self, error: wasmtime::Error, store: &Store<HostState>) -> CallError {
        if store.data().memory.hit {
            return CallError::MemoryLimit(self.engine.limits.memory_bytes);
        }
        if let Some(Trap::Interrupt) = error.downcast_ref::<Trap>() {
            return CallError::Deadline(self.engine.limits.deadline);
        }
        let mut detail = format!("{error:#}");
        let stderr = store.data().stderr_text();
        if !stderr.is_empty() {
            detail.push_str("; plugin stderr: ");
            detail.push_str(stderr.trim_end());
        }
        CallError::Trap(detail)
    }

    fn check(&self, action: &Action) -> Result<(), CallError> {
        match action {
            Action::Forward => Ok(()),
            Action::ForwardWithBody(body)
                if body.len() > self.engine.limits.max_output_body_bytes =>
            {
                Err(CallError::InvalidAnswer(format!(
                    "a {} byte body is over the {} byte limit",
                    body.len(),
                    self.engine.limits.max_output_body_bytes
                )))
            }
            Action::ForwardWithBody(_) => Ok(()),
            Action::Reject(r) if !(400..=599).contains(&r.status) => Err(CallError::InvalidAnswer(
                format!("reject status {} is not in 400..=599", r.status),
            )),
            Action::Reject(_) => Ok(()),
        }
    }
}
