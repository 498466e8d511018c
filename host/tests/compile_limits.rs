//! Plugins are compiled in a child process (`snowgate compile-plugin`)
//! under limits of their own: a build whose compile needs more memory or
//! CPU time than its limit is refused, naming the limit, while the gateway
//! goes on serving the build it had, its own memory untouched; a gateway
//! that dies mid-compile takes the child with it; and the child's builds,
//! and its refusals, are those of a compile in the process.
//!
//! The builds that exceed the limits are made here: a component whose one
//! function keeps hundreds of thousands of call results alive at once,
//! which Cranelift's register allocator must all track and spill (a few
//! megabytes of WebAssembly that takes gigabytes and seconds to compile).

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use http::StatusCode;
use snowgate_host::{
    CompileLimits, CompileProcess, HostServices, IdClock, MachineIdentity, Plugin, PluginEngine,
    PluginLimits,
};
use snowgate_plugin::SnowflakeLayout;
use support::*;

/// The watcher effectively off, so that only `POST /reload` reloads.
const NO_WATCH: &[&str] = &["--reload-debounce-ms", "600000"];

/// Appends section `id` holding `content`.
fn section(out: &mut Vec<u8>, id: u8, content: &[u8]) {
    out.push(id);
    leb128(content.len(), out);
    out.extend_from_slice(content);
}

/// A component holding one core module whose second function calls the
/// first `values` times, keeping every result on the operand stack, then
/// adds them all up. Valid WebAssembly (it does not implement the
/// middleware world, which is checked only after compiling); every result
/// is alive until the additions, so the compile's memory and time grow
/// with `values`.
fn compile_bomb(values: usize) -> Vec<u8> {
    let mut module = b"\0asm\x01\0\0\0".to_vec();
    // Types: () -> i32, () -> ().
    section(&mut module, 1, &[2, 0x60, 0, 1, 0x7f, 0x60, 0, 0]);
    // Functions: 0 of type 0, 1 of type 1.
    section(&mut module, 3, &[2, 0, 1]);
    let mut bomb = vec![0]; // no locals
    for _ in 0..values {
        bomb.extend_from_slice(&[0x10, 0]); // call 0
    }
    bomb.extend(std::iter::repeat_n(0x6a, values - 1)); // i32.add
    bomb.extend_from_slice(&[0x1a, 0x0b]); // drop, end
    let mut code = vec![2];
    // Function 0: i32.const 7.
    code.extend_from_slice(&[4, 0, 0x41, 7, 0x0b]);
    leb128(bomb.len(), &mut code);
    code.extend_from_slice(&bomb);
    section(&mut module, 10, &code);
    let mut component = b"\0asm\x0d\0\x01\0".to_vec();
    section(&mut component, 1, &module); // a core module
    component
}

/// The size of the bomb the tests use: its compile needs about 950 MiB
/// and 3 s of CPU (about 2.4 KiB and 7 µs a value, in the tests' build).
const BOMB_VALUES: usize = 400_000;

/// The compile memory limit the memory test gives: twice what the bundled
/// plugin's compile needs (under 200 MiB of address space), half of what
/// the bomb's does.
const MEMORY_LIMIT_MIB: u64 = 512;

/// Runs `snowgate serve` with `args` (and `--machine-id 1`) on loopback,
/// for a start that must fail: its output once it exits. One that starts instead is killed after five minutes (a compile in a
/// debug build may take one), and fails the test.
fn serve_until_it_exits(args: &[&str]) -> std::process::Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_snowgate"));
    command
        .args(SERVE_ON_LOOPBACK)
        .args(["--machine-id", "1"])
        .args(args);
    run_bounded(command, b"", Duration::from_secs(300))
}

/// Runs `snowgate check` with `args` until it exits (killed after five
/// minutes, failing the test): its output.
fn check_until_it_exits(args: &[&str]) -> std::process::Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_snowgate"));
    command.arg("check").args(args);
    run_bounded(command, b"", Duration::from_secs(300))
}

/// A gateway serving build 0 of the bundled plugin from a file in a new
/// directory, with `extra` flags.
async fn serving(name: &str, extra: &[&str]) -> (TempDir, std::path::PathBuf, Gateway) {
    let dir = TempDir::new(name);
    let path = dir.path().join("plugin.wasm");
    std::fs::write(&path, plugin_variant(0)).unwrap();
    let mut args = vec!["--plugin", arg(&path)];
    args.extend_from_slice(NO_WATCH);
    args.extend_from_slice(extra);
    let gateway = Gateway::start(&args).await;
    (dir, path, gateway)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_whose_compile_needs_more_memory_than_its_limit_is_refused_and_the_old_one_serves()
{
    let limit = MEMORY_LIMIT_MIB.to_string();
    let (_dir, path, gateway) = serving(
        "compile-memory",
        &["--plugin-compile-memory-mib", limit.as_str()],
    )
    .await;
    let serving_sha = gateway.plugin_sha().await;
    let peak_before = peak_rss_kib(gateway.pid());

    rewrite_in_place(&path, &compile_bomb(BOMB_VALUES));
    let message = reload_refused(&gateway).await;
    assert!(
        message.contains("--plugin-compile-memory-mib")
            && message.contains(&format!("{MEMORY_LIMIT_MIB} MiB")),
        "names the limit: {message}"
    );
    assert!(message.contains(arg(&path)), "names the file: {message}");
    assert_eq!(
        gateway.plugin_sha().await,
        serving_sha,
        "the old build serves"
    );
    assert_stamps(&gateway).await;
    // The compile's memory was the child's: the gateway's own peak grew
    // by far less than the limit the child ran into.
    let grown_mib = peak_rss_kib(gateway.pid()).saturating_sub(peak_before) >> 10;
    assert!(
        grown_mib < MEMORY_LIMIT_MIB / 4,
        "the gateway's peak resident memory grew by {grown_mib} MiB"
    );

    // A good build still compiles in the child and swaps in.
    rewrite_in_place(&path, &plugin_variant(1));
    let reply = post_empty(gateway.admin, "/reload").await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(gateway.plugin_sha().await, sha256_hex(&plugin_variant(1)));
    assert_stamps(&gateway).await;
}

/// A build whose compile runs past `--plugin-compile-cpu-secs` is refused
/// for good (`may_pass` false), even where whoever started the gateway
/// ignores SIGXCPU, which `exec` passes on: the child must still end at
/// its soft limit, not be killed at the hard one, which looks like the
/// out-of-memory killer's SIGKILL and would be tried again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_whose_compile_takes_more_cpu_than_its_limit_is_refused() {
    // SAFETY: sets a signal's disposition, which nothing in this test
    // process relies on; every gateway this binary starts inherits it, and
    // must work with it.
    unsafe { libc::signal(libc::SIGXCPU, libc::SIG_IGN) };
    let (_dir, path, gateway) = serving(
        "compile-cpu",
        &[
            "--plugin-compile-cpu-secs",
            "1",
            "--plugin-compile-memory-mib",
            "8192",
        ],
    )
    .await;
    let serving_sha = gateway.plugin_sha().await;
    rewrite_in_place(&path, &compile_bomb(BOMB_VALUES));
    // The compile runs at a low priority: on a machine busy with other
    // work it may not get its second of CPU within the 10 s of wall-clock
    // time it is allowed, and is then ended for that. Such a round says
    // nothing of the CPU limit, so another bomb (one value more: other
    // bytes, which the gateway has not refused before) is tried, up to
    // three in all.
    let mut message = reload_refused(&gateway).await;
    for more in 1..3 {
        if !message.contains("of wall-clock time") {
            break;
        }
        rewrite_in_place(&path, &compile_bomb(BOMB_VALUES + more));
        message = reload_refused(&gateway).await;
    }
    assert!(
        message.contains("1 s of CPU time (--plugin-compile-cpu-secs)"),
        "names the limit: {message}"
    );
    let status = get(gateway.admin, "/status").await.json();
    assert_eq!(
        status["last_reload_error"]["may_pass"], false,
        "refused for good: {status}"
    );
    assert_eq!(
        gateway.plugin_sha().await,
        serving_sha,
        "the old build serves"
    );
    assert_stamps(&gateway).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gateway_whose_first_build_exceeds_a_compile_limit_does_not_start_and_says_why() {
    let dir = TempDir::new("compile-first");
    let path = dir.path().join("plugin.wasm");
    std::fs::write(&path, compile_bomb(BOMB_VALUES)).unwrap();
    let limit = MEMORY_LIMIT_MIB.to_string();
    let output = serve_until_it_exits(&[
        "--plugin",
        arg(&path),
        "--plugin-compile-memory-mib",
        limit.as_str(),
    ]);
    assert_eq!(output.status.code(), Some(1), "it must not start");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--plugin-compile-memory-mib") && !stderr.contains("panicked"),
        "{stderr}"
    );
}

/// `snowgate check` compiles a build as the gateway of its config file
/// would: in a child process, under the file's compile limits, and refuses
/// one over them as that gateway would.
#[test]
fn check_compiles_under_its_config_files_compile_limits() {
    let dir = TempDir::new("compile-check");
    std::fs::write(dir.path().join("plugin.wasm"), compile_bomb(BOMB_VALUES)).unwrap();
    let config = dir.path().join("snowgate.toml");
    std::fs::write(
        &config,
        format!("plugin = \"plugin.wasm\"\nplugin-compile-memory-mib = {MEMORY_LIMIT_MIB}\n"),
    )
    .unwrap();
    let limit = MEMORY_LIMIT_MIB.to_string();
    let plugin = dir.path().join("plugin.wasm");
    // From the file, and from the flag as `serve` takes it.
    for args in [
        vec!["--config", arg(&config)],
        vec![
            "--plugin",
            arg(&plugin),
            "--plugin-compile-memory-mib",
            limit.as_str(),
        ],
    ] {
        let output = check_until_it_exits(&args);
        assert_eq!(output.status.code(), Some(1), "{args:?}: must be refused");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("--plugin-compile-memory-mib") && !stderr.contains("panicked"),
            "{args:?}: {stderr}"
        );
    }
}

/// `--plugin-compile-in-process` over a config file that sets a compile
/// limit is refused, by `serve` and `check`, naming the file, even where
/// the file's limit is the default (before, only a limit other than the
/// default was noticed, and one the file stated was dropped without a
/// word); so is a limit's flag over a file that compiles in-process.
#[test]
fn compiling_in_process_over_a_config_files_compile_limit_is_refused() {
    let dir = TempDir::new("compile-in-process-over-file");
    let config = dir.path().join("snowgate.toml");
    let default_mib = snowgate_host::CompileLimits::default().memory_bytes >> 20;
    std::fs::write(
        &config,
        format!("plugin-compile-memory-mib = {default_mib}\n"),
    )
    .unwrap();
    let in_process = "--plugin-compile-in-process";
    let serve = serve_until_it_exits(&["--config", arg(&config), in_process]);
    let check = check_until_it_exits(&["--config", arg(&config), in_process]);
    // And the other way round: the file compiles in-process, a flag sets a
    // limit (before, refused without naming the file).
    let other_way = dir.path().join("in-process.toml");
    std::fs::write(&other_way, "plugin-compile-in-process = true\n").unwrap();
    let flag_limit = check_until_it_exits(&[
        "--config",
        arg(&other_way),
        "--plugin-compile-memory-mib",
        "512",
    ]);
    for (command, output, file, key) in [
        ("serve", serve, "snowgate.toml", "plugin-compile-memory-mib"),
        ("check", check, "snowgate.toml", "plugin-compile-memory-mib"),
        (
            "check",
            flag_limit,
            "in-process.toml",
            "sets plugin-compile-in-process",
        ),
    ] {
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{command}: {stderr}");
        assert!(
            stderr.contains("the config file") && stderr.contains(file) && stderr.contains(key),
            "{command}: {stderr}"
        );
    }
}

#[test]
fn compile_limits_out_of_range_are_refused_as_bad_flags() {
    for (flag, value, says) in [
        ("--plugin-compile-memory-mib", "100", "between 256 and"),
        ("--plugin-compile-cpu-secs", "0", "between 1 and 86400"),
    ] {
        let output = serve_until_it_exits(&[flag, value]);
        assert_eq!(output.status.code(), Some(2), "{flag} {value}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(says), "{flag} {value}: {stderr}");
    }
}

/// The processes whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|text| {
            text.split_whitespace()
                .filter_map(|n| n.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// Whether process `pid` is gone, or dead and waiting to be reaped.
fn is_dead(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the command name in parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}

/// Polls `done` every 20 ms until it holds, at most `bound`.
fn poll_until(what: &str, bound: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < bound, "{what} within {bound:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_mid_compile_takes_its_compile_process_with_it() {
    let (_dir, path, gateway) = serving("compile-orphan", &[]).await;
    rewrite_in_place(&path, &compile_bomb(BOMB_VALUES));
    // The reload runs to its end even though this request is dropped.
    let admin = gateway.admin;
    let reload = tokio::spawn(async move { post_empty(admin, "/reload").await });
    // Stopped, it cannot finish its compile and end by itself meanwhile:
    // only a SIGKILL from the kernel, when its parent dies, ends it.
    let child = Killed(compile_child_of(gateway.pid()));
    signal(child.0, "STOP");
    gateway.signal("KILL");
    gateway.wait_exit(STEP).await;
    poll_until("the compile process dies with the gateway", STEP, || {
        is_dead(child.0)
    });
    reload.abort();
}

/// The compile process of the build a reload is compiling, once it has
/// started (polled, at most [`STEP`]).
fn compile_child_of(pid: u32) -> u32 {
    let mut child = 0;
    poll_until("the compile process starts", STEP, || {
        child = children_of(pid)
            .into_iter()
            .find(|c| {
                std::fs::read(format!("/proc/{c}/cmdline"))
                    .is_ok_and(|cmd| cmd.windows(14).any(|w| w == b"compile-plugin"))
            })
            .unwrap_or(0);
        child != 0
    });
    child
}

/// A stop does not wait for a reload's compile: a compile may take
/// minutes, and a stop that waited for it could be cut short by a
/// SIGKILL before the gateway has accounted for its ids. Here the compile
/// never ends (its process is stopped); the gateway still stops at once,
/// writes its last id's millisecond to its high-water file, and its
/// compile process ends with it. Before, the stop waited for the compile
/// with the mark unwritten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_does_not_wait_for_a_reloads_compile() {
    let dir = TempDir::new("compile-stop");
    let mark = dir.path().join("ids.mark");
    let (_plugin_dir, path, gateway) =
        serving("compile-stop", &["--high-water-file", arg(&mark)]).await;
    assert_stamps(&gateway).await;
    rewrite_in_place(&path, &compile_bomb(BOMB_VALUES));
    let admin = gateway.admin;
    let reload = tokio::spawn(async move { post_empty(admin, "/reload").await });
    let child = Killed(compile_child_of(gateway.pid()));
    signal(child.0, "STOP");
    gateway.stop().await;
    let log = gateway.stderr_text();
    assert!(
        log.contains("is the high-water file's mark"),
        "the stop writes its last id's millisecond: {log}"
    );
    poll_until("the compile process ends with the gateway", STEP, || {
        is_dead(child.0)
    });
    reload.abort();
}

/// With `--plugin-compile-in-process` (for valgrind, or a seccomp profile
/// without `execve`) builds are compiled in the gateway's own process: a
/// reload of a build that takes a while to compile starts no child, and
/// the flag beside a compile limit is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_compile_in_process_no_compile_process_is_started() {
    let (_dir, path, gateway) =
        serving("compile-in-process", &["--plugin-compile-in-process"]).await;
    // A quarter of the bomb: some hundreds of milliseconds of compiling,
    // in which a compile process would be seen.
    rewrite_in_place(&path, &compile_bomb(BOMB_VALUES / 4));
    let admin = gateway.admin;
    let reload = tokio::spawn(async move { post_empty(admin, "/reload").await });
    let pid = gateway.pid();
    let mut children = Vec::new();
    let mut looks = 0;
    while !reload.is_finished() {
        children.extend(children_of(pid));
        looks += 1;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let reply = reload.await.expect("the reload request");
    assert!(children.is_empty(), "compile processes {children:?}");
    // The compile was looked at while under way, more than once.
    assert!(looks > 2, "the reload ended after {looks} looks");
    // Compiled, then refused for what it is (a component that exports
    // nothing of the world), by the gateway's own compile.
    assert_eq!(
        reply.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        reply.text()
    );
    assert!(reply.text().contains("does not export"), "{}", reply.text());
    assert!(
        !reply.text().contains("compile process"),
        "{}",
        reply.text()
    );
    gateway.stop().await;

    let output = serve_until_it_exits(&[
        "--plugin-compile-in-process",
        "--plugin-compile-cpu-secs",
        "5",
    ]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("cannot be used with"), "{stderr}");
}

/// Sends process `pid` `signal`, if it is still there.
fn signal(pid: u32, signal: &str) {
    // It may have gone already.
    let _ = send_signal(pid, signal);
}

/// A process killed when the test ends, pass or fail.
struct Killed(u32);

impl Drop for Killed {
    fn drop(&mut self) {
        signal(self.0, "KILL");
    }
}

/// An engine that compiles in `snowgate compile-plugin` under `limits`.
fn engine_compiling_in_a_child(limits: CompileLimits) -> PluginEngine {
    let services = HostServices {
        clock: std::sync::Arc::new(IdClock::system()),
        identity: std::sync::Arc::new(
            MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 3).unwrap(),
        ),
    };
    let limits_of_calls = PluginLimits {
        max_instances: 4,
        ..PluginLimits::default()
    };
    PluginEngine::new(services, limits_of_calls)
        .unwrap()
        // SAFETY: the snowgate binary of this build compiles with this
        // crate's `compile_for_parent`.
        .with_compile_process(unsafe {
            CompileProcess::of_program(env!("CARGO_BIN_EXE_snowgate"), &["compile-plugin"], limits)
        })
}

#[test]
fn a_build_from_the_child_serves_and_a_refusal_from_it_says_what_one_here_says() {
    let engine = engine_compiling_in_a_child(CompileLimits::default());
    let plugin = Plugin::load(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[]).unwrap();
    let request = snowgate_host::Request {
        method: "POST".into(),
        path: "/v1/completions".into(),
        headers: vec![("content-type".into(), b"application/json".to_vec())].into(),
        body: CONTEXT_ONLY.as_bytes().to_vec(),
    };
    let snowgate_host::Action::ForwardWithBody(body) = plugin.handle(&request).unwrap() else {
        panic!("the bundled plugin stamps a context-only body");
    };
    assert!(String::from_utf8(body)
        .unwrap()
        .contains("\"disagg_request_id\":"));

    // A component of another world compiles; it fails the same check
    // after, with the same words.
    let here = PluginEngine::new(
        engine.services().clone(),
        PluginLimits {
            max_instances: 4,
            ..PluginLimits::default()
        },
    )
    .unwrap();
    let wrong = snowgate_test_fixtures::WRONG_WORLD_WASM;
    let in_child = format!("{:#}", Plugin::load(&engine, wrong, &[]).unwrap_err());
    let in_here = format!("{:#}", Plugin::load(&here, wrong, &[]).unwrap_err());
    assert_eq!(in_child, in_here);

    // Bytes wasmtime cannot read: its message comes through the child.
    let mut broken = snowgate_plugin_bundle::PLUGIN_WASM.to_vec();
    broken.truncate(broken.len() / 2);
    let in_child = format!("{:#}", Plugin::load(&engine, &broken, &[]).unwrap_err());
    let in_here = format!("{:#}", Plugin::load(&here, &broken, &[]).unwrap_err());
    assert!(
        in_child.starts_with("the plugin is not a valid WebAssembly component for this host: "),
        "{in_child}"
    );
    assert_eq!(in_child, in_here);
}

#[test]
fn a_compile_process_that_cannot_start_is_named() {
    let engine = engine_compiling_in_a_child(CompileLimits::default());
    // SAFETY: nothing is run: the program does not exist.
    let missing = unsafe {
        CompileProcess::of_program("/nonexistent/snowgate", &[], CompileLimits::default())
    };
    let engine = engine.with_compile_process(missing);
    let error = Plugin::load(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[]).unwrap_err();
    let message = format!("{error:#}");
    assert!(
        message.contains("starting the compile process /nonexistent/snowgate"),
        "{message}"
    );
}
