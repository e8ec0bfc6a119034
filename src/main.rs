//! Temporary entry point for `slotstream pull` while the real CLI is assembled.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "slotstream", version, about = "Run Mixture-of-Experts models larger than memory")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Download a model into the Hugging Face cache, resumably and verified.
    Pull(slotstream::pull::PullArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Pull(args) => slotstream::pull::run_pull(&args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
