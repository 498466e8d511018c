//! The `request-headers` import: a plugin reads the headers of the request
//! it is handling, and only those, on a fresh instance (`Plugin::handle`)
//! and on a reused one (`Plugin::handle_async`); `configure` sees none.
//!
//! The hostile fixture's `headers` behaviour answers with what the import
//! gave it: every entry, the values of the header named in
//! `x-hostile-get`, and what `configure` saw.

mod common;

use common::{describe, engine_with, json_request, with_header, CONTEXT_ONLY, START_MILLIS};
use snowgate_host::{Action, FixedClock, Plugin, PluginLimits, Request};
use snowgate_plugin::SnowflakeLayout;
use snowgate_test_fixtures::HOSTILE_WASM;

fn hostile() -> Plugin {
    let engine = engine_with(
        SnowflakeLayout::TrtllmV1,
        5,
        FixedClock(START_MILLIS),
        PluginLimits::default(),
    );
    Plugin::load(&engine, HOSTILE_WASM, &[])
        .unwrap_or_else(|e| panic!("loading the hostile fixture: {e:#}"))
}

/// A context-only request whose plugin call reports its headers, with
/// `extra` added after `x-hostile: headers`.
fn reporting(extra: &[(&str, &str)]) -> Request {
    let mut request = with_header(json_request(CONTEXT_ONLY), "x-hostile", b"headers");
    for (name, value) in extra {
        request = with_header(request, name, value.as_bytes());
    }
    request
}

fn report(answer: Result<Action, snowgate_host::CallError>) -> String {
    match answer {
        Ok(Action::ForwardWithBody(body)) => String::from_utf8(body).expect("a UTF-8 report"),
        other => panic!("expected a report, got {}", describe(&other)),
    }
}

#[test]
fn a_plugin_reads_every_header_and_the_values_of_one_by_name_ignoring_case() {
    let request = reporting(&[
        ("accept", "text/a"),
        ("x-hostile-get", "ACCEPT"),
        ("accept", "text/b"),
    ]);
    assert_eq!(
        report(hostile().handle(&request)),
        "entries=[(\"content-type\", \"application/json\"), (\"x-hostile\", \"headers\"), \
         (\"accept\", \"text/a\"), (\"x-hostile-get\", \"ACCEPT\"), (\"accept\", \"text/b\")]\n\
         get=[\"text/a\", \"text/b\"]\n\
         configure-entries=0\n\
         configure-get=0"
    );
}

#[test]
fn a_header_the_request_lacks_has_no_values() {
    let request = reporting(&[("x-hostile-get", "authorization")]);
    let report = report(hostile().handle(&request));
    assert!(report.contains("\nget=[]\n"), "{report}");
}

/// A reused instance reads each request's own headers: nothing of the
/// request before, and `configure` (run once, for the first) saw none.
/// The call gives the headers back when it ends: a map lent to it comes
/// back itself, not a copy.
#[test]
fn a_reused_instance_reads_the_headers_of_the_request_it_handles() {
    let plugin = hostile();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime");
    let first = reporting(&[("x-hostile-get", "x-only-first"), ("x-only-first", "1")]);
    let count = with_header(json_request(CONTEXT_ONLY), "x-hostile", b"count");
    let mut second = reporting(&[("x-hostile-get", "x-only-first"), ("x-only-second", "2")]);
    let map = second.headers.clone().into_map();
    let lent_at = map.get("x-only-second").map(std::ptr::from_ref);
    second.headers = map.into();
    let (a, handled, b) = runtime.block_on(async {
        let a = report(plugin.handle_async(&first).await);
        let handled = match plugin.handle_async(&count).await {
            Ok(Action::Reject(r)) if r.status == 418 => r.message,
            other => panic!("expected a count, got {}", describe(&other)),
        };
        let b = report(plugin.handle_async(&second).await);
        (a, handled, b)
    });
    assert_eq!(handled, "2", "one instance served all three");
    let back = second.headers.into_map();
    assert_eq!(
        back.get("x-only-second").map(std::ptr::from_ref),
        lent_at,
        "the call kept a share of the headers"
    );
    assert!(a.contains("(\"x-only-first\", \"1\")"), "{a}");
    assert!(a.contains("\nget=[\"1\"]\n"), "{a}");
    assert!(b.contains("(\"x-only-second\", \"2\")"), "{b}");
    assert!(!b.contains("x-only-first\", \"1"), "{b}");
    assert!(b.contains("\nget=[]\n"), "{b}");
    assert!(b.ends_with("configure-entries=0\nconfigure-get=0"), "{b}");
}
