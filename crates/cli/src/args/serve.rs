//! The flags of the commands that run holders and requesters: `requester`, the step loop,
//! the model and `generate`, `demo`, `holder`, `sweep` and `verify-predicate`.

use super::*;

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
