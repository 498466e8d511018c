//! A fleet lease can withdraw the machine id: then the plugin must make no
//! ids and refuse context-only requests with 503, naming the reason, while
//! requests that need no id pass; once a new machine id is assigned,
//! stamping resumes with it. A leased id is also bounded by the host
//! itself, whatever the plugin does: past the lease's deadline, or for ids
//! past the slot's high-water mark, the request is refused the same way.

mod common;

use std::time::Duration;

use common::{
    clock_of, fixed_plugin, identity_of, json_request, reject, rejection_in, START_MILLIS,
};
use snowgate_host::boot_clock::BootTime;
use snowgate_host::identity::LeaseBounds;
use snowgate_host::{Action, Plugin};
use snowgate_plugin::SnowflakeLayout;

#[test]
fn a_withdrawn_machine_id_gets_503_until_a_new_one_is_assigned() {
    let layout = SnowflakeLayout::TrtllmV2;
    let plugin = fixed_plugin(layout, 7, START_MILLIS);
    let machine_of = |out: &[u8]| {
        let ids = common::ids_in(out);
        assert_eq!(ids.len(), 1);
        layout.decode(ids[0]).expect("decodes")
    };

    let before = machine_of(&common::stamp(&plugin, common::CONTEXT_ONLY));
    assert_eq!(before.machine_id, 7);

    identity_of(&plugin).withdraw("the fleet lease for machine id 7 expired");

    let rejection = reject(&plugin, &json_request(common::CONTEXT_ONLY));
    assert_eq!(rejection.status, 503, "{rejection:?}");
    assert!(
        rejection
            .message
            .contains("the fleet lease for machine id 7 expired"),
        "the message does not name the reason: {:?}",
        rejection.message
    );
    // Requests that need no id still pass, unchanged.
    for body in [
        &br#"{"model":"m","prompt":"Hello"}"#[..],
        br#"{"disaggregated_params":{"request_type":"generation_only","disagg_request_id":1099511628800}}"#,
    ] {
        let answer = plugin.handle(&json_request(body));
        assert!(
            matches!(answer, Ok(Action::Forward)),
            "{}",
            common::describe(&answer)
        );
    }
    // A body that needs an id among several is refused whole: no partial
    // stamping without a machine id.
    let rejection = reject(&plugin, &json_request(common::batch_body(3)));
    assert_eq!(rejection.status, 503);

    identity_of(&plugin)
        .assign(12_345)
        .expect("in range for trtllm-v2");
    let after = machine_of(&common::stamp(&plugin, common::CONTEXT_ONLY));
    assert_eq!(after.machine_id, 12_345);
    assert!(
        (after.millis, after.sequence) > (before.millis, before.sequence),
        "{before:?} then {after:?}"
    );
}

/// A leased machine id 9 whose lease is alive for `alive_for` and whose
/// high-water mark is `ceiling`.
fn lease(plugin: &Plugin, alive_for: Duration, ceiling: u64) {
    identity_of(plugin)
        .assign_leased(
            9,
            LeaseBounds {
                alive_until: BootTime::now().after(alive_for),
                ceiling_millis: ceiling,
                raise_from_millis: ceiling,
            },
        )
        .expect("in range");
}

/// The ids of `body` through `plugin`, each checked to be machine id 9's.
fn stamped_by_9(plugin: &Plugin, body: impl Into<Vec<u8>>) -> Vec<u64> {
    let ids = common::ids_in(&common::stamp(plugin, body));
    for id in &ids {
        let parts = SnowflakeLayout::TrtllmV1.decode(*id).expect("decodes");
        assert_eq!(parts.machine_id, 9, "id {id}");
    }
    ids
}

#[test]
fn a_leased_machine_id_is_refused_past_its_deadline_even_before_it_is_withdrawn() {
    let plugin = fixed_plugin(SnowflakeLayout::TrtllmV1, 7, START_MILLIS);
    lease(&plugin, Duration::ZERO, u64::MAX);
    let rejection = reject(&plugin, &json_request(common::CONTEXT_ONLY));
    assert_eq!(rejection.status, 503, "{rejection:?}");
    assert!(
        rejection.message.contains("lease may have expired"),
        "{rejection:?}"
    );
    identity_of(&plugin).lease_renewed(BootTime::now().after(Duration::from_secs(60)));
    assert_eq!(stamped_by_9(&plugin, common::CONTEXT_ONLY).len(), 1);
}

#[test]
fn ids_past_the_slots_high_water_mark_never_leave_the_host() {
    // The clock reads START_MILLIS: 4096 ids fit in that millisecond, the
    // next ones are in START_MILLIS + 1.
    let plugin = fixed_plugin(SnowflakeLayout::TrtllmV1, 7, START_MILLIS);
    lease(&plugin, Duration::from_secs(60), START_MILLIS);
    assert_eq!(stamped_by_9(&plugin, common::batch_body(4000)).len(), 4000);
    // This batch crosses into START_MILLIS + 1, past the mark: refused
    // whole, although the plugin stamped it.
    let rejection = reject(&plugin, &json_request(common::batch_body(200)));
    assert_eq!(rejection.status, 503, "{rejection:?}");
    assert!(
        rejection
            .message
            .contains(&format!("past the slot's high-water mark {START_MILLIS}")),
        "{rejection:?}"
    );
    // Requests that need no id still pass.
    let answer = plugin.handle(&json_request(&br#"{"prompt":"Hello"}"#[..]));
    assert!(
        matches!(answer, Ok(Action::Forward)),
        "{}",
        common::describe(&answer)
    );
    // Once the keeper raises the mark, stamping resumes after the ids
    // that were withheld (they are never handed out again).
    identity_of(&plugin).ceiling_raised(START_MILLIS + 10, START_MILLIS + 5);
    let ids = stamped_by_9(&plugin, common::batch_body(10));
    let first = SnowflakeLayout::TrtllmV1.decode(ids[0]).expect("decodes");
    assert_eq!(first.millis, START_MILLIS + 1);
    assert_eq!(first.sequence, 4200 - 4096, "{first:?}");
}

#[test]
fn the_gateways_async_calls_are_bounded_the_same_way() {
    let plugin = fixed_plugin(SnowflakeLayout::TrtllmV1, 7, START_MILLIS);
    lease(&plugin, Duration::from_secs(60), START_MILLIS - 1);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let answer = runtime.block_on(plugin.handle_async(&json_request(common::CONTEXT_ONLY)));
    let rejection = rejection_in(answer);
    assert_eq!(rejection.status, 503, "{rejection:?}");
    assert_eq!(rejection.code, "no_machine_id");
    identity_of(&plugin).ceiling_raised(START_MILLIS + 10, START_MILLIS + 5);
    let answer = runtime.block_on(plugin.handle_async(&json_request(common::CONTEXT_ONLY)));
    assert!(
        matches!(answer, Ok(Action::ForwardWithBody(_))),
        "{}",
        common::describe(&answer)
    );
}

/// The machine ids of the ids in a stamped answer.
fn machine_ids(answer: &Result<Action, snowgate_host::CallError>) -> Vec<u32> {
    let Ok(Action::ForwardWithBody(body)) = answer else {
        panic!("expected a stamped body, got {}", common::describe(answer));
    };
    common::ids_in(body)
        .into_iter()
        .map(|id| {
            SnowflakeLayout::TrtllmV1
                .decode(id)
                .expect("decodes")
                .machine_id
        })
        .collect()
}

/// The gateway's calls reuse instances, and the bundled plugin keeps the
/// machine id an instance was given. Every change of the machine id still
/// reaches the next request, and a lease that stops covering the ids while
/// an instance keeps its id gets those ids withheld.
#[test]
fn a_reused_instance_stamps_only_with_the_machine_id_held_now() {
    let plugin = fixed_plugin(SnowflakeLayout::TrtllmV1, 7, START_MILLIS);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let call = |body: &str| runtime.block_on(plugin.handle_async(&json_request(body)));

    for _ in 0..3 {
        assert_eq!(machine_ids(&call(common::CONTEXT_ONLY)), [7]);
    }
    identity_of(&plugin).assign(8).expect("in range");
    for _ in 0..3 {
        assert_eq!(machine_ids(&call(common::CONTEXT_ONLY)), [8]);
    }
    identity_of(&plugin).withdraw("the fleet lease for machine id 8 expired");
    let rejection = rejection_in(call(common::CONTEXT_ONLY));
    assert_eq!(rejection.status, 503, "{rejection:?}");
    assert!(
        rejection
            .message
            .contains("the fleet lease for machine id 8 expired"),
        "{rejection:?}"
    );

    // Leased 9, with ids allowed up to START_MILLIS: the instance that
    // stamps keeps 9, and then the clock passes the mark with no new
    // grant.
    lease(&plugin, Duration::from_secs(60), START_MILLIS);
    for _ in 0..3 {
        assert_eq!(machine_ids(&call(common::CONTEXT_ONLY)), [9]);
    }
    clock_of(&plugin).advance_past(START_MILLIS);
    let rejection = rejection_in(call(common::CONTEXT_ONLY));
    assert_eq!(rejection.status, 503, "{rejection:?}");
    assert_eq!(rejection.code, "no_machine_id");
    assert!(
        rejection
            .message
            .contains("past the slot's high-water mark"),
        "{rejection:?}"
    );
    identity_of(&plugin).ceiling_raised(START_MILLIS + 10, START_MILLIS + 5);
    assert_eq!(machine_ids(&call(common::CONTEXT_ONLY)), [9]);
}
