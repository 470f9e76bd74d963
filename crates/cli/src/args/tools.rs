//! The offline tools' flags: Helix runs and ranks, the directory listing, the simulators,
//! trace replay, the storage tier and the kernels on `.npy` files.

use super::*;

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
