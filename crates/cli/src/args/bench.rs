//! The benches' flags: transport, fabric, the KV path and the kernels.

use super::*;

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
