//! The `kvroute` command line as a library: argument definitions and one function per command,
//! each returning a report that prints as text or serialises as JSON. The binary in `main.rs`
//! only parses, calls [`run`] and prints; tests call [`run`] directly.
//!
//! Commands: `predict` (route / fetch / local for one request), `plan prfaas`, `plan helix`,
//! `presets`, `tour` (the papers' operating points), `bench transport`, `bench fabric`,
//! `bench kernels`, `kernel partial | merge | splice | gpu-info` (the kernels on .npy files),
//! `demo`, `generate` and `holder` (the main job end to end: a model's decode loop over a
//! context held by holder processes), `model init` (a checkpoint), `sweep` (route and fetch measured between
//! processes, fitted and plotted), `trace replay` (a request trace through the prefix cache),
//! `store write | verify | bench` (the storage tier) and `simulate dualpath | prfaas` (the
//! cluster schedulers in the discrete-event simulator), `verify-predicate` (the calibrated
//! route / fetch selector's predictions against live measurements), `helix run` (Helix
//! parallelism's decode layer over N ranks, checked against one rank).

#![forbid(unsafe_code)]

pub mod args;
mod bench;
mod bench_fabric;
mod bench_kernels;
mod bench_kvpath;
mod calibrate;
pub mod demo;
mod directory;
mod helix;
mod kernel;
mod metrics_http;
mod model;

mod plan;
mod predict;
mod presets;
mod simulate;
mod store;
mod sweep;
mod tour;
mod units;
mod verify;

use anyhow::Result;
pub use args::Cli;
use args::{
    BenchCommand, Command, DirectoryCommand, HelixCommand, KernelCommand, ModelCommand,
    PlanCommand, SimulateCommand, StoreCommand, TraceCommand,
};
pub use bench::{Target, TransportBenchReport};
pub use bench_fabric::{Compared, FabricBenchReport, PagedRow};
pub use bench_kernels::KernelsBenchReport;
pub use bench_kvpath::KvPathReport;
pub use calibrate::CalibrationSummary;
pub use directory::Listing;
pub use helix::HelixRunReport;
pub use kernel::{GpuReport, KernelReport};
pub use model::ModelInitReport;
pub use plan::{HelixReport, PrfaasReport};
pub use predict::PredictReport;
pub use presets::PresetsReport;
pub use simulate::{SimulateDualPathReport, SimulatePrfaasReport};
pub use store::{StoreBenchReport, StoreVerifyReport, StoreWriteReport, TraceReplayReport};
pub use sweep::SweepReport;
pub use tour::{Figure, StopResult, TourReport, TourStop};
pub use verify::VerifyReport;

/// Runs `cli` and returns what to print: pretty JSON with `--json`, text otherwise.
pub fn run(cli: &Cli) -> Result<String> {
    match &cli.command {
        Command::Predict(args) => render(cli.json, &predict::run(args)?),
        Command::Plan(PlanCommand::Prfaas(args)) => render(cli.json, &plan::prfaas(args)?),
        Command::Plan(PlanCommand::Helix(args)) => render(cli.json, &plan::helix(args)?),
        Command::Presets => render(cli.json, &presets::run()),
        Command::Tour => render(cli.json, &tour::run()?),
        Command::Bench(BenchCommand::Transport(args)) => render(cli.json, &bench::transport(args)?),
        Command::Bench(BenchCommand::Fabric(args)) => render(cli.json, &bench_fabric::run(args)?),
        Command::Bench(BenchCommand::Kernels(args)) if args.batched => {
            render(cli.json, &bench_kernels::batched(args)?)
        }
        Command::Bench(BenchCommand::Kernels(args)) => render(cli.json, &bench_kernels::run(args)?),
        Command::Kernel(KernelCommand::Partial(args)) => render(cli.json, &kernel::partial(args)?),
        Command::Kernel(KernelCommand::Merge(args)) => render(cli.json, &kernel::merge(args)?),
        Command::Kernel(KernelCommand::Splice(args)) => render(cli.json, &kernel::splice(args)?),
        Command::Kernel(KernelCommand::GpuInfo) => render(cli.json, &kernel::gpu_info()?),
        Command::Demo(args) if args.attention_checks => {
            checked(cli.json, &demo::run(args)?, "the demo")
        }
        Command::Demo(args) => generated(cli.json, &demo::demo_generation(args)?, "the demo"),
        Command::Generate(args) => generated(cli.json, &demo::generate(args)?, "the generation"),
        Command::Model(ModelCommand::Init(args)) => render(cli.json, &model::init(args)?),
        Command::Requester(args) => checked(cli.json, &demo::requester(args)?, "the requester"),
        Command::Directory(DirectoryCommand::List(args)) => {
            render(cli.json, &directory::list(args)?)
        }
        Command::Sweep(args) => render(cli.json, &sweep::run(args)?),
        Command::VerifyPredicate(args) => render(cli.json, &verify::run(args)?),
        Command::Trace(TraceCommand::Replay(args)) => render(cli.json, &store::replay(args)?),
        Command::Simulate(SimulateCommand::Dualpath(args)) => {
            render(cli.json, &simulate::dualpath(args)?)
        }
        Command::Simulate(SimulateCommand::Prfaas(args)) => {
            render(cli.json, &simulate::prfaas(args)?)
        }
        Command::Store(StoreCommand::Write(args)) => render(cli.json, &store::write(args)?),
        Command::Store(StoreCommand::Verify(args)) => {
            let report = store::verify(args)?;
            let text = render(cli.json, &report)?;
            if report.corrupt + report.missing > 0 {
                return Err(ReportedFailure {
                    report: text,
                    why: format!(
                        "{} bad blocks in {}",
                        report.corrupt + report.missing,
                        report.dir
                    ),
                }
                .into());
            }
            Ok(text)
        }
        Command::Store(StoreCommand::Bench(args)) => render(cli.json, &store::bench(args)?),
        Command::Holder(args) => {
            demo::holder(args)?;
            Ok(String::new())
        }
        Command::Bench(BenchCommand::Kvpath(args)) => render(cli.json, &bench_kvpath::run(args)?),
        Command::Bench(BenchCommand::KvpathPeer(args)) => {
            bench_kvpath::peer(args)?;
            Ok(String::new())
        }
        Command::Bench(BenchCommand::FabricPeer(args)) => {
            bench_fabric::peer(args)?;
            Ok(String::new())
        }
        Command::Helix(HelixCommand::Run(args)) => {
            let report = helix::run(args)?;
            let text = render(cli.json, &report)?;
            if !report.passed {
                return Err(ReportedFailure {
                    report: text,
                    why: "helix run: a rank failed or a check failed".to_owned(),
                }
                .into());
            }
            Ok(text)
        }
        Command::Helix(HelixCommand::Rank(args)) => {
            helix::rank(args)?;
            Ok(String::new())
        }
    }
}

/// A command that ran and found a failure its report shows: the report is still printed on
/// stdout (so a failed run's numbers are not lost, and `--json` stdout stays one document:
/// this report, no error object after it), the error on stderr, and the exit status is 1.
#[derive(Debug)]
pub struct ReportedFailure {
    /// The rendered report.
    pub report: String,
    /// What failed.
    pub why: String,
}

impl std::fmt::Display for ReportedFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.why)
    }
}

impl std::error::Error for ReportedFailure {}

/// A run's report, or a [`ReportedFailure`] carrying it when one of its checks failed.
fn checked(json: bool, report: &demo::DemoReport, what: &str) -> Result<String> {
    let text = render(json, report)?;
    if !report.passed {
        return Err(ReportedFailure {
            report: text,
            why: format!("{what}'s checks failed"),
        }
        .into());
    }
    Ok(text)
}

/// A generation's report, or a [`ReportedFailure`] carrying it when its check failed.
fn generated(json: bool, report: &demo::GenerationReport, what: &str) -> Result<String> {
    let text = render(json, report)?;
    if !report.generation.passed {
        return Err(ReportedFailure {
            report: text,
            why: format!("{what}: tokens differ from the single-instance reference"),
        }
        .into());
    }
    Ok(text)
}

fn render<R: serde::Serialize + std::fmt::Display>(json: bool, report: &R) -> Result<String> {
    if json {
        let mut text = serde_json::to_string_pretty(report)?;
        text.push('\n');
        Ok(text)
    } else {
        Ok(report.to_string())
    }
}
