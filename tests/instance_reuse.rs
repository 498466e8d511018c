//! Instance reuse in the gateway's call path (`Plugin::handle_async`): an
//! instance serves up to `calls_per_instance` requests, one at a time; one
//! whose call failed is never called again; a runaway call does not hold up
//! other calls on its thread; and the bundled plugin answers exactly as a
//! fresh instance would, so reuse changes no byte and no id.
//!
//! The hostile fixture's `count` behaviour reports how many requests its
//! instance has handled, which makes reuse visible.

mod common;

use std::time::Duration;

use common::{
    describe, engine_with, json_request, load_bundled, with_header, CONTEXT_ONLY, START_MILLIS,
};
use proptest::prelude::*;
use snowgate_host::{Action, CallError, FixedClock, Plugin, PluginLimits, Request};
use snowgate_plugin::SnowflakeLayout;
use snowgate_test_fixtures::HOSTILE_WASM;

fn hostile(limits: PluginLimits) -> Plugin {
    let engine = engine_with(
        SnowflakeLayout::TrtllmV1,
        5,
        FixedClock(START_MILLIS),
        limits,
    );
    Plugin::load(&engine, HOSTILE_WASM, &[])
        .unwrap_or_else(|e| panic!("loading the hostile fixture: {e:#}"))
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime")
}

fn behaving(behaviour: &str) -> Request {
    with_header(
        json_request(CONTEXT_ONLY),
        "x-hostile",
        behaviour.as_bytes(),
    )
}

/// How many requests the instance that served this one has handled.
async fn count(plugin: &Plugin) -> u32 {
    match plugin.handle_async(&behaving("count")).await {
        Ok(Action::Reject(r)) if r.status == 418 => r.message.parse().expect("a count"),
        other => panic!("expected a count, got {}", describe(&other)),
    }
}

/// The counts `n` requests in a row report, with `calls_per_instance`.
fn counts(calls_per_instance: u32, n: usize) -> Vec<u32> {
    let plugin = hostile(PluginLimits {
        calls_per_instance,
        ..PluginLimits::default()
    });
    runtime().block_on(async {
        let mut counts = Vec::new();
        for _ in 0..n {
            counts.push(count(&plugin).await);
        }
        counts
    })
}

#[test]
fn an_instance_serves_its_share_of_requests_then_a_fresh_one_takes_over() {
    assert_eq!(counts(3, 8), [1, 2, 3, 1, 2, 3, 1, 2]);
}

/// A plugin whose runtime starts large (here 8 MiB more than the fixture
/// needs, as CPython or a JavaScript engine does) is reused all the same:
/// only growth after `configure` counts against reuse.
#[test]
fn an_instance_that_starts_large_is_reused() {
    let engine = engine_with(
        SnowflakeLayout::TrtllmV1,
        5,
        FixedClock(START_MILLIS),
        PluginLimits::default(),
    );
    let settings = [("hostile-configure".to_string(), "ballast".to_string())];
    let plugin = Plugin::load(&engine, HOSTILE_WASM, &settings)
        .unwrap_or_else(|e| panic!("loading the hostile fixture: {e:#}"));
    let counts = runtime().block_on(async {
        let mut counts = Vec::new();
        for _ in 0..4 {
            counts.push(count(&plugin).await);
        }
        counts
    });
    assert_eq!(counts, [1, 2, 3, 4]);
}

#[test]
fn one_call_per_instance_gives_every_request_a_fresh_instance() {
    assert_eq!(counts(1, 5), [1; 5]);
}

#[test]
fn an_instance_whose_call_failed_is_never_called_again() {
    let plugin = hostile(PluginLimits {
        deadline: Duration::from_millis(300),
        memory_bytes: 32 << 20,
        max_output_body_bytes: 1 << 20,
        ..PluginLimits::default()
    });
    runtime().block_on(async {
        for (behaviour, kind) in [
            ("trap", "trap"),
            ("panic", "trap"),
            ("loop", "deadline"),
            ("memory-bomb", "memory_limit"),
            ("huge-body", "memory_limit"),
        ] {
            let first = count(&plugin).await;
            assert_eq!(count(&plugin).await, first + 1, "before {behaviour}");
            match plugin.handle_async(&behaving(behaviour)).await {
                Err(e) => assert_eq!(e.kind(), kind, "{behaviour}: {e}"),
                other => panic!("{behaviour}: expected an error, got {}", describe(&other)),
            }
            // The instance that was counting served the failed call and was
            // dropped with it: the next request gets a fresh one.
            assert_eq!(count(&plugin).await, 1, "after {behaviour}");
        }
    });
}

#[test]
fn an_answer_over_the_limit_drops_the_instance_too() {
    let plugin = hostile(PluginLimits {
        max_output_body_bytes: 1 << 20,
        // Building the 100 MiB answer must finish, even on a busy machine.
        deadline: Duration::from_secs(30),
        ..PluginLimits::default()
    });
    runtime().block_on(async {
        assert_eq!(count(&plugin).await, 1);
        match plugin.handle_async(&behaving("huge-body")).await {
            Err(CallError::InvalidAnswer(detail)) => assert!(detail.contains("over"), "{detail}"),
            other => panic!("expected InvalidAnswer, got {}", describe(&other)),
        }
        assert_eq!(count(&plugin).await, 1);
    });
}

#[test]
fn rejections_are_normal_answers_and_keep_the_instance() {
    let plugin = hostile(PluginLimits::default());
    runtime().block_on(async {
        assert_eq!(count(&plugin).await, 1);
        match plugin.handle_async(&json_request("{not json")).await {
            Ok(Action::Reject(r)) => assert_eq!(r.status, 400),
            other => panic!("expected a 400 rejection, got {}", describe(&other)),
        }
        assert_eq!(count(&plugin).await, 3);
    });
}

#[test]
fn a_runaway_call_does_not_hold_up_other_calls_on_its_thread() {
    let plugin = hostile(PluginLimits {
        deadline: Duration::from_secs(5),
        ..PluginLimits::default()
    });
    runtime().block_on(async {
        let loop_request = behaving("loop");
        let looping = plugin.handle_async(&loop_request);
        tokio::pin!(looping);
        let others = async {
            for _ in 0..50 {
                match plugin.handle_async(&json_request(CONTEXT_ONLY)).await {
                    Ok(Action::ForwardWithBody(_)) => {}
                    other => panic!("expected a stamp, got {}", describe(&other)),
                }
            }
        };
        // The loop is polled first. Only if it gives the thread back while
        // it runs can the 50 other calls finish before it does.
        tokio::select! {
            biased;
            answer = &mut looping => panic!(
                "the looping call held the thread until it ended: {}",
                describe(&answer)
            ),
            () = others => {}
        }
        match looping.await {
            Err(CallError::Deadline(limit)) => assert_eq!(limit, Duration::from_secs(5)),
            other => panic!("expected the deadline, got {}", describe(&other)),
        }
    });
}

/// Bodies that take every branch of the bundled plugin: stamps, batches,
/// nested params, kept ids, each kind of rejection, and bodies left alone.
fn varied_bodies() -> Vec<Request> {
    let mut requests: Vec<Request> = [
        CONTEXT_ONLY,
        r#"{"disaggregated_params":{"request_type":"generation_only","disagg_request_id":7}}"#,
        r#"[{"disaggregated_params":{"request_type":"context_only"}},{"disaggregated_params":{"request_type":"CONTEXT_ONLY","disagg_request_id":null}}]"#,
        r#"{"a":{"b":[{"disaggregated_params":{"request_type":"context_only"}}]},"prompt":"x"}"#,
        r#"{"disaggregated_params":{"request_type":"context_only","disagg_request_id":42}}"#,
        r#"{"prompt":"{\"disaggregated_params\":{\"request_type\":\"context_only\"}}"}"#,
        r#"{"disaggregated\u005fparams":{"request_type":"context_only"},"n":1E400}"#,
        r#"{"disaggregated_params":{"request_type":"context_only"},"disaggregated_params":{"request_type":"context_only"}}"#,
        "{not json",
        "[1,2,",
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        "",
    ]
    .iter()
    .map(|body| json_request(*body))
    .collect();
    requests.push(json_request(vec![b'['; 1000]));
    requests.push(json_request(b"{\"a\":\"\xff\"}".to_vec()));
    // MessagePack, as TensorRT-LLM marks it: a map to stamp, one left
    // alone, and one cut short.
    let mut to_stamp = vec![0x81, 0xb4];
    to_stamp.extend_from_slice(b"disaggregated_params");
    to_stamp.extend_from_slice(&[0x81, 0xac]);
    to_stamp.extend_from_slice(b"request_type");
    to_stamp.push(0xac);
    to_stamp.extend_from_slice(b"context_only");
    let cut_short = to_stamp[..to_stamp.len() - 3].to_vec();
    for body in [to_stamp, vec![0x81, 0xa1, b'a', 0x01], cut_short] {
        requests.push(with_header(json_request(body), "x-trtllm-msgpack", b"1"));
    }
    let mut large = br#"{"prompt_token_ids":["#.to_vec();
    for i in 0..50_000 {
        large.extend_from_slice(format!("{i},").as_bytes());
    }
    large.extend_from_slice(br#"0],"disaggregated_params":{"request_type":"context_only"}}"#);
    requests.push(json_request(large));
    requests
}

#[test]
fn the_bundled_plugin_answers_a_reused_instance_as_it_answers_a_fresh_one() {
    let plugin = |calls_per_instance| {
        load_bundled(&engine_with(
            SnowflakeLayout::TrtllmV1,
            9,
            FixedClock(START_MILLIS),
            PluginLimits {
                calls_per_instance,
                ..PluginLimits::default()
            },
        ))
    };
    // Engines with the same fixed clock hand out the same ids in the same
    // order, so the answers must match byte for byte.
    let fresh = plugin(1);
    let reused = plugin(1000);
    let sync = plugin(1000);
    let requests = varied_bodies();
    runtime().block_on(async {
        let mut kinds = Vec::new();
        for round in 0..3 {
            for (i, request) in requests.iter().enumerate() {
                let expected = exact(&fresh.handle_async(request).await);
                let format = match request.headers.values("x-trtllm-msgpack").is_empty() {
                    true => "json",
                    false => "msgpack",
                };
                kinds.push(format!(
                    "{format} {}",
                    expected.split(' ').next().unwrap_or_default()
                ));
                assert_eq!(
                    exact(&reused.handle_async(request).await),
                    expected,
                    "round {round}, body {i}: a reused instance answered otherwise"
                );
                // `handle`, a fresh instance per call, agrees too.
                assert_eq!(
                    exact(&sync.handle(request)),
                    expected,
                    "round {round}, body {i}: the sync path answered otherwise"
                );
            }
        }
        // The bodies do take each kind of answer, MessagePack's too.
        for kind in ["forward", "forward-with-body", "reject"] {
            for format in ["json", "msgpack"] {
                let kind = format!("{format} {kind}");
                assert!(kinds.contains(&kind), "no {kind} among {kinds:?}");
            }
        }
    });
}

/// An answer in full, to compare.
fn exact(answer: &Result<Action, CallError>) -> String {
    match answer {
        Ok(Action::Forward) => "forward".to_string(),
        Ok(Action::ForwardWithBody(body)) => {
            format!("forward-with-body {}", String::from_utf8_lossy(body))
        }
        Ok(Action::Reject(r)) => format!("reject {} {} {}", r.status, r.code, r.message),
        Err(e) => format!("error {e:?}"),
    }
}

/// An engine with four instance slots, so that one kept per plugin is
/// enough to run out within a few builds.
fn four_slot_engine() -> snowgate_host::PluginEngine {
    engine_with(
        SnowflakeLayout::TrtllmV1,
        9,
        FixedClock(START_MILLIS),
        PluginLimits {
            max_instances: 4,
            ..PluginLimits::default()
        },
    )
}

/// A context-only request through the gateway's call path is stamped.
fn assert_stamps_async(runtime: &tokio::runtime::Runtime, plugin: &Plugin, round: usize) {
    runtime.block_on(async {
        match plugin.handle_async(&json_request(CONTEXT_ONLY)).await {
            Ok(Action::ForwardWithBody(_)) => {}
            other => panic!("round {round}: expected a stamp, got {}", describe(&other)),
        }
    });
}

#[test]
fn a_replaced_plugin_gives_back_the_instances_it_kept() {
    // Four slots in all: if the instances a plugin keeps for reuse outlived
    // it, the fifth plugin would find no slot for its load-time check.
    let engine = four_slot_engine();
    let runtime = runtime();
    for round in 0..50 {
        let plugin = load_bundled(&engine);
        assert_stamps_async(&runtime, &plugin, round);
        drop(plugin);
    }
}

#[test]
fn a_retired_plugin_frees_its_kept_instances_though_requests_still_hold_it() {
    // Four slots, one kept per plugin. A replaced build stays referenced
    // while requests that started on it finish; if it kept its instance,
    // the fourth build would find no slot for its load-time check.
    let engine = four_slot_engine();
    let runtime = runtime();
    let mut still_referenced = Vec::new();
    for round in 0..20 {
        let plugin = load_bundled(&engine);
        assert_stamps_async(&runtime, &plugin, round);
        plugin.retire();
        still_referenced.push(plugin);
    }

    // A retired plugin still answers, each call on a fresh instance.
    let plugin = hostile(PluginLimits::default());
    runtime.block_on(async {
        assert_eq!(count(&plugin).await, 1);
        assert_eq!(count(&plugin).await, 2, "kept before it retires");
        plugin.retire();
        assert_eq!(count(&plugin).await, 1, "its kept instance was freed");
        assert_eq!(count(&plugin).await, 1, "and it keeps none");
    });
}

/// One request-shaped JSON element: params of every request type, with no
/// id, a null id or an id, and a prompt with escapes and non-ASCII text.
fn element() -> impl Strategy<Value = String> {
    let request_type = prop::sample::select(vec![
        "context_only",
        "CONTEXT_ONLY",
        "Context_Only",
        "generation_only",
        "context_and_generation",
    ]);
    let id = prop::sample::select(vec![
        "",
        r#","disagg_request_id":null"#,
        r#","disagg_request_id":123"#,
    ]);
    let text = prop::collection::vec(
        prop::sample::select(vec![
            "a", "é", "\\\"", "\\\\", "\\n", "\\u005f", " ", "{", "]", "漢",
        ]),
        0..40,
    );
    (request_type, id, text, any::<bool>()).prop_map(|(rt, id, text, params_first)| {
        let params = format!(r#""disaggregated_params":{{"request_type":"{rt}"{id}}}"#);
        let prompt = format!(r#""prompt":"{}""#, text.concat());
        if params_first {
            format!("{{{params},{prompt}}}")
        } else {
            format!("{{{prompt}, {params}}}")
        }
    })
}

/// A body: one element or a batch, sometimes cut short (invalid JSON).
fn body() -> impl Strategy<Value = Vec<u8>> {
    (
        prop::collection::vec(element(), 1..5),
        any::<bool>(),
        any::<prop::sample::Index>(),
        0..4u8,
    )
        .prop_map(|(elements, batch, cut, damage)| {
            let mut body = if batch || elements.len() > 1 {
                format!("[{}]", elements.join(","))
            } else {
                elements[0].clone()
            }
            .into_bytes();
            if damage == 0 {
                body.truncate(cut.index(body.len()));
            }
            body
        })
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 128,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Any sequence of bodies through one reused instance gets exactly the
    /// answers fresh instances give, ids included. The two plugins live
    /// across cases (compiling them is the slow part), so the reused one
    /// keeps its instances from case to case; their clocks move in step.
    #[test]
    fn a_reused_instance_answers_any_sequence_as_fresh_instances_do(
        bodies in prop::collection::vec(body(), 1..24),
    ) {
        static PLUGINS: std::sync::OnceLock<(Plugin, Plugin)> = std::sync::OnceLock::new();
        let (fresh, reused) = PLUGINS.get_or_init(|| {
            let plugin = |calls_per_instance| {
                load_bundled(&engine_with(
                    SnowflakeLayout::TrtllmV1,
                    9,
                    FixedClock(START_MILLIS),
                    PluginLimits {
                        calls_per_instance,
                        ..PluginLimits::default()
                    },
                ))
            };
            (plugin(1), plugin(1000))
        });
        let runtime = runtime();
        for (i, body) in bodies.iter().enumerate() {
            let request = json_request(body.clone());
            let expected = exact(&fresh.handle(&request));
            let got = exact(&runtime.block_on(reused.handle_async(&request)));
            prop_assert_eq!(got, expected, "body {}: {}", i, String::from_utf8_lossy(body));
        }
    }
}
