//! `snowgate compile-plugin`: the child `snowgate serve` compiles each
//! plugin build in, under limits of its own (see
//! [`snowgate_host::compile_process`]). Not for use by hand.

use snowgate_host::compile_process::{
    compile_for_parent, CompileOutOfMemory, RefusedComponent, FAILED_STATUS, OUT_OF_MEMORY_STATUS,
    REFUSED_STATUS,
};

/// Compiles the component on stdin and writes the build on stdout. The
/// exit status is 0 for a build, [`REFUSED_STATUS`] for a component
/// wasmtime refused, [`OUT_OF_MEMORY_STATUS`] for a compile that ran out of
/// memory, [`FAILED_STATUS`] for anything else (why on stderr).
pub fn run() -> std::process::ExitCode {
    match compile_for_parent(std::io::stdin().lock(), std::io::stdout().lock()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            say!("{e:#}");
            let status = if e.is::<RefusedComponent>() {
                REFUSED_STATUS
            } else if e.is::<CompileOutOfMemory>() {
                OUT_OF_MEMORY_STATUS
            } else {
                FAILED_STATUS
            };
            std::process::ExitCode::from(status as u8)
        }
    }
}
