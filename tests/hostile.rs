//! Hostile plugins: purpose-made fixture components that misbehave, run in
//! the real host, to prove it contains each one.
//!
//! The fixture `snowgate_test_fixtures::HOSTILE_WASM` stamps exactly like the
//! real plugin (so it passes the gateway's load-time self-check) until a
//! request carries `x-hostile: BEHAVIOUR`: `loop`, `memory-bomb`, `panic`,
//! `trap`, `escape` or `huge-body`. `WRONG_WORLD_WASM` is built for an
//! incompatible contract, `snowgate:middleware@0.1.0`.
//!
//! Two levels:
//! - the library: `Plugin::handle` gives the right `CallError` for each
//!   misbehaviour, within a bound, and the same plugin then serves a normal
//!   request; a wrong-world component is refused by `Plugin::load`;
//! - the gateway, in process over loopback HTTP, with a recording upstream:
//!   the failure policy's answer, the upstream left alone (fail-closed) or
//!   given the request unchanged (fail-open), exact failure counts on
//!   `/metrics`; with the hostile plugin loaded at start, and swapped in live
//!   by replacing the plugin file, after which a wrong-world build is refused
//!   and the hostile build keeps serving.
//!
//! Every wait is bounded; nothing sleeps in place of synchronisation (the
//! only pause is in polling `/status` for a reload, under a deadline).

mod common;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::io::Read as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::describe;
use http::{HeaderMap, Method, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use snowgate_host::gateway::{FailurePolicy, Gateway, GatewayConfig};
use snowgate_host::{
    Action, CallError, HostServices, IdClock, MachineIdentity, Plugin, PluginEngine, PluginLimits,
    Request,
};
use snowgate_plugin::SnowflakeLayout;
use snowgate_plugin_bundle::PLUGIN_WASM;
use snowgate_test_fixtures::{HOSTILE_WASM, WRONG_WORLD_WASM};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The machine id every engine and gateway here gets.
const MACHINE_ID: u32 = 7;

/// The smallest body that needs an id.
const CONTEXT_ONLY: &str =
    r#"{"model":"m","prompt":"Hello","disaggregated_params":{"request_type":"context_only"}}"#;

/// The name the hostile fixture reports.
const HOSTILE_NAME: &str = "snowgate-hostile-fixture";

/// The name the real plugin reports.
const REAL_NAME: &str = "snowgate-disagg-id";

/// What the fixture writes to stdout in `escape`.
const STDOUT_MARKER: &str = "hostile plugin was here";

/// How much longer than its deadline a failing call may take to come back:
/// a bound against hanging, not a speed claim.
const LIBRARY_MARGIN: Duration = Duration::from_secs(2);

/// The same bound for a whole HTTP round trip through the gateway.
const GATEWAY_MARGIN: Duration = Duration::from_secs(5);

/// The longest one HTTP exchange may take.
const STEP: Duration = Duration::from_secs(60);

/// The longest a plugin reload may take to show on `/status`: a compile in
/// a debug build, possibly while other tests compile theirs.
const RELOAD_TIMEOUT: Duration = Duration::from_secs(90);

// ---------------------------------------------------------------------------
// Library level
// ---------------------------------------------------------------------------

fn engine(limits: PluginLimits) -> PluginEngine {
    let services = HostServices {
        clock: Arc::new(IdClock::system()),
        identity: Arc::new(
            MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, MACHINE_ID)
                .expect("the test machine id is in range"),
        ),
    };
    PluginEngine::new(services, limits).expect("creating the plugin engine")
}

fn hostile_plugin(limits: PluginLimits) -> Plugin {
    let plugin = Plugin::load(&engine(limits), HOSTILE_WASM, &[])
        .unwrap_or_else(|e| panic!("loading the hostile fixture: {e:#}"));
    assert_eq!(plugin.info().name, HOSTILE_NAME);
    plugin
}

/// A context-only JSON request; with `x-hostile: behaviour` when given.
fn request(behaviour: Option<&str>, extra: &[(&str, &str)]) -> Request {
    let mut headers = vec![("content-type".to_string(), b"application/json".to_vec())];
    if let Some(behaviour) = behaviour {
        headers.push(("x-hostile".to_string(), behaviour.as_bytes().to_vec()));
    }
    for (name, value) in extra {
        headers.push((name.to_string(), value.as_bytes().to_vec()));
    }
    Request {
        method: "POST".into(),
        path: "/v1/completions".into(),
        headers: headers.into(),
        body: CONTEXT_ONLY.as_bytes().to_vec(),
    }
}

/// Runs `behaviour` on `plugin`, asserting that the call came back within
/// the deadline plus [`LIBRARY_MARGIN`]; returns the error and how long the
/// call took.
fn misbehave(plugin: &Plugin, behaviour: &str) -> (CallError, Duration) {
    let deadline = plugin.engine().limits().deadline;
    let started = Instant::now();
    let answer = plugin.handle(&request(Some(behaviour), &[]));
    let took = started.elapsed();
    assert!(
        took < deadline + LIBRARY_MARGIN,
        "{behaviour}: the call took {took:?}, over its {deadline:?} deadline plus {LIBRARY_MARGIN:?}"
    );
    match answer {
        Err(e) => (e, took),
        other => panic!("{behaviour}: expected an error, got {}", describe(&other)),
    }
}

/// The id in a stamped body, checked to be of this machine.
fn assert_stamped(body: &[u8]) -> u64 {
    let value: Value = serde_json::from_slice(body)
        .unwrap_or_else(|e| panic!("the stamped body is not JSON ({e}): {body:?}"));
    let id = value["disaggregated_params"]["disagg_request_id"]
        .as_u64()
        .unwrap_or_else(|| panic!("no integer disagg_request_id in {value}"));
    let parts = SnowflakeLayout::TrtllmV1
        .decode(id)
        .unwrap_or_else(|e| panic!("id {id} does not decode: {e:?}"));
    assert_eq!(parts.machine_id, MACHINE_ID, "id {id}");
    assert_eq!(value["prompt"], "Hello", "the rest of the body is kept");
    id
}

/// After a failure, the same plugin stamps a normal request: the host, the
/// engine and the plugin are all fine.
fn assert_next_request_is_stamped(plugin: &Plugin) {
    assert_answer_stamped(
        &plugin.handle(&request(None, &[])),
        "the request after a failure",
    );
}

/// Checks that `answer` is a new body carrying a stamp ([`assert_stamped`]);
/// `what` names the call in the failure message.
fn assert_answer_stamped(answer: &Result<Action, CallError>, what: &str) {
    match answer {
        Ok(Action::ForwardWithBody(body)) => {
            assert_stamped(body);
        }
        other => panic!("{what} was not stamped: {}", describe(other)),
    }
}

#[test]
fn an_infinite_loop_is_stopped_at_the_deadline() {
    let deadline = Duration::from_millis(100);
    let plugin = hostile_plugin(PluginLimits {
        deadline,
        ..PluginLimits::default()
    });
    for _ in 0..2 {
        let (error, took) = misbehave(&plugin, "loop");
        assert_eq!(error, CallError::Deadline(deadline));
        assert_eq!(error.kind(), "deadline");
        assert_eq!(error.to_string(), "the plugin ran past its 100 ms deadline");
        // The epoch ticker sleeps at least 1 ms per tick and the call gets
        // 100 ticks: it ran until the deadline, not into some other stop.
        assert!(took >= deadline, "stopped after only {took:?}");
        assert_next_request_is_stamped(&plugin);
    }
}

/// Runs `behaviour` through the async path (the gateway's), timed.
fn misbehave_async(plugin: &Plugin, behaviour: &str) -> (Result<Action, CallError>, Duration) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a current-thread runtime");
    let started = Instant::now();
    let answer = runtime.block_on(plugin.handle_async(&request(Some(behaviour), &[])));
    (answer, started.elapsed())
}

#[test]
fn a_plugin_sleeping_past_its_deadline_is_stopped_at_once() {
    // Epoch ticks interrupt wasm code, not a plugin waiting in a WASI clock
    // subscription: the host must refuse a wait that outlasts the deadline.
    // The plugin sleeps 60 s; a deadline of 20 s tells "at once" from "at
    // the deadline" with room for a busy machine.
    let deadline = Duration::from_secs(20);
    let plugin = hostile_plugin(PluginLimits {
        deadline,
        ..PluginLimits::default()
    });
    // `sleep` waits with `subscribe-duration`, `sleep-until` with
    // `subscribe-instant`: the host replaces both.
    for sleep in ["sleep", "sleep-until", "sleep", "sleep-until"] {
        let (error, took) = misbehave(&plugin, sleep);
        assert_eq!(error, CallError::Deadline(deadline), "sync {sleep}");
        assert!(
            took < deadline,
            "sync {sleep}: waited {took:?} before stopping"
        );
        let (answer, took) = misbehave_async(&plugin, sleep);
        match answer {
            Err(error) => assert_eq!(error, CallError::Deadline(deadline), "async {sleep}"),
            other => panic!("async {sleep}: {}", describe(&other)),
        }
        assert!(
            took < deadline,
            "async {sleep}: waited {took:?} before stopping"
        );
        assert_next_request_is_stamped(&plugin);
    }
}

#[test]
fn a_sleep_within_the_deadline_sleeps_and_the_call_goes_on() {
    let plugin = hostile_plugin(PluginLimits {
        deadline: Duration::from_secs(30),
        ..PluginLimits::default()
    });
    // The fixture's `nap` and `nap-until` are 20 ms, one with each of the
    // clock's subscriptions.
    let nap = Duration::from_millis(20);
    for behaviour in ["nap", "nap-until"] {
        let started = Instant::now();
        let answer = plugin.handle(&request(Some(behaviour), &[]));
        let took = started.elapsed();
        assert_answer_stamped(&answer, &format!("sync {behaviour}"));
        assert!(took >= nap, "sync {behaviour}: took only {took:?}");
        let (answer, took) = misbehave_async(&plugin, behaviour);
        assert_answer_stamped(&answer, &format!("async {behaviour}"));
        assert!(took >= nap, "async {behaviour}: took only {took:?}");
    }
}

#[test]
fn one_deadline_covers_a_fresh_instances_configure_and_first_call() {
    // With `hostile-configure=nap`, configure sleeps 2000 ms; a `nap`
    // request sleeps 2000 ms more. 4000 ms of waits do not fit a 3000 ms
    // deadline when it covers both (as it must); they would if the first
    // call got a deadline of its own. The load's check, configure and one
    // small call, has 1000 ms to spare on a busy machine.
    let settings = [
        ("hostile-configure".to_string(), "nap".to_string()),
        ("hostile-nap-ms".to_string(), "2000".to_string()),
    ];
    let plugin = |deadline| {
        Plugin::load(
            &engine(PluginLimits {
                deadline,
                ..PluginLimits::default()
            }),
            HOSTILE_WASM,
            &settings,
        )
        .unwrap_or_else(|e| panic!("loading the hostile fixture: {e:#}"))
    };
    let tight = Duration::from_millis(3000);
    let (answer, _) = misbehave_async(&plugin(tight), "nap");
    match answer {
        Err(error) => assert_eq!(error, CallError::Deadline(tight)),
        other => panic!("expected the deadline, got {}", describe(&other)),
    }
    // With room for both, the same call stamps.
    let (answer, _) = misbehave_async(&plugin(Duration::from_secs(30)), "nap");
    assert_answer_stamped(&answer, "a nap with room for both");
}

#[test]
fn an_unlimited_deadline_is_taken_as_a_day_not_an_overflow() {
    let plugin = hostile_plugin(PluginLimits {
        deadline: Duration::MAX,
        ..PluginLimits::default()
    });
    assert_eq!(
        plugin.engine().limits().deadline,
        snowgate_host::engine::MAX_DEADLINE
    );
    assert_next_request_is_stamped(&plugin);
    let (answer, _) = misbehave_async(&plugin, "nap");
    assert_answer_stamped(&answer, "a nap under a day's deadline");
}

#[test]
fn a_memory_bomb_is_stopped_at_the_memory_limit() {
    let plugin = hostile_plugin(PluginLimits {
        memory_bytes: 32 << 20,
        // Generous, so that the memory limit, not the clock, stops it.
        deadline: Duration::from_secs(30),
        ..PluginLimits::default()
    });
    let (error, _) = misbehave(&plugin, "memory-bomb");
    assert_eq!(error, CallError::MemoryLimit(32 << 20));
    assert_eq!(error.kind(), "memory_limit");
    assert_eq!(
        error.to_string(),
        "the plugin tried to use more than its 32 MiB memory limit"
    );
    assert_next_request_is_stamped(&plugin);
}

#[test]
fn a_rust_panic_is_a_trap_that_carries_the_panic_message() {
    let plugin = hostile_plugin(PluginLimits::default());
    let (error, _) = misbehave(&plugin, "panic");
    let CallError::Trap(detail) = &error else {
        panic!("expected a trap, got {error:?}");
    };
    assert_eq!(error.kind(), "trap");
    // The trap itself, then what the plugin wrote to its (captured) stderr.
    assert!(
        detail.contains("wasm `unreachable` instruction executed"),
        "{detail}"
    );
    let (_, stderr) = detail
        .split_once("; plugin stderr: ")
        .unwrap_or_else(|| panic!("no captured stderr in {detail}"));
    assert!(
        stderr.contains("panicked at tests/fixtures/hostile-plugin/src/lib.rs"),
        "{stderr}"
    );
    assert!(
        stderr.contains("deliberate panic in the hostile fixture"),
        "{stderr}"
    );
    assert!(error.to_string().starts_with(
        "the plugin trapped: wasm trap: wasm `unreachable` instruction executed; plugin stderr: "
    ));
    assert!(
        !error.to_string().contains("wasm backtrace"),
        "the caller's message leaves the backtrace to the log: {error}"
    );
    assert_next_request_is_stamped(&plugin);
}

#[test]
fn a_wasm_trap_is_a_trap() {
    let plugin = hostile_plugin(PluginLimits::default());
    let (error, _) = misbehave(&plugin, "trap");
    let CallError::Trap(detail) = &error else {
        panic!("expected a trap, got {error:?}");
    };
    assert!(
        detail.starts_with("wasm trap: wasm `unreachable` instruction executed"),
        "{detail}"
    );
    assert!(
        !detail.contains("plugin stderr"),
        "a bare trap writes nothing to stderr: {detail}"
    );
    assert_next_request_is_stamped(&plugin);
}

/// The longest text the host keeps of a plugin's reject message or error
/// message: 4 KiB, then a note of how much was cut.
const KEPT_TEXT: usize = 4096 + "... (1048576 more bytes cut)".len();

/// A reject message goes to the client: a 1 MiB one (of control
/// characters, six bytes each once escaped in JSON) is cut to 4 KiB.
#[test]
fn a_huge_reject_message_is_cut() {
    let plugin = hostile_plugin(PluginLimits::default());
    match plugin.handle(&request(Some("huge-reject"), &[])) {
        Ok(Action::Reject(r)) => {
            assert_eq!((r.status, r.code.as_str()), (400, "huge"));
            assert!(r.message.len() <= KEPT_TEXT, "{} bytes", r.message.len());
            assert!(
                r.message
                    .ends_with(&format!("... ({} more bytes cut)", (1 << 20) - 4096)),
                "{:?}",
                r.message.get(4000..)
            );
        }
        other => panic!("expected the rejection, got {}", describe(&other)),
    }
    assert_next_request_is_stamped(&plugin);
}

/// A reject code is a short name: a 1 KiB one makes the answer unusable.
#[test]
fn a_reject_code_over_64_bytes_is_an_unusable_answer() {
    let plugin = hostile_plugin(PluginLimits::default());
    let (error, _) = misbehave(&plugin, "huge-code");
    assert_eq!(
        error,
        CallError::InvalidAnswer("a 1024 byte reject code is over the 64 byte limit".to_string())
    );
    assert_next_request_is_stamped(&plugin);
}

/// A plugin's error message goes to the gateway's log: a 1 MiB one is cut
/// to 4 KiB.
#[test]
fn a_huge_plugin_error_message_is_cut() {
    let plugin = hostile_plugin(PluginLimits::default());
    let (error, _) = misbehave(&plugin, "huge-error");
    match &error {
        CallError::PluginError(message) => {
            assert!(message.len() <= KEPT_TEXT, "{} bytes", message.len());
            assert!(
                message.ends_with("more bytes cut)"),
                "{:?}",
                message.get(4000..)
            );
        }
        other => panic!("expected a plugin error, got {other:?}"),
    }
    assert_next_request_is_stamped(&plugin);
}

#[test]
fn a_100_mib_answer_over_the_answer_limit_is_refused() {
    // Memory enough to build the answer, so that the answer limit (the
    // default 64 MiB) is what refuses it.
    let limits = PluginLimits {
        memory_bytes: 256 << 20,
        deadline: Duration::from_secs(30),
        max_output_body_bytes: 64 << 20,
        ..PluginLimits::default()
    };
    let plugin = hostile_plugin(limits);
    let (error, _) = misbehave(&plugin, "huge-body");
    assert_eq!(
        error,
        CallError::InvalidAnswer(
            "a 104857600 byte body is over the 67108864 byte limit".to_string()
        )
    );
    assert_eq!(error.kind(), "invalid_answer");
    assert_next_request_is_stamped(&plugin);
}

/// The echo of a body of `mib` MiB by the fixture set to answer every
/// request with its own body, under an answer limit of `limit_mib`.
fn echo_of(mib: usize, limit_mib: usize) -> Result<Action, CallError> {
    let limits = PluginLimits {
        memory_bytes: 1 << 30,
        deadline: Duration::from_secs(60),
        max_output_body_bytes: limit_mib << 20,
        ..PluginLimits::default()
    };
    let settings = [("hostile-handle".to_string(), "echo".to_string())];
    let plugin = Plugin::load(&engine(limits), HOSTILE_WASM, &settings)
        .unwrap_or_else(|e| panic!("loading the hostile fixture: {e:#}"));
    let mut request = request(None, &[]);
    request.body = vec![b' '; mib << 20];
    plugin.handle(&request)
}

/// wasmtime refuses to take more than 128 MiB from a plugin at once unless
/// told otherwise: an answer within a larger answer limit (a gateway with
/// `--max-body-bytes` over 64 MiB, or `snowgate rewrite` on a large body)
/// must come back whole, not as wasmtime's "fuel allocated for hostcalls
/// has been exhausted" trap.
#[test]
fn an_answer_over_128_mib_within_the_answer_limit_comes_back_whole() {
    match echo_of(130, 260) {
        Ok(Action::ForwardWithBody(body)) => assert_eq!(body.len(), 130 << 20),
        other => panic!("expected the 130 MiB body back, got {}", describe(&other)),
    }
}

/// An answer past what the host takes from a plugin at once (here
/// wasmtime's 128 MiB, as the answer limit is below it) is an unusable
/// answer that says what the limits are, not a trap in wasmtime's words.
/// This also pins the message wasmtime refuses with, which the host
/// recognises (wasmtime does not export its type).
#[test]
fn an_answer_past_the_hostcall_fuel_is_an_unusable_answer() {
    let error = echo_of(130, 64).expect_err("a 130 MiB answer over a 64 MiB limit");
    assert_eq!(
        error,
        CallError::InvalidAnswer(format!(
            "the plugin handed the host more than {} bytes at once (the largest answer body is \
             {} bytes)",
            128 << 20,
            64 << 20
        ))
    );
}

#[test]
fn a_100_mib_answer_over_the_memory_limit_is_stopped_while_being_built() {
    let limits = PluginLimits {
        memory_bytes: 64 << 20,
        deadline: Duration::from_secs(30),
        max_output_body_bytes: 1 << 30,
        ..PluginLimits::default()
    };
    let plugin = hostile_plugin(limits);
    let (error, _) = misbehave(&plugin, "huge-body");
    assert_eq!(error, CallError::MemoryLimit(64 << 20));
    assert_next_request_is_stamped(&plugin);
}

/// The escape attempts the fixture reports, in its order.
const ESCAPE_ATTEMPTS: [&str; 9] = [
    "read_dir_root",
    "open_etc_passwd",
    "create_file",
    "read_dir_cwd",
    "env_vars",
    "args",
    "tcp_connect",
    "udp_bind",
    "stdout",
];

/// Checks an escape report: every attempt failed, except that a write to
/// stdout may "succeed" into the host's sink (see
/// `plugin_stdout_reaches_nothing`); returns the report.
fn assert_escape_failed(report: &[u8]) -> BTreeMap<String, String> {
    let report: BTreeMap<String, String> = serde_json::from_slice(report).unwrap_or_else(|e| {
        panic!(
            "the escape report is not a JSON object of strings ({e}): {}",
            String::from_utf8_lossy(report)
        )
    });
    let mut keys: Vec<&str> = report.keys().map(String::as_str).collect();
    keys.sort_unstable();
    let mut expected = ESCAPE_ATTEMPTS.to_vec();
    expected.sort_unstable();
    assert_eq!(keys, expected, "{report:?}");
    for (attempt, result) in &report {
        if attempt == "stdout" {
            assert!(
                result.starts_with("failed") || result == "succeeded",
                "{attempt}: {result}"
            );
        } else {
            assert!(
                result.starts_with("failed"),
                "the plugin's {attempt} attempt got something: {result}"
            );
        }
    }
    assert_eq!(report["env_vars"], "failed: none");
    assert_eq!(report["args"], "failed: none");
    report
}

/// A loopback listener nobody should connect to; its port.
fn bait_listener() -> (std::net::TcpListener, u16) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("binding a loopback port");
    listener
        .set_nonblocking(true)
        .expect("making the listener non-blocking");
    let port = listener
        .local_addr()
        .expect("the listener's address")
        .port();
    (listener, port)
}

/// Nothing is waiting in `listener`'s backlog: no connection was made.
fn assert_nobody_connected(listener: &std::net::TcpListener) {
    match listener.accept() {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
        Ok((_, peer)) => panic!("the plugin connected to the test's listener from {peer}"),
        Err(e) => panic!("accept failed: {e}"),
    }
}

#[test]
fn files_environment_and_sockets_give_the_plugin_nothing() {
    let plugin = hostile_plugin(PluginLimits::default());
    let (listener, port) = bait_listener();
    // A path of this test's own, so that nothing else made it.
    let dir = TempDir::new("escape");
    let marker_file = dir.0.join("created-by-the-plugin");
    let marker = marker_file.to_str().expect("a UTF-8 temp path");

    let port = port.to_string();
    let answer = plugin.handle(&request(
        Some("escape"),
        &[("x-hostile-port", &port), ("x-hostile-file", marker)],
    ));
    let Ok(Action::ForwardWithBody(report)) = &answer else {
        panic!("expected a report, got {}", describe(&answer));
    };
    let report = assert_escape_failed(report);
    for attempt in [
        "read_dir_root",
        "open_etc_passwd",
        "create_file",
        "read_dir_cwd",
    ] {
        // WASI errno 44: no preopened directory to resolve the path in.
        assert_eq!(
            report[attempt], "failed: No such file or directory (os error 44)",
            "{attempt}"
        );
    }
    for attempt in ["tcp_connect", "udp_bind"] {
        assert!(
            report[attempt].starts_with("failed: Permission denied"),
            "{attempt}: {}",
            report[attempt]
        );
    }
    assert_nobody_connected(&listener);
    assert!(!marker_file.exists(), "the plugin created {marker_file:?}");
    assert_next_request_is_stamped(&plugin);
}

/// Set in the child process of [`plugin_stdout_reaches_nothing`].
const CHILD_ENV: &str = "SNOWGATE_HOSTILE_STDOUT_CHILD";

/// Printed by the child once the escape ran.
const CHILD_DONE: &str = "escape child finished:";

/// Only does something in the child process that
/// [`plugin_stdout_reaches_nothing`] starts: runs `escape` and prints the
/// report to the process's real stdout.
#[test]
fn escape_in_a_child_process() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let plugin = hostile_plugin(PluginLimits::default());
    let answer = plugin.handle(&request(Some("escape"), &[]));
    let Ok(Action::ForwardWithBody(report)) = &answer else {
        panic!("expected a report, got {}", describe(&answer));
    };
    println!("{CHILD_DONE} {}", String::from_utf8_lossy(report));
}

/// The write to stdout that the fixture's report may call "succeeded" goes
/// into the host's sink: the bytes reach neither the process's stdout nor
/// its stderr. Proven in a child process (this test binary, running
/// [`escape_in_a_child_process`] uncaptured) whose output is read whole.
#[test]
fn plugin_stdout_reaches_nothing() {
    let mut child = Command::new(std::env::current_exe().expect("the test binary's path"))
        .args([
            "escape_in_a_child_process",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the test binary as a child");
    let drain = |mut pipe: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            let _ = pipe.read_to_end(&mut text);
            String::from_utf8_lossy(&text).into_owned()
        })
    };
    let stdout = drain(Box::new(child.stdout.take().expect("piped stdout")));
    let stderr = drain(Box::new(child.stderr.take().expect("piped stderr")));
    // Poll the child's exit under a deadline (killing it on timeout).
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("polling the child") {
            break status;
        }
        if started.elapsed() > STEP {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the child test did not finish within {STEP:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = stdout.join().expect("reading the child's stdout");
    let stderr = stderr.join().expect("reading the child's stderr");
    assert!(
        status.success(),
        "the child failed ({status}):\n{stdout}\n{stderr}"
    );
    let report_line = stdout
        .lines()
        .find_map(|line| line.split_once(CHILD_DONE).map(|(_, report)| report.trim()))
        .unwrap_or_else(|| panic!("the child printed no report:\n{stdout}\n{stderr}"));
    let report = assert_escape_failed(report_line.as_bytes());
    assert!(
        !stdout.contains(STDOUT_MARKER) && !stderr.contains(STDOUT_MARKER),
        "the plugin's stdout write (reported {:?}) reached the host process:\n{stdout}\n{stderr}",
        report["stdout"]
    );
}

#[test]
fn a_plugin_for_another_contract_version_is_refused_at_load() {
    let error = Plugin::load(&engine(PluginLimits::default()), WRONG_WORLD_WASM, &[])
        .expect_err("the wrong-world fixture must not load");
    let message = format!("{error:#}");
    assert_eq!(
        message,
        "the plugin was built for snowgate:middleware@0.1.0 (it exports \
         `snowgate:middleware/handler@0.1.0`), but this host implements \
         snowgate:middleware@0.2.1 (and loads plugins built for 0.2.0 and 0.2.1): rebuild it \
         against this snowgate's wit/middleware.wit"
    );
}

/// A component of the right interface names whose `handle` has another
/// signature (the wrong-world fixture relabelled from @0.1.0 to @0.2.1:
/// its `handle` takes an extra argument) is refused naming the function and the type
/// the world wants, not as a trap.
#[test]
fn an_export_of_another_type_is_refused_naming_the_function() {
    let mut bytes = WRONG_WORLD_WASM.to_vec();
    let mut relabelled = 0;
    for at in 0..bytes.len() - 6 {
        if &bytes[at..at + 6] == b"@0.1.0" {
            bytes[at..at + 6].copy_from_slice(b"@0.2.1");
            relabelled += 1;
        }
    }
    assert!(relabelled > 0, "the fixture names its interfaces' version");
    let error = Plugin::load(&engine(PluginLimits::default()), &bytes, &[])
        .expect_err("a handle of another type must not load");
    let message = format!("{error:#}");
    assert!(
        message.contains(
            "the plugin's handle export has another type than the \
                          snowgate:middleware@0.2.1 contract's \
                          `handle: func(request: request) -> result<action, plugin-error>`"
        ),
        "{message}"
    );
    assert!(!message.contains("trapped"), "{message}");
}

// ---------------------------------------------------------------------------
// Gateway level: helpers
// ---------------------------------------------------------------------------

/// A directory under the system temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "snowgate-hostile-{}-{tag}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("creating a temp dir");
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Replaces `path` atomically: writes a temp file next to it, then renames
/// it into place.
fn replace_atomically(path: &Path, bytes: &[u8]) {
    let temp = path.with_extension("wasm.tmp");
    std::fs::write(&temp, bytes).expect("writing the new plugin");
    std::fs::rename(&temp, path).expect("renaming the new plugin into place");
}

/// One request as the upstream received it.
#[derive(Debug, Clone)]
struct Seen {
    headers: HeaderMap,
    body: Bytes,
}

/// A small upstream that records every request and answers 200 with the
/// body it received.
struct RecordingUpstream {
    url: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: JoinHandle<()>,
}

impl RecordingUpstream {
    async fn start() -> RecordingUpstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding the upstream");
        let addr = listener.local_addr().expect("the upstream's address");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let log = log.clone();
                tokio::spawn(async move {
                    let service =
                        hyper::service::service_fn(move |request: http::Request<Incoming>| {
                            let log = log.clone();
                            async move {
                                let (parts, body) = request.into_parts();
                                let body = body
                                    .collect()
                                    .await
                                    .map(|c| c.to_bytes())
                                    .unwrap_or_default();
                                log.lock().unwrap_or_else(|p| p.into_inner()).push(Seen {
                                    headers: parts.headers,
                                    body: body.clone(),
                                });
                                let mut response = http::Response::new(Full::new(body));
                                response.headers_mut().insert(
                                    http::header::CONTENT_TYPE,
                                    http::HeaderValue::from_static("application/json"),
                                );
                                Ok::<_, Infallible>(response)
                            }
                        });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        RecordingUpstream {
            url: format!("http://{addr}"),
            seen,
            task,
        }
    }

    fn count(&self) -> usize {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    fn last(&self) -> Seen {
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .last()
            .cloned()
            .expect("the upstream received a request")
    }
}

impl Drop for RecordingUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An HTTP answer, read whole.
struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("the answer is not JSON ({e}): {}", self.text()))
    }
}

/// Sends one request on a new connection and reads the whole answer,
/// within [`STEP`].
async fn send(addr: SocketAddr, request: http::Request<Full<Bytes>>) -> Reply {
    let what = format!("{} {}", request.method(), request.uri());
    let exchange = async move {
        let stream = TcpStream::connect(addr).await.expect("connecting");
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("HTTP handshake");
        tokio::spawn(connection);
        let response = sender.send_request(request).await.expect("sending");
        let status = response.status();
        let headers = response.headers().clone();
        let body = response
            .into_body()
            .collect()
            .await
            .expect("reading the answer")
            .to_bytes();
        Reply {
            status,
            headers,
            body,
        }
    };
    match tokio::time::timeout(STEP, exchange).await {
        Ok(reply) => reply,
        Err(_) => panic!("{what} took over {STEP:?}"),
    }
}

/// `POST /v1/completions` with a context-only JSON body and `headers`.
async fn post(addr: SocketAddr, headers: &[(&str, &str)]) -> Reply {
    let mut builder = http::Request::builder()
        .method(Method::POST)
        .uri("/v1/completions")
        .header("host", addr.to_string())
        .header("content-type", "application/json");
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let request = builder
        .body(Full::new(Bytes::from_static(CONTEXT_ONLY.as_bytes())))
        .expect("a valid request");
    send(addr, request).await
}

async fn get(addr: SocketAddr, path: &str) -> Reply {
    let request = http::Request::builder()
        .method(Method::GET)
        .uri(path)
        .header("host", addr.to_string())
        .body(Full::new(Bytes::new()))
        .expect("a valid request");
    send(addr, request).await
}

/// A gateway served in this process, with its recording upstream.
struct RunningGateway {
    addr: SocketAddr,
    admin: SocketAddr,
    plugin_path: PathBuf,
    upstream: RecordingUpstream,
    limits: PluginLimits,
    shutdown: Option<oneshot::Sender<()>>,
    served: Option<JoinHandle<anyhow::Result<()>>>,
    _dir: TempDir,
}

/// The configuration the gateway tests start from.
fn gateway_limits() -> PluginLimits {
    PluginLimits {
        deadline: Duration::from_millis(200),
        memory_bytes: 64 << 20,
        ..PluginLimits::default()
    }
}

/// Writes `plugin` into a temp dir and serves a gateway that loads it from
/// there, in front of a new recording upstream.
async fn start_gateway(
    plugin: &[u8],
    policy: FailurePolicy,
    limits: PluginLimits,
) -> RunningGateway {
    start_gateway_with_settings(plugin, policy, limits, &[]).await
}

/// [`start_gateway`], with plugin settings.
async fn start_gateway_with_settings(
    plugin: &[u8],
    policy: FailurePolicy,
    limits: PluginLimits,
    settings: &[(&str, &str)],
) -> RunningGateway {
    let dir = TempDir::new("gateway");
    let plugin_path = dir.0.join("plugin.wasm");
    std::fs::write(&plugin_path, plugin).expect("writing the plugin file");
    let upstream = RecordingUpstream::start().await;
    let config = GatewayConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        admin_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        plugin: Some(plugin_path.clone()),
        plugin_settings: settings
            .iter()
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect(),
        upstream: Some(upstream.url.clone()),
        machine_id: Some(MACHINE_ID),
        failure_policy: policy,
        plugin_limits: limits,
        reload_debounce: Duration::from_millis(50),
        shutdown_grace: Duration::from_secs(5),
        ..GatewayConfig::default()
    };
    let gateway = Gateway::bind(config)
        .await
        .unwrap_or_else(|e| panic!("starting the gateway: {e:#}"));
    let addr = gateway.local_addr().expect("the gateway's address");
    let admin = gateway.admin_addr().expect("the admin address");
    let (shutdown, stop) = oneshot::channel::<()>();
    let served = tokio::spawn(gateway.serve(async move {
        let _ = stop.await;
    }));
    let running = RunningGateway {
        addr,
        admin,
        plugin_path,
        upstream,
        limits,
        shutdown: Some(shutdown),
        served: Some(served),
        _dir: dir,
    };
    // The admin listener is served once the watcher is in place.
    let health = get(admin, "/healthz").await;
    assert_eq!(health.status, StatusCode::OK, "{}", health.text());
    running
}

impl RunningGateway {
    async fn status(&self) -> Value {
        let reply = get(self.admin, "/status").await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        reply.json()
    }

    async fn metrics(&self) -> String {
        let reply = get(self.admin, "/metrics").await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        reply.text()
    }

    /// Polls `/status` until `done` holds, within [`RELOAD_TIMEOUT`].
    async fn wait_for_status(&self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let started = Instant::now();
        loop {
            let status = self.status().await;
            if done(&status) {
                return status;
            }
            assert!(
                started.elapsed() < RELOAD_TIMEOUT,
                "waited {RELOAD_TIMEOUT:?} for {what}; last /status: {status:#}"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Stops the gateway and waits (bounded) for it to finish.
    async fn stop(mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(served) = self.served.take() {
            match tokio::time::timeout(STEP, served).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => panic!("the gateway failed: {e:#}"),
                Ok(Err(e)) => panic!("the gateway task failed: {e}"),
                Err(_) => panic!("the gateway did not stop within {STEP:?}"),
            }
        }
    }

    /// A normal request is stamped and reaches the upstream.
    async fn assert_serves_normally(&self) {
        let before = self.upstream.count();
        let reply = post(self.addr, &[]).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        assert_eq!(self.upstream.count(), before + 1);
        let seen = self.upstream.last();
        assert_stamped(&seen.body);
        assert_eq!(
            reply.body, seen.body,
            "the client gets the upstream's answer"
        );
    }
}

impl Drop for RunningGateway {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }
}

/// One failing behaviour, and how the gateway must describe it.
struct Misbehaviour {
    header: &'static str,
    kind: &'static str,
    /// Fragments the 503 message must contain.
    says: &'static [&'static str],
}

/// The failing behaviours under [`gateway_limits`] (64 MiB: a 100 MiB answer
/// cannot even be built).
const MISBEHAVIOURS: [Misbehaviour; 5] = [
    Misbehaviour {
        header: "loop",
        kind: "deadline",
        says: &["the plugin ran past its 200 ms deadline"],
    },
    Misbehaviour {
        header: "memory-bomb",
        kind: "memory_limit",
        says: &["the plugin tried to use more than its 64 MiB memory limit"],
    },
    Misbehaviour {
        header: "panic",
        kind: "trap",
        says: &["the plugin trapped (the gateway's log has the details)"],
    },
    Misbehaviour {
        header: "trap",
        kind: "trap",
        says: &["the plugin trapped (the gateway's log has the details)"],
    },
    Misbehaviour {
        header: "huge-body",
        kind: "memory_limit",
        says: &["the plugin tried to use more than its 64 MiB memory limit"],
    },
];

/// Failure counts `behaviours` must leave, by kind.
fn expected_failures(behaviours: &[Misbehaviour]) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for b in behaviours {
        *counts.entry(b.kind.to_string()).or_insert(0) += 1;
    }
    counts
}

/// One labelled counter from a Prometheus text page.
fn counter(metrics: &str, series: &str) -> u64 {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {series} in /metrics:\n{metrics}"))
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{series} is not a count: {e}"))
}

/// Asserts every `snowgate_plugin_failures_total` series: the `expected`
/// counts, and 0 for every other kind.
fn assert_failures(metrics: &str, expected: &BTreeMap<String, u64>) {
    let mut seen = BTreeMap::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("snowgate_plugin_failures_total{kind=\"") else {
            continue;
        };
        let (kind, count) = rest
            .split_once("\"} ")
            .unwrap_or_else(|| panic!("unexpected line {line}"));
        seen.insert(
            kind.to_string(),
            count.parse::<u64>().expect("a failure count"),
        );
    }
    for kind in [
        "deadline",
        "memory_limit",
        "trap",
        "plugin_error",
        "invalid_answer",
    ] {
        assert!(seen.contains_key(kind), "no {kind} series:\n{metrics}");
    }
    for (kind, count) in &seen {
        let want = expected.get(kind).copied().unwrap_or(0);
        assert_eq!(
            *count, want,
            "snowgate_plugin_failures_total{{kind=\"{kind}\"}}:\n{metrics}"
        );
    }
}

/// Fail-closed: each behaviour gets a 503 naming the failure, within the
/// deadline plus [`GATEWAY_MARGIN`], without reaching the upstream; the next
/// normal request is stamped. Returns how many requests were stamped.
async fn assert_fail_closed(gateway: &RunningGateway, behaviours: &[Misbehaviour]) -> u64 {
    let deadline = gateway.limits.deadline;
    let mut stamped = 0;
    for b in behaviours {
        let before = gateway.upstream.count();
        let started = Instant::now();
        let reply = post(gateway.addr, &[("x-hostile", b.header)]).await;
        let took = started.elapsed();
        assert_eq!(
            reply.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{}: {}",
            b.header,
            reply.text()
        );
        assert!(
            took < deadline + GATEWAY_MARGIN,
            "{}: answered after {took:?}, over the {deadline:?} deadline plus {GATEWAY_MARGIN:?}",
            b.header
        );
        if b.kind == "deadline" {
            assert!(
                took >= deadline,
                "{}: answered after only {took:?}",
                b.header
            );
        }
        assert_eq!(
            reply.headers.get(http::header::CONTENT_TYPE),
            Some(&http::HeaderValue::from_static("application/json"))
        );
        // A failure the same request would meet again tells OpenAI's
        // clients not to retry it; one that may pass (the deadline) does not.
        let no_retry = b.kind != "deadline";
        assert_eq!(
            reply.headers.get("x-should-retry").map(|v| v.as_bytes()),
            no_retry.then_some(&b"false"[..]),
            "{}",
            b.header
        );
        let error = &reply.json()["error"];
        assert_eq!(error["code"], "middleware_failed", "{}", reply.text());
        assert_eq!(error["type"], "server_error", "{}", reply.text());
        assert_eq!(error["param"], Value::Null, "{}", reply.text());
        let message = error["message"].as_str().expect("a message");
        assert!(
            message.starts_with("the plugin failed, so the request was not forwarded: "),
            "{message}"
        );
        // What the plugin wrote or panicked with stays in the log.
        for private in ["deliberate panic", "plugin stderr", "wasm trap"] {
            assert!(!message.contains(private), "{}: {message}", b.header);
        }
        for fragment in b.says {
            assert!(
                message.contains(fragment),
                "{}: the message does not say {fragment:?}: {message}",
                b.header
            );
        }
        assert_eq!(
            gateway.upstream.count(),
            before,
            "{}: the upstream was called",
            b.header
        );
        gateway.assert_serves_normally().await;
        stamped += 1;
    }
    stamped
}

/// The escape behaviour through the gateway: the plugin's report is what
/// reaches the upstream, every attempt in it failed, and nothing connected
/// to the test's listener.
async fn assert_escape_gets_nothing(gateway: &RunningGateway) {
    let (listener, port) = bait_listener();
    let port = port.to_string();
    let reply = post(
        gateway.addr,
        &[("x-hostile", "escape"), ("x-hostile-port", &port)],
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_escape_failed(&gateway.upstream.last().body);
    assert_nobody_connected(&listener);
}

// ---------------------------------------------------------------------------
// Gateway level: tests
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fail_closed_gateway_contains_a_hostile_plugin_loaded_at_start() {
    let gateway = start_gateway(HOSTILE_WASM, FailurePolicy::FailClosed, gateway_limits()).await;
    let status = gateway.status().await;
    assert_eq!(status["plugin"]["name"], HOSTILE_NAME, "{status:#}");
    assert_eq!(status["failure_policy"], "fail-closed");

    gateway.assert_serves_normally().await;
    let stamped = assert_fail_closed(&gateway, &MISBEHAVIOURS).await;
    assert_escape_gets_nothing(&gateway).await;

    let metrics = gateway.metrics().await;
    assert_failures(&metrics, &expected_failures(&MISBEHAVIOURS));
    assert_eq!(
        counter(
            &metrics,
            "snowgate_requests_total{outcome=\"failed_closed\"}"
        ),
        MISBEHAVIOURS.len() as u64
    );
    assert_eq!(
        counter(&metrics, "snowgate_requests_total{outcome=\"failed_open\"}"),
        0
    );
    // The first normal request, one after each failure, and the escape
    // report (a rewritten body).
    assert_eq!(
        counter(&metrics, "snowgate_requests_total{outcome=\"rewritten\"}"),
        1 + stamped + 1
    );
    gateway.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fail_open_gateway_forwards_unchanged_when_a_hostile_plugin_fails() {
    let gateway = start_gateway(HOSTILE_WASM, FailurePolicy::FailOpen, gateway_limits()).await;
    let deadline = gateway.limits.deadline;
    for b in &MISBEHAVIOURS {
        let before = gateway.upstream.count();
        let started = Instant::now();
        let reply = post(gateway.addr, &[("x-hostile", b.header)]).await;
        let took = started.elapsed();
        assert_eq!(
            reply.status,
            StatusCode::OK,
            "{}: {}",
            b.header,
            reply.text()
        );
        assert!(
            took < deadline + GATEWAY_MARGIN,
            "{}: answered after {took:?}",
            b.header
        );
        assert_eq!(gateway.upstream.count(), before + 1, "{}", b.header);
        let seen = gateway.upstream.last();
        assert_eq!(
            seen.body,
            CONTEXT_ONLY.as_bytes(),
            "{}: the upstream did not get the body unchanged",
            b.header
        );
        assert_eq!(
            seen.headers.get("x-hostile").map(|v| v.as_bytes()),
            Some(b.header.as_bytes())
        );
        assert_eq!(reply.body, CONTEXT_ONLY.as_bytes(), "{}", b.header);
        gateway.assert_serves_normally().await;
    }
    let metrics = gateway.metrics().await;
    assert_failures(&metrics, &expected_failures(&MISBEHAVIOURS));
    assert_eq!(
        counter(&metrics, "snowgate_requests_total{outcome=\"failed_open\"}"),
        MISBEHAVIOURS.len() as u64
    );
    assert_eq!(
        counter(
            &metrics,
            "snowgate_requests_total{outcome=\"failed_closed\"}"
        ),
        0
    );
    gateway.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sleeping_plugins_cannot_hold_the_gateways_calls() {
    // More sleeping requests at once than the gateway runs calls at once:
    // if a sleep held its call, the last ones would queue behind minutes
    // of sleeping.
    let gateway = start_gateway(HOSTILE_WASM, FailurePolicy::FailClosed, gateway_limits()).await;
    let deadline = gateway.limits.deadline;
    let clients = gateway.limits.concurrent_calls() as usize * 2;
    let started = Instant::now();
    let mut sleepers = tokio::task::JoinSet::new();
    for _ in 0..clients {
        let addr = gateway.addr;
        sleepers.spawn(async move { post(addr, &[("x-hostile", "sleep")]).await });
    }
    let replies = sleepers.join_all().await;
    let took = started.elapsed();
    for reply in &replies {
        assert_eq!(
            reply.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{}",
            reply.text()
        );
        let message = reply.json()["error"]["message"]
            .as_str()
            .unwrap_or("")
            .to_string();
        assert!(
            message.contains("the plugin ran past its 200 ms deadline"),
            "{message}"
        );
    }
    assert!(
        took < deadline + GATEWAY_MARGIN,
        "{clients} sleeping requests took {took:?}"
    );
    assert_eq!(gateway.upstream.count(), 0, "fail-closed forwards nothing");
    gateway.assert_serves_normally().await;
    // A short sleep inside the deadline works on the gateway's workers: the
    // call waits on the worker's own timer, and the request is stamped.
    let nap = post(gateway.addr, &[("x-hostile", "nap")]).await;
    assert_eq!(nap.status, StatusCode::OK, "{}", nap.text());
    assert_stamped(&gateway.upstream.last().body);
    let metrics = gateway.metrics().await;
    assert_eq!(
        counter(
            &metrics,
            "snowgate_plugin_failures_total{kind=\"deadline\"}"
        ),
        clients as u64
    );
    gateway.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_100_mib_answer_is_refused_by_the_gateway() {
    // Memory enough to build the answer and time enough to build it in a
    // debug build: the answer limit is what refuses it.
    let limits = PluginLimits {
        memory_bytes: 256 << 20,
        deadline: Duration::from_secs(30),
        max_output_body_bytes: 64 << 20,
        ..PluginLimits::default()
    };
    let gateway = start_gateway(HOSTILE_WASM, FailurePolicy::FailClosed, limits).await;
    let huge = [Misbehaviour {
        header: "huge-body",
        kind: "invalid_answer",
        says: &["the plugin gave an unusable answer: a 104857600 byte body is over the 67108864 byte limit"],
    }];
    assert_fail_closed(&gateway, &huge).await;
    assert_failures(&gateway.metrics().await, &expected_failures(&huge));
    gateway.stop().await;
}

/// Through the gateway, a plugin reads the client's headers (the
/// gateway's own `x-forwarded-for` included) through the
/// `request-headers` import: the values of one name together, in the
/// order the client sent them, and `get` by any case. The hop-by-hop
/// headers are gone, and the others keep their order (removing them from
/// the map in place moved the last header into the first one's place).
/// What it answers is what the upstream receives.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_plugin_reads_the_clients_headers_through_the_gateway() {
    let gateway = start_gateway(HOSTILE_WASM, FailurePolicy::FailClosed, gateway_limits()).await;
    let reply = post(
        gateway.addr,
        &[
            ("connection", "keep-alive, x-drop"),
            ("accept", "text/a"),
            ("x-drop", "1"),
            ("x-hostile", "headers"),
            ("keep-alive", "timeout=5"),
            ("x-hostile-get", "ACCEPT"),
            ("accept", "text/b"),
            ("x-last", "z"),
        ],
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let report = String::from_utf8(gateway.upstream.last().body.to_vec()).expect("UTF-8");
    let entries = report
        .lines()
        .find_map(|l| l.strip_prefix("entries="))
        .expect("the entries");
    let accept = entries
        .find(r#"("accept", "text/a"), ("accept", "text/b")"#)
        .expect("both accept values, together and in order");
    let marker = entries
        .find(r#"("x-hostile", "headers")"#)
        .expect("the marker header");
    assert!(
        accept < marker,
        "names in the order they first came: {entries}"
    );
    assert!(
        entries.contains(r#"("x-forwarded-for", "127.0.0.1")"#),
        "{entries}"
    );
    let mut names: Vec<&str> = entries
        .split("(\"")
        .skip(1)
        .filter_map(|entry| entry.split('"').next())
        .collect();
    names.dedup();
    let sent = [
        "host",
        "content-type",
        "accept",
        "x-hostile",
        "x-hostile-get",
        "x-last",
    ];
    assert_eq!(names[..sent.len()], sent, "{entries}");
    for gone in ["connection", "keep-alive", "x-drop"] {
        assert!(!names.contains(&gone), "{gone}: {entries}");
    }
    assert!(
        report.contains("\nget=[\"text/a\", \"text/b\"]\n"),
        "{report}"
    );
    assert!(
        report.ends_with("configure-entries=0\nconfigure-get=0"),
        "{report}"
    );
    gateway.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wrong_world_plugin_keeps_the_gateway_from_starting() {
    let dir = TempDir::new("wrong-world");
    let path = dir.0.join("plugin.wasm");
    std::fs::write(&path, WRONG_WORLD_WASM).expect("writing the plugin file");
    let config = GatewayConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        admin_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        plugin: Some(path.clone()),
        machine_id: Some(MACHINE_ID),
        ..GatewayConfig::default()
    };
    let Err(error) = Gateway::bind(config).await else {
        panic!("a gateway started with the wrong-world plugin");
    };
    assert_eq!(
        format!("{error:#}"),
        format!(
            "loading the plugin {}: the plugin was built for snowgate:middleware@0.1.0 (it exports \
             `snowgate:middleware/handler@0.1.0`), but this host implements \
             snowgate:middleware@0.2.1 (and loads plugins built for 0.2.0 and 0.2.1): rebuild \
             it against this snowgate's wit/middleware.wit",
            path.display()
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hostile_plugin_swapped_in_live_is_contained_and_a_wrong_world_one_is_refused() {
    let gateway = start_gateway(PLUGIN_WASM, FailurePolicy::FailClosed, gateway_limits()).await;
    let status = gateway.status().await;
    assert_eq!(status["plugin"]["name"], REAL_NAME, "{status:#}");
    // The real plugin ignores the header: the failures below are the swap's.
    let reply = post(gateway.addr, &[("x-hostile", "trap")]).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_stamped(&gateway.upstream.last().body);

    replace_atomically(&gateway.plugin_path, HOSTILE_WASM);
    let status = gateway
        .wait_for_status("the hostile plugin to be swapped in", |s| {
            s["plugin"]["name"] == HOSTILE_NAME
        })
        .await;
    assert_eq!(status["reloads"]["succeeded"], 1, "{status:#}");
    assert_eq!(status["reloads"]["failed"], 0, "{status:#}");
    assert_eq!(status["last_reload_error"], Value::Null, "{status:#}");

    assert_fail_closed(&gateway, &MISBEHAVIOURS).await;
    assert_escape_gets_nothing(&gateway).await;
    assert_failures(&gateway.metrics().await, &expected_failures(&MISBEHAVIOURS));

    replace_atomically(&gateway.plugin_path, WRONG_WORLD_WASM);
    let status = gateway
        .wait_for_status("the wrong-world plugin to be refused", |s| {
            !s["last_reload_error"].is_null()
        })
        .await;
    let message = status["last_reload_error"]["message"]
        .as_str()
        .expect("a reload error message");
    assert_eq!(
        message,
        format!(
            "loading the plugin {}: the plugin was built for snowgate:middleware@0.1.0 (it exports \
             `snowgate:middleware/handler@0.1.0`), but this host implements \
             snowgate:middleware@0.2.1 (and loads plugins built for 0.2.0 and 0.2.1): rebuild \
             it against this snowgate's wit/middleware.wit",
            gateway.plugin_path.display()
        )
    );
    assert_eq!(status["plugin"]["name"], HOSTILE_NAME, "{status:#}");
    assert_eq!(status["reloads"]["succeeded"], 1, "{status:#}");
    assert_eq!(status["reloads"]["failed"], 1, "{status:#}");

    // The hostile build still serves: normal requests are stamped, and its
    // misbehaviour is still contained.
    gateway.assert_serves_normally().await;
    let trap = [Misbehaviour {
        header: "trap",
        kind: "trap",
        says: &["the plugin trapped (the gateway's log has the details)"],
    }];
    assert_fail_closed(&gateway, &trap).await;
    let mut expected = expected_failures(&MISBEHAVIOURS);
    *expected.entry("trap".to_string()).or_insert(0) += 1;
    let metrics = gateway.metrics().await;
    assert_failures(&metrics, &expected);
    assert_eq!(
        counter(&metrics, "snowgate_reloads_total{result=\"succeeded\"}"),
        1
    );
    assert_eq!(
        counter(&metrics, "snowgate_reloads_total{result=\"failed\"}"),
        1
    );
    gateway.stop().await;
}

/// A plugin that writes to stderr while it is configured (which the host
/// does at load time) loads in a gateway started from async code, and
/// serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_writing_stderr_at_load_time_starts_a_gateway() {
    let gateway = start_gateway_with_settings(
        HOSTILE_WASM,
        FailurePolicy::FailClosed,
        gateway_limits(),
        &[("hostile-configure", "stderr")],
    )
    .await;
    let reply = post(gateway.addr, &[]).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_stamped(&gateway.upstream.last().body);
    gateway.stop().await;
}
