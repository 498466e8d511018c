//! The inputs the fuzz campaign found interesting (`tests/fuzz_regressions/`:
//! every crash it found, and a minimized, diverse slice of its corpus), run
//! through the very checks of the `stamp_core` fuzz target, which live in
//! `fuzz/src/oracle.rs` and are included here as a module.
//!
//! To add an input: drop the file into `tests/fuzz_regressions/`.

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

fn inputs() -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_regressions");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.is_file())
        .collect();
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
    assert!(!inputs.is_empty(), "no regression inputs found");
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
