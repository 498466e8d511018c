//! TensorRT-LLM's own test vectors, made end to end: the real plugin in the
//! real host, with the host's clock and identity set to each vector's inputs.
//!
//! One engine per layout serves every vector of that layout (a plugin load
//! compiles the component, which is slow in a debug build): its wall clock
//! is a hand clock set to each vector's timestamp, its machine id is
//! reassigned for each vector, and the vectors run in timestamp order,
//! because the host's id clock never goes backwards.

mod common;

use common::{clock_of, identity_of, plugin_with, HandClock};
use serde_json::Value;
use snowgate_host::{Plugin, Tick};
use snowgate_plugin::SnowflakeLayout;

/// One test vector: inputs and the id TensorRT-LLM makes from them.
#[derive(Debug, Clone, Copy)]
struct Vector {
    timestamp_ms: u64,
    machine_id: u32,
    counter: u32,
    id: u64,
}

fn field(case: &Value, name: &str) -> u64 {
    case[name]
        .as_u64()
        .unwrap_or_else(|| panic!("vector field {name} in {case}"))
}

/// The vectors of one layout (`v1` or `v2`; a v2 machine id is
/// `node_id * 64 + process_id`), sorted by timestamp.
fn vectors(key: &str) -> Vec<Vector> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../plugin/vectors/trtllm-snowflake.json"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    let all: Value = serde_json::from_str(&text).expect("the vectors are JSON");
    let mut vectors: Vec<Vector> = all[key]
        .as_array()
        .unwrap_or_else(|| panic!("no {key} vectors in {path}"))
        .iter()
        .map(|case| Vector {
            timestamp_ms: field(case, "timestamp_ms"),
            machine_id: match key {
                "v1" => field(case, "machine_id"),
                _ => field(case, "node_id") * 64 + field(case, "process_id"),
            } as u32,
            counter: field(case, "counter") as u32,
            id: field(case, "id"),
        })
        .collect();
    assert!(vectors.len() >= 40, "only {} {key} vectors", vectors.len());
    vectors.sort_by_key(|v| (v.timestamp_ms, v.counter));
    vectors
}

/// Moves the id clock so that its next tick is `(timestamp_ms, counter)`:
/// the wall clock reads the vector's timestamp, and the sequences before the
/// vector's counter are used up.
fn position_clock(plugin: &Plugin, wall: &HandClock, vector: &Vector, space: u32) {
    let clock = clock_of(plugin);
    let target = Tick {
        millis: vector.timestamp_ms,
        sequence: vector.counter,
    };
    if let Some(last) = clock.last_tick() {
        assert!(
            last < target,
            "vectors out of order: clock at {last:?}, vector {vector:?}"
        );
    }
    wall.set(vector.timestamp_ms);
    for _ in 0..vector.counter {
        clock.next_tick(space).expect("a tick");
    }
    // The loop above started the vector's millisecond at sequence 0, since
    // every earlier tick was in an earlier millisecond.
    if vector.counter > 0 {
        assert_eq!(
            clock.last_tick(),
            Some(Tick {
                millis: vector.timestamp_ms,
                sequence: vector.counter - 1
            })
        );
    }
}

fn check_every_vector(layout: SnowflakeLayout, key: &str) {
    let vectors = vectors(key);
    let wall = HandClock::at(0);
    let plugin = plugin_with(layout, vectors[0].machine_id, wall.clone());
    let space = layout.sequence_space();
    let mut folded = 0;
    for vector in &vectors {
        identity_of(&plugin)
            .assign(vector.machine_id)
            .unwrap_or_else(|e| panic!("vector {vector:?}: {e}"));
        position_clock(&plugin, &wall, vector, space);

        let body = r#"{"model":"m","prompt":"Hello","disaggregated_params":{"request_type":"context_only","schedule_style":0}}"#;
        // TensorRT-LLM's v2 makes this id again after its stamp wraps
        // (the vectors hold one such, 1 ms before the wrap): the plugin
        // makes none, and answers 503.
        let folds = layout
            .compose_unique(vector.timestamp_ms, vector.machine_id, vector.counter)
            .is_err();
        if folds {
            let rejection = common::reject(&plugin, &common::json_request(body));
            assert_eq!(rejection.status, 503, "vector {vector:?}");
            assert_eq!(rejection.code, "no_unique_id", "vector {vector:?}");
            // It is the vector's id that would be made again: TensorRT-LLM
            // makes it from these fields, as the plain layout does.
            assert_eq!(
                layout
                    .compose(vector.timestamp_ms, vector.machine_id, vector.counter)
                    .ok(),
                Some(vector.id),
                "vector {vector:?}"
            );
            folded += 1;
            continue;
        }
        let out = common::stamp(&plugin, body);

        // The plugin took exactly the tick the vector names.
        assert_eq!(
            clock_of(&plugin).last_tick(),
            Some(Tick {
                millis: vector.timestamp_ms,
                sequence: vector.counter
            }),
            "vector {vector:?}"
        );
        let expected = format!(
            r#"{{"model":"m","prompt":"Hello","disaggregated_params":{{"request_type":"context_only","schedule_style":0,"disagg_request_id":{}}}}}"#,
            vector.id
        );
        assert_eq!(
            String::from_utf8_lossy(&out),
            expected,
            "{key} vector {vector:?}"
        );
    }
    let expected_folds = match layout {
        SnowflakeLayout::TrtllmV1 => 0,
        SnowflakeLayout::TrtllmV2 => 1,
    };
    assert_eq!(folded, expected_folds, "{key} vectors the plugin refused");
}

#[test]
fn every_v1_vector_is_stamped_exactly_by_the_plugin_in_the_host() {
    check_every_vector(SnowflakeLayout::TrtllmV1, "v1");
}

/// v2 vectors carry the raw (unmasked) millisecond timestamp that
/// TensorRT-LLM masks to 39 bits; the host's clock reads it raw and the
/// plugin masks it, as TensorRT-LLM does, so the ids must match exactly;
/// but for the one vector in the 65.536 s before the stamp wraps, whose id
/// TensorRT-LLM makes twice, which the plugin refuses with 503.
#[test]
fn every_v2_vector_is_stamped_exactly_by_the_plugin_in_the_host() {
    check_every_vector(SnowflakeLayout::TrtllmV2, "v2");
}
