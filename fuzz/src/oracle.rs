//! The invariants of the plugin's pure core, checked on one arbitrary body.
//!
//! Shared by the `stamp_core` fuzz target and by the plugin's
//! `tests/fuzz_regressions.rs` (which includes this file with `#[path]`), so
//! the regression inputs go through exactly the checks the fuzzer ran.
//!
//! The oracle is serde_json (with `arbitrary_precision`, so numbers compare
//! by their text): where ids must go is computed from serde_json's reading
//! of the body, independently of the walk in `body.rs`. Two documented
//! differences between snowgate and serde_json are handled explicitly:
//! - lone surrogate escapes (`"\ud800"`): snowgate accepts them, as Python
//!   does, and compares them as WTF-8; serde_json refuses them. Before the
//!   oracle parses a body, each lone surrogate escape is rewritten to an
//!   escape of its own private-use code point (U+F0000 + unit - 0xD800),
//!   which keeps string equality exactly as snowgate sees it. Bodies that
//!   already contain such code points are not given to the oracle.
//! - nesting: snowgate allows 128 levels, serde_json's default 127. The
//!   caller passes the parser: the fuzz crate's has serde_json's recursion
//!   limit disabled (safe: only bodies whose brackets nest at most 128 deep
//!   are parsed); with the default parser, a body nested exactly 128 deep
//!   gets every check but the comparison with serde_json.
//! - integers of more than 4300 digits: snowgate refuses them, as Python's
//!   `json.loads` does; serde_json reads them. A body serde_json reads with
//!   such an integer (not a float, not digits in a string) is one to refuse.
//!
//! One quirk of the oracle itself is avoided: with `arbitrary_precision`,
//! serde_json reads an object whose first key is
//! `"$serde_json::private::Number"` as a number (found by the fuzzer:
//! `{"$serde_json::private::Number":"x"}` is "an invalid number" to it).
//! Bodies that mention that token, even escaped, are not given to it.
//!
//! Every check panics with a message that says what broke.

use std::borrow::Cow;
use std::collections::HashSet;

use serde_json::Value;
use snowgate_plugin::stamp::apply;
use snowgate_plugin::{
    decide, find_edits, BodyError, Config, Decision, Edit, IdSource, MachineId, SnowflakeLayout,
    Tick, MAX_NESTING_DEPTH,
};

/// 2025-11-24, in milliseconds since the Unix epoch.
pub const START_MILLIS: u64 = 1_764_000_000_000;
/// The machine id [`CounterIds`] hands out.
pub const MACHINE: u32 = 7;

/// The nesting snowgate documents (README, `MAX_NESTING_DEPTH`): 128
/// levels of arrays and objects. Spelled out here so that a change of the
/// constant fails the oracle instead of moving it along.
pub const DOCUMENTED_DEPTH: usize = 128;

/// How the oracle reads a body as JSON.
pub type Parse = fn(&[u8]) -> Result<Value, serde_json::Error>;

/// The layout a body is stamped in: trtllm-v2 for a body of odd length,
/// trtllm-v1 (the default) otherwise, so that every campaign and every
/// regression input covers both layouts' ids and sequence spaces.
pub fn layout_for(body: &[u8]) -> SnowflakeLayout {
    if body.len() % 2 == 1 {
        SnowflakeLayout::TrtllmV2
    } else {
        SnowflakeLayout::TrtllmV1
    }
}

/// A deterministic id source with the real clock's semantics: ticks
/// strictly increase and the sequence rolls over to the next millisecond.
pub struct CounterIds {
    layout: SnowflakeLayout,
    millis: u64,
    sequence: u32,
    /// How often the machine id was asked for.
    pub machine_calls: usize,
    /// Every tick handed out, in order.
    pub ticks: Vec<Tick>,
}

impl CounterIds {
    /// A fresh source for `layout`.
    pub fn new(layout: SnowflakeLayout) -> CounterIds {
        CounterIds {
            layout,
            millis: START_MILLIS,
            sequence: 0,
            machine_calls: 0,
            ticks: Vec::new(),
        }
    }
}

impl IdSource for CounterIds {
    fn machine_id(&mut self) -> Result<MachineId, String> {
        self.machine_calls += 1;
        Ok(MachineId {
            value: MACHINE,
            layout: self.layout,
        })
    }

    fn next_tick(&mut self, sequence_space: u32) -> Tick {
        if self.sequence >= sequence_space {
            self.millis += 1;
            self.sequence = 0;
        }
        let tick = Tick {
            millis: self.millis,
            sequence: self.sequence,
        };
        self.sequence += 1;
        self.ticks.push(tick);
        tick
    }
}

/// What the oracle makes of a body.
enum Verdict {
    /// Valid JSON, read as this value.
    Valid(Value),
    /// Not JSON (or nested deeper than snowgate allows): must be refused.
    Invalid(String),
    /// The oracle cannot tell (see the module docs).
    Unknown,
}

/// Runs every check on `body`: `decide` never fails or panics; it agrees
/// with `find_edits`; it refuses exactly what is not JSON (with 400); what
/// it stamps is the input plus ids, byte for byte, at exactly the effective
/// context-only params serde_json finds, replacing a `null` id exactly
/// where serde_json reads one; and stamping is idempotent.
///
/// Returns a short summary of what happened, which names regression
/// inputs: `stamp2-null1-valid` (two ids, one replacing `null`, the body
/// valid JSON to the oracle), `reject-invalid_json-invalid`,
/// `forward-unknown` (the oracle does not judge it, see the module docs).
pub fn check_body(body: &[u8], parse: Parse) -> String {
    assert_eq!(
        MAX_NESTING_DEPTH, DOCUMENTED_DEPTH,
        "the nesting limit moved"
    );
    let layout = layout_for(body);
    let found = find_edits(body);
    let mut source = CounterIds::new(layout);
    let decision = decide(&Config { layout }, false, body, &mut source)
        .unwrap_or_else(|e| panic!("plugin failure: {e}"));
    let verdict = oracle(body, parse);
    let verdict_name = match &verdict {
        Verdict::Valid(_) => "valid",
        Verdict::Invalid(_) => "invalid",
        Verdict::Unknown => "unknown",
    };

    let what = match (&found, &decision) {
        (Err(e), Decision::Reject(r)) => {
            check_body_error(body, e);
            assert_eq!(r.status, 400, "rejection {r:?}");
            assert_eq!(r.code, e.code(), "rejection {r:?}");
            assert_eq!(r.message, e.to_string(), "rejection {r:?}");
            assert_eq!(source.machine_calls, 0, "a bad body needs no machine id");
            if let Verdict::Valid(_) = verdict {
                panic!("serde_json accepts the body, snowgate rejects it: {r:?}");
            }
            format!("reject-{}", r.code)
        }
        (Ok(edits), Decision::Forward) => {
            assert!(edits.is_empty(), "forwarded despite edits {edits:?}");
            assert_eq!(source.machine_calls, 0, "asked for a machine id needlessly");
            assert!(source.ticks.is_empty(), "took ticks needlessly");
            match &verdict {
                Verdict::Valid(value) => {
                    let paths = paths_needing_ids(value);
                    assert!(
                        paths.is_empty(),
                        "forwarded, but ids are needed at {paths:?}"
                    );
                }
                Verdict::Invalid(e) => panic!("serde_json rejects ({e}), snowgate forwards"),
                Verdict::Unknown => {}
            }
            "forward".to_string()
        }
        (Ok(edits), Decision::ForwardWithBody { body: output, ids }) => {
            assert!(!edits.is_empty(), "stamped without edits");
            if let Verdict::Invalid(e) = &verdict {
                panic!("serde_json rejects ({e}), snowgate stamps");
            }
            check_ids(ids, edits.len(), &source, layout);
            assert_eq!(
                *output,
                apply(body, edits, ids),
                "decide's body is not apply(find_edits)"
            );
            assert_only_ids_spliced_in(body, output, edits, ids);
            // Every params object that needed an id has one now.
            assert_eq!(
                find_edits(output),
                Ok(vec![]),
                "stamping again would change the body: {}",
                String::from_utf8_lossy(output)
            );
            let nulls = edits
                .iter()
                .filter(|e| matches!(e, Edit::ReplaceNull { .. }))
                .count();
            if let Verdict::Valid(value) = &verdict {
                check_against_serde(value, output, ids, parse);
                assert_eq!(
                    nulls,
                    null_ids_needed(value),
                    "ids replacing null where serde_json reads none, or added beside one: {}",
                    String::from_utf8_lossy(output)
                );
            }
            format!("stamp{}-null{nulls}", edits.len())
        }
        (found, decision) => panic!("find_edits gave {found:?} but decide gave {decision:?}"),
    };
    format!("{what}-{verdict_name}")
}

/// How many of the params that need an id (see [`paths_needing_ids`])
/// hold a `null` one, which the id must replace: added beside it, the
/// object would hold the key twice, and a reader that keeps the first, or
/// refuses duplicates, would see no id.
fn null_ids_needed(value: &Value) -> usize {
    let mut value = value.clone();
    paths_needing_ids(&value)
        .iter()
        .filter(|path| at_path(&mut value, path).get("disagg_request_id") == Some(&Value::Null))
        .count()
}

/// What serde_json (with the documented differences handled) says of `body`.
fn oracle(body: &[u8], parse: Parse) -> Verdict {
    let depth = bracket_depth(body);
    if depth > DOCUMENTED_DEPTH {
        return Verdict::Invalid(format!("brackets nest {depth} deep"));
    }
    if mentions_serde_number_token(body) {
        return Verdict::Unknown;
    }
    let Some(mapped) = map_lone_surrogates(body) else {
        return Verdict::Unknown;
    };
    match parse(&mapped) {
        Ok(value) => match longest_integer(body) {
            digits if digits > MAX_INTEGER_DIGITS => Verdict::Invalid(format!(
                "an integer of {digits} digits, which Python refuses"
            )),
            _ => Verdict::Valid(value),
        },
        Err(e) if e.to_string().contains("recursion limit exceeded") => {
            // Only the default parser, only at exactly snowgate's limit.
            assert_eq!(depth, DOCUMENTED_DEPTH, "serde_json: {e}");
            Verdict::Unknown
        }
        Err(e) => {
            let message = e.to_string();
            assert!(
                !message.contains("surrogate") && !message.contains("end of hex escape"),
                "a lone surrogate escaped the oracle's mapping: {message}"
            );
            Verdict::Invalid(message)
        }
    }
}

/// Checks what a refusal says about the body.
fn check_body_error(body: &[u8], e: &BodyError) {
    let whitespace = |b: &u8| b" \t\r\n".contains(b);
    match *e {
        BodyError::Empty => assert!(body.iter().all(whitespace), "{e:?}"),
        BodyError::InvalidUtf8 { offset } => {
            let utf8 = std::str::from_utf8(body).expect_err("reported invalid UTF-8");
            assert_eq!(offset, utf8.valid_up_to());
        }
        BodyError::Syntax {
            offset,
            line,
            column,
            ..
        } => {
            assert!(offset <= body.len(), "{e:?}");
            let before = &body[..offset];
            let lines = before.iter().filter(|&&b| b == b'\n').count() + 1;
            assert_eq!(line, lines, "{e:?}");
            let line_start = before
                .iter()
                .rposition(|&b| b == b'\n')
                .map_or(0, |p| p + 1);
            assert_eq!(column, offset - line_start + 1, "{e:?}");
        }
        BodyError::TooDeep { offset } => {
            assert!(matches!(body.get(offset), Some(b'[' | b'{')), "{e:?}");
            assert!(bracket_depth(body) > DOCUMENTED_DEPTH, "{e:?}");
        }
    }
    if !matches!(e, BodyError::Empty) {
        assert!(!body.iter().all(whitespace), "{e:?} for a blank body");
    }
    if !matches!(e, BodyError::InvalidUtf8 { .. }) {
        assert!(std::str::from_utf8(body).is_ok(), "{e:?} for invalid UTF-8");
    }
}

/// The ids: one per edit, distinct, in body order, made from the source's
/// ticks and machine id.
pub fn check_ids(ids: &[u64], edits: usize, source: &CounterIds, layout: SnowflakeLayout) {
    assert_eq!(ids.len(), edits, "one id per edit");
    assert_eq!(source.machine_calls, 1, "machine id asked once");
    assert_eq!(source.ticks.len(), ids.len(), "one tick per id");
    assert!(
        ids.windows(2).all(|w| w[0] < w[1]),
        "ids not increasing: {ids:?}"
    );
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), ids.len());
    for (id, tick) in ids.iter().zip(&source.ticks) {
        let expected = layout
            .compose(tick.millis, MACHINE, tick.sequence)
            .expect("ticks are in range");
        assert_eq!(*id, expected, "id for {tick:?}");
    }
}

/// The output, read by serde_json, is the input's value with exactly the
/// ids added at the paths serde_json says need one.
fn check_against_serde(input: &Value, output: &[u8], ids: &[u64], parse: Parse) {
    let paths = paths_needing_ids(input);
    assert_eq!(paths.len(), ids.len(), "serde_json wants ids at {paths:?}");
    let mapped = map_lone_surrogates(output).expect("the output escapes as the input does");
    let out: Value = parse(&mapped).unwrap_or_else(|e| {
        panic!(
            "the output is not JSON ({e}): {}",
            String::from_utf8_lossy(output)
        )
    });
    let mut expected = input.clone();
    let mut out_copy = out.clone();
    let mut placed = Vec::new();
    for path in &paths {
        let got = at_path(&mut out_copy, path)
            .get("disagg_request_id")
            .and_then(Value::as_u64)
            .unwrap_or_else(|| panic!("no id at {path:?}"));
        placed.push(got);
        at_path(&mut expected, path)
            .as_object_mut()
            .expect("params are an object")
            .insert("disagg_request_id".to_string(), Value::from(got));
    }
    assert!(
        out == expected,
        "output {out} is not input plus ids {expected}"
    );
    placed.sort_unstable();
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    assert_eq!(placed, sorted, "ids placed are not the ids returned");
}

/// One step of a path into a JSON value.
#[derive(Debug, Clone)]
pub enum Step {
    /// An object member.
    Key(String),
    /// An array element.
    Index(usize),
}

/// Where ids must go by serde_json's reading (which, like Python, keeps the
/// last of duplicate keys): every effective `disaggregated_params` object
/// that is context-only and has no id or a null one.
pub fn paths_needing_ids(value: &Value) -> Vec<Vec<Step>> {
    fn walk(value: &Value, path: &mut Vec<Step>, found: &mut Vec<Vec<Step>>) {
        match value {
            Value::Object(map) => {
                for (k, v) in map {
                    path.push(Step::Key(k.clone()));
                    if k == "disaggregated_params" {
                        if let Value::Object(params) = v {
                            let context_only = matches!(
                                params.get("request_type"),
                                Some(Value::String(t)) if t.eq_ignore_ascii_case("context_only")
                            );
                            let no_id =
                                matches!(params.get("disagg_request_id"), None | Some(Value::Null));
                            if context_only && no_id {
                                found.push(path.clone());
                            }
                        }
                    }
                    walk(v, path, found);
                    path.pop();
                }
            }
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    path.push(Step::Index(i));
                    walk(item, path, found);
                    path.pop();
                }
            }
            _ => {}
        }
    }
    let mut found = Vec::new();
    walk(value, &mut Vec::new(), &mut found);
    found
}

/// The value at `path` (which must exist).
pub fn at_path<'v>(mut value: &'v mut Value, path: &[Step]) -> &'v mut Value {
    for step in path {
        value = match step {
            Step::Key(k) => value.get_mut(k.as_str()).expect("path exists"),
            Step::Index(i) => value.get_mut(*i).expect("path exists"),
        };
    }
    value
}

/// Walks the edits over input and output: the output must be the input with
/// exactly the id text spliced in at each edit, and nothing else changed.
pub fn assert_only_ids_spliced_in(input: &[u8], output: &[u8], edits: &[Edit], ids: &[u64]) {
    assert_eq!(edits.len(), ids.len());
    let (mut i, mut o) = (0, 0);
    for (edit, id) in edits.iter().zip(ids) {
        let at = edit.at();
        assert!(at >= i, "edits out of order or overlapping: {edits:?}");
        let same = &input[i..at];
        assert_eq!(
            output.get(o..o + same.len()),
            Some(same),
            "bytes before {edit:?}"
        );
        o += same.len();
        let digits = id.to_string();
        match *edit {
            Edit::InsertMember { comma, .. } => {
                assert!(comma, "a context-only object has members");
                let member = format!(",\"disagg_request_id\":{digits}");
                assert_eq!(output.get(o..o + member.len()), Some(member.as_bytes()));
                o += member.len();
                // Right after the last member's value: only whitespace
                // separates it from the closing brace.
                assert!(
                    !b" \t\r\n".contains(&input[at - 1]),
                    "insertion at {at} follows whitespace"
                );
                let next = input[at..]
                    .iter()
                    .find(|b| !b" \t\r\n".contains(b))
                    .copied();
                assert_eq!(
                    next,
                    Some(b'}'),
                    "insertion at {at} is not at an object's end"
                );
                i = at;
            }
            Edit::ReplaceNull { at } => {
                assert_eq!(input.get(at..at + 4), Some(&b"null"[..]));
                assert_eq!(output.get(o..o + digits.len()), Some(digits.as_bytes()));
                o += digits.len();
                i = at + 4;
            }
        }
    }
    assert_eq!(&output[o..], &input[i..], "bytes after the last edit");
}

/// How deep brackets outside strings nest. For valid JSON this is the
/// nesting depth; for any body it bounds how deep a parser recurses before
/// it finds an error.
pub fn bracket_depth(body: &[u8]) -> usize {
    let (mut depth, mut max) = (0usize, 0usize);
    for b in outside_strings(body) {
        match b {
            b'[' | b'{' => {
                depth += 1;
                max = max.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

/// The bytes of `body` outside its strings (the quotes left out too), as
/// a reader that knows only quotes and backslash escapes finds them.
fn outside_strings(body: &[u8]) -> impl Iterator<Item = u8> + '_ {
    let (mut in_string, mut escaped) = (false, false);
    body.iter().copied().filter(move |&b| {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            false
        } else if b == b'"' {
            in_string = true;
            false
        } else {
            true
        }
    })
}

/// `body` with every lone surrogate escape (one not part of a high-low
/// pair, paired as snowgate pairs them) rewritten as the surrogate-pair
/// escape of private-use code point U+F0000 + (unit - 0xD800). `None` when
/// the body may already hold such a code point (raw, or escaped with a high
/// surrogate of 0xDB80 or 0xDB81), which would make the mapping ambiguous.
pub fn map_lone_surrogates(body: &[u8]) -> Option<Cow<'_, [u8]>> {
    fn unit_at(body: &[u8], i: usize) -> Option<u32> {
        if body.get(i) != Some(&b'\\') || body.get(i + 1) != Some(&b'u') {
            return None;
        }
        let hex = body.get(i + 2..i + 6)?;
        let text = std::str::from_utf8(hex).ok()?;
        if !hex.iter().all(u8::is_ascii_hexdigit) {
            return None;
        }
        u32::from_str_radix(text, 16).ok()
    }
    if body.windows(2).any(|w| w == b"\xF3\xB0") {
        return None;
    }
    let mut out: Option<Vec<u8>> = None;
    let mut i = 0;
    while i < body.len() {
        if body[i] != b'\\' {
            if let Some(out) = &mut out {
                out.push(body[i]);
            }
            i += 1;
            continue;
        }
        let Some(unit) = unit_at(body, i) else {
            // Another escape, or a stray backslash: copy it and what it escapes.
            let end = (i + 2).min(body.len());
            if let Some(out) = &mut out {
                out.extend_from_slice(&body[i..end]);
            }
            i = end;
            continue;
        };
        if (0xDB80..=0xDB81).contains(&unit) {
            return None;
        }
        let paired = (0xD800..0xDC00).contains(&unit)
            && unit_at(body, i + 6).is_some_and(|low| (0xDC00..0xE000).contains(&low));
        if paired {
            if let Some(out) = &mut out {
                out.extend_from_slice(&body[i..i + 12]);
            }
            i += 12;
        } else if (0xD800..0xE000).contains(&unit) {
            let out = out.get_or_insert_with(|| body[..i].to_vec());
            let code = 0xF0000 + (unit - 0xD800);
            let high = 0xD800 + ((code - 0x10000) >> 10);
            let low = 0xDC00 + ((code - 0x10000) & 0x3FF);
            out.extend_from_slice(format!("\\u{high:04X}\\u{low:04X}").as_bytes());
            i += 6;
        } else {
            if let Some(out) = &mut out {
                out.extend_from_slice(&body[i..i + 6]);
            }
            i += 6;
        }
    }
    Some(match out {
        Some(out) => Cow::Owned(out),
        None => Cow::Borrowed(body),
    })
}

/// The most digits Python's `json.loads` reads in an integer
/// (`sys.int_info.default_max_str_digits`); a float's are not counted.
const MAX_INTEGER_DIGITS: usize = 4300;

/// The digits of the longest integer (no fraction, no exponent) in
/// `body`, valid JSON: read from the text, not from serde_json's value,
/// which keeps only the last of duplicate keys (Python reads every number
/// before it drops one).
fn longest_integer(body: &[u8]) -> usize {
    // A run of digits, and whether the number has turned out a float (its
    // fraction's and exponent's digits, and the run before, are not an
    // integer's). In valid JSON a number ends at a byte that is none of
    // these; the `e` of `true` and `false` is followed by such a byte.
    let (mut longest, mut run, mut float) = (0, 0, false);
    for b in outside_strings(body) {
        match b {
            b'0'..=b'9' if !float => run += 1,
            b'0'..=b'9' => {}
            b'.' | b'e' | b'E' => (run, float) = (0, true),
            b'+' | b'-' if float => {}
            _ => {
                longest = longest.max(run);
                (run, float) = (0, false);
            }
        }
    }
    longest.max(run)
}

/// Whether serde_json's private number token may appear in a string of
/// `body`: searched for in the body with every escape resolved (loosely:
/// escapes outside strings and surrogates are resolved too, which can only
/// find the token where there is none).
pub fn mentions_serde_number_token(body: &[u8]) -> bool {
    const TOKEN: &[u8] = b"serde_json::private::Number";
    if !body.contains(&b'\\') {
        return body.windows(TOKEN.len()).any(|w| w == TOKEN);
    }
    let mut text = Vec::with_capacity(body.len());
    let mut i = 0;
    while i < body.len() {
        match (body[i], body.get(i + 1)) {
            (b'\\', Some(b'u')) => {
                let code = body
                    .get(i + 2..i + 6)
                    .and_then(|hex| std::str::from_utf8(hex).ok())
                    .and_then(|hex| u32::from_str_radix(hex, 16).ok());
                match code.and_then(char::from_u32) {
                    Some(c) => {
                        text.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
                        i += 6;
                    }
                    None => {
                        text.push(b'?');
                        i += 2;
                    }
                }
            }
            (b'\\', Some(&escaped)) => {
                text.push(escaped);
                i += 2;
            }
            (byte, _) => {
                text.push(byte);
                i += 1;
            }
        }
    }
    text.windows(TOKEN.len()).any(|w| w == TOKEN)
}
