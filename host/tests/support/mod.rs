//! Helpers shared by the gateway's end-to-end tests: the real `snowgate`
//! binary as a child process, a recording hyper upstream in the test
//! process, HTTP clients (hyper, and raw bytes over TCP for exact control),
//! and distinct builds of the real plugin for reload tests.
//!
//! Every wait is bounded, so a failure fails a test instead of hanging it;
//! nothing sleeps in place of synchronisation (the only loops that pause
//! poll an observable state, such as `/status`, under a deadline).
//!
//! Each test file compiles this module on its own and uses only part of it.
#![allow(dead_code)]

use std::collections::HashSet;
use std::convert::Infallible;
use std::io::{BufRead as _, BufReader as StdBufReader, Read as _};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use sha2::{Digest, Sha256};
use snowgate_plugin::SnowflakeLayout;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Notify};

/// `snowgate serve` on ephemeral loopback ports: the first arguments of
/// every gateway a test starts.
pub const SERVE_ON_LOOPBACK: [&str; 5] = [
    "serve",
    "--listen",
    "127.0.0.1:0",
    "--admin-listen",
    "127.0.0.1:0",
];

/// The machine id every gateway gets unless a test passes its own.
pub const MACHINE_ID: u32 = 7;

/// The longest a gateway may take to print its ready line. Compiling the
/// plugin in a debug build takes seconds, more while other tests compile
/// theirs.
pub const START_TIMEOUT: Duration = Duration::from_secs(90);

/// The longest one request (or one step of a test) may take.
pub const STEP: Duration = Duration::from_secs(30);

/// The longest a plugin reload may take to show on `/status`: a compile in
/// a debug build, possibly queued behind another.
pub const RELOAD_TIMEOUT: Duration = Duration::from_secs(60);

/// A context-only body: the plugin must stamp it.
/// How the self-check's refusals name its second call, the canned request
/// again on the same instance.
pub const SELF_CHECK_SECOND_CALL: &str =
    "a canned context-only request again (its instance's second call)";

/// How the self-check's refusals name its third call, the batch.
pub const SELF_CHECK_BATCH: &str =
    "a canned batch of two context-only requests (its instance's third call)";

pub const CONTEXT_ONLY: &str = r#"{"model":"m","prompt":"Hello","max_tokens":16,"stream":false,"disaggregated_params":{"request_type":"context_only"}}"#;

/// Runs `command` with `stdin` on its standard input and waits for it, for
/// at most `bound`: one that runs longer (a `serve` that should have been
/// refused and started instead, a `rewrite` stuck on a lock) is killed and
/// fails its test, instead of hanging the suite.
pub fn run_bounded(command: Command, stdin: &[u8], bound: Duration) -> std::process::Output {
    run_bounded_with_stderr(command, stdin, bound, Stdio::piped())
}

/// A child process, killed and reaped when dropped, however the test ends.
pub struct Reaped(pub std::process::Child);

impl Reaped {
    /// Waits at most `bound` for the process to exit by itself; its exit
    /// status. Fails the test if it has not exited by then.
    pub fn exit_within(&mut self, bound: Duration) -> ExitStatus {
        let deadline = Instant::now() + bound;
        loop {
            if let Some(status) = self.0.try_wait().expect("waiting for the process") {
                return status;
            }
            assert!(Instant::now() < deadline, "still running after {bound:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// [`run_bounded`], with the command's stderr going to `stderr` (where it
/// is not piped, the output's `stderr` is empty).
pub fn run_bounded_with_stderr(
    mut command: Command,
    stdin: &[u8],
    bound: Duration,
    stderr: Stdio,
) -> std::process::Output {
    use std::io::Write as _;
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("starting snowgate");
    let pid = child.id() as libc::pid_t;
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        let overran = matches!(
            finished.recv_timeout(bound),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout)
        );
        if overran {
            // SAFETY: kill only sends a signal; the child is not yet
            // reaped (the test thread reaps it only once this thread has
            // ended), so `pid` is still it.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        overran
    });
    let mut input = child.stdin.take().expect("stdin is piped");
    // A command that fails before reading stdin closes it: ignore EPIPE.
    let _ = input.write_all(stdin);
    drop(input);
    let errors = child.stderr.take().map(|mut stderr| {
        std::thread::spawn(move || {
            let mut text = Vec::new();
            let _ = std::io::Read::read_to_end(&mut stderr, &mut text);
            text
        })
    });
    let mut stdout = Vec::new();
    if let Some(mut out) = child.stdout.take() {
        let _ = std::io::Read::read_to_end(&mut out, &mut stdout);
    }
    let stderr = errors.map_or_else(Vec::new, |errors| errors.join().expect("stderr"));
    // Its end waited for without reaping it, before the watchdog is told:
    // reaped first, its pid could be another process's by the time the
    // watchdog's kill went out (the unsafe-code review).
    snowgate_host::compile_process::wait_unreaped(pid).expect("waiting for snowgate to end");
    let _ = done.send(());
    let overran = watchdog.join().expect("the watchdog");
    let status = child.wait().expect("waiting for snowgate");
    let output = std::process::Output {
        status,
        stdout,
        stderr,
    };
    assert!(
        !overran,
        "{command:?} ran past {bound:?} and was killed; stderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// libfaketime's library (Debian's `libfaketime`, which `.ci/run`
/// installs), or `None` (and a message, see [`tool_present`]) where it is
/// missing.
pub fn faketime() -> Option<PathBuf> {
    let found = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path().join("faketime/libfaketime.so.1"))
        .find(|path| path.exists());
    tool_present(
        found.is_some(),
        "libfaketime",
        "apt-get install libfaketime",
    )
    .then(|| found.expect("present"))
}

/// Whether a tool a test needs (`tool`, installed with `install`) is
/// here. Where it is missing the test is skipped (it prints `SKIPPED`), but
/// not in CI (`CI` set), where `.ci/run` installs it: there it fails.
pub fn tool_present(present: bool, tool: &str, install: &str) -> bool {
    if !present {
        assert!(
            std::env::var_os("CI").is_none(),
            "{tool} is missing; CI must install it ({install}; see .ci/run)"
        );
        eprintln!("SKIPPED: {tool} not found ({install})");
    }
    present
}

/// Sends process `pid` the signal named `signal` (`TERM`, `INT`, `HUP`,
/// `KILL`, `STOP`, `CONT`), at once: through `kill(2)`, not a `kill`
/// process, whose start could take longer than a test's window between
/// two signals.
pub fn send_signal(pid: u32, signal: &str) -> std::io::Result<()> {
    let number = match signal {
        "TERM" => libc::SIGTERM,
        "INT" => libc::SIGINT,
        "HUP" => libc::SIGHUP,
        "KILL" => libc::SIGKILL,
        "STOP" => libc::SIGSTOP,
        "CONT" => libc::SIGCONT,
        other => panic!("no signal named {other} here"),
    };
    // SAFETY: kill only sends a signal.
    if unsafe { libc::kill(pid as libc::pid_t, number) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Awaits `future` for at most `bound`, panicking with `what` on timeout.
pub async fn bounded<F: std::future::Future>(what: &str, bound: Duration, future: F) -> F::Output {
    match tokio::time::timeout(bound, future).await {
        Ok(output) => output,
        Err(_) => panic!("timed out after {bound:?}: {what}"),
    }
}

// ---------------------------------------------------------------------------
// The gateway process
// ---------------------------------------------------------------------------

/// Exit status of a child, set once by the thread that reaps it.
#[derive(Default)]
struct Exit {
    status: Mutex<Option<ExitStatus>>,
    changed: Condvar,
}

impl Exit {
    fn wait(&self, bound: Duration) -> Option<ExitStatus> {
        let guard = self.status.lock().unwrap_or_else(|p| p.into_inner());
        let (guard, _) = self
            .changed
            .wait_timeout_while(guard, bound, |s| s.is_none())
            .unwrap_or_else(|p| p.into_inner());
        *guard
    }

    fn get(&self) -> Option<ExitStatus> {
        *self.status.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The gateway's stderr as read so far.
#[derive(Default)]
struct Log {
    text: Mutex<String>,
    grew: Condvar,
}

/// A running `snowgate serve`, killed when dropped.
pub struct Gateway {
    pid: u32,
    /// Where clients connect.
    pub addr: SocketAddr,
    /// Where the admin endpoints are.
    pub admin: SocketAddr,
    /// The line the gateway printed on stdout once ready.
    pub ready_line: String,
    exit: Arc<Exit>,
    stderr: Arc<Log>,
}

impl Gateway {
    /// Starts `snowgate serve` on ephemeral loopback ports with `args`
    /// (plus `--machine-id 7` unless `args` name one or `--etcd`) and waits for its
    /// ready line and for `/healthz`.
    pub async fn start(args: &[&str]) -> Gateway {
        Gateway::start_logging(args, "info").await
    }

    /// [`Gateway::start`], with `filter` as the log filter (`SNOWGATE_LOG`).
    pub async fn start_logging(args: &[&str], filter: &str) -> Gateway {
        Gateway::start_signalled(args, filter, None, &[]).await
    }

    /// [`Gateway::start`], with `env` added to the process's environment.
    pub async fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Gateway {
        Gateway::start_signalled(args, "info", None, env).await
    }

    /// [`Gateway::start`], sending the process `signal` as soon as its log
    /// shows `needle`, while it starts.
    pub async fn start_signalled_on_log(args: &[&str], needle: &str, signal: &str) -> Gateway {
        Gateway::start_signalled(args, "info", Some((needle, signal)), &[]).await
    }

    async fn start_signalled(
        args: &[&str],
        filter: &str,
        signal_on_log: Option<(&str, &str)>,
        env: &[(&str, &str)],
    ) -> Gateway {
        let mut command = Command::new(env!("CARGO_BIN_EXE_snowgate"));
        command
            .args(SERVE_ON_LOOPBACK)
            .args(args)
            .envs(env.iter().copied());
        if !args.contains(&"--machine-id") && !args.contains(&"--etcd") {
            command.args(["--machine-id", &MACHINE_ID.to_string()]);
        }
        let mut child = command
            .env("SNOWGATE_LOG", filter)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the snowgate binary starts");
        let pid = child.id();
        let stdout = child.stdout.take().expect("piped stdout");
        let mut stderr_pipe = child.stderr.take().expect("piped stderr");

        let stderr = Arc::new(Log::default());
        let sink = stderr.clone();
        let stderr_reader = std::thread::spawn(move || {
            let mut buffer = [0u8; 4096];
            while let Ok(n) = stderr_pipe.read(&mut buffer) {
                if n == 0 {
                    break;
                }
                sink.text
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push_str(&String::from_utf8_lossy(&buffer[..n]));
                sink.grew.notify_all();
            }
        });

        if let Some((needle, signal)) = signal_on_log {
            let (log, needle, signal) = (stderr.clone(), needle.to_string(), signal.to_string());
            std::thread::spawn(move || {
                let text = log.text.lock().unwrap_or_else(|p| p.into_inner());
                let (text, _) = log
                    .grew
                    .wait_timeout_while(text, START_TIMEOUT, |t| !t.contains(&needle))
                    .unwrap_or_else(|p| p.into_inner());
                if text.contains(&needle) {
                    let _ = Command::new("kill")
                        .args([format!("-{signal}"), pid.to_string()])
                        .status();
                }
            });
        }

        // Reap the child on a thread, so that waiting for its exit is an
        // event, not a poll. The exit is announced only once its whole
        // stderr has been read.
        let exit = Arc::new(Exit::default());
        let reaper = exit.clone();
        std::thread::spawn(move || {
            let status = child.wait().expect("waiting for the gateway");
            let _ = stderr_reader.join();
            *reaper.status.lock().unwrap_or_else(|p| p.into_inner()) = Some(status);
            reaper.changed.notify_all();
        });

        let (line_tx, line_rx) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || {
            let mut reader = StdBufReader::new(stdout);
            let mut line = String::new();
            let _ = reader.read_line(&mut line);
            let _ = line_tx.send(line);
            // Keep draining so the pipe never fills.
            let mut rest = Vec::new();
            let _ = reader.read_to_end(&mut rest);
        });

        let mut gateway = Gateway {
            pid,
            addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            admin: SocketAddr::from(([0, 0, 0, 0], 0)),
            ready_line: String::new(),
            exit,
            stderr,
        };
        let line = match tokio::time::timeout(START_TIMEOUT, line_rx).await {
            Ok(Ok(line)) if !line.is_empty() => line,
            other => panic!(
                "the gateway printed no ready line ({}); stderr:\n{}",
                match other {
                    Err(_) => "timed out".to_string(),
                    _ => "stdout closed".to_string(),
                },
                gateway.stderr_text()
            ),
        };
        gateway.addr = address_after(&line, "snowgate listening on http://");
        gateway.admin = address_after(&line, "(admin http://");
        gateway.ready_line = line;

        // The reload triggers (file watcher, SIGHUP) are in place before
        // the ready line, from `Gateway::bind`; the worker event loops are
        // made after it, in `Gateway::serve`, which serves the admin
        // listener only once they exist. So one admin answer means the
        // gateway is wholly set up.
        let health = get(gateway.admin, "/healthz").await;
        // With an admin token, an unauthenticated /healthz is 401: also up.
        assert!(
            health.status == StatusCode::OK || health.status == StatusCode::UNAUTHORIZED,
            "{}",
            health.text()
        );
        gateway
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Sends a signal (`TERM`, `INT`, `HUP`, `KILL`, `STOP`, `CONT`), at
    /// once (see [`send_signal`]).
    pub fn signal(&self, signal: &str) {
        send_signal(self.pid, signal)
            .unwrap_or_else(|e| panic!("kill -{signal} {}: {e}", self.pid));
    }

    /// Stops it as an operator does (SIGTERM) and checks that it exits
    /// cleanly within [`STEP`].
    pub async fn stop(&self) {
        self.signal("TERM");
        let status = self.wait_exit(STEP).await;
        assert!(
            status.success(),
            "SIGTERM: {status}; stderr:\n{}",
            self.stderr_text()
        );
    }

    /// Waits for the process to exit, at most `bound`.
    pub async fn wait_exit(&self, bound: Duration) -> ExitStatus {
        let exit = self.exit.clone();
        let status = tokio::task::spawn_blocking(move || exit.wait(bound))
            .await
            .expect("the exit waiter");
        status.unwrap_or_else(|| {
            panic!(
                "the gateway did not exit within {bound:?}; stderr:\n{}",
                self.stderr_text()
            )
        })
    }

    /// Whether the process has exited.
    pub fn exited(&self) -> Option<ExitStatus> {
        self.exit.get()
    }

    /// Everything the gateway wrote to stderr so far (its log).
    pub fn stderr_text(&self) -> String {
        self.stderr
            .text
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Waits (at most [`STEP`]) until the gateway's log contains `needle`:
    /// the log arrives through a pipe, a little after the event it reports.
    pub async fn wait_log(&self, needle: &str) {
        self.wait_log_times(needle, 1).await
    }

    /// Waits (at most [`STEP`]) until the gateway's log contains `needle`
    /// at least `times` times.
    pub async fn wait_log_times(&self, needle: &str, times: usize) {
        let wanted = needle.to_string();
        self.wait_log_until(&format!("{needle:?} {times} times"), move |text| {
            text.matches(&wanted).count() >= times
        })
        .await
    }

    /// Waits (at most [`STEP`]) until `done` holds for the gateway's log
    /// so far; `what` names the wait in the failure message.
    pub async fn wait_log_until(&self, what: &str, done: impl Fn(&str) -> bool + Send + 'static) {
        let log = self.stderr.clone();
        let found = tokio::task::spawn_blocking(move || {
            let text = log.text.lock().unwrap_or_else(|p| p.into_inner());
            let (text, _) = log
                .grew
                .wait_timeout_while(text, STEP, |t| !done(t))
                .unwrap_or_else(|p| p.into_inner());
            done(&text)
        })
        .await
        .expect("the log waiter");
        assert!(
            found,
            "the gateway never logged {what}; stderr:\n{}",
            self.stderr_text()
        );
    }

    /// `GET /status` on the admin listener, parsed.
    pub async fn status(&self) -> Value {
        let reply = get(self.admin, "/status").await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        reply.json()
    }

    /// `GET /metrics` on the admin listener.
    /// Every fetch is held to the exposition format
    /// ([`assert_exposition`]).
    pub async fn metrics(&self) -> String {
        let reply = get(self.admin, "/metrics").await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        let text = reply.text().to_string();
        assert_exposition(&text);
        text
    }

    /// Polls `/status` (every 20 ms, at most `bound`) until `done` holds;
    /// returns that status.
    pub async fn wait_status(
        &self,
        what: &str,
        bound: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + bound;
        loop {
            let status = self.status().await;
            if done(&status) {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {bound:?} waiting for {what}; last /status: {status:#}\nstderr:\n{}",
                self.stderr_text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Polls `/metrics` (every 20 ms, at most [`STEP`]) until the sample
    /// `sample` reads `value`; returns that text.
    pub async fn wait_metric(&self, sample: &str, value: f64) -> String {
        self.wait_metric_where(sample, &format!("{value}"), |v| v == value)
            .await
    }

    /// Polls `/metrics` until `sample`'s value passes `check` (`what` says
    /// what it waits for, for the failure message), at most [`STEP`];
    /// returns the last text.
    pub async fn wait_metric_where(
        &self,
        sample: &str,
        what: &str,
        check: impl Fn(f64) -> bool,
    ) -> String {
        let waited_for = format!("{sample} {what}");
        self.wait_metrics_until(&waited_for, |text| check(metric(text, sample)))
            .await
    }

    /// Polls `/metrics` (every 20 ms, at most [`STEP`]) until its text
    /// passes `done` (`what` says what it waits for, for the failure
    /// message); returns that text.
    pub async fn wait_metrics_until(&self, what: &str, done: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + STEP;
        loop {
            let text = self.metrics().await;
            if done(&text) {
                return text;
            }
            assert!(
                Instant::now() < deadline,
                "timed out after {STEP:?} waiting for {what}; last /metrics:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The serving plugin's SHA-256, from `/status`.
    pub async fn plugin_sha(&self) -> String {
        self.status().await["plugin"]["sha256"]
            .as_str()
            .expect("plugin.sha256 is a string")
            .to_string()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if self.exit.get().is_none() {
            let _ = Command::new("kill")
                .args(["-KILL", &self.pid.to_string()])
                .status();
            self.exit.wait(Duration::from_secs(10));
        }
        if std::thread::panicking() {
            eprintln!("--- gateway stderr ---\n{}", self.stderr_text());
        }
    }
}

fn address_after(line: &str, marker: &str) -> SocketAddr {
    let start = line
        .find(marker)
        .unwrap_or_else(|| panic!("no {marker:?} in the ready line {line:?}"))
        + marker.len();
    let rest = &line[start..];
    let end = rest
        .find(|c: char| {
            !(c.is_ascii_alphanumeric() || c == '.' || c == ':' || c == '[' || c == ']')
        })
        .unwrap_or(rest.len());
    rest[..end]
        .parse()
        .unwrap_or_else(|e| panic!("bad address {:?} in {line:?}: {e}", &rest[..end]))
}

// ---------------------------------------------------------------------------
// The test upstream
// ---------------------------------------------------------------------------

/// One request the upstream received.
#[derive(Debug, Clone)]
pub struct Seen {
    /// The method.
    pub method: Method,
    /// Path and query.
    pub path: String,
    /// Headers as received.
    pub headers: HeaderMap,
    /// The whole body.
    pub body: Bytes,
}

impl Seen {
    /// A header's value as text (`None`: absent).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("ASCII header"))
    }
}

/// What the upstream shares with the test.
#[derive(Default)]
pub struct UpstreamState {
    seen: Mutex<Vec<Seen>>,
    /// Signalled when a `/hold` request has arrived.
    pub held: Notify,
    /// Lets a `/hold` request answer.
    pub release: Notify,
    /// Lets a `/sse` stream send its second event.
    pub sse_release: Notify,
    /// Connections the gateway has opened so far.
    pub accepted: AtomicU64,
    /// Connections the gateway has closed so far.
    pub closed: AtomicU64,
    /// Signalled when the gateway closes a connection.
    pub closed_one: Notify,
}

/// A connection to `gateway` with a `GET /hold` in flight, held by
/// `upstream` until released.
pub async fn held_request(gateway: &Gateway, upstream: &TestUpstream) -> tokio::net::TcpStream {
    let mut stream = tokio::net::TcpStream::connect(gateway.addr)
        .await
        .expect("connect");
    tokio::io::AsyncWriteExt::write_all(&mut stream, b"GET /hold HTTP/1.1\r\nHost: gw\r\n\r\n")
        .await
        .expect("a held request");
    bounded(
        "the held request upstream",
        STEP,
        upstream.state.held.notified(),
    )
    .await;
    stream
}

/// An HTTP/1.1 upstream in the test process, on 127.0.0.1:0. It records
/// every request and answers by path:
/// - `/sse…`: a `text/event-stream` that sends `event 1`, waits for
///   [`UpstreamState::sse_release`], then sends `event 2` and `[DONE]`;
/// - `/hold…`: signals [`UpstreamState::held`], waits for
///   [`UpstreamState::release`], then answers 200 `released`;
/// - `/hop…`: answers 200 with hop-by-hop headers the gateway must drop;
/// - anything else: 200 with the request body echoed back, the request's
///   content type, and `x-upstream: seen`.
pub struct TestUpstream {
    /// Where it listens.
    pub addr: SocketAddr,
    /// What it saw, and its signals.
    pub state: Arc<UpstreamState>,
    accept: tokio::task::JoinHandle<()>,
}

type UpstreamBody = BoxBody<Bytes, Infallible>;

impl TestUpstream {
    /// Binds and starts serving.
    pub async fn start() -> TestUpstream {
        TestUpstream::start_at("127.0.0.1:0").await
    }

    /// Binds `addr` and starts serving.
    pub async fn start_at(addr: &str) -> TestUpstream {
        let listener = TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("bind upstream at {addr}: {e}"));
        let addr = listener.local_addr().expect("upstream address");
        let state = Arc::new(UpstreamState::default());
        let shared = state.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let state = shared.clone();
                state.accepted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let per_request = state.clone();
                    let service = hyper::service::service_fn(move |request| {
                        let state = per_request.clone();
                        async move { Ok::<_, Infallible>(upstream_answer(state, request).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                    state.closed.fetch_add(1, Ordering::SeqCst);
                    state.closed_one.notify_one();
                });
            }
        });
        TestUpstream {
            addr,
            state,
            accept,
        }
    }

    /// `http://ADDR`, for `--upstream`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request received so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.state
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The one request received; panics unless there was exactly one.
    pub fn only_seen(&self) -> Seen {
        let seen = self.seen();
        assert_eq!(
            seen.len(),
            1,
            "expected one upstream request, got {seen:#?}"
        );
        seen.into_iter().next().expect("one")
    }
}

impl Drop for TestUpstream {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn upstream_answer(
    state: Arc<UpstreamState>,
    request: Request<Incoming>,
) -> Response<UpstreamBody> {
    let (parts, body) = request.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let content_type = parts.headers.get(http::header::CONTENT_TYPE).cloned();
    state
        .seen
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(Seen {
            method: parts.method,
            path: path.clone(),
            headers: parts.headers,
            body: body.clone(),
        });

    if path.starts_with("/sse") {
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            let _ = tx.send(Bytes::from_static(b"data: event 1\n\n")).await;
            state.sse_release.notified().await;
            let _ = tx.send(Bytes::from_static(b"data: event 2\n\n")).await;
            let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
        });
        return Response::builder()
            .header("content-type", "text/event-stream")
            .header("cache-control", "no-cache")
            .body(ChannelBody(rx).boxed())
            .expect("an SSE response");
    }
    if path.starts_with("/hold") {
        state.held.notify_one();
        state.release.notified().await;
        return Response::new(full("released"));
    }
    if path.starts_with("/hop") {
        return Response::builder()
            .header("connection", "x-resp-secret")
            .header("x-resp-secret", "1")
            .header("keep-alive", "timeout=5")
            .header("x-upstream", "seen")
            .body(full("hop"))
            .expect("a response");
    }
    let mut response = Response::builder().header("x-upstream", "seen");
    if let Some(content_type) = content_type {
        response = response.header(http::header::CONTENT_TYPE, content_type);
    }
    response.body(full(body)).expect("a response")
}

/// Lets a `/sse` stream send the rest of its events, and returns what
/// `body` then carries until it ends.
pub async fn release_the_rest_of_the_events(state: &UpstreamState, body: Incoming) -> Bytes {
    state.sse_release.notify_one();
    bounded("the rest of the stream", STEP, body.collect())
        .await
        .expect("the stream ends cleanly")
        .to_bytes()
}

fn full(body: impl Into<Bytes>) -> UpstreamBody {
    Full::new(body.into()).boxed()
}

/// An HTTP/2 connection to the gateway at `addr`.
pub async fn http2_to<B>(addr: std::net::SocketAddr) -> hyper::client::conn::http2::SendRequest<B>
where
    B: http_body::Body + Unpin + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .expect("an HTTP/2 handshake");
    tokio::spawn(connection);
    sender
}

/// A body fed chunk by chunk from a channel, of unknown length: a response
/// body of the test upstream, or a request body a test streams.
pub struct ChannelBody(pub mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|c| Ok(Frame::data(c))))
    }
}

/// An upstream that answers every connection's first request with the same
/// bytes, written as they are, then closes: for responses hyper would not
/// write. It keeps each request head it read.
pub struct RawUpstream {
    /// Where it listens.
    pub addr: SocketAddr,
    heads: Arc<Mutex<Vec<String>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl RawUpstream {
    /// Binds and starts answering with `response`.
    pub async fn start(response: &'static [u8]) -> RawUpstream {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the raw upstream");
        let addr = listener.local_addr().expect("raw upstream address");
        let heads = Arc::new(Mutex::new(Vec::new()));
        let seen = heads.clone();
        let accept = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    let mut reader = BufReader::new(stream);
                    let mut head = String::new();
                    loop {
                        let mut line = String::new();
                        match reader.read_line(&mut line).await {
                            Ok(0) | Err(_) => return,
                            Ok(_) if line.trim_end().is_empty() => break,
                            Ok(_) => head.push_str(&line),
                        }
                    }
                    seen.lock().unwrap_or_else(|p| p.into_inner()).push(head);
                    let mut stream = reader.into_inner();
                    let _ = stream.write_all(response).await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        RawUpstream {
            addr,
            heads,
            accept,
        }
    }

    /// `http://ADDR`, for `--upstream`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The request heads read so far (request line and header lines).
    pub fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Reads from `stream` (a raw upstream's connection from the gateway)
/// until a whole request head has come: what was read, and where the head
/// ends in it (the start of whatever of the body came with it). Fails if
/// the connection ends first.
pub async fn read_request_head(stream: &mut TcpStream) -> (Vec<u8>, usize) {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        if let Some(at) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
            return (seen, at + 4);
        }
        let n = stream
            .read(&mut buf)
            .await
            .expect("reading the request head");
        assert!(n > 0, "the gateway closed before its request head");
        seen.extend_from_slice(&buf[..n]);
    }
}

/// `count` connections to `addr`, opened and left silent.
pub async fn connect_many(addr: SocketAddr, count: usize) -> Vec<TcpStream> {
    let mut streams = Vec::with_capacity(count);
    for _ in 0..count {
        let stream = bounded("connecting", STEP, TcpStream::connect(addr))
            .await
            .unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
        streams.push(stream);
    }
    streams
}

/// An address nothing listens on, which nothing else can take while this
/// lives: a socket bound to it that never listens, so a connection to it
/// is refused. An address bound and released could be taken by another
/// test's server, which then answered in its place.
pub struct DeadAddress {
    addr: SocketAddr,
    _held: tokio::net::TcpSocket,
}

impl std::fmt::Display for DeadAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.addr.fmt(f)
    }
}

/// See [`DeadAddress`].
pub async fn dead_address() -> DeadAddress {
    // Without SO_REUSEADDR, which every listener sets: none can share it.
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket.set_reuseaddr(false).expect("SO_REUSEADDR off");
    socket
        .bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .expect("bind");
    DeadAddress {
        addr: socket.local_addr().expect("address"),
        _held: socket,
    }
}

// ---------------------------------------------------------------------------
// Clients
// ---------------------------------------------------------------------------

/// A whole response.
#[derive(Debug)]
pub struct Reply {
    /// The status.
    pub status: StatusCode,
    /// The headers.
    pub headers: HeaderMap,
    /// The whole body.
    pub body: Bytes,
}

impl Reply {
    /// `response`, its body read whole (within [`STEP`]).
    pub async fn read(response: Response<Incoming>) -> Reply {
        let (parts, body) = response.into_parts();
        let body = bounded("a response body", STEP, body.collect())
            .await
            .expect("a whole body")
            .to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    /// The body as text.
    pub fn text(&self) -> &str {
        std::str::from_utf8(&self.body).expect("a UTF-8 body")
    }

    /// The body parsed as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("the body is not JSON ({e}): {:?}", self.text()))
    }

    /// A header's value as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("ASCII header"))
    }
}

/// One HTTP/1.1 keep-alive connection (hyper's client connection).
pub struct Client {
    addr: SocketAddr,
    /// The hyper sender, for requests the helpers do not cover.
    pub sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
}

impl Client {
    /// Connects to `addr`.
    pub async fn connect(addr: SocketAddr) -> Client {
        let stream = bounded("connecting", STEP, TcpStream::connect(addr))
            .await
            .unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("an HTTP/1.1 handshake");
        tokio::spawn(connection);
        Client { addr, sender }
    }

    /// A request builder with `Host` set.
    pub fn builder(&self, method: Method, path: &str) -> http::request::Builder {
        Request::builder()
            .method(method)
            .uri(path)
            .header(http::header::HOST, self.addr.to_string())
    }

    /// Sends `request` and returns the response head with its body still
    /// streaming.
    pub async fn send_streaming(&mut self, request: Request<Full<Bytes>>) -> Response<Incoming> {
        bounded("the connection to be ready", STEP, self.sender.ready())
            .await
            .expect("the connection is usable");
        bounded("a response head", STEP, self.sender.send_request(request))
            .await
            .expect("a response")
    }

    /// Sends `request` and reads the whole response.
    pub async fn send(&mut self, request: Request<Full<Bytes>>) -> Reply {
        Reply::read(self.send_streaming(request).await).await
    }

    /// `GET path`.
    pub async fn get(&mut self, path: &str) -> Reply {
        let request = self
            .builder(Method::GET, path)
            .body(Full::default())
            .expect("a request");
        self.send(request).await
    }

    /// `POST path` with a JSON body.
    pub async fn post_json(&mut self, path: &str, body: impl Into<Bytes>) -> Reply {
        let request = self
            .builder(Method::POST, path)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body.into()))
            .expect("a request");
        self.send(request).await
    }
}

/// `GET path` on a new connection.
pub async fn get(addr: SocketAddr, path: &str) -> Reply {
    Client::connect(addr).await.get(path).await
}

/// `POST path` with a JSON body on a new connection.
pub async fn post_json(addr: SocketAddr, path: &str, body: impl Into<Bytes>) -> Reply {
    Client::connect(addr).await.post_json(path, body).await
}

/// `POST path` with no body on a new connection.
pub async fn post_empty(addr: SocketAddr, path: &str) -> Reply {
    let mut client = Client::connect(addr).await;
    let request = client
        .builder(Method::POST, path)
        .body(Full::default())
        .expect("a request");
    client.send(request).await
}

/// A response read off a raw socket.
#[derive(Debug)]
pub struct RawReply {
    /// The status code.
    pub status: u16,
    /// Headers, names lower-cased, in order.
    pub headers: Vec<(String, String)>,
    /// The body, de-chunked.
    pub body: Vec<u8>,
    /// Trailer fields after a chunked body, names lower-cased, in order.
    pub trailers: Vec<(String, String)>,
}

impl RawReply {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The body parsed as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "the body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }
}

/// Writes `request` byte for byte on a new connection and reads one
/// response (by `Content-Length`, chunked, or to the end of the stream).
/// The request need not be complete: the response is read right after.
pub async fn raw_exchange(addr: SocketAddr, request: &[u8]) -> RawReply {
    let stream = bounded("connecting", STEP, TcpStream::connect(addr))
        .await
        .expect("connect");
    raw_exchange_on(stream, request).await
}

/// Like [`raw_exchange`], on a connection opened earlier.
pub async fn raw_exchange_on(mut stream: TcpStream, request: &[u8]) -> RawReply {
    bounded("a raw exchange", STEP, async {
        stream.write_all(request).await.expect("write the request");
        read_raw_response(&mut BufReader::new(stream)).await
    })
    .await
}

/// A POST of `body` to `path`, with `headers` (whole `Name: value\r\n`
/// lines, written as they are), a `Content-Length` and `Connection: close`.
pub fn raw_post_request(path: &str, headers: &[u8], body: &[u8]) -> Vec<u8> {
    let mut request = format!("POST {path} HTTP/1.1\r\nHost: gateway.example\r\n").into_bytes();
    request.extend_from_slice(headers);
    request.extend_from_slice(
        format!(
            "Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )
        .as_bytes(),
    );
    request.extend_from_slice(body);
    request
}

/// POSTs `body` to `path` on a new connection (see [`raw_post_request`])
/// and reads the response.
pub async fn raw_post(addr: SocketAddr, path: &str, headers: &[u8], body: &[u8]) -> RawReply {
    raw_exchange(addr, &raw_post_request(path, headers, body)).await
}

/// Sends `head` (which asks for `Expect: 100-continue`), waits for the
/// interim `100 Continue`, then sends `body` and reads the final response.
pub async fn raw_expect_continue(addr: SocketAddr, head: &[u8], body: &[u8]) -> RawReply {
    bounded("an Expect: 100-continue exchange", STEP, async {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let mut reader = BufReader::new(stream);
        reader
            .get_mut()
            .write_all(head)
            .await
            .expect("write the head");
        let mut line = String::new();
        reader
            .read_line(&mut line)
            .await
            .expect("an interim status line");
        assert!(
            line.starts_with("HTTP/1.1 100"),
            "expected 100 Continue, got {line:?}"
        );
        loop {
            line.clear();
            reader
                .read_line(&mut line)
                .await
                .expect("an interim header");
            if line.trim().is_empty() {
                break;
            }
        }
        reader
            .get_mut()
            .write_all(body)
            .await
            .expect("write the body");
        read_raw_response(&mut reader).await
    })
    .await
}

/// Reads one response (head and body) off `reader`.
pub async fn read_raw_response(reader: &mut BufReader<TcpStream>) -> RawReply {
    let mut line = String::new();
    reader.read_line(&mut line).await.expect("a status line");
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    let mut raw_line = Vec::new();
    loop {
        // Bytes, not text: a header may carry obs-text (bytes over 0x7f).
        raw_line.clear();
        reader
            .read_until(b'\n', &mut raw_line)
            .await
            .expect("a header line");
        line = String::from_utf8_lossy(&raw_line).into_owned();
        let trimmed = line.trim_end();
        if trimmed.is_empty() {
            break;
        }
        let (name, value) = trimmed.split_once(':').expect("name: value");
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
    }
    let find = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    let mut body = Vec::new();
    let mut trailers = Vec::new();
    if find("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        loop {
            line.clear();
            reader.read_line(&mut line).await.expect("a chunk size");
            let size = usize::from_str_radix(line.trim(), 16).expect("a hex chunk size");
            if size == 0 {
                loop {
                    line.clear();
                    reader.read_line(&mut line).await.expect("a trailer line");
                    let Some((name, value)) = line.trim_end().split_once(':') else {
                        break;
                    };
                    trailers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
                }
                break;
            }
            let start = body.len();
            body.resize(start + size, 0);
            reader
                .read_exact(&mut body[start..])
                .await
                .expect("a chunk");
            line.clear();
            reader.read_line(&mut line).await.expect("a chunk end");
        }
    } else if let Some(length) = find("content-length") {
        body.resize(length.parse().expect("a numeric Content-Length"), 0);
        reader.read_exact(&mut body).await.expect("the body");
    } else {
        reader.read_to_end(&mut body).await.expect("the body");
    }
    RawReply {
        status,
        headers,
        body,
        trailers,
    }
}

/// `parts` as a chunked body, terminated.
pub fn chunked(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for part in parts {
        out.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
        out.extend_from_slice(part);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"0\r\n\r\n");
    out
}

/// Connects to `addr` until the connection is refused (polled every 10 ms,
/// at most `bound`).
pub async fn wait_refused(addr: SocketAddr, bound: Duration) {
    let deadline = Instant::now() + bound;
    loop {
        match TcpStream::connect(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return,
            // Caught in the backlog as the listener closed: not served, but
            // keep going until the port refuses outright.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!("connecting to {addr} failed, but not refused: {e}"),
            Ok(stream) => drop(stream),
        }
        assert!(
            Instant::now() < deadline,
            "{addr} still accepts connections after {bound:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ---------------------------------------------------------------------------
// Ids, errors and metrics
// ---------------------------------------------------------------------------

/// The `disagg_request_id` of a body's top-level `disaggregated_params`.
pub fn stamped_id(body: &[u8]) -> u64 {
    let value: Value = serde_json::from_slice(body)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(body)));
    value["disaggregated_params"]["disagg_request_id"]
        .as_u64()
        .unwrap_or_else(|| panic!("no integer disagg_request_id in {value}"))
}

/// Checks that `id` is a trtllm-v1 id of [`MACHINE_ID`] made in the last
/// minute.
pub fn assert_fresh_v1_id(id: u64) {
    let parts = SnowflakeLayout::TrtllmV1
        .decode(id)
        .unwrap_or_else(|e| panic!("{id} is not a trtllm-v1 id: {e:?}"));
    assert_eq!(parts.machine_id, MACHINE_ID, "machine id of {id}");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as u64;
    assert!(
        parts.millis <= now + 1_000 && parts.millis + 60_000 >= now,
        "id {id} was made at {} ms, now is {now} ms",
        parts.millis
    );
}

/// Checks an OpenAI-style error body and returns its message.
pub fn assert_openai_error(body: &Value, code: &str, kind: &str) -> String {
    let error = &body["error"];
    assert_eq!(error["code"], code, "{body}");
    assert_eq!(error["type"], kind, "{body}");
    let message = error["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no error.message in {body}"));
    assert!(!message.is_empty(), "{body}");
    message.to_string()
}

/// The responses to clients `/metrics` text `text` counts, by class:
/// `2xx`, `4xx` and `5xx`.
pub fn responses_by_class(text: &str) -> [f64; 3] {
    ["2xx", "4xx", "5xx"].map(|class| {
        metric(
            text,
            &format!("snowgate_responses_total{{code=\"{class}\"}}"),
        )
    })
}

/// The requests `/metrics` text `text` counts with outcome `outcome`
/// (`client_error`, `abandoned`, `passed_through`, ...).
pub fn requests_with_outcome(text: &str, outcome: &str) -> f64 {
    metric(
        text,
        &format!("snowgate_requests_total{{outcome=\"{outcome}\"}}"),
    )
}

/// The requests that got no upstream response, `/metrics` text `text`
/// counts: of the kind `kind` (`unreachable`, `failed`, `unusable`,
/// `timed_out`), or of every kind.
pub fn upstream_errors(text: &str, kind: Option<&str>) -> f64 {
    let kinds = ["unreachable", "failed", "unusable", "timed_out"];
    kinds
        .iter()
        .filter(|k| kind.is_none_or(|kind| kind == **k))
        .map(|k| {
            metric(
                text,
                &format!("snowgate_upstream_errors_total{{kind=\"{k}\"}}"),
            )
        })
        .sum()
}

/// The value of one sample line (`name{labels} value`) in Prometheus text.
pub fn metric(text: &str, sample: &str) -> f64 {
    text.lines()
        .find_map(|line| {
            line.strip_prefix(sample)
                .and_then(|rest| rest.strip_prefix(' '))
                .map(|value| value.trim().parse().expect("a numeric sample"))
        })
        .unwrap_or_else(|| panic!("no sample {sample} in:\n{text}"))
}

/// Holds `text` to Prometheus's text exposition format, as a scraper
/// reads it: every family has one `# HELP` and one `# TYPE` before its
/// samples, which come together; a counter's name ends in `_total` and no
/// other's does; label values escape only `\\`, `\"` and `\n`; a
/// histogram's buckets, for each set of its other labels, rise with `le`
/// to a last one of `+Inf`, which equals its `_count`, beside a `_sum`.
pub fn assert_exposition(text: &str) {
    #[derive(Default)]
    struct Family {
        help: bool,
        kind: Option<String>,
        /// Whether another family's lines came after its own.
        ended: bool,
    }
    let mut families: std::collections::HashMap<String, Family> = Default::default();
    let mut current: Option<String> = None;
    // A histogram's buckets, by its other labels: (le, value).
    let mut buckets: std::collections::HashMap<String, Vec<(f64, f64)>> = Default::default();
    let mut counts: std::collections::HashMap<String, f64> = Default::default();
    let mut sums: HashSet<String> = HashSet::new();
    // Every series, by its name and sorted labels: Prometheus refuses a
    // scrape that gives one twice.
    let mut series_seen: HashSet<String> = HashSet::new();
    assert!(
        text.ends_with('\n'),
        "the exposition ends without a newline"
    );
    let mut enter = |name: &str, families: &mut std::collections::HashMap<String, Family>| {
        if current.as_deref() != Some(name) {
            if let Some(left) = current.replace(name.to_string()) {
                families.entry(left).or_default().ended = true;
            }
            let family = families.entry(name.to_string()).or_default();
            assert!(
                !family.ended,
                "the lines of {name} do not come together:\n{text}"
            );
        }
    };
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').expect("a HELP with text");
            assert!(!help.trim().is_empty(), "an empty HELP for {name}");
            enter(name, &mut families);
            let family = families.get_mut(name).expect("entered");
            assert!(!family.help, "a second HELP for {name}");
            family.help = true;
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("a TYPE with a type");
            assert!(
                ["counter", "gauge", "histogram"].contains(&kind),
                "{name}: type {kind}"
            );
            assert_eq!(
                name.ends_with("_total"),
                kind == "counter",
                "{name} is a {kind}: only a counter's name ends in _total"
            );
            enter(name, &mut families);
            let family = families.get_mut(name).expect("entered");
            assert!(family.kind.is_none(), "a second TYPE for {name}");
            family.kind = Some(kind.to_string());
            continue;
        }
        assert!(!line.starts_with('#') && !line.is_empty(), "line {line:?}");
        let (series, value) = line.rsplit_once(' ').expect("a sample and its value");
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            value => value
                .parse()
                .unwrap_or_else(|_| panic!("{line:?}: not a number")),
        };
        let (name, mut labels) = match series.split_once('{') {
            Some((name, labels)) => (name, exposition_labels(labels, line)),
            None => (series, Vec::new()),
        };
        labels.sort();
        assert!(
            series_seen.insert(format!("{name}{labels:?}")),
            "{line:?}: a series given twice"
        );
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "{line:?}: a metric name"
        );
        let histogram_part = ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
            let base = name.strip_suffix(suffix)?;
            let family = families.get(base)?;
            (family.kind.as_deref() == Some("histogram")).then_some((base, *suffix))
        });
        let family_name = histogram_part.map_or(name, |(base, _)| base);
        enter(family_name, &mut families);
        let family = &families[family_name];
        assert!(
            family.help && family.kind.is_some(),
            "{line:?}: a sample before its family's HELP and TYPE"
        );
        if family.kind.as_deref() == Some("histogram") {
            let (_, suffix) = histogram_part.unwrap_or_else(|| {
                panic!("{line:?}: a histogram sample that is no bucket, sum or count")
            });
            let others: Vec<String> = labels
                .iter()
                .filter(|(key, _)| key != "le")
                .map(|(key, value)| format!("{key}={value:?}"))
                .collect();
            let series = format!("{family_name}{{{}}}", others.join(","));
            match suffix {
                "_bucket" => {
                    let le = labels
                        .iter()
                        .find(|(key, _)| key == "le")
                        .unwrap_or_else(|| panic!("{line:?}: a bucket without le"));
                    let le: f64 = match le.1.as_str() {
                        "+Inf" => f64::INFINITY,
                        le => le.parse().unwrap_or_else(|_| panic!("{line:?}: le")),
                    };
                    buckets.entry(series).or_default().push((le, value));
                }
                "_sum" => {
                    sums.insert(series);
                }
                _ => {
                    counts.insert(series, value);
                }
            }
        }
    }
    for (name, family) in &families {
        assert!(
            family.help && family.kind.is_some(),
            "{name}: no HELP or TYPE"
        );
    }
    for (series, buckets) in &buckets {
        assert!(
            buckets
                .windows(2)
                .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1),
            "{series}: buckets that do not rise with le: {buckets:?}"
        );
        let last = buckets.last().expect("a bucket");
        assert_eq!(last.0, f64::INFINITY, "{series}: no +Inf bucket");
        assert_eq!(
            counts.get(series),
            Some(&last.1),
            "{series}: _count and +Inf"
        );
        assert!(sums.contains(series), "{series}: no _sum");
    }
    assert_eq!(
        buckets.len(),
        counts.len(),
        "a histogram _count without buckets"
    );
}

/// The labels of an exposition line, `key="value",...}` after its `{`,
/// with their escapes undone; only `\\`, `\"` and `\n` may be escaped.
fn exposition_labels(mut rest: &str, line: &str) -> Vec<(String, String)> {
    let mut labels = Vec::new();
    loop {
        if let Some(after) = rest.strip_prefix('}') {
            assert!(after.is_empty(), "{line:?}: text after the labels");
            return labels;
        }
        let (key, after) = rest
            .split_once("=\"")
            .unwrap_or_else(|| panic!("{line:?}: a label"));
        assert!(
            !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "{line:?}: label name {key:?}"
        );
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => match chars.next() {
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, 'n')) => value.push('\n'),
                    other => panic!("{line:?}: the escape \\{other:?}"),
                },
                Some((at, '"')) => break at,
                Some((_, c)) => value.push(c),
                None => panic!("{line:?}: an unterminated label value"),
            }
        };
        labels.push((key.to_string(), value));
        rest = &after[end + 1..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
}

/// Checks that every id is distinct.
pub fn assert_unique(ids: &[u64]) {
    let distinct: HashSet<u64> = ids.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        ids.len(),
        "{} duplicate ids",
        ids.len() - distinct.len()
    );
}

// ---------------------------------------------------------------------------
// Plugin builds and files
// ---------------------------------------------------------------------------

/// Lower-case hex SHA-256, written here rather than taken from
/// `snowgate_host::plugin::hex_sha256`: the tests check the gateway's
/// names of builds against a reckoning of their own.
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Appends `n` to `out` as an unsigned LEB128 number (WebAssembly's
/// sizes and counts).
pub fn leb128(mut n: usize, out: &mut Vec<u8>) {
    loop {
        let byte = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// The bundled plugin with a custom section `snowgate-test-variant` holding
/// `n` appended: the same behaviour, a different SHA-256 for every `n`.
pub fn plugin_variant(n: u32) -> Vec<u8> {
    variant_of(snowgate_plugin_bundle::PLUGIN_WASM, n)
}

/// The component `base` with a custom section `snowgate-test-variant`
/// holding `n` appended (see [`plugin_variant`]).
pub fn variant_of(base: &[u8], n: u32) -> Vec<u8> {
    let name = b"snowgate-test-variant";
    let payload = format!("variant {n}");
    let mut content = Vec::new();
    leb128(name.len(), &mut content);
    content.extend_from_slice(name);
    content.extend_from_slice(payload.as_bytes());
    let mut out = base.to_vec();
    out.push(0x00); // custom section
    leb128(content.len(), &mut out);
    out.extend_from_slice(&content);
    out
}

/// A directory under the system temp dir, removed when dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    /// A fresh, empty directory whose name contains `tag`.
    pub fn new(tag: &str) -> TempDir {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = std::env::temp_dir().join(format!(
            "snowgate-{tag}-{}-{}-{nanos}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&path).expect("create a temp dir");
        TempDir(path)
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Replaces `path` atomically: writes a temporary file beside it, then
/// renames it into place (what `cp new.wasm dir/.tmp && mv` does).
pub fn replace_by_rename(path: &Path, bytes: &[u8]) {
    let tmp = path.with_file_name(format!(
        ".{}.tmp",
        path.file_name().expect("a file name").to_string_lossy()
    ));
    std::fs::write(&tmp, bytes).expect("write the temporary file");
    std::fs::rename(&tmp, path).expect("rename into place");
}

/// Rewrites `path` in place: truncate, then write.
pub fn rewrite_in_place(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).expect("rewrite in place");
}

/// `path` as a `&str` for an argument list.
pub fn arg(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

/// `POST /reload`, which must be refused with 422 `reload_failed`; the
/// error's message.
pub async fn reload_refused(gateway: &Gateway) -> String {
    let reply = post_empty(gateway.admin, "/reload").await;
    assert_eq!(
        reply.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        reply.text()
    );
    assert_openai_error(&reply.json(), "reload_failed", "invalid_request_error")
}

/// Sends a context-only request (built-in echo upstream) and checks it was
/// stamped.
pub async fn assert_stamps(gateway: &Gateway) -> u64 {
    let reply = post_json(gateway.addr, "/v1/completions", CONTEXT_ONLY).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    let id = stamped_id(&serde_json::to_vec(&reply.json()["body"]).unwrap());
    assert_fresh_v1_id(id);
    id
}

/// Peak resident memory of process `pid` (`VmHWM`), in KiB.
pub fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read its status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/PID/status")
}

/// The preloadable shim `tests/shims/NAME.c`, built with the machine's C
/// compiler into `dir`, when there is one.
pub fn built_shim(dir: &Path, name: &str) -> Option<PathBuf> {
    let library = dir.join(format!("{name}.so"));
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/shims/{name}.c"));
    let built = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&library)
        .arg(&source)
        .arg("-ldl")
        .output();
    if let Ok(output) = &built {
        assert!(
            output.status.success(),
            "building {}: {}",
            source.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    tool_present(built.is_ok(), "a C compiler (cc)", "apt-get install gcc").then_some(library)
}

/// A raw HTTP/2 frame of `kind` with `flags` on `stream`.
pub fn h2_frame_on(stream: u32, kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut frame = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    frame.extend_from_slice(&[kind, flags]);
    frame.extend_from_slice(&stream.to_be_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// An HPACK field block of literal fields, not indexed, names and values
/// as they are (each under 128 bytes).
pub fn h2_literal_block(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut block = Vec::new();
    for (name, value) in fields {
        block.push(0x00);
        block.push(name.len() as u8);
        block.extend_from_slice(name.as_bytes());
        block.push(value.len() as u8);
        block.extend_from_slice(value.as_bytes());
    }
    block
}
