//! The real `snowgate` binary, run as an operator runs it.

mod support;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// 2025-11-24T16:00:00Z in milliseconds since the Unix epoch.
const MILLIS: &str = "1764000000000";
/// The trtllm-v1 id of machine 7 at `MILLIS`, sequence 0:
/// `((1764000000000 << 22) | (7 << 12) | 0) % (2^63 - 1 - 2^42) + 2^42`.
const FIRST_ID_V1: u64 = 7_398_756_654_046_539_776;
/// The trtllm-v2 id of machine 16383 (node 255, process 63) at `MILLIS`,
/// sequence 0: the timestamp masked to 39 bits is 114732558336, and
/// `((114732558336 << 24) | (255 << 16) | (63 << 10) | 0) % (2^63 - 1 - 2^40) + 2^40`.
const FIRST_ID_V2: u64 = 1_924_894_012_964_076_544;

const CONTEXT_ONLY: &str =
    r#"{"prompt":"hi","disaggregated_params":{"request_type":"context_only"}}"#;

fn snowgate(args: &[&str], stdin: &[u8]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_snowgate"));
    command.args(args);
    run(command, stdin)
}

/// The longest one command of these tests may take; one that runs longer
/// (a `serve` that should have been refused and started instead) is
/// killed and fails its test, instead of hanging the suite.
const COMMAND_BOUND: std::time::Duration = std::time::Duration::from_secs(120);

/// Runs `command` with `stdin` on its standard input, for at most
/// [`COMMAND_BOUND`].
fn run(command: Command, stdin: &[u8]) -> Output {
    support::run_bounded(command, stdin, COMMAND_BOUND)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Asserts success and returns stdout.
fn success(output: &Output) -> String {
    assert!(
        output.status.success(),
        "exit {:?}, stderr: {}",
        output.status,
        text(&output.stderr)
    );
    text(&output.stdout)
}

/// Asserts failure with exit status `code`, nothing on stdout, and a
/// message on stderr that contains every one of `words`.
fn failure(output: &Output, code: i32, words: &[&str]) {
    assert_eq!(
        output.status.code(),
        Some(code),
        "stdout: {}, stderr: {}",
        text(&output.stdout),
        text(&output.stderr)
    );
    assert!(output.stdout.is_empty(), "stdout: {}", text(&output.stdout));
    let stderr = text(&output.stderr);
    for word in words {
        assert!(
            stderr.contains(word),
            "stderr does not mention {word:?}: {stderr}"
        );
    }
}

fn rewrite_v1(stdin: &str) -> Output {
    snowgate(
        &[
            "rewrite",
            "--machine-id",
            "7",
            "--clock",
            &format!("fixed:{MILLIS}"),
        ],
        stdin.as_bytes(),
    )
}

/// A file under this test target's scratch directory.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("snowgate-cli");
    std::fs::create_dir_all(&dir).expect("creating the scratch directory");
    dir.join(name)
}

#[test]
fn rewrite_stamps_a_context_only_body_byte_exactly() {
    let out = success(&rewrite_v1(&format!("{CONTEXT_ONLY}\n")));
    assert_eq!(
        out,
        format!(
            r#"{{"prompt":"hi","disaggregated_params":{{"request_type":"context_only","disagg_request_id":{FIRST_ID_V1}}}}}"#
        ) + "\n"
    );
}

#[test]
fn rewrite_gives_the_nth_request_sequence_n() {
    let item = r#"{"disaggregated_params":{"request_type":"context_only"}}"#;
    let body = format!("[{}]", [item; 5].join(", "));
    let out = success(&rewrite_v1(&body));
    // The sequence is the low 12 bits, so the n-th id is the first plus n.
    let stamped: Vec<String> = (0..5u64)
        .map(|n| {
            format!(
                r#"{{"disaggregated_params":{{"request_type":"context_only","disagg_request_id":{}}}}}"#,
                FIRST_ID_V1 + n
            )
        })
        .collect();
    assert_eq!(out, format!("[{}]", stamped.join(", ")));
}

#[test]
fn rewrite_makes_v2_ids_with_the_v2_layout() {
    let out = success(&snowgate(
        &[
            "rewrite",
            "--layout",
            "trtllm-v2",
            "--machine-id",
            "16383",
            "--clock",
            &format!("fixed:{MILLIS}"),
        ],
        format!("{CONTEXT_ONLY}\r\n").as_bytes(),
    ));
    assert_eq!(
        out,
        format!(
            r#"{{"prompt":"hi","disaggregated_params":{{"request_type":"context_only","disagg_request_id":{FIRST_ID_V2}}}}}"#
        ) + "\r\n"
    );
}

#[test]
fn rewrite_forwards_a_body_that_needs_no_id_unchanged() {
    let body = "{ \"prompt\" : \"hi\", \"n\": 1E400 }\n\n";
    assert_eq!(success(&rewrite_v1(body)), body);
}

/// The component the build leaves for operators at
/// `<target>/wasm32-wasip2/release/snowgate_plugin.wasm`; `<target>` is the
/// nearest ancestor of the binary that cargo marked with `CACHEDIR.TAG`.
fn operator_plugin_path() -> PathBuf {
    let exe = Path::new(env!("CARGO_BIN_EXE_snowgate"));
    let target = exe
        .ancestors()
        .find(|dir| dir.join("CACHEDIR.TAG").is_file())
        .unwrap_or_else(|| panic!("no target directory above {}", exe.display()));
    target
        .join("wasm32-wasip2")
        .join("release")
        .join(snowgate_plugin_bundle::PLUGIN_FILE_NAME)
}

#[test]
fn rewrite_runs_the_plugin_file_given_with_plugin() {
    let path = operator_plugin_path();
    assert!(
        path.is_file(),
        "the build should leave the plugin at {}",
        path.display()
    );
    let path = path.to_str().expect("a UTF-8 path");
    let out = success(&snowgate(
        &[
            "rewrite",
            "--plugin",
            path,
            "--machine-id",
            "7",
            "--clock",
            &format!("fixed:{MILLIS}"),
        ],
        CONTEXT_ONLY.as_bytes(),
    ));
    assert_eq!(
        out,
        format!(
            r#"{{"prompt":"hi","disaggregated_params":{{"request_type":"context_only","disagg_request_id":{FIRST_ID_V1}}}}}"#
        )
    );
}

/// A fixed clock at the last millisecond a u64 holds has 4096 ticks for
/// trtllm-v1: a batch of 5000 context-only requests is refused, where it
/// used to get 904 repeated ids.
#[test]
fn rewrite_refuses_a_batch_the_clock_has_no_ticks_left_for() {
    let one = r#"{"prompt":"x","disaggregated_params":{"request_type":"context_only"}}"#;
    let batch = format!("[{}]", vec![one; 5000].join(","));
    let args = [
        "rewrite",
        "--machine-id",
        "7",
        "--clock",
        "fixed:18446744073709551615",
    ];
    let output = snowgate(&args, batch.as_bytes());
    failure(&output, 2, &["id clock", "every millisecond", "repeat"]);
}

/// `--msgpack` reads the body as MessagePack and stamps it in MessagePack;
/// without it the same bytes are not JSON.
#[test]
fn rewrite_stamps_a_messagepack_body_with_msgpack() {
    // {"disaggregated_params": {"request_type": "context_only"}}
    let body = b"\x81\xb4disaggregated_params\x81\xacrequest_type\xaccontext_only";
    let args = [
        "rewrite",
        "--machine-id",
        "7",
        "--clock",
        &format!("fixed:{MILLIS}"),
        "--msgpack",
    ];
    let output = snowgate(&args, body);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let mut expected = body.to_vec();
    expected[22] = 0x82;
    expected.extend_from_slice(b"\xb1disagg_request_id\xcf");
    expected.extend_from_slice(&FIRST_ID_V1.to_be_bytes());
    assert_eq!(output.stdout, expected);

    let output = snowgate(&args[..5], body);
    failure(&output, 2, &["JSON must be UTF-8"]);
}

/// `--plugin-setting` reaches the plugin's configure export, as with
/// `serve`: the bundled plugin refuses one it does not know, by name.
#[test]
fn rewrite_hands_plugin_settings_to_the_plugin() {
    let args = [
        "rewrite",
        "--machine-id",
        "7",
        "--plugin-setting",
        "colour=blue",
    ];
    let output = snowgate(&args, CONTEXT_ONLY.as_bytes());
    failure(&output, 2, &["refused its configuration", "colour"]);
    let args = ["rewrite", "--machine-id", "7", "--plugin-setting", "colour"];
    let output = snowgate(&args, CONTEXT_ONLY.as_bytes());
    failure(&output, 2, &["\"colour\" is not NAME=VALUE"]);
}

/// `snowgate rewrite` of [`CONTEXT_ONLY`] through the hostile fixture
/// (written to a file of this test's own, `name`) with the plugin setting
/// `setting`, and `SNOWGATE_LOG` set to `log` if given.
fn rewrite_through_hostile(name: &str, setting: &str, log: Option<&str>) -> Output {
    let path = scratch(name);
    std::fs::write(&path, snowgate_test_fixtures::HOSTILE_WASM).expect("writing the fixture");
    let mut command = Command::new(env!("CARGO_BIN_EXE_snowgate"));
    command.args([
        "rewrite",
        "--machine-id",
        "7",
        "--plugin",
        path.to_str().expect("a UTF-8 path"),
        "--plugin-setting",
        setting,
    ]);
    if let Some(log) = log {
        command.env("SNOWGATE_LOG", log);
    }
    run(command, CONTEXT_ONLY.as_bytes())
}

/// `snowgate check` runs the gateway's self-check on a build, on its
/// own: the bundled plugin passes (exit 0, naming it), in either layout; a
/// build that keeps an id from one call of an instance to the next, or
/// repeats one within a batch, is refused (exit 1, saying which call and
/// why), even one that takes no batches; one that takes no batches but
/// stamps one request at a time passes, with a warning. Flags and
/// settings that are refused are bad input (exit 2).
#[test]
fn check_passes_the_bundled_plugin_and_refuses_builds_that_repeat_ids() {
    let said = success(&snowgate(&["check"], b""));
    assert!(
        said.contains(snowgate_plugin::PLUGIN_NAME) && said.contains("passed the self-check"),
        "{said}"
    );
    let v2 = ["check", "--layout", "trtllm-v2", "--machine-id", "16383"];
    assert!(success(&snowgate(&v2, b"")).contains("passed the self-check"));

    let path = scratch("check-hostile.wasm");
    std::fs::write(&path, snowgate_test_fixtures::HOSTILE_WASM).expect("writing the fixture");
    let check = |setting: &str| {
        let plugin = path.to_str().expect("a UTF-8 path");
        snowgate(
            &["check", "--plugin", plugin, "--plugin-setting", setting],
            b"",
        )
    };
    failure(
        &check("hostile-ids=kept-tick"),
        1,
        &[
            "checking the plugin",
            support::SELF_CHECK_SECOND_CALL,
            "took no tick",
        ],
    );
    failure(
        &check("hostile-ids=one-tick-a-call"),
        1,
        &[support::SELF_CHECK_BATCH, "stamped the same id"],
    );
    // Builds a gateway takes, though their check did not see them stamp
    // (batches): said on stdout, not only in a warning a log level hides.
    for (setting, unchecked) in [
        (
            "hostile-reject-batches=400",
            "whether it stamps batches was not checked",
        ),
        (
            "hostile-reject-all=401",
            "whether it stamps was not checked",
        ),
    ] {
        let said = success(&check(setting));
        assert!(
            said.contains("would serve") && said.contains(unchecked),
            "{setting}: {said}"
        );
        assert!(!said.contains("passed the self-check"), "{setting}: {said}");
    }

    failure(&check("hostile-ids=nonsense"), 2, &["hostile-ids"]);
    // A path that is no plugin file is the operator's mistake, not the
    // build's.
    let missing = scratch("no-such-plugin.wasm");
    let missing = missing.to_str().expect("a UTF-8 path");
    failure(
        &snowgate(&["check", "--plugin", missing], b""),
        2,
        &[missing],
    );
    let directory = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .to_str()
        .expect("a UTF-8 path");
    failure(
        &snowgate(&["check", "--plugin", directory], b""),
        2,
        &["not a regular file"],
    );
    failure(
        &snowgate(&["check", "--machine-id", "1023"], b""),
        2,
        &["--machine-id"],
    );
}

/// `check --config` loads the build a gateway's config file names, as that
/// gateway would: the file's plugin (its relative path taken from the
/// file's directory), settings, layout and machine id, with the flags over
/// them; without touching the file's etcd or high-water file, which a
/// running gateway holds. It warns of what in the file `serve` would not
/// start with.
#[test]
fn check_loads_the_build_a_config_file_names_with_its_settings() {
    let dir = support::TempDir::new("check-config");
    std::fs::write(
        dir.path().join("hostile.wasm"),
        snowgate_test_fixtures::HOSTILE_WASM,
    )
    .expect("writing the fixture");
    let config = |text: &str| {
        let path = dir.path().join("snowgate.toml");
        std::fs::write(&path, text).expect("writing the config file");
        path
    };
    let check = |config: &Path, flags: &[&str]| {
        let mut args = vec!["check", "--config", config.to_str().expect("a UTF-8 path")];
        args.extend_from_slice(flags);
        snowgate(&args, b"")
    };

    let hostile = config(
        "plugin = \"hostile.wasm\"\nmachine-id = 1000\n[plugin-settings]\nhostile-ids = \"kept-tick\"\n",
    );
    failure(
        &check(&hostile, &[]),
        1,
        &[
            "checking the plugin",
            "hostile.wasm",
            support::SELF_CHECK_SECOND_CALL,
        ],
    );
    // A flag's setting is added to the file's: this build now rejects the
    // canned request for want of credentials, so its ids go unseen.
    let said = success(&check(
        &hostile,
        &["--plugin-setting", "hostile-reject-all=401"],
    ));
    assert!(said.contains("would serve"), "{said}");

    // The bundled plugin, where the file names none, in the file's layout,
    // which the file's machine id fits; a flag replaces the layout.
    let v2 = config("layout = \"trtllm-v2\"\nmachine-id = 16383\n");
    assert!(success(&check(&v2, &[])).contains("passed the self-check"));
    failure(
        &check(&v2, &["--layout", "trtllm-v1"]),
        2,
        &["--machine-id", "16383", "snowgate.toml"],
    );

    // A leased machine id and a high-water file are a serving gateway's,
    // not the check's.
    let mark = dir.path().join("mark");
    let leased = config("layout = \"trtllm-v2\"\netcd = \"http://127.0.0.1:1\"\n");
    let said = success(&check(&leased, &[]));
    assert!(
        said.contains(snowgate_plugin::PLUGIN_NAME) && said.contains("passed the self-check"),
        "{said}"
    );
    let marked = config(&format!(
        "machine-id = 3\nhigh-water-file = {:?}\n",
        mark.to_str().expect("a UTF-8 path")
    ));
    assert!(success(&check(&marked, &[])).contains("passed the self-check"));
    assert!(!mark.exists(), "the check opened the high-water file");

    for (text, says) in [
        (
            "plugin-settings = { id-layout = \"trtllm-v2\" }\n",
            "id-layout",
        ),
        ("no-such-key = 1\n", "no-such-key"),
        ("plugin-memory-mib = 0\n", "plugin-memory-mib"),
    ] {
        failure(&check(&config(text), &[]), 2, &[says, "snowgate.toml"]);
    }
    // Not the build's settings, but ones `serve` would not start with on
    // the file alone: said, as `serve`'s flags may supply what it lacks.
    let serve_refuses = |output: &Output, says: &str| {
        assert!(success(output).contains("passed the self-check"));
        let stderr = text(&output.stderr);
        assert!(
            stderr.contains("serve would not start with the config file")
                && stderr.contains("snowgate.toml")
                && stderr.contains(says),
            "{stderr}"
        );
    };
    for (text, says) in [
        ("upstream = \"ftp://upstream.example\"\n", "scheme ftp"),
        ("admin-listen = \"0.0.0.0:9901\"\n", "needs a bearer token"),
        (
            "listen = \"127.0.0.1:9901\"\nadmin-listen = \"127.0.0.1:9901\"\n",
            "would take the same port",
        ),
        (
            "max-upstream-requests = 8\n",
            "--upstream URL, which is not set",
        ),
    ] {
        serve_refuses(&check(&config(text), &[]), says);
    }
    // With the admin token `serve` would take from its environment, it
    // would start.
    let exposed = config("admin-listen = \"0.0.0.0:9901\"\n");
    let with_token = |token: &std::ffi::OsStr| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_snowgate"));
        command
            .args(["check", "--config", exposed.to_str().expect("a UTF-8 path")])
            .env("SNOWGATE_ADMIN_TOKEN", token);
        run(command, b"")
    };
    let output = with_token("a-token".as_ref());
    assert!(success(&output).contains("passed the self-check"));
    assert!(
        !text(&output.stderr).contains("serve would not start"),
        "{}",
        text(&output.stderr)
    );
    serve_refuses(&with_token("".as_ref()), "admin token");
}

/// What a plugin logs while it is configured carries its name, as its
/// lines in a request's call do: the load learns the name from the same
/// instance, first.
#[test]
fn a_plugins_configure_log_lines_carry_its_name() {
    let output = rewrite_through_hostile("hostile-log.wasm", "hostile-configure=log", None);
    success(&output);
    let stderr = text(&output.stderr);
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|line| line.contains("the hostile fixture is being configured"))
        .collect();
    assert!(!lines.is_empty(), "no configure line: {stderr}");
    for line in lines {
        assert!(
            line.contains("plugin=\"snowgate-hostile-fixture\""),
            "{line}"
        );
    }

    // So does the warning about a plugin that traps in configure at load.
    let output = rewrite_through_hostile("hostile-panic.wasm", "hostile-configure=panic", None);
    let stderr = text(&output.stderr);
    let trapped = stderr
        .lines()
        .find(|line| line.contains("the plugin trapped"))
        .unwrap_or_else(|| panic!("no trap warning: {stderr}"));
    assert!(
        trapped.contains("plugin=snowgate-hostile-fixture"),
        "{trapped}"
    );
}

/// A plugin that refuses its settings without a reason is said to have
/// given none: the message ended in a colon.
#[test]
fn a_refusal_without_a_reason_says_none_was_given() {
    let output = rewrite_through_hostile(
        "hostile-refuse-silently.wasm",
        "hostile-configure=refuse-silently",
        None,
    );
    failure(
        &output,
        2,
        &["the plugin refused its configuration: (no reason given)"],
    );
}

/// Lines below the log's level count for no limit: after an info line
/// that `SNOWGATE_LOG=warn` leaves out, all 64 warn lines of a call are
/// written (each of `rewrite`'s two instances runs `configure`).
#[test]
fn lines_below_the_log_level_do_not_count_against_a_calls_64() {
    let output = rewrite_through_hostile(
        "hostile-levels.wasm",
        "hostile-configure=log-levels",
        Some("warn"),
    );
    success(&output);
    let stderr = text(&output.stderr);
    assert_eq!(
        stderr.matches("configure warn line").count(),
        128,
        "{stderr}"
    );
    assert!(!stderr.contains("more than 64 log lines"), "{stderr}");
}

/// A plugin's rejection reaches the terminal with its control characters
/// escaped, as in the gateway's log: a plugin cannot move the cursor or
/// forge a line of `rewrite`'s output.
#[test]
fn rewrite_prints_a_rejection_with_control_characters_escaped() {
    let output = rewrite_through_hostile(
        "hostile-reject.wasm",
        "hostile-require-header=x\u{1b}[31m\nforged",
        None,
    );
    failure(
        &output,
        2,
        &["the header x\\u{1b}[31m\\nforged is required (missing_header, HTTP 401)"],
    );
    let stderr = text(&output.stderr);
    assert!(!stderr.contains('\u{1b}'), "a raw escape: {stderr:?}");
}

/// `rewrite --header` and `--path` make the request the plugin sees, and
/// the changes a plugin makes to the forwarded request's headers are told
/// on stderr, while stdout carries only the body.
#[test]
fn rewrite_hands_the_plugin_headers_and_a_path_and_shows_its_header_changes() {
    let path = scratch("hostile-request.wasm");
    std::fs::write(&path, snowgate_test_fixtures::HOSTILE_WASM).expect("writing the fixture");
    let rewrite = |extra: &[&str]| {
        let mut args = vec![
            "rewrite",
            "--machine-id",
            "7",
            "--clock",
            "fixed:1764000000000",
            "--plugin",
            path.to_str().expect("a UTF-8 path"),
        ];
        args.extend_from_slice(extra);
        snowgate(&args, CONTEXT_ONLY.as_bytes())
    };

    let output = rewrite(&[
        "--header",
        "X-Tenant:  a\t",
        "-H",
        "x-hostile: headers",
        "-H",
        "x-tenant: b",
        "-H",
        "x-hostile-get: x-tenant",
        "-H",
        "connection: x-hop",
        "-H",
        "x-hop: 1",
        "-H",
        "upgrade: h2c",
        "-H",
        "expect: 100-continue",
        "-H",
        "trailer: x-checksum",
        "-H",
        "x_forwarded_for: 192.0.2.1",
        "-H",
        "content-length: 5",
    ]);
    let report = success(&output);
    let length = CONTEXT_ONLY.len();
    assert!(
        report.contains(&format!(
            r#"entries=[("content-type", "application/json"), ("x-tenant", "a"), ("x-tenant", "b"), ("x-hostile", "headers"), ("x-hostile-get", "x-tenant"), ("content-length", "{length}")]"#
        )),
        "the default content type first, then the headers given, grouped by name as the \
         gateway hands them on, names lowercased, values trimmed, hop-by-hop headers, \
         `Expect`, `Trailer` and aliases of managed names gone, and the body's own length: \
         {report}"
    );
    assert!(report.contains(r#"get=["a", "b"]"#), "{report}");
    assert!(
        !text(&output.stderr).contains("would not run the plugin"),
        "{}",
        text(&output.stderr)
    );
    let output = rewrite(&["-H", "x-hostile: headers", "-H", "content-type: text/plain"]);
    let report = success(&output);
    assert!(
        report.contains(&format!(
            r#"entries=[("x-hostile", "headers"), ("content-type", "text/plain"), ("content-length", "{}")]"#,
            CONTEXT_ONLY.len()
        )),
        "a content type given replaces the default: {report}"
    );
    assert!(
        text(&output.stderr).contains("a gateway would not run the plugin on this request"),
        "a content type the gateway streams through is pointed out: {}",
        text(&output.stderr)
    );

    // A value in UTF-8 reaches the plugin, as the gateway passes one on
    // (http 1.6's text parser refused it, as a control character).
    let output = rewrite(&["-H", "x-hostile: headers", "-H", "x-user: café"]);
    let report = success(&output);
    assert!(report.contains(r#"("x-user", "café")"#), "{report}");

    let output = rewrite(&["-H", "x-hostile: request-line"]);
    assert_eq!(success(&output), "POST /");
    let output = rewrite(&[
        "-H",
        "x-hostile: request-line",
        "--path",
        "/v1/completions?stream=true",
    ]);
    assert_eq!(success(&output), "POST /v1/completions?stream=true");

    let output = rewrite(&[
        "-H",
        "x-hostile: edit-headers",
        "-H",
        "x-hostile-edits: set x-route prefill-1, append cookie c=3, remove x-tenant",
    ]);
    let stdout = success(&output);
    assert!(
        stdout.starts_with(r#"{"prompt":"hi","disaggregated_params":{"request_type":"context_only","disagg_request_id":"#),
        "only the stamped body on stdout: {stdout}"
    );
    assert!(
        text(&output.stderr).contains(
            "the plugin changes the forwarded request's headers:\n  set x-route: prefill-1\n  \
             append cookie: c=3\n  remove x-tenant\n"
        ),
        "{}",
        text(&output.stderr)
    );
    // What is not printable ASCII in a value shows escaped, whole.
    let output = rewrite(&[
        "-H",
        "x-hostile: edit-headers",
        "-H",
        "x-hostile-edits: set x-a a%09b%E2%80%AEc",
    ]);
    success(&output);
    assert!(
        text(&output.stderr).contains("  set x-a: a\\tb\\xe2\\x80\\xaec\n"),
        "{:?}",
        text(&output.stderr)
    );
    // A rejection drops the changes, as the gateway does.
    let output = rewrite(&[
        "-H",
        "x-hostile: edit-headers",
        "-H",
        "x-hostile-edits: set x-route prefill-1",
        "-H",
        "x-hostile-then: reject",
    ]);
    failure(&output, 2, &["HTTP 418"]);
    assert!(
        !text(&output.stderr).contains("x-route"),
        "{}",
        text(&output.stderr)
    );

    for (flag, value, words) in [
        ("-H", "x-tenant a", &["has no ':'"][..]),
        ("-H", "x tenant: a", &["\"x tenant\" is not a header name"]),
        (
            "-H",
            "x-tenant : a",
            &["\"x-tenant \" is not a header name"],
        ),
        (
            "-H",
            "x-tenant: a\u{7f}",
            &["the value of x-tenant holds a control character or DEL"],
        ),
        ("--path", "v1/completions", &["is not a path"]),
        ("--path", "/a b", &["is not a path"]),
        ("--path", "/a#top", &["is not a path", "'#'"]),
    ] {
        let output = rewrite(&[flag, value]);
        failure(&output, 2, words);
    }
}

/// A plugin path that is a device or a FIFO is refused as `serve`
/// refuses it, instead of reading /dev/zero until memory runs out.
#[test]
fn rewrite_refuses_a_plugin_path_that_is_not_a_regular_file() {
    let args = ["rewrite", "--machine-id", "7", "--plugin", "/dev/zero"];
    let output = snowgate(&args, CONTEXT_ONLY.as_bytes());
    failure(&output, 1, &["/dev/zero", "not a regular file"]);
}

/// A config file that is a device is refused with a message, instead of
/// being read until memory runs out; so is one over the size limit.
#[test]
fn serve_refuses_a_config_file_that_is_a_device_or_too_large() {
    let output = snowgate(&["serve", "--config", "/dev/zero"], b"");
    failure(
        &output,
        2,
        &["/dev/zero", "a character device, not a regular file"],
    );
    let big = std::env::temp_dir().join(format!("snowgate-cli-{}-big.toml", std::process::id()));
    std::fs::write(&big, vec![b'#'; (1 << 20) + 1]).expect("write the file");
    let output = snowgate(&["serve", "--config", big.to_str().unwrap()], b"");
    let _ = std::fs::remove_file(&big);
    failure(&output, 2, &["big.toml", "over the 1048576 byte limit"]);
}

/// A setting out of range in the config file is named with the file it
/// came from, and exits 2 as the flag would; `max-body-bytes = 0` (nginx's
/// "no limit") is refused rather than refusing every body.
#[test]
fn serve_names_the_config_file_a_bad_setting_came_from() {
    for (name, text, says) in [
        (
            "out-of-range.toml",
            "machine-id = 5000\n",
            [
                "in the flags or the config file",
                "machine id 5000 is out of range",
            ],
        ),
        (
            "bad-setting.toml",
            "max-body-bytes = 0\n",
            [
                "in the config file",
                "max-body-bytes must be at least 1, not 0",
            ],
        ),
        (
            "layout-setting.toml",
            "[plugin-settings]\nid-layout = \"trtllm-v2\"\n",
            [
                "in the flags or the config file",
                "the plugin setting id-layout is the host's own",
            ],
        ),
        // Before, the file's own directory: builds were written beside it.
        (
            "empty-cache-dir.toml",
            "plugin-cache-dir = \"\"\n",
            ["in the config file", "plugin-cache-dir is empty"],
        ),
        (
            "empty-plugin.toml",
            "plugin = \"\"\n",
            ["in the config file", "plugin is empty"],
        ),
        (
            "empty-high-water-file.toml",
            "high-water-file = \"\"\n",
            ["in the config file", "high-water-file is empty"],
        ),
    ] {
        let file = scratch(name);
        std::fs::write(&file, text).expect("write the file");
        let output = snowgate(&["serve", "--config", file.to_str().unwrap()], b"");
        failure(&output, 2, &[says[0], name, says[1]]);
    }
}

/// A log filter that does not parse stops the command with status 2 and
/// says so, instead of silently logging at the default level (which, for
/// `snowgate::access=debg`, meant no access log at all).
#[test]
fn a_log_filter_that_does_not_parse_is_refused() {
    let mut command = Command::new(env!("CARGO_BIN_EXE_snowgate"));
    command
        .args(["decode", "7398756654046539776"])
        .env("SNOWGATE_LOG", "info,snowgate::access=debg");
    let output = run(command, b"");
    failure(
        &output,
        2,
        &["SNOWGATE_LOG \"info,snowgate::access=debg\" is not a log filter"],
    );
    // Nor is one that is not UTF-8 (before, the default level, silently).
    let mut command = Command::new(env!("CARGO_BIN_EXE_snowgate"));
    command.args(["decode", "7398756654046539776"]).env(
        "SNOWGATE_LOG",
        <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(b"n\xffu"),
    );
    let output = run(command, b"");
    failure(&output, 2, &["SNOWGATE_LOG", "is not UTF-8"]);
    // A misspelled level parses, as a target: said, not refused.
    let mut command = Command::new(env!("CARGO_BIN_EXE_snowgate"));
    command
        .args(["decode", "7398756654046539776"])
        .env("SNOWGATE_LOG", "inof");
    let output = run(command, b"");
    success(&output);
    assert!(
        text(&output.stderr).contains("SNOWGATE_LOG \"inof\" is not a level"),
        "{}",
        text(&output.stderr)
    );
    // A filter of targets alone turns off every other line, errors
    // included: said, with the filter to write instead.
    let decode = |filter: &str| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_snowgate"));
        command
            .args(["decode", "7398756654046539776"])
            .env("SNOWGATE_LOG", filter);
        let output = run(command, b"");
        success(&output);
        text(&output.stderr)
    };
    let stderr = decode("snowgate::access=debug");
    assert!(
        stderr.contains("sets no level for the targets it does not name")
            && stderr.contains("\"info,snowgate::access=debug\""),
        "{stderr}"
    );
    assert_eq!(decode("info,snowgate::access=debug"), "");
    assert_eq!(decode("snowgate::access=debug,warn"), "");
}

/// An admin token that is not UTF-8, from the environment or the flag, is
/// refused with a message that names where it came from and does not show
/// it. clap's own message named neither.
#[cfg(unix)]
#[test]
fn an_admin_token_that_is_not_utf8_is_named_not_shown() {
    use std::os::unix::ffi::OsStrExt;
    let token = std::ffi::OsStr::from_bytes(b"s3cret\xff");
    let refused = |command: Command| {
        let output = run(command, b"");
        let stderr = text(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("the admin token (--admin-token or SNOWGATE_ADMIN_TOKEN) is not UTF-8"),
            "{stderr}"
        );
        assert!(!stderr.contains("s3cret"), "{stderr}");
    };
    let serve = || {
        let mut command = Command::new(env!("CARGO_BIN_EXE_snowgate"));
        command.args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ]);
        command
    };
    let mut from_env = serve();
    from_env.env("SNOWGATE_ADMIN_TOKEN", token);
    refused(from_env);
    let mut from_flag = serve();
    from_flag
        .arg("--admin-token")
        .arg(token)
        .env_remove("SNOWGATE_ADMIN_TOKEN");
    refused(from_flag);
}

/// Output that cannot be written is an error that says so, not a panic.
#[test]
fn output_that_cannot_be_written_is_an_error_not_a_panic() {
    let full = || {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("/dev/full")
    };
    let decode = Command::new(env!("CARGO_BIN_EXE_snowgate"))
        .args(["decode", "7398756654046539776"])
        .stdout(full())
        .output()
        .expect("running decode");
    assert_eq!(decode.status.code(), Some(1), "{}", text(&decode.stderr));
    assert!(text(&decode.stderr).contains("writing the output to stdout"));
    assert!(!text(&decode.stderr).contains("panicked"));
}

/// A stdout open only for reading (`1<file`): writes to it fail with
/// `EBADF`, which Rust's own stdout takes for success. `rewrite` lost the
/// body it had stamped and exited 0; now it exits 1 and says why. (A
/// closed stdout, `>&-`, is not this case: Rust's start-up opens
/// `/dev/null` on it, as on any closed standard descriptor, and output
/// goes there as with `>/dev/null`.)
#[cfg(unix)]
#[test]
fn a_stdout_not_open_for_writing_is_an_error_not_output_lost() {
    use std::os::unix::process::CommandExt;
    let said = |output: &Output| {
        assert_eq!(output.status.code(), Some(1), "{}", text(&output.stderr));
        assert!(
            text(&output.stderr).contains("stdout is not open for writing"),
            "{}",
            text(&output.stderr)
        );
    };
    // `run` pipes stdout; `then` changes descriptor 1 after that, in the
    // child.
    let snowgate = |args: &[&str], then: fn() -> libc::c_int| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_snowgate"));
        command.args(args);
        // SAFETY: between fork and exec the closure only calls open and
        // dup2, which are async-signal-safe.
        unsafe {
            command.pre_exec(move || match then() {
                -1 => Err(std::io::Error::last_os_error()),
                _ => Ok(()),
            });
        }
        command
    };
    // SAFETY: open gets a NUL-terminated path; dup2 only replaces
    // descriptor 1, which nothing in the child holds a Rust handle to yet.
    let read_only = || unsafe {
        let fd = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY);
        libc::dup2(fd, 1)
    };
    let rewrite = ["rewrite", "--machine-id", "7"];
    said(&run(snowgate(&rewrite, read_only), CONTEXT_ONLY.as_bytes()));
    said(&run(
        snowgate(&["decode", "7398756654046539776"], read_only),
        b"",
    ));
}

/// A pipe whose reader is gone: each write to it fails with `EPIPE`.
fn broken_pipe() -> std::process::Stdio {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    writer.into()
}

/// A stderr that cannot be written (its reader, a log collector, gone)
/// loses the lines written to it, not the process: `rewrite` still writes
/// its stamped body and exits with its own status, and `serve` starts,
/// answers a request whose failure it logs, and stops cleanly. Before,
/// each line panicked (`eprintln!`), exit status 101: `serve` dropped
/// the request and skipped its drain.
#[test]
fn a_stderr_that_cannot_be_written_loses_lines_not_the_process() {
    use std::io::{BufRead, BufReader, Read, Write};
    let rewrite = |args: &[&str], stdin: &str| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_snowgate"));
        command.args(args);
        support::run_bounded_with_stderr(command, stdin.as_bytes(), COMMAND_BOUND, broken_pipe())
    };
    // A note on stderr (not a JSON content type), then the body.
    let stamped = rewrite(
        &[
            "rewrite",
            "--machine-id",
            "7",
            "-H",
            "content-type: text/plain",
        ],
        CONTEXT_ONLY,
    );
    assert_eq!(stamped.status.code(), Some(0));
    assert!(text(&stamped.stdout).contains("disagg_request_id"));
    let refused = rewrite(&["rewrite", "--machine-id", "7"], "{");
    assert_eq!(refused.status.code(), Some(2));

    // An upstream that refuses connections: the request's 502 is logged.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
    let upstream = format!("http://{}", closed.local_addr().expect("its address"));
    drop(closed);
    let mut gateway = support::Reaped(
        Command::new(env!("CARGO_BIN_EXE_snowgate"))
            .args(["serve", "--machine-id", "7", "--upstream", &upstream])
            .args(ANY_PORT)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(broken_pipe())
            .spawn()
            .expect("starting snowgate"),
    );
    let mut ready = String::new();
    BufReader::new(gateway.0.stdout.take().expect("piped"))
        .read_line(&mut ready)
        .expect("reading the ready line");
    let port = ready
        .strip_prefix("snowgate listening on http://")
        .and_then(|rest| rest.split_once(' '))
        .map(|(addr, _)| addr.to_string())
        .unwrap_or_else(|| panic!("no ready line: {ready:?}"));
    let mut client = std::net::TcpStream::connect(&port).expect("connecting");
    client
        .set_read_timeout(Some(COMMAND_BOUND))
        .expect("a read timeout");
    client
        .write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .expect("sending");
    let mut reply = String::new();
    client.read_to_string(&mut reply).expect("the reply");
    assert!(reply.starts_with("HTTP/1.1 502"), "{reply:?}");
    // SAFETY: kill only sends a signal to the child, not yet reaped.
    unsafe { libc::kill(gateway.0.id() as libc::pid_t, libc::SIGTERM) };
    let stopped = gateway.exit_within(COMMAND_BOUND);
    assert_eq!(stopped.code(), Some(0), "{stopped:?}");
}

/// `snowgate serve` on free ports with `flags`, for flags that must stop it
/// before it serves (it would otherwise run until killed).
fn serve_on_any_port(flags: &[&str]) -> Output {
    snowgate(&[&["serve"][..], &ANY_PORT, flags].concat(), b"")
}

/// `serve`'s listeners on ports the system picks.
const ANY_PORT: [&str; 4] = ["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"];

/// A listen address that is not an IP address and a port stops `serve`
/// with status 2 and what to write instead; a host name is not resolved.
#[test]
fn serve_refuses_a_listen_address_without_an_ip_saying_what_to_write() {
    let output = snowgate(&["serve", "--listen", "localhost:8080"], b"");
    failure(
        &output,
        2,
        &["--listen", "host names are not resolved", "127.0.0.1:8080"],
    );
    let output = snowgate(&["serve", "--admin-listen", ":9901"], b"");
    failure(&output, 2, &["--admin-listen", "0.0.0.0:9901"]);
}

/// An upstream or etcd URL the gateway cannot use is a bad setting (status
/// 2, as any other), named without the password it may carry.
#[test]
fn serve_refuses_unusable_upstream_and_etcd_urls_with_status_2_without_the_password() {
    for (flags, named) in [
        (&["--upstream", "localhost:8000"][..], "needs a scheme"),
        (
            &["--upstream", "http://user:hunter2@127.0.0.1:8000"][..],
            "credentials in the URL are not supported",
        ),
        (
            &["--etcd", "http://root:hunter2@127.0.0.1:2379"][..],
            "credentials in the URL are not supported",
        ),
        (
            &["--etcd", "http://root:hunter2/x@127.0.0.1:2379"][..],
            "credentials in the URL are not supported",
        ),
        (
            &["--upstream", "http://root:hunter2/x@127.0.0.1:8000"][..],
            "--upstream \"http://***@127.0.0.1:8000\"",
        ),
        (
            &["--etcd", "https://127.0.0.1:2379"][..],
            "https:// is not supported",
        ),
        // Taken by the URL parser, and before retried for ever (a port
        // over 65535 as port 80), or failing at every request.
        (&["--upstream", "http://:80"][..], "its host is empty"),
        (&["--etcd", "http://:2379"][..], "its host is empty"),
        (
            &["--upstream", "http://127.0.0.1:"][..],
            "its port is empty",
        ),
        (&["--etcd", "http://127.0.0.1:"][..], "its port is empty"),
        (
            &["--etcd", "http://127.0.0.1:99999"][..],
            "port 99999 is not 1..=65535",
        ),
        (
            &["--etcd", "http://127.0.0.1:0"][..],
            "port 0 is not 1..=65535",
        ),
        (
            &["--etcd", "http://127.0.0.1:2379/v3?x=1"][..],
            "a path or query (/v3?x=1) is not supported",
        ),
    ] {
        let output = serve_on_any_port(flags);
        failure(&output, 2, &[named]);
        assert!(
            !text(&output.stderr).contains("hunter2"),
            "the password shown: {}",
            text(&output.stderr)
        );
    }
}

/// `snowgate serve` on free ports with `flags`, its address space limited
/// to `bytes` (what `ulimit -v` sets), stdout and stderr piped.
#[cfg(unix)]
fn serve_in_address_space(bytes: u64, flags: &[&str]) -> Command {
    serve_under_rlimit(libc::RLIMIT_AS, bytes, bytes, flags)
}

/// `snowgate serve` on free ports with `flags`, under the resource limit
/// `resource` of `soft` (and `hard`), as `ulimit` sets it; no stdin,
/// stdout and stderr piped.
#[cfg(unix)]
fn serve_under_rlimit(
    resource: libc::__rlimit_resource_t,
    soft: u64,
    hard: u64,
    flags: &[&str],
) -> Command {
    let mut command = under_rlimit(resource, soft, hard);
    command
        .arg("serve")
        .args(ANY_PORT)
        .args(["--machine-id", "7"])
        .args(flags)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// A `snowgate` started with `SIGCHLD` ignored (the disposition passes
/// through `exec`, so a wrapper or a supervisor that ignores it passes it
/// on) still compiles its plugin in a child process: such a child used to
/// be reaped by the kernel before the gateway waited for it, and every
/// load failed with "No child processes", at start too.
#[cfg(unix)]
#[test]
fn a_snowgate_started_with_sigchld_ignored_still_compiles_its_plugin() {
    use std::os::unix::process::CommandExt;
    let mut command = Command::new(env!("CARGO_BIN_EXE_snowgate"));
    command.args(["check", "--machine-id", "7"]);
    // SAFETY: between fork and exec the closure only calls signal, which
    // is async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            if libc::signal(libc::SIGCHLD, libc::SIG_IGN) == libc::SIG_ERR {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    success(&run(command, b""));
}

/// `snowgate`, to be given its arguments, under the resource limit
/// `resource` of `soft` (and `hard`), as `ulimit` sets it.
#[cfg(unix)]
fn under_rlimit(resource: libc::__rlimit_resource_t, soft: u64, hard: u64) -> Command {
    use std::os::unix::process::CommandExt;
    let mut command = Command::new(env!("CARGO_BIN_EXE_snowgate"));
    let limit = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: between fork and exec the closure only calls setrlimit, which
    // is async-signal-safe, and touches no memory but its own copy of
    // `limit`.
    unsafe {
        command.pre_exec(move || {
            if libc::setrlimit(resource, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    command
}

/// `serve` raises its soft open file limit to the hard one (systemd's
/// default soft limit, 1024, is below what the default 4096 connections
/// need), and warns, naming the numbers, where the hard one is too low.
#[cfg(target_os = "linux")]
#[test]
fn serve_raises_its_open_file_limit_and_warns_when_it_is_too_low() {
    let open_files = |pid: u32| {
        let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
        let line = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .expect("a line for open files")
            .to_string();
        line.split_whitespace()
            .skip(3)
            .take(2)
            .map(|n| n.parse::<u64>().expect("a number"))
            .collect::<Vec<u64>>()
    };
    // The hard limit this test runs under (lowering it needs no privilege;
    // raising it would), if it is high enough to show the raise.
    let mut ours = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    assert_eq!(
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut ours) },
        0
    );
    let hard = ours.rlim_max.min(1 << 20);
    assert!(
        hard >= 1024,
        "the test needs a hard limit of 1024 or more, not {hard}"
    );
    let roomy = serve_under_rlimit(
        libc::RLIMIT_NOFILE,
        256,
        hard,
        &["--max-connections", "400"],
    )
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("starting snowgate");
    assert_eq!(
        while_serving(roomy, |pid, _| open_files(pid)).0,
        [hard, hard]
    );

    let tight = serve_under_rlimit(libc::RLIMIT_NOFILE, 256, 512, &["--workers", "2"])
        .spawn()
        .expect("starting snowgate");
    // It serves all the same, taking no more connections than it has
    // descriptors for: before, it took 4096, and past the limit its
    // accepts took the descriptors upstream connections gave back, and the
    // clients it served got 502s.
    let ((files, metrics), output) = while_serving(tight, |pid, ready| {
        // The connection gauges are registered once the workers run, a
        // moment after the ready line.
        let started = std::time::Instant::now();
        let metrics = loop {
            let metrics = admin_get(ready, "/metrics");
            if metrics.contains("snowgate_connections_max ") || started.elapsed() > COMMAND_BOUND {
                break metrics;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        (open_files(pid), metrics)
    });
    assert_eq!(files, [512, 512]);
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("the open file limit (512, hard limit 512) is below the 12424")
            && stderr.contains("serving at most 125 connections at once"),
        "{stderr}"
    );
    assert!(
        metrics
            .lines()
            .any(|line| line == "snowgate_connections_max 125"),
        "{metrics}"
    );
}

/// Where address space is limited (`ulimit -v`) below what the default 64
/// plugin instance slots reserve (about 4 GiB each), `serve` stops with a
/// message that names `--plugin-instances`; with fewer slots it starts.
#[cfg(unix)]
#[test]
fn serve_fits_a_limited_address_space_with_fewer_plugin_instances() {
    const LIMIT: u64 = 64 << 30;
    let output = run(serve_in_address_space(LIMIT, &[]), b"");
    failure(&output, 1, &["64 instance slots", "--plugin-instances"]);

    let child = serve_in_address_space(LIMIT, &["--plugin-instances", "4"])
        .spawn()
        .expect("starting snowgate");
    while_serving(child, |_, _| ());
}

/// `rewrite` and `check`, which run a build once or a few times, reserve
/// the address space of two instance slots, not a gateway's 64: they run
/// where it is limited to 16 GiB. Before, both needed about 258 GiB, and
/// neither had a flag to ask for less.
#[cfg(unix)]
#[test]
fn rewrite_and_check_fit_a_limited_address_space() {
    const LIMIT: u64 = 16 << 30;
    let mut rewrite = under_rlimit(libc::RLIMIT_AS, LIMIT, LIMIT);
    rewrite.args(["rewrite", "--machine-id", "7"]);
    let stamped = success(&run(rewrite, CONTEXT_ONLY.as_bytes()));
    assert!(stamped.contains("disagg_request_id"), "{stamped}");
    let mut check = under_rlimit(libc::RLIMIT_AS, LIMIT, LIMIT);
    check.arg("check");
    let passed = success(&run(check, b""));
    assert!(passed.contains("passed"), "{passed}");
}

/// The body of `GET path` from the admin listener a ready line names.
fn admin_get(ready: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let admin = ready
        .split_once("(admin http://")
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(addr, _)| addr)
        .unwrap_or_else(|| panic!("no admin address in {ready:?}"));
    let mut stream = std::net::TcpStream::connect(admin).expect("connecting to the admin listener");
    stream
        .set_read_timeout(Some(COMMAND_BOUND))
        .expect("a read timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n"
    )
    .expect("asking");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).expect("the answer");
    let (head, body) = answer.split_once("\r\n\r\n").expect("a head and a body");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

/// Waits (at most [`COMMAND_BOUND`]) for the ready line of `child` (a
/// `serve` with piped stdout and stderr), runs `look` on its pid and ready
/// line while it serves, then stops it; what `look` saw, and the gateway's output. Fails
/// the test, with the gateway's stderr, if it stopped before it was ready
/// or was not ready in time. The gateway is killed however the test ends.
fn while_serving<T>(
    mut child: std::process::Child,
    look: impl FnOnce(u32, &str) -> T,
) -> (T, Output) {
    use std::io::{BufRead, BufReader};
    /// Kills the gateway should the test fail while it serves.
    struct Serving(Option<std::process::Child>);
    impl Drop for Serving {
        fn drop(&mut self) {
            if let Some(child) = &mut self.0 {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
    let stdout = child.stdout.take().expect("piped stdout");
    let mut serving = Serving(Some(child));
    // Its ready line, or end of file if it stopped; read on a thread of its
    // own, so that a gateway that neither serves nor stops is not waited
    // for without end.
    let (line, read) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut ready = String::new();
        let _ = BufReader::new(stdout).read_line(&mut ready);
        let _ = line.send(ready);
    });
    let ready = read.recv_timeout(COMMAND_BOUND).ok();
    let serves = ready
        .as_deref()
        .is_some_and(|line| line.starts_with("snowgate listening on "));
    let mut child = serving.0.take().expect("the gateway");
    if !serves {
        let _ = child.kill();
        let output = child.wait_with_output().expect("waiting for snowgate");
        panic!(
            "no ready line within {COMMAND_BOUND:?} ({ready:?}); stderr: {}",
            text(&output.stderr)
        );
    }
    let pid = child.id();
    serving.0 = Some(child);
    let seen = look(pid, ready.as_deref().unwrap_or_default());
    let mut child = serving.0.take().expect("the gateway");
    let _ = child.kill();
    let output = child.wait_with_output().expect("waiting for snowgate");
    (seen, output)
}

/// A `--plugin-setting` name given twice is bad input for every command
/// that takes one; before, `serve` and `check` kept the last, and
/// `rewrite` handed the plugin both.
#[test]
fn a_plugin_setting_given_twice_is_refused() {
    let twice = [
        "--plugin-setting",
        "colour=red",
        "--plugin-setting",
        "colour=blue",
    ];
    for output in [
        snowgate(
            &[&["rewrite", "--machine-id", "7"][..], &twice].concat(),
            CONTEXT_ONLY.as_bytes(),
        ),
        snowgate(&[&["check"][..], &twice].concat(), b""),
        serve_on_any_port(&twice),
    ] {
        failure(
            &output,
            2,
            &["--plugin-setting colour is given twice: give it once"],
        );
        let stderr = text(&output.stderr);
        assert!(
            !stderr.contains("red") && !stderr.contains("blue"),
            "a setting's value, which may be a credential, is shown: {stderr}"
        );
    }
}

/// `--shutdown-grace-secs` past a day is refused, as every other timeout
/// is.
#[test]
fn a_shutdown_grace_past_a_day_is_refused() {
    let output = serve_on_any_port(&["--shutdown-grace-secs", "18446744073709551615"]);
    failure(
        &output,
        2,
        &["shutdown-grace-secs must be at most 86400 (a day)"],
    );
}

/// A plugin setting the plugin refuses stops `serve` before it listens,
/// with status 2 and the plugin's reason, as `rewrite` does.
#[test]
fn serve_refuses_a_setting_the_plugin_refuses_with_status_2() {
    let output = serve_on_any_port(&["--plugin-setting", "colour=blue"]);
    failure(&output, 2, &["refused its configuration", "colour"]);
}

#[test]
fn rewrite_refuses_bad_json_with_status_2_and_says_why() {
    failure(
        &rewrite_v1(r#"{"prompt":"hi","#),
        2,
        &["not valid JSON", "400"],
    );
    failure(&rewrite_v1(""), 2, &["empty"]);
}

/// An 8 MiB context-only body.
fn eight_mib_body() -> Vec<u8> {
    let tail = br#"","disaggregated_params":{"request_type":"context_only"}}"#;
    let mut body = br#"{"prompt":""#.to_vec();
    body.resize((8 << 20) - tail.len(), b'x');
    body.extend_from_slice(tail);
    body
}

/// A body too large for the bundled plugin's memory is bad input (status
/// 2, as for any refused body), and the message names the flag that
/// raises the limit; a plugin file's may be its own fault (status 1).
/// With more memory the same body is stamped.
#[test]
fn rewrite_refuses_a_body_too_large_for_the_plugins_memory_naming_the_flag() {
    let body = eight_mib_body();
    let millis = format!("fixed:{MILLIS}");
    let rewrite = [
        "rewrite",
        "--machine-id",
        "7",
        "--clock",
        &millis,
        // Time enough for a debug build on a busy machine.
        "--plugin-deadline-ms",
        "30000",
    ];
    let small = [&rewrite[..], &["--plugin-memory-mib", "16"]].concat();
    failure(
        &snowgate(&small, &body),
        2,
        &[
            "the 8388608 byte body is too large for the plugin's memory",
            "16 MiB memory limit",
            "raise --plugin-memory-mib (a body of this size needs about 19 MiB with few ids, up \
             to 36 MiB when dense with ids)",
        ],
    );
    let path = operator_plugin_path();
    let path = path.to_str().expect("a UTF-8 path");
    let from_file = [&small[..], &["--plugin", path]].concat();
    failure(
        &snowgate(&from_file, &body),
        1,
        &["running the plugin", "16 MiB memory limit"],
    );
    let enough = [&rewrite[..], &["--plugin-memory-mib", "64"]].concat();
    let out = snowgate(&enough, &body);
    let out = success(&out);
    assert_eq!(
        out.len(),
        body.len() + r#","disagg_request_id":"#.len() + 19
    );
    assert!(
        out.ends_with(&format!(r#""disagg_request_id":{FIRST_ID_V1}}}}}"#)),
        "{}",
        &out[out.len() - 100..]
    );
}

#[test]
fn rewrite_refuses_plugin_limits_out_of_range_by_name() {
    for (flag, value, says) in [
        ("--plugin-memory-mib", "0", "between 1 and 4096, not 0"),
        (
            "--plugin-memory-mib",
            "4097",
            "between 1 and 4096, not 4097",
        ),
        ("--plugin-deadline-ms", "0", "between 1 and 3600000"),
    ] {
        let output = snowgate(
            &["rewrite", "--machine-id", "7", flag, value],
            CONTEXT_ONLY.as_bytes(),
        );
        failure(&output, 2, &[&flag[2..], says]);
    }
}

#[test]
fn rewrite_refuses_an_out_of_range_machine_id_naming_the_range() {
    failure(
        &snowgate(
            &["rewrite", "--machine-id", "1023"],
            CONTEXT_ONLY.as_bytes(),
        ),
        2,
        &["--machine-id", "1023", "0..=1022"],
    );
    failure(
        &snowgate(
            &["rewrite", "--layout", "trtllm-v2", "--machine-id", "16384"],
            CONTEXT_ONLY.as_bytes(),
        ),
        2,
        &["--machine-id", "16384", "0..=16383"],
    );
}

/// `serve` refuses the same machine ids with the same status as
/// `rewrite`, before it loads anything; and settings that are wrong
/// together, as bad input too.
#[test]
fn serve_refuses_an_out_of_range_machine_id_and_clashing_settings_as_bad_input() {
    let serve = |extra: &[&str]| {
        let mut args = vec![
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ];
        args.extend_from_slice(extra);
        snowgate(&args, b"")
    };
    failure(
        &serve(&["--machine-id", "1023"]),
        2,
        &["--machine-id", "1023", "0..=1022"],
    );
    failure(
        &serve(&["--layout", "trtllm-v2", "--machine-id", "16384"]),
        2,
        &["--machine-id", "16384", "0..=16383"],
    );
    failure(
        &serve(&["--machine-id", "3", "--etcd", "http://127.0.0.1:1"]),
        2,
        &["not both"],
    );
}

#[test]
fn rewrite_refuses_a_missing_or_garbage_plugin_file_clearly() {
    let missing = scratch("no-such-plugin.wasm");
    let _ = std::fs::remove_file(&missing);
    let output = snowgate(
        &[
            "rewrite",
            "--machine-id",
            "7",
            "--plugin",
            missing.to_str().expect("a UTF-8 path"),
        ],
        CONTEXT_ONLY.as_bytes(),
    );
    assert!(!output.status.success());
    assert!(output.stdout.is_empty());
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("reading the plugin") && stderr.contains("no-such-plugin.wasm"),
        "{stderr}"
    );

    let garbage = scratch("garbage-plugin.wasm");
    std::fs::write(&garbage, b"not a component").expect("writing the garbage plugin");
    let output = snowgate(
        &[
            "rewrite",
            "--machine-id",
            "7",
            "--plugin",
            garbage.to_str().expect("a UTF-8 path"),
        ],
        CONTEXT_ONLY.as_bytes(),
    );
    assert!(!output.status.success());
    assert!(output.stdout.is_empty());
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("garbage-plugin.wasm")
            && stderr.contains("not a valid WebAssembly component"),
        "{stderr}"
    );
}

/// The `name: value` lines of `decode`'s output.
fn fields(out: &str) -> Vec<(String, String)> {
    out.lines()
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_string(), value.trim().to_string()))
        .collect()
}

fn field<'f>(fields: &'f [(String, String)], name: &str) -> &'f str {
    fields
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("no {name:?} line in {fields:?}"))
}

#[test]
fn decode_prints_the_fields_of_a_v1_id() {
    let out = success(&snowgate(&["decode", &(FIRST_ID_V1 + 3).to_string()], b""));
    let fields = fields(&out);
    assert!(
        field(&fields, "timestamp").starts_with(MILLIS),
        "{fields:?}"
    );
    assert!(
        field(&fields, "timestamp").contains("2025-11-24T16:00:00.000Z"),
        "{fields:?}"
    );
    assert_eq!(field(&fields, "machine id"), "7");
    assert_eq!(field(&fields, "sequence"), "3");
}

#[test]
fn decode_prints_node_and_process_of_a_v2_id() {
    let out = success(&snowgate(
        &[
            "decode",
            "--layout",
            "trtllm-v2",
            &(FIRST_ID_V2 + 9).to_string(),
        ],
        b"",
    ));
    let fields = fields(&out);
    assert!(
        field(&fields, "timestamp").starts_with("114732558336"),
        "the masked timestamp: {fields:?}"
    );
    let machine = field(&fields, "machine id");
    assert!(machine.starts_with("16383"), "{machine}");
    assert!(
        machine.contains("node 255") && machine.contains("process 63"),
        "{machine}"
    );
    assert_eq!(field(&fields, "sequence"), "9");
}

#[test]
fn decode_refuses_an_id_below_the_layouts_range() {
    failure(&snowgate(&["decode", "5"], b""), 2, &["below"]);
}

/// Each flag the README gives `rewrite` has a line of its own in its
/// help, matched whole (`--plugin` is not found in `--plugin-setting`).
#[test]
fn rewrite_help_mentions_every_flag() {
    let out = success(&snowgate(&["rewrite", "--help"], b""));
    // A flag line: `  -H, --header <NAME: VALUE>`, `      --msgpack`.
    let flags: Vec<&str> = out
        .lines()
        .filter_map(|line| {
            let line = line.trim_start();
            let line = line.strip_prefix("-H, ").unwrap_or(line);
            line.starts_with("--")
                .then(|| line.split([' ', '=']).next().unwrap_or(line))
        })
        .collect();
    for flag in [
        "--plugin",
        "--plugin-setting",
        "--plugin-cache-dir",
        "--plugin-memory-mib",
        "--plugin-deadline-ms",
        "--msgpack",
        "--header",
        "--path",
        "--high-water-file",
        "--layout",
        "--machine-id",
        "--clock",
    ] {
        assert!(
            flags.contains(&flag),
            "--help has no line for {flag}:\n{out}"
        );
    }
    assert!(out.contains("-H, --header"), "{out}");
    for word in ["trtllm-v1", "trtllm-v2", "fixed:"] {
        assert!(out.contains(word), "--help does not mention {word}:\n{out}");
    }
}

/// The layout is the host's to hand the plugin (`--layout`): a plugin
/// setting `id-layout`, which the plugin would read after the host's, is
/// refused as a bad flag before anything loads.
#[test]
fn the_id_layout_is_no_plugin_setting() {
    let says = ["the plugin setting id-layout is the host's own", "--layout"];
    let output = snowgate(
        &[
            "rewrite",
            "--machine-id",
            "1",
            "--plugin-setting",
            "id-layout=trtllm-v2",
        ],
        CONTEXT_ONLY.as_bytes(),
    );
    failure(&output, 2, &says);
    let output = serve_on_any_port(&[
        "--machine-id",
        "1",
        "--plugin-setting",
        "id-layout=trtllm-v1",
    ]);
    failure(&output, 2, &says);
}

/// `--msgpack` with an `x-trtllm-msgpack` header of its own is a
/// contradiction, not a header given twice.
#[test]
fn rewrite_refuses_msgpack_with_a_header_of_the_same_name() {
    let output = snowgate(
        &[
            "rewrite",
            "--machine-id",
            "1",
            "--msgpack",
            "-H",
            "X-TRTLLM-Msgpack: 0",
        ],
        CONTEXT_ONLY.as_bytes(),
    );
    failure(
        &output,
        2,
        &["--msgpack", "x-trtllm-msgpack", "give one of them"],
    );
}

/// A body larger than the plugin's memory is refused after reading one
/// byte past it: an endless input ends in exit status 2, not in memory
/// running out.
#[test]
fn rewrite_reads_no_more_than_the_plugins_memory_of_its_input() {
    let mut command = Command::new("sh");
    command.args([
        "-c",
        r#"exec "$0" rewrite --machine-id 1 --plugin-memory-mib 16 < /dev/zero"#,
        env!("CARGO_BIN_EXE_snowgate"),
    ]);
    let output = run(command, b"");
    failure(
        &output,
        2,
        &[
            "larger than the plugin's memory, 16777216 bytes",
            "raise --plugin-memory-mib",
        ],
    );
}

/// The admin listener on the requests' port is refused as a bad setting,
/// before the plugin compiles.
#[test]
fn serve_refuses_the_admin_listener_on_the_requests_port() {
    let output = snowgate(
        &[
            "serve",
            "--machine-id",
            "1",
            "--listen",
            "127.0.0.1:47123",
            "--admin-listen",
            "0.0.0.0:47123",
        ],
        b"",
    );
    failure(&output, 2, &["would take the same port"]);
}

#[test]
fn the_perfmap_variable_names_the_plugins_compiled_functions_for_perf() {
    let run = |perfmap: Option<&str>| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_snowgate"));
        command
            .args(["rewrite", "--machine-id", "7"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env_remove(snowgate_host::engine::PERFMAP_VARIABLE);
        if let Some(value) = perfmap {
            command.env(snowgate_host::engine::PERFMAP_VARIABLE, value);
        }
        let mut child = command.spawn().expect("starting snowgate");
        let map = PathBuf::from(format!("/tmp/perf-{}.map", child.id()));
        let mut input = child.stdin.take().expect("stdin is piped");
        input
            .write_all(CONTEXT_ONLY.as_bytes())
            .expect("writing stdin");
        drop(input);
        let output = child.wait_with_output().expect("waiting for snowgate");
        success(&output);
        let written = std::fs::read_to_string(&map).ok();
        let _ = std::fs::remove_file(&map);
        written
    };

    let map = run(Some("1")).expect("SNOWGATE_WASM_PERFMAP=1 writes /tmp/perf-PID.map");
    // One line per compiled function: start, size, name; the plugin's own
    // functions are among them by name.
    assert!(
        map.lines().all(|line| line.splitn(3, ' ').count() == 3),
        "{map}"
    );
    assert!(map.contains("snowgate_plugin"), "{map}");
    assert_eq!(run(None), None, "no map without the variable");
    assert_eq!(run(Some("0")), None, "no map with the variable set to 0");
}

/// A compile cache directory others may write to is refused at start,
/// naming the flag: its files are run as compiled code.
#[test]
fn serve_refuses_a_compile_cache_others_may_write_to() {
    use std::os::unix::fs::PermissionsExt as _;

    let dir = scratch("shared-cache");
    std::fs::create_dir_all(&dir).expect("created");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let output = serve_on_any_port(&["--plugin-cache-dir", dir.to_str().expect("UTF-8")]);
    failure(
        &output,
        1,
        &["--plugin-cache-dir", "others may write to it"],
    );
}

/// `rewrite --plugin-cache-dir` compiles the plugin once and reads it
/// from the cache on the next run, with the same result.
#[test]
fn rewrite_reads_the_plugin_from_the_compile_cache_on_its_second_run() {
    let dir = scratch("rewrite-cache");
    let _ = std::fs::remove_dir_all(&dir);
    let rewrite = || {
        let mut command = Command::new(env!("CARGO_BIN_EXE_snowgate"));
        command
            .args([
                "rewrite",
                "--machine-id",
                "7",
                "--clock",
                "fixed:1764000000000",
            ])
            .arg("--plugin-cache-dir")
            .arg(&dir)
            .env("SNOWGATE_LOG", "snowgate_host=debug");
        let output = run(command, CONTEXT_ONLY.as_bytes());
        (success(&output), text(&output.stderr))
    };
    let (first, log) = rewrite();
    assert!(
        log.contains("compiled and stored in the compile cache"),
        "{log}"
    );
    let (second, log) = rewrite();
    assert!(log.contains("read from the compile cache"), "{log}");
    assert_eq!(first, second, "a fixed clock: the same id both times");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The `THP_enabled` field of `/proc/PID/status` (Linux 5.0 and later):
/// `0` once the process turned transparent huge pages off.
#[cfg(target_os = "linux")]
fn thp_enabled(pid: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("THP_enabled:"))
        .map(|value| value.trim().to_string())
}

/// snowgate turns transparent huge pages off for itself, first thing in
/// `main` (they kept the gateway's idle RSS at 103 MiB instead of 44 MiB),
/// unless mimalloc's own `MIMALLOC_ALLOW_THP` says otherwise. Checked on
/// `serve`, the command that runs for long.
#[cfg(target_os = "linux")]
#[test]
fn serve_turns_huge_pages_off_unless_mimalloc_allow_thp_is_set() {
    let present = thp_enabled("self").as_deref() == Some("1");
    if !support::tool_present(
        present,
        "THP_enabled: 1 in /proc/self/status",
        "a kernel that shows it, with the tests not run under PR_SET_THP_DISABLE",
    ) {
        return;
    }
    let serve = |allow: Option<&str>| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_snowgate"));
        command
            .arg("serve")
            .args(ANY_PORT)
            .args(["--machine-id", "7"])
            .env_remove("MIMALLOC_ALLOW_THP")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(value) = allow {
            command.env("MIMALLOC_ALLOW_THP", value);
        }
        let child = command.spawn().expect("starting snowgate");
        while_serving(child, |pid, _| thp_enabled(&pid.to_string()))
            .0
            .expect("a running gateway has a THP_enabled field")
    };
    assert_eq!(serve(None), "0", "off by default");
    assert_eq!(serve(Some("1")), "1", "kept with MIMALLOC_ALLOW_THP=1");
    assert_eq!(
        serve(Some("0")),
        "0",
        "off with MIMALLOC_ALLOW_THP=0 (mimalloc's own doing)"
    );
}
