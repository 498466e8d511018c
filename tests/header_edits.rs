//! The `header-edits` import (contract 0.2.1): a plugin changes the headers
//! of the request it forwards, with a real component (the hostile test
//! fixture's `edit-headers`; the bundled plugin edits no header) in the
//! real host; the host refuses, naming why, what a
//! plugin may not set; and a plugin built for 0.2.0, before the import,
//! still loads and stamps.

mod common;

use common::{describe, engine_with, json_request, with_header, CONTEXT_ONLY, START_MILLIS};
use http::HeaderMap;
use snowgate_host::{Action, Answer, CallError, FixedClock, Plugin, PluginLimits, Request};
use snowgate_plugin::SnowflakeLayout;
use snowgate_test_fixtures::HOSTILE_WASM;

fn engine() -> snowgate_host::PluginEngine {
    engine_with(
        SnowflakeLayout::TrtllmV1,
        5,
        FixedClock(START_MILLIS),
        PluginLimits::default(),
    )
}

fn hostile() -> Plugin {
    Plugin::load(&engine(), HOSTILE_WASM, &[])
        .unwrap_or_else(|e| panic!("loading the hostile fixture: {e:#}"))
}

/// A context-only request whose plugin makes the changes `edits` lists,
/// then answers as `then` says (`None`: stamps).
fn editing(edits: &str, then: Option<&str>) -> Request {
    let mut request = with_header(json_request(CONTEXT_ONLY), "x-hostile", b"edit-headers");
    request = with_header(request, "x-tenant", b"t1");
    request = with_header(request, "x-hostile-edits", edits.as_bytes());
    if let Some(then) = then {
        request = with_header(request, "x-hostile-then", then.as_bytes());
    }
    request
}

fn answer(plugin: &Plugin, request: &Request) -> Result<Answer, CallError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
        .block_on(plugin.answer_async(request))
}

/// The request's headers after the answer's changes, as `name: value`
/// lines sorted by name (a `HeaderMap` keeps the order of one name's
/// values, not of names).
fn edited(request: &Request, answer: Answer) -> Vec<String> {
    let mut headers: HeaderMap = request.headers.clone().into_map();
    answer.header_edits.apply(&mut headers);
    let mut lines: Vec<String> = headers
        .iter()
        .map(|(name, value)| format!("{name}: {}", String::from_utf8_lossy(value.as_bytes())))
        .collect();
    lines.sort_by(|a, b| a.split(':').next().cmp(&b.split(':').next()));
    lines
}

#[test]
fn a_plugin_sets_appends_and_removes_headers_of_the_request_it_forwards() {
    let plugin = hostile();
    let request = editing(
        "set X-Disagg-Request-Id 42, append accept text%2Fa, append accept text%2Fb, \
         remove x-tenant, set x-hostile-edits done",
        None,
    );
    let answer = answer(&plugin, &request).expect("answers");
    assert!(
        matches!(&answer.action, Action::ForwardWithBody(body) if body.windows(17).any(|w| w == b"disagg_request_id")),
        "stamped as usual: {:?}",
        answer.action
    );
    assert_eq!(answer.header_edits.iter().count(), 5);
    assert_eq!(
        edited(&request, answer),
        [
            "accept: text/a",
            "accept: text/b",
            "content-type: application/json",
            "x-disagg-request-id: 42",
            "x-hostile: edit-headers",
            "x-hostile-edits: done",
        ]
    );
}

#[test]
fn a_forward_carries_the_changes_and_a_reject_drops_them() {
    let plugin = hostile();
    let forward = answer(&plugin, &editing("set x-routed yes", Some("forward"))).expect("answers");
    assert!(
        matches!(forward.action, Action::Forward),
        "{:?}",
        forward.action
    );
    assert_eq!(forward.header_edits.iter().count(), 1);

    let rejected = answer(&plugin, &editing("set x-routed yes", Some("reject"))).expect("answers");
    assert!(
        matches!(&rejected.action, Action::Reject(r) if r.status == 418),
        "{:?}",
        rejected.action
    );
    assert!(
        rejected.header_edits.is_empty(),
        "a rejected request is not sent"
    );
}

/// A reused instance starts each call with no changes: those of the
/// request before do not carry over.
#[test]
fn changes_belong_to_one_call() {
    let plugin = hostile();
    let first = answer(&plugin, &editing("set x-first 1", None)).expect("answers");
    assert_eq!(first.header_edits.iter().count(), 1);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        plugin
            .answer_async(&editing("set x-first 1", None))
            .await
            .expect("answers");
        let plain = plugin
            .answer_async(&json_request(CONTEXT_ONLY))
            .await
            .expect("answers");
        assert!(plain.header_edits.is_empty(), "{:?}", plain.header_edits);
    });
}

/// What the host refuses, and the reason the plugin is given.
#[test]
fn the_host_refuses_what_a_plugin_may_not_set_naming_why() {
    let plugin = hostile();
    let refused = |edits: &str| -> String {
        match answer(&plugin, &editing(edits, None)) {
            Ok(Answer {
                action: Action::Reject(r),
                header_edits,
                ..
            }) if r.status == 422 && r.code == "edit_refused" => {
                assert!(header_edits.is_empty());
                r.message
            }
            other => panic!(
                "{edits}: expected a refusal, got {}",
                describe(&other.map(|a| a.action))
            ),
        }
    };
    for managed in [
        "set host upstream.example",
        "set Content-Length 5",
        "remove transfer-encoding",
        "append connection close",
        "set upgrade websocket",
        "set expect 100-continue",
        "set x-forwarded-for 203.0.113.7",
        "remove X-Forwarded-For",
    ] {
        let reason = refused(managed);
        assert!(
            reason.contains("is the host's to set, not a plugin's"),
            "{managed}: {reason}"
        );
    }
    let reason = refused("set bad%20name 1");
    assert_eq!(
        reason,
        "\"bad name\" is not an HTTP header name (letters, digits and !#$%&'*+-.^_`|~ only)"
    );
    // Header injection: a value with a line break would start a header of
    // its own upstream.
    let reason = refused("set x-a ok%0D%0AInjected:%201");
    assert!(
        reason.contains("holds a carriage return, a line feed"),
        "{reason}"
    );
    let reason = refused(&format!("set x-long {}", "v".repeat(8193)));
    assert!(
        reason.contains("8193 bytes long, over the 8192 byte limit"),
        "{reason}"
    );
    let many = vec!["append x-n 1"; 65].join(",");
    let reason = refused(&many);
    assert_eq!(reason, "more than 64 header changes in one call");
    // Within the limits, the same plugin's changes go through.
    let fine =
        answer(&plugin, &editing(&vec!["append x-n 1"; 64].join(","), None)).expect("answers");
    assert_eq!(fine.header_edits.iter().count(), 64);
}

/// The bundled plugin relabelled as built for 0.2.0 (every
/// `snowgate:middleware/...@0.2.1` name it imports or exports renamed):
/// the 0.2.1 host loads it, and it stamps.
#[test]
fn a_plugin_built_for_0_2_0_loads_and_stamps() {
    let mut bytes = snowgate_plugin_bundle::PLUGIN_WASM.to_vec();
    let prefix = b"snowgate:middleware/";
    let mut relabelled = 0;
    let mut at = 0;
    while let Some(found) = bytes[at..].windows(prefix.len()).position(|w| w == prefix) {
        let start = at + found;
        let name_end = start
            + bytes[start..]
                .iter()
                .position(|&b| !(b.is_ascii_alphanumeric() || b"-:/@.".contains(&b)))
                .unwrap_or(bytes.len() - start);
        if bytes[start..name_end].ends_with(b"@0.2.1") {
            bytes[name_end - 6..name_end].copy_from_slice(b"@0.2.0");
            relabelled += 1;
        }
        at = name_end;
    }
    assert!(
        relabelled >= 4,
        "the plugin names its interfaces: {relabelled}"
    );
    let plugin = Plugin::load(&engine(), &bytes, &[])
        .unwrap_or_else(|e| panic!("a 0.2.0 plugin on a 0.2.1 host: {e:#}"));
    match plugin.handle(&json_request(CONTEXT_ONLY)) {
        Ok(Action::ForwardWithBody(body)) => assert!(
            common::ids_in(&body).len() == 1,
            "{}",
            String::from_utf8_lossy(&body)
        ),
        other => panic!("expected a stamp, got {}", describe(&other)),
    }
}
