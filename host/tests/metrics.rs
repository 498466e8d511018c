//! The gateway's `/metrics`, read as Prometheus reads it: linted by
//! Prometheus's own `promtool` after requests down many paths, and the
//! gauges an operator alerts on (readiness, the machine id held) checked
//! against what `/readyz` and `/status` say.

mod support;

use std::io::Write as _;
use std::process::{Command, Stdio};

use http::StatusCode;
use support::*;

/// `promtool`, where it is here (Debian's `prometheus` package; `.ci/run`
/// installs it).
fn promtool_present() -> bool {
    let present = Command::new("promtool")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    tool_present(
        present,
        "promtool",
        "apt-get install --no-install-recommends prometheus",
    )
}

/// What `promtool check metrics` says of `text`: `Ok` when it finds
/// nothing, otherwise its complaints.
fn promtool_check(text: &str) -> Result<(), String> {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start promtool");
    child
        .stdin
        .take()
        .expect("promtool's stdin")
        .write_all(text.as_bytes())
        .expect("write the metrics to promtool");
    let output = child.wait_with_output().expect("promtool's answer");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    if output.status.success() && said.trim().is_empty() {
        Ok(())
    } else {
        Err(format!("{}: {said}", output.status))
    }
}

/// Every family the gateway can render, after requests that end every
/// common way (stamped, passed through, refused as bad JSON, too large,
/// over HTTP/2, a reload and a failed one), passes `promtool check
/// metrics`: no missing HELP or TYPE, counters named `_total`, units in
/// names, no duplicate or malformed series. The lint is checked to catch
/// a bad family, so that a pass means something.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_pass_promtools_lint_after_requests_down_many_paths() {
    if !promtool_present() {
        return;
    }
    assert!(
        promtool_check("# HELP requests Requests.\n# TYPE requests counter\nrequests 1\n").is_err(),
        "promtool lints: a counter not named _total is refused"
    );

    let dir = TempDir::new("metrics-lint");
    let plugin = dir.path().join("plugin.wasm");
    std::fs::write(&plugin, plugin_variant(0)).expect("write the plugin");
    let mark = dir.path().join("high-water");
    let upstream = TestUpstream::start().await;
    let gateway = Gateway::start(&[
        "--upstream",
        &upstream.url(),
        "--plugin",
        arg(&plugin),
        "--high-water-file",
        arg(&mark),
        "--max-upstream-requests",
        "16",
        "--max-body-bytes",
        "65536",
    ])
    .await;
    let before = gateway.metrics().await;
    promtool_check(&before).unwrap_or_else(|e| panic!("at start: {e}\n{before}"));

    let stamped = post_json(gateway.addr, "/v1/completions", CONTEXT_ONLY).await;
    assert_eq!(stamped.status, StatusCode::OK, "{}", stamped.text());
    let bad = post_json(gateway.addr, "/v1/completions", "{\"prompt\":").await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.text());
    let large = post_json(gateway.addr, "/v1/completions", vec![b' '; 70_000]).await;
    assert_eq!(large.status, StatusCode::PAYLOAD_TOO_LARGE);
    let models = get(gateway.addr, "/v1/models").await;
    assert_eq!(models.status, StatusCode::OK);
    let mut sender = http2_to::<http_body_util::Full<bytes::Bytes>>(gateway.addr).await;
    let request = http::Request::post(format!("http://{}/v1/completions", gateway.addr))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(CONTEXT_ONLY)))
        .expect("a request");
    let over_h2 = sender.send_request(request).await.expect("an answer");
    assert_eq!(over_h2.status(), StatusCode::OK);
    replace_by_rename(&plugin, &plugin_variant(1));
    let reloaded = post_empty(gateway.admin, "/reload").await;
    assert_eq!(reloaded.status, StatusCode::OK, "{}", reloaded.text());
    replace_by_rename(&plugin, b"not a component");
    let refused = post_empty(gateway.admin, "/reload").await;
    assert_eq!(refused.status, StatusCode::UNPROCESSABLE_ENTITY);

    let after = gateway.metrics().await;
    for family in [
        "snowgate_requests_total",
        "snowgate_plugin_call_seconds",
        "snowgate_upstream_busy_total",
        "snowgate_high_water_file_writes_total",
        "snowgate_ready",
        "snowgate_machine_id_info",
        "snowgate_body_memory_lane_max_bytes",
        "snowgate_build_info",
        "process_resident_memory_bytes",
        "process_open_fds",
    ] {
        assert!(
            after.contains(&format!("# TYPE {family} ")),
            "{family} rendered: {after}"
        );
    }
    promtool_check(&after).unwrap_or_else(|e| panic!("after requests: {e}\n{after}"));
    gateway.stop().await;
}

/// `snowgate_ready` says what `/readyz` says, and
/// `snowgate_machine_id_info` names the machine id `/status` names, with
/// its layout, so that two replicas holding one machine id can be alerted
/// on from the metrics alone; the id clock's lead and the small bodies'
/// lane are there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_id_gauges_say_what_readyz_and_status_say() {
    let upstream = TestUpstream::start().await;
    for (layout, machine_id) in [("trtllm-v1", "7"), ("trtllm-v2", "300")] {
        let gateway = Gateway::start(&[
            "--upstream",
            &upstream.url(),
            "--layout",
            layout,
            "--machine-id",
            machine_id,
            "--body-memory-mib",
            "64",
        ])
        .await;
        let status = get(gateway.admin, "/status").await.json();
        assert_eq!(status["machine_id"].to_string(), machine_id, "{status}");
        assert_eq!(get(gateway.admin, "/readyz").await.status, StatusCode::OK);
        let metrics = gateway.metrics().await;
        assert_eq!(metric(&metrics, "snowgate_ready"), 1.0, "{metrics}");
        let info =
            format!("snowgate_machine_id_info{{machine_id=\"{machine_id}\",layout=\"{layout}\"}}");
        assert_eq!(metric(&metrics, &info), 1.0, "{metrics}");
        assert_eq!(
            metrics.matches("snowgate_machine_id_info{").count(),
            1,
            "one series: {metrics}"
        );
        let lead = metric(&metrics, "snowgate_id_clock_lead_seconds");
        assert!((0.0..9.0).contains(&lead), "{lead}: {metrics}");
        // A sixteenth of the body memory.
        assert_eq!(
            metric(&metrics, "snowgate_body_memory_lane_max_bytes"),
            (4 << 20) as f64,
            "{metrics}"
        );

        // Stopping, draining a request in flight: not ready, in both.
        let addr = gateway.addr;
        let in_flight =
            tokio::spawn(
                async move { post_json(addr, "/hold/v1/completions", CONTEXT_ONLY).await },
            );
        bounded(
            "the held request to reach the upstream",
            STEP,
            upstream.state.held.notified(),
        )
        .await;
        gateway.signal("TERM");
        wait_refused(gateway.addr, STEP).await;
        let readiness = get(gateway.admin, "/readyz").await;
        assert_eq!(readiness.status, StatusCode::SERVICE_UNAVAILABLE);
        let metrics = gateway.metrics().await;
        assert_eq!(metric(&metrics, "snowgate_ready"), 0.0, "{metrics}");
        upstream.state.release.notify_one();
        let reply = bounded("the in-flight request", STEP, in_flight)
            .await
            .expect("the client task");
        assert_eq!(reply.status, StatusCode::OK);
        let exit = gateway.wait_exit(STEP).await;
        assert_eq!(exit.code(), Some(0), "{exit:?}");
    }
}
