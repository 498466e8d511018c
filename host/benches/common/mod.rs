//! What the plugin-path benchmarks share: the requests they send, the
//! engine and plugins they call, and the native path's id source.

// Each bench target uses part of this module.
#![allow(dead_code)]

use std::sync::Arc;

use snowgate_host::{
    HostServices, IdClock, MachineIdentity, Plugin, PluginEngine, PluginLimits, Request,
};
use snowgate_plugin::{IdSource, MachineId, SnowflakeLayout, Tick};

/// The machine id both paths stamp.
pub const MACHINE_ID: u32 = 7;

/// The engine the plugins run in, under `limits`, on the host's real
/// process clock (returned too, for the native path) and machine id
/// [`MACHINE_ID`].
pub fn engine(limits: PluginLimits) -> (Arc<IdClock>, PluginEngine) {
    let clock = Arc::new(IdClock::system());
    let services = HostServices {
        clock: clock.clone(),
        identity: Arc::new(
            MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, MACHINE_ID)
                .expect("machine id in range"),
        ),
    };
    let engine = PluginEngine::new(services, limits).expect("plugin engine");
    (clock, engine)
}

/// The bundled plugin, loaded in `engine`.
pub fn bundled(engine: &PluginEngine) -> Plugin {
    Plugin::load(engine, snowgate_plugin_bundle::PLUGIN_WASM, &[]).expect("bundled plugin")
}

/// The test fixture plugin set to answer at once without reading the
/// request: `forward`, or `echo` (its own body back).
pub fn floor(engine: &PluginEngine, answer: &str) -> Plugin {
    let settings = [("hostile-handle".to_string(), answer.to_string())];
    Plugin::load(engine, snowgate_test_fixtures::HOSTILE_WASM, &settings)
        .expect("the fixture plugin")
}

/// An id source backed by the host's real process clock, as the host's
/// `clock` import is, and a fixed machine id.
pub struct HostClockIds<'c> {
    /// The host's process clock.
    clock: &'c IdClock,
    /// The machine id stamped.
    machine: MachineId,
}

impl<'c> HostClockIds<'c> {
    /// Ids from `clock` with machine id [`MACHINE_ID`], for `layout`.
    pub fn new(clock: &'c IdClock, layout: SnowflakeLayout) -> HostClockIds<'c> {
        HostClockIds {
            clock,
            machine: MachineId {
                value: MACHINE_ID,
                layout,
            },
        }
    }
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
pub fn chat_body() -> Vec<u8> {
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
pub fn long_chat_body() -> Vec<u8> {
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
pub fn token_ids_body() -> Vec<u8> {
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

/// A POST of `body` to `path` with two headers.
pub fn request(path: &str, body: Vec<u8>) -> Request {
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

/// The benchmarked requests, by name: a 1 KiB chat request, twice: with
/// two headers, and with the 17 that OpenAI's Python client sends
/// (`chat_1KiB_openai_headers`), which shows what headers cost a call; a
/// 64 KiB multi-turn chat; a 1 MiB `prompt_token_ids` completion.
pub fn cases() -> [(&'static str, Request); 4] {
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
    [
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
    ]
}
