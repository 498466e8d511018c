//! One plugin path run a given number of times, for counting its
//! instructions under callgrind: a number that does not move with the
//! machine's load, where the wall-clock times of `plugin_path` on a shared
//! 2-CPU VM can swing by half between runs of the same build.
//!
//! ```sh
//! cargo bench -p snowgate-host --bench instructions --no-run
//! bench/instructions.sh target/release/deps/instructions-<hash>
//! ```
//!
//! `bench/instructions.sh` runs this under callgrind twice per path, with
//! N and 2N iterations, and prints the difference divided by N: the
//! instructions of one iteration, set-up (engine, compilation, the first
//! instance) cancelled out. Instructions are not time (a cache miss or a
//! mispredicted branch costs no instruction), so read them beside the
//! criterion times, as the repeatable half of the picture.
//!
//! The paths are `plugin_path`'s: `native`, `plugin_reused`, `floor_echo`
//! and `floor_forward`, on its requests (`chat_1KiB`, ...). Callgrind
//! cannot reserve the 4 GiB of address space per slot of the default 64
//! instance slots, so the engine here has 4, which still keeps one idle
//! instance per plugin for reuse.

use std::hint::black_box;
use std::process::ExitCode;

use snowgate_host::{Action, Plugin, PluginLimits, Request};
use snowgate_plugin::{decide, Config, Decision};

mod common;

use common::{cases, HostClockIds};

/// Instance slots: enough for one kept instance (see the module docs).
const INSTANCE_SLOTS: u32 = 4;

/// The paths that can be counted.
const PATHS: [&str; 4] = ["native", "plugin_reused", "floor_echo", "floor_forward"];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` runs every bench target with `--bench`: nothing to
    // count then.
    let [path, case, iterations] = args.as_slice() else {
        eprintln!(
            "usage: instructions PATH CASE ITERATIONS (PATH: {}; CASE: {}); see bench/instructions.sh",
            PATHS.join(", "),
            cases().map(|(name, _)| name).join(", ")
        );
        return if args.iter().any(|a| a == "--bench") {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(2)
        };
    };
    let Ok(iterations) = iterations.parse::<u64>() else {
        eprintln!("ITERATIONS must be a whole number, not {iterations:?}");
        return ExitCode::from(2);
    };
    let Some((_, request)) = cases().into_iter().find(|(name, _)| name == case) else {
        eprintln!(
            "no case {case:?}: the cases are {}",
            cases().map(|(n, _)| n).join(", ")
        );
        return ExitCode::from(2);
    };

    let limits = PluginLimits {
        max_instances: INSTANCE_SLOTS,
        ..PluginLimits::default()
    };
    let (clock, engine) = common::engine(limits);
    match path.as_str() {
        "native" => {
            let config = Config::default();
            let mut ids = HostClockIds::new(&clock, config.layout);
            counted_native(&config, &request.body, &mut ids, iterations);
        }
        "plugin_reused" | "floor_echo" | "floor_forward" => {
            let plugin = match path.as_str() {
                "plugin_reused" => common::bundled(&engine),
                "floor_echo" => common::floor(&engine, "echo"),
                _ => common::floor(&engine, "forward"),
            };
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a current-thread runtime");
            // Decided once: a name compared per call would be counted too.
            let forwards = path == "floor_forward";
            counted_calls(&runtime, &plugin, &request, path, forwards, iterations);
        }
        other => {
            eprintln!("no path {other:?}: the paths are {}", PATHS.join(", "));
            return ExitCode::from(2);
        }
    }
    ExitCode::SUCCESS
}

// The two loops below are what `bench/instructions.sh` counts: it has
// callgrind collect only inside functions named `counted_*`, on the thread
// that runs them. So neither the plugin's compilation, on wasmtime's
// parallel threads, whose variation between runs moved the per-call count
// by hundreds of instructions, nor the epoch ticker thread is in it.

/// `iterations` native calls of `decide` on `body`.
#[inline(never)]
fn counted_native(config: &Config, body: &[u8], ids: &mut HostClockIds, iterations: u64) {
    for _ in 0..iterations {
        let decision = decide(config, false, black_box(body), ids);
        assert!(matches!(decision, Ok(Decision::ForwardWithBody { .. })));
    }
}

/// `iterations` + 1 reused calls of `plugin` on `request`, one after
/// another on `runtime`, as in the gateway's event loop.
#[inline(never)]
fn counted_calls(
    runtime: &tokio::runtime::Runtime,
    plugin: &Plugin,
    request: &Request,
    path: &str,
    forwards: bool,
    iterations: u64,
) {
    runtime.block_on(async {
        // The first call makes the instance the others reuse: made in both
        // runs, so it cancels out.
        for _ in 0..iterations + 1 {
            let answer = plugin.handle_async(black_box(request)).await;
            let expected = if forwards {
                matches!(answer, Ok(Action::Forward))
            } else {
                matches!(answer, Ok(Action::ForwardWithBody(_)))
            };
            assert!(expected, "{path} answered {answer:?}");
        }
    });
}
