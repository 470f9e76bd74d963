//! What the simulated cluster is: the model's prefill and decode costs and the cluster's
//! engines, links and scheduler constants.

use kvroute_costmodel::model_preset;
use serde::Serialize;

use crate::dualpath::{Policy, SchedConfig, Topology};
use crate::error::{Result, SchedError, count, positive};

/// What prefill and decode cost for one model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ModelProfile {
    /// Name in reports.
    pub name: &'static str,
    /// KV bytes per token, all layers, as stored.
    pub kv_bytes_per_token: f64,
    /// FLOPs per new token outside attention (2 x active parameters).
    pub linear_flops_per_token: f64,
    /// Attention FLOPs per (query token, attended key) pair, all layers.
    pub attn_flops_per_pair: f64,
    /// Sparse-attention indexer FLOPs per (query token, key) pair, all layers (0: none).
    pub indexer_flops_per_pair: f64,
    /// Keys each query attends when the model selects (`index_topk`).
    pub topk: Option<u64>,
}

impl ModelProfile {
    /// DeepSeek-V3.2 (paper 003's DS 660B), from the cost model's preset: 61 layers, 128
    /// heads, MLA rows of 576 (keys) and 512 (values), `index_topk` 2048. Stored KV: 656 bytes
    /// per token per layer (V3.2's FP8 cache: 512 FP8 latent values, 4 FP32 scales, 64 BF16
    /// RoPE values). 37B active parameters (DeepSeek-V3 technical report, arXiv:2412.19437).
    /// The indexer: 64 heads of 128 (V3.2 config).
    pub fn deepseek_v32() -> Result<Self> {
        let dims = model_preset("deepseek-v3.2")?.dims;
        let layers = f64::from(dims.layers);
        Ok(Self {
            name: "deepseek-v3.2",
            kv_bytes_per_token: 656.0 * layers,
            linear_flops_per_token: 2.0 * 37e9,
            attn_flops_per_pair: 2.0
                * f64::from(dims.query_heads)
                * f64::from(dims.d_qk + dims.d_v)
                * layers,
            indexer_flops_per_pair: 2.0 * 64.0 * 128.0 * layers,
            topk: dims.topk.map(u64::from),
        })
    }

    /// Paper 003's DS 27B (appendix A.2): hidden 2560, 30 layers (the first dense, FFN 12288),
    /// 32 heads, 72 routed experts of FFN 1536 with 6 active and 2 shared, an indexer of 32
    /// heads of 64 selecting 1024 keys, no query LoRA. Its MLA rows are taken as DS 660B's
    /// (576 / 512, "a similar architecture") and its cache as V3.2's FP8 format (656 bytes per
    /// token per layer). Active parameters per token, counted from those shapes: per MoE layer
    /// attention 32.0M (q 2560 x 32 x 192, kv_a 2560 x 576, kv_b 512 x 32 x 256, o 4096 x
    /// 2560) plus 8 experts x 3 x 2560 x 1536 = 94.4M; the dense layer 32.0M + 3 x 2560 x
    /// 12288 = 94.4M; 3.79B in all.
    pub fn ds_27b() -> Self {
        let layers = 30.0;
        let attention =
            2560.0 * 32.0 * 192.0 + 2560.0 * 576.0 + 512.0 * 32.0 * 256.0 + 4096.0 * 2560.0;
        let experts = 8.0 * 3.0 * 2560.0 * 1536.0;
        let dense = 3.0 * 2560.0 * 12288.0;
        let active = (layers - 1.0) * (attention + experts) + attention + dense;
        Self {
            name: "ds-27b",
            kv_bytes_per_token: 656.0 * layers,
            linear_flops_per_token: 2.0 * active,
            attn_flops_per_pair: 2.0 * 32.0 * (576.0 + 512.0) * layers,
            indexer_flops_per_pair: 2.0 * 32.0 * 64.0 * layers,
            topk: Some(1024),
        }
    }

    /// Attention (and indexer) FLOPs of `new` tokens whose first has `cached` tokens before
    /// it: token `p` (0-based position) attends `min(p + 1, topk)` keys and indexes `p + 1`.
    pub fn attention_flops(&self, cached: u64, new: u64) -> f64 {
        let (c, n) = (cached as f64, new as f64);
        // Sum over p in [c, c + n) of (p + 1) = n c + n (n + 1) / 2.
        let all_keys = n * c + n * (n + 1.0) / 2.0;
        let attended = match self.topk {
            None => all_keys,
            Some(k) => {
                let k = k as f64;
                // Positions below k - 1 attend p + 1 keys, the rest k.
                let below = (k - c).clamp(0.0, n);
                below * c + below * (below + 1.0) / 2.0 + (n - below) * k
            }
        };
        attended * self.attn_flops_per_pair + all_keys * self.indexer_flops_per_pair
    }

    /// Paper 003 section 3's cache-compute ratio: GB of cached KV to load per PFLOP of
    /// prefill, for a turn that appends `append` tokens to `context` cached ones.
    pub fn cache_compute_gb_per_pflop(&self, context: u64, append: u64) -> f64 {
        let bytes = context as f64 * self.kv_bytes_per_token;
        let flops =
            append as f64 * self.linear_flops_per_token + self.attention_flops(context, append);
        bytes / 1e9 / (flops / 1e15)
    }
}

/// The cluster and its constants.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ClusterConfig {
    /// Nodes and engines.
    pub topology: Topology,
    /// The model.
    pub model: ModelProfile,
    /// Effective prefill FLOP/s of one GPU.
    pub gpu_flops: f64,
    /// Storage NIC per node, Gbps.
    pub snic_gbps: f64,
    /// Compute NIC per GPU, Gbps.
    pub cnic_gbps: f64,
    /// Seconds per decode step.
    pub tpot_s: f64,
    /// KV bytes one DE holds in HBM.
    pub de_hbm_bytes: f64,
    /// Section 6.2's compute quota: predicted attention seconds per forward pass.
    pub compute_quota_s: f64,
    /// `alpha` as seconds of storage-NIC reading.
    pub short_read_queue_s: f64,
    /// `beta` as seconds of one GPU's prefill at the mean request's cost.
    pub max_unfinished_s: f64,
    /// Blocks of this many tokens are stored (and hit); partial blocks are recomputed.
    pub block_tokens: u64,
    /// Window of the storage-NIC balance metric, seconds.
    pub balance_window_s: f64,
}

impl ClusterConfig {
    /// Paper 003 section 7's DS 660B setup at `prefill_nodes` P `decode_nodes` D: 8 Hopper GPUs
    /// per node, one 400 Gbps storage NIC per node and one 400 Gbps compute NIC per GPU
    /// (section 7.2), compute quota 300 ms (A.4), TPOT 39 ms (table 3, 2P4D online), 64-token
    /// blocks (section 4.1). Not in the paper, chosen here: 400 TFLOP/s of effective prefill
    /// per GPU (40% of H800's 989 dense BF16), 40 GB of DE HBM for KV, `alpha` = 0.5 s of
    /// storage reading and `beta` = 2 s of GPU work (A.4 defines both this way; the values
    /// did not survive in our copy of the paper).
    pub fn paper_003(prefill_nodes: u32, decode_nodes: u32) -> Result<Self> {
        Ok(Self {
            topology: Topology {
                prefill_nodes,
                decode_nodes,
                engines_per_node: 8,
                nodes_per_group: 1,
            },
            model: ModelProfile::deepseek_v32()?,
            gpu_flops: 400e12,
            snic_gbps: 400.0,
            cnic_gbps: 400.0,
            tpot_s: 0.039,
            de_hbm_bytes: 40e9,
            compute_quota_s: 0.3,
            short_read_queue_s: 0.5,
            max_unfinished_s: 2.0,
            block_tokens: 64,
            balance_window_s: 1.0,
        })
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<()> {
        self.topology.validate()?;
        for (name, v) in [
            ("gpu_flops", self.gpu_flops),
            ("snic_gbps", self.snic_gbps),
            ("cnic_gbps", self.cnic_gbps),
            ("tpot_s", self.tpot_s),
            ("de_hbm_bytes", self.de_hbm_bytes),
            ("compute_quota_s", self.compute_quota_s),
            ("short_read_queue_s", self.short_read_queue_s),
            ("max_unfinished_s", self.max_unfinished_s),
            ("balance_window_s", self.balance_window_s),
            ("kv_bytes_per_token", self.model.kv_bytes_per_token),
            ("linear_flops_per_token", self.model.linear_flops_per_token),
            ("attn_flops_per_pair", self.model.attn_flops_per_pair),
        ] {
            positive(name, v)?;
        }
        if !(self.model.indexer_flops_per_pair.is_finite()
            && self.model.indexer_flops_per_pair >= 0.0)
        {
            return Err(SchedError::NotPositive {
                name: "indexer_flops_per_pair",
                value: self.model.indexer_flops_per_pair,
            });
        }
        count("block_tokens", self.block_tokens)?;
        Ok(())
    }

    pub(super) fn sched_config(
        &self,
        policy: Policy,
        mean_tokens: f64,
        mean_new: f64,
    ) -> SchedConfig {
        let per_request_s = (mean_new * self.model.linear_flops_per_token
            + self
                .model
                .attention_flops(mean_tokens as u64, mean_new as u64))
            / self.gpu_flops;
        let tokens_per_gpu_s = mean_tokens / per_request_s.max(1e-9);
        SchedConfig {
            policy,
            short_read_queue_bytes: self.short_read_queue_s * self.snic_gbps * 1e9 / 8.0,
            max_unfinished_tokens: self.max_unfinished_s * tokens_per_gpu_s,
            de_hbm_bytes: self.de_hbm_bytes,
            kv_bytes_per_token: self.model.kv_bytes_per_token,
        }
    }
}
