//! Helpers shared by the suite's test files: the real plugin
//! ([`snowgate_plugin_bundle::PLUGIN_WASM`]) loaded into the real host, with
//! a chosen layout, machine id, wall clock and limits.
//!
//! Each test file compiles this module on its own and uses only part of it.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde_json::Value;
use snowgate_host::{
    Action, FixedClock, HostServices, IdClock, MachineIdentity, Plugin, PluginEngine, PluginLimits,
    Rejection, Request, WallClock,
};
use snowgate_plugin::SnowflakeLayout;

/// 2025-11-24T16:00:00Z in milliseconds since the Unix epoch.
pub const START_MILLIS: u64 = 1_764_000_000_000;

/// The smallest body that needs an id.
pub const CONTEXT_ONLY: &str = r#"{"disaggregated_params":{"request_type":"context_only"}}"#;

/// A wall clock a test moves by hand; clones share the reading.
#[derive(Clone, Debug)]
pub struct HandClock(pub Arc<AtomicU64>);

impl HandClock {
    /// A clock that reads `millis` until moved.
    pub fn at(millis: u64) -> HandClock {
        HandClock(Arc::new(AtomicU64::new(millis)))
    }

    /// Makes the clock read `millis` (forwards or backwards).
    pub fn set(&self, millis: u64) {
        self.0.store(millis, Ordering::SeqCst);
    }

    /// What the clock reads now.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

impl WallClock for HandClock {
    fn now_millis(&self) -> u64 {
        self.get()
    }
}

/// A plugin engine whose id clock reads `wall` and whose machine id is
/// `machine_id` in `layout`.
pub fn engine_with(
    layout: SnowflakeLayout,
    machine_id: u32,
    wall: impl WallClock + 'static,
    limits: PluginLimits,
) -> PluginEngine {
    let services = HostServices {
        clock: Arc::new(IdClock::new(wall)),
        identity: Arc::new(
            MachineIdentity::fixed(layout, machine_id).expect("test machine id is in range"),
        ),
    };
    PluginEngine::new(services, limits).expect("creating the plugin engine")
}

/// The bundled plugin, loaded into `engine` with no extra settings.
pub fn load_bundled(engine: &PluginEngine) -> Plugin {
    Plugin::load(engine, snowgate_plugin_bundle::PLUGIN_WASM, &[])
        .unwrap_or_else(|e| panic!("loading the bundled plugin: {e:#}"))
}

/// The bundled plugin in a fresh engine: `layout`, `machine_id`, `wall`,
/// default limits.
pub fn plugin_with(
    layout: SnowflakeLayout,
    machine_id: u32,
    wall: impl WallClock + 'static,
) -> Plugin {
    load_bundled(&engine_with(
        layout,
        machine_id,
        wall,
        PluginLimits::default(),
    ))
}

/// The bundled plugin in a fresh engine whose clock always reads `millis`.
pub fn fixed_plugin(layout: SnowflakeLayout, machine_id: u32, millis: u64) -> Plugin {
    plugin_with(layout, machine_id, FixedClock(millis))
}

/// The id clock a plugin's engine shares with every plugin in it.
pub fn clock_of(plugin: &Plugin) -> &IdClock {
    &plugin.engine().services().clock
}

/// The machine identity a plugin's engine shares with every plugin in it.
pub fn identity_of(plugin: &Plugin) -> &MachineIdentity {
    &plugin.engine().services().identity
}

/// A JSON `POST /v1/completions` carrying `body`.
pub fn json_request(body: impl Into<Vec<u8>>) -> Request {
    Request {
        method: "POST".into(),
        path: "/v1/completions".into(),
        headers: vec![("content-type".into(), b"application/json".to_vec())].into(),
        body: body.into(),
    }
}

/// `request` with the header `name: value` added after the others.
pub fn with_header(mut request: Request, name: &str, value: &[u8]) -> Request {
    let mut headers = request.headers.to_vec();
    headers.push((name.to_string(), value.to_vec()));
    request.headers = headers.into();
    request
}

/// Runs `body` through `plugin` and returns the stamped body; panics on any
/// other answer.
pub fn stamp(plugin: &Plugin, body: impl Into<Vec<u8>>) -> Vec<u8> {
    match plugin.handle(&json_request(body)) {
        Ok(Action::ForwardWithBody(out)) => out,
        other => panic!("expected a stamped body, got {}", describe(&other)),
    }
}

/// Runs `request` through `plugin` and returns the rejection; panics on
/// any other answer.
pub fn reject(plugin: &Plugin, request: &Request) -> Rejection {
    rejection_in(plugin.handle(request))
}

/// The rejection `answer` holds; panics on any other answer.
pub fn rejection_in(answer: Result<Action, snowgate_host::CallError>) -> Rejection {
    match answer {
        Ok(Action::Reject(rejection)) => rejection,
        other => panic!("expected a rejection, got {}", describe(&other)),
    }
}

/// A short description of an answer, for assertion messages (bodies can be
/// megabytes long, so only their length and start are shown).
pub fn describe(answer: &Result<Action, snowgate_host::CallError>) -> String {
    match answer {
        Ok(Action::Forward) => "Forward".to_string(),
        Ok(Action::ForwardWithBody(body)) => format!(
            "ForwardWithBody({} bytes: {:?}...)",
            body.len(),
            String::from_utf8_lossy(&body[..body.len().min(200)])
        ),
        Ok(Action::Reject(r)) => format!("Reject({} {}: {})", r.status, r.code, r.message),
        Err(e) => format!("Err({e:?})"),
    }
}

/// The `disaggregated_params.disagg_request_id` of a request object, or of
/// each request object in a top-level array, in body order.
pub fn ids_in(body: &[u8]) -> Vec<u64> {
    let value: Value = serde_json::from_slice(body).expect("the stamped body is JSON");
    let mut ids = Vec::new();
    collect_ids(&value, &mut ids);
    ids
}

fn collect_ids(value: &Value, ids: &mut Vec<u64>) {
    match value {
        Value::Array(items) => items.iter().for_each(|item| collect_ids(item, ids)),
        Value::Object(members) => {
            if let Some(id) = members
                .get("disaggregated_params")
                .and_then(|p| p.get("disagg_request_id"))
            {
                ids.push(id.as_u64().unwrap_or_else(|| panic!("id {id} is a u64")));
            }
        }
        _ => {}
    }
}

/// A top-level array of `n` context-only requests, each with its own prompt.
pub fn batch_body(n: usize) -> String {
    let items: Vec<String> = (0..n).map(batch_item).collect();
    format!("[{}]", items.join(","))
}

/// Item `i` of [`batch_body`], with the id it got (or none yet).
fn batch_item_with(i: usize, id: Option<u64>) -> String {
    let id = id.map_or(String::new(), |id| format!(r#","disagg_request_id":{id}"#));
    format!(r#"{{"prompt":"p{i}","disaggregated_params":{{"request_type":"context_only"{id}}}}}"#)
}

fn batch_item(i: usize) -> String {
    batch_item_with(i, None)
}

/// What [`batch_body`] must become once item `i` got `ids[i]`.
pub fn stamped_batch_body(ids: &[u64]) -> String {
    let items: Vec<String> = ids
        .iter()
        .enumerate()
        .map(|(i, &id)| batch_item_with(i, Some(id)))
        .collect();
    format!("[{}]", items.join(","))
}

/// Matches `output` against `template`, in which each `{ID}` stands for one
/// decimal id and every other byte must be equal; returns the ids.
pub fn match_template(template: &str, output: &[u8]) -> Vec<u64> {
    let out = String::from_utf8(output.to_vec()).expect("the output is UTF-8");
    let mut parts = template.split("{ID}");
    let first = parts.next().unwrap_or_default();
    let mismatch =
        || format!("output does not match the template\n template: {template}\n output:   {out}");
    let mut rest = out
        .strip_prefix(first)
        .unwrap_or_else(|| panic!("{}", mismatch()));
    let mut ids = Vec::new();
    for part in parts {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        assert!(digits > 0, "{}", mismatch());
        ids.push(rest[..digits].parse().expect("the id is a u64"));
        rest = rest[digits..]
            .strip_prefix(part)
            .unwrap_or_else(|| panic!("{}", mismatch()));
    }
    assert!(rest.is_empty(), "{}", mismatch());
    ids
}
