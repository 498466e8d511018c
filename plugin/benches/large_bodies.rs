//! The walks on 32 MiB bodies. MessagePack: a long prompt's token ids
//! (`tokens`), an array of one-byte integers (`fixints`), a map of long
//! array keys over params (`tuple_keys`) and one of string keys sharing a
//! long prefix over params (`string_keys`); JSON: the same string keys
//! (`json_string_keys`). The last three are hostile bodies.
//!
//! ```sh
//! cargo bench -p snowgate-plugin --bench large_bodies             # times
//! cargo bench -p snowgate-plugin --bench large_bodies --no-run
//! valgrind --tool=callgrind --toggle-collect='*find_*edits*' \
//!     target/release/deps/large_bodies-<hash> count tokens          # instructions
//! ```
//!
//! `count CASE` walks the body once, so that callgrind, collecting only
//! inside the walk, counts its instructions: a number that does not move
//! with the machine's load. `write CASE` writes the body on stdout, for
//! `snowgate rewrite` (each is at most 32 MiB, the gateway's default
//! largest body).

use std::hint::black_box;

use criterion::{Criterion, Throughput};
use snowgate_plugin::{find_edits, find_msgpack_edits};

/// The gateway's default largest body: every body is at most this.
const SIZE: usize = 32 << 20;

/// The bodies, by name.
const CASES: [&str; 5] = [
    "tokens",
    "fixints",
    "tuple_keys",
    "string_keys",
    "json_string_keys",
];

/// `{"disaggregated_params": {"request_type": "context_only"}}` in
/// MessagePack.
fn context_only_params() -> Vec<u8> {
    let mut params = vec![0x81, 0xb4];
    params.extend_from_slice(b"disaggregated_params");
    params.extend_from_slice(&[0x81, 0xac]);
    params.extend_from_slice(b"request_type");
    params.push(0xac);
    params.extend_from_slice(b"context_only");
    params
}

/// The `i`-th of a million 60-byte keys that share their first 55 bytes.
fn long_key(i: usize) -> Vec<u8> {
    let mut key = vec![b'k'; 55];
    key.extend((0..5).map(|digit| b'a' + ((i >> (4 * digit)) & 15) as u8));
    key
}

/// A MessagePack map of about [`SIZE`] bytes whose keys are
/// [`long_key`]s, each over a context-only params map.
fn string_keys() -> Vec<u8> {
    let params = context_only_params();
    let pairs = (SIZE - 5) / (2 + 60 + params.len());
    let mut body = vec![0xdf];
    body.extend_from_slice(&(pairs as u32).to_be_bytes());
    for i in 0..pairs {
        body.extend_from_slice(&[0xd9, 60]);
        body.extend_from_slice(&long_key(i));
        body.extend_from_slice(&params);
    }
    body
}

/// The same as JSON: `{"<key>":{"disaggregated_params":{...}},...}`.
fn json_string_keys() -> Vec<u8> {
    let params = br#"{"disaggregated_params":{"request_type":"context_only"}}"#;
    let mut body = b"{".to_vec();
    let mut i = 0;
    // A member (the comma, the quoted key, the colon and the params) and
    // the closing brace.
    while body.len() + 1 + 62 + 1 + params.len() < SIZE {
        if i > 0 {
            body.push(b',');
        }
        body.push(b'"');
        body.extend_from_slice(&long_key(i));
        body.extend_from_slice(b"\":");
        body.extend_from_slice(params);
        i += 1;
    }
    body.push(b'}');
    body
}

/// `{"prompt_token_ids": [...]}` of about [`SIZE`] bytes: ids below
/// 151,936 (a Qwen vocabulary), each a fixint, uint 16 or uint 32.
fn tokens() -> Vec<u8> {
    let mut body = vec![0x81, 0xb0];
    body.extend_from_slice(b"prompt_token_ids");
    let count_at = body.len() + 1;
    body.extend_from_slice(&[0xdd, 0, 0, 0, 0]);
    let mut count: u32 = 0;
    let mut state: u32 = 1;
    while body.len() + 5 <= SIZE {
        state = state.wrapping_mul(2_654_435_761).wrapping_add(12_345);
        match state % 151_936 {
            id @ 0..128 => body.push(id as u8),
            id @ 128..65_536 => {
                body.push(0xcd);
                body.extend_from_slice(&(id as u16).to_be_bytes());
            }
            id => {
                body.push(0xce);
                body.extend_from_slice(&id.to_be_bytes());
            }
        }
        count += 1;
    }
    body[count_at..count_at + 4].copy_from_slice(&count.to_be_bytes());
    body
}

/// An array 32 of one-byte integers, [`SIZE`] bytes in all.
fn fixints() -> Vec<u8> {
    let mut body = vec![0xdd];
    body.extend_from_slice(&(SIZE as u32 - 5).to_be_bytes());
    body.resize(SIZE, 0x7f);
    body
}

/// A map of about [`SIZE`] bytes whose keys are arrays of 10,923 one-byte
/// items and a distinct integer, each over a context-only params map.
fn tuple_keys() -> Vec<u8> {
    let params = context_only_params();
    let pairs = (SIZE - 5) / (3 + 10_923 + 3 + params.len());
    let mut body = vec![0xdf];
    body.extend_from_slice(&(pairs as u32).to_be_bytes());
    for i in 0..pairs {
        body.push(0xdc);
        body.extend_from_slice(&10_924u16.to_be_bytes());
        body.extend(std::iter::repeat_n(0x7f, 10_923));
        body.push(0xcd);
        body.extend_from_slice(&(i as u16).to_be_bytes());
        body.extend_from_slice(&params);
    }
    body
}

/// The body of `case`, one of [`CASES`].
fn body(case: &str) -> Vec<u8> {
    match case {
        "tokens" => tokens(),
        "fixints" => fixints(),
        "tuple_keys" => tuple_keys(),
        "string_keys" => string_keys(),
        "json_string_keys" => json_string_keys(),
        other => panic!("no case {other:?}: one of {CASES:?}"),
    }
}

/// Walks `body` of `case` as its format, and returns how many edits it
/// found.
fn walk(case: &str, body: &[u8]) -> usize {
    if case.starts_with("json") {
        find_edits(black_box(body)).expect("valid JSON").len()
    } else {
        find_msgpack_edits(black_box(body))
            .expect("valid MessagePack")
            .len()
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [mode, case] = &args[..] {
        if mode == "count" {
            let body = body(case);
            println!("{case}: {} bytes, {} edits", body.len(), walk(case, &body));
            return;
        }
        if mode == "write" {
            use std::io::Write as _;
            std::io::stdout()
                .write_all(&body(case))
                .expect("writing the body");
            return;
        }
    }
    let mut criterion = Criterion::default().sample_size(10).configure_from_args();
    let mut group = criterion.benchmark_group("large_bodies");
    for case in CASES {
        let body = body(case);
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_function(case, |b| b.iter(|| walk(case, &body)));
    }
    group.finish();
    criterion.final_summary();
}
