//! The snowgate disaggregated-request-id plugin.
//!
//! Finds every context-only `disaggregated_params` object in a JSON (or
//! MessagePack) request body and gives it a `disagg_request_id` in TensorRT-LLM's snowflake layout,
//! changing no other byte of the body (in MessagePack, but for the count
//! in the header of a map that gains the id).
//!
//! The crate is a pure core that compiles natively (tests, fuzzing,
//! benchmarks, the host's `decode` command) and, for `wasm32`, a thin
//! wit-bindgen glue that exports it as a `snowgate:middleware` component:
//! - [`body`]: the JSON walk that finds where ids go;
//! - [`stamp`]: splices ids into those places;
//! - [`msgpack`]: both, for MessagePack bodies (`X-TRTLLM-Msgpack: 1`);
//! - [`layout`]: packs ids bit for bit as TensorRT-LLM does;
//! - [`handler`]: the decision for one request, on top of the other four.
//!
//! # Example
//! ```
//! use snowgate_plugin::{decide, Config, Decision, IdSource, MachineId, SnowflakeLayout, Tick};
//!
//! struct Fixed(u32);
//! impl IdSource for Fixed {
//!     fn machine_id(&mut self) -> Result<MachineId, String> {
//!         Ok(MachineId { value: 7, layout: SnowflakeLayout::TrtllmV1 })
//!     }
//!     fn next_tick(&mut self, _space: u32) -> Tick {
//!         self.0 += 1;
//!         Tick { millis: 1_764_000_000_000, sequence: self.0 - 1 }
//!     }
//! }
//!
//! let body = br#"{"prompt":"hi","disaggregated_params":{"request_type":"context_only"}}"#;
//! let decision = decide(&Config::default(), false, body, &mut Fixed(0)).unwrap();
//! let Decision::ForwardWithBody { body, ids } = decision else { panic!("expected a stamp") };
//! assert_eq!(ids, [7398756654046539776]);
//! assert_eq!(
//!     String::from_utf8(body).unwrap(),
//!     r#"{"prompt":"hi","disaggregated_params":{"request_type":"context_only","disagg_request_id":7398756654046539776}}"#
//! );
//! ```

// Every public item is documented: the docs are the API.
#![deny(missing_docs)]

// The component's allocator; natively only its tests use it.
#[cfg_attr(
    not(all(target_arch = "wasm32", feature = "component")),
    allow(dead_code)
)]
mod arena;
pub mod body;
mod edits_by_key;
pub mod handler;
pub mod layout;
pub mod msgpack;
pub mod stamp;

#[cfg(all(target_arch = "wasm32", feature = "component"))]
mod guest;

pub use body::{find_edits, BodyError, Edit, MAX_NESTING_DEPTH};
pub use handler::{
    decide, is_msgpack, Config, Decision, IdSource, MachineId, PluginFailure, Rejection, Tick,
    MSGPACK_HEADER, PLUGIN_NAME, PLUGIN_VERSION,
};
pub use layout::{IdParts, LayoutError, SnowflakeLayout};
pub use msgpack::{find_msgpack_edits, MsgpackEdit, MsgpackError};
