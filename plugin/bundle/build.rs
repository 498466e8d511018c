//! Builds the plugin for `wasm32-wasip2` so its bytes can be embedded, and
//! leaves a copy at `<target>/wasm32-wasip2/release/snowgate_plugin.wasm`
//! for operators.

use std::fs;
use std::path::PathBuf;

use snowgate_guest_build::{build_component, outer_target_dir, GUEST_TARGET};

const GUEST_FILE: &str = "snowgate_plugin.wasm";

fn main() {
    let manifest_dir = PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"),
    );
    let workspace = manifest_dir.join("../..");
    let wasm = build_component(
        &workspace,
        "snowgate-plugin",
        "snowgate_plugin",
        &[
            &workspace.join("wit"),
            &workspace.join("plugin/Cargo.toml"),
            &workspace.join("Cargo.lock"),
        ],
    );
    println!("cargo:rustc-env=SNOWGATE_PLUGIN_WASM={}", wasm.display());

    if let Some(target_dir) = outer_target_dir() {
        let dest = target_dir.join(GUEST_TARGET).join("release");
        fs::create_dir_all(&dest).expect("creating the plugin's directory under target/");
        // Copy to a temporary name and rename, so a watcher never sees half a file.
        let tmp = dest.join(format!(".{GUEST_FILE}.tmp"));
        fs::copy(&wasm, &tmp).expect("copying the plugin component under target/");
        fs::rename(&tmp, dest.join(GUEST_FILE)).expect("moving the plugin component into place");
    }
}
