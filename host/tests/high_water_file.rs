//! `snowgate serve --high-water-file`: a fixed machine id's ids never
//! repeat across restarts, not after a crash (SIGKILL) and not after the
//! wall clock stepped back, with the real binary, the real plugin and a
//! real file.
//!
//! The wall clock stepping back is the real one as the gateway reads it:
//! the gateway runs under libfaketime (Debian's `libfaketime`, which
//! `.ci/run` installs), which shifts what `clock_gettime(CLOCK_REALTIME)`
//! returns to the process and leaves its monotonic clock alone.

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::StatusCode;
use snowgate_host::high_water_file::keeper::START_LEAD;
use snowgate_plugin::SnowflakeLayout;
use support::{get, post_json, stamped_id, Gateway, CONTEXT_ONLY, MACHINE_ID, STEP};

/// How far the faked wall clock steps back after a clean stop: within the
/// 7 s a start may be behind a mark without waiting, so that a gateway that
/// continues after the last id can stamp at once; more than a debug build
/// takes to stop one gateway and start the next on a busy machine, so that
/// the step is real.
const STEP_BACK_AFTER_A_STOP: &str = "-7s";

/// The same after a crash: far enough that the restart, however slow, comes
/// before its wall clock reaches the mark, and with the mark's lead of up to
/// 2 s, beyond the 7 s a start goes on without waiting; it waits out the
/// rest (a few seconds).
const STEP_BACK_AFTER_A_CRASH: &str = "-10s";

/// How far ahead the clock of a gateway that leaves a mark to be waited for
/// runs: far enough that the next start, however slow, finds the mark more
/// than 7 s ahead and waits (about 9 s).
const AHEAD_TO_BE_WAITED_FOR: &str = "+16s";

/// What a start's log says when it waits for a mark far ahead. Not only
/// "waiting": the scratch directory of a test may be named so, and the log
/// names the file.
const WAITS_FOR_THE_MARK: &str = "as ids may not run further ahead";

/// A directory of the test's own, empty and removed when dropped, and the
/// high-water file's path in it.
fn scratch(name: &str) -> (support::TempDir, PathBuf) {
    let dir = support::TempDir::new(&format!("high-water-{name}"));
    let file = dir.path().join("ids.mark");
    (dir, file)
}

/// The environment that moves the gateway's wall clock by `offset`
/// (libfaketime's `-7s`, `+12s`).
fn faked_clock(library: &Path, offset: &str) -> Vec<(&'static str, String)> {
    vec![
        ("LD_PRELOAD", library.display().to_string()),
        ("FAKETIME", offset.to_string()),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_string()),
    ]
}

fn env_of<'a>(pairs: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    pairs.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// Runs a gateway on the high-water file `file_arg` with its clock
/// `offset` ahead (libfaketime's `library`), stamps five ids and stops it:
/// the file's mark is left about that far ahead of the wall clock.
async fn leave_a_mark_ahead(library: &Path, file_arg: &str, offset: &str) {
    let ahead = faked_clock(library, offset);
    let gateway = Gateway::start_with_env(&["--high-water-file", file_arg], &env_of(&ahead)).await;
    stamp(&gateway, 5).await;
    gateway.stop().await;
}

/// The ids of `count` context-only requests, one after another, as the
/// built-in echo upstream received them.
async fn stamp(gateway: &Gateway, count: usize) -> Vec<u64> {
    let mut ids = Vec::with_capacity(count);
    for _ in 0..count {
        let reply = post_json(gateway.addr, "/v1/completions", CONTEXT_ONLY).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        let received = reply.json()["body"].to_string();
        ids.push(stamped_id(received.as_bytes()));
    }
    ids
}

/// The millisecond of a trtllm-v1 id of [`MACHINE_ID`].
fn millis_of(id: u64) -> u64 {
    let parts = SnowflakeLayout::TrtllmV1
        .decode(id)
        .expect("a trtllm-v1 id");
    assert_eq!(parts.machine_id, MACHINE_ID, "id {id}");
    parts.millis
}

/// The mark the file holds, read as an operator would: the higher
/// `millis=` of its two copies.
fn mark_in(path: &Path) -> u64 {
    let text = std::fs::read_to_string(path).expect("the high-water file reads as text");
    let marks: Vec<u64> = text
        .lines()
        .map(|line| {
            let field = line
                .split_whitespace()
                .find_map(|field| field.strip_prefix("millis="))
                .unwrap_or_else(|| panic!("no millis= in {line:?}"));
            field.parse().expect("a count of milliseconds")
        })
        .collect();
    assert_eq!(marks.len(), 2, "two copies: {text:?}");
    marks.into_iter().max().expect("two copies")
}

fn now_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as u64
}

/// `snowgate serve` with `args` that must fail to start: its status and
/// stderr.
fn failed_start(args: &[&str]) -> (Option<i32>, String) {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_snowgate"));
    command.args(support::SERVE_ON_LOOPBACK).args(args);
    // One that starts instead is killed, and fails the test.
    let output = support::run_bounded(command, b"", STEP);
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A clean stop writes the last id's millisecond; the next gateway, whose
/// wall clock has stepped back, continues after it. Without the file the
/// same step back puts the next gateway's ids among the earlier ones',
/// where they can repeat (the control, which shows the step is real).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_stop_and_a_step_back_ids_continue_after_the_last() {
    let Some(library) = support::faketime() else {
        return;
    };
    let (_dir, file) = scratch("step-back");
    let file_arg = file.to_str().expect("a UTF-8 path");

    let env = faked_clock(&library, STEP_BACK_AFTER_A_STOP);
    // Started first, so that its stamps come right after the first
    // gateway's, whatever a start takes.
    let control = Gateway::start_with_env(&[], &env_of(&env)).await;
    let first = Gateway::start(&["--high-water-file", file_arg]).await;
    let before = stamp(&first, 50).await;
    let unmarked = stamp(&control, 5).await;
    control.stop().await;
    first.stop().await;
    let last = before.iter().copied().map(millis_of).max().expect("ids");
    assert_eq!(
        mark_in(&file),
        last,
        "a clean stop writes the last id's millisecond as the mark"
    );
    assert!(
        unmarked.iter().all(|&id| millis_of(id) < last),
        "the control's clock did not step back: {} ms after the last id {last}",
        millis_of(unmarked[0]).saturating_sub(last)
    );

    let second = Gateway::start_with_env(&["--high-water-file", file_arg], &env_of(&env)).await;
    let after = stamp(&second, 50).await;
    let status = second.status().await;
    second.stop().await;
    let first_after = after.iter().copied().min().expect("ids");
    assert!(
        first_after > *before.iter().max().expect("ids") && millis_of(first_after) > last,
        "after the step back, id {first_after} (at {}) is not after the last id before it (at \
         {last})",
        millis_of(first_after)
    );
    support::assert_unique(&[before, after].concat());
    assert!(
        status["high_water_file"]["mark"].as_u64().expect("a mark") > last,
        "{status}"
    );
    assert_eq!(
        status["high_water_file"]["path"], file_arg,
        "/status names the file: {status}"
    );
}

/// A gateway killed with SIGKILL writes nothing at its end; the mark it
/// kept ahead of its ids while it served covers them. The next gateway
/// starts on a wall clock that also stepped back (an NTP step), far behind
/// that mark, waits until the mark is within reach and continues after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_crash_ids_continue_after_the_mark_kept_ahead() {
    let Some(library) = support::faketime() else {
        return;
    };
    let (_dir, file) = scratch("crash");
    let file_arg = file.to_str().expect("a UTF-8 path");

    let first = Gateway::start(&["--high-water-file", file_arg]).await;
    let before = stamp(&first, 50).await;
    let killed_at = now_millis();
    first.signal("KILL");
    first.wait_exit(STEP).await;
    let mark = mark_in(&file);
    let last = before.iter().copied().map(millis_of).max().expect("ids");
    assert!(
        mark >= last,
        "the mark {mark} is below an id given out at {last}"
    );
    assert!(
        mark > killed_at,
        "the mark was not kept ahead of the clock: {mark} at {killed_at}"
    );

    let env = faked_clock(&library, STEP_BACK_AFTER_A_CRASH);
    let second = Gateway::start_with_env(&["--high-water-file", file_arg], &env_of(&env)).await;
    let after = stamp(&second, 50).await;
    second.stop().await;
    // The restart came before its wall clock reached the mark: without
    // the file its ids would have started behind it.
    assert!(
        second.stderr_text().contains("ms ahead of the wall clock"),
        "{}",
        second.stderr_text()
    );
    let first_after = after.iter().copied().map(millis_of).min().expect("ids");
    assert!(
        first_after > mark,
        "after the crash, an id at {first_after} is not after the mark {mark}"
    );
    support::assert_unique(&[before, after].concat());
}

/// A mark further ahead than the id clock may run (here left by a gateway
/// whose clock was 12 s ahead, then set right) is waited out to within
/// reach before the start goes on; nothing is written meanwhile, so
/// restarts do not push it further out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_waits_for_a_mark_beyond_the_id_clocks_lead() {
    let Some(library) = support::faketime() else {
        return;
    };
    let (_dir, file) = scratch("far-ahead");
    let file_arg = file.to_str().expect("a UTF-8 path");
    leave_a_mark_ahead(&library, file_arg, AHEAD_TO_BE_WAITED_FOR).await;
    let mark = mark_in(&file);
    assert!(
        mark > now_millis() + START_LEAD.as_millis() as u64,
        "the mark is {} ms ahead",
        mark - now_millis()
    );

    let second = Gateway::start(&["--high-water-file", file_arg]).await;
    assert!(
        second.stderr_text().contains(WAITS_FOR_THE_MARK),
        "{}",
        second.stderr_text()
    );
    let after = stamp(&second, 5).await;
    second.stop().await;
    let first_after = after.iter().copied().map(millis_of).min().expect("ids");
    assert!(
        first_after > mark,
        "an id at {first_after} is not after the mark {mark}"
    );
}

/// While the start waits out a mark far ahead, the admin listener answers:
/// `/healthz` ok (a liveness probe must not restart a gateway for
/// waiting), `/readyz` 503 saying what it waits for, the other endpoints
/// 503 `starting`. Before, it was bound only after the wait, and refused
/// connections for as long as the mark was ahead (up to a day).
///
/// A stop (SIGTERM) then ends the start at once, with status 0. Before,
/// stop signals were heard only once the gateway was bound, and this one
/// killed it (status 143).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_waiting_for_its_mark_answers_probes_and_ends_cleanly_on_a_stop() {
    use std::io::Read as _;
    let Some(library) = support::faketime() else {
        return;
    };
    let (_dir, file) = scratch("stopped-while-waiting");
    let file_arg = file.to_str().expect("a UTF-8 path");
    leave_a_mark_ahead(&library, file_arg, "+60s").await;

    // A free port (bound and let go; the gateway binds it right after): the
    // ready line that names an ephemeral one comes only after the wait.
    let admin: std::net::SocketAddr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port");
    let admin_arg = admin.to_string();
    let mut waiting = support::Reaped(
        std::process::Command::new(env!("CARGO_BIN_EXE_snowgate"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--admin-listen",
                &admin_arg,
            ])
            .args(["--machine-id", "1", "--high-water-file", file_arg])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("starting snowgate"),
    );
    // Its log, until it says it waits (read on a thread of its own, so
    // that a start that neither waits nor ends fails the test in time).
    let mut stderr = waiting.0.stderr.take().expect("piped");
    let (said, heard) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut log = Vec::new();
        let mut buffer = [0u8; 4096];
        while !String::from_utf8_lossy(&log).contains(WAITS_FOR_THE_MARK) {
            match stderr.read(&mut buffer) {
                Ok(n) if n > 0 => log.extend_from_slice(&buffer[..n]),
                _ => break,
            }
        }
        let _ = said.send(String::from_utf8_lossy(&log).into_owned());
        // Keep draining, so that the pipe never fills.
        let _ = std::io::copy(&mut stderr, &mut std::io::sink());
    });
    let log = heard
        .recv_timeout(support::START_TIMEOUT)
        .expect("its log within the start timeout");
    assert!(log.contains(WAITS_FOR_THE_MARK), "it did not wait: {log}");

    // Bound before the wait began.
    let health = get(admin, "/healthz").await;
    assert_eq!(health.status, StatusCode::OK, "{}", health.text());
    let ready = get(admin, "/readyz").await;
    assert_eq!(
        ready.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        ready.text()
    );
    assert!(
        ready.text().contains("starting") && ready.text().contains("high-water file's mark"),
        "/readyz says what the start waits for: {}",
        ready.text()
    );
    let status = get(admin, "/status").await;
    assert_eq!(
        status.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        status.text()
    );
    assert_eq!(
        status.json()["error"]["code"],
        "starting",
        "{}",
        status.text()
    );

    // SAFETY: kill only sends a signal to the child, not yet reaped.
    unsafe { libc::kill(waiting.0.id() as libc::pid_t, libc::SIGTERM) };
    let status = waiting.exit_within(Duration::from_secs(20));
    assert_eq!(status.code(), Some(0), "{status:?}");
}

/// With no request for longer than the mark's lead, the gateway has kept
/// raising it: the next request is stamped, not refused at the old mark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_gateway_keeps_its_mark_ahead_of_the_clock() {
    let (_dir, file) = scratch("idle");
    let gateway = Gateway::start(&["--high-water-file", file.to_str().expect("UTF-8")]).await;
    let first_mark = gateway.status().await["high_water_file"]["mark"]
        .as_u64()
        .expect("a mark");
    // Wait, polling, until the wall clock is past the first mark.
    let deadline = Instant::now() + STEP;
    while now_millis() <= first_mark {
        assert!(Instant::now() < deadline, "the wall clock stands still");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ids = stamp(&gateway, 3).await;
    assert!(millis_of(ids[0]) > first_mark, "ids at the wall clock");
    let status = gateway.status().await;
    let file_status = &status["high_water_file"];
    assert!(
        file_status["mark"].as_u64().expect("a mark") > first_mark,
        "{status}"
    );
    assert!(
        file_status["writes"].as_u64().expect("a count") >= 2,
        "{status}"
    );
    assert_eq!(file_status["failures"], 0, "{status}");
    let metrics = gateway.metrics().await;
    assert!(
        support::metric(&metrics, "snowgate_high_water_file_writes_total") >= 2.0,
        "{metrics}"
    );
    // The mark in seconds, as written: past the first one, at most the
    // mark /status gives now (it may have been written again since).
    let mark_seconds = support::metric(&metrics, "snowgate_high_water_file_mark_seconds");
    let mark_millis = (mark_seconds * 1000.0).round() as u64;
    let mark_now = gateway.status().await["high_water_file"]["mark"]
        .as_u64()
        .expect("a mark");
    assert!(
        mark_millis > first_mark && mark_millis <= mark_now,
        "{mark_seconds} s against marks {first_mark} and {mark_now} ms"
    );
    gateway.stop().await;
}

/// The disk under a test's directory, made faulty: the fdatasync shim
/// (`tests/shims/faulty_fdatasync.c`), preloaded, fails every `fdatasync`
/// with EIO while the flag file exists ([`FaultyDisk::env`]), or slows
/// each by `SLOW_FDATASYNC_MS`.
struct FaultyDisk {
    /// The shim, for `LD_PRELOAD`.
    library: String,
    /// While this file exists, `fdatasync` fails.
    flag: PathBuf,
}

impl FaultyDisk {
    /// The shim built into `dir`, when the machine has a C compiler.
    fn in_dir(dir: &Path) -> Option<FaultyDisk> {
        let library = support::built_shim(dir, "faulty_fdatasync")?;
        Some(FaultyDisk {
            library: library.display().to_string(),
            flag: dir.join("failing"),
        })
    }

    /// The environment that preloads the shim into a child process, to
    /// fail while the flag file exists.
    fn env(&self) -> [(&str, &str); 2] {
        [
            ("LD_PRELOAD", self.library.as_str()),
            ("FAIL_FDATASYNC_WHILE", self.flag.to_str().expect("UTF-8")),
        ]
    }
}

/// A disk slow to sync (each `fdatasync` 600 ms, so each mark's two copies
/// take 1.2 s, longer than the interval between raises) costs no request
/// a 503: the mark's lead grows with the writes' time, so the next mark
/// lands before ids reach the one before it. With the fixed 2 s lead of
/// before, ids reached the mark for some 0.4 s of every 1.2 s.
///
/// The slow disk is the real file on the real disk with a delay before
/// each sync, preloaded into the gateway: slowing a real device needs
/// root (`dm-delay`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_slow_to_sync_lengthens_the_lead_instead_of_refusing_ids() {
    let (_dir, file) = scratch("slow-disk");
    let Some(disk) = FaultyDisk::in_dir(file.parent().expect("a directory")) else {
        return;
    };
    let gateway = Gateway::start_with_env(
        &["--high-water-file", file.to_str().expect("UTF-8")],
        &[("LD_PRELOAD", &disk.library), ("SLOW_FDATASYNC_MS", "600")],
    )
    .await;
    // Requests one after another for some seven raises, and on until five
    // writes have been seen (a busy machine may be slower).
    let until = Instant::now() + Duration::from_secs(8);
    let writes = |status: &serde_json::Value| status["high_water_file"]["writes"].as_u64();
    let mut ids = Vec::new();
    let mut refused = Vec::new();
    while Instant::now() < until || writes(&gateway.status().await).unwrap_or(0) < 5 {
        assert!(
            Instant::now() < until + STEP,
            "fewer than five writes: {}",
            gateway.status().await
        );
        let reply = post_json(gateway.addr, "/v1/completions", CONTEXT_ONLY).await;
        if reply.status == 200 {
            ids.push(stamped_id(reply.json()["body"].to_string().as_bytes()));
        } else {
            refused.push(format!("{} {}", reply.status, reply.text()));
        }
    }
    let status = gateway.status().await;
    assert!(
        refused.is_empty(),
        "{} of {} requests refused, the first: {}; {status}",
        refused.len(),
        refused.len() + ids.len(),
        refused[0]
    );
    let file_status = &status["high_water_file"];
    let slowest = file_status["slowest_write_ms"].as_f64().expect("a time");
    let lead = file_status["lead_ms"].as_u64().expect("a lead");
    assert!(slowest >= 1_200.0, "the syncs were not slowed: {status}");
    assert!(lead > 2 * 1_200, "{status}");
    assert!(
        file_status["writes"].as_u64().expect("a count") >= 5,
        "{status}"
    );
    assert!(
        support::metric(
            &gateway.metrics().await,
            "snowgate_high_water_file_lead_seconds"
        ) > 2.4
    );
    assert!(
        gateway.stderr_text().contains("the mark now goes"),
        "the longer lead is logged: {}",
        gateway.stderr_text()
    );
    gateway.stop().await;
    support::assert_unique(&ids);
    let last = ids.iter().copied().map(millis_of).max().expect("ids");
    assert_eq!(
        mark_in(&file),
        last,
        "the stop writes the last id's millisecond"
    );
}

/// Context-only requests, one after another, until one is refused (at most [`STEP`]): the ids of those stamped before it, and the
/// refusal.
async fn stamp_until_refused(gateway: &Gateway) -> (Vec<u64>, support::Reply) {
    let deadline = Instant::now() + STEP;
    let mut ids = Vec::new();
    loop {
        let reply = post_json(gateway.addr, "/v1/completions", CONTEXT_ONLY).await;
        if reply.status != 200 {
            return (ids, reply);
        }
        ids.push(stamped_id(reply.json()["body"].to_string().as_bytes()));
        assert!(
            Instant::now() < deadline,
            "{} requests stamped in {STEP:?}, none refused; /status: {}",
            ids.len(),
            gateway.status().await
        );
    }
}

/// A disk that fails while the gateway serves: ids stop at the mark last
/// written, with a 503 that says so; `/readyz` turns traffic away;
/// `/status`, `/metrics` and the log name the failure. Once the disk takes
/// writes again, ids resume without a restart. A stop while it fails still
/// ends, and the file's mark still covers every id given out, which is
/// where the next start continues.
///
/// The failing disk is the real file on the real disk with `fdatasync`
/// failing (EIO) while a flag file exists, preloaded into the gateway:
/// failing a real device needs root (`dm-flakey`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_that_fails_mid_serve_stops_ids_at_the_mark_until_it_recovers() {
    let (_dir, file) = scratch("failing-disk");
    let dir = file.parent().expect("a directory");
    let Some(disk) = FaultyDisk::in_dir(dir) else {
        return;
    };
    let failing = &disk.flag;
    let gateway = Gateway::start_with_env(
        &["--high-water-file", file.to_str().expect("UTF-8")],
        &disk.env(),
    )
    .await;
    let mut ids = stamp(&gateway, 20).await;

    // The disk fails: ids go on until they reach the mark written before.
    std::fs::write(failing, b"").expect("the flag file");
    let (stamped, refusal) = stamp_until_refused(&gateway).await;
    ids.extend(stamped);
    assert_eq!(refusal.status, 503, "{}", refusal.text());
    assert!(
        refusal.text().contains("past the high-water mark"),
        "{}",
        refusal.text()
    );
    let status = gateway.status().await;
    let file_status = &status["high_water_file"];
    let mark = file_status["mark"].as_u64().expect("a mark");
    let last = ids.iter().copied().map(millis_of).max().expect("ids");
    assert!(
        last <= mark,
        "an id of millisecond {last} left past the mark {mark}"
    );
    assert!(
        file_status["failures"].as_u64().expect("a count") >= 1,
        "{status}"
    );
    let error = file_status["last_error"].as_str().expect("the last error");
    assert!(
        error.contains("Input/output error") && error.contains(file.to_str().expect("UTF-8")),
        "the error names the cause and the file: {error}"
    );
    let metrics = gateway.metrics().await;
    assert!(support::metric(&metrics, "snowgate_high_water_file_failures_total") >= 1.0);
    // Counted as an outage of ids, not as requests the plugin rejected.
    assert!(
        support::requests_with_outcome(&metrics, "ids_unavailable") >= 1.0,
        "{metrics}"
    );
    assert_eq!(
        support::requests_with_outcome(&metrics, "rejected"),
        0.0,
        "{metrics}"
    );
    let ready = support::get(gateway.admin, "/readyz").await;
    assert_eq!(ready.status, 503, "{}", ready.text());
    assert!(
        ready.text().contains("high-water"),
        "/readyz says why: {}",
        ready.text()
    );
    gateway.wait_log("ids stop at the mark").await;

    // The disk recovers: the next retry writes a mark and ids resume.
    std::fs::remove_file(failing).expect("removing the flag file");
    let status = gateway
        .wait_status("a mark written after the failure", STEP, |status| {
            status["high_water_file"]["mark"]
                .as_u64()
                .is_some_and(|now| now > mark)
        })
        .await;
    // /status shows the mark a moment before the ids are bound by it:
    // ready once they are.
    let deadline = Instant::now() + STEP;
    loop {
        let ready = support::get(gateway.admin, "/readyz").await;
        if ready.status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not ready {STEP:?} after the mark was written: {}; {status}",
            ready.text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ids.extend(stamp(&gateway, 20).await);
    gateway
        .wait_log("the high-water file takes writes again")
        .await;

    // It fails again, and the gateway is stopped meanwhile.
    std::fs::write(failing, b"").expect("the flag file");
    let failures = status["high_water_file"]["failures"]
        .as_u64()
        .expect("a count");
    gateway
        .wait_status("a failed write", STEP, |status| {
            status["high_water_file"]["failures"]
                .as_u64()
                .is_some_and(|now| now > failures)
        })
        .await;
    ids.extend(stamp(&gateway, 5).await);
    gateway.stop().await;
    assert!(
        gateway.stderr_text().contains("written before stands"),
        "the stop says which mark stands: {}",
        gateway.stderr_text()
    );
    std::fs::remove_file(failing).expect("removing the flag file");
    support::assert_unique(&ids);
    let last = ids.iter().copied().map(millis_of).max().expect("ids");
    assert!(
        mark_in(&file) >= last,
        "the file's mark {} is below the last id's millisecond {last}",
        mark_in(&file)
    );
}

/// A new build reaches the plugin file while ids stop at the mark: its
/// self-check could not tell a build that refuses every request with 503
/// from one that refuses for want of an id, so its reload is put off, not
/// passed (before, any 503 passed then, and a build refusing everything
/// went on to serve once ids resumed). `/status` shows the build waiting
/// and `POST /reload` answers 503 with `Retry-After`; the log says so once
/// per build, though the file watch asks at every poll. Once ids resume,
/// the file watch reloads it without being asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_while_ids_stop_at_the_mark_waits_until_they_resume() {
    let (_dir, file) = scratch("reload-at-the-mark");
    let dir = file.parent().expect("a directory");
    let Some(disk) = FaultyDisk::in_dir(dir) else {
        return;
    };
    let failing = &disk.flag;
    let plugin = dir.join("plugin.wasm");
    std::fs::write(&plugin, support::plugin_variant(1)).expect("the first build");
    let gateway = Gateway::start_with_env(
        &[
            "--high-water-file",
            file.to_str().expect("UTF-8"),
            "--plugin",
            plugin.to_str().expect("UTF-8"),
        ],
        &disk.env(),
    )
    .await;
    let first = support::sha256_hex(&support::plugin_variant(1));
    assert_eq!(gateway.status().await["plugin"]["sha256"], first.as_str());
    std::fs::write(failing, b"").expect("the flag file");
    let (_, refusal) = stamp_until_refused(&gateway).await;
    assert_eq!(refusal.status, 503, "{}", refusal.text());

    let second = support::plugin_variant(2);
    let second_sha = support::sha256_hex(&second);
    support::replace_by_rename(&plugin, &second);
    let status = gateway
        .wait_status(
            "the new build's reload put off",
            support::RELOAD_TIMEOUT,
            |status| status["deferred_reload"]["sha256"] == second_sha.as_str(),
        )
        .await;
    assert_eq!(status["plugin"]["sha256"], first.as_str(), "{status}");
    assert_eq!(status["reloads"]["failed"], 0, "{status}");
    assert!(status["last_reload_error"].is_null(), "{status}");
    let message = status["deferred_reload"]["message"].as_str().expect("why");
    assert!(
        message.contains("past the high-water mark") && message.contains("plugin.wasm"),
        "says why, naming the file: {message}"
    );
    let asked = support::post_empty(gateway.admin, "/reload").await;
    assert_eq!(asked.status, 503, "{}", asked.text());
    assert_eq!(
        asked.json()["error"]["code"],
        "reload_deferred",
        "{}",
        asked.text()
    );
    assert!(
        asked.headers.contains_key("retry-after"),
        "{:?}",
        asked.headers
    );
    assert_eq!(gateway.status().await["plugin"]["sha256"], first.as_str());
    let metrics = gateway.metrics().await;
    assert_eq!(
        support::metric(&metrics, "snowgate_plugin_reload_deferred"),
        1.0
    );
    assert_eq!(
        support::metric(&metrics, "snowgate_plugin_reload_failing"),
        0.0
    );

    // The disk recovers: ids resume, and the file watch reloads the build.
    std::fs::remove_file(failing).expect("removing the flag file");
    let status = gateway
        .wait_status("the new build serving", support::RELOAD_TIMEOUT, |status| {
            status["plugin"]["sha256"] == second_sha.as_str()
        })
        .await;
    assert!(status["deferred_reload"].is_null(), "{status}");
    assert_eq!(status["reloads"]["failed"], 0, "{status}");
    let metrics = gateway.metrics().await;
    assert_eq!(
        support::metric(&metrics, "snowgate_plugin_reload_deferred"),
        0.0
    );
    stamp(&gateway, 3).await;
    let log = gateway.stderr_text();
    assert_eq!(
        log.matches("plugin reload put off").count(),
        1,
        "put off once, said once: {log}"
    );
    gateway.stop().await;
}

/// `snowgate rewrite` of [`CONTEXT_ONLY`] with machine id [`MACHINE_ID`],
/// `args` and `env` added; a run past [`STEP`] is killed and fails the test.
fn rewrite(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_snowgate"));
    command
        .args(["rewrite", "--machine-id", &MACHINE_ID.to_string()])
        .args(args)
        .envs(env.iter().copied());
    support::run_bounded(command, CONTEXT_ONLY.as_bytes(), STEP)
}

/// The id a successful `rewrite` wrote on stdout.
fn rewritten_id(output: &std::process::Output) -> u64 {
    assert!(
        output.status.success(),
        "{}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stamped_id(&output.stdout)
}

/// `snowgate rewrite --high-water-file` keeps a machine id's history as a
/// gateway does, and shares it with gateways: each run continues after the
/// mark the last run or gateway on the file wrote, also after the wall
/// clock stepped back, and writes its last id's millisecond. Without the
/// file the same step back puts a run's id before the last one's (the
/// control, which shows the step is real).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewrite_runs_on_a_high_water_file_continue_after_its_mark() {
    let Some(library) = support::faketime() else {
        return;
    };
    let (_dir, file) = scratch("rewrite");
    let file_arg = file.to_str().expect("a UTF-8 path");
    let with_file = ["--high-water-file", file_arg];

    let first = rewritten_id(&rewrite(&with_file, &[]));
    assert_eq!(
        mark_in(&file),
        millis_of(first),
        "a run writes its id's millisecond"
    );

    let stepped = faked_clock(&library, STEP_BACK_AFTER_A_STOP);
    let control = rewritten_id(&rewrite(&[], &env_of(&stepped)));
    assert!(
        millis_of(control) < millis_of(first),
        "the control's clock did not step back: {} ms after the first id",
        millis_of(control) - millis_of(first)
    );

    let second = rewritten_id(&rewrite(&with_file, &env_of(&stepped)));
    assert!(
        second > first && millis_of(second) > millis_of(first),
        "after the step back, id {second} (at {}) is not after {first} (at {})",
        millis_of(second),
        millis_of(first)
    );
    assert_eq!(mark_in(&file), millis_of(second));

    // A gateway on the file, on the same stepped-back clock, continues
    // after the run; a run after the gateway continues after its ids.
    let gateway = Gateway::start_with_env(&with_file, &env_of(&stepped)).await;
    let served = stamp(&gateway, 20).await;
    gateway.stop().await;
    assert!(
        served.iter().all(|&id| millis_of(id) > millis_of(second)),
        "the gateway's ids start at {}, not after the run's {}",
        millis_of(*served.iter().min().expect("ids")),
        millis_of(second)
    );
    let third = rewritten_id(&rewrite(&with_file, &env_of(&stepped)));
    let last_served = served.iter().copied().map(millis_of).max().expect("ids");
    assert!(
        millis_of(third) > last_served,
        "the run's id at {} is not after the gateway's last at {last_served}",
        millis_of(third)
    );
    support::assert_unique(&[vec![first, second, third], served].concat());
}

/// A run cannot share a file with a gateway that holds it, writes no body
/// whose ids it could not record, and needs the system clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewrite_writes_no_body_its_high_water_file_did_not_record() {
    let (_dir, file) = scratch("rewrite-refused");
    let dir = file.parent().expect("a directory");
    let file_arg = file.to_str().expect("a UTF-8 path");
    let with_file = ["--high-water-file", file_arg];

    let gateway = Gateway::start(&with_file).await;
    let refused = rewrite(&with_file, &[]);
    gateway.stop().await;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{stderr}");
    assert!(refused.stdout.is_empty());
    assert!(
        stderr.contains("is in use by another process") && stderr.contains(file_arg),
        "{stderr}"
    );

    let fixed = rewrite(
        &[
            "--clock",
            "fixed:1764000000000",
            "--high-water-file",
            file_arg,
        ],
        &[],
    );
    assert_eq!(fixed.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&fixed.stderr).contains("--high-water-file needs --clock system"),
        "{}",
        String::from_utf8_lossy(&fixed.stderr)
    );

    let Some(disk) = FaultyDisk::in_dir(dir) else {
        return;
    };
    let failing = &disk.flag;
    std::fs::write(failing, b"").expect("the flag file");
    let before = mark_in(&file);
    let env = disk.env();
    let unrecorded = rewrite(&with_file, &env);
    let stderr = String::from_utf8_lossy(&unrecorded.stderr);
    assert_eq!(unrecorded.status.code(), Some(1), "{stderr}");
    assert!(
        unrecorded.stdout.is_empty(),
        "a body went out with ids the file does not hold: {}",
        String::from_utf8_lossy(&unrecorded.stdout)
    );
    assert!(
        stderr.contains("the ids made are not recorded, so the body is not written")
            && stderr.contains("Input/output error")
            && stderr.contains(file_arg),
        "{stderr}"
    );
    std::fs::remove_file(failing).expect("removing the flag file");
    let id = rewritten_id(&rewrite(&with_file, &env));
    assert!(millis_of(id) > before);
    assert_eq!(mark_in(&file), millis_of(id));
}

/// One file, one gateway: a second one on the same file is refused at
/// start, naming the file, while the first serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_gateway_on_the_same_file_is_refused() {
    let (_dir, file) = scratch("locked");
    let file_arg = file.to_str().expect("a UTF-8 path");
    let first = Gateway::start(&["--high-water-file", file_arg]).await;
    let (status, stderr) = failed_start(&["--machine-id", "8", "--high-water-file", file_arg]);
    assert_eq!(status, Some(1), "{stderr}");
    assert!(stderr.contains("is in use by another process"), "{stderr}");
    assert!(stderr.contains(file_arg), "{stderr}");
    stamp(&first, 1).await;
    first.stop().await;
}

/// A gateway whose file was replaced while it ran by one another process
/// holds (a second gateway of the same machine id, started on the path)
/// stops stamping at its next raise: the other starts from its own mark,
/// while the first's ids could run seconds ahead, over the same
/// milliseconds. Here the test holds the new file's lock, put in place by
/// a rename so that the first cannot make a file of its own there first;
/// then a second gateway takes it and serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_whose_file_another_took_stops_stamping() {
    use std::os::fd::AsRawFd as _;
    let (_dir, file) = scratch("taken");
    let file_arg = file.to_str().expect("a UTF-8 path");
    let first = Gateway::start(&["--high-water-file", file_arg]).await;
    stamp(&first, 1).await;
    let replacement = file.with_extension("new");
    let held = std::fs::File::create(&replacement).expect("created");
    // SAFETY: locks a file this test opened and keeps open.
    let locked = unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    assert_eq!(locked, 0, "the replacement locked");
    std::fs::rename(&replacement, &file).expect("put in place");
    first.wait_log("this gateway stops stamping").await;
    let refused = post_json(first.addr, "/v1/completions", CONTEXT_ONLY).await;
    assert_eq!(
        refused.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        refused.text()
    );
    assert!(
        refused.text().contains("in use by another process"),
        "{}",
        refused.text()
    );
    let readiness = get(first.admin, "/readyz").await;
    assert_eq!(readiness.status, StatusCode::SERVICE_UNAVAILABLE);
    drop(held);
    let second = Gateway::start(&["--high-water-file", file_arg]).await;
    stamp(&second, 1).await;
    first.stop().await;
    second.stop().await;
}

/// A file last written for another machine id (a machine id moved, a
/// file copied with a configuration) is used, its mark a safe floor, and
/// the start says whose history it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_of_another_machine_id_is_used_and_named_at_start() {
    let (_dir, file) = scratch("another-id");
    let file_arg = file.to_str().expect("a UTF-8 path");
    let first = Gateway::start(&["--high-water-file", file_arg]).await;
    let before = stamp(&first, 5).await;
    first.stop().await;
    assert!(
        !first
            .stderr_text()
            .contains("was last written by a gateway"),
        "{}",
        first.stderr_text()
    );
    let mark = mark_in(&file);

    let second = Gateway::start(&["--machine-id", "8", "--high-water-file", file_arg]).await;
    let reply = post_json(second.addr, "/v1/completions", CONTEXT_ONLY).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let id = stamped_id(reply.json()["body"].to_string().as_bytes());
    second.stop().await;
    let parts = SnowflakeLayout::TrtllmV1
        .decode(id)
        .expect("a trtllm-v1 id");
    assert_eq!(parts.machine_id, 8);
    assert!(
        parts.millis > mark,
        "{} after the mark {mark}",
        parts.millis
    );
    let stderr = second.stderr_text();
    assert!(
        stderr.contains(&format!(
            "was last written by a gateway stamping machine id {MACHINE_ID} in trtllm-v1; this \
             one stamps machine id 8 in trtllm-v1"
        )),
        "{stderr}"
    );
    assert!(before.iter().all(|&earlier| earlier != id));
}

/// A file that is damaged, or not a high-water file, stops the start with
/// a message that says so; so does the flag beside --etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_that_does_not_read_stops_the_start_saying_why() {
    let (_dir, file) = scratch("damaged");
    let file_arg = file.to_str().expect("a UTF-8 path");
    std::fs::write(&file, "not a mark\n").expect("written");
    let (status, stderr) = failed_start(&["--machine-id", "7", "--high-water-file", file_arg]);
    assert_eq!(status, Some(1), "{stderr}");
    assert!(
        stderr.contains("holds no readable high-water mark"),
        "{stderr}"
    );
    assert!(stderr.contains(file_arg), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    let (status, stderr) = failed_start(&[
        "--etcd",
        "http://127.0.0.1:1",
        "--high-water-file",
        file_arg,
    ]);
    assert_eq!(status, Some(2), "{stderr}");
    assert!(
        stderr.contains("--high-water-file is for a fixed --machine-id"),
        "{stderr}"
    );
}

/// A high-water file replaced while its gateway runs by one holding a
/// higher mark (a copy restored into place, another run's file moved
/// there) is taken over keeping that mark: the gateway's ids go on above
/// it, and neither its next raise nor its stop writes a lower mark over
/// it. Before, the takeover wrote the higher mark once, the next raise
/// about a second later wrote the gateway's own lower one over it, and the
/// gateway's ids went on below it, among those the file said were used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_replaced_by_one_with_a_higher_mark_keeps_it() {
    let Some(library) = support::faketime() else {
        return;
    };
    let (dir, file) = scratch("replaced");
    let file_arg = file.to_str().expect("a UTF-8 path");
    let gateway = Gateway::start(&["--high-water-file", file_arg]).await;
    let before = stamp(&gateway, 3).await;

    // A run 4 s ahead (within the id clock's lead) on a file of its own.
    let ahead = dir.path().join("ahead.mark");
    let faked = faked_clock(&library, "+4s");
    rewritten_id(&rewrite(
        &["--high-water-file", ahead.to_str().expect("a UTF-8 path")],
        &env_of(&faked),
    ));
    let adopted = mark_in(&ahead);
    assert!(
        adopted > before.iter().copied().map(millis_of).max().expect("ids") + 2_000,
        "the copy's mark is not ahead"
    );
    std::fs::rename(&ahead, &file).expect("replaced");
    gateway
        .wait_log("was removed or replaced while this gateway ran")
        .await;
    // Ids stop (503) from the takeover until the mark past the adopted
    // one is written.
    gateway
        .wait_status("the mark raised past the adopted one", STEP, |status| {
            status["high_water_file"]["mark"].as_u64() > Some(adopted)
        })
        .await;

    let after = stamp(&gateway, 20).await;
    for id in &after {
        assert!(
            millis_of(*id) > adopted,
            "an id at {} ms, not above the adopted mark {adopted}",
            millis_of(*id)
        );
    }
    // Two more raises: neither writes below it.
    let writes = gateway.status().await["high_water_file"]["writes"]
        .as_u64()
        .expect("a count");
    gateway
        .wait_status("two more raises", STEP, |status| {
            status["high_water_file"]["writes"].as_u64() >= Some(writes + 2)
        })
        .await;
    assert!(mark_in(&file) >= adopted, "lowered by a raise");
    gateway.stop().await;
    assert!(mark_in(&file) >= adopted, "lowered at the stop");
}
