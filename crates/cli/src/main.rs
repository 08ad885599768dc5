//! `fabriq`: the command-line tool of the fabriq RDMA middleware.
//!
//! This file owns argument parsing and error reporting only; each subcommand lives in its own
//! module under [`cmd`] and is registered there with one line of the `commands!` table. Errors
//! reach the user as one `error:` line with their cause chain and exit status 1 (clap's own
//! usage errors exit with 2).
#![forbid(unsafe_code)]

mod cmd;
mod out;

use clap::Parser;

/// fabriq: RDMA communication middleware tools.
#[derive(Debug, Parser)]
#[command(name = "fabriq", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: cmd::Command,
}

/// Diagnostics of the library on standard error when `FABRIQ_LOG` holds a filter
/// (`FABRIQ_LOG=debug`, `FABRIQ_LOG=fabriq=trace,fabriq_verbs=debug`); silent otherwise.
fn init_logging() {
    if let Ok(filter) = std::env::var("FABRIQ_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
}

fn main() -> std::process::ExitCode {
    init_logging();
    let cli = Cli::parse();
    match cli.command.run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // The reader of the report went away (`fabriq demo | head`): nothing left to say.
        Err(err) if out::is_closed_pipe(&err) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            for cause in err.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}
