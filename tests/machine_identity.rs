//! A fleet lease can withdraw the machine id: then the plugin must make no
//! ids and refuse context-only requests with 503, naming the reason, while
//! requests that need no id pass; once a new machine id is assigned,
//! stamping resumes with it.

mod common;

use common::{fixed_plugin, identity_of, json_request, reject, START_MILLIS};
use snowgate_host::Action;
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
