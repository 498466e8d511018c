//! A wall clock that steps backwards (an NTP correction, a VM migration)
//! must not make ids go back or repeat: the host's clock keeps counting
//! from its last reading until the wall clock catches up.

mod common;

use std::collections::HashSet;

use common::{batch_body, ids_in, plugin_with, HandClock, START_MILLIS};
use snowgate_plugin::{IdParts, SnowflakeLayout};

const MACHINE: u32 = 3;

#[test]
fn ids_keep_increasing_and_never_repeat_when_the_wall_clock_steps_back() {
    let layout = SnowflakeLayout::TrtllmV1;
    let wall = HandClock::at(START_MILLIS);
    let plugin = plugin_with(layout, MACHINE, wall.clone());
    let decode = |id: u64| layout.decode(id).expect("a stamped id decodes");

    let mut issued: Vec<u64> = Vec::new();
    let mut stamp = |body: &str| -> Vec<u64> {
        let ids = ids_in(&common::stamp(&plugin, body));
        issued.extend(&ids);
        ids
    };

    let first = stamp(&batch_body(3));
    assert_eq!(
        decode(first[0]),
        IdParts {
            millis: START_MILLIS,
            machine_id: MACHINE,
            sequence: 0
        }
    );

    // Step back by 1, 2, ... 5 seconds between requests: every id continues
    // exactly where the previous one left off, in the same millisecond.
    let mut previous = decode(*first.last().expect("three ids"));
    for seconds in 1..=5u64 {
        wall.set(START_MILLIS - seconds * 1000);
        let ids = stamp(&batch_body(2));
        for id in ids {
            let parts = decode(id);
            assert_eq!(
                (parts.millis, parts.sequence),
                (previous.millis, previous.sequence + 1),
                "after stepping back {seconds} s"
            );
            previous = parts;
        }
    }

    // While the wall clock is behind, a burst larger than one millisecond's
    // sequence space moves on to the next millisecond, still never back.
    wall.set(START_MILLIS - 10_000);
    let burst = stamp(&batch_body(5000));
    let last = decode(*burst.last().expect("5000 ids"));
    assert!(last.millis > START_MILLIS, "{last:?}");

    // Once the wall clock is ahead again, ids follow it from sequence 0.
    wall.set(START_MILLIS + 60_000);
    let caught_up = stamp(common::CONTEXT_ONLY);
    assert_eq!(
        decode(caught_up[0]),
        IdParts {
            millis: START_MILLIS + 60_000,
            machine_id: MACHINE,
            sequence: 0
        }
    );
    // And a step back from there does not reuse the earlier range either.
    wall.set(START_MILLIS);
    let again = stamp(common::CONTEXT_ONLY);
    assert_eq!(
        decode(again[0]),
        IdParts {
            millis: START_MILLIS + 60_000,
            machine_id: MACHINE,
            sequence: 1
        }
    );

    assert!(
        issued.windows(2).all(|w| w[0] < w[1]),
        "ids must strictly increase in issue order"
    );
    let distinct: HashSet<u64> = issued.iter().copied().collect();
    assert_eq!(distinct.len(), issued.len(), "ids repeat");
}
