//! Helix Parallelism's roofline and HOP-B timeline (paper 004, "Helix Parallelism").
//!
//! During attention Helix shards the KV cache over `KVP` GPUs along the sequence and the heads
//! over `TPA <= K` GPUs; for the FFN the same `KVP x TPA` GPUs are re-provisioned as `TPF`-way
//! tensor parallelism (section 2). Decode is DRAM-bound, so appendix A prices a layer by the
//! bytes each GPU reads: its KV shard and its slice of the weights. HOP-B (section 2.1.3,
//! figure 3) overlaps each request's all-to-all with the next request's attention.

use serde::{Deserialize, Serialize};

use crate::error::{Result, count, non_negative, positive};

/// One Helix configuration of one transformer layer (paper 004 appendix A's symbols).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HelixLayout {
    /// `B`: batch size (decode tokens in flight).
    pub batch: u32,
    /// `Q`: query heads.
    pub q_heads: u32,
    /// `K`: KV heads.
    pub kv_heads: u32,
    /// `Hsz`: attention head size.
    pub head_size: u32,
    /// `S`: KV sequence length, tokens.
    pub seq_len: u64,
    /// `F`: FFN intermediate dimension.
    pub ffn_dim: u32,
    /// `TPA`: tensor-parallel width in attention (duplication of KV once above `K`).
    pub tpa: u32,
    /// `TPF`: tensor-parallel width in the FFN.
    pub tpf: u32,
    /// `KVP`: KV-parallel width (sequence shards).
    pub kvp: u32,
    /// `bytes_param`: bytes per weight and per KV element (0.5 for FP4).
    pub bytes_per_param: f64,
    /// `MemBW`: GPU memory bandwidth, GB/s.
    pub mem_bw_gbps: f64,
}

/// Appendix A's read times of one layer on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HelixRoofline {
    /// Time to read this GPU's KV shard, microseconds.
    pub kv_read_us: f64,
    /// Time to read this GPU's weight slice, microseconds.
    pub weight_read_us: f64,
    /// GPUs in the attention pool, `KVP x TPA`.
    pub gpus: u64,
}

impl HelixRoofline {
    /// Both reads together: the layer's DRAM-bound latency without communication.
    pub fn total_us(&self) -> f64 {
        self.kv_read_us + self.weight_read_us
    }
}

impl HelixLayout {
    /// Paper 004 figure 1's dense model on GB200 NVL72: B = 8, Q = 128, K = 8, Hsz = 128,
    /// F = 65536, FP4 weights and KV (0.5 B), MemBW = 8000 GB/s.
    pub const fn figure_1(seq_len: u64, tpa: u32, tpf: u32, kvp: u32) -> Self {
        Self {
            batch: 8,
            q_heads: 128,
            kv_heads: 8,
            head_size: 128,
            seq_len,
            ffn_dim: 65536,
            tpa,
            tpf,
            kvp,
            bytes_per_param: 0.5,
            mem_bw_gbps: 8000.0,
        }
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<()> {
        count("batch", self.batch)?;
        count("q_heads", self.q_heads)?;
        count("kv_heads", self.kv_heads)?;
        count("head_size", self.head_size)?;
        count("ffn_dim", self.ffn_dim)?;
        count("tpa", self.tpa)?;
        count("tpf", self.tpf)?;
        count("kvp", self.kvp)?;
        positive("seq_len", self.seq_len as f64)?;
        positive("bytes_per_param", self.bytes_per_param)?;
        positive("mem_bw_gbps", self.mem_bw_gbps)?;
        Ok(())
    }

    /// `H = Q x Hsz`.
    pub const fn hidden(&self) -> u64 {
        self.q_heads as u64 * self.head_size as u64
    }

    /// KV heads each attention GPU holds, `ceil(K / TPA)`: one once `TPA >= K` (duplication).
    pub const fn kv_heads_per_gpu(&self) -> u32 {
        self.kv_heads.div_ceil(self.tpa)
    }

    /// Appendix A's two read times.
    pub fn roofline(&self) -> Result<HelixRoofline> {
        self.validate()?;
        let bytes_per_us = self.mem_bw_gbps * 1e3;
        let (b, hsz, h) = (
            f64::from(self.batch),
            f64::from(self.head_size),
            self.hidden() as f64,
        );
        let kv_heads = f64::from(self.kv_heads_per_gpu());
        // B x 2 x ceil(K/TPA) x Hsz x S/KVP x bytes_param / MemBW
        let kv_bytes = b
            * 2.0
            * kv_heads
            * hsz
            * (self.seq_len as f64 / f64::from(self.kvp))
            * self.bytes_per_param;
        // (2 H Q/TPA Hsz + 2 H ceil(K/TPA) Hsz + 3 H F / TPF) x bytes_param / MemBW (SwiGLU FFN)
        let q_heads = f64::from(self.q_heads) / f64::from(self.tpa);
        let weights = 2.0 * h * q_heads * hsz
            + 2.0 * h * kv_heads * hsz
            + 3.0 * h * f64::from(self.ffn_dim) / f64::from(self.tpf);
        Ok(HelixRoofline {
            kv_read_us: kv_bytes / bytes_per_us,
            weight_read_us: weights * self.bytes_per_param / bytes_per_us,
            gpus: u64::from(self.kvp) * u64::from(self.tpa),
        })
    }
}

/// Requests whose attention is followed by an all-to-all (paper 004 figure 3).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HopB {
    /// Requests in the batch.
    pub requests: u32,
    /// Attention time of one request (any unit).
    pub attention_per_request: f64,
    /// All-to-all time of one request (same unit).
    pub comm_per_request: f64,
}

/// The span of a batch with and without HOP-B, and the communication each leaves exposed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HopBTimeline {
    /// Lockstep: all attention, then all communication.
    pub span_without: f64,
    /// Pipelined: request i's all-to-all overlaps request i+1's attention.
    pub span_with: f64,
    /// Communication not hidden behind compute, without HOP-B.
    pub exposed_comm_without: f64,
    /// Communication not hidden behind compute, with HOP-B.
    pub exposed_comm_with: f64,
}

impl HopB {
    /// Paper 004 figure 3: 8 requests, 2 units of attention and 1.2 of all-to-all each.
    pub const FIGURE_3: Self = Self {
        requests: 8,
        attention_per_request: 2.0,
        comm_per_request: 1.2,
    };

    /// The two timelines. With one compute stream and one link, pipelining identical requests
    /// is a two-stage flow shop: the span is `c + m + (n - 1) max(c, m)`.
    pub fn timeline(&self) -> Result<HopBTimeline> {
        count("requests", self.requests)?;
        non_negative("attention_per_request", self.attention_per_request)?;
        non_negative("comm_per_request", self.comm_per_request)?;
        let (n, c, m) = (
            f64::from(self.requests),
            self.attention_per_request,
            self.comm_per_request,
        );
        let compute = n * c;
        let span_without = compute + n * m;
        let span_with = c + m + (n - 1.0) * c.max(m);
        Ok(HopBTimeline {
            span_without,
            span_with,
            exposed_comm_without: span_without - compute,
            exposed_comm_with: span_with - compute,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Paper 004 figure 3: 8 requests x (16 units of attention + 9.6 of all-to-all) span 25.6
    /// units in lockstep and about 17 with HOP-B (exactly 17.2: 16 of compute plus the last
    /// request's 1.2 of communication).
    #[test]
    fn figure_3_hop_b_cuts_25_6_units_to_about_17() {
        let t = HopB::FIGURE_3.timeline().unwrap();
        assert!((t.span_without - 25.6).abs() < 1e-9, "{t:?}");
        assert!((t.span_with - 17.0).abs() <= 0.25, "{t:?}");
        assert!(
            (t.exposed_comm_with - 1.2).abs() < 1e-9 && (t.exposed_comm_without - 9.6).abs() < 1e-9
        );
    }

    #[test]
    fn communication_longer_than_compute_is_exposed_per_request() {
        let t = HopB {
            requests: 4,
            attention_per_request: 1.0,
            comm_per_request: 3.0,
        }
        .timeline()
        .unwrap();
        assert_eq!(t.span_with, 1.0 + 4.0 * 3.0);
        assert_eq!(t.span_without, 16.0);
    }

    /// Appendix A by hand at 1M tokens, TPA = 8, KVP = 1, figure 1's model: the KV shard is
    /// 8 x 2 x 1 x 128 x 1e6 x 0.5 B = 1.024 GB, 128 us at 8000 GB/s; the weights are
    /// (2 x 16384 x 16 x 128 + 2 x 16384 x 1 x 128 + 3 x 16384 x 65536 / 8) x 0.5 B.
    #[test]
    fn appendix_a_read_times_match_a_hand_evaluation() {
        let r = HelixLayout::figure_1(1_000_000, 8, 8, 1)
            .roofline()
            .unwrap();
        assert!((r.kv_read_us - 128.0).abs() < 1e-9, "{r:?}");
        let weight_bytes =
            (2.0 * 16384.0 * 16.0 * 128.0 + 2.0 * 16384.0 * 128.0 + 3.0 * 16384.0 * 65536.0 / 8.0)
                * 0.5;
        assert!(
            (r.weight_read_us - weight_bytes / 8e6).abs() < 1e-9,
            "{r:?}"
        );
        assert_eq!(r.gpus, 8);
    }

    /// Figure 1 (left): KV read time stops improving once TP exceeds K (each GPU keeps a whole
    /// KV head), while (right) KVP keeps dividing it.
    #[test]
    fn kv_reads_plateau_beyond_tp_equal_k_but_keep_falling_with_kvp() {
        let kv = |tp: u32, kvp: u32| {
            HelixLayout::figure_1(1 << 20, tp, tp, kvp)
                .roofline()
                .unwrap()
                .kv_read_us
        };
        assert!(kv(4, 1) > kv(8, 1));
        assert_eq!(kv(8, 1), kv(16, 1));
        assert_eq!(kv(8, 1), kv(64, 1));
        assert!((kv(8, 1) / kv(8, 4) - 4.0).abs() < 1e-9);
    }

    #[test]
    fn bad_layouts_are_typed_errors() {
        assert!(
            HelixLayout {
                tpa: 0,
                ..HelixLayout::figure_1(1, 1, 1, 1)
            }
            .roofline()
            .is_err()
        );
        assert!(
            HelixLayout {
                seq_len: 0,
                ..HelixLayout::figure_1(1, 1, 1, 1)
            }
            .roofline()
            .is_err()
        );
        assert!(
            HelixLayout {
                mem_bw_gbps: f64::NAN,
                ..HelixLayout::figure_1(1, 1, 1, 1)
            }
            .roofline()
            .is_err()
        );
        assert!(
            HopB {
                requests: 0,
                ..HopB::FIGURE_3
            }
            .timeline()
            .is_err()
        );
        assert!(
            HopB {
                comm_per_request: -1.0,
                ..HopB::FIGURE_3
            }
            .timeline()
            .is_err()
        );
    }
}
