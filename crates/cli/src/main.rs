//! `kvroute`: see `kvroute --help`.

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use kvroute_cli::{Cli, ReportedFailure};

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Logs to stderr: warnings by default, `RUST_LOG` (e.g. `kvroute_sched=debug` for every
    // selector decision and refit) for more.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    match kvroute_cli::run(&cli) {
        Ok(text) => {
            // A closed pipe (`kvroute tour | head`) is not an error worth a message.
            let _ = std::io::stdout().write_all(text.as_bytes());
            ExitCode::SUCCESS
        }
        Err(err) => {
            match err.downcast_ref::<ReportedFailure>() {
                // The report is the one stdout document, failure or not.
                Some(failed) => {
                    let _ = std::io::stdout().write_all(failed.report.as_bytes());
                }
                None if cli.json => {
                    let message = serde_json::json!({ "error": format!("{err:#}") });
                    println!("{message}");
                }
                None => {}
            }
            eprintln!("kvroute: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
