//! Loading a plugin that is not one: the error says what is wrong, in the
//! `{:#}` form a gateway logs.
//!
//! Without component tooling in the suite (no `wasm-tools`, no `wat` or
//! `wasm-encoder` dependency), the components that do not implement the
//! world are made from bytes: the empty component (a valid component with
//! no imports and no exports), and copies of the real plugin with one
//! interface name renamed in place. A renamed name keeps its length, so
//! every length prefix stays right and the copy is still a valid component,
//! just one that exports or imports another interface version.

mod common;

use common::{engine_with, START_MILLIS};
use snowgate_host::{FixedClock, Plugin, PluginEngine, PluginLimits, LAYOUT_SETTING};
use snowgate_plugin::SnowflakeLayout;
use snowgate_plugin_bundle::PLUGIN_WASM;

fn engine() -> PluginEngine {
    engine_with(
        SnowflakeLayout::TrtllmV1,
        1,
        FixedClock(START_MILLIS),
        PluginLimits::default(),
    )
}

/// Loads `bytes` and returns the `{:#}` message of the error it must give.
fn load_error(bytes: &[u8]) -> String {
    match Plugin::load(&engine(), bytes, &[]) {
        Ok(plugin) => panic!("loaded {:?} from bad bytes", plugin.info()),
        Err(e) => format!("{e:#}"),
    }
}

fn assert_mentions(message: &str, words: &[&str]) {
    for word in words {
        assert!(
            message.contains(word),
            "the message does not mention {word:?}: {message}"
        );
    }
}

/// `PLUGIN_WASM` with every occurrence of `from` replaced by `to` (of the
/// same length); panics when `from` does not occur.
fn renamed(from: &str, to: &str) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let mut bytes = PLUGIN_WASM.to_vec();
    let mut count = 0;
    let mut at = 0;
    while let Some(found) = bytes[at..]
        .windows(from.len())
        .position(|w| w == from.as_bytes())
    {
        let start = at + found;
        bytes[start..start + to.len()].copy_from_slice(to.as_bytes());
        at = start + to.len();
        count += 1;
    }
    assert!(count > 0, "{from:?} does not occur in the plugin");
    bytes
}

#[test]
fn garbage_bytes_are_refused_as_not_a_component() {
    let message = load_error(b"this is not WebAssembly at all");
    assert_eq!(
        message,
        "the plugin is not a valid WebAssembly component for this host: no WebAssembly magic \
         header (\\0asm): the file starts with 74 68 69 73 20 69 73 20 (\"this is \")"
    );
    let message = load_error(b"");
    assert_eq!(
        message,
        "the plugin is not a valid WebAssembly component for this host: the file is empty"
    );
}

#[test]
fn a_truncated_plugin_is_refused_as_not_a_component() {
    for len in [9, PLUGIN_WASM.len() / 2, PLUGIN_WASM.len() - 1] {
        let message = load_error(&PLUGIN_WASM[..len]);
        assert_mentions(&message, &["not a valid WebAssembly component"]);
    }
}

#[test]
fn a_core_module_is_refused_as_not_a_component() {
    // The smallest valid core WebAssembly module: magic and version 1.
    let message = load_error(b"\0asm\x01\0\0\0");
    assert_mentions(
        &message,
        &[
            "not a valid WebAssembly component",
            "a core WebAssembly module, not a component",
            "wasm32-wasip2",
        ],
    );
    assert!(!message.contains('\n'), "one line: {message}");
}

#[test]
fn an_empty_component_is_refused_for_not_exporting_the_handler() {
    // Magic, then the component-model layer marker: a valid component with
    // nothing in it.
    let message = load_error(b"\0asm\x0d\0\x01\0");
    assert_mentions(
        &message,
        &["does not export", "snowgate:middleware/handler@0.2.1"],
    );
}

#[test]
fn a_component_exporting_another_handler_version_is_refused_naming_both_versions() {
    let bytes = renamed(
        "snowgate:middleware/handler@0.2.1",
        "snowgate:middleware/handler@9.9.9",
    );
    let message = load_error(&bytes);
    assert_eq!(
        message,
        "the plugin was built for snowgate:middleware@9.9.9 (it exports \
         `snowgate:middleware/handler@9.9.9`), but this host implements \
         snowgate:middleware@0.2.1 (and loads plugins built for 0.2.0 and 0.2.1): rebuild it \
         against this snowgate's wit/middleware.wit"
    );
}

/// A plugin built for the contract before this one (0.1.0, whose request
/// record carried the headers) imports its interfaces at that version: the
/// message names it, rather than an import the host lacks.
#[test]
fn a_component_importing_the_previous_contract_version_is_refused_naming_both_versions() {
    let bytes = renamed(
        "snowgate:middleware/clock@0.2.1",
        "snowgate:middleware/clock@0.1.0",
    );
    let message = load_error(&bytes);
    assert_eq!(
        message,
        "the plugin was built for snowgate:middleware@0.1.0 (it imports \
         `snowgate:middleware/clock@0.1.0`), but this host implements \
         snowgate:middleware@0.2.1 (and loads plugins built for 0.2.0 and 0.2.1): rebuild it \
         against this snowgate's wit/middleware.wit"
    );
}

#[test]
fn a_component_importing_an_interface_the_host_lacks_is_refused() {
    let bytes = renamed(
        "snowgate:middleware/clock@0.2.1",
        "snowgate:middleware/clack@0.2.1",
    );
    let message = load_error(&bytes);
    assert!(
        !message.contains("not a valid WebAssembly component"),
        "the renamed copy should still be a valid component: {message}"
    );
    assert_mentions(
        &message,
        &[
            "imports something the host does not provide",
            "snowgate:middleware/clack@0.2.1",
        ],
    );
}

/// A plugin whose memory starts above the memory limit is refused naming
/// the limit and the flag that raises it, not as an invalid component.
#[test]
fn a_plugin_that_starts_above_the_memory_limit_is_refused_naming_the_limit() {
    let engine = engine_with(
        SnowflakeLayout::TrtllmV1,
        1,
        FixedClock(START_MILLIS),
        PluginLimits {
            memory_bytes: 256 << 10,
            ..PluginLimits::default()
        },
    );
    let message = match Plugin::load(&engine, PLUGIN_WASM, &[]) {
        Ok(plugin) => panic!("loaded {:?} under a 256 KiB limit", plugin.info()),
        Err(e) => format!("{e:#}"),
    };
    assert_mentions(
        &message,
        &[
            "memory starts larger than",
            "plugin memory limit",
            "--plugin-memory-mib",
        ],
    );
    assert!(!message.contains("not a valid"), "{message}");
}

/// A plugin that panics in `configure`, or spins there past the deadline,
/// is refused at load with the panic's text or the deadline, in one line,
/// as a request's call would be: not wasmtime's multi-line backtrace.
#[test]
fn a_plugin_failing_in_configure_is_refused_naming_the_panic_or_the_deadline() {
    let limits = PluginLimits {
        deadline: std::time::Duration::from_millis(300),
        ..PluginLimits::default()
    };
    let engine = engine_with(
        SnowflakeLayout::TrtllmV1,
        1,
        FixedClock(START_MILLIS),
        limits,
    );
    let refusal = |behaviour: &str| {
        let settings = [("hostile-configure".to_string(), behaviour.to_string())];
        match Plugin::load(&engine, snowgate_test_fixtures::HOSTILE_WASM, &settings) {
            Ok(_) => panic!("hostile-configure={behaviour} was loaded"),
            Err(e) => format!("{e:#}"),
        }
    };

    let panicked = refusal("panic");
    assert_mentions(
        &panicked,
        &[
            "calling the plugin's configure export",
            "the plugin trapped",
            "deliberate panic in the hostile fixture's configure",
        ],
    );
    let spun = refusal("loop");
    assert_mentions(
        &spun,
        &[
            "calling the plugin's configure export",
            "its 300 ms deadline",
        ],
    );
    for message in [&panicked, &spun] {
        assert!(!message.contains('\n'), "more than one line: {message}");
        assert!(!message.contains("wasm function"), "a backtrace: {message}");
    }
}

/// A caller's `id-layout` setting is refused, even one naming the engine's
/// own layout: the host hands the plugin its layout first, and a setting
/// after it would configure the plugin for a layout the machine id is not
/// checked against.
#[test]
fn a_caller_cannot_set_the_plugins_id_layout() {
    let engine = engine();
    for value in ["trtllm-v1", "trtllm-v2"] {
        let settings = [(LAYOUT_SETTING.to_string(), value.to_string())];
        let error = match Plugin::load(&engine, PLUGIN_WASM, &settings) {
            Ok(_) => panic!("id-layout={value} was taken"),
            Err(e) => format!("{e:#}"),
        };
        assert_mentions(
            &error,
            &["the plugin setting id-layout is the host's own", "--layout"],
        );
    }
}
