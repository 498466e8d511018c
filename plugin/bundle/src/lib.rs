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

/// How much linear memory the bundled plugin needs to stamp a body of
/// `body_bytes`: the body, its stamped copy, and the walk's lists, which
/// grow with the number of ids. Measured by `bench/plugin_memory.py`
/// (the least `snowgate rewrite --plugin-memory-mib` that stamps a 32 MiB
/// body): one id in a long string, 66 MiB (2.06 times); JSON that is
/// nothing but context-only params maps (an id every 58 bytes), 101 MiB
/// (3.16 times); MessagePack of the same (an id every 49 bytes), 101 MiB
/// (3.16 times); and the most, maps of distinct short keys each over such
/// params, which the walk holds until their map ends in case a later
/// duplicate overrides them: MessagePack with uint 32 keys (an id every 54
/// bytes), 119 MiB (3.72 times), and up to 3.9 times at sizes where the
/// walk's list of edits has just doubled (105 MiB for 27 MiB of 2^19 + 1
/// keys); JSON with keys of a few digits, 115 MiB (3.59 times). The
/// workspace test `limits` stamps each kind in the memory this gives, and
/// checks that the keyed MessagePack does not fit in 85 % of it.
pub fn memory_needed(body_bytes: u64, ids: IdDensity) -> u64 {
    let tenths = match ids {
        IdDensity::Few => 21,
        IdDensity::Densest => 42,
    };
    body_bytes.saturating_mul(tenths) / 10 + MEMORY_BASE
}

/// What an instance takes before a body: its stack, data and first
/// allocations.
const MEMORY_BASE: u64 = 2 << 20;

/// How many ids a body holds, for [`memory_needed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdDensity {
    /// A few ids, the rest prompt text or token ids: a request, or a
    /// small batch.
    Few,
    /// Nothing but context-only params maps without ids, each given one
    /// (at worst, each under a distinct key): the most any body of that
    /// size needs.
    Densest,
}

#[cfg(test)]
mod tests {
    #[test]
    fn is_a_webassembly_component() {
        // Magic, then the component-model layer marker (version 0xd, layer 1).
        assert_eq!(&super::PLUGIN_WASM[..8], b"\0asm\x0d\x00\x01\x00");
    }
}
