//! `kvroute`: see `kvroute --help`.

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use kvroute_cli::Cli;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match kvroute_cli::run(&cli) {
        Ok(text) => {
            // A closed pipe (`kvroute tour | head`) is not an error worth a message.
            let _ = std::io::stdout().write_all(text.as_bytes());
            ExitCode::SUCCESS
        }
        Err(err) => {
            if cli.json {
                let message = serde_json::json!({ "error": format!("{err:#}") });
                println!("{message}");
            }
            eprintln!("kvroute: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
