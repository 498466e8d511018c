//! The inputs the fuzz campaign found interesting, run through the very
//! checks of the `stamp_core` fuzz target, which live in
//! `fuzz/src/oracle.rs` and are included here as a module.
//!
//! The inputs: every crash the fuzzer found (`crash-*`), a minimized,
//! diverse slice of its corpus, named `<what decide does>-<what serde_json
//! says>-<corpus file name>` (e.g. `stamp3-null2-valid-lone-...`: three ids,
//! two of them replacing `null`; valid JSON once lone surrogates are mapped),
//! both in `tests/fuzz_regressions/`, and the fuzzers' hand-written seeds
//! (`fuzz/seeds/stamp_core/`). To add an input, drop the file in the
//! directory.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

#[path = "../../fuzz/src/oracle.rs"]
#[allow(dead_code)]
mod oracle;

/// serde_json as the plugin's dev-dependency has it (`arbitrary_precision`,
/// default recursion limit): bodies nested exactly 128 deep get every check
/// but the comparison with serde_json.
fn parse(body: &[u8]) -> Result<serde_json::Value, serde_json::Error> {
    serde_json::from_slice(body)
}

/// Every file of the regression directory and of the fuzzers' seeds.
fn inputs() -> Vec<(PathBuf, Vec<u8>)> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in [
        root.join("tests/fuzz_regressions"),
        root.join("../fuzz/seeds/stamp_core"),
    ] {
        let entries =
            std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
        files.extend(
            entries
                .map(|entry| entry.expect("a directory entry").path())
                .filter(|path| path.is_file()),
        );
    }
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let bytes =
                std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
            (path, bytes)
        })
        .collect()
}

#[test]
fn every_fuzz_regression_input_keeps_the_stamp_core_invariants() {
    let inputs = inputs();
    assert!(inputs.len() >= 60, "only {} inputs", inputs.len());
    let failures: Vec<String> = inputs
        .iter()
        .filter_map(|(path, body)| {
            catch_unwind(AssertUnwindSafe(|| oracle::check_body(body, parse)))
                .err()
                .map(|panic| {
                    let message = panic
                        .downcast_ref::<String>()
                        .map(String::as_str)
                        .or_else(|| panic.downcast_ref::<&str>().copied())
                        .unwrap_or("(no message)");
                    format!("{}: {message}", path.display())
                })
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} inputs break an invariant:\n{}",
        failures.len(),
        inputs.len(),
        failures.join("\n")
    );
}

#[test]
fn the_oracle_maps_lone_surrogates_and_only_those() {
    use std::borrow::Cow;
    assert!(matches!(
        oracle::map_lone_surrogates(br#"{"a":"\ud83d\ude00 \\ud800"}"#),
        Some(Cow::Borrowed(_))
    ));
    assert_eq!(
        oracle::map_lone_surrogates(br#"["\ud800\u0041","\uDFFF","\ud800\ud800\udc00"]"#)
            .as_deref(),
        Some(&br#"["\uDB80\uDC00\u0041","\uDB81\uDFFF","\uDB80\uDC00\ud800\udc00"]"#[..])
    );
    assert_eq!(oracle::map_lone_surrogates(br#""\udb80""#), None);
    assert_eq!(
        oracle::map_lone_surrogates("\"\u{F0001}\"".as_bytes()),
        None
    );
    assert_eq!(oracle::bracket_depth(br#"[{"a":"[[[\"{"}, [[]]]"#), 3);
    assert!(oracle::mentions_serde_number_token(
        br#"{"\u0024serde_json\u003a:private::N\u0075mber":"1"}"#
    ));
    assert!(!oracle::mentions_serde_number_token(
        br#"{"serde_json::private":1}"#
    ));
}

/// Found while writing the fuzz oracle, not by the fuzzer (its 64 KiB inputs
/// are too small to show it): the walk compared each key with every earlier
/// member that had edits, so an object with many such members and many
/// other members was quadratic. A 4 MiB body took 5 s natively and ran the
/// plugin past its 1 s deadline; now it takes milliseconds.
#[test]
fn many_members_with_edits_stay_linear() {
    let mut body = String::from("{");
    let mut params = 0;
    while body.len() < 1 << 20 {
        body.push_str(&format!(
            r#""k{params}":{{"disaggregated_params":{{"request_type":"context_only"}}}},"#
        ));
        params += 1;
    }
    while body.len() < 2 << 20 {
        body.push_str(r#""":0,"#);
    }
    body.push_str(r#""z":0}"#);
    // Speed is not asserted here (it is a benchmark's job); the body runs so
    // that a quadratic walk shows as a test taking ~40 s instead of ~0.2 s.
    let edits = snowgate_plugin::find_edits(body.as_bytes()).expect("valid JSON");
    assert_eq!(edits.len(), params);
}
