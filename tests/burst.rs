//! A burst: one body with 10,000 context-only requests (a top-level array)
//! on a clock stuck in one millisecond. Each request gets its own id; once a
//! millisecond's sequence space is used up, ids move on to the next
//! millisecond instead of wrapping (TensorRT-LLM's own counter wraps and
//! repeats ids).

mod common;

use std::collections::HashSet;

use common::{batch_body, fixed_plugin, ids_in, stamped_batch_body, START_MILLIS};
use snowgate_plugin::{IdParts, SnowflakeLayout};

const BURST: usize = 10_000;

fn check_burst(layout: SnowflakeLayout, machine_id: u32) {
    let plugin = fixed_plugin(layout, machine_id, START_MILLIS);
    let out = common::stamp(&plugin, batch_body(BURST));

    let ids = ids_in(&out);
    assert_eq!(ids.len(), BURST, "one id per request");
    let distinct: HashSet<u64> = ids.iter().copied().collect();
    assert_eq!(distinct.len(), BURST, "ids repeat");

    // Nothing but the ids was added to the body.
    assert!(
        out == stamped_batch_body(&ids).into_bytes(),
        "the stamped body differs from the input plus ids"
    );

    let parts: Vec<IdParts> = ids
        .iter()
        .map(|&id| layout.decode(id).expect("a stamped id decodes"))
        .collect();
    assert!(parts.iter().all(|p| p.machine_id == machine_id));
    assert!(
        parts
            .windows(2)
            .all(|w| (w[0].millis, w[0].sequence) < (w[1].millis, w[1].sequence)),
        "(ms, sequence) must strictly increase in body order"
    );

    // Exactly `space` ids per millisecond, then the next millisecond from 0.
    let space = layout.sequence_space() as usize;
    let mask = match layout {
        SnowflakeLayout::TrtllmV1 => u64::MAX,
        SnowflakeLayout::TrtllmV2 => (1 << 39) - 1,
    };
    for (i, p) in parts.iter().enumerate() {
        let expected = IdParts {
            millis: (START_MILLIS + (i / space) as u64) & mask,
            machine_id,
            sequence: (i % space) as u32,
        };
        assert_eq!(*p, expected, "id #{i} ({})", ids[i]);
    }
    // The spill-over point itself, spelled out.
    assert_eq!(
        (parts[space - 1].sequence, parts[space].sequence),
        (space as u32 - 1, 0)
    );
    assert_eq!(parts[space].millis, parts[space - 1].millis + 1);
}

#[test]
fn a_burst_of_10000_requests_gets_distinct_ids_that_spill_over_after_4096_in_v1() {
    check_burst(SnowflakeLayout::TrtllmV1, 1022);
}

#[test]
fn a_burst_of_10000_requests_gets_distinct_ids_that_spill_over_after_1024_in_v2() {
    check_burst(SnowflakeLayout::TrtllmV2, 16383);
}
