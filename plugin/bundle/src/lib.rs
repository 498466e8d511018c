//! The snowgate plugin, built for `wasm32-wasip2` by this crate's build
//! script, as bytes to embed: the plugin a `snowgate` binary runs when no
//! `--plugin` is given, and the one the workspace tests run.
//!
//! Building this crate also leaves the component at
//! `target/wasm32-wasip2/release/snowgate_plugin.wasm`.

// Every public item is documented: the docs are the API.
#![deny(missing_docs)]

/// The bundled plugin component (a WebAssembly component binary).
pub static PLUGIN_WASM: &[u8] = include_bytes!(env!("SNOWGATE_PLUGIN_WASM"));

/// The file name the component is left under in the target directory.
pub const PLUGIN_FILE_NAME: &str = "snowgate_plugin.wasm";

#[cfg(test)]
mod tests {
    #[test]
    fn is_a_webassembly_component() {
        // Magic, then the component-model layer marker (version 0xd, layer 1).
        assert_eq!(&super::PLUGIN_WASM[..8], b"\0asm\x0d\x00\x01\x00");
    }
}
