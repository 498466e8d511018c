//! The `snowgate` command: runs the plugin on request bodies, and reads ids.

mod decode;
mod rewrite;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// snowgate: request middleware that gives disaggregated LLM requests
/// globally unique `disagg_request_id`s, in a WebAssembly plugin.
#[derive(Parser)]
#[command(name = "snowgate", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Read one request body on stdin, run the plugin on it, write the result
    /// on stdout.
    Rewrite(rewrite::RewriteArgs),
    /// Print the fields of an id: timestamp, machine id, sequence.
    Decode(decode::DecodeArgs),
}

/// How a command failed, and so which exit status it gets.
pub enum Failure {
    /// The input or a flag was bad: exit status 2.
    BadInput(String),
    /// Something else failed: exit status 1.
    Failed(anyhow::Error),
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Self {
        Failure::Failed(e)
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SNOWGATE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Rewrite(args) => rewrite::run(args),
        Command::Decode(args) => decode::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::BadInput(message)) => {
            eprintln!("snowgate: {message}");
            ExitCode::from(2)
        }
        Err(Failure::Failed(error)) => {
            eprintln!("snowgate: {error:#}");
            ExitCode::FAILURE
        }
    }
}
