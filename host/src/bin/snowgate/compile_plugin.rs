//! `snowgate compile-plugin`: the child `snowgate serve` compiles each
//! plugin build in, under limits of its own (see
//! [`snowgate_host::compile_process`]). Not for use by hand.

use snowgate_host::compile_process::{compile_for_parent, RefusedComponent, REFUSED_STATUS};

/// Compiles the component on stdin and writes the build on stdout. The
/// exit status is 0 for a build, [`REFUSED_STATUS`] for a component
/// wasmtime refused (why on stderr), 1 for anything else.
pub fn run() -> std::process::ExitCode {
    match compile_for_parent(std::io::stdin().lock(), std::io::stdout().lock()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e:#}");
            if e.is::<RefusedComponent>() {
                std::process::ExitCode::from(REFUSED_STATUS as u8)
            } else {
                std::process::ExitCode::FAILURE
            }
        }
    }
}
