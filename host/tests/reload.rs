//! Hot plugin reloads of a running `snowgate serve`: file changes (atomic
//! rename, in-place rewrite), SIGHUP and `POST /reload`; bad files that
//! must never replace a good build; and reloads under concurrent traffic.
//!
//! Distinct builds come from the bundled plugin with a custom section
//! appended ([`support::plugin_variant`]): same behaviour, new SHA-256.

mod support;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use serde_json::Value;
use snowgate_host::gateway::watch::POLL_INTERVAL;
use snowgate_host::gateway::NoReload;
use support::*;
use tokio::sync::Notify;

/// The watcher, quick (for the file-change tests).
const QUICK: &[&str] = &["--reload-debounce-ms", "50"];

/// The watcher effectively off (a 10-minute quiet time), so that only
/// SIGHUP or `POST /reload` can reload.
const NO_WATCH: &[&str] = &["--reload-debounce-ms", "600000"];

async fn start(path: &Path, upstream: Option<&TestUpstream>, extra: &[&str]) -> Gateway {
    let url = upstream.map(TestUpstream::url);
    let mut args = vec!["--plugin", arg(path)];
    if let Some(url) = &url {
        args.extend(["--upstream", url.as_str()]);
    }
    args.extend_from_slice(extra);
    Gateway::start(&args).await
}

/// A gateway (built-in echo upstream, `extra` flags) serving build 0 of the
/// plugin from `plugin.wasm` in a new temporary directory named `name`.
async fn serving_variant_0(name: &str, extra: &[&str]) -> (TempDir, PathBuf, Gateway) {
    let dir = TempDir::new(name);
    let path = dir.path().join("plugin.wasm");
    std::fs::write(&path, plugin_variant(0)).unwrap();
    let gateway = start(&path, None, extra).await;
    (dir, path, gateway)
}

fn sha_of(status: &Value) -> &str {
    status["plugin"]["sha256"].as_str().expect("plugin.sha256")
}

fn reloads(status: &Value) -> (u64, u64) {
    (
        status["reloads"]["succeeded"]
            .as_u64()
            .expect("reloads.succeeded"),
        status["reloads"]["failed"]
            .as_u64()
            .expect("reloads.failed"),
    )
}

fn last_error(status: &Value) -> Option<&str> {
    status["last_reload_error"]
        .get("message")
        .map(|m| m.as_str().expect("last_reload_error.message"))
}

/// An atomic replace (write a temporary file, rename it over the plugin)
/// is seen by the directory watcher and swapped in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_atomic_rename_is_picked_up() {
    let (_dir, path, gateway) = serving_variant_0("rename", QUICK).await;

    let status = gateway.status().await;
    assert_eq!(sha_of(&status), sha256_hex(&plugin_variant(0)));
    assert_eq!(status["plugin"]["source"], arg(&path));
    assert_eq!(reloads(&status), (0, 0));
    let before = assert_stamps(&gateway).await;

    let new = sha256_hex(&plugin_variant(1));
    replace_by_rename(&path, &plugin_variant(1));
    let status = gateway
        .wait_status("the renamed build to serve", RELOAD_TIMEOUT, |s| {
            sha_of(s) == new
        })
        .await;
    assert_eq!(reloads(&status), (1, 0), "{status:#}");
    assert_eq!(status["last_reload_error"], Value::Null);
    assert_eq!(status["plugin"]["name"], snowgate_plugin::PLUGIN_NAME);
    gateway.wait_log("plugin reloaded").await;
    let after = assert_stamps(&gateway).await;
    assert!(after > before, "ids keep increasing across a swap");
}

/// A gateway the system gives no file watch (out of inotify instances, as
/// a busy node runs out) starts all the same, says so, and a new build is
/// picked up by the poll. Before, the gateway refused to start.
///
/// The missing instances are a preloaded `inotify_init1` that fails with
/// `EMFILE` (`tests/shims/no_inotify.c`): the machine's own limit is the
/// whole user's, which a test must not use up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_without_file_watches_starts_and_polls() {
    let dir = TempDir::new("no-inotify");
    let Some(library) = built_shim(dir.path(), "no_inotify") else {
        return;
    };
    let path = dir.path().join("plugin.wasm");
    std::fs::write(&path, plugin_variant(0)).unwrap();
    let gateway = Gateway::start_with_env(
        &["--plugin", arg(&path), "--reload-debounce-ms", "50"],
        &[("LD_PRELOAD", library.to_str().expect("UTF-8"))],
    )
    .await;
    gateway
        .wait_log("could not watch the plugin directory")
        .await;
    assert_stamps(&gateway).await;
    let new = sha256_hex(&plugin_variant(1));
    replace_by_rename(&path, &plugin_variant(1));
    let status = gateway
        .wait_status(
            "the new build to serve, seen by the poll",
            RELOAD_TIMEOUT,
            |s| sha_of(s) == new,
        )
        .await;
    assert_eq!(reloads(&status), (1, 0), "{status:#}");
    assert_stamps(&gateway).await;
}

/// An in-place rewrite (truncate, then write the same path) is seen too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_place_rewrite_is_picked_up() {
    let (_dir, path, gateway) = serving_variant_0("in-place", QUICK).await;
    assert_stamps(&gateway).await;

    let new = sha256_hex(&plugin_variant(1));
    rewrite_in_place(&path, &plugin_variant(1));
    let status = gateway
        .wait_status("the rewritten build to serve", RELOAD_TIMEOUT, |s| {
            sha_of(s) == new
        })
        .await;
    assert_eq!(reloads(&status).0, 1, "{status:#}");
    assert_eq!(status["last_reload_error"], Value::Null);
    assert_stamps(&gateway).await;
}

/// A file removed, then written anew in pieces for longer than the quiet
/// time, and longer than the ten quiet times a reload waits at most
/// (`install`, `kubectl cp` of a large build, an editor's backup by
/// rename), is read once its write ends, not half written once the quiet
/// time after the removal runs out: no failed reload is counted, nor
/// raised as an alarm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_written_anew_slowly_after_a_removal_is_read_whole() {
    // A quiet time ten times each pause of the writer below, so that only
    // the removal's can run out before the write ends.
    let (_dir, path, gateway) =
        serving_variant_0("slow-write", &["--reload-debounce-ms", "500"]).await;
    let build = plugin_variant(1);
    let new = sha256_hex(&build);
    std::fs::remove_file(&path).unwrap();
    let mut file = std::fs::File::create(&path).unwrap();
    // About 6 s of writing in 120 pieces: twelve quiet times.
    for piece in build.chunks(build.len().div_ceil(120)) {
        std::io::Write::write_all(&mut file, piece).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(file);
    let status = gateway
        .wait_status("the new build to serve", RELOAD_TIMEOUT, |s| {
            sha_of(s) == new
        })
        .await;
    assert_eq!(reloads(&status), (1, 0), "{status:#}");
    assert_eq!(status["last_reload_error"], Value::Null, "{status:#}");
    assert_stamps(&gateway).await;
}

/// A writer that pauses mid-write longer than the quiet time and than the
/// poll's interval, with the file open (a copy from a slow volume, a
/// stalled `kubectl cp`), has its file read once its write ends, not half
/// written when the quiet time or the poll ran out: whether it wrote the
/// file anew after a removal, or in place. No failed reload is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_pauses_longer_than_the_quiet_time_and_the_poll_is_read_whole() {
    let (_dir, path, gateway) =
        serving_variant_0("paused-write", &["--reload-debounce-ms", "200"]).await;
    let pause = POLL_INTERVAL + Duration::from_millis(500);
    for (variant, anew) in [(1, true), (2, false)] {
        let build = plugin_variant(variant);
        let new = sha256_hex(&build);
        if anew {
            std::fs::remove_file(&path).unwrap();
        }
        let mut file = std::fs::File::create(&path).unwrap();
        let (first, rest) = build.split_at(build.len() / 2);
        std::io::Write::write_all(&mut file, first).unwrap();
        // The writer's pause: the behaviour under test.
        tokio::time::sleep(pause).await;
        std::io::Write::write_all(&mut file, rest).unwrap();
        drop(file);
        let status = gateway
            .wait_status("the new build to serve", RELOAD_TIMEOUT, |s| {
                sha_of(s) == new
            })
            .await;
        assert_eq!(reloads(&status), (u64::from(variant), 0), "{status:#}");
        assert_eq!(status["last_reload_error"], Value::Null, "{status:#}");
    }
    assert_stamps(&gateway).await;
}

/// Kubernetes updates a mounted ConfigMap by flipping a symlink: the path
/// is `plugin.wasm -> ..data/plugin.wasm`, and `..data` is renamed to
/// point at a new directory. The plugin file itself sees no event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_symlink_flipped_as_kubernetes_does_is_picked_up() {
    let dir = TempDir::new("configmap");
    let root = dir.path();
    let version = |n: u32| {
        let versioned = root.join(format!("..v{n}"));
        std::fs::create_dir(&versioned).unwrap();
        std::fs::write(versioned.join("plugin.wasm"), plugin_variant(n)).unwrap();
    };
    version(0);
    std::os::unix::fs::symlink("..v0", root.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/plugin.wasm", root.join("plugin.wasm")).unwrap();
    let gateway = start(&root.join("plugin.wasm"), None, QUICK).await;
    assert_eq!(
        sha_of(&gateway.status().await),
        sha256_hex(&plugin_variant(0))
    );

    version(1);
    std::os::unix::fs::symlink("..v1", root.join("..data_tmp")).unwrap();
    std::fs::rename(root.join("..data_tmp"), root.join("..data")).unwrap();
    std::fs::remove_dir_all(root.join("..v0")).unwrap();
    let new = sha256_hex(&plugin_variant(1));
    let status = gateway
        .wait_status("the flipped build to serve", RELOAD_TIMEOUT, |s| {
            sha_of(s) == new
        })
        .await;
    assert_eq!(reloads(&status).0, 1, "{status:#}");
    assert_stamps(&gateway).await;
}

/// A deploy that replaces the plugin's whole directory (`mv dir dir.old;
/// mv dir.new dir`) is seen, and so are later changes in the new
/// directory: the old directory's watch went with it, so the new one is
/// watched anew (before, only the poll saw them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_directory_is_picked_up_and_watched_after() {
    let dir = TempDir::new("replaced-dir");
    let live = dir.path().join("plugins");
    let path = live.join("plugin.wasm");
    std::fs::create_dir(&live).unwrap();
    std::fs::write(&path, plugin_variant(0)).unwrap();
    let gateway = start(&path, None, QUICK).await;

    let staged = dir.path().join("plugins.new");
    std::fs::create_dir(&staged).unwrap();
    std::fs::write(staged.join("plugin.wasm"), plugin_variant(1)).unwrap();
    std::fs::rename(&live, dir.path().join("plugins.old")).unwrap();
    std::fs::rename(&staged, &live).unwrap();
    let new = sha256_hex(&plugin_variant(1));
    gateway
        .wait_status("the new directory's build to serve", RELOAD_TIMEOUT, |s| {
            sha_of(s) == new
        })
        .await;
    gateway.wait_log("watching the new one").await;

    replace_by_rename(&path, &plugin_variant(2));
    let newer = sha256_hex(&plugin_variant(2));
    let status = gateway
        .wait_status(
            "a build renamed into the new directory",
            RELOAD_TIMEOUT,
            |s| sha_of(s) == newer,
        )
        .await;
    // Two swaps; a look between the two renames may also have found no
    // file, which is refused like any bad file.
    assert_eq!(reloads(&status).0, 2, "{status:#}");
    assert_stamps(&gateway).await;
}

/// A FIFO at the plugin path would block a plain read until some writer
/// came, holding the reload lock, so that neither later reloads nor a clean
/// stop could finish; a huge file would be read whole into memory. Both
/// are refused at once, naming the problem, and the gateway reloads and
/// stops as usual after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_or_an_oversized_file_is_refused_without_reading_it() {
    let (_dir, path, gateway) = serving_variant_0("fifo", NO_WATCH).await;

    let fifo = path.with_file_name(".fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo runs");
    assert!(made.success());
    std::fs::rename(&fifo, &path).unwrap();
    let message = reload_refused(&gateway).await;
    assert!(
        message.contains("it is a FIFO, not a regular file"),
        "{message}"
    );

    std::fs::remove_file(&path).unwrap();
    let big = std::fs::File::create(&path).unwrap();
    let limit = snowgate_host::gateway::plugin_file::MAX_PLUGIN_FILE_BYTES;
    big.set_len(limit + 1).unwrap(); // sparse
    let message = reload_refused(&gateway).await;
    assert!(
        message.contains(&format!("over the {limit} byte limit")),
        "{message}"
    );

    replace_by_rename(&path, &plugin_variant(1));
    let reply = post_empty(gateway.admin, "/reload").await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_stamps(&gateway).await;
    gateway.stop().await;
}

/// SIGHUP reloads (the watcher is muted, so only the signal can).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_plugin() {
    let (_dir, path, gateway) = serving_variant_0("sighup", NO_WATCH).await;

    let new = sha256_hex(&plugin_variant(1));
    rewrite_in_place(&path, &plugin_variant(1));
    gateway.signal("HUP");
    let status = gateway
        .wait_status("the build SIGHUP loaded", RELOAD_TIMEOUT, |s| {
            sha_of(s) == new
        })
        .await;
    assert_eq!(reloads(&status), (1, 0), "{status:#}");
    assert!(
        gateway.exited().is_none(),
        "SIGHUP must not stop the gateway"
    );
    gateway.wait_log("SIGHUP").await;
    assert_stamps(&gateway).await;

    // A SIGHUP with nothing new says so: nobody else would see it.
    gateway.signal("HUP");
    gateway
        .wait_log("SIGHUP: the plugin file holds the build that serves; nothing changed")
        .await;
    assert_eq!(reloads(&gateway.status().await), (1, 0));

    // A bad build is logged once, by the reload, at ERROR; the signal's
    // handler adds no second line. The handler takes one signal at a time,
    // so once the next SIGHUP's line is there, the first one's are too.
    rewrite_in_place(&path, b"not a component");
    gateway.signal("HUP");
    gateway.wait_log("plugin reload failed").await;
    rewrite_in_place(&path, &plugin_variant(1));
    gateway.signal("HUP");
    gateway
        .wait_log("the last reload error no longer holds")
        .await;
    let log = gateway.stderr_text();
    assert_eq!(log.matches("plugin reload failed").count(), 1, "{log}");
    assert!(!log.contains("SIGHUP: no reload"), "{log}");
    assert_eq!(reloads(&gateway.status().await), (1, 1));
}

/// A SIGHUP to a gateway serving the bundled plugin says why it reloads
/// nothing, instead of nothing at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_with_the_bundled_plugin_says_there_is_no_file() {
    let gateway = Gateway::start(&[]).await;
    gateway.signal("HUP");
    gateway
        .wait_log("SIGHUP: no reload: the bundled plugin has no file to reload from")
        .await;
    assert!(
        gateway.exited().is_none(),
        "SIGHUP must not stop the gateway"
    );
    assert_stamps(&gateway).await;
}

/// A SIGHUP that comes while the gateway is still loading its plugin (a
/// deploy script racing a restart, a plugin whose runtime takes seconds to
/// start) does not end the process, whose default action it would be: the
/// gateway starts, then reloads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sighup_while_the_plugin_loads_does_not_end_the_gateway() {
    let (_dir, path) = slow_configure_plugin("sighup-at-start");
    let gateway = Gateway::start_signalled_on_log(
        &[&["--plugin", arg(&path)][..], &SLOW_CONFIGURE].concat(),
        // Logged at the start of the load's first configure, which then
        // takes a second.
        "the hostile fixture starts a slow configure",
        "HUP",
    )
    .await;
    gateway.wait_log("SIGHUP: reloading the plugin").await;
    assert!(gateway.exited().is_none(), "{}", gateway.stderr_text());
    gateway.stop().await;
}

/// The hostile fixture in `plugin.wasm` of a new temporary directory
/// named for `tag`, to serve with [`SLOW_CONFIGURE`].
fn slow_configure_plugin(tag: &str) -> (TempDir, PathBuf) {
    let dir = TempDir::new(tag);
    let path = dir.path().join("plugin.wasm");
    std::fs::write(&path, snowgate_test_fixtures::HOSTILE_WASM).unwrap();
    (dir, path)
}

/// Flags that make the hostile fixture's `configure` log that it starts,
/// then take a second, within a deadline that allows it.
const SLOW_CONFIGURE: [&str; 4] = [
    "--plugin-setting",
    "hostile-configure=slow",
    "--plugin-deadline-ms",
    "10000",
];

/// A stop while a reload runs the new build's `configure` (here one that
/// sleeps a second) waits for it, and for the build's self-check after it,
/// as for a self-check under way: before, the stop went on, and the
/// runtime could be shut down under the sleeping call, whose thread then
/// panicked ("A Tokio 1.x context was found, but it is being shutdown").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_while_a_reload_configures_its_build_waits_for_it() {
    let (_dir, path) = slow_configure_plugin("stop-in-configure");
    let gateway = Gateway::start(
        &[
            &["--plugin", arg(&path), "--reload-debounce-ms", "10"][..],
            &SLOW_CONFIGURE,
        ]
        .concat(),
    )
    .await;
    let slow = "the hostile fixture starts a slow configure";
    let at_start = gateway.stderr_text().matches(slow).count();
    replace_by_rename(&path, &variant_of(snowgate_test_fixtures::HOSTILE_WASM, 1));
    // The new build's first instance is in its configure's second.
    gateway.wait_log_times(slow, at_start + 1).await;
    gateway.stop().await;
    let log = gateway.stderr_text();
    assert!(!log.contains("panicked"), "{log}");
    // The stop waited for the configure, and the self-check after it,
    // whose instance is configured too.
    assert!(log.matches(slow).count() >= at_start + 2, "{log}");
}

/// `POST /reload` answers `swapped` with the new SHA-256 when the file
/// changed, `unchanged` when it did not, and 422 with the reason when the
/// file is bad (the old build keeps serving); once the file is good again,
/// `last_reload_error` is cleared even though nothing was swapped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_reload_swaps_reports_unchanged_and_refuses_bad_files() {
    let (_dir, path, gateway) = serving_variant_0("post-reload", NO_WATCH).await;
    let first = sha256_hex(&plugin_variant(0));

    let reply = post_empty(gateway.admin, "/reload").await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(
        reply.json(),
        serde_json::json!({"result": "unchanged", "sha256": first})
    );

    let second = sha256_hex(&plugin_variant(1));
    rewrite_in_place(&path, &plugin_variant(1));
    let reply = post_empty(gateway.admin, "/reload").await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
    assert_eq!(
        reply.json(),
        serde_json::json!({"result": "swapped", "sha256": second})
    );
    let status = gateway.status().await;
    assert_eq!(sha_of(&status), second);
    assert_eq!(reloads(&status), (1, 0));
    assert_stamps(&gateway).await;

    let reply = post_empty(gateway.admin, "/reload").await;
    assert_eq!(
        reply.json(),
        serde_json::json!({"result": "unchanged", "sha256": second})
    );

    rewrite_in_place(&path, b"not a plugin");
    let message = reload_refused(&gateway).await;
    assert!(message.contains(arg(&path)), "names the file: {message}");
    let status = gateway.status().await;
    assert_eq!(sha_of(&status), second, "the old build keeps serving");
    assert_eq!(reloads(&status), (1, 1));
    assert_eq!(last_error(&status), Some(message.as_str()));
    let refused_at = status["last_reload_error"]["at"].clone();
    let metrics = gateway.metrics().await;
    assert!(
        metrics.contains("snowgate_plugin_reload_failing 1\n"),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!("sha256=\"{second}\"}} 1\n")),
        "{metrics}"
    );
    assert_stamps(&gateway).await;
    // Asked again for the same bytes (as after a `mv` the file watch saw
    // too): the same refusal, not compiled, counted or logged again.
    let failed = "plugin reload failed";
    gateway.wait_log(failed).await;
    assert_eq!(gateway.stderr_text().matches(failed).count(), 1);
    assert_eq!(reload_refused(&gateway).await, message);
    assert_eq!(reloads(&gateway.status().await), (1, 1));
    assert_eq!(gateway.stderr_text().matches(failed).count(), 1);

    // The serving build back in place: unchanged, and the error is gone.
    rewrite_in_place(&path, &plugin_variant(1));
    let reply = post_empty(gateway.admin, "/reload").await;
    assert_eq!(
        reply.json(),
        serde_json::json!({"result": "unchanged", "sha256": second})
    );
    let status = gateway.status().await;
    assert_eq!(status["last_reload_error"], Value::Null, "{status:#}");
    assert_eq!(reloads(&status), (1, 1));
    // The log, which said the reload failed, says that no longer holds.
    gateway
        .wait_log(
            "the file holds the build that serves again; the last reload error no longer holds",
        )
        .await;
    let metrics = gateway.metrics().await;
    assert!(
        metrics.contains("snowgate_plugin_reload_failing 0\n"),
        "{metrics}"
    );
    // The refused bytes again after that: the refusal holds again, and is
    // counted and logged as such.
    rewrite_in_place(&path, b"not a plugin");
    assert_eq!(reload_refused(&gateway).await, message);
    let status = gateway.status().await;
    assert_eq!(reloads(&status), (1, 2));
    assert_eq!(last_error(&status), Some(message.as_str()));
    let at = |value: &Value| value.as_str().expect("a time").to_string();
    assert!(
        at(&status["last_reload_error"]["at"]) > at(&refused_at),
        "the refusal again is as of now: {status:#}"
    );
    gateway.wait_log_times(failed, 2).await;
    rewrite_in_place(&path, &plugin_variant(1));
    post_empty(gateway.admin, "/reload").await;

    assert_eq!(
        get(gateway.admin, "/reload").await.status,
        StatusCode::METHOD_NOT_ALLOWED
    );
}

/// Truncated, garbage, a core module, a component of the wrong world, and
/// a deleted file: none replaces the serving build; each failure is counted,
/// logged and shown on /status. Restoring the serving build clears the
/// error without a swap; a new good build then swaps in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_files_never_replace_a_good_plugin() {
    let (_dir, path, gateway) = serving_variant_0("bad-files", QUICK).await;
    let good = sha256_hex(&plugin_variant(0));

    let good_bytes = plugin_variant(1);
    let truncated = good_bytes[..good_bytes.len() / 2].to_vec();
    // (what, new contents or deleted, renamed into place, what the error says)
    type Case = (&'static str, Option<Vec<u8>>, bool, &'static [&'static str]);
    let cases: [Case; 5] = [
        (
            "truncated",
            Some(truncated),
            false,
            &["not a valid WebAssembly component"],
        ),
        (
            "garbage",
            Some(b"GIF89a, not wasm at all".to_vec()),
            true,
            &["not a valid WebAssembly component", "magic header"],
        ),
        (
            "a core module",
            Some(b"\0asm\x01\0\0\0".to_vec()),
            true,
            &["not a valid WebAssembly component", "module"],
        ),
        // A valid, empty component: it exports nothing of the world.
        (
            "the wrong world",
            Some(b"\0asm\x0d\0\x01\0".to_vec()),
            false,
            &["does not export the snowgate:middleware/handler"],
        ),
        (
            "deleted",
            None,
            false,
            &["reading the plugin", "No such file"],
        ),
    ];
    let mut failed = 0;
    for (what, bytes, by_rename, expected) in cases {
        match &bytes {
            Some(bytes) if by_rename => replace_by_rename(&path, bytes),
            Some(bytes) => rewrite_in_place(&path, bytes),
            None => std::fs::remove_file(&path).unwrap(),
        }
        let status = gateway
            .wait_status(
                &format!("the {what} file to be refused"),
                RELOAD_TIMEOUT,
                |s| reloads(s).1 > failed,
            )
            .await;
        failed = reloads(&status).1;
        assert_eq!(sha_of(&status), good, "{what}: the old build keeps serving");
        assert_eq!(reloads(&status).0, 0, "{what}: {status:#}");
        let message = last_error(&status)
            .unwrap_or_else(|| panic!("{what}: no last_reload_error in {status:#}"));
        for expected in expected {
            assert!(message.contains(expected), "{what}: {message}");
        }
        assert!(
            message.contains(arg(&path)),
            "{what}: names the file: {message}"
        );
        assert!(status["last_reload_error"]["at"].is_string(), "{status:#}");
        assert_stamps(&gateway).await;
    }
    gateway.wait_log("the previous build keeps serving").await;
    let metrics = gateway.metrics().await;
    assert_eq!(
        metric(&metrics, r#"snowgate_reloads_total{result="failed"}"#),
        failed as f64
    );

    // Putting the serving build back is a reload that finds nothing wrong:
    // the error goes, with no swap.
    replace_by_rename(&path, &plugin_variant(0));
    let status = gateway
        .wait_status(
            "the restored file to clear the error",
            RELOAD_TIMEOUT,
            |s| s["last_reload_error"].is_null(),
        )
        .await;
    assert_eq!(sha_of(&status), good);
    assert_eq!(reloads(&status), (0, failed), "{status:#}");

    let new = sha256_hex(&good_bytes);
    replace_by_rename(&path, &good_bytes);
    let status = gateway
        .wait_status("a good file to serve again", RELOAD_TIMEOUT, |s| {
            sha_of(s) == new
        })
        .await;
    assert_eq!(status["last_reload_error"], Value::Null, "{status:#}");
    assert_eq!(reloads(&status), (1, failed));
    assert_stamps(&gateway).await;
}

/// One file change the replacer makes.
struct Change {
    bytes: Vec<u8>,
    /// Renamed into place, or rewritten in place.
    rename: bool,
    /// The variant written; `None` for a bad file.
    variant: Option<u32>,
}

/// Hundreds of context-only requests from 8 keep-alive clients while the
/// plugin file is replaced 20 times (alternating rename and in-place
/// rewrite) with a truncated and a garbage file in between: no request
/// fails, every id is unique, and /status ends on the last good build.
///
/// The replacer is paced by the clients' progress (one change every few
/// dozen completed requests), waits for each bad file to be refused and
/// for every fourth variant to serve (so swaps and refusals certainly
/// happen under traffic), and the clients keep going until the last build
/// serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_survive_repeated_plugin_replacement() {
    const CLIENTS: usize = 8;
    const MIN_PER_CLIENT: usize = 60;
    const VARIANTS: u32 = 20;
    /// Every this many variants the replacer waits until the variant
    /// serves, so that swaps certainly happen under traffic; the changes in
    /// between may be coalesced by the watcher's debounce.
    const CHECKPOINT: u32 = 4;

    let dir = TempDir::new("concurrent");
    let path = dir.path().join("plugin.wasm");
    std::fs::write(&path, plugin_variant(0)).unwrap();
    let upstream = TestUpstream::start().await;
    // A generous call deadline: the test checks reloads, not how a starved
    // CPU (two cores, compiles, other tests) meets the default 1 s.
    let gateway = Arc::new(
        start(
            &path,
            Some(&upstream),
            &[
                "--reload-debounce-ms",
                "50",
                "--plugin-deadline-ms",
                "10000",
            ],
        )
        .await,
    );

    let mut changes = Vec::new();
    for n in 1..=VARIANTS {
        if n == 7 {
            let bytes = plugin_variant(n);
            changes.push(Change {
                bytes: bytes[..bytes.len() / 3].to_vec(),
                rename: false,
                variant: None,
            });
        }
        if n == 14 {
            changes.push(Change {
                bytes: b"garbage, not a component".to_vec(),
                rename: true,
                variant: None,
            });
        }
        changes.push(Change {
            bytes: plugin_variant(n),
            rename: n % 2 == 1,
            variant: Some(n),
        });
    }
    let last_good = sha256_hex(&plugin_variant(VARIANTS));
    let pace = CLIENTS * MIN_PER_CLIENT / (changes.len() + 1);

    let completed = Arc::new(AtomicUsize::new(0));
    let progress = Arc::new(Notify::new());
    let stop = Arc::new(AtomicBool::new(false));

    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        let (addr, completed, progress, stop) = (
            gateway.addr,
            completed.clone(),
            progress.clone(),
            stop.clone(),
        );
        clients.push(tokio::spawn(async move {
            let mut client = Client::connect(addr).await;
            let mut ids = Vec::new();
            let mut failures = Vec::new();
            let mut i = 0;
            while i < MIN_PER_CLIENT || !stop.load(Ordering::SeqCst) {
                let body = format!(
                    r#"{{"model":"m","prompt":"client {c} request {i}","disaggregated_params":{{"request_type":"context_only"}}}}"#
                );
                let reply = client.post_json("/v1/completions", body).await;
                let id = serde_json::from_slice::<Value>(&reply.body)
                    .ok()
                    .and_then(|v| v["disaggregated_params"]["disagg_request_id"].as_u64());
                match (reply.status, id) {
                    (StatusCode::OK, Some(id)) => ids.push(id),
                    (status, _) => failures.push(format!(
                        "client {c} request {i}: {status} {}",
                        String::from_utf8_lossy(&reply.body)
                    )),
                }
                i += 1;
                completed.fetch_add(1, Ordering::SeqCst);
                progress.notify_one();
            }
            (ids, failures)
        }));
    }

    let replacer = {
        let (gateway, path, last_good) = (gateway.clone(), path.clone(), last_good.clone());
        async move {
            for (k, change) in changes.into_iter().enumerate() {
                let target = (k + 1) * pace;
                while completed.load(Ordering::SeqCst) < target {
                    progress.notified().await;
                }
                let failed_before = reloads(&gateway.status().await).1;
                if change.rename {
                    replace_by_rename(&path, &change.bytes);
                } else {
                    rewrite_in_place(&path, &change.bytes);
                }
                match change.variant {
                    None => {
                        gateway
                            .wait_status("a bad file to be refused", RELOAD_TIMEOUT, |s| {
                                reloads(s).1 > failed_before
                            })
                            .await;
                    }
                    Some(n) if n % CHECKPOINT == 0 => {
                        let sha = sha256_hex(&change.bytes);
                        gateway
                            .wait_status(&format!("variant {n} to serve"), RELOAD_TIMEOUT, |s| {
                                sha_of(s) == sha
                            })
                            .await;
                    }
                    Some(_) => {}
                }
            }
            gateway
                .wait_status("the last good build to serve", RELOAD_TIMEOUT, |s| {
                    sha_of(s) == last_good
                })
                .await
        }
    };
    let status = bounded("the replacer", Duration::from_secs(240), replacer).await;
    stop.store(true, Ordering::SeqCst);

    let mut ids = Vec::new();
    let mut failures = Vec::new();
    for client in clients {
        let (mut client_ids, mut client_failures) = bounded("a client", STEP, client)
            .await
            .expect("a client task");
        ids.append(&mut client_ids);
        failures.append(&mut client_failures);
    }
    assert!(
        failures.is_empty(),
        "{} failed requests, e.g. {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert!(
        ids.len() >= CLIENTS * MIN_PER_CLIENT,
        "{} requests",
        ids.len()
    );
    assert_unique(&ids);
    for &id in &ids {
        assert_fresh_v1_id(id);
    }

    let final_status = gateway.status().await;
    assert_eq!(sha_of(&final_status), last_good);
    assert_eq!(sha_of(&status), last_good);
    assert_eq!(
        final_status["last_reload_error"],
        Value::Null,
        "{final_status:#}"
    );
    let (succeeded, failed) = reloads(&final_status);
    assert!(
        succeeded >= u64::from(VARIANTS / CHECKPOINT),
        "at least every checkpoint variant swapped in: {final_status:#}"
    );
    assert!(
        failed >= 2,
        "the truncated and the garbage file were refused: {final_status:#}"
    );
    let metrics = gateway.metrics().await;
    assert_eq!(
        requests_with_outcome(&metrics, "rewritten"),
        ids.len() as f64
    );
    assert_eq!(requests_with_outcome(&metrics, "failed_closed"), 0.0);
    assert_eq!(upstream.seen().len(), ids.len());
    eprintln!(
        "{} requests, {} distinct ids, {succeeded} swaps, {failed} refused reloads",
        ids.len(),
        ids.len()
    );
}

/// A plugin slot of the library (no gateway process) loaded from a file in
/// a new temporary directory named after `name`, holding build 1: the
/// directory, the plugin file's path and the slot.
fn library_slot(name: &str) -> (TempDir, PathBuf, Arc<snowgate_host::gateway::PluginSlot>) {
    use snowgate_host::gateway::{Metrics, PluginSlot};
    use snowgate_host::{HostServices, IdClock, MachineIdentity, PluginEngine, PluginLimits};

    let dir = TempDir::new(name);
    let path = dir.path().join("plugin.wasm");
    std::fs::write(&path, plugin_variant(1)).expect("writing the first build");
    let services = HostServices {
        clock: Arc::new(IdClock::system()),
        identity: Arc::new(
            MachineIdentity::fixed(snowgate_plugin::SnowflakeLayout::TrtllmV1, MACHINE_ID)
                .expect("in range"),
        ),
    };
    let engine = PluginEngine::new(services, PluginLimits::default()).expect("an engine");
    let slot = Arc::new(
        PluginSlot::load(
            engine,
            Some(path.clone()),
            Vec::new(),
            Arc::new(Metrics::default()),
        )
        .expect("the first build loads"),
    );
    (dir, path, slot)
}

/// A reload whose caller stops waiting (an admin client that hangs up
/// drops the request's future) still runs to the end and swaps the build
/// in; had it stopped halfway, its check would run beside the next
/// reload's and the good build would be dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_whose_caller_gives_up_still_swaps_the_build_in() {
    let (_dir, path, slot) = library_slot("cancelled-reload");
    let second = plugin_variant(2);
    std::fs::write(&path, &second).expect("writing the second build");

    // Compiling and checking a build takes tens of milliseconds at least:
    // the caller gives up long before.
    let gave_up = tokio::time::timeout(Duration::from_micros(100), slot.reload()).await;
    assert!(
        gave_up.is_err(),
        "the reload finished before its caller gave up"
    );

    let wanted = sha256_hex(&second);
    let started = std::time::Instant::now();
    while slot.current().info().sha256 != wanted {
        assert!(
            started.elapsed() < RELOAD_TIMEOUT,
            "the abandoned reload never swapped the second build in"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(slot.metrics().reloads(), (1, 0));
}

/// A stopping gateway closes its slot before it gives up its machine id: a
/// reload's self-check already running finishes first, and none runs
/// afterwards (each takes an id from the clock). A reload still compiling
/// is not waited for (see `compile_limits.rs`): it ends refused, without
/// a self-check, counted as no failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_slot_lets_no_self_check_run_and_refuses_later_reloads() {
    let (_dir, path, slot) = library_slot("closed-slot");
    let clock = slot.engine().services().clock.clone();
    std::fs::write(&path, plugin_variant(2)).expect("writing the second build");

    // A reload under way when the slot closes either ran its self-check
    // before `close` returned or runs none: no id is taken afterwards.
    let running = tokio::spawn({
        let slot = slot.clone();
        async move { slot.reload().await }
    });
    slot.close().await;
    let issued_at_close = clock.issued();
    let outcome = running.await.expect("the reload task");
    assert_eq!(clock.issued(), issued_at_close, "an id taken after close");
    match outcome {
        Ok(_) => assert_eq!(slot.current().info().sha256, sha256_hex(&plugin_variant(2))),
        Err(e) => assert!(
            matches!(&e, NoReload::NotPossible(m) if m.contains("stopping")),
            "{e:?}"
        ),
    }
    let at_close = slot.current().info().sha256.clone();

    // Later reloads are refused, saying why; the file is not read, and no
    // failure is counted or shown.
    std::fs::write(&path, plugin_variant(3)).expect("writing the third build");
    let refused = slot.reload().await.expect_err("a reload after close");
    assert_eq!(
        refused,
        NoReload::NotPossible("the gateway is stopping: reloads are over".to_string())
    );
    assert_eq!(slot.current().info().sha256, at_close);
    assert_eq!(slot.metrics().reloads().1, 0);
    assert_eq!(slot.last_error(), None);
}

/// While the host holds no machine id (a lease lapsed, say), a new build
/// cannot show that it stamps: its reload is put off, neither passed nor
/// counted as failed, and the previous build keeps serving. Once the host
/// holds an id again, the same build reloads. A build that refuses every
/// request with 503 is not let in meanwhile: before, any 503 passed the
/// self-check while the host held no id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_machine_id_a_reload_is_put_off_until_one_is_held() {
    use snowgate_host::gateway::NoReload;
    let (_dir, path, slot) = library_slot("no-machine-id");
    let engine = slot.engine().clone();
    let identity = engine.services().identity.clone();
    let first = slot.current().info().sha256.clone();
    identity.withdraw("the lease lapsed (a test)");

    let second = plugin_variant(2);
    std::fs::write(&path, &second).expect("writing the second build");
    for _ in 0..2 {
        match slot.reload().await {
            Err(NoReload::Deferred(message)) => assert!(
                message.contains("the lease lapsed (a test)")
                    && message.contains("cannot show that it stamps")
                    && message.contains("plugin.wasm"),
                "{message}"
            ),
            other => panic!("expected the reload put off, got {other:?}"),
        }
    }
    assert_eq!(slot.current().info().sha256, first);
    assert_eq!(slot.metrics().reloads(), (0, 0));
    assert_eq!(slot.last_error(), None);
    let deferred = slot.deferred().expect("the build put off");
    assert_eq!(deferred.sha256, sha256_hex(&second));

    // The self-check's own rule, reached when ids stop between the check
    // before compiling and the self-check: a plugin's 503 cannot be judged.
    let refuses_all = [("hostile-reject-all".to_string(), "503".to_string())];
    let load_refusing_all = || {
        let error = snowgate_host::gateway::slot::load_checked(
            &engine,
            snowgate_test_fixtures::HOSTILE_WASM,
            &refuses_all,
        )
        .expect_err("a build refusing everything with 503 is not let in");
        format!("{error:#}")
    };
    let error = load_refusing_all();
    assert!(error.contains("cannot show that it stamps"), "{error}");

    identity.assign(MACHINE_ID).expect("in range");
    assert_eq!(
        slot.reload().await,
        Ok(snowgate_host::gateway::Reloaded::Swapped(sha256_hex(
            &second
        )))
    );
    assert_eq!(slot.deferred(), None);
    // With an id held, the same 503 is the build's own refusal.
    let error = load_refusing_all();
    assert!(
        error.contains("rejected a valid context-only request with 503"),
        "{error}"
    );
}

/// A reload asked by hand (`POST /reload`, SIGHUP) of the bytes the file
/// watch refused answers with that refusal at once, counted once, even
/// while the host holds no machine id: the build is not put off until an
/// id is held, to be compiled and refused again then. Before, it was put
/// off, and once an id was held the watch asked for it, and it was
/// compiled, refused and counted a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_the_watch_refused_is_refused_by_hand_at_once_with_or_without_an_id() {
    use snowgate_host::gateway::watch::watch_plugin_file;
    let (_dir, path, slot) = library_slot("refused-by-hand");
    let _watch = watch_plugin_file(slot.clone(), Duration::from_millis(50))
        .expect("a watch")
        .expect("a plugin file to watch");
    replace_by_rename(&path, b"not a component");
    until("the watch's reload refusing the file", || {
        slot.metrics().reloads() == (0, 1)
    })
    .await;
    let refused = slot.last_error().expect("the build refused");
    assert!(!refused.may_pass, "{refused:?}");

    let identity = slot.engine().services().identity.clone();
    identity.withdraw("the lease lapsed (a test)");
    let asked = slot.reload().await;
    assert_eq!(asked, Err(NoReload::Failed(refused.clone())));
    assert_eq!(slot.deferred(), None);
    identity.assign(MACHINE_ID).expect("in range");
    assert_eq!(slot.reload().await, Err(NoReload::Failed(refused.clone())));
    assert_eq!(slot.metrics().reloads(), (0, 1));
    assert_eq!(slot.last_error(), Some(refused));
}

/// Polls `done` (every 20 ms, at most [`RELOAD_TIMEOUT`]) until it holds.
async fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + RELOAD_TIMEOUT;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {RELOAD_TIMEOUT:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The files the compile cache holds: `*.cwasm`, sorted.
fn cached_builds(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("the cache directory")
        .map(|entry| entry.expect("an entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "cwasm"))
        .collect();
    files.sort();
    files
}

/// Waits for the compile cache to hold `count` builds: a build is stored
/// once it serves, on a thread of its own (its swap does not wait).
async fn stored_builds(dir: &Path, count: usize) -> Vec<PathBuf> {
    let deadline = tokio::time::Instant::now() + STEP;
    loop {
        let builds = cached_builds(dir);
        if builds.len() == count {
            return builds;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the cache holds {builds:?}, not {count} builds, after {STEP:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `snowgate_plugin_loads_total`: (compiled now, read from the cache).
async fn loads(gateway: &Gateway) -> (f64, f64) {
    let metrics = gateway.metrics().await;
    let count = |compiled: &str| {
        metric(
            &metrics,
            &format!("snowgate_plugin_loads_total{{compiled=\"{compiled}\"}}"),
        )
    };
    (count("now"), count("cache"))
}

fn compiled(status: &Value) -> &str {
    status["plugin"]["compiled"]
        .as_str()
        .expect("plugin.compiled")
}

/// With `--plugin-cache-dir`, a restart and a reload back to a build served
/// before read the compiled build instead of compiling; a new build is
/// compiled and stored; a cached file that is no longer a build is compiled
/// again and replaced, never the gateway's end.
#[tokio::test(flavor = "multi_thread")]
async fn the_compile_cache_serves_restarts_and_reloads_back_and_survives_a_bad_file() {
    use std::os::unix::fs::PermissionsExt as _;

    let dir = TempDir::new("compile-cache");
    let cache = dir.path().join("cache");
    let path = dir.path().join("plugin.wasm");
    std::fs::write(&path, plugin_variant(0)).unwrap();
    let flags = [QUICK, &["--plugin-cache-dir", arg(&cache)]].concat();

    // First start: compiled, and stored for this user only.
    let gateway = start(&path, None, &flags).await;
    let status = gateway.status().await;
    assert_eq!(compiled(&status), "now");
    let first_build = sha_of(&status).to_string();
    let stored = stored_builds(&cache, 1).await;
    let name = stored[0].file_name().unwrap().to_string_lossy().to_string();
    assert!(
        name.starts_with(&first_build),
        "{name} is keyed by the component's SHA-256"
    );
    let mode = std::fs::metadata(&stored[0]).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    assert_eq!(
        std::fs::metadata(&cache).unwrap().permissions().mode() & 0o777,
        0o700
    );
    let before_restart = assert_stamps(&gateway).await;
    gateway.stop().await;

    // A restart reads it.
    let gateway = start(&path, None, &flags).await;
    let status = gateway.status().await;
    assert_eq!(compiled(&status), "cache", "{status:#}");
    assert_eq!(sha_of(&status), first_build);
    assert!(assert_stamps(&gateway).await > before_restart);
    assert_eq!(loads(&gateway).await, (0.0, 1.0));

    // A new build is compiled and stored beside it; going back to the
    // first reads the first again.
    replace_by_rename(&path, &plugin_variant(1));
    let status = gateway
        .wait_status("build 1 to serve", STEP, |s| sha_of(s) != first_build)
        .await;
    assert_eq!(compiled(&status), "now");
    stored_builds(&cache, 2).await;
    replace_by_rename(&path, &plugin_variant(0));
    let status = gateway
        .wait_status("build 0 to serve again", STEP, |s| sha_of(s) == first_build)
        .await;
    assert_eq!(compiled(&status), "cache", "{status:#}");
    assert_stamps(&gateway).await;
    assert_eq!(
        loads(&gateway).await,
        (1.0, 2.0),
        "compiled now, read from the cache"
    );
    gateway.stop().await;

    // A cached file that is not a build the cache wrote and checked is
    // compiled again, with a warning that names the problem, and replaced
    // by a good one; never run, never waited on.
    let the_file = stored[0].clone();
    /// What a spoiled file must be refused for, and how to spoil it.
    type Spoiler<'a> = (&'static str, Box<dyn Fn() + 'a>);
    let spoilers: [Spoiler; 5] = [
        // Where wasmtime would not notice, and would run broken code.
        (
            "checksum does not match",
            Box::new(|| {
                let mut damaged = std::fs::read(&the_file).unwrap();
                let middle = damaged.len() / 2;
                for byte in &mut damaged[middle..middle + 4096] {
                    *byte = !*byte;
                }
                std::fs::write(&the_file, &damaged).unwrap();
            }),
        ),
        // Another user's hard link to a build of ours, under this name.
        (
            "one name",
            Box::new(|| {
                let _ = std::fs::remove_file(dir.path().join("second-name"));
                std::fs::hard_link(&the_file, dir.path().join("second-name")).unwrap();
            }),
        ),
        // A FIFO would make a plain open wait for a writer for ever.
        (
            "not a regular file",
            Box::new(|| {
                std::fs::remove_file(&the_file).unwrap();
                let status = std::process::Command::new("mkfifo")
                    .arg(&the_file)
                    .status()
                    .expect("mkfifo");
                assert!(status.success());
            }),
        ),
        // Sparse: 2 GiB that would all be read into memory.
        (
            "more than any build",
            Box::new(|| {
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&the_file)
                    .unwrap();
                file.set_len(2 << 30).unwrap();
            }),
        ),
        (
            "others may write to it",
            Box::new(|| {
                std::fs::set_permissions(&the_file, std::fs::Permissions::from_mode(0o666))
                    .unwrap();
            }),
        ),
    ];
    for (problem, spoil) in spoilers {
        spoil();
        let gateway = start(&path, None, &flags).await;
        let status = gateway.status().await;
        assert_eq!(compiled(&status), "now", "{problem}: {status:#}");
        assert!(
            gateway.stderr_text().contains(problem),
            "{problem}: {}",
            gateway.stderr_text()
        );
        assert_stamps(&gateway).await;
        gateway.stop().await;
        let gateway = start(&path, None, &flags).await;
        assert_eq!(compiled(&gateway.status().await), "cache", "{problem}");
        // The file it was read from may change or go while it serves.
        std::fs::write(&the_file, b"").unwrap();
        assert_stamps(&gateway).await;
        gateway.stop().await;
        // Good again for the next case.
        let gateway = start(&path, None, &flags).await;
        assert_eq!(compiled(&gateway.status().await), "now", "{problem}");
        gateway.stop().await;
    }
}

/// A compiled build is stored once it serves, on a thread of its own, one
/// write at a time: a cache volume that hangs does not hold up the swap
/// nor gather a thread per reload, and a stop waits for the write, so that
/// the next start reads the build. The hung volume is
/// the real cache directory with each `fsync` held while a flag file
/// exists (`tests/shims/faulty_fdatasync.c`, preloaded).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_cache_volume_holds_up_no_swap_and_a_stop_waits_for_the_write() {
    let dir = TempDir::new("compile-cache-hung");
    let Some(shim) = built_shim(dir.path(), "faulty_fdatasync") else {
        return;
    };
    let cache = dir.path().join("cache");
    let hold = dir.path().join("hold");
    let path = dir.path().join("plugin.wasm");
    std::fs::write(&path, plugin_variant(0)).unwrap();
    let flags = [QUICK, &["--plugin-cache-dir", arg(&cache)]].concat();
    let env = [("LD_PRELOAD", arg(&shim)), ("HOLD_FSYNC_WHILE", arg(&hold))];
    let mut args = vec!["--plugin", arg(&path)];
    args.extend_from_slice(&flags);
    let gateway = Gateway::start_with_env(&args, &env).await;
    stored_builds(&cache, 1).await;

    std::fs::write(&hold, b"").unwrap();
    let new = sha256_hex(&plugin_variant(1));
    replace_by_rename(&path, &plugin_variant(1));
    let status = gateway
        .wait_status("build 1 to serve", STEP, |s| sha_of(s) == new)
        .await;
    assert_eq!(compiled(&status), "now");
    assert_stamps(&gateway).await;
    // Its write is still held: the swap did not wait for it.
    assert_eq!(cached_builds(&cache).len(), 1);
    // One write at a time: a build swapped in meanwhile leaves no second
    // thread waiting on the volume (with its build in memory).
    let newer = sha256_hex(&plugin_variant(2));
    replace_by_rename(&path, &plugin_variant(2));
    gateway
        .wait_status("build 2 to serve", STEP, |s| sha_of(s) == newer)
        .await;
    gateway
        .wait_log(
            "the new build is not stored in the compile cache: a write to it is still under way",
        )
        .await;
    let writers = std::fs::read_dir(format!("/proc/{}/task", gateway.pid()))
        .expect("the gateway's threads")
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("snowgate-compil"))
        .count();
    assert_eq!(writers, 1, "threads writing to the compile cache");

    gateway.signal("TERM");
    // Released only once the stop waits for it: a stop that did not would
    // end first.
    gateway
        .wait_log("waiting up to 10 s for the compile cache write under way")
        .await;
    std::fs::remove_file(&hold).unwrap();
    let exited = gateway.wait_exit(STEP).await;
    assert!(exited.success(), "{exited}: {}", gateway.stderr_text());
    assert_eq!(cached_builds(&cache).len(), 2, "{}", gateway.stderr_text());
    // Build 2, not stored, is compiled again; build 1 was.
    let gateway = start(&path, None, &flags).await;
    assert_eq!(compiled(&gateway.status().await), "now");
    gateway.stop().await;
    replace_by_rename(&path, &plugin_variant(1));
    let gateway = start(&path, None, &flags).await;
    assert_eq!(compiled(&gateway.status().await), "cache");
    gateway.stop().await;
}

/// Only a build that passed the load-time self-check is kept: one that
/// never stamps is refused and leaves nothing in the cache; one that
/// rejects the canned request for want of credentials (401, 403) passes,
/// one that rejects it otherwise does not. A cached build
/// whose memory is over a lower limit is refused with the limit's own
/// message, without compiling it again.
#[test]
fn the_compile_cache_keeps_only_accepted_builds_and_names_the_memory_limit() {
    use snowgate_host::gateway::slot::load_checked;
    use snowgate_host::{
        CompileCache, HostServices, IdClock, MachineIdentity, PluginEngine, PluginLimits,
    };
    use snowgate_plugin::SnowflakeLayout;

    let dir = TempDir::new("compile-cache-accepted");
    let engine = |limits: PluginLimits| {
        let services = HostServices {
            clock: Arc::new(IdClock::system()),
            identity: Arc::new(MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 1).unwrap()),
        };
        let cache = CompileCache::open(dir.path()).expect("the cache");
        PluginEngine::new(services, limits)
            .expect("an engine")
            .with_compile_cache(cache)
    };
    let ours = engine(PluginLimits::default());

    let never_stamps = [("hostile-handle".to_string(), "forward".to_string())];
    let error = load_checked(&ours, snowgate_test_fixtures::HOSTILE_WASM, &never_stamps)
        .expect_err("refused by the self-check");
    assert!(format!("{error:#}").contains("self-check"), "{error:#}");
    assert_eq!(cached_builds(dir.path()), Vec::<PathBuf>::new());

    let plugin = load_checked(&ours, &plugin_variant(7), &[]).expect("accepted");
    assert_eq!(plugin.info().compiled.name(), "now");
    // Checked, not kept: the slot keeps a build once it serves.
    assert_eq!(cached_builds(dir.path()), Vec::<PathBuf>::new());
    plugin.keep_compiled();
    assert_eq!(cached_builds(dir.path()).len(), 1);

    // A build that rejects the canned request (it lacks an API key) sends
    // nothing on unstamped: it passes, and serves as it means to.
    let wants_a_key = [(
        "hostile-require-header".to_string(),
        "x-api-key".to_string(),
    )];
    let plugin = load_checked(&ours, snowgate_test_fixtures::HOSTILE_WASM, &wants_a_key)
        .unwrap_or_else(|e| panic!("a build that rejects the self-check: {e:#}"));
    // 403 passes too; any other rejection of a valid request does not.
    for (status, passes) in [
        ("403", true),
        ("400", false),
        ("503", false),
        ("422", false),
    ] {
        let settings = [("hostile-reject-all".to_string(), status.to_string())];
        let loaded = load_checked(&ours, snowgate_test_fixtures::HOSTILE_WASM, &settings);
        assert_eq!(loaded.is_ok(), passes, "{status}");
        if let Err(e) = loaded {
            assert!(
                format!("{e:#}").contains(&format!(
                    "rejected a valid context-only request with {status}"
                )),
                "{e:#}"
            );
        }
    }
    let request = |headers: &[(&str, &str)]| snowgate_host::Request {
        method: "POST".into(),
        path: "/v1/completions".into(),
        headers: headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect::<Vec<_>>()
            .into(),
        body: br#"{"disaggregated_params":{"request_type":"context_only"}}"#.to_vec(),
    };
    match plugin.handle(&request(&[])) {
        Ok(snowgate_host::Action::Reject(r)) => {
            assert_eq!((r.status, r.code.as_str()), (401, "missing_header"))
        }
        other => panic!(
            "expected 401 without the key, got {:?}",
            other.map(|_| "another answer")
        ),
    }
    match plugin.handle(&request(&[("x-api-key", "k")])) {
        Ok(snowgate_host::Action::ForwardWithBody(body)) => {
            let value: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
            assert!(
                value["disaggregated_params"]["disagg_request_id"].is_u64(),
                "{value}"
            );
        }
        other => panic!(
            "expected a stamp with the key, got {:?}",
            other.map(|_| "another answer")
        ),
    }

    // The bundled plugin's memory starts at 1 MiB and more. Its compile
    // process always fails: the refusal must come from the cached build,
    // read, not from a compile.
    // SAFETY: `false` writes no build; nothing it writes is loaded.
    let never_compiles = unsafe {
        snowgate_host::CompileProcess::of_program(
            "false",
            &[],
            snowgate_host::CompileLimits::default(),
        )
    };
    let small = engine(PluginLimits {
        memory_bytes: 64 << 10,
        ..PluginLimits::default()
    })
    .with_compile_process(never_compiles);
    let error = load_checked(&small, &plugin_variant(7), &[]).expect_err("over the limit");
    let error = format!("{error:#}");
    assert!(error.contains("--plugin-memory-mib"), "{error}");
    assert!(!error.contains("compile process"), "{error}");
}

/// A build whose ids are not made of the ticks it took is refused by the
/// self-check, even while other requests take ticks of the same clock.
/// Before, the check asked only for a millisecond between the clock's last
/// ticks before and after the call: under traffic a build that made ids of
/// the wall clock and a counter of its own, taking no tick, passed, as did
/// at any time one that stamped the tick's millisecond with sequence 0.
/// Builds that repeat ids within a batch, or keep an id from one call of
/// an instance to the next, are refused by the batch that follows on the
/// same instance. The bundled plugin still passes under the same traffic.
#[test]
fn a_build_whose_ids_are_not_its_ticks_is_refused_under_traffic() {
    use snowgate_host::gateway::slot::load_checked;
    use snowgate_host::{HostServices, IdClock, MachineIdentity, PluginEngine, PluginLimits};
    use snowgate_plugin::SnowflakeLayout;

    let clock = Arc::new(IdClock::system());
    let services = HostServices {
        clock: clock.clone(),
        identity: Arc::new(MachineIdentity::fixed(SnowflakeLayout::TrtllmV1, 1).unwrap()),
    };
    let engine = PluginEngine::new(services, PluginLimits::default()).expect("an engine");
    // Other requests' ticks, one at a time, until the checks are over,
    // counted so that each check is seen to run under them.
    let checks_over = Arc::new(AtomicBool::new(false));
    let taken = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let traffic = std::thread::spawn({
        let (clock, over, taken) = (clock.clone(), checks_over.clone(), taken.clone());
        move || {
            while !over.load(Ordering::Relaxed) {
                let tick = clock.next_tick(4096).expect("a tick");
                taken.fetch_add(1, Ordering::Relaxed);
                // Paced to the wall clock: a lead past 9 s would refuse
                // ticks, the checks' too.
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .expect("after 1970")
                    .as_millis() as u64;
                if tick.millis > now {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    });
    let started = std::time::Instant::now();
    while taken.load(Ordering::Relaxed) == 0 {
        assert!(started.elapsed() < STEP, "the traffic never began");
        std::thread::yield_now();
    }
    // Asserts that the traffic went on while `check` ran.
    let under_traffic = |what: &str, check: &mut dyn FnMut()| {
        let before = taken.load(Ordering::Relaxed);
        check();
        assert!(
            taken.load(Ordering::Relaxed) > before,
            "{what}: no traffic ran during the check"
        );
    };
    // The last three stamp their one request well: called again on the
    // same instance, they show it, even one that takes no batches.
    for (ids, batches, says) in [
        (
            "own-clock",
            None,
            ["took no tick of the host's id clock", "could repeat"],
        ),
        (
            "no-sequence",
            None,
            [
                "is not a tick the host's id clock gave the call",
                "could repeat",
            ],
        ),
        (
            "one-tick-a-call",
            None,
            ["stamped the same id, ", SELF_CHECK_BATCH],
        ),
        (
            "kept-tick",
            None,
            [
                "took no tick of the host's id clock",
                SELF_CHECK_SECOND_CALL,
            ],
        ),
        (
            "kept-tick",
            Some("400"),
            [
                "took no tick of the host's id clock",
                SELF_CHECK_SECOND_CALL,
            ],
        ),
    ] {
        under_traffic(ids, &mut || {
            let mut settings = vec![("hostile-ids".to_string(), ids.to_string())];
            settings.extend(batches.map(|s| ("hostile-reject-batches".to_string(), s.to_string())));
            let error = load_checked(&engine, snowgate_test_fixtures::HOSTILE_WASM, &settings)
                .expect_err(ids);
            let error = format!("{error:#}");
            assert!(
                says.iter().all(|said| error.contains(said)),
                "{ids}: {error}"
            );
        });
    }
    // A build that takes no batches, and stamps one request at a time as
    // the contract says, passes.
    under_traffic("no batches", &mut || {
        let settings = [("hostile-reject-batches".to_string(), "400".to_string())];
        load_checked(&engine, snowgate_test_fixtures::HOSTILE_WASM, &settings)
            .expect("a build that takes no batches");
    });
    under_traffic("the bundled plugin", &mut || {
        load_checked(&engine, snowgate_plugin_bundle::PLUGIN_WASM, &[])
            .expect("the bundled plugin");
    });
    checks_over.store(true, Ordering::Relaxed);
    traffic.join().expect("the traffic thread");
}
