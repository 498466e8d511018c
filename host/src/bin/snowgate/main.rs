//! The `snowgate` command: runs the plugin on request bodies, and reads ids.

/// `eprintln!` that does not panic when stderr cannot be written (a log
/// pipe whose reader is gone): the line is lost, not the request, the
/// drain of a stop, or the body `rewrite` has stamped.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

mod allocator;
mod check;
mod compile_flags;
mod compile_plugin;
mod decode;
mod gateway_config;
mod huge_pages;
mod open_files;
mod plugin_flags;
mod rewrite;
mod rewrite_high_water;
mod serve;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// mimalloc instead of glibc's malloc: a proxied request makes dozens of
/// small allocations (headers, buffers, futures), and the profile of the
/// gateway under load showed glibc's malloc and free at ~8 % of its CPU.
#[global_allocator]
static ALLOCATOR: allocator::Mimalloc = allocator::Mimalloc;

/// snowgate: request middleware that gives disaggregated LLM requests
/// globally unique `disagg_request_id`s, in a WebAssembly plugin.
///
/// Logs go to stderr: `serve` logs at info, the other commands at warn.
/// The environment variable SNOWGATE_LOG sets the level or a filter
/// (`debug`, `snowgate_host=debug,info`); a plugin's own log lines are
/// under the target `snowgate::plugin`. snowgate turns transparent huge
/// pages off for itself, to keep the gateway's resident memory near its
/// heap; MIMALLOC_ALLOW_THP=1 keeps them.
#[derive(Parser)]
#[command(name = "snowgate", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Read one request body on stdin, run the plugin on it as the body of
    /// a POST to --path (`/`) with `content-type: application/json` (and
    /// `x-trtllm-msgpack: 1` with --msgpack, and the headers --header
    /// gives), write the result on stdout.
    Rewrite(rewrite::RewriteArgs),
    /// Print the fields of an id: timestamp, machine id, sequence.
    ///
    /// Exact for trtllm-v1 ids made before 2039-09-07 15:30:06.976 UTC,
    /// when the id passes 2^63 - 1 - 2^42 and TensorRT-LLM's rotation folds
    /// later ids back to the bottom of the range, where they read as 1970
    /// times; and for trtllm-v2 ids (their time modulo 2^39 ms) except in
    /// the last 2^40 values before its masked 39-bit timestamp wraps.
    Decode(decode::DecodeArgs),
    /// Run the self-check `serve` runs on every plugin build before it
    /// serves, and say whether the build passes; loaded as a gateway of
    /// --config's file would load it. A context-only request
    /// must get an id made of the host's clock and machine id; the same
    /// request again, on the same instance, an id of that call; and a
    /// batch of two, two different ids (or, from a plugin that takes no
    /// batches, a rejection under 500). Exit status 0 when a gateway
    /// would take the build: "passed", or "would serve" with what the
    /// check could not see (a build that rejects the canned request for
    /// want of credentials, or takes no batches); 1 when it would not,
    /// saying why (a file that is not a component of the contract's world
    /// among them); 2 for a bad flag or setting of the file, a plugin path
    /// that cannot be read as a file (missing, a directory, over the size
    /// limit), or a setting the plugin refuses.
    Check(check::CheckArgs),
    /// Run the gateway: a reverse proxy that stamps ids into JSON requests
    /// on their way to the upstream, and reloads the plugin when it changes.
    Serve(Box<serve::ServeArgs>),
    /// Compile the plugin component on stdin and write the build on stdout:
    /// the child process `serve` compiles each plugin in, under
    /// --plugin-compile-memory-mib and --plugin-compile-cpu-secs.
    #[command(hide = true)]
    CompilePlugin,
}

/// How a command failed, and so which exit status it gets.
pub enum Failure {
    /// The input or a flag was bad: exit status 2.
    BadInput(String),
    /// Something else failed: exit status 1.
    Failed(anyhow::Error),
}

/// Writes `bytes` to stdout: a read-only or full stdout, or one whose
/// reader is gone, is an error that says so, not a panic or output
/// silently lost.
///
/// The write goes through a duplicate of the descriptor, not
/// [`std::io::stdout`], which takes `EBADF` for success: `rewrite
/// 1<file` lost the body it had stamped and exited 0. (A stdout closed at
/// start, `>&-`, is `/dev/null` by then: Rust's start-up opens it there.)
pub fn write_stdout(bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::fd::AsFd;

    let said = |e: std::io::Error| {
        if e.raw_os_error() == Some(libc::EBADF) {
            anyhow::anyhow!("writing the output to stdout: stdout is not open for writing ({e})")
        } else {
            anyhow::anyhow!("writing the output to stdout: {e}")
        }
    };
    let stdout = std::io::stdout().lock();
    let mut file = std::fs::File::from(stdout.as_fd().try_clone_to_owned().map_err(said)?);
    file.write_all(bytes).map_err(said)
}

impl From<anyhow::Error> for Failure {
    /// Settings the plugin refuses (`--plugin-setting`, `--layout`) are bad
    /// input, like a malformed flag; anything else failed.
    fn from(e: anyhow::Error) -> Self {
        if e.chain()
            .any(|cause| cause.is::<snowgate_host::ConfigurationRefused>())
        {
            Failure::BadInput(format!("{e:#}"))
        } else {
            Failure::Failed(e)
        }
    }
}

fn main() -> ExitCode {
    // First: every allocation from here on is in small pages.
    let huge_pages = huge_pages::keep_to_small_pages();
    let cli = Cli::parse();
    let default_level = if matches!(cli.command, Command::Serve(_)) {
        "info"
    } else {
        "warn"
    };
    // A filter that does not parse is refused, not replaced by the
    // default: `info,snowgate::access=debg` silently meant no access log.
    let filter = match std::env::var("SNOWGATE_LOG") {
        Ok(text) if !text.trim().is_empty() => {
            match tracing_subscriber::EnvFilter::builder().parse(&text) {
                Ok(filter) => {
                    // Said once, by the command run, not by each compile
                    // child, which inherits the variable.
                    if !matches!(cli.command, Command::CompilePlugin) {
                        warn_of_narrow_filters(&text);
                    }
                    filter
                }
                Err(e) => {
                    say!("snowgate: SNOWGATE_LOG {text:?} is not a log filter: {e}");
                    return ExitCode::from(2);
                }
            }
        }
        Err(std::env::VarError::NotUnicode(text)) => {
            say!("snowgate: SNOWGATE_LOG {text:?} is not a log filter: it is not UTF-8");
            return ExitCode::from(2);
        }
        // Unset or empty (`Environment=SNOWGATE_LOG=`): the default.
        _ => tracing_subscriber::EnvFilter::new(default_level),
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // A log line that cannot be written is dropped: reporting it
        // would `eprintln!`, which panics on the same stderr.
        .log_internal_errors(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(filter)
        .init();
    if let Err(error) = huge_pages {
        tracing::warn!(%error, "transparent huge pages could not be turned off; resident memory may be larger than the heap");
    }
    let result = match cli.command {
        Command::Rewrite(args) => rewrite::run(args),
        Command::Decode(args) => decode::run(args),
        Command::Check(args) => check::run(args),
        Command::Serve(args) => serve::run(*args),
        // Its own exit statuses: see `compile_plugin::run`.
        Command::CompilePlugin => return compile_plugin::run(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::BadInput(message)) => {
            say!("snowgate: {message}");
            ExitCode::from(2)
        }
        Err(Failure::Failed(error)) => {
            say!("snowgate: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Says on stderr (the log may be off) when SNOWGATE_LOG logs less than it
/// likely means to. A filter without a bare level logs only the targets it
/// names, and nothing else, errors included: `inof` for `info` (a target),
/// or `snowgate::access=debug` without the README's `info,` in front, turned
/// the rest of the log off without a word.
fn warn_of_narrow_filters(filter: &str) {
    let is_level = |word: &str| {
        word.parse::<tracing_subscriber::filter::LevelFilter>()
            .is_ok()
    };
    let words: Vec<&str> = filter
        .split(',')
        .map(str::trim)
        .filter(|word| !word.is_empty())
        .collect();
    // `[span]` names a span, not a target.
    let target = |word: &str| !word.contains('=') && !word.starts_with('[') && !is_level(word);
    for word in words.iter().filter(|word| target(word)) {
        say!(
            "snowgate: note: SNOWGATE_LOG {word:?} is not a level (trace, debug, info, warn, \
             error, off), so it names a target: only that target's lines are logged"
        );
    }
    if !words.iter().any(|w| is_level(w)) {
        say!(
            "snowgate: note: SNOWGATE_LOG {filter:?} sets no level for the targets it does not \
             name, so their lines, warnings and errors included, are not logged; to keep them, \
             put a level first: \"info,{filter}\""
        );
    }
}
