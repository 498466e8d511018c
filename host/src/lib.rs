//! The snowgate host: embeds wasmtime, loads a `snowgate:middleware` plugin
//! and runs it on requests.
//!
//! - [`engine`]: the one wasmtime engine of the process and its linker;
//! - [`plugin`]: loading and checking a plugin component, compiled here or
//!   in a [`compile_process`] under limits of its own;
//! - [`call`]: where the plugin is called: a fresh instance per call, or
//!   (in the gateway) an instance kept for up to `calls_per_instance` calls;
//!   `call_clock` counts a call's deadline in the time it runs, and
//!   [`id_fence`] checks the ids a call made before they leave;
//! - [`id_clock`] and [`identity`]: where id time and the machine id come from,
//!   and [`lease`]: machine ids leased in etcd, unique across a fleet,
//!   with deadlines on the [`boot_clock`]; or a fixed machine id whose
//!   [`high_water_file`] keeps its ids from repeating across restarts;
//! - the imports a plugin calls: `state` (the id clock's ticks, the
//!   machine id, the log), [`request`] (the request's headers) and
//!   [`header_edits`]; for those that take text from the plugin,
//!   `in_place_imports` links versions that read it in the plugin's
//!   memory, in place of the bindings' copies;
//! - [`limits`]: what one call may use;
//! - [`gateway`]: the reverse proxy that puts the plugin in a request path.
//!
//! # Example
//! ```
//! use std::sync::Arc;
//! use snowgate_host::{Action, HostServices, IdClock, MachineIdentity, Plugin, PluginEngine, PluginLimits, Request};
//! use snowgate_plugin::SnowflakeLayout;
//!
//! let services = HostServices {
//!     clock: Arc::new(IdClock::system()),
//!     identity: Arc::new(MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 7)?),
//! };
//! let engine = PluginEngine::new(services, PluginLimits::default())?;
//! let plugin = Plugin::load(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[])?;
//! let request = Request {
//!     method: "POST".into(),
//!     path: "/v1/completions".into(),
//!     headers: vec![("content-type".into(), b"application/json".to_vec())].into(),
//!     body: br#"{"prompt":"hi","disaggregated_params":{"request_type":"context_only"}}"#.to_vec(),
//! };
//! let Action::ForwardWithBody(body) = plugin.handle(&request)? else { panic!("expected a stamp") };
//! assert!(String::from_utf8(body)?.contains(r#""disagg_request_id":"#));
//! # Ok::<(), anyhow::Error>(())
//! ```

// Every public item is documented: the docs are the API.
#![deny(missing_docs)]

mod bindings;
pub mod boot_clock;
pub mod call;
mod call_clock;
pub mod compile_cache;
pub mod compile_process;
pub mod engine;
pub mod gateway;
pub mod header_edits;
pub mod high_water_file;
pub mod id_clock;
pub mod id_fence;
pub mod identity;
mod in_place_imports;
pub mod lease;
pub mod limits;
mod log_throttle;
pub mod plugin;
pub mod request;
mod sleeps;
mod state;
mod text_limits;
mod unpoisoned;
pub mod utc;

pub use bindings::exports::snowgate::middleware::handler::{Action, Rejection};
pub use call::{Answer, CallError, SelfCheckAnswer, SelfCheckInstance, YIELD_AFTER};
pub use compile_cache::{CompileCache, Compiled};
pub use compile_process::{CompileLimits, CompileProcess};
pub use engine::{HostServices, PluginEngine};
pub use header_edits::{HeaderEdit, HeaderEdits};
pub use id_clock::{FixedClock, IdClock, NoTick, SystemClock, Tick, TicksTaken, WallClock};
pub use id_fence::Fenced;
pub use identity::MachineIdentity;
pub use limits::PluginLimits;
pub use plugin::{
    layout_setting_problem, ConfigurationRefused, LinkedPlugin, Plugin, PluginInfo, LAYOUT_SETTING,
};
pub use request::{Headers, Request};
pub use text_limits::{plugin_reason, plugin_text};
