//! Limits of one call: a plugin that needs more memory than allowed, or runs
//! past its deadline, gives the caller an error value; the host does not
//! crash, and the same plugin serves the next request.

mod common;
#[path = "../plugin/tests/support/hostile_bodies.rs"]
mod hostile_bodies;

use std::time::Duration;

use common::{engine_with, load_bundled, START_MILLIS};
use snowgate_host::{Action, CallError, FixedClock, Plugin, PluginLimits};
use snowgate_plugin::SnowflakeLayout;
use snowgate_plugin_bundle::{memory_needed, IdDensity};

/// A body of about `size` bytes that needs an id (the bulk is one long
/// prompt string, which the plugin must still read to its end).
fn big_body(size: usize) -> Vec<u8> {
    let mut body = br#"{"prompt":""#.to_vec();
    body.resize(size, b'a');
    body.extend_from_slice(br#"","disaggregated_params":{"request_type":"context_only"}}"#);
    body
}

fn plugin_with_limits(limits: PluginLimits) -> Plugin {
    load_bundled(&engine_with(
        SnowflakeLayout::TrtllmV1,
        7,
        FixedClock(START_MILLIS),
        limits,
    ))
}

/// The next small request on the same plugin is stamped with an id of this
/// machine.
fn assert_next_small_request_works(plugin: &Plugin) {
    let out = common::stamp(plugin, common::CONTEXT_ONLY);
    let ids = common::ids_in(&out);
    assert_eq!(ids.len(), 1, "{}", String::from_utf8_lossy(&out));
    let parts = SnowflakeLayout::TrtllmV1.decode(ids[0]).expect("decodes");
    assert_eq!(parts.machine_id, 7);
    assert!(parts.millis >= START_MILLIS);
}

#[test]
fn a_body_larger_than_the_memory_limit_is_a_memory_limit_error_not_a_crash() {
    let limits = PluginLimits {
        memory_bytes: 8 << 20,
        ..PluginLimits::default()
    };
    let plugin = plugin_with_limits(limits);

    let answer = plugin.handle(&common::json_request(big_body(16 << 20)));
    assert_eq!(
        answer.as_ref().map(|_| "an answer"),
        Err(&CallError::MemoryLimit(8 << 20)),
        "{}",
        common::describe(&answer)
    );
    let message = answer.unwrap_err().to_string();
    assert!(message.contains("8 MiB memory limit"), "{message}");

    assert_next_small_request_works(&plugin);
}

/// The densest JSON body of about `size` bytes, and its number of ids: a
/// batch of context-only params maps without ids, each needing one.
fn densest_json(size: usize) -> (Vec<u8>, usize) {
    let count = size / (common::CONTEXT_ONLY.len() + 1);
    let body = format!("[{}]", vec![common::CONTEXT_ONLY; count].join(","));
    (body.into_bytes(), count)
}

/// The densest MessagePack body of about `size` bytes, and its number of
/// ids: an array 32 of `{"disaggregated_params": {"request_type":
/// "context_only"}}` maps.
fn densest_msgpack(size: usize) -> (Vec<u8>, usize) {
    let element = hostile_bodies::context_only_params();
    let count = size / element.len();
    let mut body = vec![0xdd];
    body.extend_from_slice(&(count as u32).to_be_bytes());
    for _ in 0..count {
        body.extend_from_slice(&element);
    }
    (body, count)
}

/// Runs `body` (MessagePack when `msgpack`) through a plugin with
/// `memory_bytes` of memory: the ids in the answer, or the call's error.
fn stamp_in(memory_bytes: u64, body: Vec<u8>, msgpack: bool) -> Result<usize, CallError> {
    let plugin = plugin_with_limits(PluginLimits {
        memory_bytes: memory_bytes as usize,
        max_output_body_bytes: 2 * body.len(),
        // The debug host lifts a large answer slowly: time is not tested.
        deadline: Duration::from_secs(120),
        ..PluginLimits::default()
    });
    let mut request = common::json_request(body);
    if msgpack {
        request = common::with_header(request, "x-trtllm-msgpack", b"1");
    }
    match plugin.handle(&request) {
        // Counted where they are written: ids nested under any key too.
        Ok(Action::ForwardWithBody(out)) => {
            if !msgpack {
                serde_json::from_slice::<serde_json::Value>(&out).expect("the answer is JSON");
            }
            Ok(out
                .windows(17)
                .filter(|w| *w == b"disagg_request_id")
                .count())
        }
        Ok(other) => panic!("expected a stamped body, got {other:?}"),
        Err(e) => Err(e),
    }
}

/// The memory the bundled plugin says it needs (what the gateway's
/// start-up warning and `rewrite`'s advice go by) stamps each kind of body
/// in full: one with one id, the densest JSON and MessagePack, MessagePack
/// whose keys are long arrays (which took more before the walk bounded
/// what it keeps of them), objects of long keys in both (whose edits
/// are held by key in a hash map, which grows by doubling), and objects
/// of the most short keys over ids in both, the most memory any body
/// takes. And the figure for the densest is close: at 85 % of it the
/// keyed MessagePack does not fit, so the warning does not cry wolf by
/// much.
#[test]
fn the_bundled_plugins_memory_figures_stamp_the_bodies_they_describe() {
    let size = 8 << 20;
    let few = memory_needed(size as u64, IdDensity::Few);
    let densest = memory_needed(size as u64, IdDensity::Densest);
    assert_eq!(stamp_in(few, big_body(size), false), Ok(1));
    let (json, json_ids) = densest_json(size);
    assert_eq!(stamp_in(densest, json, false), Ok(json_ids));
    let (msgpack, msgpack_ids) = densest_msgpack(size);
    assert_eq!(stamp_in(densest, msgpack.clone(), true), Ok(msgpack_ids));
    let (tuple_keyed, tuple_keyed_ids) = hostile_bodies::tuple_keyed_within(size);
    assert_eq!(stamp_in(densest, tuple_keyed, true), Ok(tuple_keyed_ids));
    let (string_keyed, string_keyed_ids) = hostile_bodies::string_keyed_within(size);
    assert_eq!(stamp_in(densest, string_keyed, true), Ok(string_keyed_ids));
    let (json_keyed, json_keyed_ids) = hostile_bodies::json_string_keyed_within(size);
    assert_eq!(stamp_in(densest, json_keyed, false), Ok(json_keyed_ids));
    let (short_keyed, short_keyed_ids) = hostile_bodies::json_short_keyed_within(size);
    assert_eq!(stamp_in(densest, short_keyed, false), Ok(short_keyed_ids));
    let (int_keyed, int_keyed_ids) = hostile_bodies::uint32_keyed_within(size);
    assert_eq!(
        stamp_in(densest, int_keyed.clone(), true),
        Ok(int_keyed_ids)
    );
    let tight = densest * 85 / 100;
    assert_eq!(
        stamp_in(tight, int_keyed, true),
        Err(CallError::MemoryLimit(tight as usize))
    );
}

#[test]
fn a_call_past_its_deadline_is_a_deadline_error_not_a_crash() {
    // 250 ms: the load-time check (one instantiation and three tiny
    // calls, a few ms each in a debug build) runs under the same deadline
    // and must pass on a busy machine, while stamping a batch of 1,200,000
    // params (69 MB) takes far longer, in a release build too (some 0.8 s).
    let deadline = Duration::from_millis(250);
    let plugin = plugin_with_limits(PluginLimits {
        deadline,
        memory_bytes: 1 << 30,
        max_output_body_bytes: 256 << 20,
        ..PluginLimits::default()
    });

    let params = r#"{"disaggregated_params":{"request_type":"context_only"}}"#;
    let batch = format!("[{}]", vec![params; 1_200_000].join(","));
    let answer = plugin.handle(&common::json_request(batch));
    assert_eq!(
        answer.as_ref().map(|_| "an answer"),
        Err(&CallError::Deadline(deadline)),
        "{}",
        common::describe(&answer)
    );
    let message = answer.unwrap_err().to_string();
    assert!(message.contains("250 ms deadline"), "{message}");

    assert_next_small_request_works(&plugin);
}
