//! A discrete-event simulation of a PD-disaggregated cluster loading cached KV from storage
//! (paper 003), driven by the [`DualPath`] scheduler under any of its policies.
//!
//! Resources:
//!
//! - one storage NIC per node (`snic_gbps`, section 7.2: 400 Gbps, shared by the node's
//!   engines), a FIFO of reads; a request's cached KV (`hit_tokens x kv_bytes_per_token`) is
//!   read through the PE's node or the DE's node as the scheduler decides;
//! - one compute NIC per engine (`cnic_gbps`, 400 Gbps), a FIFO for the hop that brings a
//!   request's cached KV into the PE's HBM once it is read: on the PE path through the PE's
//!   NIC (section 5.2's CNIC-assisted host-to-device copy), on the DE path through the DE's NIC
//!   and the PE's (the request is ready when both are through). The hop is taken whole before
//!   prefill starts, where the paper overlaps it layer by layer: conservative by one hop. The
//!   rest of the compute-NIC traffic (the prompt's KV to the DE after prefill) is counted, not
//!   queued: section 4.2 shows it is not the bottleneck at practical P/D ratios, and
//!   `cnic_peak_utilization` says how far from it a run was;
//! - prefill nodes run forward passes in lock step (one expert-parallel group per node). Each
//!   PE fills its part of the batch FIFO under the compute quota of section 6.2 (predicted
//!   attention time at most `compute_quota_s`, the last request chunked by binary search);
//!   a pass takes the slowest PE's attention time plus the FFN time of all the node's tokens
//!   spread over its GPUs;
//! - decode engines hold a request from the moment its KV arrives for `gen_tokens x tpot_s`
//!   (HBM reserved by the scheduler at placement).
//!
//! The same request stream runs under each policy; `throughput_ratio` compares makespans.
//! Balance is paper 003's max/avg: storage-NIC read bytes per `balance_window_s` across all
//! nodes (figure 13), and attention time across the PEs of one forward pass (figure 14),
//! both averaged over the loaded phase, until half of the requests have finished.

use std::collections::VecDeque;

use kvroute_costmodel::model_preset;
use kvroute_kvstore::{Eviction, PrefixCache, TraceRecord};
use serde::Serialize;

use crate::des::{EventQueue, FifoLink, Nanos, nanos, seconds};
use crate::dualpath::{
    DualPath, Placement, Policy, ReadSide, Request, Requeued, SchedConfig, Topology, pack_forward,
};
use crate::error::{Result, SchedError, count, positive};
use crate::rng::Rng;
use crate::stats::{Percentiles, max_over_avg};
use crate::window_totals::WindowTotals;

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

    fn sched_config(&self, policy: Policy, mean_tokens: f64, mean_new: f64) -> SchedConfig {
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

/// One turn of an agent: tokens appended to the context, then tokens generated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Turn {
    /// Tokens appended (tool output, user input; the first turn's is the initial prompt).
    pub append: u64,
    /// Tokens generated.
    pub generate: u64,
}

/// What to replay.
#[derive(Debug, Clone)]
pub enum Arrivals {
    /// Offline rollout (section 7.3): every agent starts at time 0 and sends its next turn
    /// when the previous one finishes (no tool latency).
    Agents(Vec<Vec<Turn>>),
    /// Requests at fixed times (an online trace).
    Open(Vec<(Nanos, Request)>),
}

impl Arrivals {
    /// Requests in all.
    pub fn requests(&self) -> usize {
        match self {
            Arrivals::Agents(a) => a.iter().map(Vec::len).sum(),
            Arrivals::Open(r) => r.len(),
        }
    }
}

/// Synthetic agent trajectories shaped like paper 003 table 2.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AgenticSpec {
    /// Agents.
    pub agents: u32,
    /// Trajectories end before the context would pass this (MaxLen).
    pub max_len: u64,
    /// Mean initial prompt, tokens (exponential).
    pub initial_mean: f64,
    /// Mean tokens appended per later turn (exponential).
    pub append_mean: f64,
    /// Mean tokens generated per turn (exponential).
    pub gen_mean: f64,
    /// Seed.
    pub seed: u64,
}

impl AgenticSpec {
    /// Table 2's 64K row: appends of 429 and generations of 176 tokens on average, contexts
    /// up to 64K. The initial prompt's mean (8K) is chosen here so the mean context per turn
    /// lands near the table's 32.7K.
    pub fn paper_003_64k(agents: u32, seed: u64) -> Self {
        Self {
            agents,
            max_len: 65_536,
            initial_mean: 8192.0,
            append_mean: 429.0,
            gen_mean: 176.0,
            seed,
        }
    }

    /// The trajectories.
    pub fn generate(&self) -> Result<Vec<Vec<Turn>>> {
        count("agents", u64::from(self.agents))?;
        count("max_len", self.max_len)?;
        positive("initial_mean", self.initial_mean)?;
        positive("append_mean", self.append_mean)?;
        positive("gen_mean", self.gen_mean)?;
        let mut rng = Rng::new(self.seed);
        let draw = |rng: &mut Rng, mean: f64| (rng.exponential(mean).round() as u64).max(1);
        Ok((0..self.agents)
            .map(|_| {
                let mut turns = Vec::new();
                let mut context = 0;
                let mut append = draw(&mut rng, self.initial_mean).min(self.max_len / 2);
                loop {
                    let generate = draw(&mut rng, self.gen_mean);
                    if context + append + generate > self.max_len && !turns.is_empty() {
                        break;
                    }
                    turns.push(Turn { append, generate });
                    context += append + generate;
                    append = draw(&mut rng, self.append_mean);
                }
                turns
            })
            .collect())
    }
}

/// Requests of a Mooncake-format trace, `scale` copies (disjoint prefixes, same arrival
/// times), hits from an unbounded store of the trace's blocks (a block is a hit if it was
/// seen before as part of the request's longest cached prefix; at least one token is always
/// computed). Arrival times are divided by `time_scale`.
pub fn trace_arrivals(
    records: &[TraceRecord],
    block_tokens: u32,
    scale: u32,
    time_scale: f64,
) -> Result<Arrivals> {
    count("scale", u64::from(scale))?;
    count("block_tokens", u64::from(block_tokens))?;
    positive("time_scale", time_scale)?;
    if records.is_empty() {
        return Err(SchedError::EmptyWorkload);
    }
    let mut cache = PrefixCache::<()>::new(0, Eviction::Lru);
    let mut base = Vec::with_capacity(records.len());
    for r in records {
        let hit = (cache.longest_prefix(&r.hash_ids) as u64 * u64::from(block_tokens))
            .min(r.input_length.saturating_sub(1));
        cache.access(&r.hash_ids, |_| (), &mut |_, _| ())?;
        base.push((
            nanos(r.timestamp_ms as f64 * 1e-3 / time_scale),
            hit,
            r.input_length - hit,
            r.output_length.max(1),
        ));
    }
    let mut out = Vec::with_capacity(base.len() * scale as usize);
    for &(at, hit, miss, generate) in &base {
        for _ in 0..scale {
            let id = out.len() as u64;
            out.push((
                at,
                Request {
                    id,
                    hit_tokens: hit,
                    miss_tokens: miss.max(1),
                    gen_tokens: generate,
                },
            ));
        }
    }
    Ok(Arrivals::Open(out))
}

/// A point of the time series (for plots).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SeriesPoint {
    /// Window start, seconds.
    pub t_s: f64,
    /// Prompt and generated tokens finished in the window, per second.
    pub tokens_per_s: f64,
    /// Storage-NIC read bytes max/avg across nodes in the window (`None`: no reads).
    pub snic_max_over_avg: Option<f64>,
    /// Mean over the window's forward passes of PE attention-time max/avg (`None`: none).
    pub attention_max_over_avg: Option<f64>,
}

/// What one run measured.
#[derive(Debug, Clone, Serialize)]
pub struct DualPathRun {
    /// The policy.
    pub policy: &'static str,
    /// Requests.
    pub requests: u64,
    /// Time of the last completion, seconds (the offline JCT).
    pub makespan_s: f64,
    /// Requests finished per second over the makespan.
    pub throughput_rps: f64,
    /// Prompt and generated tokens finished per second over the makespan.
    pub throughput_tokens_per_s: f64,
    /// Arrival to end of prefill (first token), seconds.
    pub ttft_s: Percentiles,
    /// Time between tokens, seconds (the configured decode step).
    pub tbt_s: f64,
    /// Storage-NIC read bytes per node.
    pub snic_read_bytes: Vec<f64>,
    /// Storage-NIC write bytes per node (new blocks persisted by the DEs).
    pub snic_write_bytes: Vec<f64>,
    /// Mean over loaded-phase windows of storage-NIC max/avg.
    pub snic_balance: Option<f64>,
    /// Mean over loaded-phase forward passes of PE attention-time max/avg.
    pub attention_balance: Option<f64>,
    /// Fraction of cached bytes read on the DE side.
    pub decode_side_read_fraction: f64,
    /// Compute-NIC bytes per engine, busiest engine, over its capacity for the makespan.
    pub cnic_peak_utilization: f64,
    /// Mean busy fraction of the prefill nodes.
    pub prefill_busy: f64,
    /// Events simulated.
    pub events: u64,
    /// Per-window series (for plots; left out of JSON): a point for every window in which
    /// something happened, and for each stretch of idle windows between them only its first
    /// and last window, so that a line through the points is the line through every window
    /// and a trace with long gaps costs no point per idle second.
    #[serde(skip)]
    pub series: Vec<SeriesPoint>,
}

#[derive(Debug, Clone, Copy)]
enum Event {
    Arrive(u32),
    ReadDone(u32),
    Landed(u32),
    ForwardDone(u32),
    DecodeDone(u32),
    Fail(u32),
}

#[derive(Debug, Clone, Copy)]
struct Live {
    request: Request,
    arrival: Nanos,
    agent: u32,
    turn: u32,
    remaining: u64,
    pe: u32,
    de: u32,
    read: ReadSide,
    /// Bumped when the request is requeued, so stale events of an earlier placement are
    /// recognised and dropped.
    epoch: u32,
    done: bool,
    /// Whether a first token was produced (a request restarted after a DE failure keeps its
    /// first TTFT).
    first_token: bool,
}

/// A failure to inject: engine `engine` dies at `at_s`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Failure {
    /// Seconds from the start.
    pub at_s: f64,
    /// The engine.
    pub engine: u32,
}

struct Sim<'a> {
    cfg: &'a ClusterConfig,
    policy: Policy,
    /// Requests in all (agents' later turns included).
    total: usize,
    sched: DualPath,
    q: EventQueue<(Event, u32)>,
    live: Vec<Live>,
    agents: &'a [Vec<Turn>],
    snic_read: Vec<FifoLink>,
    snic_write: Vec<f64>,
    cnic: Vec<f64>,
    cnic_link: Vec<FifoLink>,
    ready: Vec<VecDeque<u32>>,
    node_busy: Vec<bool>,
    /// The batches of each node's pass in flight: (request, tokens computed, its epoch).
    batch: Vec<Vec<(u32, u64, u32)>>,
    busy_ns: Vec<u64>,
    windows: WindowTotals,
    /// Attention max/avg of each forward pass, at its start.
    attention: Vec<(Nanos, f64)>,
    ttft: Vec<f64>,
    completions: Vec<Nanos>,
    decode_side_bytes: f64,
    read_bytes: f64,
    placements: Vec<Placement>,
    requeued: Vec<Requeued>,
    finished_tokens: f64,
}

impl Sim<'_> {
    fn new_request(&mut self, request: Request, arrival: Nanos, agent: u32, turn: u32) -> u32 {
        let i = self.live.len() as u32;
        self.live.push(Live {
            request,
            arrival,
            agent,
            turn,
            remaining: request.miss_tokens,
            pe: 0,
            de: 0,
            read: ReadSide::Prefill,
            epoch: 0,
            done: false,
            first_token: false,
        });
        i
    }

    fn agent_request(&mut self, agent: u32, turn: u32, context: u64, now: Nanos) -> u32 {
        let t = self.agents[agent as usize][turn as usize];
        let b = self.cfg.block_tokens;
        let hit = context / b * b;
        let id = self.live.len() as u64;
        let request = Request {
            id,
            hit_tokens: hit,
            miss_tokens: context - hit + t.append,
            gen_tokens: t.generate,
        };
        self.new_request(request, now, agent, turn)
    }

    fn schedule(&mut self, now: Nanos) {
        let mut placements = std::mem::take(&mut self.placements);
        self.sched.schedule(&mut placements);
        for p in placements.drain(..) {
            let i = p.request.id as u32;
            let l = &mut self.live[i as usize];
            l.pe = p.pe;
            l.de = p.de;
            l.read = p.read;
            l.remaining = p.request.miss_tokens;
            let epoch = l.epoch;
            let bytes = p.request.hit_tokens as f64 * self.cfg.model.kv_bytes_per_token;
            let link = &mut self.snic_read[p.read_node as usize];
            let end = link.push(now, bytes);
            let took = nanos(bytes / (self.cfg.snic_gbps * 1e9 / 8.0));
            self.windows
                .add_read(p.read_node, end.saturating_sub(took), end, bytes);
            self.read_bytes += bytes;
            let pe_cnic = bytes + p.request.tokens() as f64 * self.cfg.model.kv_bytes_per_token;
            match p.read {
                ReadSide::Prefill => {
                    self.cnic[p.pe as usize] += pe_cnic;
                    self.cnic[p.de as usize] +=
                        p.request.tokens() as f64 * self.cfg.model.kv_bytes_per_token;
                }
                ReadSide::Decode => {
                    self.decode_side_bytes += bytes;
                    let new = p.request.miss_tokens as f64 * self.cfg.model.kv_bytes_per_token;
                    self.cnic[p.pe as usize] += bytes + new;
                    self.cnic[p.de as usize] += bytes + new;
                }
            }
            self.q.at(end, (Event::ReadDone(i), epoch));
        }
        self.placements = placements;
    }

    fn start_forward(&mut self, node: u32, now: Nanos) {
        if self.node_busy[node as usize] {
            return;
        }
        let per = self.cfg.topology.engines_per_node;
        let mut attn = Vec::with_capacity(per as usize);
        let mut batch = std::mem::take(&mut self.batch[node as usize]);
        batch.clear();
        let mut new_tokens = 0u64;
        for e in node * per..(node + 1) * per {
            let ready = &self.ready[e as usize];
            let live = &self.live;
            let (model, flops) = (&self.cfg.model, self.cfg.gpu_flops);
            let spent = pack_forward(
                ready.iter().map(|&i| {
                    let l = &live[i as usize];
                    (l.request.tokens() - l.remaining, l.remaining)
                }),
                self.cfg.compute_quota_s,
                |cached, n| model.attention_flops(cached, n) / flops,
                |k, take| {
                    let i = ready[k];
                    new_tokens += take;
                    batch.push((i, take, live[i as usize].epoch));
                },
            );
            attn.push(spent);
        }
        if batch.is_empty() {
            self.batch[node as usize] = batch;
            return;
        }
        let ffn = new_tokens as f64 * self.cfg.model.linear_flops_per_token
            / (f64::from(per) * self.cfg.gpu_flops);
        let slowest = attn.iter().copied().fold(0.0, f64::max);
        if let Some(b) = max_over_avg(&attn) {
            self.attention.push((now, b));
        }
        let took = nanos(slowest + ffn).max(1);
        self.busy_ns[node as usize] += took;
        self.node_busy[node as usize] = true;
        self.batch[node as usize] = batch;
        self.q.after(took, (Event::ForwardDone(node), 0));
    }

    fn forward_done(&mut self, node: u32, now: Nanos) {
        self.node_busy[node as usize] = false;
        let batch = std::mem::take(&mut self.batch[node as usize]);
        for &(i, took, epoch) in &batch {
            let l = &mut self.live[i as usize];
            if l.epoch != epoch || l.done {
                // Requeued by a failure while in the pass: its progress is lost.
                continue;
            }
            l.remaining = l.remaining.saturating_sub(took);
            if l.remaining > 0 {
                continue;
            }
            let pe = l.pe;
            let r = l.request;
            if let Some(pos) = self.ready[pe as usize].iter().position(|&x| x == i) {
                self.ready[pe as usize].remove(pos);
            }
            if !l.first_token {
                l.first_token = true;
                self.ttft.push(seconds(now - l.arrival));
            }
            self.sched.prefill_done(r.id);
            // The KV reaches the DE over the compute network (not a bottleneck: counted at
            // placement); decoding starts at once in the HBM reserved for it.
            self.q.after(
                nanos(r.gen_tokens as f64 * self.cfg.tpot_s),
                (Event::DecodeDone(i), epoch),
            );
        }
        self.batch[node as usize] = batch;
        self.start_forward(node, now);
    }
}

/// Section 6.1's beta is in tokens: derived from the workload's mean request, `(prompt
/// tokens, new tokens)`.
fn mean_request(arrivals: &Arrivals) -> (f64, f64) {
    match arrivals {
        Arrivals::Open(r) => {
            let n = r.len() as f64;
            (
                r.iter().map(|(_, q)| q.tokens() as f64).sum::<f64>() / n,
                r.iter().map(|(_, q)| q.miss_tokens as f64).sum::<f64>() / n,
            )
        }
        Arrivals::Agents(a) => {
            let (mut ctx_sum, mut new_sum, mut n) = (0.0, 0.0, 0.0);
            for turns in a {
                let mut ctx = 0;
                for t in turns {
                    ctx_sum += (ctx + t.append) as f64;
                    new_sum += t.append as f64;
                    n += 1.0;
                    ctx += t.append + t.generate;
                }
            }
            (ctx_sum / n, new_sum / n)
        }
    }
}

impl<'a> Sim<'a> {
    /// A cluster at time 0 with `arrivals` and `failures` scheduled.
    fn new(
        cfg: &'a ClusterConfig,
        policy: Policy,
        arrivals: &'a Arrivals,
        failures: &[Failure],
    ) -> Result<Self> {
        cfg.validate()?;
        let total = arrivals.requests();
        if total == 0 {
            return Err(SchedError::EmptyWorkload);
        }
        if total > u32::MAX as usize {
            return Err(SchedError::OutOfRange {
                name: "requests",
                value: total as f64,
                range: "at most 2^32 - 1",
            });
        }
        let (mean_tokens, mean_new) = mean_request(arrivals);
        let topo = cfg.topology;
        let nodes = topo.nodes() as usize;
        let engines = topo.engines() as usize;
        let mut sim = Sim {
            cfg,
            policy,
            total,
            sched: DualPath::new(topo, cfg.sched_config(policy, mean_tokens, mean_new))?,
            q: EventQueue::new(),
            live: Vec::with_capacity(total),
            agents: match arrivals {
                Arrivals::Agents(a) => a.as_slice(),
                Arrivals::Open(_) => &[],
            },
            snic_read: (0..nodes)
                .map(|_| FifoLink::new(cfg.snic_gbps * 1e9 / 8.0))
                .collect(),
            snic_write: vec![0.0; nodes],
            cnic: vec![0.0; engines],
            cnic_link: (0..engines)
                .map(|_| FifoLink::new(cfg.cnic_gbps * 1e9 / 8.0))
                .collect(),
            ready: vec![VecDeque::new(); engines],
            node_busy: vec![false; nodes],
            batch: vec![Vec::new(); nodes],
            busy_ns: vec![0; nodes],
            windows: WindowTotals::new(nanos(cfg.balance_window_s).max(1), nodes),
            attention: Vec::new(),
            ttft: Vec::with_capacity(total),
            completions: Vec::with_capacity(total),
            decode_side_bytes: 0.0,
            read_bytes: 0.0,
            placements: Vec::new(),
            requeued: Vec::new(),
            finished_tokens: 0.0,
        };
        match arrivals {
            Arrivals::Open(requests) => {
                for (n, &(at, r)) in requests.iter().enumerate() {
                    let i = sim.new_request(Request { id: n as u64, ..r }, at, u32::MAX, 0);
                    sim.q.at(at, (Event::Arrive(i), 0));
                }
            }
            Arrivals::Agents(a) => {
                for (agent, turns) in a.iter().enumerate() {
                    if !turns.is_empty() {
                        let i = sim.agent_request(agent as u32, 0, 0, 0);
                        sim.q.at(0, (Event::Arrive(i), 0));
                    }
                }
            }
        }
        for f in failures {
            sim.q.at(nanos(f.at_s), (Event::Fail(f.engine), 0));
        }
        Ok(sim)
    }

    /// Pops events until none is left.
    fn run(&mut self) -> Result<()> {
        let topo = self.cfg.topology;
        while let Some((now, (event, epoch))) = self.q.pop() {
            match event {
                Event::Arrive(i) => {
                    self.sched.submit(self.live[i as usize].request)?;
                    self.schedule(now);
                }
                Event::ReadDone(i) => self.read_done(i, epoch, now),
                Event::Landed(i) => {
                    let l = self.live[i as usize];
                    if l.epoch != epoch || l.done {
                        continue;
                    }
                    self.ready[l.pe as usize].push_back(i);
                    self.start_forward(topo.node_of(l.pe), now);
                    self.schedule(now);
                }
                Event::ForwardDone(node) => {
                    self.forward_done(node, now);
                    self.schedule(now);
                }
                Event::DecodeDone(i) => self.decode_done(i, epoch, now),
                Event::Fail(e) => self.engine_failed(e, now),
            }
        }
        Ok(())
    }

    fn read_done(&mut self, i: u32, epoch: u32, now: Nanos) {
        let l = self.live[i as usize];
        if l.epoch != epoch || l.done {
            return;
        }
        self.sched.read_done(l.request.id);
        // The hop into the PE's HBM.
        let bytes = l.request.hit_tokens as f64 * self.cfg.model.kv_bytes_per_token;
        let mut landed = self.cnic_link[l.pe as usize].push(now, bytes);
        if l.read == ReadSide::Decode {
            landed = landed.max(self.cnic_link[l.de as usize].push(now, bytes));
        }
        self.q.at(landed, (Event::Landed(i), epoch));
    }

    fn decode_done(&mut self, i: u32, epoch: u32, now: Nanos) {
        let l = self.live[i as usize];
        if l.epoch != epoch || l.done {
            return;
        }
        self.live[i as usize].done = true;
        self.sched.decode_done(l.request.id);
        let r = l.request;
        let kv_bytes_per_token = self.cfg.model.kv_bytes_per_token;
        let node = self.cfg.topology.node_of(l.de) as usize;
        self.snic_write[node] += (r.miss_tokens + r.gen_tokens) as f64 * kv_bytes_per_token;
        self.completions.push(now);
        let tokens = (r.tokens() + r.gen_tokens) as f64;
        self.finished_tokens += tokens;
        self.windows.add_done(now, tokens);
        let agents = self.agents;
        if l.agent != u32::MAX && ((l.turn + 1) as usize) < agents[l.agent as usize].len() {
            let context = r.tokens() + r.gen_tokens;
            let next = self.agent_request(l.agent, l.turn + 1, context, now);
            self.q.at(now, (Event::Arrive(next), 0));
        }
        self.schedule(now);
    }

    fn engine_failed(&mut self, e: u32, now: Nanos) {
        let mut requeued = std::mem::take(&mut self.requeued);
        requeued.clear();
        self.sched.engine_failed(e, &mut requeued);
        for r in &requeued {
            let i = r.request.id as usize;
            self.live[i].epoch += 1;
            let pe = r.was.pe as usize;
            if let Some(pos) = self.ready[pe].iter().position(|&x| x == i as u32) {
                self.ready[pe].remove(pos);
            }
            // A pass in flight that holds it keeps its slot; its progress is dropped by the
            // epoch check of `forward_done` (the request starts over).
            self.live[i].remaining = r.request.miss_tokens;
        }
        self.requeued = requeued;
        // A dead PE's queued work is gone with it.
        if (e as usize) < self.ready.len() {
            self.ready[e as usize].clear();
        }
        self.schedule(now);
    }

    /// What the run measured; an error if requests were left unfinished.
    fn report(mut self) -> Result<DualPathRun> {
        let (cfg, total) = (self.cfg, self.total);
        let completed = self.completions.len();
        if completed != total {
            return Err(SchedError::OutOfRange {
                name: "requests unfinished",
                value: (total - completed) as f64,
                range: "0: no engine left that can serve them",
            });
        }
        let makespan = self.completions.iter().copied().max().unwrap_or(0);
        let makespan_s = seconds(makespan).max(1e-9);
        let mut sorted = self.completions.clone();
        sorted.sort_unstable();
        let half = sorted[(completed - 1) / 2];
        let summary = self.windows.summarise(&self.attention, half);
        let loaded_attention: Vec<f64> = self
            .attention
            .iter()
            .filter(|(t, _)| *t <= half)
            .map(|&(_, b)| b)
            .collect();
        let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
        let cnic_capacity = cfg.cnic_gbps * 1e9 / 8.0 * makespan_s;
        let prefill_nodes = cfg.topology.prefill_nodes as usize;
        Ok(DualPathRun {
            policy: self.policy.name(),
            requests: total as u64,
            makespan_s,
            throughput_rps: completed as f64 / makespan_s,
            throughput_tokens_per_s: self.finished_tokens / makespan_s,
            ttft_s: Percentiles::of(&mut self.ttft),
            tbt_s: cfg.tpot_s,
            snic_read_bytes: self.snic_read.iter().map(|l| l.bytes).collect(),
            snic_write_bytes: self.snic_write,
            snic_balance: mean(&summary.balances),
            attention_balance: mean(&loaded_attention),
            decode_side_read_fraction: self.decode_side_bytes / self.read_bytes.max(1.0),
            cnic_peak_utilization: self.cnic.iter().copied().fold(0.0, f64::max) / cnic_capacity,
            prefill_busy: self.busy_ns[..prefill_nodes]
                .iter()
                .map(|&b| seconds(b))
                .sum::<f64>()
                / (prefill_nodes as f64 * makespan_s),
            events: self.q.popped(),
            series: summary.series,
        })
    }
}

/// Runs `arrivals` through the cluster under `policy`, with `failures` injected.
pub fn simulate(
    cfg: &ClusterConfig,
    policy: Policy,
    arrivals: &Arrivals,
    failures: &[Failure],
) -> Result<DualPathRun> {
    let mut sim = Sim::new(cfg, policy, arrivals, failures)?;
    sim.run()?;
    sim.report()
}

/// Every policy on the same arrivals.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// DualPath, round robin, storage-to-prefill only.
    pub runs: Vec<DualPathRun>,
    /// DualPath's throughput over the storage-to-prefill baseline's (makespan ratio).
    pub throughput_ratio_vs_prefill_read: f64,
    /// DualPath's over round robin's.
    pub throughput_ratio_vs_round_robin: f64,
}

/// Runs DualPath and both baselines on `arrivals`.
pub fn compare(cfg: &ClusterConfig, arrivals: &Arrivals) -> Result<Comparison> {
    let runs = Policy::ALL
        .iter()
        .map(|&p| simulate(cfg, p, arrivals, &[]))
        .collect::<Result<Vec<_>>>()?;
    Ok(Comparison {
        throughput_ratio_vs_prefill_read: runs[2].makespan_s / runs[0].makespan_s,
        throughput_ratio_vs_round_robin: runs[1].makespan_s / runs[0].makespan_s,
        runs,
    })
}

#[cfg(test)]
mod tests;
