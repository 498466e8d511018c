//! Native tests of the plugin's pure core through its public API: which
//! `disaggregated_params` objects get an id, that nothing else in the body
//! changes, how bad input is refused, and how ids are made.

use std::collections::HashSet;
use std::time::Instant;

use proptest::prelude::*;
use serde_json::Value;
use snowgate_plugin::{
    decide, find_edits, is_msgpack, BodyError, Config, Decision, Edit, IdSource, MachineId,
    PluginFailure, Rejection, SnowflakeLayout, Tick, MAX_NESTING_DEPTH,
};

/// The fuzz oracle's reading of where ids belong and how the bytes may
/// change, shared with `fuzz_regressions.rs` and the fuzz targets.
#[path = "../../fuzz/src/oracle.rs"]
#[allow(dead_code)]
mod oracle;

/// The MessagePack fuzz oracle (which uses `oracle` above): where a
/// Python reader expects ids in a MessagePack body, and every check the
/// `stamp_msgpack` fuzz target runs.
#[path = "../../fuzz/src/mp_oracle.rs"]
#[allow(dead_code)]
mod mp_oracle;

/// 2025-11-24, in milliseconds since the Unix epoch.
const START_MILLIS: u64 = 1_764_000_000_000;
/// The machine id the fake source hands out (fits both layouts).
const MACHINE: u32 = 7;

// ---------------------------------------------------------------------------
// A deterministic id source
// ---------------------------------------------------------------------------

/// A counter clock with the real clock's semantics: every tick is strictly
/// greater than the last as `(millis, sequence)`, and the sequence rolls over
/// to the next millisecond once the layout's sequence space is used up.
struct FakeIds {
    machine: Result<MachineId, String>,
    millis: u64,
    sequence: u32,
    machine_calls: usize,
    ticks: Vec<Tick>,
}

impl FakeIds {
    fn new(layout: SnowflakeLayout) -> Self {
        Self::with_machine(Ok(MachineId {
            value: MACHINE,
            layout,
        }))
    }

    fn with_machine(machine: Result<MachineId, String>) -> Self {
        FakeIds {
            machine,
            millis: START_MILLIS,
            sequence: 0,
            machine_calls: 0,
            ticks: Vec::new(),
        }
    }

    fn failing(reason: &str) -> Self {
        Self::with_machine(Err(reason.to_string()))
    }
}

impl IdSource for FakeIds {
    fn machine_id(&mut self) -> Result<MachineId, String> {
        self.machine_calls += 1;
        self.machine.clone()
    }

    fn next_tick(&mut self, sequence_space: u32) -> Tick {
        if self.sequence >= sequence_space {
            self.millis += 1;
            self.sequence = 0;
        }
        let tick = Tick {
            millis: self.millis,
            sequence: self.sequence,
        };
        self.sequence += 1;
        if let Some(last) = self.ticks.last() {
            assert!(*last < tick, "the fake clock went backwards");
        }
        self.ticks.push(tick);
        tick
    }
}

/// A source that hands out one fixed tick, whatever the layout.
struct FixedTick(Tick);

impl IdSource for FixedTick {
    fn machine_id(&mut self) -> Result<MachineId, String> {
        Ok(MachineId {
            value: MACHINE,
            layout: SnowflakeLayout::TrtllmV1,
        })
    }

    fn next_tick(&mut self, _sequence_space: u32) -> Tick {
        self.0
    }
}

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

fn v1() -> Config {
    Config {
        layout: SnowflakeLayout::TrtllmV1,
    }
}

/// Stamps `body` with the v1 layout and returns the new body and the ids.
fn stamp(body: impl AsRef<[u8]>) -> (String, Vec<u64>) {
    let body = body.as_ref();
    let mut ids = FakeIds::new(SnowflakeLayout::TrtllmV1);
    match decide(&v1(), false, body, &mut ids).expect("no plugin failure") {
        Decision::ForwardWithBody { body: out, ids } => (
            String::from_utf8(out).expect("a stamped body stays UTF-8"),
            ids,
        ),
        other => panic!(
            "expected a stamp for {:?}, got {other:?}",
            String::from_utf8_lossy(body)
        ),
    }
}

/// Asserts that `body` is forwarded unchanged, without asking for a machine id.
fn assert_forwarded(body: impl AsRef<[u8]>) {
    let body = body.as_ref();
    let mut ids = FakeIds::new(SnowflakeLayout::TrtllmV1);
    let decision = decide(&v1(), false, body, &mut ids).expect("no plugin failure");
    assert_eq!(
        decision,
        Decision::Forward,
        "body {:?}",
        String::from_utf8_lossy(body)
    );
    assert_eq!(ids.machine_calls, 0, "asked for a machine id needlessly");
    assert!(ids.ticks.is_empty(), "took ticks needlessly");
    assert_eq!(find_edits(body), Ok(vec![]));
}

/// Asserts that `body` is rejected and returns the rejection.
fn rejection(body: impl AsRef<[u8]>) -> Rejection {
    let body = body.as_ref();
    let mut ids = FakeIds::new(SnowflakeLayout::TrtllmV1);
    match decide(&v1(), false, body, &mut ids).expect("no plugin failure") {
        Decision::Reject(r) => {
            assert_eq!(ids.machine_calls, 0, "a bad body needs no machine id");
            r
        }
        other => panic!(
            "expected a rejection of {:?}, got {other:?}",
            String::from_utf8_lossy(body)
        ),
    }
}

/// `template` with each `<ID>` replaced by the next of `ids`.
fn fill(template: &str, ids: &[u64]) -> String {
    let parts: Vec<&str> = template.split("<ID>").collect();
    assert_eq!(parts.len(), ids.len() + 1, "one <ID> per id in {template}");
    let mut out = parts[0].to_string();
    for (id, part) in ids.iter().zip(&parts[1..]) {
        out.push_str(&id.to_string());
        out.push_str(part);
    }
    out
}

/// Stamps `input` and checks that the result is exactly `template` with the
/// ids filled in; returns the ids.
fn assert_stamped(input: &str, template: &str) -> Vec<u64> {
    let (out, ids) = stamp(input);
    assert_eq!(out, fill(template, &ids), "input {input}");
    ids
}

fn parse(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// The params (v1, the fake's first tick) the first stamped id has.
fn first_v1_id() -> u64 {
    SnowflakeLayout::TrtllmV1
        .compose(START_MILLIS, MACHINE, 0)
        .unwrap()
}

// ---------------------------------------------------------------------------
// Which params get an id
// ---------------------------------------------------------------------------

#[test]
fn stamps_a_top_level_request() {
    let ids = assert_stamped(
        r#"{"model":"m","prompt":"Hello","max_tokens":16,"stream":false,"disaggregated_params":{"request_type":"context_only","schedule_style":0}}"#,
        r#"{"model":"m","prompt":"Hello","max_tokens":16,"stream":false,"disaggregated_params":{"request_type":"context_only","schedule_style":0,"disagg_request_id":<ID>}}"#,
    );
    assert_eq!(ids, [first_v1_id()]);
}

#[test]
fn stamps_every_request_of_a_batch() {
    let ids = assert_stamped(
        r#"[{"disaggregated_params":{"request_type":"context_only"}},{"prompt":"x"},{"disaggregated_params":{"request_type":"generation_only"}},{"disaggregated_params":{"request_type":"context_only","disagg_request_id":null}},{"disaggregated_params":{"request_type":"context_only"}}]"#,
        r#"[{"disaggregated_params":{"request_type":"context_only","disagg_request_id":<ID>}},{"prompt":"x"},{"disaggregated_params":{"request_type":"generation_only"}},{"disaggregated_params":{"request_type":"context_only","disagg_request_id":<ID>}},{"disaggregated_params":{"request_type":"context_only","disagg_request_id":<ID>}}]"#,
    );
    assert_eq!(ids.len(), 3);
}

#[test]
fn stamps_params_nested_deeper() {
    assert_stamped(
        r#"{"payload":{"batch":[[{"x":{"disaggregated_params":{"request_type":"context_only"}}}]]},"y":[{"disaggregated_params":{"request_type":"context_only"}}]}"#,
        r#"{"payload":{"batch":[[{"x":{"disaggregated_params":{"request_type":"context_only","disagg_request_id":<ID>}}}]]},"y":[{"disaggregated_params":{"request_type":"context_only","disagg_request_id":<ID>}}]}"#,
    );
}

#[test]
fn stamps_params_nested_inside_params_in_body_order() {
    // The inner object's insertion point comes first in the body, so it
    // gets the first id.
    let ids = assert_stamped(
        r#"{"disaggregated_params":{"request_type":"context_only","extra":{"disaggregated_params":{"request_type":"context_only"}}}}"#,
        r#"{"disaggregated_params":{"request_type":"context_only","extra":{"disaggregated_params":{"request_type":"context_only","disagg_request_id":<ID>}},"disagg_request_id":<ID>}}"#,
    );
    assert!(ids[0] < ids[1]);
}

#[test]
fn leaves_a_params_like_object_under_another_key_alone() {
    assert_forwarded(r#"{"request_type":"context_only"}"#);
    assert_forwarded(r#"[{"request_type":"context_only"}]"#);
    assert_forwarded(r#"{"params":{"request_type":"context_only"}}"#);
    assert_forwarded(r#"{"Disaggregated_params":{"request_type":"context_only"}}"#);
    assert_forwarded(r#"{"disaggregated_params ":{"request_type":"context_only"}}"#);
    assert_forwarded(r#"{"disaggregated_params":{"Request_type":"context_only"}}"#);
}

#[test]
fn matches_context_only_ignoring_ascii_case() {
    for request_type in [
        "context_only",
        "CONTEXT_ONLY",
        "Context_Only",
        "cOnTeXt_OnLy",
    ] {
        let input = format!(r#"{{"disaggregated_params":{{"request_type":"{request_type}"}}}}"#);
        let template = format!(
            r#"{{"disaggregated_params":{{"request_type":"{request_type}","disagg_request_id":<ID>}}}}"#
        );
        assert_stamped(&input, &template);
    }
}

#[test]
fn does_not_stamp_other_request_types() {
    for request_type in [
        r#""generation_only""#,
        r#""GENERATION_ONLY""#,
        r#""context_and_generation""#,
        r#""context_only ""#,
        r#"" context_only""#,
        r#""context-only""#,
        r#""contextonly""#,
        r#""context_onlyy""#,
        r#""context_onl""#,
        // A non-ASCII look-alike (fullwidth c) and a trailing NUL.
        r#""ｃontext_only""#,
        r#""context_only\u0000""#,
        r#""""#,
        "null",
        "0",
        "true",
        r#"["context_only"]"#,
        r#"{"request_type":"context_only"}"#,
    ] {
        for id in ["", r#","disagg_request_id":null"#] {
            assert_forwarded(format!(
                r#"{{"disaggregated_params":{{"request_type":{request_type}{id}}}}}"#
            ));
        }
    }
}

#[test]
fn does_not_stamp_params_without_a_request_type() {
    assert_forwarded(r#"{"disaggregated_params":{}}"#);
    assert_forwarded(r#"{"disaggregated_params":{"disagg_request_id":null}}"#);
    assert_forwarded(r#"{"disaggregated_params":{"schedule_style":0,"ctx_request_id":3}}"#);
}

#[test]
fn never_stamps_generation_only_or_context_and_generation() {
    for request_type in ["generation_only", "context_and_generation"] {
        assert_forwarded(format!(
            r#"{{"disaggregated_params":{{"request_type":"{request_type}"}}}}"#
        ));
        assert_forwarded(format!(
            r#"{{"disaggregated_params":{{"request_type":"{request_type}","disagg_request_id":null}}}}"#
        ));
        assert_forwarded(format!(
            r#"{{"disaggregated_params":{{"request_type":"{request_type}","disagg_request_id":1099511628800}}}}"#
        ));
    }
}

#[test]
fn keeps_an_existing_id() {
    for id in [
        "0",
        "-1",
        "1.5",
        "1099511628800",
        "123456789012345678901234567890",
        "1E400",
        "-0.0",
        r#""abc""#,
        r#""""#,
        r#""null""#,
        "false",
        "true",
        "{}",
        "[]",
        "[null]",
        r#"{"x":null}"#,
    ] {
        assert_forwarded(format!(
            r#"{{"disaggregated_params":{{"request_type":"context_only","disagg_request_id":{id}}}}}"#
        ));
        assert_forwarded(format!(
            r#"{{"disaggregated_params":{{"disagg_request_id":{id},"request_type":"context_only"}}}}"#
        ));
    }
}

#[test]
fn replaces_a_null_id_in_place() {
    assert_stamped(
        r#"{"disaggregated_params":{"disagg_request_id":null,"request_type":"context_only","schedule_style":1}}"#,
        r#"{"disaggregated_params":{"disagg_request_id":<ID>,"request_type":"context_only","schedule_style":1}}"#,
    );
    assert_stamped(
        "{\"disaggregated_params\" :\n\t{ \"request_type\" : \"context_only\" , \"disagg_request_id\" :\r\n null }\n}",
        "{\"disaggregated_params\" :\n\t{ \"request_type\" : \"context_only\" , \"disagg_request_id\" :\r\n <ID> }\n}",
    );
}

#[test]
fn leaves_non_object_params_alone() {
    for params in [
        "null",
        "0",
        "true",
        r#""context_only""#,
        r#""{\"request_type\":\"context_only\"}""#,
        "[]",
        r#"[{"request_type":"context_only"}]"#,
        r#"[[{"request_type":"context_only"}]]"#,
    ] {
        assert_forwarded(format!(r#"{{"disaggregated_params":{params}}}"#));
    }
}

#[test]
fn stamps_params_inside_a_non_object_params_value_only_under_their_own_key() {
    // The array is not itself params, but an object inside it may hold
    // params of its own.
    assert_stamped(
        r#"{"disaggregated_params":[{"disaggregated_params":{"request_type":"context_only"}}]}"#,
        r#"{"disaggregated_params":[{"disaggregated_params":{"request_type":"context_only","disagg_request_id":<ID>}}]}"#,
    );
}

#[test]
fn never_touches_text_inside_strings() {
    assert_forwarded(
        r#"{"prompt":"{\"disaggregated_params\":{\"request_type\":\"context_only\"}}","x":"disaggregated_params"}"#,
    );
    assert_forwarded(r#"["disaggregated_params",{"request_type":"context_only"}]"#);
    assert_stamped(
        r#"{"prompt":"{\"disaggregated_params\":{\"request_type\":\"context_only\"}}","disaggregated_params":{"request_type":"context_only","note":"{\"disagg_request_id\":null}"}}"#,
        r#"{"prompt":"{\"disaggregated_params\":{\"request_type\":\"context_only\"}}","disaggregated_params":{"request_type":"context_only","note":"{\"disagg_request_id\":null}","disagg_request_id":<ID>}}"#,
    );
    // Braces, quotes and backslashes in a string do not confuse the walk.
    assert_stamped(
        r#"{"disaggregated_params":{"request_type":"context_only","s":"}\\\"{[,:]"}}"#,
        r#"{"disaggregated_params":{"request_type":"context_only","s":"}\\\"{[,:]","disagg_request_id":<ID>}}"#,
    );
}

// ---------------------------------------------------------------------------
// JSON semantics: escapes and duplicate keys
// ---------------------------------------------------------------------------

#[test]
fn matches_keys_and_values_after_unescaping() {
    assert_stamped(
        r#"{"disaggregated\u005fparams":{"request\u005ftype":"context\u005fonly"}}"#,
        r#"{"disaggregated\u005fparams":{"request\u005ftype":"context\u005fonly","disagg_request_id":<ID>}}"#,
    );
    assert_stamped(
        r#"{"\u0064isaggregated_params":{"request_type":"\u0043ONTEXT_ONLY"}}"#,
        r#"{"\u0064isaggregated_params":{"request_type":"\u0043ONTEXT_ONLY","disagg_request_id":<ID>}}"#,
    );
    // An escaped id key with null is replaced; with a value it is kept.
    assert_stamped(
        r#"{"disaggregated_params":{"request_type":"context_only","disagg\u005Frequest_id":null}}"#,
        r#"{"disaggregated_params":{"request_type":"context_only","disagg\u005Frequest_id":<ID>}}"#,
    );
    assert_forwarded(
        r#"{"disaggregated_params":{"request_type":"context_only","disagg_request_i\u0064":5}}"#,
    );
    // `\/` unescapes to `/`: not a match for `_`.
    assert_forwarded(r#"{"disaggregated\/params":{"request_type":"context_only"}}"#);
}

#[test]
fn stamps_the_last_of_duplicate_params() {
    assert_stamped(
        r#"{"disaggregated_params":{"request_type":"context_only"},"disaggregated_params":{"request_type":"context_only"}}"#,
        r#"{"disaggregated_params":{"request_type":"context_only"},"disaggregated_params":{"request_type":"context_only","disagg_request_id":<ID>}}"#,
    );
    // The duplicate matches only after unescaping.
    assert_stamped(
        r#"{"disaggregated_params":{"request_type":"context_only"},"disaggregated\u005fparams":{"request_type":"context_only"}}"#,
        r#"{"disaggregated_params":{"request_type":"context_only"},"disaggregated\u005fparams":{"request_type":"context_only","disagg_request_id":<ID>}}"#,
    );
    // A later non-object value overrides the params entirely.
    assert_forwarded(
        r#"{"disaggregated_params":{"request_type":"context_only"},"disaggregated_params":null}"#,
    );
    assert_forwarded(
        r#"{"disaggregated_params":{"request_type":"context_only"},"disaggregated_params":{"request_type":"generation_only"}}"#,
    );
    // A later object overrides an earlier non-object.
    assert_stamped(
        r#"{"disaggregated_params":7,"disaggregated_params":{"request_type":"context_only"}}"#,
        r#"{"disaggregated_params":7,"disaggregated_params":{"request_type":"context_only","disagg_request_id":<ID>}}"#,
    );
}

#[test]
fn replaces_the_last_of_duplicate_null_ids() {
    assert_stamped(
        r#"{"disaggregated_params":{"request_type":"context_only","disagg_request_id":null,"disagg_request_id":null}}"#,
        r#"{"disaggregated_params":{"request_type":"context_only","disagg_request_id":null,"disagg_request_id":<ID>}}"#,
    );
    assert_stamped(
        r#"{"disaggregated_params":{"disagg_request_id":5,"request_type":"context_only","disagg_request_id":null}}"#,
        r#"{"disaggregated_params":{"disagg_request_id":5,"request_type":"context_only","disagg_request_id":<ID>}}"#,
    );
}

#[test]
fn keeps_a_duplicate_id_whose_last_value_is_set() {
    assert_forwarded(
        r#"{"disaggregated_params":{"request_type":"context_only","disagg_request_id":null,"disagg_request_id":5}}"#,
    );
    assert_forwarded(
        r#"{"disaggregated_params":{"disagg_request_id":null,"request_type":"context_only","disagg\u005frequest_id":0}}"#,
    );
}

#[test]
fn follows_the_last_of_duplicate_request_types() {
    assert_forwarded(
        r#"{"disaggregated_params":{"request_type":"context_only","request_type":"generation_only"}}"#,
    );
    assert_forwarded(
        r#"{"disaggregated_params":{"request_type":"context_only","request_type":null}}"#,
    );
    assert_stamped(
        r#"{"disaggregated_params":{"request_type":"generation_only","request_type":"context_only"}}"#,
        r#"{"disaggregated_params":{"request_type":"generation_only","request_type":"context_only","disagg_request_id":<ID>}}"#,
    );
    assert_stamped(
        r#"{"disaggregated_params":{"request_type":"generation_only","request\u005ftype":"context_only"}}"#,
        r#"{"disaggregated_params":{"request_type":"generation_only","request\u005ftype":"context_only","disagg_request_id":<ID>}}"#,
    );
}

#[test]
fn never_stamps_inside_an_overridden_member() {
    let params = r#"{"disaggregated_params":{"request_type":"context_only"}}"#;
    assert_forwarded(format!(r#"{{"requests":[{params}],"requests":[]}}"#));
    assert_forwarded(format!(r#"{{"requests":[{params}],"request\u0073":[]}}"#));
    assert_forwarded(format!(r#"{{"a":{{"b":{params}}},"a":1}}"#));
    assert_forwarded(format!(
        r#"{{"disaggregated_params":{{"request_type":"context_only","x":{params},"x":0}},"disaggregated_params":0}}"#
    ));
    // Params inside the overriding member do get ids.
    assert_stamped(
        &format!(r#"{{"requests":[{params}],"requests":[{params},{params}]}}"#),
        r#"{"requests":[{"disaggregated_params":{"request_type":"context_only"}}],"requests":[{"disaggregated_params":{"request_type":"context_only","disagg_request_id":<ID>}},{"disaggregated_params":{"request_type":"context_only","disagg_request_id":<ID>}}]}"#,
    );
    // Three duplicates: only the last counts.
    assert_stamped(
        &format!(r#"{{"r":{params},"r":{params},"r":{params}}}"#),
        r#"{"r":{"disaggregated_params":{"request_type":"context_only"}},"r":{"disaggregated_params":{"request_type":"context_only"}},"r":{"disaggregated_params":{"request_type":"context_only","disagg_request_id":<ID>}}}"#,
    );
    // A duplicate in an inner object does not cancel a member of an outer.
    assert_stamped(
        &format!(r#"{{"r":{params},"s":{{"r":1}}}}"#),
        r#"{"r":{"disaggregated_params":{"request_type":"context_only","disagg_request_id":<ID>}},"s":{"r":1}}"#,
    );
}

#[test]
fn accepts_lone_surrogate_escapes_in_strings() {
    assert_stamped(
        r#"{"prompt":"\ud800 \udfff \ud800\u0041","\udc00":1,"disaggregated_params":{"request_type":"context_only","x":"\uDBFF"}}"#,
        r#"{"prompt":"\ud800 \udfff \ud800\u0041","\udc00":1,"disaggregated_params":{"request_type":"context_only","x":"\uDBFF","disagg_request_id":<ID>}}"#,
    );
    // A lone surrogate in the key makes it a different key.
    assert_forwarded(r#"{"disaggregated_params\ud800":{"request_type":"context_only"}}"#);
    assert_forwarded(r#"{"disaggregated_params":{"request_type":"context_only\udc00"}}"#);
    // Keys with lone surrogates compare as Python compares them: the same
    // escape in either case, or followed by a character written either
    // way, is the same key, so the later member overrides params under
    // the earlier one (the fuzz oracles cannot judge these: serde_json
    // refuses lone surrogates).
    for override_by in [r#""x\uD800":0"#, r#""x\ud800":0"#] {
        assert_forwarded(format!(
            r#"{{"x\ud800":{{"disaggregated_params":{{"request_type":"context_only"}}}},{override_by}}}"#
        ));
    }
    assert_forwarded(
        r#"{"k\ud800\u0041":{"disaggregated_params":{"request_type":"context_only"}},"k\ud800A":0}"#,
    );
    // A different lone surrogate is a different key.
    assert_stamped(
        r#"{"x\ud800":{"disaggregated_params":{"request_type":"context_only"}},"x\ud801":0}"#,
        r#"{"x\ud800":{"disaggregated_params":{"request_type":"context_only","disagg_request_id":<ID>}},"x\ud801":0}"#,
    );
}

// ---------------------------------------------------------------------------
// Byte preservation
// ---------------------------------------------------------------------------

#[test]
fn forwards_a_body_that_needs_no_change() {
    assert_forwarded(
        "\r\n\t{ \"model\" :\"caf\\u00e9\\/x\" ,\"n\":[123456789012345678901234567890,1E400,-0.0,1e-7],\r\n\"disaggregated_params\":{\"request_type\":\"generation_only\",\"disagg_request_id\":1099511628800}\t}\n ",
    );
}

#[test]
fn preserves_whitespace_escapes_and_number_text() {
    assert_stamped(
        "\r\n\t{ \"model\" :\"caf\\u00e9 \\/ \\ud83d\\ude00 \u{1F600} \\\" \\\\ \\b\\f\\n\\r\\t\" ,\r\n  \"n\" : [ 123456789012345678901234567890 , 1E400 , -0.0 , 1e-7 , 2.50E+10 ],\r\n\t\"disaggregated_params\" :\t{\r\n\t\t\"request_type\" : \"context_only\" ,\r\n\t\t\"schedule_style\" : 0 \r\n\t} \r\n}\r\n",
        "\r\n\t{ \"model\" :\"caf\\u00e9 \\/ \\ud83d\\ude00 \u{1F600} \\\" \\\\ \\b\\f\\n\\r\\t\" ,\r\n  \"n\" : [ 123456789012345678901234567890 , 1E400 , -0.0 , 1e-7 , 2.50E+10 ],\r\n\t\"disaggregated_params\" :\t{\r\n\t\t\"request_type\" : \"context_only\" ,\r\n\t\t\"schedule_style\" : 0,\"disagg_request_id\":<ID> \r\n\t} \r\n}\r\n",
    );
}

#[test]
fn inserts_right_after_the_last_member_value() {
    // After a string, a number, a literal, an array and an object, with the
    // whitespace before `}` kept after the new member.
    for last in [
        r#""x""#,
        "12",
        "1.5e3",
        "true",
        "false",
        "null",
        "[1, 2]",
        r#"{"a":{}}"#,
    ] {
        let input = format!(
            "{{\"disaggregated_params\":{{\"request_type\":\"context_only\",\"last\":{last}  \n}}}}"
        );
        let template = format!(
            "{{\"disaggregated_params\":{{\"request_type\":\"context_only\",\"last\":{last},\"disagg_request_id\":<ID>  \n}}}}"
        );
        assert_stamped(&input, &template);
    }
    // The request type as the only member.
    assert_stamped(
        "{\"disaggregated_params\":{ \"request_type\":\"context_only\"\t}}",
        "{\"disaggregated_params\":{ \"request_type\":\"context_only\",\"disagg_request_id\":<ID>\t}}",
    );
}

#[test]
fn find_edits_reports_positions_in_body_order() {
    let body = br#"[{"disaggregated_params":{"request_type":"context_only"}},{"disaggregated_params":{"disagg_request_id":null,"request_type":"context_only"}}]"#;
    let text = std::str::from_utf8(body).unwrap();
    let insert_at = text.find(r#""context_only"}"#).unwrap() + r#""context_only""#.len();
    let null_at = text.find("null").unwrap();
    assert_eq!(
        find_edits(body),
        Ok(vec![
            Edit::InsertMember {
                at: insert_at,
                comma: true
            },
            Edit::ReplaceNull { at: null_at },
        ])
    );
}

// ---------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------

/// `(what, body, code, words the message must contain)`.
const BAD_BODIES: &[(&str, &[u8], &str, &str)] = &[
    ("empty body", b"", "empty_body", "empty"),
    (
        "whitespace only",
        b" \t\r\n ",
        "empty_body",
        "only whitespace",
    ),
    (
        "truncated object",
        br#"{"a":1"#,
        "invalid_json",
        "ends inside an object",
    ),
    (
        "truncated after a comma",
        br#"{"a":1,"#,
        "invalid_json",
        "ends inside an object",
    ),
    (
        "truncated key",
        br#"{"a"#,
        "invalid_json",
        "ends inside a string",
    ),
    (
        "truncated string",
        br#"{"a":"xy"#,
        "invalid_json",
        "ends inside a string",
    ),
    (
        "truncated after colon",
        br#"{"a":"#,
        "invalid_json",
        "ends where a JSON value was expected",
    ),
    (
        "truncated array",
        b"[1,2",
        "invalid_json",
        "ends inside an array",
    ),
    (
        "truncated literal",
        b"[nul",
        "invalid_json",
        "expected a JSON value",
    ),
    (
        "truncated escape",
        br#"["\u00"#,
        "invalid_json",
        "four hex digits",
    ),
    (
        "trailing comma in object",
        br#"{"a":1,}"#,
        "invalid_json",
        "expected a string key",
    ),
    (
        "trailing comma in array",
        b"[1,]",
        "invalid_json",
        "expected a JSON value",
    ),
    (
        "single-quoted key",
        b"{'a':1}",
        "invalid_json",
        "expected a string key",
    ),
    (
        "single-quoted value",
        br#"{"a":'x'}"#,
        "invalid_json",
        "expected a JSON value",
    ),
    (
        "unquoted key",
        b"{a:1}",
        "invalid_json",
        "expected a string key",
    ),
    (
        "missing colon",
        br#"{"a" 1}"#,
        "invalid_json",
        "expected ':'",
    ),
    (
        "missing comma in object",
        br#"{"a":1 "b":2}"#,
        "invalid_json",
        "expected ',' or '}'",
    ),
    (
        "missing comma in array",
        b"[1 2]",
        "invalid_json",
        "expected ',' or ']'",
    ),
    (
        "NaN",
        br#"{"a":NaN}"#,
        "invalid_json",
        "NaN and Infinity are not JSON",
    ),
    (
        "Infinity",
        br#"{"a":Infinity}"#,
        "invalid_json",
        "NaN and Infinity are not JSON",
    ),
    (
        "-Infinity",
        br#"{"a":-Infinity}"#,
        "invalid_json",
        "NaN and Infinity are not JSON",
    ),
    (
        "a word that only begins like NaN",
        br#"{"a":Nope}"#,
        "invalid_json",
        "expected a JSON value",
    ),
    (
        "a minus before a word",
        br#"{"a":-Inf}"#,
        "invalid_json",
        "expected a digit",
    ),
    (
        "leading zero",
        br#"{"a":01}"#,
        "invalid_json",
        "leading zero",
    ),
    (
        "leading zero at top level",
        b"01",
        "invalid_json",
        "leading zero",
    ),
    (
        "negative leading zero",
        b"[-012]",
        "invalid_json",
        "leading zero",
    ),
    (
        "leading plus",
        b"[+1]",
        "invalid_json",
        "expected a JSON value",
    ),
    (
        "leading dot",
        b"[.5]",
        "invalid_json",
        "expected a JSON value",
    ),
    ("bare minus", b"[-]", "invalid_json", "expected a digit"),
    (
        "no fraction digits",
        b"[1.]",
        "invalid_json",
        "after the decimal point",
    ),
    ("no exponent digits", b"[1e+]", "invalid_json", "exponent"),
    (
        "hex number",
        b"[0x10]",
        "invalid_json",
        "expected ',' or ']'",
    ),
    (
        "capitalised literal",
        b"[True]",
        "invalid_json",
        "expected a JSON value",
    ),
    (
        "raw newline in string",
        b"[\"a\nb\"]",
        "invalid_json",
        "control character",
    ),
    (
        "raw tab in string",
        b"[\"a\tb\"]",
        "invalid_json",
        "control character",
    ),
    (
        "raw NUL in string",
        b"[\"a\0b\"]",
        "invalid_json",
        "control character",
    ),
    (
        "bad escape",
        br#"["\x41"]"#,
        "invalid_json",
        "invalid escape",
    ),
    (
        "escaped single quote",
        br#"["\'"]"#,
        "invalid_json",
        "invalid escape",
    ),
    (
        "short unicode escape",
        br#"["\u12"]"#,
        "invalid_json",
        "four hex digits",
    ),
    (
        "non-hex unicode escape",
        br#"["\u12G4"]"#,
        "invalid_json",
        "four hex digits",
    ),
    (
        "trailing garbage",
        br#"{"a":1} x"#,
        "invalid_json",
        "unexpected data after the JSON value",
    ),
    (
        "two values",
        b"{}{}",
        "invalid_json",
        "unexpected data after the JSON value",
    ),
    (
        "trailing comma at top level",
        b"{},",
        "invalid_json",
        "unexpected data after the JSON value",
    ),
    (
        "comment",
        b"{} // done",
        "invalid_json",
        "unexpected data after the JSON value",
    ),
    (
        "non-breaking space",
        b"{\"a\":\xc2\xa01}",
        "invalid_json",
        "expected a JSON value",
    ),
    (
        "UTF-8 byte order mark",
        b"\xef\xbb\xbf{}",
        "invalid_json",
        "byte order mark",
    ),
    (
        "invalid UTF-8 byte",
        b"{\"a\":\"\xff\"}",
        "invalid_utf8",
        "UTF-8",
    ),
    (
        "overlong encoding",
        b"{\"a\":\"\xc0\xaf\"}",
        "invalid_utf8",
        "UTF-8",
    ),
    ("overlong NUL", b"[\"\xc0\x80\"]", "invalid_utf8", "UTF-8"),
    (
        "raw surrogate bytes",
        b"[\"\xed\xa0\x80\"]",
        "invalid_utf8",
        "UTF-8",
    ),
    (
        "truncated multi-byte",
        b"[\"\xe2\x82\"]",
        "invalid_utf8",
        "UTF-8",
    ),
    (
        "code point above U+10FFFF",
        b"[\"\xf4\x90\x80\x80\"]",
        "invalid_utf8",
        "UTF-8",
    ),
    ("Latin-1 text", b"[\"caf\xe9\"]", "invalid_utf8", "UTF-8"),
];

#[test]
fn rejects_bad_input_with_a_message_naming_the_problem() {
    for &(what, body, code, words) in BAD_BODIES {
        let r = rejection(body);
        assert_eq!(r.status, 400, "{what}: {r:?}");
        assert_eq!(r.code, code, "{what}: {r:?}");
        assert!(
            r.message.contains(words),
            "{what}: message {:?} lacks {words:?}",
            r.message
        );
        let err = find_edits(body).expect_err(what);
        assert_eq!(err.code(), code, "{what}");
        assert_eq!(err.to_string(), r.message, "{what}");
    }
}

/// Python's `json.loads` refuses an integer of more than 4300 digits
/// (CPython's limit on converting decimal strings to `int`), so such a
/// body is refused as Python would; a float has no such limit, nor does
/// the sign count.
#[test]
fn refuses_integers_longer_than_python_reads() {
    let body = |number: &str| {
        format!(r#"{{"n":{number},"disaggregated_params":{{"request_type":"context_only"}}}}"#)
    };
    let digits = |n: usize| "7".repeat(n);
    for fine in [
        digits(4300),
        format!("-{}", digits(4300)),
        format!("{}.0", digits(5000)),
        format!("{}e1", digits(5000)),
    ] {
        assert_eq!(stamp(body(&fine)).1.len(), 1, "{} characters", fine.len());
    }
    for refused in [digits(4301), format!("-{}", digits(4301))] {
        let r = rejection(body(&refused));
        assert_eq!(r.code, "invalid_json", "{r:?}");
        assert!(r.message.contains("4300 digits"), "{r:?}");
        assert!(r.message.contains("(byte 5)"), "the number's start: {r:?}");
    }
}

#[test]
fn names_where_the_problem_is() {
    let r = rejection("{\n  \"a\": 1,\n  \"b\": tru\n}");
    assert_eq!(r.code, "invalid_json");
    assert!(
        r.message.contains("line 3 column 8"),
        "message {:?}",
        r.message
    );
    assert!(matches!(
        find_edits(b"[1,\n 01]"),
        Err(BodyError::Syntax {
            line: 2,
            column: 3,
            offset: 6,
            ..
        })
    ));
    assert_eq!(
        find_edits(b"{\"a\":\"\xe9\"}"),
        Err(BodyError::InvalidUtf8 { offset: 6 })
    );
    let r = rejection(b"{\"a\":\"\xe9\"}");
    assert!(r.message.contains("offset 6"), "message {:?}", r.message);
}

/// UTF-8 is checked inside long strings too, which the walk skips a word
/// at a time: a bad sequence at any offset of a string is found, and a good
/// one at any offset is accepted.
#[test]
fn checks_utf8_at_every_offset_of_a_long_string() {
    let good: [&[u8]; 3] = [b"\xc3\xa9", b"\xe2\x82\xac", b"\xf0\x9f\x98\x80"];
    let bad: [&[u8]; 5] = [b"\xff", b"\xe9", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82"];
    for at in 0..40 {
        let body = |inner: &[u8]| {
            let mut body = br#"{"prompt":""#.to_vec();
            body.extend(std::iter::repeat_n(b'a', at));
            body.extend_from_slice(inner);
            body.extend(std::iter::repeat_n(b'b', 40 - at));
            body.extend_from_slice(br#"","disaggregated_params":{"request_type":"context_only"}}"#);
            body
        };
        for inner in good {
            let body = body(inner);
            assert_eq!(
                find_edits(&body).map(|e| e.len()),
                Ok(1),
                "{inner:x?} at {at}"
            );
        }
        for inner in bad {
            let body = body(inner);
            let offset = std::str::from_utf8(&body).unwrap_err().valid_up_to();
            assert_eq!(
                find_edits(&body),
                Err(BodyError::InvalidUtf8 { offset }),
                "{inner:x?} at {at}"
            );
            assert_eq!(rejection(&body).code, "invalid_utf8");
        }
    }
}

#[test]
fn rejects_every_truncation_of_a_body_without_panicking() {
    let body = "{\"model\":\"caf\u{e9} \u{1F600}\\u00e9\\ud83d\\ude00\",\"n\":[-1.5e+3,true,false,null],\r\n\"disaggregated_params\":{\"request_type\":\"context_only\",\"disagg_request_id\":null}}";
    assert_eq!(stamp(body).1.len(), 1);
    for len in 0..body.len() {
        let r = rejection(&body.as_bytes()[..len]);
        assert_eq!(r.status, 400, "prefix {len}: {r:?}");
        assert!(
            ["empty_body", "invalid_json", "invalid_utf8"].contains(&r.code),
            "prefix {len}: {r:?}"
        );
    }
}

fn nested(depth: usize, inner: &str) -> String {
    format!("{}{inner}{}", "[".repeat(depth), "]".repeat(depth))
}

#[test]
fn accepts_nesting_up_to_the_limit() {
    assert_eq!(MAX_NESTING_DEPTH, 128);
    assert_forwarded(nested(128, ""));
    assert_forwarded(format!("{}1{}", r#"{"a":"#.repeat(128), "}".repeat(128)));
    // 126 arrays + the request object + the params object = 128 levels.
    let (out, ids) = stamp(nested(
        126,
        r#"{"disaggregated_params":{"request_type":"context_only"}}"#,
    ));
    assert_eq!(
        out,
        nested(
            126,
            &format!(
                r#"{{"disaggregated_params":{{"request_type":"context_only","disagg_request_id":{}}}}}"#,
                ids[0]
            )
        )
    );
}

#[test]
fn rejects_nesting_beyond_the_limit() {
    for body in [
        nested(129, ""),
        nested(10_000, ""),
        format!("{}1{}", r#"{"a":"#.repeat(129), "}".repeat(129)),
        nested(
            127,
            r#"{"disaggregated_params":{"request_type":"context_only"}}"#,
        ),
        // Unclosed: the depth check comes before the end of the body.
        "[".repeat(100_000),
    ] {
        let r = rejection(&body);
        assert_eq!(r.status, 400);
        assert_eq!(r.code, "nesting_too_deep");
        assert!(r.message.contains("deeper than 128"), "{}", r.message);
    }
    assert_eq!(
        find_edits(nested(129, "").as_bytes()),
        Err(BodyError::TooDeep { offset: 128 })
    );
}

// ---------------------------------------------------------------------------
// MessagePack, the machine id and the clock
// ---------------------------------------------------------------------------

#[test]
fn recognises_the_msgpack_header() {
    let yes: &[(&str, &[u8])] = &[
        ("content-type", b"application/json"),
        ("X-TRTLLM-Msgpack", b"1"),
    ];
    assert!(is_msgpack(yes.iter().copied()));
    assert!(is_msgpack([("x-trtllm-msgpack", &b" 1 "[..])].into_iter()));
    assert!(!is_msgpack([("x-trtllm-msgpack", &b"0"[..])].into_iter()));
    assert!(!is_msgpack(
        [("x-trtllm-msgpack-other", &b"1"[..])].into_iter()
    ));
    assert!(!is_msgpack(
        [("content-type", &b"application/json"[..])].into_iter()
    ));
    assert!(!is_msgpack(std::iter::empty()));
    // The first value counts, as the worker reads it.
    let first: &[(&str, &[u8])] = &[
        ("x-trtllm-msgpack", b"0"),
        ("content-type", b"application/json"),
        ("X-TRTLLM-Msgpack", b"1"),
    ];
    assert!(!is_msgpack(first.iter().copied()));
    let first: &[(&str, &[u8])] = &[("x-trtllm-msgpack", b"1"), ("x-trtllm-msgpack", b"0")];
    assert!(is_msgpack(first.iter().copied()));
}

// MessagePack bodies: the same rules, checked against rmpv, an independent
// MessagePack reader and writer.

/// `{k: v, ...}` as an rmpv map, keys as strings.
fn mp_map(pairs: Vec<(&str, rmpv::Value)>) -> rmpv::Value {
    rmpv::Value::Map(pairs.into_iter().map(|(k, v)| (k.into(), v)).collect())
}

fn mp_encode(value: &rmpv::Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, value).expect("encoding into a Vec");
    out
}

fn mp_decode(bytes: &[u8]) -> rmpv::Value {
    let mut reader = bytes;
    let value = rmpv::decode::read_value(&mut reader).expect("valid MessagePack");
    assert!(reader.is_empty(), "nothing after the value");
    value
}

fn mp_context_only(extra: Vec<(&str, rmpv::Value)>) -> rmpv::Value {
    let mut pairs = vec![("request_type", "context_only".into())];
    pairs.extend(extra);
    mp_map(pairs)
}

/// Decides on a MessagePack body with the v1 layout.
fn decide_msgpack(body: &[u8]) -> Decision {
    let mut ids = FakeIds::new(SnowflakeLayout::TrtllmV1);
    decide(&v1(), true, body, &mut ids).expect("no plugin failure")
}

/// Stamps a MessagePack body and returns the new body and the ids.
fn stamp_msgpack(body: &[u8]) -> (Vec<u8>, Vec<u64>) {
    match decide_msgpack(body) {
        Decision::ForwardWithBody { body, ids } => (body, ids),
        other => panic!("expected a stamp, got {other:?}"),
    }
}

#[test]
fn stamps_a_messagepack_request_as_it_would_a_json_one() {
    let request = mp_map(vec![
        ("model", "m".into()),
        (
            "prompt_token_ids",
            rmpv::Value::Array(vec![1.into(), 2.into()]),
        ),
        ("disaggregated_params", mp_context_only(vec![])),
    ]);
    let body = mp_encode(&request);
    let (out, ids) = stamp_msgpack(&body);
    assert_eq!(ids, [first_v1_id()]);
    let expected = mp_map(vec![
        ("model", "m".into()),
        (
            "prompt_token_ids",
            rmpv::Value::Array(vec![1.into(), 2.into()]),
        ),
        (
            "disaggregated_params",
            mp_context_only(vec![("disagg_request_id", ids[0].into())]),
        ),
    ]);
    assert_eq!(mp_decode(&out), expected);
    // Only the params map's header changed, and the pair was appended.
    let header = body.len() - 1 - "request_type".len() - 1 - "context_only".len() - 1;
    assert_eq!(body[header], 0x81);
    assert_eq!(out[header], 0x82);
    assert_eq!(out[..header], body[..header]);
    assert_eq!(out[header + 1..body.len()], body[header + 1..]);
}

/// A byte string `request_type` is read as its text, as the worker's
/// pydantic model reads bytes for a `str` field: a hand-made body that
/// sends `context_only` as bin 8 would otherwise reach it without an id.
/// A byte string key is never `request_type`, as a bytes dict key is no
/// field name to pydantic.
#[test]
fn a_byte_string_request_type_is_read_as_its_text() {
    let params = |request_type: rmpv::Value| {
        mp_encode(&mp_map(vec![(
            "disaggregated_params",
            mp_map(vec![("request_type", request_type)]),
        )]))
    };
    let body = params(rmpv::Value::Binary(b"Context_Only".to_vec()));
    let (out, ids) = stamp_msgpack(&body);
    assert_eq!(ids.len(), 1);
    let expected = mp_map(vec![(
        "disaggregated_params",
        mp_map(vec![
            (
                "request_type",
                rmpv::Value::Binary(b"Context_Only".to_vec()),
            ),
            ("disagg_request_id", ids[0].into()),
        ]),
    )]);
    assert_eq!(mp_decode(&out), expected);
    let other = params(rmpv::Value::Binary(b"generation_only".to_vec()));
    assert!(matches!(decide_msgpack(&other), Decision::Forward));
    let bin_key = mp_encode(&rmpv::Value::Map(vec![(
        "disaggregated_params".into(),
        rmpv::Value::Map(vec![(
            rmpv::Value::Binary(b"request_type".to_vec()),
            "context_only".into(),
        )]),
    )]));
    assert!(matches!(decide_msgpack(&bin_key), Decision::Forward));
}

#[test]
fn stamps_messagepack_params_like_json_ones() {
    let ctx = || mp_context_only(vec![]);
    // A null id is replaced in place, by a uint 64.
    let body = mp_encode(&mp_map(vec![(
        "disaggregated_params",
        mp_context_only(vec![
            ("disagg_request_id", rmpv::Value::Nil),
            ("x", 1.into()),
        ]),
    )]));
    let (out, ids) = stamp_msgpack(&body);
    let nil = body.iter().position(|&b| b == 0xc0).expect("a nil");
    assert_eq!(out[..nil], body[..nil]);
    assert_eq!(out[nil], 0xcf);
    assert_eq!(out[nil + 1..nil + 9], ids[0].to_be_bytes());
    assert_eq!(out[nil + 9..], body[nil + 1..]);

    // Each request of a batch, in order; the request type ignoring case.
    let batch = rmpv::Value::Array(
        [
            "context_only",
            "CONTEXT_ONLY",
            "generation_only",
            "Context_Only",
        ]
        .iter()
        .map(|t| {
            mp_map(vec![(
                "disaggregated_params",
                mp_map(vec![("request_type", (*t).into())]),
            )])
        })
        .collect(),
    );
    let (out, ids) = stamp_msgpack(&mp_encode(&batch));
    assert_eq!(ids.len(), 3);
    let rmpv::Value::Array(requests) = mp_decode(&out) else {
        panic!("an array")
    };
    let stamped: Vec<Option<u64>> = requests
        .iter()
        .map(|r| r["disaggregated_params"]["disagg_request_id"].as_u64())
        .collect();
    assert_eq!(stamped, [Some(ids[0]), Some(ids[1]), None, Some(ids[2])]);

    // Bodies that need no id come out as they went in.
    for value in [
        mp_map(vec![(
            "disaggregated_params",
            mp_context_only(vec![("disagg_request_id", 5.into())]),
        )]),
        mp_map(vec![(
            "disaggregated_params",
            mp_map(vec![("request_type", "generation_only".into())]),
        )]),
        mp_map(vec![("other", ctx())]),
        mp_map(vec![(
            "prompt",
            "\"disaggregated_params\": {\"request_type\": \"context_only\"}".into(),
        )]),
        rmpv::Value::Map(vec![(
            rmpv::Value::Binary(b"disaggregated_params".to_vec()),
            ctx(),
        )]),
    ] {
        assert!(
            matches!(decide_msgpack(&mp_encode(&value)), Decision::Forward),
            "{value}"
        );
    }
}

#[test]
fn the_last_of_duplicate_messagepack_keys_counts() {
    // Duplicate params: only the last gets an id.
    let body = mp_encode(&mp_map(vec![
        ("disaggregated_params", mp_context_only(vec![])),
        ("disaggregated_params", mp_context_only(vec![])),
    ]));
    let (out, ids) = stamp_msgpack(&body);
    assert_eq!(ids.len(), 1);
    let rmpv::Value::Map(pairs) = mp_decode(&out) else {
        panic!("a map")
    };
    assert!(pairs[0].1["disagg_request_id"].is_nil());
    assert_eq!(pairs[1].1["disagg_request_id"].as_u64(), Some(ids[0]));

    // The last request type, and the last id, decide.
    for (pairs, stamped) in [
        (
            vec![
                ("request_type", "generation_only".into()),
                ("request_type", "context_only".into()),
            ],
            true,
        ),
        (
            vec![
                ("request_type", "context_only".into()),
                ("request_type", "generation_only".into()),
            ],
            false,
        ),
        (
            vec![
                ("request_type", "context_only".into()),
                ("disagg_request_id", 9.into()),
                ("disagg_request_id", rmpv::Value::Nil),
            ],
            true,
        ),
        (
            vec![
                ("request_type", "context_only".into()),
                ("disagg_request_id", rmpv::Value::Nil),
                ("disagg_request_id", 9.into()),
            ],
            false,
        ),
    ] {
        let body = mp_encode(&mp_map(vec![("disaggregated_params", mp_map(pairs))]));
        assert_eq!(
            matches!(decide_msgpack(&body), Decision::ForwardWithBody { .. }),
            stamped
        );
    }

    // A member overridden by a later duplicate key is never stamped.
    let body = mp_encode(&mp_map(vec![
        (
            "a",
            mp_map(vec![("disaggregated_params", mp_context_only(vec![]))]),
        ),
        ("a", 1.into()),
    ]));
    assert!(matches!(decide_msgpack(&body), Decision::Forward));
}

#[test]
fn a_map_that_outgrows_its_header_format_gets_the_next_one() {
    // 15 pairs fit a fixmap; the 16th needs a map 16.
    let mut pairs = vec![("request_type", "context_only".into())];
    let names: Vec<String> = (0..14).map(|i| format!("k{i}")).collect();
    pairs.extend(names.iter().map(|n| (n.as_str(), rmpv::Value::from(1))));
    let body = mp_encode(&mp_map(vec![(
        "disaggregated_params",
        mp_map(pairs.clone()),
    )]));
    let (out, ids) = stamp_msgpack(&body);
    let header = 1 + 1 + "disaggregated_params".len();
    assert_eq!(body[header], 0x8f);
    assert_eq!(out[header..header + 3], [0xde, 0x00, 0x10]);
    pairs.push(("disagg_request_id", ids[0].into()));
    assert_eq!(
        mp_decode(&out),
        mp_map(vec![("disaggregated_params", mp_map(pairs))])
    );
}

#[test]
fn gives_a_messagepack_burst_of_ten_thousand_params_distinct_ids() {
    let batch = rmpv::Value::Array(
        (0..10_000)
            .map(|_| mp_map(vec![("disaggregated_params", mp_context_only(vec![]))]))
            .collect(),
    );
    let (out, ids) = stamp_msgpack(&mp_encode(&batch));
    assert_eq!(ids.len(), 10_000);
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 10_000);
    let rmpv::Value::Array(requests) = mp_decode(&out) else {
        panic!("an array")
    };
    assert_eq!(requests.len(), ids.len(), "one id a request");
    for (request, id) in requests.iter().zip(&ids) {
        assert_eq!(
            request["disaggregated_params"]["disagg_request_id"].as_u64(),
            Some(*id)
        );
    }
}

#[test]
fn rejects_bad_messagepack_with_400_naming_the_problem() {
    let ctx = mp_encode(&mp_map(vec![(
        "disaggregated_params",
        mp_context_only(vec![]),
    )]));
    let mut deep = vec![0x91; MAX_NESTING_DEPTH];
    deep.push(0xc0);
    let mut too_deep = vec![0x91; MAX_NESTING_DEPTH + 1];
    too_deep.push(0xc0);
    assert!(matches!(decide_msgpack(&deep), Decision::Forward));
    for (body, problem) in [
        (&b""[..], "empty"),
        (&ctx[..ctx.len() - 1], "ends inside"),
        (
            &[ctx.as_slice(), b"\x00"].concat()[..],
            "after the MessagePack value",
        ),
        (b"\xc1", "0xc1"),
        (b"\x81\xa1a\xa2\xff\xfe", "UTF-8"),
        (b"\x81\x80\x01", "map key is or holds a map"),
        (&too_deep[..], "deeper than 128"),
        (b"\xdb\xff\xff\xff\xff", "ends inside"),
        (b"\xdd\xff\xff\xff\xff", "ends"),
        (
            br#"{"disaggregated_params":{"request_type":"context_only"}}"#,
            "after the MessagePack value",
        ),
    ] {
        let Decision::Reject(r) = decide_msgpack(body) else {
            panic!("expected a rejection of {body:?}");
        };
        assert_eq!((r.status, r.code), (400, "invalid_msgpack"), "{body:?}");
        assert!(
            r.message.contains("MessagePack") && r.message.contains(problem),
            "{body:?}: {}",
            r.message
        );
    }
    // Every truncation of a stamped-looking body is refused, never a panic.
    for end in 0..ctx.len() {
        assert!(matches!(decide_msgpack(&ctx[..end]), Decision::Reject(_)));
    }
}

/// A MessagePack value for the property test: nested maps and arrays with
/// params maps in every state, under keys that repeat.
fn mp_document() -> BoxedStrategy<rmpv::Value> {
    let leaf = prop_oneof![
        Just(rmpv::Value::Nil),
        any::<bool>().prop_map(rmpv::Value::from),
        any::<i64>().prop_map(rmpv::Value::from),
        any::<u64>().prop_map(rmpv::Value::from),
        any::<f64>().prop_map(rmpv::Value::from),
        prop::sample::select(vec![
            "context_only",
            "CONTEXT_only",
            "generation_only",
            "",
            "é"
        ])
        .prop_map(rmpv::Value::from),
        prop::collection::vec(any::<u8>(), 0..4).prop_map(rmpv::Value::Binary),
    ];
    let scalar_key = prop_oneof![
        prop::sample::select(vec![
            "disaggregated_params",
            "request_type",
            "disagg_request_id",
            "a",
            "b"
        ])
        .prop_map(rmpv::Value::from),
        (0i64..3).prop_map(rmpv::Value::from),
        any::<bool>().prop_map(rmpv::Value::from),
        Just(rmpv::Value::Binary(b"disaggregated_params".to_vec())),
    ];
    // Arrays are tuples, and hashable, as dict keys in Python: equal item
    // by item, nested ones too.
    let key = prop_oneof![
        4 => scalar_key.clone(),
        1 => scalar_key.prop_recursive(2, 6, 3, |inner| {
            prop::collection::vec(inner, 0..3).prop_map(rmpv::Value::Array)
        }),
    ];
    // Params maps as a router sends them, among other pairs: without them
    // a random map rarely holds `disaggregated_params` over a map that
    // holds `request_type: context_only` (about one document in a
    // thousand), and the stamping path went all but unchecked.
    let request_type =
        prop::sample::select(vec!["context_only", "CONTEXT_ONLY", "generation_only"])
            .prop_map(rmpv::Value::from);
    let id = prop_oneof![
        Just(None),
        Just(Some(rmpv::Value::Nil)),
        any::<u64>().prop_map(|n| Some(rmpv::Value::from(n))),
    ];
    leaf.prop_recursive(5, 64, 6, move |inner| {
        let params = (
            request_type.clone(),
            id.clone(),
            prop::collection::vec((key.clone(), inner.clone()), 0..3),
        )
            .prop_map(|(request_type, id, mut pairs)| {
                pairs.insert(0, ("request_type".into(), request_type));
                if let Some(id) = id {
                    pairs.push(("disagg_request_id".into(), id));
                }
                rmpv::Value::Map(pairs)
            });
        let with_params = (
            prop::collection::vec((key.clone(), inner.clone()), 0..3),
            params,
        )
            .prop_map(|(mut pairs, params)| {
                pairs.push(("disaggregated_params".into(), params));
                rmpv::Value::Map(pairs)
            });
        prop_oneof![
            2 => prop::collection::vec(inner.clone(), 0..5).prop_map(rmpv::Value::Array),
            2 => prop::collection::vec((key.clone(), inner), 0..6).prop_map(rmpv::Value::Map),
            3 => with_params,
        ]
    })
    .boxed()
}

/// The MessagePack documents of the property tests do reach the
/// stamping path: at least a fifth of them get ids.
#[test]
fn the_messagepack_property_tests_mostly_reach_the_stamping_path() {
    use proptest::strategy::ValueTree as _;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let strategy = mp_document();
    let summaries: Vec<String> = (0..500)
        .map(|_| {
            let doc = strategy
                .new_tree(&mut runner)
                .expect("a document")
                .current();
            mp_oracle::check_msgpack_body(&mp_encode(&doc))
        })
        .collect();
    let stamped = summaries.iter().filter(|s| s.starts_with("stamp")).count();
    let nil_replaced = summaries
        .iter()
        .filter(|s| s.starts_with("stamp") && !s.contains("-nil0-"))
        .count();
    assert!(stamped >= 100, "{stamped} of 500 stamped");
    assert!(
        nil_replaced >= 20,
        "{nil_replaced} of 500 had a nil id replaced"
    );
}

/// The host lets a plugin answer with twice the largest body it takes
/// (`PluginLimits::answering_bodies_of`). Bodies made of nothing but the
/// smallest params to stamp, each getting a 19-digit id, stay under that:
/// a JSON batch, params nested in params to the depth limit, `null` ids,
/// and a MessagePack batch.
#[test]
fn a_stamped_body_is_less_than_twice_its_size_however_densely_it_asks_for_ids() {
    let params = r#"{"disaggregated_params":{"request_type":"context_only"}}"#;
    let batch = format!("[{}]", vec![params; 5000].join(","));
    let depth = MAX_NESTING_DEPTH / 2 - 1;
    let nested = format!(
        "{}0{}",
        r#"{"disaggregated_params":{"request_type":"context_only","d":"#.repeat(depth),
        "}}".repeat(depth)
    );
    let nulls = format!(
        "[{}]",
        vec![
            r#"{"disaggregated_params":{"request_type":"context_only","disagg_request_id":null}}"#;
            5000
        ]
        .join(",")
    );
    for (name, body) in [("batch", &batch), ("nested", &nested), ("nulls", &nulls)] {
        let (out, ids) = stamp(body);
        assert!(ids.iter().all(|id| id.to_string().len() == 19), "{name}");
        assert!(!ids.is_empty(), "{name}");
        assert!(
            out.len() < 2 * body.len(),
            "{name}: {} from {}",
            out.len(),
            body.len()
        );
    }
    let item = mp_map(vec![("disaggregated_params", mp_context_only(vec![]))]);
    let body = mp_encode(&rmpv::Value::Array(vec![item; 5000]));
    let (out, ids) = stamp_msgpack(&body);
    assert_eq!(ids.len(), 5000);
    assert!(
        out.len() < 2 * body.len(),
        "msgpack: {} from {}",
        out.len(),
        body.len()
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Any bytes at all, and any valid document with bytes overwritten or
    /// cut, get a decision, never a panic; what is forwarded stamped is
    /// still MessagePack that rmpv reads whole; and the MessagePack fuzz
    /// oracle agrees with the decision.
    #[test]
    fn any_bytes_as_messagepack_get_a_decision(
        doc in mp_document(),
        noise in prop::collection::vec(any::<u8>(), 0..64),
        changes in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut body = mp_encode(&doc);
        for (at, byte) in &changes {
            let at = at.index(body.len());
            body[at] = *byte;
        }
        body.truncate(cut.index(body.len() + 1));
        for body in [&body[..], &noise[..]] {
            if let Decision::ForwardWithBody { body: out, .. } = decide_msgpack(body) {
                let mut reader = &out[..];
                prop_assert!(rmpv::decode::read_value(&mut reader).is_ok());
                prop_assert!(reader.is_empty());
            }
            // And every check of the `stamp_msgpack` fuzz target.
            mp_oracle::check_msgpack_body(body);
        }
    }

    /// Any MessagePack document comes out as rmpv reads it plus exactly
    /// the ids the oracle expects where it expects them, all distinct; a
    /// document that needs none comes out byte for byte.
    #[test]
    fn messagepack_bodies_gain_exactly_the_expected_ids(doc in mp_document()) {
        check_mp_document(&doc)?;
    }

    /// Maps whose keys are a few tuples, equal or not in Python, each over
    /// params to stamp or nothing: the last of equal keys alone is stamped.
    #[test]
    fn messagepack_tuple_keys_are_compared_as_python_compares_them(doc in mp_tuple_keyed()) {
        check_mp_document(&doc)?;
    }
}

/// `doc` encoded goes through the MessagePack fuzz oracle
/// (`fuzz/src/mp_oracle.rs`): it comes out as rmpv reads it plus exactly
/// the ids the oracle expects where it expects them, all distinct; a
/// document that needs none is forwarded as it came. Every generated
/// document is one the oracle judges, and none is refused.
fn check_mp_document(doc: &rmpv::Value) -> Result<(), TestCaseError> {
    let body = mp_encode(doc);
    let summary = mp_oracle::check_msgpack_body(&body);
    prop_assert!(
        summary.ends_with("-valid"),
        "the oracle does not judge {}: {}",
        doc,
        summary
    );
    prop_assert!(!summary.starts_with("reject"), "rejected: {}", doc);
    Ok(())
}

/// A map of a few pairs whose keys are tuples from a small set (with
/// `1 == True` and `0 == False` inside), each over a map holding params
/// to stamp, or over nil.
fn mp_tuple_keyed() -> BoxedStrategy<rmpv::Value> {
    use rmpv::Value;
    let keys = vec![
        Value::Array(vec![]),
        Value::Array(vec![0.into()]),
        Value::Array(vec![false.into()]),
        Value::Array(vec![1.into(), "a".into()]),
        Value::Array(vec![true.into(), "a".into()]),
        Value::Array(vec![Value::Array(vec![0.into()])]),
        Value::Array(vec![Value::Array(vec![])]),
        Value::Array(vec![1.into(), Value::Array(vec![true.into()])]),
    ];
    let value = prop_oneof![
        Just(mp_map(vec![(
            "disaggregated_params",
            mp_map(vec![("request_type", "context_only".into())]),
        )])),
        Just(Value::Nil),
    ];
    prop::collection::vec((prop::sample::select(keys), value), 1..6)
        .prop_map(Value::Map)
        .boxed()
}

#[test]
fn rejects_with_503_when_there_is_no_machine_id() {
    let mut ids = FakeIds::failing("the etcd lease expired");
    let body = br#"{"disaggregated_params":{"request_type":"context_only"}}"#;
    let Ok(Decision::Reject(r)) = decide(&v1(), false, body, &mut ids) else {
        panic!("expected a rejection");
    };
    assert_eq!(r.status, 503);
    assert_eq!(r.code, "no_machine_id");
    assert!(
        r.message.contains("the etcd lease expired"),
        "{}",
        r.message
    );
    assert!(ids.ticks.is_empty(), "no ticks without a machine id");
}

#[test]
fn forwards_bodies_that_need_no_id_without_a_machine_id() {
    for body in [
        &br#"{"prompt":"hi"}"#[..],
        br#"{"disaggregated_params":{"request_type":"generation_only"}}"#,
        br#"{"disaggregated_params":{"request_type":"context_only","disagg_request_id":5}}"#,
    ] {
        let mut ids = FakeIds::failing("no lease");
        assert_eq!(decide(&v1(), false, body, &mut ids), Ok(Decision::Forward));
        assert_eq!(ids.machine_calls, 0);
    }
    // A bad body is still the client's problem, not a 503.
    let mut ids = FakeIds::failing("no lease");
    let Ok(Decision::Reject(r)) = decide(&v1(), false, b"{", &mut ids) else {
        panic!("expected a rejection");
    };
    assert_eq!(r.status, 400);
    assert_eq!(ids.machine_calls, 0);
}

#[test]
fn fails_when_the_machine_id_is_for_another_layout() {
    let body = br#"{"disaggregated_params":{"request_type":"context_only"}}"#;
    for layout in SnowflakeLayout::ALL {
        let other = SnowflakeLayout::ALL
            .into_iter()
            .find(|&l| l != layout)
            .unwrap();
        let mut ids = FakeIds::new(other);
        let Err(PluginFailure(message)) = decide(&Config { layout }, false, body, &mut ids) else {
            panic!("expected a plugin failure");
        };
        assert!(
            message.contains(layout.name()) && message.contains(other.name()),
            "{message}"
        );
        assert!(ids.ticks.is_empty());
    }
}

#[test]
fn fails_when_the_machine_id_is_out_of_range() {
    let body = br#"{"disaggregated_params":{"request_type":"context_only"}}"#;
    let mut ids = FakeIds::with_machine(Ok(MachineId {
        value: 1023,
        layout: SnowflakeLayout::TrtllmV1,
    }));
    let Err(PluginFailure(message)) = decide(&v1(), false, body, &mut ids) else {
        panic!("expected a plugin failure");
    };
    assert!(message.contains("machine id"), "{message}");
    assert!(message.contains("1023"), "{message}");
    assert!(!message.contains("clock"), "blames the clock: {message}");
    assert!(ids.ticks.is_empty());
}

#[test]
fn fails_on_a_tick_outside_the_sequence_space() {
    let body = br#"{"disaggregated_params":{"request_type":"context_only"}}"#;
    let mut ids = FixedTick(Tick {
        millis: START_MILLIS,
        sequence: 4096,
    });
    let Err(PluginFailure(message)) = decide(&v1(), false, body, &mut ids) else {
        panic!("expected a plugin failure");
    };
    assert!(message.contains("sequence 4096"), "{message}");
}

#[test]
fn ids_decode_to_the_ticks_and_machine_used() {
    let body = br#"[{"disaggregated_params":{"request_type":"context_only"}},{"disaggregated_params":{"request_type":"context_only","disagg_request_id":null}},{"disaggregated_params":{"request_type":"CONTEXT_ONLY"}}]"#;
    for layout in SnowflakeLayout::ALL {
        for machine in [0, MACHINE, layout.max_machine_id()] {
            let mut ids = FakeIds::with_machine(Ok(MachineId {
                value: machine,
                layout,
            }));
            let Ok(Decision::ForwardWithBody {
                body: out,
                ids: stamped,
            }) = decide(&Config { layout }, false, body, &mut ids)
            else {
                panic!("expected a stamp");
            };
            assert_eq!(stamped.len(), 3);
            assert_eq!(ids.ticks.len(), 3);
            for (id, tick) in stamped.iter().zip(&ids.ticks) {
                let parts = layout.decode(*id).unwrap();
                let millis = match layout {
                    SnowflakeLayout::TrtllmV1 => tick.millis,
                    SnowflakeLayout::TrtllmV2 => tick.millis & ((1 << 39) - 1),
                };
                assert_eq!(parts.millis, millis, "{layout}");
                assert_eq!(parts.machine_id, machine, "{layout}");
                assert_eq!(parts.sequence, tick.sequence, "{layout}");
                assert!(*id >= layout.min_id() && *id < 1 << 63);
                assert_eq!(
                    *id,
                    layout.compose(tick.millis, machine, tick.sequence).unwrap()
                );
            }
            // The ids appear in the body in the order they were made.
            let out: Value = serde_json::from_slice(&out).unwrap();
            let in_body: Vec<u64> = out
                .as_array()
                .unwrap()
                .iter()
                .map(|r| {
                    r["disaggregated_params"]["disagg_request_id"]
                        .as_u64()
                        .unwrap()
                })
                .collect();
            assert_eq!(in_body, stamped);
        }
    }
}

#[test]
fn ids_follow_body_order_across_inserts_and_replacements() {
    let (out, ids) = stamp(
        r#"{"b":{"disaggregated_params":{"disagg_request_id":null,"request_type":"context_only"}},"a":{"disaggregated_params":{"request_type":"context_only","inner":{"disaggregated_params":{"request_type":"context_only"}}}},"c":[{"disaggregated_params":{"request_type":"context_only","disagg_request_id":null}}]}"#,
    );
    assert_eq!(ids.len(), 4);
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    let out = parse(&out);
    let id = |v: &Value| v["disagg_request_id"].as_u64().unwrap();
    assert_eq!(id(&out["b"]["disaggregated_params"]), ids[0]);
    assert_eq!(
        id(&out["a"]["disaggregated_params"]["inner"]["disaggregated_params"]),
        ids[1]
    );
    assert_eq!(id(&out["a"]["disaggregated_params"]), ids[2]);
    assert_eq!(id(&out["c"][0]["disaggregated_params"]), ids[3]);
}

fn burst_body(count: usize) -> String {
    let mut body = String::from("[");
    for i in 0..count {
        if i > 0 {
            body.push(',');
        }
        body.push_str(r#"{"prompt":"p","disaggregated_params":{"request_type":"context_only"}}"#);
    }
    body.push(']');
    body
}

#[test]
fn gives_a_burst_of_ten_thousand_params_distinct_ids() {
    let body = burst_body(10_000);
    for layout in SnowflakeLayout::ALL {
        let mut ids = FakeIds::new(layout);
        let Ok(Decision::ForwardWithBody {
            body: out,
            ids: stamped,
        }) = decide(&Config { layout }, false, body.as_bytes(), &mut ids)
        else {
            panic!("expected a stamp");
        };
        assert_eq!(stamped.len(), 10_000);
        assert_eq!(ids.ticks.len(), 10_000, "one clock reading an id");
        assert_eq!(stamped.iter().collect::<HashSet<_>>().len(), 10_000);
        assert!(stamped.windows(2).all(|w| w[0] < w[1]), "{layout}");
        // The burst spilled over into later milliseconds instead of wrapping.
        let space = layout.sequence_space() as u64;
        assert_eq!(
            ids.ticks.last().unwrap().millis - START_MILLIS,
            (10_000 - 1) / space
        );
        for (id, tick) in stamped.iter().zip(&ids.ticks) {
            let parts = layout.decode(*id).unwrap();
            assert_eq!(parts.sequence, tick.sequence);
            assert_eq!(parts.machine_id, MACHINE);
        }
        let out: Value = serde_json::from_slice(&out).unwrap();
        let in_body: Vec<u64> = out
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                r["disaggregated_params"]["disagg_request_id"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(in_body, stamped, "{layout}");
    }
}

#[test]
fn stamps_a_body_of_tens_of_mebibytes() {
    const TARGET: usize = 20 << 20;
    let mut tokens = String::with_capacity(TARGET + 16);
    let mut n: u32 = 0;
    while tokens.len() < TARGET {
        if n > 0 {
            tokens.push(',');
        }
        tokens.push_str(&(n.wrapping_mul(2_654_435_761) % 200_000).to_string());
        n += 1;
    }
    let input = format!(
        r#"{{"model":"m","prompt_token_ids":[{tokens}],"disaggregated_params":{{"request_type":"context_only","schedule_style":0}}}}"#
    );
    assert!(input.len() > TARGET);
    let started = Instant::now();
    let mut ids = FakeIds::new(SnowflakeLayout::TrtllmV1);
    let Ok(Decision::ForwardWithBody {
        body: out,
        ids: stamped,
    }) = decide(&v1(), false, input.as_bytes(), &mut ids)
    else {
        panic!("expected a stamp");
    };
    let elapsed = started.elapsed();
    assert_eq!(stamped, [first_v1_id()]);
    let expected = format!(
        r#"{{"model":"m","prompt_token_ids":[{tokens}],"disaggregated_params":{{"request_type":"context_only","schedule_style":0,"disagg_request_id":{}}}}}"#,
        stamped[0]
    );
    assert!(out == expected.as_bytes(), "the big body came out wrong");
    eprintln!(
        "stamped a {:.1} MiB body in {elapsed:?}",
        input.len() as f64 / (1 << 20) as f64
    );
}

#[test]
fn reads_settings() {
    assert_eq!(Config::from_settings([]), Ok(v1()));
    assert_eq!(
        Config::from_settings([("id-layout", "trtllm-v2")]),
        Ok(Config {
            layout: SnowflakeLayout::TrtllmV2
        })
    );
    assert!(Config::from_settings([("id-layout", "v3")])
        .unwrap_err()
        .contains("trtllm-v1"));
    assert!(Config::from_settings([("layout", "trtllm-v1")])
        .unwrap_err()
        .contains("id-layout"));
}

// ---------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------

/// A JSON document before it is written out; strings hold their decoded
/// text, and writing picks whitespace and escapes.
#[derive(Debug, Clone)]
enum J {
    Null,
    Bool(bool),
    /// Number text, written as is.
    Num(&'static str),
    Str(String),
    Arr(Vec<J>),
    Obj(Vec<(String, J)>),
}

const NUMBERS: &[&str] = &[
    "0",
    "-0",
    "-0.0",
    "1",
    "-1",
    "1.5",
    "5",
    "1E400",
    "1e-7",
    "2.50E+10",
    "123456789012345678901234567890",
    "1099511628800",
];

const KEYS: &[&str] = &[
    "disaggregated_params",
    "disaggregated_params",
    "request_type",
    "disagg_request_id",
    "requests",
    "prompt",
    "a",
    "",
    "caf\u{e9}",
    "\u{1F600}",
    "Disaggregated_params",
    "disaggregated_params ",
    "k\"\\/\n",
];

const REQUEST_TYPES: &[&str] = &[
    "context_only",
    "context_only",
    "CONTEXT_ONLY",
    "Context_Only",
    "generation_only",
    "context_and_generation",
    "context_only ",
    "contextonly",
    "",
];

const STRINGS: &[&str] = &[
    "",
    "hello",
    "context_only",
    "disaggregated_params",
    r#"{"disaggregated_params":{"request_type":"context_only"}}"#,
    r#"{"disagg_request_id":null}"#,
    "null",
    "\\\"}]{[,:",
    "caf\u{e9} \u{1F600} \u{7f} \u{1} \t\n\r\u{8}\u{c}/",
];

fn leaf() -> BoxedStrategy<J> {
    prop_oneof![
        Just(J::Null),
        any::<bool>().prop_map(J::Bool),
        prop::sample::select(NUMBERS).prop_map(J::Num),
        prop::sample::select(STRINGS).prop_map(|s| J::Str(s.to_string())),
        "[a-z_\"\\\\/{}:, \n\t\u{1}\u{e9}\u{1F600}]{0,8}".prop_map(J::Str),
    ]
    .boxed()
}

fn key() -> BoxedStrategy<String> {
    prop::sample::select(KEYS).prop_map(str::to_string).boxed()
}

fn request_type_value() -> BoxedStrategy<J> {
    prop_oneof![
        6 => prop::sample::select(REQUEST_TYPES).prop_map(|s| J::Str(s.to_string())),
        1 => leaf(),
    ]
    .boxed()
}

fn id_value() -> BoxedStrategy<J> {
    prop_oneof![
        4 => Just(J::Null),
        2 => prop::sample::select(NUMBERS).prop_map(J::Num),
        1 => Just(J::Str("abc".into())),
        1 => Just(J::Bool(false)),
        1 => Just(J::Obj(vec![])),
        1 => Just(J::Arr(vec![])),
    ]
    .boxed()
}

fn document() -> BoxedStrategy<J> {
    let tree = leaf().prop_recursive(4, 48, 6, |inner| {
        let params = prop::collection::vec(
            prop_oneof![
                4 => request_type_value().prop_map(|v| ("request_type".to_string(), v)),
                3 => id_value().prop_map(|v| ("disagg_request_id".to_string(), v)),
                2 => (key(), inner.clone()),
            ],
            0..5,
        )
        .prop_map(J::Obj);
        let member = prop_oneof![
            3 => params.prop_map(|p| ("disaggregated_params".to_string(), p)),
            3 => (key(), inner.clone()),
            1 => request_type_value().prop_map(|v| ("request_type".to_string(), v)),
            1 => id_value().prop_map(|v| ("disagg_request_id".to_string(), v)),
        ];
        prop_oneof![
            1 => prop::collection::vec(inner.clone(), 0..5).prop_map(J::Arr),
            3 => prop::collection::vec(member, 0..6).prop_map(J::Obj),
        ]
    });
    prop_oneof![
        1 => tree.clone(),
        1 => prop::collection::vec(tree, 0..6).prop_map(J::Arr),
    ]
    .boxed()
}

/// A small deterministic generator for the choices made while writing.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn write_ws(rng: &mut Rng, out: &mut String) {
    const WS: &[&str] = &["", "", "", "", " ", "\t", "\n", "\r\n", " \t\n "];
    out.push_str(WS[rng.below(WS.len() as u64) as usize]);
}

fn write_u(rng: &mut Rng, out: &mut String, unit: u32) {
    if rng.below(2) == 0 {
        out.push_str(&format!("\\u{unit:04x}"));
    } else {
        out.push_str(&format!("\\u{unit:04X}"));
    }
}

fn write_str(rng: &mut Rng, out: &mut String, text: &str) {
    out.push('"');
    for c in text.chars() {
        let escape = rng.below(4) == 0;
        match c {
            '"' | '\\' if !escape => {
                out.push('\\');
                out.push(c);
            }
            '/' if !escape => out.push_str(if rng.below(2) == 0 { "/" } else { "\\/" }),
            '\u{8}' | '\u{c}' | '\n' | '\r' | '\t' if !escape => out.push_str(match c {
                '\u{8}' => "\\b",
                '\u{c}' => "\\f",
                '\n' => "\\n",
                '\r' => "\\r",
                _ => "\\t",
            }),
            c if (c as u32) < 0x20 || escape => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    write_u(rng, out, u32::from(*unit));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn write(j: &J, rng: &mut Rng, out: &mut String) {
    match j {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Num(n) => out.push_str(n),
        J::Str(s) => write_str(rng, out, s),
        J::Arr(items) => {
            out.push('[');
            write_ws(rng, out);
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    write_ws(rng, out);
                    out.push(',');
                    write_ws(rng, out);
                }
                write(item, rng, out);
            }
            write_ws(rng, out);
            out.push(']');
        }
        J::Obj(members) => {
            out.push('{');
            write_ws(rng, out);
            for (i, (k, v)) in members.iter().enumerate() {
                if i > 0 {
                    write_ws(rng, out);
                    out.push(',');
                    write_ws(rng, out);
                }
                write_str(rng, out, k);
                write_ws(rng, out);
                out.push(':');
                write_ws(rng, out);
                write(v, rng, out);
            }
            write_ws(rng, out);
            out.push('}');
        }
    }
}

fn render(doc: &J, seed: u64) -> String {
    let mut rng = Rng(seed);
    let mut out = String::new();
    write_ws(&mut rng, &mut out);
    write(doc, &mut rng, &mut out);
    write_ws(&mut rng, &mut out);
    out
}

/// The whole check for one valid body: the decision, the ids, the parsed
/// output and the bytes.
fn check_valid_body(input: &[u8], layout: SnowflakeLayout) -> Result<(), TestCaseError> {
    let parsed: Value = serde_json::from_slice(input).expect("the body is valid JSON");
    let expected_paths = oracle::paths_needing_ids(&parsed);

    let edits = find_edits(input).map_err(|e| TestCaseError::fail(format!("find_edits: {e}")))?;
    prop_assert_eq!(edits.len(), expected_paths.len(), "edits {:?}", edits);

    let mut source = FakeIds::new(layout);
    let decision = decide(&Config { layout }, false, input, &mut source)
        .map_err(|e| TestCaseError::fail(format!("plugin failure: {e}")))?;
    match decision {
        Decision::Forward => {
            prop_assert!(
                expected_paths.is_empty(),
                "needed ids at {:?}",
                expected_paths
            );
            prop_assert_eq!(source.machine_calls, 0);
        }
        Decision::ForwardWithBody { body: output, ids } => {
            prop_assert_eq!(ids.len(), expected_paths.len());
            prop_assert_eq!(
                ids.iter().collect::<HashSet<_>>().len(),
                ids.len(),
                "ids repeat"
            );
            prop_assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids not in body order");
            prop_assert_eq!(source.ticks.len(), ids.len(), "one clock reading an id");
            for (id, tick) in ids.iter().zip(&source.ticks) {
                let parts = layout.decode(*id).unwrap();
                prop_assert_eq!(parts.machine_id, MACHINE);
                prop_assert_eq!(parts.sequence, tick.sequence);
            }

            let out: Value = serde_json::from_slice(&output)
                .map_err(|e| TestCaseError::fail(format!("output is not JSON: {e}")))?;
            let mut expected = parsed.clone();
            let mut placed = Vec::new();
            let mut out_copy = out.clone();
            for path in &expected_paths {
                let got = oracle::at_path(&mut out_copy, path)["disagg_request_id"].as_u64();
                let Some(got) = got else {
                    return Err(TestCaseError::fail(format!("no id at {path:?}")));
                };
                placed.push(got);
                oracle::at_path(&mut expected, path)
                    .as_object_mut()
                    .unwrap()
                    .insert("disagg_request_id".to_string(), Value::from(got));
            }
            prop_assert_eq!(&out, &expected);
            placed.sort_unstable();
            let mut sorted = ids.clone();
            sorted.sort_unstable();
            prop_assert_eq!(placed, sorted);

            oracle::assert_only_ids_spliced_in(input, &output, &edits, &ids);
        }
        Decision::Reject(r) => {
            return Err(TestCaseError::fail(format!("rejected valid JSON: {r:?}")));
        }
    }
    Ok(())
}

/// Serde errors that come from lone surrogate escapes, which serde_json's
/// `String` refuses but JSON (and Python, and the walk) accepts.
fn is_surrogate_error(e: &serde_json::Error) -> bool {
    let message = e.to_string();
    message.contains("surrogate") || message.contains("end of hex escape")
}

const MUTATION_BYTES: &[u8] = b"{}[]\",:\\/ntrue0123456789.eE+-_ \t\n\x01\x7f\xc3\xa9\xff\xed";

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 384,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn stamps_exactly_the_effective_context_only_params(
        doc in document(),
        seed in any::<u64>(),
        v2 in any::<bool>(),
    ) {
        let body = render(&doc, seed);
        let layout = if v2 { SnowflakeLayout::TrtllmV2 } else { SnowflakeLayout::TrtllmV1 };
        check_valid_body(body.as_bytes(), layout)?;
    }

    #[test]
    fn agrees_with_serde_json_on_what_is_valid(
        doc in document(),
        seed in any::<u64>(),
        mutations in prop::collection::vec((any::<prop::sample::Index>(), 0..3u8, prop::sample::select(MUTATION_BYTES)), 1..4),
    ) {
        let mut body = render(&doc, seed).into_bytes();
        for (index, op, byte) in mutations {
            match op {
                0 if !body.is_empty() => {
                    body.remove(index.index(body.len()));
                }
                1 if !body.is_empty() => {
                    let at = index.index(body.len());
                    body[at] = byte;
                }
                _ => body.insert(index.index(body.len() + 1), byte),
            }
        }
        let ours = find_edits(&body);
        // Invalid UTF-8 anywhere is named as such, at its first bad byte,
        // whatever else is wrong with the body (the walk checks UTF-8
        // string by string, in the same pass).
        if let Err(bad) = std::str::from_utf8(&body) {
            prop_assert_eq!(&ours, &Err(BodyError::InvalidUtf8 { offset: bad.valid_up_to() }));
        }
        match serde_json::from_slice::<Value>(&body) {
            Ok(_) => {
                prop_assert!(ours.is_ok(), "serde_json accepts, we reject: {:?}", ours);
                check_valid_body(&body, SnowflakeLayout::TrtllmV1)?;
            }
            Err(e) if is_surrogate_error(&e) => {}
            Err(e) => {
                prop_assert!(ours.is_err(), "serde_json rejects ({}), we accept", e);
                let r = rejection(&body);
                prop_assert_eq!(r.status, 400);
            }
        }
    }

    #[test]
    fn never_panics_on_arbitrary_bytes(body in prop::collection::vec(any::<u8>(), 0..64)) {
        let mut ids = FakeIds::new(SnowflakeLayout::TrtllmV1);
        let decision = decide(&v1(), false, &body, &mut ids);
        prop_assert!(decision.is_ok());
        if serde_json::from_slice::<Value>(&body).is_ok() {
            check_valid_body(&body, SnowflakeLayout::TrtllmV1)?;
        }
    }
}
