//! The command line, as clap parses it. Every numeric flag is range-checked here, at parse
//! time, against a range chosen from what it means and given in its `--help` line: an absurd
//! value (a count past 2^32, a NaN, a time of 1e308) is a usage error before anything runs,
//! and no value accepted can by itself exhaust memory or keep a command busy for minutes. The
//! crates that use the values still check what depends on several of them (a split needs two
//! instances, a width must divide the heads) with their typed errors.

use std::ops::RangeInclusive;

use clap::builder::RangedU64ValueParser;
use clap::{Args, Parser, Subcommand, ValueEnum};

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

/// `kvroute helix ...`.
#[derive(Debug, Subcommand)]
pub enum HelixCommand {
    /// Start the ranks (threads over `mem`, processes over libfabric), run decode steps, check
    /// each rank's output against a single-rank computation of the layer, and report the
    /// phases and the communication HOP-B leaves exposed.
    Run(HelixRunArgs),
    /// One rank process of `helix run` (started by it).
    #[command(hide = true)]
    Rank(HelixRankArgs),
}

/// Attention of the layer `helix run` builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HelixModel {
    /// DeepSeek-V3's MLA layer, scaled down (16 heads, hidden 1024).
    Mla,
    /// Llama-3.1-405B's GQA layer, scaled down (16 query, 8 KV heads of 64, hidden 1024).
    Gqa,
}

/// HOP-B on or off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    /// Overlap each request's all-to-all with the next request's attention.
    On,
    /// All attention first, then all communication.
    Off,
}

/// `kvroute helix run`.
#[derive(Debug, Clone, Args)]
pub struct HelixRunArgs {
    /// N, the ranks (the layer's 16 query heads divide over them; 1 to 16).
    #[arg(long, value_parser = usize_in(1..=16), default_value_t = 4)]
    pub ranks: usize,
    /// KV-parallel width (default N / TPA; 1 to 16).
    #[arg(long, value_parser = usize_in(1..=16))]
    pub kvp: Option<usize>,
    /// Tensor-parallel width in attention (at most the KV heads: 1 for MLA, 8 for GQA; 1 to 8).
    #[arg(long, value_parser = usize_in(1..=8), default_value_t = 1)]
    pub tpa: usize,
    /// Tensor-parallel width of the FFN (default N / EP; 1 to 16).
    #[arg(long, value_parser = usize_in(1..=16))]
    pub tpf: Option<usize>,
    /// Expert-parallel width of the FFN (needs --moe above 1; 1 to 16).
    #[arg(long, value_parser = usize_in(1..=16), default_value_t = 1)]
    pub ep: usize,
    /// Requests decoded together (1 to 64). The ranks and the reference hold batch x (ctx +
    /// steps) tokens of KV, at most 2^19.
    #[arg(long, value_parser = usize_in(1..=64), default_value_t = 8)]
    pub batch: usize,
    /// Context tokens per request before the first step (0 to 32768).
    #[arg(long, value_parser = u64_in(0..=32_768), default_value_t = 4096)]
    pub ctx: u64,
    /// Decode steps (1 to 500).
    #[arg(long, value_parser = usize_in(1..=500), default_value_t = 6)]
    pub steps: usize,
    /// Tokens appended to one KV shard before the next (staged round-robin; 1 to 32768).
    #[arg(long, value_parser = usize_in(1..=32_768), default_value_t = 16)]
    pub stage: usize,
    /// The layer's attention.
    #[arg(long, value_enum, default_value_t = HelixModel::Mla)]
    pub model: HelixModel,
    /// A MoE FFN (DeepSeek-V3's, scaled: 16 experts of 256, 2 per token) instead of a dense one.
    #[arg(long)]
    pub moe: bool,
    /// HOP-B for every step; without it steps alternate off and on, both reported.
    #[arg(long, value_enum)]
    pub hopb: Option<OnOff>,
    /// `mem` (ranks as threads), or a libfabric provider (`shm`, `tcp`: ranks as processes).
    #[arg(long, default_value = "mem")]
    pub provider: String,
    /// Seed of weights, tokens and queries.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// How long a rank waits for its peers before failing the step, ms (1 to 600000).
    #[arg(long, value_parser = u64_in(1..=600_000), default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// Where rank processes meet (a new directory; default: a fresh one under the temp dir).
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
}

/// `kvroute helix rank`.
#[derive(Debug, Clone, Args)]
pub struct HelixRankArgs {
    /// This rank (0 to 15).
    #[arg(long, value_parser = usize_in(0..=15))]
    pub rank: usize,
    /// The layer and workload, as JSON (`HelixConfig`).
    #[arg(long)]
    pub config: String,
    /// One character per step: `1` with HOP-B, `0` without.
    #[arg(long)]
    pub schedule: String,
    /// libfabric provider.
    #[arg(long)]
    pub provider: String,
    /// The rendezvous directory.
    #[arg(long)]
    pub dir: std::path::PathBuf,
    /// Serve the rank's metrics (its transport's) at http://ADDR/metrics (printed on stderr).
    #[arg(long)]
    pub metrics_listen: Option<String>,
}

/// `kvroute directory ...`.
#[derive(Debug, Subcommand)]
pub enum DirectoryCommand {
    /// What is registered: holders, their chunks and replica numbers, lease time left, and
    /// every entry skipped as malformed.
    List(DirectoryListArgs),
}

/// `kvroute directory list`.
#[derive(Debug, Clone, Args)]
pub struct DirectoryListArgs {
    /// The directory: etcd://HOST:PORT[,HOST:PORT...].
    #[arg(long)]
    pub directory: String,
}

/// Where a holder registers or a requester looks holders up.
#[derive(Debug, Clone, Args)]
pub struct DirectoryArgs {
    /// A cluster directory, etcd://HOST:PORT[,HOST:PORT...]: holders register their chunks
    /// there under a lease, requesters discover them there and follow joins and departures.
    #[arg(long)]
    pub directory: Option<String>,
    /// The lease TTL, seconds (2 to 3600): how long a dead holder's chunks stay offered.
    #[arg(long, value_parser = u64_in(2..=3600), default_value_t = 5)]
    pub directory_ttl: u64,
}

/// `kvroute simulate ...`.
#[derive(Debug, Subcommand)]
pub enum SimulateCommand {
    /// DualPath KV loading (paper 003) against round robin over both read paths and against
    /// storage-to-prefill only, on agent trajectories or a trace.
    #[command(allow_negative_numbers = true)]
    Dualpath(SimulateDualPathArgs),
    /// PrfaaS-PD (paper 001) against homogeneous PD and naive heterogeneous PD.
    #[command(allow_negative_numbers = true)]
    Prfaas(SimulatePrfaasArgs),
}

/// `kvroute simulate dualpath`.
#[derive(Debug, Clone, Args)]
pub struct SimulateDualPathArgs {
    /// A Mooncake-format trace (online arrivals); without it, offline agent trajectories
    /// shaped like paper 003's 64K dataset.
    #[arg(long)]
    pub trace: Option<std::path::PathBuf>,
    /// Copies of the trace, each with its own prefixes, at the same arrival times (1 to 100).
    #[arg(long, value_parser = u32_in(1..=100), default_value_t = 1)]
    pub scale: u32,
    /// Trace arrival times are divided by this (0.001 to 1e6).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.001, 1e6), default_value_t = 1.0)]
    pub time_scale: f64,
    /// Agents of the offline rollout (without --trace; 1 to 16384).
    #[arg(long, value_parser = u32_in(1..=16_384), default_value_t = 1024)]
    pub agents: u32,
    /// Seed of the agent trajectories.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// deepseek-v3.2 (paper 003's DS 660B) or ds-27b.
    #[arg(long, default_value = "deepseek-v3.2")]
    pub model: String,
    /// Prefill nodes (8 engines each; 1 to 256).
    #[arg(long, value_parser = u32_in(1..=256), default_value_t = 2)]
    pub prefill_nodes: u32,
    /// Decode nodes (8 engines each; 1 to 256).
    #[arg(long, value_parser = u32_in(1..=256), default_value_t = 4)]
    pub decode_nodes: u32,
    /// Policies to run: all, or one of dualpath, round-robin, prefill-read.
    #[arg(long, default_value = "all")]
    pub policy: String,
    /// Effective prefill TFLOP/s per GPU (1 to 1e6).
    #[arg(long, value_parser = |s: &str| f64_in(s, 1.0, 1e6), default_value_t = 400.0)]
    pub gpu_tflops: f64,
    /// Storage NIC per node, Gbps (1 to 1e6).
    #[arg(long, value_parser = |s: &str| f64_in(s, 1.0, 1e6), default_value_t = 400.0)]
    pub snic_gbps: f64,
    /// Compute NIC per GPU, Gbps (the hop of cached KV into the prefill engine; 1 to 1e6).
    #[arg(long, value_parser = |s: &str| f64_in(s, 1.0, 1e6), default_value_t = 400.0)]
    pub cnic_gbps: f64,
    /// KV GB one decode engine holds (default: 40 for deepseek-v3.2, 64 for ds-27b; 0.001 to 1e6).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.001, 1e6))]
    pub de_hbm_gb: Option<f64>,
    /// The unfinished-token limit beta, as seconds of one GPU's prefill (0.001 to 3600).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.001, 3600.0), default_value_t = 2.0)]
    pub beta_s: f64,
    /// The short read-queue threshold alpha, as seconds of storage-NIC reading (0.001 to 3600).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.001, 3600.0), default_value_t = 0.5)]
    pub alpha_s: f64,
    /// Write throughput.png, snic_balance.png and attention_balance.png here.
    #[arg(long)]
    pub plots: Option<std::path::PathBuf>,
}

/// `kvroute simulate prfaas`.
#[derive(Debug, Clone, Args)]
pub struct SimulatePrfaasArgs {
    /// A Mooncake-format trace; without it, paper 001's case study (Poisson arrivals,
    /// truncated log-normal lengths) at each deployment's sustainable rate.
    #[arg(long)]
    pub trace: Option<std::path::PathBuf>,
    /// Trace arrival times are divided by this (0.001 to 1e6).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.001, 1e6), default_value_t = 1.0)]
    pub time_scale: f64,
    /// Blocks each cluster's prefix cache holds, trace only (0: unbounded; 0 to 4194304).
    #[arg(long, value_parser = usize_in(0..=4_194_304), default_value_t = 0)]
    pub cache_blocks: usize,
    /// The PD cluster's prefill slowdown against table 5's H200 profile; without it, both
    /// readings of table 6 (2.19 and the homogeneous column's ~2.61; 0.1 to 100).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.1, 100.0))]
    pub h20_slowdown: Option<f64>,
    /// Requests per case-study run (1 to 250000).
    #[arg(long, value_parser = u64_in(1..=250_000), default_value_t = 40_000)]
    pub requests: u64,
    /// Seed of the case study's draws.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Let the PrfaaS-PD router move its threshold from load samples.
    #[arg(long)]
    pub adapt: bool,
}

/// `kvroute trace ...`.
#[derive(Debug, Subcommand)]
pub enum TraceCommand {
    /// Replay a trace in arrival order through the prefix cache: hit ratios, evictions, and
    /// with `--store` the bytes the storage tier moved.
    Replay(TraceReplayArgs),
}

/// `kvroute trace replay`.
#[derive(Debug, Clone, Args)]
pub struct TraceReplayArgs {
    /// The trace: JSON lines with timestamp, input_length, output_length, hash_ids.
    #[arg(long)]
    pub trace: std::path::PathBuf,
    /// Tokens per block (the trace's hashing granularity; 1 to 65536).
    #[arg(long, value_parser = u32_in(1..=65_536), default_value_t = 512)]
    pub block_tokens: u32,
    /// Blocks the cache holds (0: unbounded; 0 to 4194304).
    #[arg(long, value_parser = usize_in(0..=4_194_304), default_value_t = 0)]
    pub capacity_blocks: usize,
    /// Eviction policy: lru (trace studies' semantics) or tail-first (vLLM's order).
    #[arg(long, default_value = "lru")]
    pub policy: String,
    /// Replay only the first N requests (0: all; 0 to 100000000).
    #[arg(long, value_parser = usize_in(0..=100_000_000), default_value_t = 0)]
    pub limit: usize,
    /// A storage tier below the cache: evicted blocks are written here, prefix blocks found
    /// here are read back.
    #[arg(long)]
    pub store: Option<std::path::PathBuf>,
    /// Layers per stored block (each layer of a block is block-tokens x 1152 bytes; 1 to 128).
    #[arg(long, value_parser = u32_in(1..=128), default_value_t = 1)]
    pub store_layers: u32,
}

/// `kvroute store ...`.
#[derive(Debug, Subcommand)]
pub enum StoreCommand {
    /// Write a synthetic corpus as full blocks (keys 0..chunks).
    Write(StoreWriteArgs),
    /// Read every block whole and check every checksum; exit 1 if any block is corrupt or
    /// missing.
    Verify(StoreDirArgs),
    /// Block read and write bandwidth against dd and fio on the same files, same run.
    Bench(StoreBenchArgs),
}

/// `kvroute store write`.
#[derive(Debug, Clone, Args)]
pub struct StoreWriteArgs {
    /// The store's directory (created if needed).
    #[arg(long)]
    pub dir: std::path::PathBuf,
    /// Blocks (corpus chunks) to write (1 to 256).
    #[arg(long, value_parser = u32_in(1..=256))]
    pub chunks: u32,
    /// Tokens per block (1 to 16384).
    #[arg(long, value_parser = u32_in(1..=16_384))]
    pub tokens: u32,
    /// Layers per block (27: DeepSeek-V2-Lite; 1 to 128).
    #[arg(long, value_parser = u32_in(1..=128), default_value_t = 27)]
    pub layers: u32,
    /// The corpus generator's seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// A store directory.
#[derive(Debug, Clone, Args)]
pub struct StoreDirArgs {
    /// The store's directory.
    #[arg(long)]
    pub dir: std::path::PathBuf,
}

/// `kvroute store bench`.
#[derive(Debug, Clone, Args)]
pub struct StoreBenchArgs {
    /// The store's directory (`kvroute store write` first).
    #[arg(long)]
    pub dir: std::path::PathBuf,
    /// Rounds of each measurement (the median is reported; 1 to 20).
    #[arg(long, value_parser = u32_in(1..=20), default_value_t = 3)]
    pub rounds: u32,
}

/// `kvroute kernel ...`.
#[derive(Debug, Subcommand)]
pub enum KernelCommand {
    /// Partial attention: writes `OUT/o.npy` `[Mq, 512]`, `OUT/m.npy` `[Mq]`, `OUT/l.npy` `[Mq]`.
    Partial(KernelPartialArgs),
    /// Merge partials (directories holding o.npy, m.npy, l.npy) into one.
    Merge(KernelMergeArgs),
    /// Re-rotate the RoPE dims of cache rows from stored to new positions.
    Splice(KernelSpliceArgs),
    /// The GPU the CUDA backend would use and its kernels' registers and shared memory (fails
    /// when there is none, saying why).
    GpuInfo,
}

/// `kvroute kernel partial`.
#[derive(Debug, Clone, Args)]
pub struct KernelPartialArgs {
    /// Query rows [Mq, 576].
    #[arg(long)]
    pub q: std::path::PathBuf,
    /// Cache rows [ct, 576].
    #[arg(long)]
    pub cache: std::path::PathBuf,
    /// Sparse: selected token indices [Mq, k] int32/int64, -1 = padding (or [Mq / h, k]: one
    /// index row for each h consecutive query rows). Dense without it.
    #[arg(long)]
    pub indices: Option<std::path::PathBuf>,
    /// Softmax scale (DeepSeek-V2-Lite: 0.1147, V3: 0.1352; 1e-6 to 1000).
    #[arg(
        long,
        value_parser = |s: &str| f64_in(s, 1e-6, 1000.0).map(|v| v as f32),
        allow_negative_numbers = true
    )]
    pub scale: f32,
    /// Output directory.
    #[arg(long)]
    pub out: std::path::PathBuf,
    /// auto, cpu, cuda, reference (or avx512, avx512bf16, avx2, scalar).
    #[arg(long, default_value = "auto")]
    pub backend: String,
}

/// `kvroute kernel merge`.
#[derive(Debug, Clone, Args)]
pub struct KernelMergeArgs {
    /// Partial directories, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pub parts: Vec<std::path::PathBuf>,
    /// Output directory.
    #[arg(long)]
    pub out: std::path::PathBuf,
    /// auto, cpu, cuda, reference.
    #[arg(long, default_value = "auto")]
    pub backend: String,
}

/// RoPE band layout, as named on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LayoutArg {
    /// Pairs (2i, 2i + 1) (DeepSeek's reference code).
    Interleaved,
    /// Pairs (i, i + 32) (rotate-half).
    Half,
}

/// `kvroute kernel splice`.
#[derive(Debug, Clone, Args)]
pub struct KernelSpliceArgs {
    /// Cache rows [n, 576].
    #[arg(long)]
    pub cache: std::path::PathBuf,
    /// Stored positions `[n]` int64.
    #[arg(long)]
    pub from: std::path::PathBuf,
    /// New positions `[n]` int64.
    #[arg(long)]
    pub to: std::path::PathBuf,
    /// RoPE base theta (2 to 1e9).
    #[arg(long, value_parser = |s: &str| f64_in(s, 2.0, 1e9), allow_negative_numbers = true)]
    pub theta: f64,
    /// YaRN scaling factor (plain RoPE without it; 1 to 10000).
    #[arg(long, value_parser = |s: &str| f64_in(s, 1.0, 10_000.0), allow_negative_numbers = true)]
    pub yarn_factor: Option<f64>,
    /// YaRN beta_fast (0.001 to 10000).
    #[arg(
        long,
        value_parser = |s: &str| f64_in(s, 0.001, 10_000.0),
        default_value_t = 32.0,
        requires = "yarn_factor",
        allow_negative_numbers = true
    )]
    pub beta_fast: f64,
    /// YaRN beta_slow (0.001 to 10000).
    #[arg(
        long,
        value_parser = |s: &str| f64_in(s, 0.001, 10_000.0),
        default_value_t = 1.0,
        requires = "yarn_factor",
        allow_negative_numbers = true
    )]
    pub beta_slow: f64,
    /// YaRN original max positions (1 to 134217728).
    #[arg(
        long,
        value_parser = |s: &str| f64_in(s, 1.0, 134_217_728.0),
        default_value_t = 4096.0,
        requires = "yarn_factor",
        allow_negative_numbers = true
    )]
    pub original_max: f64,
    /// RoPE band layout.
    #[arg(long, value_enum, default_value = "interleaved")]
    pub layout: LayoutArg,
    /// Output file: the re-rotated rows [n, 576] f32.
    #[arg(long)]
    pub out: std::path::PathBuf,
    /// auto, cpu, cuda, reference.
    #[arg(long, default_value = "auto")]
    pub backend: String,
}

/// `kvroute bench ...`.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// The transfer engine on the in-process `mem` domain: submit-to-post latency, paged-write
    /// throughput, scatter posting time.
    Transport(TransportBenchArgs),
    /// The libfabric domain between two processes, beside fi_pingpong on the same provider:
    /// the immediate-only round trip, single writes (64 KiB-32 MiB), paged writes (1-64 KiB).
    Fabric(FabricBenchArgs),
    /// The kernels: dense and sparse partials, merge, splice, beside the machine's read
    /// bandwidth (CPU) or device copy bandwidth (CUDA) and the reference, in the same run.
    Kernels(KernelsBenchArgs),
    /// The second process of `bench fabric` (started by it).
    #[command(hide = true)]
    FabricPeer(FabricPeerArgs),
    /// Cached KV to a prefill engine two ways, between two processes over libfabric: read
    /// from the storage tier directly, or read by a decode process and written on with paged
    /// writes (paper 003's storage -> DE -> PE path); every landed block checked.
    Kvpath(KvPathBenchArgs),
    /// The decode process of `bench kvpath` (started by it).
    #[command(hide = true)]
    KvpathPeer(KvPathPeerArgs),
}

/// `kvroute bench fabric`.
#[derive(Debug, Clone, Args)]
pub struct FabricBenchArgs {
    /// libfabric provider: tcp (tcp;ofi_rxm), shm, or any provider name (efa, ...); both
    /// processes run on this host.
    #[arg(long, default_value = "tcp")]
    pub provider: String,
    /// Who runs the engines' passes: `manual` (the bench's own thread, as fi_pingpong's one
    /// thread does; fair on machines with few cores) or `thread` (a worker thread each).
    #[arg(long, default_value = "manual")]
    pub progress: String,
    /// One round and shorter runs (a smoke run).
    #[arg(long)]
    pub quick: bool,
}

/// `kvroute bench fabric-peer`.
#[derive(Debug, Clone, Args)]
pub struct FabricPeerArgs {
    /// libfabric provider.
    #[arg(long)]
    pub provider: String,
    /// Address to bind.
    #[arg(long)]
    pub node: Option<String>,
    /// Manual progress.
    #[arg(long)]
    pub manual: bool,
}

/// `kvroute bench kvpath`.
#[derive(Debug, Clone, Args)]
pub struct KvPathBenchArgs {
    /// The store (`kvroute store write` first).
    #[arg(long)]
    pub dir: std::path::PathBuf,
    /// libfabric provider: shm or tcp (efa on EFA hosts).
    #[arg(long, default_value = "shm")]
    pub provider: String,
    /// Rounds of each path, in rotated order (the median is reported; 1 to 100).
    #[arg(long, value_parser = u32_in(1..=100), default_value_t = 5)]
    pub rounds: u32,
    /// Blocks per pass (0: all; 0 to 1048576).
    #[arg(long, value_parser = usize_in(0..=1_048_576), default_value_t = 0)]
    pub blocks: usize,
}

/// `kvroute bench kvpath-peer`.
#[derive(Debug, Clone, Args)]
pub struct KvPathPeerArgs {
    /// The store.
    #[arg(long)]
    pub dir: std::path::PathBuf,
    /// libfabric provider.
    #[arg(long)]
    pub provider: String,
    /// Address to bind.
    #[arg(long)]
    pub node: Option<String>,
}

/// `kvroute bench kernels`.
#[derive(Debug, Clone, Args)]
pub struct KernelsBenchArgs {
    /// cpu (or avx512, avx512bf16, avx2, scalar) or cuda.
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Fewer repetitions (a smoke run).
    #[arg(long)]
    pub quick: bool,
    /// The batched paged kernels at FlashMLA's decode shapes instead (`--backend cuda`).
    #[arg(long)]
    pub batched: bool,
    /// PyTorch's matrix rate and SDPA times on the same GPU, written just before by
    /// `scripts/torch_baselines.py` (with `--batched`): the compute roofline and SDPA column.
    #[arg(long, value_name = "FILE", requires = "batched")]
    pub torch_baselines: Option<std::path::PathBuf>,
    /// Only this shape of the grid, as its row names it (`dense b=64 s_q=1 h_q=16 s_k=4096`,
    /// `sparse ...`, `sparse-fp8 ...`), and not the single call: for a profiler.
    #[arg(long, value_name = "SHAPE", requires = "batched")]
    pub only: Option<String>,
}

/// `kvroute bench transport`.
#[derive(Debug, Clone, Args)]
pub struct TransportBenchArgs {
    /// Fewer samples (a smoke run, seconds instead of a minute).
    #[arg(long)]
    pub quick: bool,
}

/// A primitive, as named on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PrimitiveArg {
    /// Move the query.
    Route,
    /// Move the cache.
    Fetch,
    /// Recompute.
    Local,
}

/// `kvroute predict`.
#[derive(Debug, Clone, Args)]
#[allow(clippy::struct_excessive_bools)]
pub struct PredictArgs {
    /// Model preset (see `kvroute presets`).
    #[arg(long, default_value = "deepseek-v2-lite")]
    pub model: String,
    /// Fabric preset (default h100-ibgda); or give --probe-us and --bw-gbps for a measured one.
    #[arg(long, conflicts_with_all = ["probe_us", "bw_gbps"])]
    pub fabric: Option<String>,
    /// Measured probe round trip, microseconds (with --bw-gbps; 0.001 to 1e9).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.001, 1e9), requires = "bw_gbps")]
    pub probe_us: Option<f64>,
    /// Measured effective bandwidth, GB/s (with --probe-us; 0.001 to 1e6).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.001, 1e6), requires = "probe_us")]
    pub bw_gbps: Option<f64>,
    /// Fixed turnaround beyond the probe, microseconds (measured fabrics; presets carry
    /// theirs; 0 to 1e9).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.0, 1e9))]
    pub turnaround_us: Option<f64>,
    /// Peak link rate, GB/s, for pricing --flows (presets carry theirs; 0.001 to 1e6).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.001, 1e6))]
    pub link_gbps: Option<f64>,
    /// Query rows routed in one round trip (Mq: decode tokens x query heads; 1 to 1048576).
    #[arg(long, value_parser = u32_in(1..=1_048_576))]
    pub mq: u32,
    /// Tokens in the chunk (ct; 1 to 134217728).
    #[arg(long, value_parser = u32_in(1..=134_217_728))]
    pub ct: u32,
    /// Sparse selection: entries each query attends (top-k); default contiguous (1 to 134217728).
    #[arg(long, value_parser = u32_in(1..=134_217_728))]
    pub topk: Option<u32>,
    /// Holders the sparse selection is scattered over (1 to 4096).
    #[arg(long, value_parser = u32_in(1..=4096), requires = "topk", default_value_t = 1)]
    pub holders: u32,
    /// Tensor-parallel degree; rank r routes to rank r, each pair moving 1/N of the bytes (1 to
    /// 1024).
    #[arg(long, value_parser = u32_in(1..=1024), default_value_t = 1)]
    pub tp: u32,
    /// Routed requesters the holder serves at once (its partial-attention batch; 1 to 4096).
    #[arg(long, value_parser = u32_in(1..=4096), default_value_t = 1)]
    pub holder_requesters: u32,
    /// A flat splice in microseconds instead of the measured H100 splice line (0.001 to 1e9).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.001, 1e9))]
    pub splice_us: Option<f64>,
    /// Re-prefill cost c, microseconds per token per layer (0.001 to 1e6).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.001, 1e6), default_value_t = 1.0)]
    pub local_us_per_token_layer: f64,
    /// A flat online-softmax merge on the requester, microseconds, instead of paper 000's
    /// 25 us bound spread over rows x parts (0 to 1e9).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.0, 1e9))]
    pub merge_us: Option<f64>,
    /// Congestion: effective bandwidth divided by this (1 to 1e6).
    #[arg(long, value_parser = |s: &str| f64_in(s, 1.0, 1e6), default_value_t = 1.0)]
    pub bw_degradation: f64,
    /// Congestion: probe multiplied by this (1 to 1e6).
    #[arg(long, value_parser = |s: &str| f64_in(s, 1.0, 1e6), default_value_t = 1.0)]
    pub probe_inflation: f64,
    /// Congestion: flows sharing the link, this one included (1 to 65536).
    #[arg(long, value_parser = u32_in(1..=65_536), default_value_t = 1)]
    pub flows: u32,
    /// Allow only this primitive (for experiments); repeat to allow several.
    #[arg(long, value_enum)]
    pub only: Vec<PrimitiveArg>,
}

/// `kvroute plan ...`.
#[derive(Debug, Subcommand)]
pub enum PlanCommand {
    /// PrfaaS-PD throughput: the optimal length threshold t and prefill/decode split.
    #[command(allow_negative_numbers = true)]
    Prfaas(PrfaasArgs),
    /// Helix: per-layer DRAM read times and, optionally, the HOP-B timeline.
    #[command(allow_negative_numbers = true)]
    Helix(HelixArgs),
}

/// `kvroute plan prfaas`; the defaults are paper 001's case study.
#[derive(Debug, Clone, Args)]
pub struct PrfaasArgs {
    /// PrfaaS prefill instances (0 to 4096).
    #[arg(long, value_parser = u32_in(0..=4096), default_value_t = 4)]
    pub n_prfaas: u32,
    /// Instances in the PD cluster (split into prefill and decode; 1 to 4096).
    #[arg(long, value_parser = u32_in(1..=4096), default_value_t = 8)]
    pub n_pd: u32,
    /// PrfaaS egress bandwidth, Gbps (0.001 to 1e6).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.001, 1e6), default_value_t = 100.0)]
    pub egress_gbps: f64,
    /// Maximum decode batch per decode instance (1 to 65536).
    #[arg(long, value_parser = u32_in(1..=65_536), default_value_t = 20)]
    pub bs_max: u32,
    /// Decode SLO in tokens per second (T_decode = 1 / this; 0.001 to 1e6).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.001, 1e6), default_value_t = 40.0)]
    pub decode_tps: f64,
    /// Mean output length, tokens (1 to 134217728).
    #[arg(long, value_parser = |s: &str| f64_in(s, 1.0, 134_217_728.0), default_value_t = 1024.0)]
    pub output_tokens: f64,
    /// Log-normal mu of the input length, in ln(tokens) (0 to 20).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.0, 20.0), default_value_t = 9.90)]
    pub mu: f64,
    /// Log-normal sigma of the input length (0.001 to 10).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.001, 10.0), default_value_t = 1.00)]
    pub sigma: f64,
    /// Shortest input, tokens (1 to 134217728).
    #[arg(long, value_parser = |s: &str| f64_in(s, 1.0, 134_217_728.0), default_value_t = 128.0)]
    pub min_tokens: f64,
    /// Longest input, tokens (1 to 134217728).
    #[arg(
        long,
        value_parser = |s: &str| f64_in(s, 1.0, 134_217_728.0),
        default_value_t = 131_072.0
    )]
    pub max_tokens: f64,
    /// A JSON file of measured profile points `[{"tokens", "kv_bytes", "prefill_s"}, ...]`
    /// for the PrfaaS hardware (default: paper 001 table 5).
    #[arg(long)]
    pub profile: Option<std::path::PathBuf>,
    /// PD-cluster prefill time relative to the PrfaaS profile (default: 2.19, implied by
    /// paper 001 table 6 for H20 against H200; 0.1 to 100).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.1, 100.0))]
    pub pd_prefill_slowdown: Option<f64>,
    /// Threshold grid points (log-spaced over the length range; 2 to 65536).
    #[arg(long, value_parser = u32_in(2..=65_536), default_value_t = 1024)]
    pub grid: u32,
    /// Evaluate this threshold (tokens) instead of searching (with --np; 1 to 134217728).
    #[arg(long, value_parser = |s: &str| f64_in(s, 1.0, 134_217_728.0), requires = "np")]
    pub threshold: Option<f64>,
    /// Evaluate with this many PD prefill instances (with --threshold; 1 to 4096).
    #[arg(long, value_parser = u32_in(1..=4096), requires = "threshold")]
    pub np: Option<u32>,
}

/// `kvroute plan helix`; the defaults are paper 004 figure 1's model at 1M tokens.
#[derive(Debug, Clone, Args)]
pub struct HelixArgs {
    /// Batch size B (1 to 65536).
    #[arg(long, value_parser = u32_in(1..=65_536), default_value_t = 8)]
    pub batch: u32,
    /// Query heads Q (1 to 4096).
    #[arg(long, value_parser = u32_in(1..=4096), default_value_t = 128)]
    pub q_heads: u32,
    /// KV heads K (1 to 4096).
    #[arg(long, value_parser = u32_in(1..=4096), default_value_t = 8)]
    pub kv_heads: u32,
    /// Head size Hsz (1 to 4096).
    #[arg(long, value_parser = u32_in(1..=4096), default_value_t = 128)]
    pub head_size: u32,
    /// KV sequence length S, tokens (1 to 134217728).
    #[arg(long, value_parser = u64_in(1..=134_217_728), default_value_t = 1 << 20)]
    pub seq_len: u64,
    /// FFN intermediate dimension F (1 to 1048576).
    #[arg(long, value_parser = u32_in(1..=1_048_576), default_value_t = 65536)]
    pub ffn_dim: u32,
    /// Tensor parallelism in attention (TPA; 1 to 4096).
    #[arg(long, value_parser = u32_in(1..=4096), default_value_t = 8)]
    pub tpa: u32,
    /// Tensor parallelism in the FFN (TPF; 1 to 4096).
    #[arg(long, value_parser = u32_in(1..=4096), default_value_t = 64)]
    pub tpf: u32,
    /// KV parallelism (KVP; 1 to 4096).
    #[arg(long, value_parser = u32_in(1..=4096), default_value_t = 8)]
    pub kvp: u32,
    /// Bytes per parameter and KV element (0.5 = FP4; 0.125 to 8).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.125, 8.0), default_value_t = 0.5)]
    pub bytes_per_param: f64,
    /// GPU memory bandwidth, GB/s (0.001 to 1e6).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.001, 1e6), default_value_t = 8000.0)]
    pub mem_bw_gbps: f64,
    /// HOP-B: requests in the batch (with --hopb-attention and --hopb-comm; 1 to 65536).
    #[arg(long, value_parser = u32_in(1..=65_536), requires_all = ["hopb_attention", "hopb_comm"])]
    pub hopb_requests: Option<u32>,
    /// HOP-B: attention time per request (0 to 1e9).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.0, 1e9), requires = "hopb_requests")]
    pub hopb_attention: Option<f64>,
    /// HOP-B: all-to-all time per request (0 to 1e9).
    #[arg(long, value_parser = |s: &str| f64_in(s, 0.0, 1e9), requires = "hopb_requests")]
    pub hopb_comm: Option<f64>,
}

/// `kvroute requester`: decode steps against holders that are already running.
#[derive(Debug, Clone, Args)]
pub struct RequesterArgs {
    /// Holders' control addresses, comma separated.
    #[arg(long, value_delimiter = ',', required_unless_present_any = ["peers", "directory"])]
    pub holders: Vec<String>,
    /// A static peer file instead: one holder control address per line (`#` comments).
    #[arg(long, conflicts_with = "holders")]
    pub peers: Option<std::path::PathBuf>,
    /// Find holders in a directory instead (and follow holders joining and leaving).
    #[command(flatten)]
    pub directory: DirectoryArgs,
    /// With a directory: how long a step waits for every chunk of the document to have a
    /// live holder before it fails, milliseconds (0 to 600000).
    #[arg(long, value_parser = u64_in(0..=600_000), default_value_t = 30_000)]
    pub wait_ms: u64,
    /// libfabric provider the holders run (shm, tcp, ...).
    #[arg(long, default_value = "tcp")]
    pub provider: String,
    /// The corpus the holders serve (the same arguments they were given).
    #[command(flatten)]
    pub corpus: CorpusArgs,
    /// Seed of the queries and the sparse selection.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Serve the requester's metrics (the step API's, the selector's, its transport's) at
    /// http://ADDR/metrics while it runs (printed on stderr).
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// With --metrics-listen: keep serving the page this long after the last step,
    /// milliseconds (0 to 600000), so that a scraper reads the final counts.
    #[arg(long, value_parser = u64_in(0..=600_000), default_value_t = 0)]
    pub metrics_linger_ms: u64,
    /// The decode steps.
    #[command(flatten)]
    pub run: StepArgs,
}

/// The decode steps a requester runs (`kvroute demo` and `kvroute requester`).
#[derive(Debug, Clone, Args)]
pub struct StepArgs {
    /// Decode steps (0 to 100).
    #[arg(long, value_parser = u32_in(0..=100), default_value_t = 2)]
    pub steps: u32,
    /// Requests per decode step, one new token each (16 query rows a layer, DeepSeek-V2-Lite's
    /// heads; 1 to 64).
    #[arg(long, value_parser = u32_in(1..=64), default_value_t = 4)]
    pub batch: u32,
    /// Force one primitive for every (chunk, request).
    #[arg(long, value_enum)]
    pub force: Option<PrimitiveArg>,
    /// How long the requester waits for a holder before declaring it failed, milliseconds (1
    /// to 600000).
    #[arg(long, value_parser = u64_in(1..=600_000), default_value_t = 5000)]
    pub timeout_ms: u64,
    /// A pause before each decode step after the first, milliseconds (a run that spans
    /// holders joining and leaving; 0 to 60000).
    #[arg(long, value_parser = u64_in(0..=60_000), default_value_t = 0)]
    pub pause_ms: u64,
    /// How often the step API asks the holders for their load and kernel, milliseconds (0:
    /// before every layer call; 0 to 600000); a holder that does not answer is marked dead
    /// there.
    #[arg(long, value_parser = u64_in(0..=600_000), default_value_t = 500)]
    pub poll_ms: u64,
}

/// `kvroute model ...`.
#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Write a checkpoint of random weights (config.json and model.safetensors, under the
    /// tensor names DeepSeek-V2-Lite's checkpoint uses).
    Init(ModelInitArgs),
}

/// Which model architecture's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModelPreset {
    /// DeepSeek-V2-Lite's architecture, small (runs on two cores).
    Tiny,
    /// DeepSeek-V2-Lite's published sizes (15.7B parameters: about 63 GB of f32 to write).
    DeepseekV2Lite,
}

/// `kvroute model init`.
#[derive(Debug, Clone, Args)]
pub struct ModelInitArgs {
    /// Directory to write into (created if missing; its checkpoint files replaced).
    #[arg(long)]
    pub out: std::path::PathBuf,
    /// Seed of the weights.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The sizes.
    #[arg(long, value_enum, default_value = "tiny")]
    pub preset: ModelPreset,
}

/// What a generation runs: the model, the tokens, the paged caches, a holder to kill.
#[derive(Debug, Clone, Args)]
pub struct GenerationArgs {
    /// The checkpoint directory (`kvroute model init`); default: a tiny model drawn from
    /// --model-seed, written to a temporary directory and removed at the end.
    #[arg(long)]
    pub model: Option<std::path::PathBuf>,
    /// Seed of the default model's weights.
    #[arg(long, default_value_t = 1)]
    pub model_seed: u64,
    /// Tokens each request generates (1 to 4096).
    #[arg(long, value_parser = usize_in(1..=4096), default_value_t = 32)]
    pub new_tokens: usize,
    /// Each request's own prompt, tokens, after its chunks (1 to 4096).
    #[arg(long, value_parser = u32_in(1..=4096), default_value_t = 8)]
    pub prompt_tokens: u32,
    /// Tokens per block of every paged KV cache, the holders' and the requests' own (1 to
    /// 65536).
    #[arg(long, value_parser = usize_in(1..=65_536), default_value_t = 64)]
    pub block_tokens: usize,
    /// Kill holder process 0 once this many tokens were generated (0 to 4096); with
    /// --replicas 2 or more its chunks fall back to their replicas.
    #[arg(long, value_parser = usize_in(0..=4096))]
    pub kill_holder_at_token: Option<usize>,
}

/// `kvroute generate`.
#[derive(Debug, Clone, Args)]
pub struct GenerateArgs {
    /// Holder processes, one chunk of the context each (2 to 8).
    #[arg(long, value_parser = usize_in(2..=8), default_value_t = 3)]
    pub holders: usize,
    /// libfabric provider: auto (shm if present, else tcp), shm or tcp.
    #[arg(long, default_value = "auto")]
    pub provider: String,
    /// Seed of the context's and prompts' token ids.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Tokens per chunk of the context (64 to 16384).
    #[arg(long, value_parser = u32_in(64..=16_384), default_value_t = 2048)]
    pub tokens: u32,
    /// Requests generating side by side (1 to 64).
    #[arg(long, value_parser = u32_in(1..=64), default_value_t = 4)]
    pub requests: u32,
    /// Copies of each chunk (chunk c also on holders c+1, ..., c+replicas-1; 1 to 8).
    #[arg(long, value_parser = usize_in(1..=8), default_value_t = 1)]
    pub replicas: usize,
    /// Force one primitive for every (chunk, request): route or fetch.
    #[arg(long, value_enum)]
    pub force: Option<PrimitiveArg>,
    /// How long the requester waits for a holder before declaring it failed, milliseconds (1
    /// to 600000).
    #[arg(long, value_parser = u64_in(1..=600_000), default_value_t = 5000)]
    pub timeout_ms: u64,
    /// How often the step API asks the holders for their load and kernel, milliseconds (0
    /// to 600000); 0: before every layer call.
    #[arg(long, value_parser = u64_in(0..=600_000), default_value_t = 500)]
    pub poll_ms: u64,
    /// Holders register in this directory and the requester finds them there.
    #[command(flatten)]
    pub directory: DirectoryArgs,
    /// The holders' kernels (`kvroute holder --backend`), a comma-separated list cycled over
    /// the holders.
    #[arg(long, default_value = "cpu")]
    pub holder_backend: String,
    /// Serve the requester's metrics at http://ADDR/metrics, and each holder's on a port of
    /// its own on the same host (all printed).
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// The model, tokens and caches.
    #[command(flatten)]
    pub generation: GenerationArgs,
}

/// `kvroute demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Run the checked attention steps over a synthetic DeepSeek-V2-Lite-shaped corpus
    /// instead of the generation.
    #[arg(long)]
    pub attention_checks: bool,
    /// The generation's model, tokens and caches (without --attention-checks).
    #[command(flatten)]
    pub generation: GenerationArgs,
    /// Holder processes to start (2 to 8).
    #[arg(long, value_parser = usize_in(2..=8), default_value_t = 3)]
    pub holders: usize,
    /// libfabric provider: auto (shm if present, else tcp), shm or tcp.
    #[arg(long, default_value = "auto")]
    pub provider: String,
    /// Seed of the corpus and the queries.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The decode steps.
    #[command(flatten)]
    pub run: StepArgs,
    /// Tokens per chunk (one chunk per holder; 64 to 16384).
    #[arg(long, value_parser = u32_in(64..=16_384), default_value_t = 2048)]
    pub tokens: u32,
    /// Copies of each chunk (chunk c also on holders c+1, ..., c+replicas-1; 1 to 8).
    #[arg(long, value_parser = usize_in(1..=8), default_value_t = 1)]
    pub replicas: usize,
    /// Kill holder process 0 before this step (tests the fallback to a replica; 0 to 100).
    #[arg(long, value_parser = u32_in(0..=100))]
    pub kill_holder_at_step: Option<u32>,
    /// Holders register in this directory and the requester finds them there (default: the
    /// requester is given their addresses).
    #[command(flatten)]
    pub directory: DirectoryArgs,
    /// The holders' kernels (`kvroute holder --backend`): cpu, cuda (chunks resident on the
    /// GPU), auto, or a CPU instruction set; a comma-separated list gives holder h the
    /// (h mod length)-th (`cuda,cpu`: a GPU holder beside CPU holders, the selector choosing
    /// between replicas).
    #[arg(long, default_value = "cpu")]
    pub holder_backend: String,
    /// The holders serve from a paged KV cache of blocks of this many tokens, as
    /// `kvroute holder --block-tokens` (1 to 65536); default: contiguous full blocks.
    #[arg(long, value_parser = usize_in(1..=65_536))]
    pub holder_block_tokens: Option<usize>,
    /// The generation's requester serves its metrics at http://ADDR/metrics, each holder on a
    /// port of its own on the same host (all printed).
    #[arg(long)]
    pub metrics_listen: Option<String>,
}

/// Which synthetic corpus: a `CorpusSpec` as JSON, or DeepSeek-V2-Lite's of the sizes given.
#[derive(Debug, Clone, Args)]
pub struct CorpusArgs {
    /// The corpus as the JSON of `CorpusSpec` (what `kvroute demo` passes its holders);
    /// overrides --tokens, --doc-chunks and --corpus-seed.
    #[arg(long)]
    pub corpus: Option<String>,
    /// Tokens per chunk of the DeepSeek-V2-Lite corpus (64 to 16384).
    #[arg(long, value_parser = u32_in(64..=16_384), default_value_t = 2048)]
    pub tokens: u32,
    /// Chunks in the document (1 to 32).
    #[arg(long, value_parser = u32_in(1..=32), default_value_t = 3)]
    pub doc_chunks: u32,
    /// Seed the corpus is generated from.
    #[arg(long, default_value_t = 1)]
    pub corpus_seed: u64,
}

/// `kvroute holder`: serve chunks of a synthetic corpus until stdin closes.
#[derive(Debug, Clone, Args)]
pub struct HolderArgs {
    /// libfabric provider (shm, tcp, efa, ...).
    #[arg(long, default_value = "tcp")]
    pub provider: String,
    /// Control listener address (a fixed port for a static peer file).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// The corpus.
    #[command(flatten)]
    pub corpus: CorpusArgs,
    /// Chunk ids to serve, comma separated.
    #[arg(long)]
    pub chunks: String,
    /// Concurrent requesters served before pushing back (paper 000 section 6.3: 8; 1 to 256).
    /// The holder accepts at least as many control connections (32 by default).
    #[arg(long, value_parser = usize_in(1..=256), default_value_t = 8)]
    pub max_requesters: usize,
    /// Control connections held at once, sessions included (1 to 4096), raised to at least
    /// --max-requesters; a newcomer past it takes the place of the oldest connection that
    /// has not said hello, else of the oldest unproven session, and is refused only if
    /// there is neither.
    #[arg(long, value_parser = usize_in(1..=4096), default_value_t = 32)]
    pub max_connections: usize,
    /// Control connections one source address may hold at once, sessions included (1 to
    /// 4096), raised to at least --max-requesters; past it, a newcomer takes the place of
    /// that address's oldest connection without a hello or unproven session.
    #[arg(long, value_parser = usize_in(1..=4096), default_value_t = 16)]
    pub max_per_source: usize,
    /// How long a granted session may take to prove its address before it is closed,
    /// milliseconds (1 to 600000); until then it is answered nothing but its welcome.
    #[arg(long, value_parser = u64_in(1..=600_000), default_value_t = 5000)]
    pub proof_timeout_ms: u64,
    /// How long a session may go without a request before a requester that finds every slot
    /// taken gets its slot, milliseconds (1 to 86400000); pings do not count as requests.
    #[arg(long, value_parser = u64_in(1..=86_400_000), default_value_t = 10_000)]
    pub idle_evict_ms: u64,
    /// How long a granted session may go without its first request or ping before it is
    /// closed, milliseconds (1 to 86400000).
    #[arg(long, value_parser = u64_in(1..=86_400_000), default_value_t = 30_000)]
    pub open_timeout_ms: u64,
    /// Bytes of each requester's inbox slot and reply staging (the largest request, up to the
    /// 128 MiB `verify-predicate --mq 65536` asks of its holders; 4096 to 134217728).
    #[arg(long, value_parser = usize_in(4096..=134_217_728), default_value_t = 4 << 20)]
    pub slot_bytes: usize,
    /// Who progresses the engine: `thread` (a worker that parks when idle, for machines with
    /// more processes than cores) or `manual` (the serving thread polls: lowest latency, one
    /// busy core).
    #[arg(long, value_enum, default_value = "thread")]
    pub progress: ProgressArg,
    /// Serve until a stop signal (by hand) or until stdin closes (a parent's child).
    #[arg(long, value_enum, default_value = "signal")]
    pub lifeline: Lifeline,
    /// Register in a directory while serving (revoked at a clean stop).
    #[command(flatten)]
    pub directory: DirectoryArgs,
    /// The replica number registered for every chunk served: a chunk's copies are offered
    /// lowest number first (0 to 255).
    #[arg(long, value_parser = u32_in(0..=255), default_value_t = 0)]
    pub replica: u32,
    /// Which kernels serve the partials: cpu (the widest instruction set here), cuda (every
    /// chunk uploaded to the GPU at start and attended there; the start fails without one),
    /// auto (resident on the GPU where one is usable, else cpu), reference, avx512bf16,
    /// avx512, avx2 or scalar.
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// Serve the chunks out of a paged KV cache of blocks of this many tokens, scattered over
    /// the pool as an engine's allocator leaves them (1 to 65536); default: each chunk one
    /// contiguous full block.
    #[arg(long, value_parser = usize_in(1..=65_536))]
    pub block_tokens: Option<usize>,
    /// Serve chunks of a model's context instead of the synthetic corpus: the checkpoint
    /// directory (`kvroute model init`); each chunk is prefilled through the model at its
    /// canonical positions (needs --context).
    #[arg(long, requires = "context")]
    pub model: Option<std::path::PathBuf>,
    /// The context the chunks are of, as the JSON of `kvroute_decode::context::ContextSpec`
    /// (what `kvroute generate` passes its holders).
    #[arg(long, requires = "model")]
    pub context: Option<String>,
    /// Serve this process's metrics at http://ADDR/metrics (Prometheus' text format;
    /// 127.0.0.1:0 picks a port, printed beside the control address).
    #[arg(long)]
    pub metrics_listen: Option<String>,
}

/// What keeps a holder serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Lifeline {
    /// Until SIGINT, SIGTERM or SIGHUP, then a clean shutdown (started by hand).
    Signal,
    /// Until its stdin closes: the parent (`kvroute demo`, `kvroute sweep`) exited or let go.
    Stdin,
}

/// Who progresses an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProgressArg {
    /// A worker thread per engine; idle workers poll every 50 us.
    Thread,
    /// The application's own thread polls (no worker thread).
    Manual,
}

impl std::fmt::Display for ProgressArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Thread => "thread",
            Self::Manual => "manual",
        })
    }
}

/// `kvroute sweep`.
#[derive(Debug, Clone, Args)]
pub struct SweepArgs {
    /// libfabric provider: auto (shm if present, else tcp), shm or tcp.
    #[arg(long, default_value = "auto")]
    pub provider: String,
    /// Query rows per route request, comma separated (1 to 65536).
    #[arg(
        long,
        value_parser = u32_in(1..=65_536),
        default_value = "1,4,16,64,256,512,1024,2048,4096",
        value_delimiter = ','
    )]
    pub mq: Vec<u32>,
    /// Chunk tokens the route sweep attends (one layer), and the decode point's ct (1 to 16384).
    #[arg(long, value_parser = u32_in(1..=16_384), default_value_t = 2048)]
    pub route_ct: u32,
    /// Chunk sizes the fetch sweep pulls (every layer), comma separated (1 to 16384).
    #[arg(
        long,
        value_parser = u32_in(1..=16_384),
        default_value = "64,128,256,512,1024,2048,4096,8192",
        value_delimiter = ','
    )]
    pub ct: Vec<u32>,
    /// Concurrent requesters for the holder-capacity sweep, comma separated (the flag with no
    /// value: skip; 1 to 1024).
    #[arg(
        long,
        value_parser = u32_in(1..=1024),
        default_value = "1,2,4,8,16,32,64",
        value_delimiter = ',',
        num_args = 0..
    )]
    pub concurrency: Vec<u32>,
    /// Query rows each concurrent requester routes (one decode token of DeepSeek-V2-Lite; 1 to
    /// 4096).
    #[arg(long, value_parser = u32_in(1..=4096), default_value_t = 16)]
    pub concurrency_mq: u32,
    /// Repetitions per point (medians are reported; every sample is in the JSON; 1 to 100).
    #[arg(long, value_parser = u32_in(1..=100), default_value_t = 7)]
    pub reps: u32,
    /// Who progresses the engines (see `kvroute holder --progress`).
    #[arg(long, value_enum, default_value = "manual")]
    pub progress: ProgressArg,
    /// Where the PNG plots and sweep.json go.
    #[arg(long, default_value = "target/sweep")]
    pub out: std::path::PathBuf,
    /// No progress bar (it is also hidden when stderr is not a terminal).
    #[arg(long)]
    pub quiet: bool,
    /// Seed of the corpus and queries.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// `kvroute verify-predicate`: the calibrated selector's predictions against measurements.
#[derive(Debug, Clone, Args)]
pub struct VerifyArgs {
    /// libfabric provider: auto (shm if present, else tcp), shm or tcp.
    #[arg(long, default_value = "auto")]
    pub provider: String,
    /// Holder processes per chunk size (the grid's points go round them; 1 to 8).
    #[arg(long, value_parser = usize_in(1..=8), default_value_t = 2)]
    pub holders: usize,
    /// Query rows per routed request, comma separated (1 to 65536).
    #[arg(
        long,
        value_parser = u32_in(1..=65_536),
        default_value = "16,64,256,1024",
        value_delimiter = ','
    )]
    pub mq: Vec<u32>,
    /// Chunk sizes in tokens, comma separated (each gets holders of its own; 64 to 16384).
    #[arg(
        long,
        value_parser = u32_in(64..=16_384),
        default_value = "512,1024,2048,4096",
        value_delimiter = ','
    )]
    pub ct: Vec<u32>,
    /// Measurements of each primitive per point (the median is compared; 1 to 100).
    #[arg(long, value_parser = usize_in(1..=100), default_value_t = 7)]
    pub reps: usize,
    /// Who progresses the engines (see `kvroute holder --progress`).
    #[arg(long, value_enum, default_value = "thread")]
    pub progress: ProgressArg,
    /// Write predicted-vs-measured.png and decision-map.png here.
    #[arg(long)]
    pub plots: Option<std::path::PathBuf>,
    /// Seed of the corpus and the queries.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// The holders' kernels (`kvroute holder --backend`): cpu, cuda (chunks resident on the
    /// GPU), auto, or a CPU instruction set. The requester's own (local, fetch's splice and
    /// the merge) stay on the CPU.
    #[arg(long, default_value = "cpu")]
    pub holder_backend: String,
}
