//! The cost model's flags: `predict` and the PrfaaS and Helix plans.

use super::*;

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
