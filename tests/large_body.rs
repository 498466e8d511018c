//! A long prompt given as token ids: a ~24 MiB body is stamped within the
//! default limits, and nothing but the id is added.
//!
//! In its own test binary so that no other test competes for the CPU while
//! the call runs under the default 1 s deadline. In a debug build the
//! deadline is 5 s: a debug build of the host copies the body in and out
//! slowly (about 0.5 s for 21 MiB here, `target/debug/snowgate rewrite`),
//! close enough to the second for a busy CI machine to pass it.

mod common;

use std::time::Duration;

use common::{engine_with, load_bundled, START_MILLIS};
use snowgate_host::{Action, FixedClock, PluginLimits};
use snowgate_plugin::SnowflakeLayout;

/// `{"model":..,"prompt_token_ids":[...],"disaggregated_params":{..}}` of at
/// least `size` bytes, the params last so the whole body is read first.
pub fn token_ids_body(size: usize) -> Vec<u8> {
    let mut body = br#"{"model":"m","max_tokens":1,"prompt_token_ids":["#.to_vec();
    let mut token = 0u32;
    while body.len() < size {
        body.extend_from_slice((token % 151_936).to_string().as_bytes());
        body.push(b',');
        token = token.wrapping_mul(2_654_435_761).wrapping_add(12_345);
    }
    body.extend_from_slice(br#"0],"disaggregated_params":{"request_type":"context_only"}}"#);
    body
}

#[test]
fn a_24_mib_prompt_token_ids_body_is_stamped_within_the_default_memory_limits() {
    let defaults = PluginLimits::default();
    let limits = PluginLimits {
        deadline: if cfg!(debug_assertions) {
            Duration::from_secs(5)
        } else {
            defaults.deadline
        },
        ..defaults
    };
    let plugin = load_bundled(&engine_with(
        SnowflakeLayout::TrtllmV1,
        7,
        FixedClock(START_MILLIS),
        limits,
    ));
    let body = token_ids_body(24 << 20);

    let answer = plugin.handle(&common::json_request(body.as_slice()));
    let Ok(Action::ForwardWithBody(out)) = answer else {
        panic!("expected a stamped body, got {}", common::describe(&answer));
    };

    // The first id of machine 7 at 2025-11-24T16:00:00Z, sequence 0.
    let mut expected = body[..body.len() - 2].to_vec();
    expected.extend_from_slice(br#","disagg_request_id":7398756654046539776}}"#);
    assert_eq!(out.len(), expected.len());
    // Compared without printing 24 MiB on failure.
    if let Some(at) = out.iter().zip(&expected).position(|(a, b)| a != b) {
        panic!(
            "the stamped body differs from the expected one at byte {at}: {:?} vs {:?}",
            String::from_utf8_lossy(&out[at..(at + 80).min(out.len())]),
            String::from_utf8_lossy(&expected[at..(at + 80).min(expected.len())])
        );
    }
}
