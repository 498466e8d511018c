//! Ids never repeat across calls, across threads calling the same plugin at
//! once, and across a plugin swap (a second plugin loaded from the same bytes
//! into the same engine while calls are running): the counter lives in the
//! host, not in a plugin instance. Half the threads call as the gateway
//! does (`handle_async`, instances reused across calls), half with a fresh
//! instance per call (`handle`), in both layouts.

mod common;

use std::collections::HashSet;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, RwLock};
use std::thread;
use std::time::Duration;

use common::{
    batch_body, describe, fixed_plugin, ids_in, json_request, load_bundled, START_MILLIS,
};
use snowgate_host::{Action, Plugin};
use snowgate_plugin::SnowflakeLayout;

const WORKERS: usize = 4;
/// Context-only requests per call.
const PER_CALL: usize = 8;
/// Calls each worker must have made on each plugin before moving on.
const CALLS_PER_PHASE: usize = 25;
const MACHINE: u32 = 5;

/// What a worker made in one call.
struct Report {
    worker: usize,
    generation: usize,
    ids: Vec<u64>,
}

/// The longest the main thread waits for the workers' next report: far
/// more than any call takes, so only a worker stuck for good runs it out.
const REPORT_WAIT: Duration = Duration::from_secs(120);

/// One call on `plugin`, with a fresh instance, or, with `runtime`, on the
/// gateway's path, where an instance serves many calls: the ids it stamped,
/// or why it failed (a worker reports a failure instead of panicking, so
/// the main thread, which waits for the workers' progress, is never left
/// waiting for a dead worker).
fn call(
    plugin: &Plugin,
    body: &str,
    runtime: Option<&tokio::runtime::Runtime>,
) -> Result<Vec<u64>, String> {
    let call = AssertUnwindSafe(|| match runtime {
        None => ids_in(&common::stamp(plugin, body.as_bytes())),
        Some(runtime) => {
            let request = json_request(body.as_bytes());
            match runtime.block_on(plugin.handle_async(&request)) {
                Ok(Action::ForwardWithBody(out)) => ids_in(&out),
                other => panic!("expected a stamped body, got {}", describe(&other)),
            }
        }
    });
    std::panic::catch_unwind(call).map_err(|panic| {
        panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a call panicked".to_string())
    })
}

#[test]
fn v1_ids_stay_unique_across_calls_threads_instances_and_a_plugin_swap() {
    ids_stay_unique(SnowflakeLayout::TrtllmV1);
}

#[test]
fn v2_ids_stay_unique_across_calls_threads_instances_and_a_plugin_swap() {
    ids_stay_unique(SnowflakeLayout::TrtllmV2);
}

fn ids_stay_unique(layout: SnowflakeLayout) {
    // A clock stuck in one millisecond: uniqueness then rests entirely on
    // the host's sequence, which a per-instance or per-plugin counter would
    // break at once.
    let first = fixed_plugin(layout, MACHINE, START_MILLIS);
    let engine = first.engine().clone();
    // The plugin the workers use now, and its generation (0, then 1).
    let current: Arc<RwLock<(usize, Arc<Plugin>)>> = Arc::new(RwLock::new((0, Arc::new(first))));
    let stop = Arc::new(AtomicBool::new(false));
    let (reports, progress) = mpsc::channel::<Result<Report, String>>();

    let workers: Vec<_> = (0..WORKERS)
        .map(|worker| {
            let current = current.clone();
            let stop = stop.clone();
            let reports = reports.clone();
            thread::spawn(move || {
                let body = batch_body(PER_CALL);
                // Odd workers call as the gateway does.
                let runtime = (worker % 2 == 1).then(|| {
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("a runtime")
                });
                while !stop.load(Ordering::SeqCst) {
                    let (generation, plugin) = {
                        let guard = current.read().unwrap_or_else(|p| p.into_inner());
                        (guard.0, guard.1.clone())
                    };
                    let report = call(&plugin, &body, runtime.as_ref()).map(|ids| Report {
                        worker,
                        generation,
                        ids,
                    });
                    let failed = report.is_err();
                    if reports.send(report).is_err() || failed {
                        break;
                    }
                }
            })
        })
        .collect();
    drop(reports);

    let mut all: Vec<Report> = Vec::new();
    // Waits (on the channel, not on time) until every worker has made
    // `CALLS_PER_PHASE` calls on the plugin of `generation`.
    let wait_for = |generation: usize, all: &mut Vec<Report>| {
        let mut calls = [0usize; WORKERS];
        for report in all.iter().filter(|r| r.generation == generation) {
            calls[report.worker] += 1;
        }
        while calls.iter().any(|&c| c < CALLS_PER_PHASE) {
            let report = match progress.recv_timeout(REPORT_WAIT) {
                Ok(Ok(report)) => report,
                Ok(Err(failure)) => {
                    stop.store(true, Ordering::SeqCst);
                    panic!("a call failed: {failure}");
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => panic!("every worker stopped early"),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    stop.store(true, Ordering::SeqCst);
                    panic!("no worker reported for {REPORT_WAIT:?}: {calls:?} calls so far");
                }
            };
            if report.generation == generation {
                calls[report.worker] += 1;
            }
            all.push(report);
        }
    };

    wait_for(0, &mut all);
    // The swap: load the same bytes again into the same engine while the
    // workers keep calling the first plugin, then hand them the second.
    let second = load_bundled(&engine);
    *current.write().unwrap_or_else(|p| p.into_inner()) = (1, Arc::new(second));
    wait_for(1, &mut all);
    stop.store(true, Ordering::SeqCst);
    for worker in workers {
        worker.join().expect("worker thread panicked");
    }
    for report in progress.iter() {
        all.push(report.unwrap_or_else(|failure| panic!("a call failed: {failure}")));
    }

    let mut seen = HashSet::new();
    for report in &all {
        assert_eq!(report.ids.len(), PER_CALL);
        for &id in &report.ids {
            assert!(seen.insert(id), "id {id} was issued twice");
            let parts = layout.decode(id).expect("decodes");
            assert_eq!(parts.machine_id, MACHINE);
        }
    }
    // Each worker's ids strictly increase over its calls, across the swap.
    for worker in 0..WORKERS {
        let ids: Vec<u64> = all
            .iter()
            .filter(|r| r.worker == worker)
            .flat_map(|r| r.ids.iter().copied())
            .collect();
        assert!(
            ids.windows(2).all(|w| w[0] < w[1]),
            "worker {worker}'s ids do not strictly increase"
        );
        assert!(all.iter().any(|r| r.worker == worker && r.generation == 1));
    }
    assert_eq!(seen.len(), all.len() * PER_CALL);
}
