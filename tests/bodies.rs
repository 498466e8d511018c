//! What the plugin in the host does to bodies: every byte but the id is
//! kept, bodies that need no id are forwarded untouched, and bodies it
//! cannot read are refused with a status and a message that names the
//! problem, after which the same plugin serves the next request.
//!
//! All tests share one engine and plugin (a load compiles the component);
//! the ids they see depend on the order tests run in, so the tests read
//! the ids out of the output and check them, rather than expect fixed ones.

mod common;

use std::sync::OnceLock;

use common::{json_request, match_template, reject, with_header, START_MILLIS};
use snowgate_host::{Action, Plugin};
use snowgate_plugin::{SnowflakeLayout, MAX_NESTING_DEPTH};

const MACHINE: u32 = 42;

fn plugin() -> &'static Plugin {
    static PLUGIN: OnceLock<Plugin> = OnceLock::new();
    PLUGIN.get_or_init(|| common::fixed_plugin(SnowflakeLayout::TrtllmV1, MACHINE, START_MILLIS))
}

/// Runs `input` through the plugin; the output must equal `template` with
/// each `{ID}` an id of this machine, and the ids must increase in order.
fn assert_stamped_as(input: &str, template: &str) {
    let out = common::stamp(plugin(), input);
    let ids = match_template(template, &out);
    assert!(!ids.is_empty());
    for &id in &ids {
        let parts = SnowflakeLayout::TrtllmV1
            .decode(id)
            .expect("a stamped id decodes");
        assert_eq!(parts.machine_id, MACHINE, "id {id}");
        assert!(parts.millis >= START_MILLIS, "id {id}");
    }
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
}

fn assert_forwarded(input: &[u8]) {
    let answer = plugin().handle(&json_request(input));
    assert!(
        matches!(answer, Ok(Action::Forward)),
        "{:?}: expected Forward, got {}",
        String::from_utf8_lossy(input),
        common::describe(&answer)
    );
}

/// After a refusal, the same plugin still stamps the next good request.
fn assert_next_request_works() {
    assert_stamped_as(
        common::CONTEXT_ONLY,
        r#"{"disaggregated_params":{"request_type":"context_only","disagg_request_id":{ID}}}"#,
    );
}

// ---------------------------------------------------------------------------
// Byte preservation
// ---------------------------------------------------------------------------

#[test]
fn odd_whitespace_is_kept_byte_for_byte() {
    assert_stamped_as(
        " \r\n\t{ \"prompt\" :\t\"hi\" ,\n  \"disaggregated_params\" : {\r\n \"request_type\" : \"context_only\"\n\t}\n}\n\t ",
        " \r\n\t{ \"prompt\" :\t\"hi\" ,\n  \"disaggregated_params\" : {\r\n \"request_type\" : \"context_only\",\"disagg_request_id\":{ID}\n\t}\n}\n\t ",
    );
    // Newlines around the colon, spaces before the closing braces: the id
    // goes right after the last value, before the whitespace.
    assert_stamped_as(
        "[ {\"disaggregated_params\":{ \"request_type\"\n:\n\"context_only\" } } ]",
        "[ {\"disaggregated_params\":{ \"request_type\"\n:\n\"context_only\",\"disagg_request_id\":{ID} } } ]",
    );
}

#[test]
fn escapes_and_raw_unicode_are_kept_byte_for_byte() {
    // Escaped keys and values still name the params (they match after
    // unescaping, as Python's json reads them), and are not rewritten.
    assert_stamped_as(
        r#"{"pr\u006fmpt":"a\"b\\c\/d\n\u00e9\ud83d\ude00 h\u00e9llo 😀 ñ","disaggregated_para\u006ds":{"request_typ\u0065":"context\u005Fonly","tag":"\t\\"}}"#,
        r#"{"pr\u006fmpt":"a\"b\\c\/d\n\u00e9\ud83d\ude00 h\u00e9llo 😀 ñ","disaggregated_para\u006ds":{"request_typ\u0065":"context\u005Fonly","tag":"\t\\","disagg_request_id":{ID}}}"#,
    );
    // TensorRT-LLM lower-cases the request type before checking it.
    assert_stamped_as(
        r#"{"disaggregated_params":{"request_type":"CONTEXT_ONLY"}}"#,
        r#"{"disaggregated_params":{"request_type":"CONTEXT_ONLY","disagg_request_id":{ID}}}"#,
    );
}

#[test]
fn huge_and_odd_numbers_are_kept_byte_for_byte() {
    assert_stamped_as(
        r#"{"a":123456789012345678901234567890,"b":1E400,"c":-0.0,"d":[1.5e-300,0,-1E+2,18446744073709551616],"disaggregated_params":{"request_type":"context_only","seed":-0.0,"big":123456789012345678901234567890}}"#,
        r#"{"a":123456789012345678901234567890,"b":1E400,"c":-0.0,"d":[1.5e-300,0,-1E+2,18446744073709551616],"disaggregated_params":{"request_type":"context_only","seed":-0.0,"big":123456789012345678901234567890,"disagg_request_id":{ID}}}"#,
    );
}

#[test]
fn a_null_id_is_replaced_in_place() {
    assert_stamped_as(
        r#"{"disaggregated_params":{"disagg_request_id" : null ,"request_type":"context_only","x":1E400}}"#,
        r#"{"disaggregated_params":{"disagg_request_id" : {ID} ,"request_type":"context_only","x":1E400}}"#,
    );
}

#[test]
fn only_the_effective_member_of_duplicate_keys_counts() {
    // The last `disaggregated_params` wins: only it is stamped.
    assert_stamped_as(
        r#"{"disaggregated_params":{"request_type":"context_only"},"disaggregated_params":{"request_type":"context_only","n":1}}"#,
        r#"{"disaggregated_params":{"request_type":"context_only"},"disaggregated_params":{"request_type":"context_only","n":1,"disagg_request_id":{ID}}}"#,
    );
    // The last `request_type` wins.
    assert_stamped_as(
        r#"{"disaggregated_params":{"request_type":"generation_only","request_type":"context_only"}}"#,
        r#"{"disaggregated_params":{"request_type":"generation_only","request_type":"context_only","disagg_request_id":{ID}}}"#,
    );
    assert_forwarded(
        br#"{"disaggregated_params":{"request_type":"context_only","request_type":"generation_only"}}"#,
    );
    // The last id wins: a set id followed by null is filled at the null.
    assert_stamped_as(
        r#"{"disaggregated_params":{"request_type":"context_only","disagg_request_id":5,"disagg_request_id":null}}"#,
        r#"{"disaggregated_params":{"request_type":"context_only","disagg_request_id":5,"disagg_request_id":{ID}}}"#,
    );
    assert_forwarded(
        br#"{"disaggregated_params":{"request_type":"context_only","disagg_request_id":null,"disagg_request_id":5}}"#,
    );
}

#[test]
fn json_inside_strings_is_left_alone() {
    let looks_like_params = r#"{\"disaggregated_params\":{\"request_type\":\"context_only\"}}"#;
    assert_stamped_as(
        &format!(
            r#"{{"prompt":"{looks_like_params}","disaggregated_params":{{"request_type":"context_only"}},"note":"}}]\"disagg_request_id\":null"}}"#
        ),
        &format!(
            r#"{{"prompt":"{looks_like_params}","disaggregated_params":{{"request_type":"context_only","disagg_request_id":{{ID}}}},"note":"}}]\"disagg_request_id\":null"}}"#
        ),
    );
    assert_forwarded(format!(r#"{{"prompt":"{looks_like_params}"}}"#).as_bytes());
}

/// The walk skips plain string content 16 bytes at a time, with SIMD that
/// differs between wasm and the native core, and the guest's words are
/// 32-bit: its build is held to the native core here. A quote, a
/// backslash, a control byte, a non-ASCII character or an invalid UTF-8
/// byte at every position of five 16-byte blocks of a string gets the
/// native core's answer, stamped or refused, from the plugin in the host.
#[test]
fn special_bytes_anywhere_in_a_long_string_are_read_as_the_native_core_reads_them() {
    // Each piece, and the code it is refused with (`None`: it is fine
    // JSON in a string, and the body is stamped). 0x7f is an ordinary
    // byte to JSON.
    let pieces: [(&[u8], Option<&str>); 9] = [
        (br#"\""#, None),
        (br"\\", None),
        (br"\u0022", None),
        ("é".as_bytes(), None),
        (b"\"", Some("invalid_json")),
        (b"\x01", Some("invalid_json")),
        (b"\x1f", Some("invalid_json")),
        (b"\x7f", None),
        (b"\xff", Some("invalid_utf8")),
    ];
    // Offsets over five 16-byte blocks: the plugin's scan reads blocks.
    const AT: usize = 80;
    for (piece, refused_with) in pieces {
        for at in 0..AT {
            let mut content = vec![b'a'; 96];
            content.splice(at..at, piece.iter().copied());
            let body = [
                &br#"{"messages":[{"content":""#[..],
                &content,
                br#""}],"disaggregated_params":{"request_type":"context_only"}}"#,
            ]
            .concat();
            let answer = plugin().handle(&json_request(body.clone()));
            let case = format!("{:?} at {at}", String::from_utf8_lossy(piece));
            match (snowgate_plugin::find_edits(&body), &answer) {
                (Ok(edits), Ok(Action::ForwardWithBody(out))) => {
                    assert_eq!(refused_with, None, "{case}: stamped");
                    let ids = common::ids_in(out);
                    assert_eq!(ids.len(), edits.len(), "{case}");
                    let expected = snowgate_plugin::stamp::apply(&body, &edits, &ids);
                    assert!(*out == expected, "{case}: {}", common::describe(&answer));
                }
                (Err(native), Ok(Action::Reject(rejection))) => {
                    assert_eq!(Some(rejection.code.as_str()), refused_with, "{case}");
                    assert_eq!(
                        (rejection.status, rejection.code.as_str()),
                        (400, native.code()),
                        "{case}: {}",
                        rejection.message
                    );
                    assert!(
                        rejection.message.contains(&native.to_string()),
                        "{case}: {:?} does not say {native}",
                        rejection.message
                    );
                }
                (native, _) => panic!(
                    "{case}: native {native:?}, plugin {}",
                    common::describe(&answer)
                ),
            }
        }
    }
}

#[test]
fn several_requests_in_one_body_each_get_an_id_in_body_order() {
    assert_stamped_as(
        r#"[{"disaggregated_params":{}},{"disaggregated_params":{"request_type":"context_only"}},{"disaggregated_params":{"request_type":"generation_only","disagg_request_id":9}},{"disaggregated_params":{"request_type":"context_only","disagg_request_id":null}},{"disaggregated_params":{"request_type":"context_only"}}]"#,
        r#"[{"disaggregated_params":{}},{"disaggregated_params":{"request_type":"context_only","disagg_request_id":{ID}}},{"disaggregated_params":{"request_type":"generation_only","disagg_request_id":9}},{"disaggregated_params":{"request_type":"context_only","disagg_request_id":{ID}}},{"disaggregated_params":{"request_type":"context_only","disagg_request_id":{ID}}}]"#,
    );
}

#[test]
fn bodies_that_need_no_id_are_forwarded_untouched() {
    for body in [
        &br#"{"model":"m","prompt":"Hello","max_tokens":16}"#[..],
        br#"{"disaggregated_params":{"request_type":"generation_only","disagg_request_id":1099511628800}}"#,
        br#"{"disaggregated_params":{"request_type":"generation_only"}}"#,
        br#"{"disaggregated_params":{"request_type":"context_and_generation"}}"#,
        br#"{"disaggregated_params":{"request_type":"context_only","disagg_request_id":1099511628800,"schedule_style":0}}"#,
        br#"{"disaggregated_params":{"request_type":"context_only","disagg_request_id":0}}"#,
        br#"{"disaggregated_params":null}"#,
        br#"{"disaggregated_params":{"request_type":null}}"#,
        br#"{"disaggregated_params":{}}"#,
        b"[]",
        b" 17 ",
        br#""context_only""#,
    ] {
        assert_forwarded(body);
    }
}

// ---------------------------------------------------------------------------
// Bad input
// ---------------------------------------------------------------------------

/// Checks a refusal: status, code, and words the message must contain.
fn assert_rejected(body: &[u8], status: u16, code: &str, words: &[&str]) {
    let rejection = reject(plugin(), &json_request(body));
    assert_eq!(
        (rejection.status, rejection.code.as_str()),
        (status, code),
        "{rejection:?}"
    );
    for word in words {
        assert!(
            rejection.message.contains(word),
            "message {:?} does not mention {word:?}",
            rejection.message
        );
    }
    assert_next_request_works();
}

#[test]
fn invalid_json_is_rejected_with_400_naming_the_problem() {
    assert_rejected(
        br#"{"disaggregated_params":{"request_type":"context_only"}"#,
        400,
        "invalid_json",
        &["not valid JSON", "ends inside an object"],
    );
    assert_rejected(
        b"{\"prompt\":\"hi\",\n \"max_tokens\": 01}",
        400,
        "invalid_json",
        &["not valid JSON", "leading zero", "line 2"],
    );
    assert_rejected(
        br#"{"a":1} {"b":2}"#,
        400,
        "invalid_json",
        &["after the JSON value"],
    );
    assert_rejected(
        br#"{"a":[1,2,],"disaggregated_params":{"request_type":"context_only"}}"#,
        400,
        "invalid_json",
        &["not valid JSON"],
    );
    assert_rejected(b"\xEF\xBB\xBF{}", 400, "invalid_json", &["byte order mark"]);
    // UTF-16 and UTF-32 without a byte order mark, as Python would detect
    // them: the message names the encoding, not a grammar error.
    for body in [
        &b"{\x00}\x00"[..],
        b"7\x00",
        b"\x00{",
        b"{\x00\x00\x00}\x00\x00\x00",
    ] {
        assert_rejected(
            body,
            400,
            "invalid_json",
            &["UTF-16 or UTF-32", "must be UTF-8"],
        );
    }
}

#[test]
fn invalid_utf8_is_rejected_with_400_naming_the_offset() {
    assert_rejected(
        b"{\"prompt\":\"caf\xE9\",\"disaggregated_params\":{\"request_type\":\"context_only\"}}",
        400,
        "invalid_utf8",
        &["UTF-8", "offset 14"],
    );
}

#[test]
fn nesting_deeper_than_the_limit_is_rejected_with_400() {
    // Arrays around one request: the request object sits at `depth` and
    // its params object one level deeper.
    let nested = |depth: usize, params: &str| {
        format!(
            r#"{}{{"disaggregated_params":{params}}}{}"#,
            "[".repeat(depth - 1),
            "]".repeat(depth - 1)
        )
    };
    let params = r#"{"request_type":"context_only"}"#;
    let stamped = r#"{"request_type":"context_only","disagg_request_id":{ID}}"#;
    // Exactly at the limit: the params object is level MAX_NESTING_DEPTH.
    assert_stamped_as(
        &nested(MAX_NESTING_DEPTH - 1, params),
        &nested(MAX_NESTING_DEPTH - 1, stamped),
    );
    // Objects to the limit as well: each level is a call of the walk's
    // object reader, whose frame is larger than an array's.
    let in_objects = |params: &str| {
        format!(
            r#"{}{{"disaggregated_params":{params}}}{}"#,
            r#"{"a":"#.repeat(MAX_NESTING_DEPTH - 2),
            "}".repeat(MAX_NESTING_DEPTH - 2)
        )
    };
    assert_stamped_as(&in_objects(params), &in_objects(stamped));
    // One level more is refused.
    assert_rejected(
        nested(MAX_NESTING_DEPTH, params).as_bytes(),
        400,
        "nesting_too_deep",
        &[&MAX_NESTING_DEPTH.to_string(), "deeper"],
    );

    let too_deep = format!(
        "{}{}",
        "[".repeat(MAX_NESTING_DEPTH + 1),
        "]".repeat(MAX_NESTING_DEPTH + 1)
    );
    assert_rejected(
        too_deep.as_bytes(),
        400,
        "nesting_too_deep",
        &[&MAX_NESTING_DEPTH.to_string(), "deeper"],
    );
    // Deep enough to overflow a naive recursive parser's stack.
    let very_deep = "[".repeat(1_000_000);
    assert_rejected(very_deep.as_bytes(), 400, "nesting_too_deep", &["deeper"]);
}

#[test]
fn an_empty_body_is_rejected_with_400() {
    for body in [&b""[..], b" \r\n\t "] {
        assert_rejected(body, 400, "empty_body", &["empty"]);
    }
}

/// A context-only MessagePack request (TensorRT-LLM's orchestrator with
/// `TRTLLM_SERVE_ENABLE_MSGSPEC=1`): `{"prompt": "hi",
/// "disaggregated_params": {"request_type": "context_only"}}`.
fn msgpack_context_only() -> Vec<u8> {
    let mut body = vec![0x82, 0xa6];
    body.extend_from_slice(b"prompt");
    body.extend_from_slice(&[0xa2, b'h', b'i', 0xb4]);
    body.extend_from_slice(b"disaggregated_params");
    body.extend_from_slice(&[0x81, 0xac]);
    body.extend_from_slice(b"request_type");
    body.push(0xac);
    body.extend_from_slice(b"context_only");
    body
}

#[test]
fn a_messagepack_body_is_stamped_in_messagepack() {
    let body = msgpack_context_only();
    let request = with_header(json_request(body.clone()), "x-trtllm-msgpack", b" 1 ");
    let Ok(Action::ForwardWithBody(out)) = plugin().handle(&request) else {
        panic!("expected a stamped body");
    };
    // The params map counts one pair more, and ends with
    // `"disagg_request_id": <uint 64>`; no other byte changes.
    let header = body.len() - 1 - 12 - 1 - 12 - 1;
    assert_eq!(out[..header], body[..header]);
    assert_eq!(out[header], 0x82);
    assert_eq!(out[header + 1..body.len()], body[header + 1..]);
    let pair = &out[body.len()..];
    assert_eq!(pair[..18], *b"\xb1disagg_request_id");
    assert_eq!(pair[18], 0xcf);
    let id = u64::from_be_bytes(pair[19..].try_into().expect("8 bytes"));
    let parts = SnowflakeLayout::TrtllmV1.decode(id).expect("a v1 id");
    assert_eq!(parts.machine_id, MACHINE);
    assert!(parts.millis >= START_MILLIS, "{parts:?}");
    assert_next_request_works();

    // Bad MessagePack is refused by name.
    let request = with_header(
        json_request(&body[..body.len() - 1]),
        "x-trtllm-msgpack",
        b"1",
    );
    let rejection = reject(plugin(), &request);
    assert_eq!(
        (rejection.status, rejection.code.as_str()),
        (400, "invalid_msgpack"),
        "{rejection:?}"
    );
    assert!(
        rejection.message.contains("not valid MessagePack"),
        "{:?}",
        rejection.message
    );

    // An ext 32 declaring 4 GiB - 1 bytes, before a context-only map: in
    // the 32-bit guest `1 + len` wrapped to 0, so the map was read and
    // stamped, into a body msgspec refuses.
    // body[11..] is `"disaggregated_params": {...}`; 0x81 makes it a map.
    let request = with_header(
        json_request([&b"\x92\xc9\xff\xff\xff\xff\x81"[..], &body[11..]].concat()),
        "x-trtllm-msgpack",
        b"1",
    );
    let rejection = reject(plugin(), &request);
    assert_eq!(
        (rejection.status, rejection.code.as_str()),
        (400, "invalid_msgpack"),
        "{rejection:?}"
    );
    assert!(
        rejection.message.contains("ends inside"),
        "{:?}",
        rejection.message
    );

    // A header that is present but not `1` is not MessagePack: the body is
    // stamped as JSON.
    let request = with_header(json_request(common::CONTEXT_ONLY), "x-trtllm-msgpack", b"0");
    match plugin().handle(&request) {
        Ok(Action::ForwardWithBody(out)) => assert_eq!(common::ids_in(&out).len(), 1),
        other => panic!("expected a stamped body, got {}", common::describe(&other)),
    }
}
