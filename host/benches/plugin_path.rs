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
use std::time::{Duration, Instant};

mod common;

use common::{cases, floor, HostClockIds};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use snowgate_host::{Action, Plugin, PluginLimits};
use snowgate_plugin::{decide, Config, Decision};

fn bench_plugin_path(c: &mut Criterion) {
    let (clock, engine) = common::engine(PluginLimits::default());
    let plugin = common::bundled(&engine);
    let (floor_forward, floor_echo) = (floor(&engine, "forward"), floor(&engine, "echo"));
    let config = Config::default();

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime");

    let cases = cases();
    for (name, request) in &cases {
        let body = request.body.as_slice();
        let mut ids = HostClockIds::new(&clock, config.layout);

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
