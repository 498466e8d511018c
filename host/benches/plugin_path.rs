//! The plugin path against the same core compiled natively.
//!
//! For each body, one criterion group with two functions side by side:
//! - `native`: `snowgate_plugin::decide` called directly, on the host's real
//!   process clock and a fixed machine id;
//! - `plugin_fresh`: `Plugin::handle` on the bundled component: a fresh
//!   store and a fresh instance (so instantiation is included), `configure`,
//!   then `handle`; what the gateway does per request with
//!   `--plugin-calls-per-instance 1`, and what `snowgate rewrite` does;
//! - `plugin_reused`: `Plugin::handle_async` on a current-thread runtime,
//!   which is what the gateway does per request by default: `handle` on an
//!   instance kept from earlier calls (a new one every 1000 calls, so
//!   instantiation is included, amortised);
//! - `floor_forward` and `floor_echo`: the same reused call of the same
//!   request, on the test fixture plugin set to answer at once, `forward`
//!   or its own body back, without reading it. What any plugin pays for the
//!   call itself: the request copied in, the answer copied out, the fiber,
//!   the deadline. `plugin_reused` minus `floor_echo` is the plugin's own
//!   work (the core compiled to wasm, its allocator, the imports).
//!
//! The reused and floor calls run one after another inside one `block_on`,
//! as the gateway's calls run inside its event loop, so that entering the
//! runtime is not counted per call.
//!
//! Both get a borrowed input (`&[u8]` for native, `&Request` for the plugin)
//! and both build and return a new body, so they do comparable work; the
//! plugin additionally pays for instantiation and for copying the request in
//! and the answer out of linear memory, which is the overhead measured here.
//!
//! Bodies: a 1 KiB chat request, twice: with two headers, and with the 17
//! that OpenAI's Python client sends (`chat_1KiB_openai_headers`), which
//! shows what headers cost a call; a 64 KiB multi-turn chat; a 1 MiB
//! `prompt_token_ids` completion.
//!
//! Run with `cargo bench -p snowgate-host --bench plugin_path`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use snowgate_host::{
    Action, HostServices, IdClock, MachineIdentity, Plugin, PluginEngine, PluginLimits, Request,
};
use snowgate_plugin::{decide, Config, Decision, IdSource, MachineId, SnowflakeLayout, Tick};

/// The machine id both paths stamp.
const MACHINE_ID: u32 = 7;

/// An id source backed by the host's real process clock, as the host's
/// `clock` import is, and a fixed machine id.
struct HostClockIds<'c> {
    clock: &'c IdClock,
    machine: MachineId,
}

impl IdSource for HostClockIds<'_> {
    fn machine_id(&mut self) -> Result<MachineId, String> {
        Ok(self.machine)
    }

    fn next_tick(&mut self, sequence_space: u32) -> Tick {
        // The system clock is nowhere near the end of time.
        let tick = self.clock.next_tick(sequence_space);
        tick.expect("the clock has milliseconds left")
    }
}

/// A ~1 KiB OpenAI chat-completion request with context-only params.
fn chat_body() -> Vec<u8> {
    let body = concat!(
        r#"{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":["#,
        r#"{"role":"system","content":"You are a helpful assistant. Answer concisely and accurately, cite sources when you can, and say so when you do not know the answer."},"#,
        r#"{"role":"user","content":"I am planning a three-day trip to Kyoto in late November. Which temples and gardens are at their best for autumn colours then, how early should I arrive to avoid the crowds, and is it realistic to combine Arashiyama, Fushimi Inari and Kiyomizu-dera in a single day without rushing? Please also suggest a couple of quieter alternatives that locals like, and tell me roughly how long to budget at each place including travel time between them. I will be travelling with my parents, who walk slowly, so please keep that in mind.\nThanks!"}],"#,
        r#""max_tokens":512,"temperature":0.7,"top_p":0.95,"stream":false,"#,
        r#""stop":["</s>","<|eot_id|>"],"user":"bench-user-0001","#,
        r#""disaggregated_params":{"request_type":"context_only"}}"#,
    );
    body.as_bytes().to_vec()
}

/// A 64 KiB multi-turn chat request, context-only: 90 turns of ~600 bytes of
/// plain English, as `bench/load.py`'s 64 KiB body. Long prompts are mostly
/// string content, which is what this body measures.
fn long_chat_body() -> Vec<u8> {
    const WORDS: [&str; 24] = [
        "the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "prefill",
        "workers", "compute", "key", "value", "caches", "for", "long", "prompts", "and", "decode",
        "workers", "stream", "tokens",
    ];
    let text = |n: usize, seed: usize| {
        let mut out = String::new();
        let mut i = seed;
        while out.len() < n {
            if !out.is_empty() {
                out.push(' ');
            }
            out.push_str(WORDS[i % WORDS.len()]);
            i += 7;
        }
        out.truncate(n);
        out
    };
    let mut body = String::from(
        r#"{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"system","content":"You are a helpful assistant."}"#,
    );
    let mut turn = 0;
    while body.len() < (64 << 10) - 700 {
        let role = if turn % 2 == 0 { "user" } else { "assistant" };
        body.push_str(&format!(
            r#",{{"role":"{role}","content":"{}"}}"#,
            text(600, turn)
        ));
        turn += 1;
    }
    body.push_str(
        r#"],"max_tokens":1,"temperature":0.0,"stream":false,"disaggregated_params":{"request_type":"context_only"}}"#,
    );
    body.into_bytes()
}

/// A ~1 MiB completion request carrying `prompt_token_ids`, with
/// context-only params.
fn token_ids_body() -> Vec<u8> {
    let mut body = br#"{"model":"meta-llama/Llama-3.1-8B-Instruct","prompt_token_ids":["#.to_vec();
    let mut token: u32 = 12_345;
    let mut first = true;
    while body.len() < (1 << 20) - 128 {
        if !first {
            body.push(b',');
        }
        first = false;
        // A cheap LCG for plausible 1..6 digit token ids below 128256.
        token = token.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        body.extend_from_slice((token % 128_256).to_string().as_bytes());
    }
    body.extend_from_slice(
        br#"],"max_tokens":1,"disaggregated_params":{"request_type":"context_only"}}"#,
    );
    body
}

fn request(path: &str, body: Vec<u8>) -> Request {
    Request {
        method: "POST".into(),
        path: path.into(),
        headers: vec![
            ("content-type".into(), b"application/json".to_vec()),
            ("accept".into(), b"application/json".to_vec()),
        ]
        .into(),
        body,
    }
}

fn bench_plugin_path(c: &mut Criterion) {
    let clock = Arc::new(IdClock::system());
    let services = HostServices {
        clock: clock.clone(),
        identity: Arc::new(
            MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, MACHINE_ID)
                .expect("machine id in range"),
        ),
    };
    let engine = PluginEngine::new(services, PluginLimits::default()).expect("plugin engine");
    let plugin =
        Plugin::load(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[]).expect("bundled plugin");
    let floor = |answer: &str| {
        let settings = [("hostile-handle".to_string(), answer.to_string())];
        Plugin::load(&engine, snowgate_test_fixtures::HOSTILE_WASM, &settings)
            .expect("the fixture plugin")
    };
    let (floor_forward, floor_echo) = (floor("forward"), floor("echo"));
    let config = Config::default();
    let machine = MachineId {
        value: MACHINE_ID,
        layout: config.layout,
    };

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime");

    // The headers OpenAI's Python client (1.57) sends with a chat request,
    // as the gateway hands them to the plugin.
    let mut openai = request("/v1/chat/completions", chat_body());
    openai.headers = [
        ("host", "127.0.0.1:8080"),
        ("accept-encoding", "gzip, deflate"),
        ("connection", "keep-alive"),
        ("accept", "application/json"),
        ("content-type", "application/json"),
        ("user-agent", "OpenAI/Python 1.57.0"),
        ("x-stainless-lang", "python"),
        ("x-stainless-package-version", "1.57.0"),
        ("x-stainless-os", "Linux"),
        ("x-stainless-arch", "x64"),
        ("x-stainless-runtime", "CPython"),
        ("x-stainless-runtime-version", "3.12.3"),
        (
            "authorization",
            "Bearer sk-0123456789abcdef0123456789abcdef",
        ),
        ("x-stainless-async", "false"),
        ("x-stainless-retry-count", "0"),
        ("x-stainless-read-timeout", "600"),
        ("content-length", "1065"),
    ]
    .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
    .to_vec()
    .into();
    let cases = [
        ("chat_1KiB", request("/v1/chat/completions", chat_body())),
        ("chat_1KiB_openai_headers", openai),
        (
            "chat_64KiB",
            request("/v1/chat/completions", long_chat_body()),
        ),
        (
            "token_ids_1MiB",
            request("/v1/completions", token_ids_body()),
        ),
    ];
    for (name, request) in &cases {
        let body = request.body.as_slice();
        let mut ids = HostClockIds {
            clock: &clock,
            machine,
        };

        // Each iteration must really stamp, on both paths.
        println!("{name}: {} byte body", body.len());
        match decide(&config, false, body, &mut ids) {
            Ok(Decision::ForwardWithBody { ids: stamped, .. }) => assert_eq!(stamped.len(), 1),
            other => panic!("{name}: native did not stamp: {other:?}"),
        }
        match plugin.handle(request) {
            Ok(Action::ForwardWithBody(out)) => {
                assert!(out.len() > body.len());
                let key = br#""disagg_request_id":"#;
                assert!(out.windows(key.len()).any(|w| w == key));
            }
            other => panic!("{name}: plugin did not stamp: {other:?}"),
        }
        match runtime.block_on(plugin.handle_async(request)) {
            Ok(Action::ForwardWithBody(out)) => assert!(out.len() > body.len()),
            other => panic!("{name}: the reused plugin did not stamp: {other:?}"),
        }
        match runtime.block_on(floor_forward.handle_async(request)) {
            Ok(Action::Forward) => {}
            other => panic!("{name}: the forward floor did not forward: {other:?}"),
        }
        match runtime.block_on(floor_echo.handle_async(request)) {
            Ok(Action::ForwardWithBody(out)) => assert_eq!(out, request.body),
            other => panic!("{name}: the echo floor did not echo: {other:?}"),
        }

        let mut group = c.benchmark_group(*name);
        group.throughput(Throughput::Bytes(body.len() as u64));
        if body.len() > 64 << 10 {
            group.measurement_time(Duration::from_secs(10));
        }
        group.bench_function("native", |b| {
            b.iter(|| decide(&config, false, black_box(body), &mut ids))
        });
        group.bench_function("plugin_fresh", |b| {
            b.iter(|| plugin.handle(black_box(request)))
        });
        let reused = |b: &mut criterion::Bencher, plugin: &Plugin| {
            b.iter_custom(|iterations| {
                runtime.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iterations {
                        black_box(plugin.handle_async(black_box(request)).await)
                            .expect("the call answers");
                    }
                    start.elapsed()
                })
            })
        };
        group.bench_function("plugin_reused", |b| reused(b, &plugin));
        group.bench_function("floor_forward", |b| reused(b, &floor_forward));
        group.bench_function("floor_echo", |b| reused(b, &floor_echo));
        group.finish();
    }
}

criterion_group!(benches, bench_plugin_path);
criterion_main!(benches);
