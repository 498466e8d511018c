//! The imports that take text from a plugin read it where it lies.
//!
//! The bindings wasmtime generates copy every string and list a plugin
//! passes to an import into the host before the import sees it: a plugin
//! that logs a 100 MiB line, or names a header with one, made the host
//! allocate 100 MiB for a line the log cuts to 4 KiB and a name refused
//! past 256 bytes (up to wasmtime's hostcall fuel, 128 MiB and more, per
//! import call, outside the plugin's memory limit). So the host replaces
//! those imports with ones that take the text as a view into the plugin's
//! memory ([`WasmStr`], [`WasmList`]) and copy only what they keep, after
//! the limits are checked: `log.write`, `request-headers.get`, and
//! `header-edits`' `set`, `append` and `remove`. What each does is
//! unchanged (see `state`, `request` and `header_edits`), but for a log
//! line the log leaves out, which is now not read at all (so not checked
//! for UTF-8 either: dropped, where the bindings trapped on it).
//!
//! This holds for a plugin whose strings are UTF-8 (Rust's, Go's and
//! Python's): one built with UTF-16 strings has each string transcoded
//! whole by [`WasmStr::to_str`], as the bindings did.
//!
//! WASI's own imports (a write to stdout or stderr) still copy: they are
//! wasmtime-wasi's. A plugin's stdout goes nowhere, and its stderr into a
//! buffer of 4 KiB.

use wasmtime::component::{Linker, WasmList, WasmStr};
use wasmtime::error::Context as _;

use crate::bindings::snowgate::middleware::types::LogLevel;
use crate::header_edits::EditAsked;
use crate::state::HostState;

/// The interfaces whose functions are replaced, at the contract's
/// version (a plugin built for an older 0.2 one is linked to these).
const LOG: &str = "snowgate:middleware/log@0.2.1";
const REQUEST_HEADERS: &str = "snowgate:middleware/request-headers@0.2.1";
const HEADER_EDITS: &str = "snowgate:middleware/header-edits@0.2.1";

/// Replaces the imports that take text from the plugin in `linker`
/// (which must already have the `snowgate:middleware` ones) with ones
/// that read it in place.
pub(crate) fn read_in_place(linker: &mut Linker<HostState>) -> anyhow::Result<()> {
    linker.allow_shadowing(true);
    linker
        .instance(LOG)
        .with_context(|| format!("finding {LOG} in the linker"))?
        .func_wrap(
            "write",
            |mut store, (level, message): (LogLevel, WasmStr)| {
                // A line the log leaves out is not even read.
                if store.data_mut().log_line_admitted(level) {
                    let message = message.to_str(&store)?;
                    store.data().write_log_line(level, &message);
                }
                Ok(())
            },
        )
        .context("replacing log.write")?;
    linker
        .instance(REQUEST_HEADERS)
        .with_context(|| format!("finding {REQUEST_HEADERS} in the linker"))?
        .func_wrap("get", |store, (name,): (WasmStr,)| {
            let name = name.to_str(&store)?;
            let values = store
                .data()
                .request_headers()
                .map_or_else(Vec::new, |headers| headers.values(&name));
            Ok((values,))
        })
        .context("replacing request-headers.get")?;
    let mut edits = linker
        .instance(HEADER_EDITS)
        .with_context(|| format!("finding {HEADER_EDITS} in the linker"))?;
    for asked in [EditAsked::Set, EditAsked::Append] {
        edits
            .func_wrap(
                asked.function(),
                move |mut store, (name, value): (WasmStr, WasmList<u8>)| {
                    let edit = {
                        let name = name.to_str(&store)?;
                        let value = value.as_le_slice(&store);
                        store.data().header_edit(asked, &name, value)
                    };
                    Ok((edit.and_then(|edit| store.data_mut().record_header_edit(edit)),))
                },
            )
            .with_context(|| format!("replacing header-edits.{}", asked.function()))?;
    }
    edits
        .func_wrap("remove", |mut store, (name,): (WasmStr,)| {
            let edit = {
                let name = name.to_str(&store)?;
                store.data().header_edit(EditAsked::Remove, &name, &[])
            };
            Ok((edit.and_then(|edit| store.data_mut().record_header_edit(edit)),))
        })
        .context("replacing header-edits.remove")?;
    linker.allow_shadowing(false);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The interfaces replaced are those of the contract's version: a
    /// version bump that left these behind would make `instance` define new,
    /// empty interfaces, and the replacements would never be called.
    #[test]
    fn the_replaced_interfaces_are_at_the_contracts_version() {
        let wit = include_str!("../../wit/middleware.wit");
        let version = wit
            .lines()
            .find_map(|line| line.strip_prefix("package snowgate:middleware@"))
            .and_then(|rest| rest.strip_suffix(';'))
            .expect("the package line");
        for interface in [LOG, REQUEST_HEADERS, HEADER_EDITS] {
            assert!(interface.ends_with(&format!("@{version}")), "{interface}");
        }
    }
}
