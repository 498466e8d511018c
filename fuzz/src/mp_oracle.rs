//! The invariants of the plugin's MessagePack path, checked on one
//! arbitrary body.
//!
//! Shared by the `stamp_msgpack` fuzz target, by the plugin's
//! `tests/fuzz_regressions.rs` and by `tests/stamping.rs` (both include
//! this file, and `oracle.rs` beside it, with `#[path]`), so the
//! regression inputs and the property tests go through exactly the checks
//! the fuzzer ran. It needs `oracle.rs` included as the sibling module
//! `oracle` (for its id source and id checks).
//!
//! The oracle is rmpv, an independent MessagePack reader, with the
//! documented semantics of snowgate's MessagePack walk (the README's
//! MessagePack row and `plugin/src/msgpack.rs`) written out on top of it:
//! - the body is exactly one MessagePack value, nothing after it;
//! - `0xc1` is refused wherever a value starts. rmpv reads it as nil, so a
//!   flat marker walk of its own ([`first_reserved_marker`]) finds it;
//! - every string is UTF-8; arrays and maps nest at most 128 levels
//!   (array keys count: a tuple key of a map at level 128 is refused);
//! - a map as a map key or inside one (a dict is not hashable), and an
//!   extension value other than a timestamp as or inside a key, are
//!   refused;
//! - a timestamp (extension type -1), anywhere, must be 4, 8 or 12 bytes,
//!   with fewer than a billion nanoseconds, and within Python's datetime
//!   (years 1 to 9999) once rounded half up to the microsecond;
//! - keys are compared as Python compares the dict keys msgspec decodes
//!   them to ([`mp_same_key`]): strings by their bytes and never equal to
//!   byte strings; integers, booleans and floats by their exact value
//!   (`1 == 1.0 == True`, `0 == -0.0 == False`, a float32 by its value as
//!   a double); nil equals nil; arrays are tuples, equal item by item; a
//!   NaN equals nothing, not even another NaN, and so neither does a tuple
//!   holding one; timestamps by their value to the microsecond;
//! - of equal keys in one map the last wins: only its value is looked
//!   into for params, and only the last `request_type` (a string or a
//!   byte string equal to `context_only` ignoring ASCII case) and
//!   `disagg_request_id` of a
//!   params map count ([`mp_needing_ids`]).
//!
//! For every body: `decide` never panics or fails; it agrees with
//! `find_msgpack_edits`; a refusal is a 400 `invalid_msgpack` naming a
//! byte inside the body; a new body is one whole MessagePack value rmpv
//! reads, and needs no further id. Where rmpv and the rules above read the
//! body as valid, a refusal fails; a body needing no id must be forwarded
//! unchanged (`Decision::Forward`); otherwise the new body, read by rmpv,
//! must be the input's value plus exactly one id at each place the oracle
//! expects (appended as the map's last pair, or replacing the nil of the
//! effective `disagg_request_id`), the ids distinct and as the id source
//! made them. Byte for byte, the new body must be the input with exactly
//! the documented splices (a map header counting one pair more, in its
//! own format while it fits; a `disagg_request_id`: uint 64 pair right
//! after the map's last pair; a nil replaced by a uint 64) at the places
//! `find_msgpack_edits` names, checked by a splicer of the oracle's own.
//! Where the rules say the body is invalid, it must be refused.
//!
//! Not given to the oracle (only the checks that hold for every body run):
//! - bodies over 8 KiB that hold an array (tuple) map key. The plugin
//!   takes an array key as equal to no other once its canonical form
//!   passes 64 KiB, or once the body's array keys have taken 1 MiB of
//!   canonical forms (a documented, deliberate difference from Python).
//!   The canonical form is private to the plugin; it takes at most a few
//!   bytes for each byte of the key (a one-byte integer is three, a float
//!   up to twenty for nine), so keys of a body of 8 KiB stay far from both
//!   caps. The fuzzer's inputs are 4 KiB at most.
//!
//! The order of `Decision::ids` is not checked beyond the ids increasing
//! as the ticks they are made from do: which id lands in which map is
//! read from the output and must be one of the ids returned, each once.
//!
//! Every check panics with a message that says what broke.

use std::collections::HashSet;

use rmpv::Value;
use snowgate_plugin::msgpack::{self, find_msgpack_edits, MsgpackEdit};
use snowgate_plugin::{decide, Config, Decision, MAX_NESTING_DEPTH};

use crate::oracle::{check_ids, layout_for, CounterIds, DOCUMENTED_DEPTH};

/// The largest body whose array keys the oracle judges (see the module
/// docs).
pub const MAX_JUDGED_WITH_ARRAY_KEYS: usize = 8 << 10;

/// The seconds of 0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z: the range
/// of Python's `datetime`.
const DATETIME_SECONDS: std::ops::RangeInclusive<i64> = -62_135_596_800..=253_402_300_799;

/// What the oracle makes of a MessagePack body.
#[derive(Debug)]
pub enum MpVerdict {
    /// One valid value, read by rmpv as this.
    Valid(Value),
    /// Not a valid body by the documented rules: must be refused.
    Invalid(String),
    /// The oracle does not judge it (see the module docs).
    Unknown(&'static str),
}

/// Runs every check on `body` as a MessagePack request body and returns a
/// short summary of what happened (e.g. `stamp2-nil1-valid`,
/// `reject-invalid`), which names regression inputs.
pub fn check_msgpack_body(body: &[u8]) -> String {
    assert_eq!(
        MAX_NESTING_DEPTH, DOCUMENTED_DEPTH,
        "the nesting limit moved"
    );
    let layout = layout_for(body);
    let found = find_msgpack_edits(body);
    let mut source = CounterIds::new(layout);
    let decision = decide(&Config { layout }, true, body, &mut source)
        .unwrap_or_else(|e| panic!("plugin failure: {e}"));
    let verdict = mp_verdict(body);
    let verdict_name = match &verdict {
        MpVerdict::Valid(_) => "valid",
        MpVerdict::Invalid(_) => "invalid",
        MpVerdict::Unknown(_) => "unknown",
    };

    let what = match (&found, &decision) {
        (Err(e), Decision::Reject(r)) => {
            assert_eq!(r.status, 400, "rejection {r:?}");
            assert_eq!(r.code, "invalid_msgpack", "rejection {r:?}");
            assert_eq!(r.code, e.code(), "rejection {r:?}");
            assert_eq!(r.message, e.to_string(), "rejection {r:?}");
            assert!(e.offset <= body.len(), "offset past the body: {e:?}");
            assert_eq!(source.machine_calls, 0, "a bad body needs no machine id");
            if let MpVerdict::Valid(value) = &verdict {
                panic!("the oracle reads the body as {value}, the plugin refuses it: {r:?}");
            }
            "reject".to_string()
        }
        (Ok(edits), Decision::Forward) => {
            assert!(edits.is_empty(), "forwarded despite edits {edits:?}");
            assert_eq!(source.machine_calls, 0, "asked for a machine id needlessly");
            assert!(source.ticks.is_empty(), "took ticks needlessly");
            match &verdict {
                MpVerdict::Valid(value) => {
                    let needs = mp_needing_ids(value);
                    assert!(
                        needs.is_empty(),
                        "forwarded unchanged, but ids are needed at {needs:?} of {value}"
                    );
                }
                MpVerdict::Invalid(why) => {
                    panic!("the oracle refuses ({why}), the plugin forwards")
                }
                MpVerdict::Unknown(_) => {}
            }
            "forward".to_string()
        }
        (Ok(edits), Decision::ForwardWithBody { body: output, ids }) => {
            assert!(!edits.is_empty(), "stamped without edits");
            if let MpVerdict::Invalid(why) = &verdict {
                panic!("the oracle refuses ({why}), the plugin stamps");
            }
            check_ids(ids, edits.len(), &source, layout);
            let out_value = read_whole(output).unwrap_or_else(|e| {
                panic!("the new body is not one whole MessagePack value: {e}: {output:02x?}")
            });
            assert_eq!(
                *output,
                msgpack::apply(body, edits, ids),
                "decide's body is not apply(find_msgpack_edits)"
            );
            assert_eq!(
                *output,
                splice(body, edits, ids),
                "the new body is not the input with exactly the documented splices"
            );
            assert_eq!(
                find_msgpack_edits(output),
                Ok(vec![]),
                "stamping again would change the body: {output:02x?}"
            );
            if let MpVerdict::Valid(value) = &verdict {
                check_against_rmpv(value, &out_value, ids);
            }
            let nils = edits
                .iter()
                .filter(|e| matches!(e, MsgpackEdit::ReplaceNil { .. }))
                .count();
            format!("stamp{}-nil{nils}", edits.len())
        }
        (found, decision) => {
            panic!("find_msgpack_edits gave {found:?} but decide gave {decision:?}")
        }
    };
    format!("{what}-{verdict_name}")
}

/// How deep rmpv may recurse: it counts two levels for each array or map
/// and up to three for the value at the bottom, so a body nested 128 deep
/// (the most that is valid) takes at most 259; a deeper one is invalid
/// either way. The bound keeps rmpv's recursion (large frames in debug
/// builds) well inside a test thread's stack.
pub const RMPV_MAX_DEPTH: usize = 2 * DOCUMENTED_DEPTH + 16;

/// Reads `bytes` as exactly one MessagePack value with rmpv.
pub fn read_whole(bytes: &[u8]) -> Result<Value, String> {
    let mut reader = bytes;
    let value = rmpv::decode::read_value_with_max_depth(&mut reader, RMPV_MAX_DEPTH)
        .map_err(|e| e.to_string())?;
    if !reader.is_empty() {
        return Err(format!("{} bytes after the value", reader.len()));
    }
    Ok(value)
}

/// What rmpv and the documented rules say of `body`.
pub fn mp_verdict(body: &[u8]) -> MpVerdict {
    if body.is_empty() {
        return MpVerdict::Invalid("the body is empty".into());
    }
    if let Some(at) = first_reserved_marker(body) {
        return MpVerdict::Invalid(format!("0xc1 at byte {at}"));
    }
    let value = match read_whole(body) {
        Ok(value) => value,
        Err(e) => return MpVerdict::Invalid(format!("rmpv: {e}")),
    };
    if let Err(why) = validate(&value, 0, false) {
        return MpVerdict::Invalid(why);
    }
    if body.len() > MAX_JUDGED_WITH_ARRAY_KEYS && has_array_key(&value) {
        return MpVerdict::Unknown("array keys in a body over 8 KiB");
    }
    MpVerdict::Valid(value)
}

/// The offset of the first value that starts with `0xc1` (which rmpv reads
/// as nil), found by a flat walk over the values' headers; `None` when there
/// is none before the body ends (or before it is cut short).
pub fn first_reserved_marker(body: &[u8]) -> Option<usize> {
    let mut pos = 0usize;
    // Values still to read: one, plus every item and key of the
    // containers begun.
    let mut pending: u128 = 1;
    let be = |bytes: &[u8]| bytes.iter().fold(0usize, |n, &b| (n << 8) | usize::from(b));
    while pending > 0 && pos < body.len() {
        pending -= 1;
        let marker = body[pos];
        // (header bytes after the marker, data bytes, items)
        let (header, data, items): (usize, usize, u128) = match marker {
            0xc1 => return Some(pos),
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => (0, 0, 0),
            0x80..=0x8f => (0, 0, 2 * u128::from(marker & 0x0f)),
            0x90..=0x9f => (0, 0, u128::from(marker & 0x0f)),
            0xa0..=0xbf => (0, usize::from(marker & 0x1f), 0),
            0xcc | 0xd0 => (0, 1, 0),
            0xcd | 0xd1 => (0, 2, 0),
            0xca | 0xce | 0xd2 => (0, 4, 0),
            0xcb | 0xcf | 0xd3 => (0, 8, 0),
            0xd4..=0xd8 => (0, 1 + (1 << (marker - 0xd4)), 0),
            0xc4 | 0xd9 | 0xc5 | 0xda | 0xc6 | 0xdb | 0xc7 | 0xc8 | 0xc9 => {
                let width = match marker {
                    0xc4 | 0xd9 | 0xc7 => 1,
                    0xc5 | 0xda | 0xc8 => 2,
                    _ => 4,
                };
                let len = be(body.get(pos + 1..pos + 1 + width)?);
                let ext = usize::from((0xc7..=0xc9).contains(&marker));
                (width, len + ext, 0)
            }
            0xdc..=0xdf => {
                let width = if marker == 0xdc || marker == 0xde {
                    2
                } else {
                    4
                };
                let count = be(body.get(pos + 1..pos + 1 + width)?) as u128;
                let items = if marker >= 0xde { 2 * count } else { count };
                (width, 0, items)
            }
        };
        pos = pos.checked_add(1 + header)?.checked_add(data)?;
        pending += items;
    }
    None
}

/// Checks the documented rules rmpv does not: nesting, UTF-8, what may be
/// a map key, timestamps. `depth` is the nesting of `value`'s container;
/// `in_key` says `value` is or is inside a map key.
fn validate(value: &Value, depth: usize, in_key: bool) -> Result<(), String> {
    match value {
        Value::String(s) if s.as_str().is_none() => Err("a string is not UTF-8".into()),
        Value::Array(items) => {
            if depth == DOCUMENTED_DEPTH {
                return Err("arrays and maps nest deeper than 128".into());
            }
            items
                .iter()
                .try_for_each(|item| validate(item, depth + 1, in_key))
        }
        Value::Map(pairs) => {
            if in_key {
                return Err("a map in a map key".into());
            }
            if depth == DOCUMENTED_DEPTH {
                return Err("arrays and maps nest deeper than 128".into());
            }
            pairs.iter().try_for_each(|(k, v)| {
                validate(k, depth + 1, true)?;
                validate(v, depth + 1, false)
            })
        }
        Value::Ext(-1, data) => timestamp(data).map(|_| ()),
        Value::Ext(kind, _) if in_key => {
            Err(format!("an extension value of type {kind} in a map key"))
        }
        _ => Ok(()),
    }
}

/// A timestamp's seconds and microseconds (rounded half up), or why
/// msgspec refuses it.
pub fn timestamp(data: &[u8]) -> Result<(i64, u32), String> {
    let be = |bytes: &[u8]| bytes.iter().fold(0u64, |n, &b| (n << 8) | u64::from(b));
    let (secs, nanos) = match data.len() {
        4 => (be(data) as i64, 0),
        8 => {
            let v = be(data);
            ((v & ((1 << 34) - 1)) as i64, v >> 34)
        }
        12 => (be(&data[4..]) as i64, be(&data[..4])),
        n => return Err(format!("a timestamp of {n} bytes")),
    };
    if nanos >= 1_000_000_000 {
        return Err("a timestamp with a billion nanoseconds or more".into());
    }
    // Checked before rounding too: msgspec refuses the last microsecond
    // before the year 1 (second -62,135,596,801, 999,999,500 ns), which
    // rounds up into it.
    if !DATETIME_SECONDS.contains(&secs) {
        return Err("a timestamp outside the years 1 to 9999".into());
    }
    let micros = (nanos + 500) / 1000;
    let (secs, micros) = if micros == 1_000_000 {
        (secs.checked_add(1).ok_or("a timestamp out of range")?, 0)
    } else {
        (secs, micros as u32)
    };
    // And after: what rounds past the year 9999 is refused.
    if !DATETIME_SECONDS.contains(&secs) {
        return Err("a timestamp outside the years 1 to 9999".into());
    }
    Ok((secs, micros))
}

/// Whether some map in `value` has an array key.
fn has_array_key(value: &Value) -> bool {
    match value {
        Value::Array(items) => items.iter().any(has_array_key),
        Value::Map(pairs) => pairs
            .iter()
            .any(|(k, v)| matches!(k, Value::Array(_)) || has_array_key(v)),
        _ => false,
    }
}

/// A number as Python compares it: an integer, or a float that is not one.
#[derive(PartialEq)]
enum Number {
    Int(i128),
    Float(f64),
}

fn number(v: &Value) -> Option<Number> {
    let float = |f: f64| {
        // Exact: an integral float below 2^127 converts without loss.
        if f.is_finite() && f.fract() == 0.0 && f.abs() < 2f64.powi(127) {
            Number::Int(f as i128)
        } else {
            Number::Float(f)
        }
    };
    match v {
        Value::Boolean(b) => Some(Number::Int(i128::from(*b))),
        Value::Integer(i) => i
            .as_i64()
            .map(i128::from)
            .or_else(|| i.as_u64().map(i128::from))
            .map(Number::Int),
        Value::F32(f) => Some(float(f64::from(*f))),
        Value::F64(f) => Some(float(*f)),
        _ => None,
    }
}

/// Two map keys Python takes for the same dict key (see the module docs).
/// Keys the plugin refuses (maps, extension values but timestamps) equal
/// nothing here.
pub fn mp_same_key(a: &Value, b: &Value) -> bool {
    if let (Some(x), Some(y)) = (number(a), number(b)) {
        // A NaN is unequal to everything, itself included, as `==` has it.
        return x == y;
    }
    match (a, b) {
        (Value::Nil, Value::Nil) => true,
        (Value::String(x), Value::String(y)) => x.as_bytes() == y.as_bytes(),
        (Value::Binary(x), Value::Binary(y)) => x == y,
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| mp_same_key(x, y))
        }
        (Value::Ext(-1, x), Value::Ext(-1, y)) => match (timestamp(x), timestamp(y)) {
            (Ok(x), Ok(y)) => x == y,
            _ => false,
        },
        _ => false,
    }
}

/// One step into a MessagePack value: an array's item, or a map's `n`th
/// pair's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MpStep {
    /// An array item.
    Item(usize),
    /// The value of a map's pair, by the pair's index.
    Pair(usize),
}

/// How a params map gets its id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MpNeed {
    /// A `disagg_request_id` pair appended after the map's last pair.
    Append,
    /// The nil value of the map's pair of this index replaced.
    ReplaceNil(usize),
}

/// Where ids go by the documented rules: every effective
/// `disaggregated_params` map whose last `request_type` is a string or a
/// byte string equal to `context_only` ignoring ASCII case, and whose last
/// `disagg_request_id` is missing or nil; in the order of the maps'
/// headers (a map before the maps inside it).
pub fn mp_needing_ids(value: &Value) -> Vec<(Vec<MpStep>, MpNeed)> {
    fn walk(
        value: &Value,
        params: bool,
        path: &mut Vec<MpStep>,
        found: &mut Vec<(Vec<MpStep>, MpNeed)>,
    ) {
        match value {
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    path.push(MpStep::Item(i));
                    walk(item, false, path, found);
                    path.pop();
                }
            }
            Value::Map(pairs) => {
                let last = |name: &str| pairs.iter().rposition(|(k, _)| k.as_str() == Some(name));
                if params {
                    // A byte string too, which pydantic's lax mode takes
                    // for a `str` field.
                    let context_only = last("request_type").is_some_and(|i| match &pairs[i].1 {
                        Value::String(t) => t
                            .as_str()
                            .is_some_and(|t| t.eq_ignore_ascii_case("context_only")),
                        Value::Binary(t) => t.eq_ignore_ascii_case(b"context_only"),
                        _ => false,
                    });
                    if context_only {
                        match last("disagg_request_id") {
                            None => found.push((path.clone(), MpNeed::Append)),
                            Some(i) if pairs[i].1.is_nil() => {
                                found.push((path.clone(), MpNeed::ReplaceNil(i)))
                            }
                            Some(_) => {}
                        }
                    }
                }
                for (i, (key, value)) in pairs.iter().enumerate() {
                    let effective = !pairs[i + 1..].iter().any(|(k, _)| mp_same_key(k, key));
                    if effective {
                        path.push(MpStep::Pair(i));
                        walk(
                            value,
                            key.as_str() == Some("disaggregated_params"),
                            path,
                            found,
                        );
                        path.pop();
                    }
                }
            }
            _ => {}
        }
    }
    let mut found = Vec::new();
    walk(value, false, &mut Vec::new(), &mut found);
    found
}

/// `value` with `ids` placed where [`mp_needing_ids`] says, in its order.
pub fn mp_expected(value: &Value, ids: &[u64]) -> Value {
    let needs = mp_needing_ids(value);
    assert_eq!(needs.len(), ids.len(), "the oracle wants ids at {needs:?}");
    let mut expected = value.clone();
    for ((path, need), id) in needs.iter().zip(ids) {
        place(&mut expected, path, *need, *id);
    }
    expected
}

fn at_path<'v>(mut value: &'v mut Value, path: &[MpStep]) -> &'v mut Value {
    for step in path {
        value = match (value, step) {
            (Value::Array(items), MpStep::Item(i)) => &mut items[*i],
            (Value::Map(pairs), MpStep::Pair(i)) => &mut pairs[*i].1,
            (value, step) => panic!("no {step:?} in {value}"),
        };
    }
    value
}

fn place(value: &mut Value, path: &[MpStep], need: MpNeed, id: u64) {
    let Value::Map(pairs) = at_path(value, path) else {
        panic!("params at {path:?} are not a map");
    };
    match need {
        MpNeed::Append => pairs.push(("disagg_request_id".into(), id.into())),
        MpNeed::ReplaceNil(i) => pairs[i].1 = id.into(),
    }
}

/// The id the output holds where `need` says one goes in the map at `path`.
fn placed_id(output: &mut Value, input_pairs: usize, path: &[MpStep], need: MpNeed) -> u64 {
    let Value::Map(pairs) = at_path(output, path) else {
        panic!("params at {path:?} are no map in the output");
    };
    let (key, id) = match need {
        MpNeed::Append => {
            assert_eq!(
                pairs.len(),
                input_pairs + 1,
                "the map at {path:?} did not gain one pair"
            );
            let (key, id) = &pairs[input_pairs];
            (key, id)
        }
        MpNeed::ReplaceNil(i) => {
            let (key, id) = &pairs[i];
            (key, id)
        }
    };
    assert_eq!(key.as_str(), Some("disagg_request_id"), "at {path:?}");
    assert!(
        matches!(id, Value::Integer(_)),
        "the id at {path:?} is {id}"
    );
    id.as_u64()
        .unwrap_or_else(|| panic!("the id at {path:?} is {id}"))
}

/// The output, read by rmpv, is the input's value plus exactly one of the
/// returned ids at each place the oracle expects one, each id once.
fn check_against_rmpv(input: &Value, output: &Value, ids: &[u64]) {
    let needs = mp_needing_ids(input);
    assert_eq!(
        needs.len(),
        ids.len(),
        "the oracle wants ids at {needs:?}, the plugin made {}",
        ids.len()
    );
    let mut scratch = output.clone();
    let mut input_copy = input.clone();
    let placed: Vec<u64> = needs
        .iter()
        .map(|(path, need)| {
            let input_pairs = match at_path(&mut input_copy, path) {
                Value::Map(pairs) => pairs.len(),
                other => panic!("params at {path:?} are {other}"),
            };
            placed_id(&mut scratch, input_pairs, path, *need)
        })
        .collect();
    let expected = mp_expected(input, &placed);
    assert!(
        same_value(output, &expected),
        "output {output} is not input plus ids {expected}"
    );
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    let mut placed = placed;
    placed.sort_unstable();
    assert_eq!(placed, sorted, "ids placed are not the ids returned");
    assert_eq!(
        placed.iter().collect::<HashSet<_>>().len(),
        placed.len(),
        "an id placed twice"
    );
}

/// Structural equality with floats compared by their bits (rmpv's `==`
/// says a NaN differs from itself) and a float32 never equal to a double.
pub fn same_value(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::F32(x), Value::F32(y)) => x.to_bits() == y.to_bits(),
        (Value::F64(x), Value::F64(y)) => x.to_bits() == y.to_bits(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same_value(x, y))
        }
        (Value::Map(x), Value::Map(y)) => {
            x.len() == y.len()
                && x.iter()
                    .zip(y)
                    .all(|((xk, xv), (yk, yv))| same_value(xk, yk) && same_value(xv, yv))
        }
        (Value::String(x), Value::String(y)) => x.as_bytes() == y.as_bytes(),
        _ => a == b,
    }
}

/// The map header for `count` pairs, in the format of the header that
/// starts with `marker` while it fits, else the next larger one, as the
/// README documents it.
fn grown_header(marker: u8, count: u64) -> Vec<u8> {
    match marker {
        0x80..=0x8f if count <= 15 => vec![0x80 | count as u8],
        0x80..=0x8f | 0xde if count <= 0xffff => {
            [&[0xde][..], &(count as u16).to_be_bytes()].concat()
        }
        _ => [&[0xdf][..], &(count as u32).to_be_bytes()].concat(),
    }
}

/// The input with the documented changes of each edit, made by the
/// oracle's own splicer; the edits are checked against the bytes they
/// name first.
fn splice(body: &[u8], edits: &[MsgpackEdit], ids: &[u64]) -> Vec<u8> {
    // (offset, bytes replaced, innermost first among insertions at one
    // offset, the bytes put there)
    let mut changes: Vec<(usize, usize, std::cmp::Reverse<usize>, Vec<u8>)> = Vec::new();
    let id_value = |id: u64| [&[0xcf][..], &id.to_be_bytes()].concat();
    for (edit, &id) in edits.iter().zip(ids) {
        match *edit {
            MsgpackEdit::AppendPair {
                header,
                header_len,
                count,
                end,
            } => {
                let marker = body[header];
                let (len, real) = match marker {
                    0x80..=0x8f => (1, u64::from(marker & 0x0f)),
                    0xde => (
                        3,
                        u64::from(u16::from_be_bytes([body[header + 1], body[header + 2]])),
                    ),
                    0xdf => (
                        5,
                        u64::from(u32::from_be_bytes(
                            body[header + 1..header + 5].try_into().unwrap(),
                        )),
                    ),
                    _ => panic!("{edit:?} names no map header ({marker:#04x})"),
                };
                assert_eq!(header_len, len, "{edit:?}");
                assert_eq!(u64::from(count), real, "{edit:?}");
                assert!(end > header && end <= body.len(), "{edit:?}");
                changes.push((
                    header,
                    header_len,
                    std::cmp::Reverse(header),
                    grown_header(marker, real + 1),
                ));
                let mut pair = vec![0xa0 | 17];
                pair.extend_from_slice(b"disagg_request_id");
                pair.extend_from_slice(&id_value(id));
                changes.push((end, 0, std::cmp::Reverse(header), pair));
            }
            MsgpackEdit::ReplaceNil { at } => {
                assert_eq!(body.get(at), Some(&0xc0), "{edit:?} names no nil");
                changes.push((at, 1, std::cmp::Reverse(at), id_value(id)));
            }
        }
    }
    // At one offset: insertions (the innermost map's first), then what
    // replaces the bytes there.
    changes.sort_by_key(|(at, replaced, inner, _)| (*at, *replaced, *inner));
    let mut out = Vec::new();
    let mut copied = 0;
    for (at, replaced, _, bytes) in changes {
        assert!(at >= copied, "edits overlap: {edits:?}");
        out.extend_from_slice(&body[copied..at]);
        out.extend_from_slice(&bytes);
        copied = at + replaced;
    }
    out.extend_from_slice(&body[copied..]);
    out
}
