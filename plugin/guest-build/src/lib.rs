//! For build scripts: builds a workspace crate as a `wasm32-wasip2`
//! component and returns where the `.wasm` is.
//!
//! The guest gets its own target directory inside `OUT_DIR`: a nested cargo
//! on the outer target directory would wait forever on the outer build's
//! lock. The outer build's flags are for the host, so they are removed.

// Every public item is documented: the docs are the API.
#![deny(missing_docs)]

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The target guests are built for.
pub const GUEST_TARGET: &str = "wasm32-wasip2";

/// Builds `package` (a member of the workspace at `workspace`) in release
/// mode for [`GUEST_TARGET`], emits `rerun-if-changed` for its sources and
/// for `extra_inputs`, and returns the path of `<file_stem>.wasm`.
///
/// Panics with a message that says what to do when the target is missing
/// or the build fails: this runs in a build script.
pub fn build_component(
    workspace: &Path,
    package: &str,
    file_stem: &str,
    extra_inputs: &[&Path],
) -> PathBuf {
    let out_dir =
        PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR for build scripts"));
    let target_dir = out_dir.join("guest-target");
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(cargo)
        .current_dir(workspace)
        .args([
            "build",
            "--release",
            "--target",
            GUEST_TARGET,
            "-p",
            package,
        ])
        .env("CARGO_TARGET_DIR", &target_dir)
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_BUILD_RUSTFLAGS")
        // `cargo clippy` wraps rustc; the guest is linted on its own.
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("RUSTC_WRAPPER")
        // A small, fast guest: no debug info, one codegen unit, LTO.
        .env("CARGO_PROFILE_RELEASE_DEBUG", "false")
        .env("CARGO_PROFILE_RELEASE_STRIP", "debuginfo")
        .env("CARGO_PROFILE_RELEASE_LTO", "true")
        .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "1")
        .output()
        .unwrap_or_else(|e| panic!("running cargo to build {package} for {GUEST_TARGET}: {e}"));
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        if stderr.contains("may not be installed") || stderr.contains("can't find crate for `core`")
        {
            panic!(
                "the {GUEST_TARGET} target is not installed; run `rustup target add {GUEST_TARGET}` and build again\n{stderr}"
            );
        }
        panic!("building {package} for {GUEST_TARGET} failed:\n{stderr}");
    }
    let release = target_dir.join(GUEST_TARGET).join("release");
    for input in extra_inputs {
        println!("cargo:rerun-if-changed={}", input.display());
    }
    rerun_if_sources_change(&release.join(format!("{file_stem}.d")));
    release.join(format!("{file_stem}.wasm"))
}

/// The outer build's target directory: the nearest ancestor of `OUT_DIR`
/// that cargo marked with `CACHEDIR.TAG`.
pub fn outer_target_dir() -> Option<PathBuf> {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR")?);
    out_dir
        .ancestors()
        .find(|dir| dir.join("CACHEDIR.TAG").is_file())
        .map(Path::to_path_buf)
}

/// Re-runs the build script when any source file of the guest changes, as
/// listed in the dep-info file of its build.
fn rerun_if_sources_change(dep_info: &Path) {
    let deps = fs::read_to_string(dep_info).unwrap_or_else(|e| {
        panic!(
            "reading the guest's dep-info file {}: {e}",
            dep_info.display()
        )
    });
    let Some((_, sources)) = deps.lines().next().and_then(|line| line.split_once(": ")) else {
        return;
    };
    // Paths are separated by spaces; a space inside a path is escaped.
    let mut path = String::new();
    let mut chars = sources.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&' ') => path.push(chars.next().unwrap_or(' ')),
            ' ' => emit(&mut path),
            _ => path.push(c),
        }
    }
    emit(&mut path);
}

fn emit(path: &mut String) {
    if !path.is_empty() {
        println!("cargo:rerun-if-changed={path}");
        path.clear();
    }
}
