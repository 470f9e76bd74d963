//! The command line, as clap parses it. Every numeric flag is range-checked here, at parse
//! time, against a range chosen from what it means and given in its `--help` line: an absurd
//! value (a count past 2^32, a NaN, a time of 1e308) is a usage error before anything runs,
//! and no value accepted can by itself exhaust memory or keep a command busy for minutes. The
//! crates that use the values still check what depends on several of them (a split needs two
//! instances, a width must divide the heads) with their typed errors.

use std::ops::RangeInclusive;

use clap::builder::RangedU64ValueParser;
use clap::{Args, Parser, Subcommand, ValueEnum};

mod bench;
mod plan;
mod serve;
mod tools;

pub use bench::*;
pub use plan::*;
pub use serve::*;
pub use tools::*;

/// A `u32` count, refused at parse time outside `range`.
fn u32_in(range: RangeInclusive<u64>) -> RangedU64ValueParser<u32> {
    RangedU64ValueParser::new().range(range)
}

/// A `u64` count or duration, refused at parse time outside `range`.
fn u64_in(range: RangeInclusive<u64>) -> RangedU64ValueParser<u64> {
    RangedU64ValueParser::new().range(range)
}

/// A `usize` count, refused at parse time outside `range`.
fn usize_in(range: RangeInclusive<u64>) -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::new().range(range)
}

/// A finite float in `low..=high`; NaN, the infinities and anything outside are refused at
/// parse time.
fn f64_in(text: &str, low: f64, high: f64) -> Result<f64, String> {
    let value: f64 = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number"))?;
    if value.is_finite() && (low..=high).contains(&value) {
        Ok(value)
    } else {
        Err(format!("{value} is not in {low} to {high}"))
    }
}

/// kvroute: move the query or move the cache? Cost-model predictions and capacity plans for
/// cross-instance attention.
#[derive(Debug, Parser)]
#[command(name = "kvroute", version, about, propagate_version = true)]
pub struct Cli {
    /// Print one machine-readable JSON document instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Price route, fetch and local for one (chunk, request) and say which wins and why.
    #[command(allow_negative_numbers = true)]
    Predict(PredictArgs),
    /// Capacity planning: PrfaaS throughput or the Helix roofline.
    #[command(subcommand)]
    Plan(PlanCommand),
    /// List the model and fabric presets with their sources.
    Presets,
    /// A tour of the papers' operating points: what the models decide there and why.
    Tour,
    /// Measure a crate on this machine, each number beside a baseline from the same run.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Run a kernel on .npy files (f32 inputs are rounded to bf16, <u2 inputs are raw bf16
    /// bits; outputs are f32), to check it against PyTorch or NumPy.
    #[command(subcommand)]
    Kernel(KernelCommand),
    /// The main job end to end: holder processes prefill a long shared context through a
    /// DeepSeek-V2-Lite-architecture model and serve it over libfabric; a requester
    /// generates tokens for several requests through the step API, checked against the same
    /// generation on one instance (`--attention-checks`: the checked attention steps instead).
    Demo(DemoArgs),
    /// Generate tokens over a context held by holder processes (the demo's main job with its
    /// own flags): tokens, the single-instance reference's tokens, per-layer differences,
    /// time per token.
    Generate(GenerateArgs),
    /// Model checkpoints.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Serve chunks of a synthetic corpus to requesters (started by `demo`, or by hand).
    Holder(HolderArgs),
    /// Run the demo's decode steps against running holders (`kvroute holder`), found by
    /// address, in a peer file or in a directory, every output checked against a full copy
    /// of the corpus.
    Requester(RequesterArgs),
    /// The cluster directory holders register in.
    #[command(subcommand)]
    Directory(DirectoryCommand),
    /// Measure route (against the raw write round trip) over Mq and fetch over ct between
    /// processes, fit the cost model, write plots and the raw samples.
    Sweep(SweepArgs),
    /// Check the calibrated route / fetch predicate against live holders: predict, then
    /// measure, over an (Mq, ct) grid spanning the crossover.
    VerifyPredicate(VerifyArgs),
    /// Request traces (Mooncake's format) through the prefix cache.
    #[command(subcommand)]
    Trace(TraceCommand),
    /// The storage tier: full blocks on disk, checksummed and crash-safe.
    #[command(subcommand)]
    Store(StoreCommand),
    /// Cluster schedulers in a discrete-event simulator, each beside its baselines in the
    /// same run.
    #[command(subcommand)]
    Simulate(SimulateCommand),
    /// Helix parallelism: one decode layer over N ranks (KV-parallel attention, an all-to-all
    /// of partials over the transfer engine, TP/EP FFN), every output checked.
    #[command(subcommand)]
    Helix(HelixCommand),
}
