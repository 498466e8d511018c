//! The walks on 32 MiB bodies. MessagePack: a long prompt's token ids
//! (`tokens`), an array of one-byte integers (`fixints`), a map of long
//! array keys over params (`tuple_keys`) and one of string keys sharing a
//! long prefix over params (`string_keys`); JSON: the same string keys
//! (`json_string_keys`). The last three are hostile bodies. Then the
//! densest bodies, nothing but params maps to stamp, in an array
//! (`params`, `json_params`) and under distinct short keys (`int_keys`,
//! `json_short_keys`); and the tiniest containers, one to three bytes
//! each: empty maps (`empty_maps`), empty arrays (`empty_arrays`), `[{}]`
//! (`empty_map_arrays`) and `{(): 0}` (`tuple_key_maps`), and in JSON
//! `{}`, `[{}]` and `{"":0}` (`json_empty_objects`,
//! `json_empty_object_arrays`, `json_empty_key_objects`).
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

#[path = "../tests/support/hostile_bodies.rs"]
mod hostile_bodies;

/// The gateway's default largest body: every body is at most this.
const SIZE: usize = 32 << 20;

/// The bodies, by name.
const CASES: [&str; 16] = [
    "tokens",
    "fixints",
    "tuple_keys",
    "string_keys",
    "json_string_keys",
    "params",
    "json_params",
    "int_keys",
    "json_short_keys",
    "empty_maps",
    "empty_arrays",
    "empty_map_arrays",
    "tuple_key_maps",
    "json_empty_objects",
    "json_empty_object_arrays",
    "json_empty_key_objects",
];

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

/// An array 32 of as many copies of `item` as fit in [`SIZE`] bytes.
fn array_of(item: &[u8]) -> Vec<u8> {
    let count = (SIZE - 5) / item.len();
    let mut body = vec![0xdd];
    body.extend_from_slice(&(count as u32).to_be_bytes());
    for _ in 0..count {
        body.extend_from_slice(item);
    }
    body
}

/// A JSON array of as many copies of `item` as fit in [`SIZE`] bytes.
fn json_array_of(item: &[u8]) -> Vec<u8> {
    let count = (SIZE - 1) / (item.len() + 1);
    let mut body = Vec::with_capacity(SIZE);
    for _ in 0..count {
        body.push(if body.is_empty() { b'[' } else { b',' });
        body.extend_from_slice(item);
    }
    body.push(b']');
    body
}

/// The body of `case`, one of [`CASES`].
fn body(case: &str) -> Vec<u8> {
    match case {
        "tokens" => tokens(),
        "fixints" => fixints(),
        "tuple_keys" => hostile_bodies::tuple_keyed_within(SIZE).0,
        "string_keys" => hostile_bodies::string_keyed_within(SIZE).0,
        "json_string_keys" => hostile_bodies::json_string_keyed_within(SIZE).0,
        "params" => array_of(&hostile_bodies::context_only_params()),
        "json_params" => {
            json_array_of(br#"{"disaggregated_params":{"request_type":"context_only"}}"#)
        }
        "int_keys" => hostile_bodies::uint32_keyed_within(SIZE).0,
        "json_short_keys" => hostile_bodies::json_short_keyed_within(SIZE).0,
        "empty_maps" => array_of(&[0x80]),
        "empty_arrays" => array_of(&[0x90]),
        "empty_map_arrays" => array_of(&[0x91, 0x80]),
        "tuple_key_maps" => array_of(&[0x81, 0x90, 0x00]),
        "json_empty_objects" => json_array_of(b"{}"),
        "json_empty_object_arrays" => json_array_of(b"[{}]"),
        "json_empty_key_objects" => json_array_of(br#"{"":0}"#),
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
