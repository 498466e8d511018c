//! Bodies made to cost the walks the most for their size: objects (maps)
//! of many keys, each over a context-only params object to stamp, whose
//! keys are long arrays (tuples, in Python) or strings sharing a long
//! prefix. Shared by the plugin's tests and bench and the workspace's
//! `limits` test, each including this file by its path.
//!
//! Each holds at most `size` bytes and comes with its number of ids.

#![allow(dead_code)]

/// `{"disaggregated_params": {"request_type": "context_only"}}` in
/// MessagePack.
pub fn context_only_params() -> Vec<u8> {
    let mut params = vec![0x81, 0xa0 | 20];
    params.extend_from_slice(b"disaggregated_params");
    params.extend_from_slice(&[0x81, 0xa0 | 12]);
    params.extend_from_slice(b"request_type");
    params.push(0xa0 | 12);
    params.extend_from_slice(b"context_only");
    params
}

/// The one-byte items of each [`tuple_keyed`] key before its last.
const TUPLE_ITEMS: usize = 10_923;

/// A MessagePack map of `pairs` pairs, each an array key of
/// [`TUPLE_ITEMS`] one-byte items and then `tail(i)`, over
/// [`context_only_params`]. Each key's canonical encoding, which the walk
/// makes to match later duplicates, is about three times its 11 KB.
pub fn tuple_keyed(pairs: u32, tail: impl Fn(u32) -> u16) -> Vec<u8> {
    let params = context_only_params();
    let mut body = vec![0xdf];
    body.extend_from_slice(&pairs.to_be_bytes());
    for i in 0..pairs {
        body.push(0xdc);
        body.extend_from_slice(&(TUPLE_ITEMS as u16 + 1).to_be_bytes());
        body.extend(std::iter::repeat_n(0x7f, TUPLE_ITEMS));
        body.push(0xcd);
        body.extend_from_slice(&tail(i).to_be_bytes());
        body.extend_from_slice(&params);
    }
    body
}

/// As many [`tuple_keyed`] pairs as fit in `size` bytes, each key distinct.
pub fn tuple_keyed_within(size: usize) -> (Vec<u8>, usize) {
    let pair = 3 + TUPLE_ITEMS + 3 + context_only_params().len();
    let pairs = (size - 5) / pair;
    (tuple_keyed(pairs as u32, |i| i as u16), pairs)
}

/// The `i`-th of a million 60-byte keys that share their first 55 bytes.
pub fn long_key(i: usize) -> Vec<u8> {
    let mut key = vec![b'k'; 55];
    key.extend((0..5).map(|digit| b'a' + ((i >> (4 * digit)) & 15) as u8));
    key
}

/// A MessagePack map of [`long_key`]s, each over [`context_only_params`],
/// as many as fit in `size` bytes.
pub fn string_keyed_within(size: usize) -> (Vec<u8>, usize) {
    let params = context_only_params();
    let pairs = (size - 5) / (2 + 60 + params.len());
    let mut body = vec![0xdf];
    body.extend_from_slice(&(pairs as u32).to_be_bytes());
    for i in 0..pairs {
        body.extend_from_slice(&[0xd9, 60]);
        body.extend_from_slice(&long_key(i));
        body.extend_from_slice(&params);
    }
    (body, pairs)
}

/// The same as JSON, `{"<key>":{"disaggregated_params":{...}},...}`, as
/// many members as fit in `size` bytes.
pub fn json_string_keyed_within(size: usize) -> (Vec<u8>, usize) {
    let params = br#"{"disaggregated_params":{"request_type":"context_only"}}"#;
    let mut body = b"{".to_vec();
    let mut members = 0;
    // A member (the comma, the quoted key, the colon and the params) and
    // the closing brace.
    while body.len() + 1 + 62 + 1 + params.len() < size {
        if members > 0 {
            body.push(b',');
        }
        body.push(b'"');
        body.extend_from_slice(&long_key(members));
        body.extend_from_slice(b"\":");
        body.extend_from_slice(params);
        members += 1;
    }
    body.push(b'}');
    (body, members)
}

/// A MessagePack map 32 of distinct uint 32 keys, each over context-only
/// params to stamp (an id every 54 bytes), of `size` bytes at most, and
/// its number of ids: the most keys over ids a body of its size holds,
/// each held by the walk until the map ends in case a later duplicate
/// overrides it.
pub fn uint32_keyed_within(size: usize) -> (Vec<u8>, usize) {
    let params = context_only_params();
    let count = (size - 5) / (5 + params.len());
    let mut body = vec![0xdf];
    body.extend_from_slice(&(count as u32).to_be_bytes());
    for key in 0..count as u32 {
        body.push(0xce);
        body.extend_from_slice(&key.to_be_bytes());
        body.extend_from_slice(&params);
    }
    (body, count)
}

/// A JSON object of short distinct keys, `{"0":{...},"1":{...},...}`, each
/// over `{"disaggregated_params":{"request_type":"context_only"}}`, of
/// `size` bytes at most, and its number of ids: the JSON body that holds
/// the most keys over ids.
pub fn json_short_keyed_within(size: usize) -> (Vec<u8>, usize) {
    let params = br#"{"disaggregated_params":{"request_type":"context_only"}}"#;
    let mut body = Vec::with_capacity(size);
    let mut count = 0;
    loop {
        let member = format!("\"{count}\":");
        // The member, its comma or the opening brace, and the closing one.
        if body.len() + 1 + member.len() + params.len() + 1 > size {
            break;
        }
        body.push(if body.is_empty() { b'{' } else { b',' });
        body.extend_from_slice(member.as_bytes());
        body.extend_from_slice(params);
        count += 1;
    }
    body.push(b'}');
    (body, count)
}
