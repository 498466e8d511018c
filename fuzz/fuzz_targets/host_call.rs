//! The host's call paths with the real plugin: each input is a request body
//! that goes through `Plugin::handle` (a fresh instance of the bundled
//! component, under the default limits) and through `Plugin::handle_async`
//! (the gateway's path: an instance reused across inputs, so one instance
//! sees a long run of arbitrary bodies). Neither call fails, and each
//! answer is the native core's decision: the same refusal, the same
//! forward, or the same edits filled with ids from the host's clock; and
//! every id of the run is greater than every id before it, whichever path
//! made it.
//!
//! A body that starts with a MessagePack map or array marker (0x80 to
//! 0x9f, 0xdc to 0xdf: never the first byte of a JSON body, whose first
//! byte that is not whitespace is ASCII)
//! goes with `X-TRTLLM-Msgpack: 1`, and is compared with the native core's
//! MessagePack decision: the wasm32 build is the only one whose `usize`
//! has 32 bits, where the MessagePack walk's lengths could overflow.
//!
//! A body of odd length goes to a host in `trtllm-v2`, with machine id
//! 16383 (node 255, process 63: every node and process bit set), one of
//! even length to a host in `trtllm-v1` with machine id 7: the length's
//! parity, as the core targets' oracle chooses (`oracle::layout_for`), so
//! the whole input stays the body, its first byte still says MessagePack
//! or JSON, and the corpora of the three targets split the same way. Each
//! layout has its own plugin, engine and clock, as two gateways would, and
//! its ids are read with that layout and must hold its host's machine id;
//! they increase within the layout (ids of the two layouts do not compare).

#![no_main]

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use libfuzzer_sys::fuzz_target;
use snowgate_fuzz::oracle::{assert_only_ids_spliced_in, layout_for, CounterIds};
use snowgate_host::{
    Action, CallError, HostServices, IdClock, MachineIdentity, Plugin, PluginEngine, PluginLimits,
    Request,
};
use snowgate_plugin::stamp::apply;
use snowgate_plugin::{
    decide, find_edits, find_msgpack_edits, msgpack, Config, Decision, Edit, MsgpackEdit,
    SnowflakeLayout,
};

/// A host in one layout, as one gateway process is: the machine id it
/// hands the plugin, the bundled plugin compiled and checked once for the
/// whole run on an engine with a clock of its own, and the last id it gave.
struct Host {
    layout: SnowflakeLayout,
    machine: u32,
    plugin: OnceLock<Plugin>,
    last: Mutex<u64>,
}

/// trtllm-v1 with a small machine id, as the target always had.
static V1: Host = Host {
    layout: SnowflakeLayout::TrtllmV1,
    machine: 7,
    plugin: OnceLock::new(),
    last: Mutex::new(0),
};

/// trtllm-v2 with its largest machine id, so that a node or process bit
/// lost or moved on the way through the host shows in the ids.
static V2: Host = Host {
    layout: SnowflakeLayout::TrtllmV2,
    machine: 16383,
    plugin: OnceLock::new(),
    last: Mutex::new(0),
};

/// The host a body goes to (see the top of the file).
fn host_for(body: &[u8]) -> &'static Host {
    match layout_for(body) {
        SnowflakeLayout::TrtllmV1 => &V1,
        SnowflakeLayout::TrtllmV2 => &V2,
    }
}

impl Host {
    fn plugin(&self) -> &Plugin {
        self.plugin.get_or_init(|| {
            let identity = MachineIdentity::fixed(self.layout, self.machine).expect("in range");
            let services = HostServices {
                clock: Arc::new(IdClock::system()),
                identity: Arc::new(identity),
            };
            let engine =
                PluginEngine::new(services, PluginLimits::default()).expect("creating the engine");
            Plugin::load(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[])
                .expect("loading the bundled plugin")
        })
    }
}

/// Reads back the ids the plugin wrote into `output` at `edits`.
fn read_back_ids(output: &[u8], edits: &[Edit]) -> Vec<u64> {
    let mut ids = Vec::with_capacity(edits.len());
    let (mut i, mut o) = (0usize, 0usize);
    for edit in edits {
        let at = edit.at();
        o += at - i;
        match *edit {
            Edit::InsertMember { comma, .. } => {
                let member = if comma {
                    &b",\"disagg_request_id\":"[..]
                } else {
                    &b"\"disagg_request_id\":"[..]
                };
                assert_eq!(
                    output.get(o..o + member.len()),
                    Some(member),
                    "member at {edit:?}"
                );
                o += member.len();
                i = at;
            }
            Edit::ReplaceNull { at } => i = at + 4,
        }
        let digits = output[o..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count();
        let text = std::str::from_utf8(&output[o..o + digits]).expect("digits");
        ids.push(
            text.parse()
                .unwrap_or_else(|e| panic!("id {text:?} at {edit:?}: {e}")),
        );
        o += digits;
    }
    ids
}

/// A current-thread runtime for the async path, made once.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
    })
}

/// One call on the fresh-instance path or on the reused-instance path.
fn call_once(plugin: &Plugin, request: &Request, reused: bool) -> Result<Action, CallError> {
    if reused {
        runtime().block_on(plugin.handle_async(request))
    } else {
        plugin.handle(request)
    }
}

fn call(plugin: &Plugin, request: &Request, reused: bool) -> Result<Action, CallError> {
    match call_once(plugin, request, reused) {
        // The deadline is wall time: a loaded machine can starve one call.
        // A body that really takes that long fails the retry too.
        Err(CallError::Deadline(limit)) => {
            let started = Instant::now();
            let again = call_once(plugin, request, reused);
            eprintln!(
                "deadline of {limit:?} hit once; the retry took {:?}",
                started.elapsed()
            );
            again
        }
        other => other,
    }
}

/// Whether the body goes as MessagePack: it starts with a map or array
/// marker.
fn is_msgpack(data: &[u8]) -> bool {
    matches!(data.first(), Some(0x80..=0x9f | 0xdc..=0xdf))
}

fuzz_target!(|data: &[u8]| {
    let host = host_for(data);
    let msgpack = is_msgpack(data);
    let mut headers = vec![("content-type".into(), b"application/json".to_vec())];
    if msgpack {
        headers.push(("x-trtllm-msgpack".into(), b"1".to_vec()));
    }
    let request = Request {
        method: "POST".into(),
        path: "/v1/completions".into(),
        headers: headers.into(),
        body: data.to_vec(),
    };
    for reused in [false, true] {
        let action = call(host.plugin(), &request, reused).unwrap_or_else(|e| {
            panic!(
                "the call failed ({}, reused instance: {reused}): {e}",
                host.layout
            )
        });
        let ids = check(host, data, msgpack, action);
        check_after_all_before(host, &ids, reused);
    }
});

/// The ids of one answer are each greater than every id the host has
/// given in the run: its clock gives each tick once per process, to any
/// instance.
fn check_after_all_before(host: &Host, ids: &[u64], reused: bool) {
    let mut last = host.last.lock().unwrap_or_else(|p| p.into_inner());
    for &id in ids {
        assert!(
            id > *last,
            "id {id} after {} ({}, reused instance: {reused}): repeated or gone back",
            *last,
            host.layout
        );
        *last = id;
    }
}

/// `action` is what the native core, in the host's layout, decides for
/// `data`, a MessagePack body if `msgpack`, else JSON; returns the ids the
/// plugin gave. The native ids (from `CounterIds`, machine id 7 in either
/// layout) are not compared: the host's are checked on their own.
fn check(host: &Host, data: &[u8], msgpack: bool, action: Action) -> Vec<u64> {
    let layout = host.layout;
    let native = decide(
        &Config { layout },
        msgpack,
        data,
        &mut CounterIds::new(layout),
    )
    .expect("no native plugin failure");
    match (native, action) {
        (Decision::Forward, Action::Forward) => Vec::new(),
        (Decision::Reject(native), Action::Reject(r)) => {
            assert_eq!(
                (r.status, r.code.as_str(), r.message.as_str()),
                (native.status, native.code, native.message.as_str()),
                "the plugin's refusal differs from the native one"
            );
            Vec::new()
        }
        (Decision::ForwardWithBody { .. }, Action::ForwardWithBody(output)) => {
            let ids = if msgpack {
                let edits = find_msgpack_edits(data).expect("stamped bodies are valid");
                let ids = read_back_msgpack_ids(data, &output, &edits);
                assert_eq!(
                    output,
                    msgpack::apply(data, &edits, &ids),
                    "not the native edits"
                );
                assert_eq!(
                    find_msgpack_edits(&output),
                    Ok(vec![]),
                    "the stamped body needs ids still"
                );
                ids
            } else {
                let edits = find_edits(data).expect("stamped bodies are valid");
                let ids = read_back_ids(&output, &edits);
                assert_eq!(output, apply(data, &edits, &ids), "not the native edits");
                assert_only_ids_spliced_in(data, &output, &edits, &ids);
                assert_eq!(
                    find_edits(&output),
                    Ok(vec![]),
                    "the stamped body needs ids still"
                );
                ids
            };
            check_made_here(host, &ids);
            ids
        }
        (native, action) => panic!("native decision {native:?}, plugin answer {action:?}"),
    }
}

/// Reads back the ids the plugin wrote into `output` at `edits`: each is a
/// `uint 64` whose eight bytes are where the native splice of an id of all
/// ones differs from that of an id of zero.
fn read_back_msgpack_ids(data: &[u8], output: &[u8], edits: &[MsgpackEdit]) -> Vec<u64> {
    let zeros = vec![0; edits.len()];
    let blank = msgpack::apply(data, edits, &zeros);
    assert_eq!(output.len(), blank.len(), "not the native edits' length");
    (0..edits.len())
        .map(|edit| {
            let mut marked = zeros.clone();
            marked[edit] = u64::MAX;
            let at = msgpack::apply(data, edits, &marked)
                .iter()
                .zip(&blank)
                .position(|(a, b)| a != b)
                .expect("an id of all ones differs from one of zero");
            let bytes = output[at..at + 8].try_into().expect("eight bytes");
            u64::from_be_bytes(bytes)
        })
        .collect()
}

/// The ids are increasing, of the host's layout and machine id, and near
/// now.
fn check_made_here(host: &Host, ids: &[u64]) {
    let layout = host.layout;
    assert!(
        ids.windows(2).all(|w| w[0] < w[1]),
        "{layout} ids not increasing: {ids:?}"
    );
    for id in ids {
        let parts = layout
            .decode(*id)
            .unwrap_or_else(|e| panic!("id {id}: {e}"));
        assert_eq!(parts.machine_id, host.machine, "{layout} id {id}");
        // Made from the host's clock: near now. A trtllm-v2 id keeps only
        // the low 39 bits of its millisecond (`SnowflakeLayout::stamp`),
        // so the distance is taken in those bits; in trtllm-v1 `stamp`
        // keeps them all.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_millis() as u64;
        let behind = layout.stamp(now.wrapping_sub(parts.millis));
        let ahead = layout.stamp(parts.millis.wrapping_sub(now));
        assert!(
            ahead <= 60_000 || behind <= 3_600_000,
            "{layout} id {id} has time {} ms, now is {now} (stamped {})",
            parts.millis,
            layout.stamp(now)
        );
    }
}
