//! The MessagePack walk on three 32 MiB bodies: a long prompt's token ids
//! (`tokens`), an array of one-byte integers (`fixints`), and a map of long
//! array keys over params (`tuple_keys`, a hostile body).
//!
//! ```sh
//! cargo bench -p snowgate-plugin --bench msgpack_walk             # times
//! cargo bench -p snowgate-plugin --bench msgpack_walk --no-run
//! valgrind --tool=callgrind --toggle-collect='*find_msgpack_edits*' \
//!     target/release/deps/msgpack_walk-<hash> count tokens          # instructions
//! ```
//!
//! `count CASE` walks the body once, so that callgrind, collecting only
//! inside the walk, counts its instructions: a number that does not move
//! with the machine's load.

use std::hint::black_box;

use criterion::{Criterion, Throughput};
use snowgate_plugin::find_msgpack_edits;

/// About the gateway's default largest body.
const SIZE: usize = 32 << 20;

/// The bodies, by name.
const CASES: [&str; 3] = ["tokens", "fixints", "tuple_keys"];

/// `{"prompt_token_ids": [...]}` of about [`SIZE`] bytes: ids below
/// 151,936 (a Qwen vocabulary), each a fixint, uint 16 or uint 32.
fn tokens() -> Vec<u8> {
    let mut body = vec![0x81, 0xb0];
    body.extend_from_slice(b"prompt_token_ids");
    let count_at = body.len() + 1;
    body.extend_from_slice(&[0xdd, 0, 0, 0, 0]);
    let mut count: u32 = 0;
    let mut state: u32 = 1;
    while body.len() < SIZE {
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

/// An array 32 of [`SIZE`] one-byte integers.
fn fixints() -> Vec<u8> {
    let mut body = vec![0xdd];
    body.extend_from_slice(&(SIZE as u32).to_be_bytes());
    body.resize(5 + SIZE, 0x7f);
    body
}

/// A map of about [`SIZE`] bytes whose keys are arrays of 10,923 one-byte
/// items and a distinct integer, each over a context-only params map.
fn tuple_keys() -> Vec<u8> {
    let mut params = vec![0x81, 0xb4];
    params.extend_from_slice(b"disaggregated_params");
    params.extend_from_slice(&[0x81, 0xac]);
    params.extend_from_slice(b"request_type");
    params.push(0xac);
    params.extend_from_slice(b"context_only");
    let pairs = SIZE / (3 + 10_923 + 3 + params.len());
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
        other => panic!("no case {other:?}: one of {CASES:?}"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [mode, case] = &args[..] {
        if mode == "count" {
            let body = body(case);
            let edits = find_msgpack_edits(black_box(&body)).expect("valid MessagePack");
            println!("{case}: {} bytes, {} edits", body.len(), edits.len());
            return;
        }
    }
    let mut criterion = Criterion::default().sample_size(10).configure_from_args();
    let mut group = criterion.benchmark_group("msgpack_walk");
    for case in CASES {
        let body = body(case);
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_function(case, |b| {
            b.iter(|| find_msgpack_edits(black_box(&body)).expect("valid MessagePack"))
        });
    }
    group.finish();
    criterion.final_summary();
}
