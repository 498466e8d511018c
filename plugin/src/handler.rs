//! What the plugin does with one request: the whole decision, independent of
//! wasm, so the guest glue and native callers run the very same code.

use std::fmt;

use crate::body::{find_edits, BodyError, Edit};
use crate::layout::{LayoutError, SnowflakeLayout};
use crate::msgpack::{self, find_msgpack_edits, MsgpackEdit, MsgpackError};
use crate::stamp;

/// The plugin's name, as the `name` export reports it.
pub const PLUGIN_NAME: &str = "snowgate-disagg-id";

/// The plugin's version, as the `version` export reports it.
pub const PLUGIN_VERSION: &str = env!("CARGO_PKG_VERSION");

/// One reading of the host's clock: unique in the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tick {
    /// Milliseconds since the Unix epoch.
    pub millis: u64,
    /// Position within the millisecond.
    pub sequence: u32,
}

/// A machine id and the layout the host checked it against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MachineId {
    /// The id.
    pub value: u32,
    /// The layout `value` is meant for.
    pub layout: SnowflakeLayout,
}

/// What the plugin needs from its host to make ids.
pub trait IdSource {
    /// The machine id to use now, or why there is none.
    fn machine_id(&mut self) -> Result<MachineId, String>;
    /// The next unique tick, for a layout with `sequence_space` sequence
    /// numbers per millisecond.
    fn next_tick(&mut self, sequence_space: u32) -> Tick;
}

/// The plugin's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Config {
    /// The layout of the ids it makes.
    pub layout: SnowflakeLayout,
}

impl Config {
    /// Builds a configuration from `(name, value)` settings. Known settings:
    /// `id-layout` (`trtllm-v1`, the default, or `trtllm-v2`).
    pub fn from_settings<'s>(
        settings: impl IntoIterator<Item = (&'s str, &'s str)>,
    ) -> Result<Config, String> {
        let mut config = Config::default();
        for (name, value) in settings {
            match name {
                "id-layout" => {
                    config.layout = value
                        .parse()
                        .map_err(|e| format!("setting id-layout: {e}"))?;
                }
                other => {
                    return Err(format!(
                        "unknown setting {other:?}: the only setting is id-layout"
                    ))
                }
            }
        }
        Ok(config)
    }
}

/// A deliberate refusal: the client gets `status` and `message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// HTTP status, 400..=599.
    pub status: u16,
    /// Machine-readable code, e.g. `invalid_json`.
    pub code: &'static str,
    /// A sentence that names the problem.
    pub message: String,
}

/// What to do with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Forward the request unchanged.
    Forward,
    /// Forward it with this body; `ids` are the ids stamped, in the order
    /// the walk recorded them (JSON: where they land; MessagePack: by the
    /// map headers they change).
    ForwardWithBody {
        /// The new body.
        body: Vec<u8>,
        /// The ids written into it.
        ids: Vec<u64>,
    },
    /// Answer the client instead.
    Reject(Rejection),
}

/// A failure of the plugin itself, not of the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginFailure(pub String);

impl fmt::Display for PluginFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PluginFailure {}

impl From<BodyError> for Rejection {
    fn from(e: BodyError) -> Self {
        Rejection {
            status: 400,
            code: e.code(),
            message: e.to_string(),
        }
    }
}

impl From<MsgpackError> for Rejection {
    fn from(e: MsgpackError) -> Self {
        Rejection {
            status: 400,
            code: e.code(),
            message: e.to_string(),
        }
    }
}

/// The header that says a body is MessagePack, in lower case.
pub const MSGPACK_HEADER: &str = "x-trtllm-msgpack";

/// Whether the headers, in the order they came, say the body is
/// MessagePack (TensorRT-LLM's `X-TRTLLM-Msgpack: 1`, sent with
/// `Content-Type: application/json`): the first value of the header is
/// `1`, as the worker reads it (Starlette's `headers.get`, which takes the
/// first). A JSON body sent with `0` and then `1` is JSON to the worker.
pub fn is_msgpack<'h>(mut headers: impl Iterator<Item = (&'h str, &'h [u8])>) -> bool {
    headers
        .find(|(name, _)| name.eq_ignore_ascii_case(MSGPACK_HEADER))
        .is_some_and(|(_, value)| value.trim_ascii() == b"1")
}

/// Decides what to do with a request body: stamp every context-only
/// `disaggregated_params` that lacks an id, or reject what cannot be read.
pub fn decide(
    config: &Config,
    msgpack: bool,
    body: &[u8],
    ids: &mut impl IdSource,
) -> Result<Decision, PluginFailure> {
    let found = if msgpack {
        find_msgpack_edits(body)
            .map(Edits::Msgpack)
            .map_err(Rejection::from)
    } else {
        find_edits(body).map(Edits::Json).map_err(Rejection::from)
    };
    let edits = match found {
        Ok(edits) => edits,
        Err(rejection) => return Ok(Decision::Reject(rejection)),
    };
    if edits.is_empty() {
        return Ok(Decision::Forward);
    }
    let machine = match ids.machine_id() {
        Ok(machine) => machine,
        Err(reason) => {
            return Ok(Decision::Reject(Rejection {
                status: 503,
                code: "no_machine_id",
                message: format!("this gateway cannot issue request ids right now: {reason}"),
            }))
        }
    };
    let layout = config.layout;
    if machine.layout != layout {
        return Err(PluginFailure(format!(
            "the host's machine id {} is meant for layout {}, but the plugin is configured for {layout}",
            machine.value, machine.layout
        )));
    }
    layout
        .check_machine_id(machine.value)
        .map_err(|e| PluginFailure(format!("the host's machine id is unusable: {e}")))?;
    let space = layout.sequence_space();
    // Filled in place: collecting the fallible map would grow it by
    // doubling, and leave the smaller copies behind in the arena.
    let mut stamped = Vec::with_capacity(edits.len());
    for _ in 0..edits.len() {
        let tick = ids.next_tick(space);
        // The reading a refusing clock gives (millis 2^64 - 1) makes an id
        // the host withholds, answering why itself (`id_rate_exceeded`):
        // it is not refused here as one in the v2 stamp's last minute.
        let made = if tick.millis == u64::MAX {
            layout.compose(tick.millis, machine.value, tick.sequence)
        } else {
            layout.compose_unique(tick.millis, machine.value, tick.sequence)
        };
        let id = match made {
            Ok(id) => id,
            // For 65.536 s every 17.4 years: a wait, not a fault.
            Err(e @ LayoutError::StampFolds { .. }) => {
                return Ok(Decision::Reject(Rejection {
                    status: 503,
                    code: "no_unique_id",
                    message: format!("this gateway cannot issue request ids right now: {e}"),
                }))
            }
            Err(e) => {
                return Err(PluginFailure(format!(
                    "the host's clock gave an unusable tick: {e}"
                )))
            }
        };
        stamped.push(id);
    }
    let body = match &edits {
        Edits::Json(edits) => stamp::apply(body, edits, &stamped),
        Edits::Msgpack(edits) => msgpack::apply(body, edits, &stamped),
    };
    Ok(Decision::ForwardWithBody { body, ids: stamped })
}

/// Where ids go, in a body of either format.
enum Edits {
    Json(Vec<Edit>),
    Msgpack(Vec<MsgpackEdit>),
}

impl Edits {
    fn len(&self) -> usize {
        match self {
            Edits::Json(edits) => edits.len(),
            Edits::Msgpack(edits) => edits.len(),
        }
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host whose clock reads `millis`, one sequence after another.
    struct ClockAt {
        millis: u64,
        sequence: u32,
    }

    impl IdSource for ClockAt {
        fn machine_id(&mut self) -> Result<MachineId, String> {
            Ok(MachineId {
                value: 7,
                layout: SnowflakeLayout::TrtllmV2,
            })
        }

        fn next_tick(&mut self, _sequence_space: u32) -> Tick {
            self.sequence += 1;
            Tick {
                millis: self.millis,
                sequence: self.sequence - 1,
            }
        }
    }

    /// In the 65.536 s before trtllm-v2's stamp wraps, where its ids would
    /// repeat those made after the wrap, a request that needs one is
    /// answered 503 saying why, not stamped, and not a plugin failure
    /// (which fail-open would forward unstamped); after the wrap it is
    /// stamped again.
    #[test]
    fn a_v2_request_in_the_window_before_the_stamp_wraps_waits_with_503() {
        let config = Config {
            layout: SnowflakeLayout::TrtllmV2,
        };
        let body = br#"{"disaggregated_params":{"request_type":"context_only"}}"#;
        let wrap = 4u64 << 39;
        let mut before = ClockAt {
            millis: wrap - 1000,
            sequence: 0,
        };
        match decide(&config, false, body, &mut before) {
            Ok(Decision::Reject(rejection)) => {
                assert_eq!(rejection.status, 503);
                assert_eq!(rejection.code, "no_unique_id");
                assert!(rejection.message.contains("wraps"), "{}", rejection.message);
            }
            other => panic!("not a 503: {other:?}"),
        }
        let mut after = ClockAt {
            millis: wrap + 64_536,
            sequence: 0,
        };
        assert!(matches!(
            decide(&config, false, body, &mut after),
            Ok(Decision::ForwardWithBody { .. })
        ));
        // The refusing clock's reading (2^64 - 1 ms, whose 39 bits are in
        // that window too) is forwarded as before: the host withholds its
        // id and answers 503 `id_rate_exceeded` itself.
        let mut refused = ClockAt {
            millis: u64::MAX,
            sequence: 0,
        };
        assert!(matches!(
            decide(&config, false, body, &mut refused),
            Ok(Decision::ForwardWithBody { .. })
        ));
    }
}
