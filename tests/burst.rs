//! A burst: one body with 10,000 context-only requests (a top-level array)
//! on a clock stuck in one millisecond. Each request gets its own id; once a
//! millisecond's sequence space is used up, ids move on to the next
//! millisecond instead of wrapping (TensorRT-LLM's own counter wraps and
//! repeats ids).

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use common::{
    batch_body, fixed_plugin, ids_in, json_request, load_bundled, reject, stamped_batch_body,
    HandClock, START_MILLIS,
};
use snowgate_host::{HostServices, IdClock, MachineIdentity, PluginEngine, PluginLimits};
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

/// Ids asked for faster than the layout makes them run the id clock ahead
/// of the wall clock; past its bound (`MAX_LEAD`, 9 s for the system clock:
/// what a stopping gateway can wait out before the next process on its
/// machine id starts) the host refuses the request with 503 rather than let
/// the lead grow. Here with a 2 ms bound and a wall clock that stands still.
#[test]
fn ids_past_the_clock_s_lead_are_refused_until_the_wall_clock_moves_on() {
    let wall = HandClock::at(START_MILLIS);
    let services = HostServices {
        clock: Arc::new(IdClock::new(wall.clone()).with_max_lead(Duration::from_millis(2))),
        identity: Arc::new(MachineIdentity::fixed(SnowflakeLayout::TrtllmV2, 5).unwrap()),
    };
    let engine = PluginEngine::new(services, PluginLimits::default()).unwrap();
    let plugin = load_bundled(&engine);
    let space = SnowflakeLayout::TrtllmV2.sequence_space() as usize;

    // Two milliseconds' worth (START_MILLIS and the next) go through.
    let first = ids_in(&common::stamp(&plugin, batch_body(2 * space)));
    assert_eq!(first.len(), 2 * space);
    // Two more would need two milliseconds past the bound: refused whole.
    let refused = reject(&plugin, &json_request(batch_body(2 * space)));
    assert_eq!(refused.status, 503, "{refused:?}");
    assert_eq!(refused.code, "id_rate_exceeded", "{refused:?}");
    assert!(
        refused
            .message
            .contains("faster than the id layout can make them"),
        "{refused:?}"
    );
    // The refused request took ticks before it was refused (its ids were
    // withheld), in the millisecond past the first two.
    let taken_by_refused = common::clock_of(&plugin).last_tick().expect("ticks taken");
    assert_eq!(
        taken_by_refused.millis,
        START_MILLIS + 2,
        "{taken_by_refused:?}"
    );
    // Once the wall clock has moved on into that millisecond, ids come
    // again, after every tick taken before, the refused request's too: its
    // ticks are never given out.
    wall.set(START_MILLIS + 2);
    let later = ids_in(&common::stamp(&plugin, batch_body(3)));
    let layout = SnowflakeLayout::TrtllmV2;
    let (millis, sequence) = match taken_by_refused.sequence + 1 {
        next if (next as usize) < space => (taken_by_refused.millis, next),
        _ => (taken_by_refused.millis + 1, 0),
    };
    assert_eq!(
        Ok(later[0]),
        layout.compose(millis, 5, sequence),
        "the first id after the refusal, after {taken_by_refused:?}"
    );
    let last_before = layout.decode(*first.last().unwrap()).unwrap();
    assert_eq!(
        (last_before.millis, last_before.sequence),
        ((START_MILLIS + 1) & ((1 << 39) - 1), space as u32 - 1)
    );
}
