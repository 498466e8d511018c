//! Limits of one call: a plugin that needs more memory than allowed, or runs
//! past its deadline, gives the caller an error value; the host does not
//! crash, and the same plugin serves the next request.

mod common;

use std::time::Duration;

use common::{engine_with, load_bundled, START_MILLIS};
use snowgate_host::{CallError, FixedClock, Plugin, PluginLimits};
use snowgate_plugin::SnowflakeLayout;

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

#[test]
fn a_call_past_its_deadline_is_a_deadline_error_not_a_crash() {
    // 10 ms: the load-time check (one instantiation and three tiny calls)
    // runs under the same deadline and must pass reliably even in a debug
    // build on a busy machine, while reading and copying 30 MiB takes far
    // longer (hundreds of ms in a debug build, tens in a release build).
    let deadline = Duration::from_millis(10);
    let plugin = plugin_with_limits(PluginLimits {
        deadline,
        ..PluginLimits::default()
    });

    let answer = plugin.handle(&common::json_request(big_body(30 << 20)));
    assert_eq!(
        answer.as_ref().map(|_| "an answer"),
        Err(&CallError::Deadline(deadline)),
        "{}",
        common::describe(&answer)
    );
    let message = answer.unwrap_err().to_string();
    assert!(message.contains("10 ms deadline"), "{message}");

    assert_next_small_request_works(&plugin);
}
