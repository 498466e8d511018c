//! MessagePack bodies of the tiniest containers, one to three bytes each:
//! a 32 MiB batch of empty maps (`[{}, {}, ...]`), of `[{}]` or of
//! `{(): 0}` is valid, and the walk steps over such containers without
//! its general read (which took those bodies past the plugin's deadline).
//! They are read as they were: forwarded as they came, params among them
//! stamped, and the edges of the shortcut kept: an empty array or map one
//! level too deep is refused where it is, a map inside a map key is
//! refused even empty and inside a tuple that equals nothing, and `()` in
//! a key is a tuple that compares. Also keys held by where they are (past
//! the first key of a map over params, the walk holds keys by their place
//! in the body, and reads them again to compare them).

use snowgate_plugin::{decide, find_msgpack_edits, Config, Decision, MsgpackError};

/// The fuzz oracle's id source and id checks, which the MessagePack one
/// below uses.
#[path = "../../fuzz/src/oracle.rs"]
#[allow(dead_code)]
mod oracle;

/// The MessagePack fuzz oracle: where a Python reader expects ids in a
/// MessagePack body, and every check the `stamp_msgpack` fuzz target runs.
#[path = "../../fuzz/src/mp_oracle.rs"]
#[allow(dead_code)]
mod mp_oracle;

#[path = "support/hostile_bodies.rs"]
mod hostile_bodies;

use hostile_bodies::context_only_params;

/// `{"disaggregated_params": {"request_type": "context_only"}}`.
fn params() -> Vec<u8> {
    context_only_params()
}

/// An array 32 of `items` repeated to about `size` bytes.
fn batch(items: &[u8], size: usize) -> (Vec<u8>, usize) {
    let copies = size / items.len();
    let mut body = vec![0xdd];
    body.extend_from_slice(&(copies as u32).to_be_bytes());
    for _ in 0..copies {
        body.extend_from_slice(items);
    }
    (body, copies)
}

/// How many ids `body` needs, or why it is refused.
fn ids(body: &[u8]) -> Result<usize, MsgpackError> {
    find_msgpack_edits(body).map(|edits| edits.len())
}

/// The refusal of `body`, as offset and problem.
fn refusal(body: &[u8]) -> (usize, &'static str) {
    let error = find_msgpack_edits(body).expect_err("refused");
    (error.offset, error.problem)
}

/// The tiny containers, alone and side by side: each valid, needing no id.
const TINY: [&[u8]; 9] = [
    // {}, [], [{}], [[]], {(): 0}, {0: {}}, {"": []}, {(): {}, 1: []}
    &[0x80],
    &[0x90],
    &[0x91, 0x80],
    &[0x91, 0x90],
    &[0x81, 0x90, 0x00],
    &[0x81, 0x00, 0x80],
    &[0x81, 0xa0, 0x90],
    &[0x82, 0x90, 0x80, 0x01, 0x90],
    // [{(): [{}]}]
    &[0x91, 0x81, 0x90, 0x91, 0x80],
];

#[test]
fn batches_of_tiny_containers_are_forwarded_as_they_came() {
    for items in TINY {
        // Large enough to be a batch, small enough for a debug build.
        let (body, _) = batch(items, 1 << 20);
        assert_eq!(ids(&body), Ok(0), "{items:02x?}");
        let mut source = oracle::CounterIds::new(oracle::layout_for(&body));
        let decision = decide(&Config::default(), true, &body, &mut source);
        assert!(
            matches!(decision, Ok(Decision::Forward)),
            "{items:02x?}: {decision:?}"
        );
        // The fuzz oracle judges a small one (it leaves bodies of more
        // than 8 KiB with array keys alone).
        let (small, _) = batch(items, 4 << 10);
        assert_eq!(
            mp_oracle::check_msgpack_body(&small),
            "forward-valid",
            "{items:02x?}"
        );
    }
}

/// Params maps among tiny containers, in every place the shortcut reads:
/// array items, map values after pairs stepped over, maps under `()`.
#[test]
fn params_among_tiny_containers_are_stamped() {
    let params = params();
    // One array of them, each copy of it an item of the batch.
    let mut items = vec![0x97];
    // [{}, P, [], {(): 0, "x": P}, {(): P}, [[{}], P], {"a": 0, "b": {}, "c": [P]}]
    items.extend([0x80]);
    items.extend(&params);
    items.extend([0x90, 0x82, 0x90, 0x00, 0xa1, b'x']);
    items.extend(&params);
    items.extend([0x81, 0x90]);
    items.extend(&params);
    items.extend([0x92, 0x91, 0x80]);
    items.extend(&params);
    items.extend([0x83, 0xa1, b'a', 0x00, 0xa1, b'b', 0x80, 0xa1, b'c', 0x91]);
    items.extend(&params);
    let per_copy = 5;
    let (small, copies) = batch(&items, 4 << 10);
    let summary = mp_oracle::check_msgpack_body(&small);
    assert_eq!(summary, format!("stamp{}-nil0-valid", copies * per_copy));
    let (body, copies) = batch(&items, 1 << 20);
    assert_eq!(ids(&body), Ok(copies * per_copy));
}

/// An empty array or map one level past the deepest nesting is refused
/// as the general read refuses the same container written in a wider
/// format (an array 16 or map 16 of no items): with the same problem, at
/// its header. One level less deep, it is read.
#[test]
fn an_empty_container_one_level_too_deep_is_refused_where_it_is() {
    let nan = [0xcb, 0x7f, 0xf8, 0, 0, 0, 0, 0, 0];
    // (`depth` containers around it, then the bytes before and after it)
    // for each place the walk steps over an empty container.
    let places: Vec<(usize, Vec<u8>, Vec<u8>)> = vec![
        // An array's item.
        (128, vec![], vec![]),
        // A map's value, and a map's key, among pairs stepped over.
        (127, vec![0x81, 0x00], vec![]),
        (127, vec![0x81], vec![0x00]),
        // A value after a pair the general read reads (a str 8 value).
        (127, vec![0x82, 0xa1, b'k', 0xd9, 0x01, b'v', 0x00], vec![]),
        // An item of an array key that equals nothing (it holds a NaN).
        (126, [&[0x81, 0x92][..], &nan].concat(), vec![0x00]),
    ];
    for (depth, before, after) in places {
        for (empty, wide) in [(&[0x90][..], &[0xdc, 0, 0][..]), (&[0x80], &[0xde, 0, 0])] {
            // An empty map cannot be a key, nor be inside one.
            if empty == [0x80] && (after == [0x00]) {
                continue;
            }
            let body = |depth, container: &[u8]| {
                [&vec![0x91; depth][..], &before, container, &after].concat()
            };
            let at = depth + before.len();
            let fast = refusal(&body(depth, empty));
            assert_eq!(fast, refusal(&body(depth, wide)), "{before:02x?}");
            assert_eq!(
                fast,
                (at, "arrays and maps nest deeper than 128 levels"),
                "{before:02x?} {empty:02x?}"
            );
            assert_eq!(ids(&body(depth - 1, empty)), Ok(0), "{before:02x?}");
        }
    }
}

/// A map as a key, or anywhere inside one, is refused even empty, and
/// inside a tuple that equals nothing (one that holds a NaN, or one too
/// long to compare): at the map's header, as a wider empty map is.
#[test]
fn a_map_inside_a_key_is_refused_even_empty_and_where_nothing_is_compared() {
    let nan = [0xcb, 0x7f, 0xf8, 0, 0, 0, 0, 0, 0];
    // A tuple of 70,000 one-byte integers: past what a key is compared by.
    let long = [&[0xdd][..], &70_001u32.to_be_bytes(), &[0x7f; 70_000]].concat();
    let keys_before: [Vec<u8>; 5] = [
        vec![],
        vec![0x91],
        [&[0x92][..], &nan].concat(),
        [&[0x92][..], &nan, &[0x91]].concat(),
        long,
    ];
    for before in &keys_before {
        for map in [&[0x80][..], &[0xde, 0, 0]] {
            let body = [&[0x81][..], before, map, &[0x00]].concat();
            assert_eq!(
                refusal(&body),
                (
                    1 + before.len(),
                    "a map key is or holds a map, which msgspec and Python refuse as a dict key"
                ),
                "{:02x?}",
                &before[..before.len().min(12)]
            );
        }
    }
}

/// `{KEY: P, OTHER: 0}`: 0 ids when OTHER overrides KEY, 1 when it does
/// not. Checked too with a key over params before KEY, so that KEY is
/// held by where it is rather than singly.
fn ids_with_keys(key: &[u8], other: &[u8]) -> usize {
    let params = params();
    let body = [&[0x82][..], key, &params, other, &[0x00]].concat();
    let alone = ids(&body).unwrap_or_else(|e| panic!("{key:02x?} then {other:02x?}: {e}"));
    let first = [0xa5, b'f', b'i', b'r', b's', b't'];
    let body = [&[0x83][..], &first, &params, key, &params, other, &[0x00]].concat();
    assert_eq!(ids(&body), Ok(1 + alone), "{key:02x?} then {other:02x?}");
    alone
}

/// `()` as a key or in one is the empty tuple, which equals itself (also
/// written as an array 16 of no items) and no other key; a tuple holding
/// a NaN equals nothing, `()` in it or not.
#[test]
fn an_empty_tuple_in_a_key_compares() {
    let nan = [0xcb, 0x7f, 0xf8, 0, 0, 0, 0, 0, 0];
    let same: [(&[u8], &[u8]); 5] = [
        (&[0x90], &[0x90]),
        (&[0x90], &[0xdc, 0, 0]),
        (&[0x91, 0x90], &[0x91, 0x90]),
        (&[0x92, 0x90, 0x01], &[0x92, 0xdc, 0, 0, 0xc3]),
        (&[0x91, 0x91, 0x90], &[0x91, 0x91, 0xdd, 0, 0, 0, 0]),
    ];
    for (key, other) in same {
        assert_eq!(ids_with_keys(key, other), 0, "{key:02x?} then {other:02x?}");
    }
    let with_nan = [&[0x92][..], &nan, &[0x90]].concat();
    let different: [(&[u8], &[u8]); 5] = [
        (&[0x90], &[0x91, 0x90]),
        (&[0x91, 0x90], &[0x90]),
        (&[0x90], &[0xc0]),
        (&[0x91, 0x90], &[0x92, 0x90, 0x90]),
        (&with_nan, &with_nan),
    ];
    for (key, other) in different {
        assert_eq!(ids_with_keys(key, other), 1, "{key:02x?} then {other:02x?}");
    }
}

/// Pairs stepped over before a params key, and duplicates of a key over
/// params that the walk steps over: the last of equal keys still wins.
#[test]
fn pairs_stepped_over_still_override_keys_before_them() {
    let params = params();
    let map = |pairs: &[&[u8]]| {
        let mut body = vec![0x80 | (pairs.len() / 2) as u8];
        pairs.iter().for_each(|part| body.extend_from_slice(part));
        body
    };
    let x = &[0xa1, b'x'][..];
    let cases: [(Vec<u8>, usize); 9] = [
        (map(&[x, &[0x00], &params[1..22], &params[22..]]), 1),
        (map(&[x, &[0x00], x, &params]), 1),
        (map(&[x, &params, x, &[0x00]]), 0),
        (map(&[x, &params, x, &[0x90]]), 0),
        (map(&[x, &params, x, &[0x80]]), 0),
        (map(&[x, &params, &[0xa1, b'y'], &[0x80]]), 1),
        (map(&[&[0x90], &params, &[0xdc, 0, 0], &[0x00]]), 0),
        // The params map's own pairs are read in full: its `request_type`
        // comes after a pair the walk would otherwise step over.
        (
            [&params[..22], &[0x82, 0xa1, b'z', 0x00], &params[23..]].concat(),
            1,
        ),
        (
            [&params[..22], &[0x82], &params[23..], &[0xa1, b'z', 0x80]].concat(),
            1,
        ),
    ];
    for (body, expected) in cases {
        assert_eq!(ids(&body), Ok(expected), "{body:02x?}");
        assert!(
            mp_oracle::check_msgpack_body(&body).ends_with("-valid"),
            "{body:02x?}"
        );
    }
}

/// A map of many keys over params holds all but the first by where they
/// are in the body, and reads them again to compare them with a later key
/// of the same hash: keys written in another format (an integer as a
/// float or a wider integer, a string as a str 8, a tuple's items so) are
/// still the same key, and override the first.
#[test]
fn keys_held_by_where_they_are_are_compared_as_keys() {
    let params = params();
    let keys = 3000u16;
    let mut pairs = 0;
    let mut body = vec![0xdf, 0, 0, 0, 0];
    let mut pair = |body: &mut Vec<u8>, key: &[u8], value: &[u8]| {
        body.extend_from_slice(key);
        body.extend_from_slice(value);
        pairs += 1;
    };
    let text = |i: u16| format!("k{i}").into_bytes();
    for i in 0..keys {
        pair(
            &mut body,
            &[&[0xcd][..], &i.to_be_bytes()].concat(),
            &params,
        );
        let name = text(i);
        pair(
            &mut body,
            &[&[0xa0 | name.len() as u8][..], &name].concat(),
            &params,
        );
        // (i, "k<i>")
        pair(
            &mut body,
            &[
                &[0x92, 0xcd][..],
                &i.to_be_bytes(),
                &[0xa0 | name.len() as u8],
                &name,
            ]
            .concat(),
            &params,
        );
    }
    let mut overridden = 0;
    for i in (0..keys).filter(|i| i % 3 == 0) {
        let name = text(i);
        let float = f64::from(i).to_bits().to_be_bytes();
        pair(&mut body, &[&[0xcb][..], &float].concat(), &[0x00]);
        pair(
            &mut body,
            &[&[0xd9, name.len() as u8][..], &name].concat(),
            &[0xc0],
        );
        pair(
            &mut body,
            &[
                &[0x92, 0xd2][..],
                &u32::from(i).to_be_bytes(),
                &[0xd9, name.len() as u8],
                &name,
            ]
            .concat(),
            &[0x80],
        );
        overridden += 3;
    }
    body[1..5].copy_from_slice(&(pairs as u32).to_be_bytes());
    assert_eq!(ids(&body), Ok(3 * usize::from(keys) - overridden));
    // A float key held by where it is: the integer after it is the same
    // key.
    let mut float_held = vec![0x83, 0xa1, b'q'];
    float_held.extend(&params);
    float_held.push(0xcb);
    float_held.extend(7.0f64.to_bits().to_be_bytes());
    float_held.extend(&params);
    float_held.extend([0x07, 0x00]);
    assert_eq!(ids(&float_held), Ok(1));
}
