//! A wall clock that steps backwards (an NTP correction, a VM migration)
//! must not make ids go back or repeat: the host's clock keeps counting
//! from its last reading until the wall clock catches up.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::{batch_body, ids_in, plugin_with, HandClock, START_MILLIS};
use snowgate_host::WallClock;
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
    // 13 sequences of START_MILLIS were used before: 4083 more fill it,
    // and the other 917 take the next millisecond's first ones.
    assert_eq!((last.millis, last.sequence), (START_MILLIS + 1, 916));

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

/// A wall clock a millisecond further back at every reading.
struct FallingClock(Arc<AtomicU64>);

impl WallClock for FallingClock {
    fn now_millis(&self) -> u64 {
        self.0.fetch_sub(1, Ordering::SeqCst)
    }
}

/// The wall clock stepping back while one body is stamped, at every tick
/// of its 5,000: its ids still strictly increase from the first reading,
/// moving on a millisecond each time one's sequence space is used up, in
/// both layouts.
#[test]
fn ids_keep_increasing_when_the_wall_clock_steps_back_within_one_body() {
    for layout in [SnowflakeLayout::TrtllmV1, SnowflakeLayout::TrtllmV2] {
        let wall = Arc::new(AtomicU64::new(START_MILLIS));
        let plugin = plugin_with(layout, MACHINE, FallingClock(wall.clone()));
        let ids = ids_in(&common::stamp(&plugin, batch_body(5000)));
        assert_eq!(ids.len(), 5000, "{layout:?}");
        assert!(
            wall.load(Ordering::SeqCst) < START_MILLIS - 1000,
            "{layout:?}: the clock was read at most {} times",
            START_MILLIS - wall.load(Ordering::SeqCst)
        );
        let space = u64::from(layout.sequence_space());
        for (n, &id) in ids.iter().enumerate() {
            // From the first reading, a millisecond per sequence space:
            // never back to the earlier readings.
            let n = n as u64;
            let (millis, sequence) = (START_MILLIS + n / space, (n % space) as u32);
            assert_eq!(
                Ok(id),
                layout.compose(millis, MACHINE, sequence),
                "{layout:?}: id {n} is not ({millis}, {sequence})"
            );
        }
    }
}
