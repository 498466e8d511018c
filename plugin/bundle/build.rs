//! Builds the plugin for `wasm32-wasip2` so its bytes can be embedded.
//!
//! The guest gets its own target directory inside `OUT_DIR` (a nested cargo
//! on the outer target directory would wait on the outer build's lock), and
//! the finished component is also copied to
//! `<target>/wasm32-wasip2/release/snowgate_plugin.wasm` for operators.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const GUEST_TARGET: &str = "wasm32-wasip2";
const GUEST_FILE: &str = "snowgate_plugin.wasm";

fn main() {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let workspace = manifest_dir.join("../..");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let guest_target_dir = out_dir.join("guest-target");
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());

    let output = Command::new(cargo)
        .current_dir(&workspace)
        .args([
            "build",
            "--release",
            "--target",
            GUEST_TARGET,
            "-p",
            "snowgate-plugin",
        ])
        .env("CARGO_TARGET_DIR", &guest_target_dir)
        // The outer build's flags are for the host, not for wasm.
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_BUILD_RUSTFLAGS")
        // A small, fast guest: no debug info, one codegen unit, LTO.
        .env("CARGO_PROFILE_RELEASE_DEBUG", "false")
        .env("CARGO_PROFILE_RELEASE_STRIP", "debuginfo")
        .env("CARGO_PROFILE_RELEASE_LTO", "true")
        .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "1")
        .output()
        .expect("running cargo to build the plugin for wasm32-wasip2");
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        if stderr.contains("may not be installed") || stderr.contains("can't find crate for `core`")
        {
            panic!(
                "the {GUEST_TARGET} target is not installed; run `rustup target add {GUEST_TARGET}` and build again\n{stderr}"
            );
        }
        panic!("building the plugin for {GUEST_TARGET} failed:\n{stderr}");
    }

    let release = guest_target_dir.join(GUEST_TARGET).join("release");
    let wasm = release.join(GUEST_FILE);
    println!("cargo:rustc-env=SNOWGATE_PLUGIN_WASM={}", wasm.display());
    rerun_if_guest_changes(&release.join("snowgate_plugin.d"), &workspace);

    if let Some(target_dir) = outer_target_dir(&out_dir) {
        let dest = target_dir.join(GUEST_TARGET).join("release");
        fs::create_dir_all(&dest).expect("creating the plugin's directory under target/");
        // Copy to a temporary name and rename, so a watcher never sees half a file.
        let tmp = dest.join(format!(".{GUEST_FILE}.tmp"));
        fs::copy(&wasm, &tmp).expect("copying the plugin component under target/");
        fs::rename(&tmp, dest.join(GUEST_FILE)).expect("moving the plugin component into place");
    }
}

/// Re-runs this script when any source file of the guest changes, as listed
/// in the dep-info file of the guest build.
fn rerun_if_guest_changes(dep_info: &Path, workspace: &Path) {
    println!("cargo:rerun-if-changed={}", workspace.join("wit").display());
    println!(
        "cargo:rerun-if-changed={}",
        workspace.join("plugin/Cargo.toml").display()
    );
    println!(
        "cargo:rerun-if-changed={}",
        workspace.join("Cargo.lock").display()
    );
    let deps = fs::read_to_string(dep_info).expect("reading the guest's dep-info file");
    let Some((_, sources)) = deps.lines().next().and_then(|line| line.split_once(": ")) else {
        return;
    };
    // Paths are separated by spaces; a space inside a path is escaped.
    let mut path = String::new();
    let mut chars = sources.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&' ') => path.push(chars.next().unwrap_or(' ')),
            ' ' => emit_source(&mut path),
            _ => path.push(c),
        }
    }
    emit_source(&mut path);
}

fn emit_source(path: &mut String) {
    if !path.is_empty() {
        println!("cargo:rerun-if-changed={path}");
        path.clear();
    }
}

/// The outer build's target directory: the nearest ancestor of `OUT_DIR`
/// that cargo marked with `CACHEDIR.TAG`.
fn outer_target_dir(out_dir: &Path) -> Option<PathBuf> {
    out_dir
        .ancestors()
        .find(|dir| dir.join("CACHEDIR.TAG").is_file())
        .map(Path::to_path_buf)
}
