//! One rank of a Helix layer, and the single-rank reference it is checked against.
//!
//! A decode step on rank `r` (paper 004 section 2, figure 4):
//! 1. append each request's new token to the KV shard that the staged round-robin placement
//!    gives it ([`crate::Placement`]), if that shard is `r`'s;
//! 2. attend: for each request, the query heads of `r`'s head group over `r`'s shard, giving
//!    partials `(o, m, l)`;
//! 3. all-to-all within the KVP domain: the partials of the heads rank `d` owns go to `d`
//!    (one round per request, so that with HOP-B a request's exchange overlaps the next
//!    request's attention, section 2.1.3);
//! 4. merge the domain's partials of its own heads exactly;
//! 5. project them with its rows of `W_o` and all-reduce over all `N` ranks (TP = N);
//! 6. normalise (RMS) and run its FFN shard (dense: columns of gate/up and rows of down, TPF = N; MoE: the
//!    experts of its expert group, each TPF-sharded) and all-reduce the result.
//!
//! The all-reduces are a reduce-scatter then an all-gather (two exchange rounds): each slice
//! is summed by one rank in rank order, so every rank ends with the same bits and the MoE
//! router (run on every rank from the reduced input) makes the same choice everywhere.

use std::time::{Duration, Instant};

use kvroute_transport::TransferEngine;
use serde::{Deserialize, Serialize};

use crate::attention::{Partials, Query, Shard, merge};
use crate::error::{HelixError, Result};
use crate::exchange::{Exchange, Posted, StepPlan};
use crate::layout::Layout;
use crate::model::{Ffn, Shape, block, init_scale, matmul_acc, rms_norm, route, stream, swiglu};
use crate::placement::Placement;
use crate::rendezvous::Rendezvous;

/// Everything that defines a Helix layer and its workload.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HelixConfig {
    /// The two grids.
    pub layout: Layout,
    /// The layer.
    pub shape: Shape,
    /// Requests decoded together (one token each per step).
    pub batch: usize,
    /// Tokens of context each request starts with.
    pub ctx: u64,
    /// Tokens appended to one KV shard before the next (staged round-robin).
    pub stage: usize,
    /// Seed of every weight, token and query.
    pub seed: u64,
    /// How long a rank waits for its peers before failing the step.
    pub timeout: Duration,
}

impl HelixConfig {
    /// Checks the layout against the shape and the workload.
    pub fn validate(&self) -> Result<()> {
        self.shape.check(&self.layout)?;
        if self.batch == 0 {
            return Err(HelixError::Config("a batch of no requests".to_owned()));
        }
        Placement::new(self.layout.kvp, self.stage)?;
        Ok(())
    }

    fn heads_per_rank(&self) -> usize {
        self.shape.q_heads / self.layout.ranks()
    }

    /// Bytes one rank sends another per request in the all-to-all.
    pub fn all_to_all_part(&self) -> usize {
        self.heads_per_rank() * Partials::row_bytes(self.shape.v_dim())
    }

    /// Elements of the `[B, H]` activations.
    fn activations(&self) -> usize {
        self.batch * self.shape.hidden
    }

    fn plan(&self) -> Result<StepPlan> {
        let slice = self.activations() / self.layout.ranks() * 4;
        let mut slots = vec![self.all_to_all_part(); self.batch];
        slots.extend([slice; 4]);
        StepPlan::new(slots)
    }
}

/// Where one step's time went on one rank, microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Phases {
    /// Attention over the shard (every request).
    pub attention_us: f64,
    /// From the end of the last request's attention to the last all-to-all part here: the
    /// communication compute did not hide.
    pub exposed_comm_us: f64,
    /// Merging the domain's partials.
    pub merge_us: f64,
    /// The post-attention projection.
    pub projection_us: f64,
    /// Both all-reduces (their exchanges and sums).
    pub all_reduce_us: f64,
    /// The FFN shard.
    pub ffn_us: f64,
    /// The whole step.
    pub total_us: f64,
}

/// One step on one rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    /// The step (0-based).
    pub step: u64,
    /// Whether HOP-B overlapped the all-to-all with attention.
    pub hopb: bool,
    /// The layer's output `[B, H]` (the same on every rank).
    pub output: Vec<f32>,
    /// Time per phase.
    pub phases: Phases,
    /// Bytes of all-to-all parts this rank wrote to peers in the step.
    pub all_to_all_bytes: u64,
    /// Tokens of each request this rank holds.
    pub shard_tokens: Vec<usize>,
}

/// Weights of one rank's shard (or of the whole layer, for the reference).
#[derive(Debug, Clone)]
struct Weights {
    /// `W_o` rows of the owned heads, `[heads x dv, H]`.
    w_o: Vec<f32>,
    ffn: FfnWeights,
}

/// One SwiGLU FFN's shard: columns of gate and up, the same rows of down.
#[derive(Debug, Clone)]
struct Mlp {
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    width: usize,
}

impl Mlp {
    /// Columns `cols` of the FFN whose tensors are streams `first..first + 3`.
    fn generate(
        seed: u64,
        first: u64,
        hidden: usize,
        dim: usize,
        cols: std::ops::Range<usize>,
    ) -> Self {
        Self {
            gate: block(
                seed,
                first,
                dim,
                0..hidden,
                cols.clone(),
                init_scale(hidden),
            ),
            up: block(
                seed,
                first + 1,
                dim,
                0..hidden,
                cols.clone(),
                init_scale(hidden),
            ),
            down: block(
                seed,
                first + 2,
                hidden,
                cols.clone(),
                0..hidden,
                init_scale(dim),
            ),
            width: cols.len(),
        }
    }

    /// `out += down(swiglu(x gate, x up))` for `x: [rows, hidden]`.
    fn apply(&self, x: &[f32], hidden: usize, out: &mut [f32]) {
        let rows = x.len() / hidden;
        let (mut g, mut u) = (vec![0f32; rows * self.width], vec![0f32; rows * self.width]);
        matmul_acc(x, &self.gate, hidden, self.width, &mut g);
        matmul_acc(x, &self.up, hidden, self.width, &mut u);
        swiglu(&mut g, &u);
        matmul_acc(&g, &self.down, self.width, hidden, out);
    }
}

#[derive(Debug, Clone)]
enum FfnWeights {
    Dense(Mlp),
    Moe {
        router: Vec<f32>,
        experts: usize,
        top_k: usize,
        /// The experts held, with their numbers.
        held: Vec<(usize, Mlp)>,
    },
}

impl Weights {
    /// Heads `heads` of `W_o`; of the FFN, columns `part` of `tpf` of each held matrix, and
    /// the experts of group `group` of `ep`.
    fn generate(
        shape: &Shape,
        seed: u64,
        heads: std::ops::Range<usize>,
        part: usize,
        tpf: usize,
        group: usize,
        ep: usize,
    ) -> Self {
        let (h, dv) = (shape.hidden, shape.v_dim());
        let w_o = block(
            seed,
            stream::W_O,
            h,
            heads.start * dv..heads.end * dv,
            0..h,
            init_scale(shape.q_heads * dv),
        );
        let ffn = match shape.ffn {
            Ffn::Dense { dim } => {
                let cols = part * dim / tpf..(part + 1) * dim / tpf;
                FfnWeights::Dense(Mlp::generate(seed, stream::DENSE, h, dim, cols))
            }
            Ffn::Moe {
                experts,
                top_k,
                dim,
            } => {
                let cols = part * dim / tpf..(part + 1) * dim / tpf;
                let held = (0..experts)
                    .filter(|e| e % ep == group)
                    .map(|e| {
                        let first = stream::EXPERT + 3 * e as u64;
                        (e, Mlp::generate(seed, first, h, dim, cols.clone()))
                    })
                    .collect();
                FfnWeights::Moe {
                    router: block(
                        seed,
                        stream::ROUTER,
                        experts,
                        0..h,
                        0..experts,
                        init_scale(h),
                    ),
                    experts,
                    top_k,
                    held,
                }
            }
        };
        Self { w_o, ffn }
    }

    /// This shard's FFN contribution for input `x: [B, H]`.
    fn ffn(&self, x: &[f32], hidden: usize) -> Vec<f32> {
        let mut out = vec![0f32; x.len()];
        match &self.ffn {
            FfnWeights::Dense(mlp) => mlp.apply(x, hidden, &mut out),
            FfnWeights::Moe {
                router,
                experts,
                top_k,
                held,
            } => {
                let mut logits = vec![0f32; x.len() / hidden * experts];
                matmul_acc(x, router, hidden, *experts, &mut logits);
                let mut y = vec![0f32; hidden];
                for ((xb, ob), lb) in x
                    .chunks_exact(hidden)
                    .zip(out.chunks_exact_mut(hidden))
                    .zip(logits.chunks_exact(*experts))
                {
                    for (e, weight) in route(lb, *top_k) {
                        let Some((_, mlp)) = held.iter().find(|w| w.0 == e) else {
                            continue;
                        };
                        y.fill(0.0);
                        mlp.apply(xb, hidden, &mut y);
                        for (o, v) in ob.iter_mut().zip(&y) {
                            *o += weight * v;
                        }
                    }
                }
            }
        }
        out
    }
}

fn micros(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e6
}

fn f32s_to_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn bytes_to_f32s(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// One rank of a running Helix layer.
#[derive(Debug)]
pub struct HelixRank {
    config: HelixConfig,
    rank: usize,
    placement: Placement,
    exchange: Exchange,
    weights: Weights,
    /// One shard per request.
    shards: Vec<Shard>,
    step: u64,
}

impl HelixRank {
    /// Builds rank `rank` on `engine`: generates its weights and KV shards, registers its
    /// regions, meets the other ranks through `rendezvous` and connects them.
    pub fn start(
        config: HelixConfig,
        rank: usize,
        engine: TransferEngine,
        rendezvous: &dyn Rendezvous,
    ) -> Result<Self> {
        config.validate()?;
        let layout = config.layout;
        let n = layout.ranks();
        if rank >= n {
            return Err(HelixError::Config(format!("rank {rank} of {n}")));
        }
        let mut exchange = Exchange::new(engine, rank, n, config.plan()?, config.timeout)?;
        let hpr = config.heads_per_rank();
        let weights = Weights::generate(
            &config.shape,
            config.seed,
            rank * hpr..(rank + 1) * hpr,
            layout.tpf_index(rank),
            layout.tpf,
            layout.expert_group(rank),
            layout.ep,
        );
        let placement = Placement::new(layout.kvp, config.stage)?;
        let mut this = Self {
            config,
            rank,
            placement,
            exchange: {
                let peers = rendezvous.exchange(exchange.info(), n, config.timeout)?;
                exchange.connect(peers)?;
                exchange
            },
            weights,
            shards: vec![Shard::default(); config.batch],
            step: 0,
        };
        for p in 0..config.ctx {
            this.append(p);
        }
        Ok(this)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The pool's infos (pids, addresses).
    pub fn exchange(&self) -> &Exchange {
        &self.exchange
    }

    /// Steps run so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    fn kv_heads(&self) -> std::ops::Range<usize> {
        let per = self.config.shape.kv_heads() / self.config.layout.tpa;
        let g = self.config.layout.head_group(self.rank);
        g * per..(g + 1) * per
    }

    fn group_heads(&self) -> std::ops::Range<usize> {
        let per = self.config.shape.q_heads / self.config.layout.tpa;
        let g = self.config.layout.head_group(self.rank);
        g * per..(g + 1) * per
    }

    /// Appends every request's token at `position` if it lands in this rank's shard.
    fn append(&mut self, position: u64) {
        if self.placement.shard_of(position) != self.config.layout.kvp_index(self.rank) {
            return;
        }
        let kv = self.kv_heads();
        for (b, shard) in self.shards.iter_mut().enumerate() {
            shard.append(
                &self.config.shape,
                self.config.seed,
                b,
                position,
                kv.clone(),
            );
        }
    }

    /// Runs one decode step (every rank of the pool must run it too), with or without
    /// HOP-B; returns the layer's output and where the time went.
    pub fn step(&mut self, hopb: bool) -> Result<StepReport> {
        let started = Instant::now();
        let (cfg, step) = (self.config, self.step);
        self.append(cfg.ctx + step);
        self.step += 1;
        let (hpr, dv) = (cfg.heads_per_rank(), cfg.shape.v_dim());
        let row_bytes = Partials::row_bytes(dv);
        let domain = cfg.layout.kvp_domain(self.rank);
        let heads = self.group_heads();
        let kv_first = self.kv_heads().start;
        let mut phases = Phases::default();
        let sent_before = self.exchange.bytes_sent();

        // Attention and the all-to-all, one round per request.
        let mut encoded = vec![0u8; heads.len() * row_bytes];
        let mut pending: Vec<Vec<u8>> = Vec::new();
        let mut posted = Vec::with_capacity(cfg.batch);
        let from: Vec<(usize, usize)> = domain.clone().map(|s| (s, hpr * row_bytes)).collect();
        let mut last_attention = Instant::now();
        for b in 0..cfg.batch {
            let t = Instant::now();
            let q = Query::generate(&cfg.shape, cfg.seed, step, b, heads.clone());
            let partial = self.shards[b].attend(&cfg.shape, &q, heads.clone(), kv_first)?;
            partial.encode_rows(0, heads.len(), &mut encoded);
            phases.attention_us += micros(t);
            last_attention = Instant::now();
            if hopb {
                posted.push(self.post_partials(step, b, &encoded, &domain, &from, hpr)?);
            } else {
                pending.push(encoded.clone());
            }
        }
        for (b, bytes) in pending.iter().enumerate() {
            posted.push(self.post_partials(step, b, bytes, &domain, &from, hpr)?);
        }
        for (b, p) in posted.iter().enumerate() {
            self.exchange
                .wait(*p, &format!("all-to-all of request {b}"))?;
        }
        phases.exposed_comm_us = micros(last_attention);

        // The exact merge of this rank's heads.
        let t = Instant::now();
        let mut attention = Vec::with_capacity(cfg.batch * hpr * dv);
        for p in &posted {
            let parts = domain
                .clone()
                .map(|s| {
                    Ok(Partials::decode(
                        dv,
                        &self.exchange.read(*p, s, hpr * row_bytes)?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            attention.extend(merge(&parts)?.o);
        }
        phases.merge_us = micros(t);

        // TP = N projection, all-reduced.
        let t = Instant::now();
        let mut h = vec![0f32; cfg.activations()];
        matmul_acc(
            &attention,
            &self.weights.w_o,
            hpr * dv,
            cfg.shape.hidden,
            &mut h,
        );
        phases.projection_us = micros(t);
        let t = Instant::now();
        let mut h = self.all_reduce(step, cfg.batch, &h)?;
        phases.all_reduce_us = micros(t);
        rms_norm(&mut h, cfg.shape.hidden);

        // The FFN shard, all-reduced.
        let t = Instant::now();
        let f = self.weights.ffn(&h, cfg.shape.hidden);
        phases.ffn_us = micros(t);
        let t = Instant::now();
        let output = self.all_reduce(step, cfg.batch + 2, &f)?;
        phases.all_reduce_us += micros(t);
        phases.total_us = micros(started);
        Ok(StepReport {
            step,
            hopb,
            output,
            phases,
            all_to_all_bytes: self.exchange.bytes_sent() - sent_before,
            shard_tokens: self.shards.iter().map(Shard::tokens).collect(),
        })
    }

    /// Posts request `b`'s partials (`bytes`: the group's heads, encoded) to the domain.
    fn post_partials(
        &mut self,
        step: u64,
        b: usize,
        bytes: &[u8],
        domain: &std::ops::Range<usize>,
        from: &[(usize, usize)],
        hpr: usize,
    ) -> Result<Posted> {
        let part = hpr * Partials::row_bytes(self.config.shape.v_dim());
        let parts: Vec<(usize, &[u8])> = domain
            .clone()
            .enumerate()
            .map(|(i, d)| (d, &bytes[i * part..(i + 1) * part]))
            .collect();
        self.exchange.post(step, b, &parts, from)
    }

    /// Sum of every rank's `x` (rounds `index`, `index + 1` of the step), the same bits on
    /// every rank.
    fn all_reduce(&mut self, step: u64, index: usize, x: &[f32]) -> Result<Vec<f32>> {
        let n = self.config.layout.ranks();
        let slice = x.len() / n;
        let bytes = f32s_to_bytes(x);
        let all: Vec<(usize, usize)> = (0..n).map(|s| (s, slice * 4)).collect();
        let parts: Vec<(usize, &[u8])> = (0..n)
            .map(|d| (d, &bytes[d * slice * 4..(d + 1) * slice * 4]))
            .collect();
        let scatter = self.exchange.post(step, index, &parts, &all)?;
        self.exchange.wait(scatter, "reduce-scatter")?;
        let mut reduced = vec![0f32; slice];
        for s in 0..n {
            let part = self.exchange.read(scatter, s, slice * 4)?;
            for (r, v) in reduced.iter_mut().zip(bytes_to_f32s(&part)) {
                *r += v;
            }
        }
        let reduced = f32s_to_bytes(&reduced);
        let parts: Vec<(usize, &[u8])> = (0..n).map(|d| (d, reduced.as_slice())).collect();
        let gather = self.exchange.post(step, index + 1, &parts, &all)?;
        self.exchange.wait(gather, "all-gather")?;
        let mut out = Vec::with_capacity(x.len());
        for s in 0..n {
            out.extend(bytes_to_f32s(&self.exchange.read(gather, s, slice * 4)?));
        }
        Ok(out)
    }
}

/// The same layer on one rank: attention over every token, the whole FFN.
#[derive(Debug)]
pub struct Reference {
    config: HelixConfig,
    weights: Weights,
    kv: Vec<Shard>,
    step: u64,
}

impl Reference {
    /// Generates the whole layer and every request's context.
    pub fn new(config: HelixConfig) -> Result<Self> {
        config.validate()?;
        let shape = config.shape;
        let weights = Weights::generate(&shape, config.seed, 0..shape.q_heads, 0, 1, 0, 1);
        let mut kv = vec![Shard::default(); config.batch];
        for (b, shard) in kv.iter_mut().enumerate() {
            for p in 0..config.ctx {
                shard.append(&shape, config.seed, b, p, 0..shape.kv_heads());
            }
        }
        Ok(Self {
            config,
            weights,
            kv,
            step: 0,
        })
    }

    /// The next step's output `[B, H]`.
    pub fn step(&mut self) -> Result<Vec<f32>> {
        let (cfg, step) = (self.config, self.step);
        self.step += 1;
        let shape = cfg.shape;
        let mut attention = Vec::with_capacity(cfg.batch * shape.q_heads * shape.v_dim());
        for (b, shard) in self.kv.iter_mut().enumerate() {
            shard.append(&shape, cfg.seed, b, cfg.ctx + step, 0..shape.kv_heads());
            let q = Query::generate(&shape, cfg.seed, step, b, 0..shape.q_heads);
            attention.extend(shard.attend(&shape, &q, 0..shape.q_heads, 0)?.o);
        }
        let mut h = vec![0f32; cfg.activations()];
        matmul_acc(
            &attention,
            &self.weights.w_o,
            shape.q_heads * shape.v_dim(),
            shape.hidden,
            &mut h,
        );
        rms_norm(&mut h, shape.hidden);
        Ok(self.weights.ffn(&h, shape.hidden))
    }
}

/// An output compared with the reference's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Check {
    /// Largest absolute difference.
    pub max_abs: f64,
    /// What f32 round-off allows: `1e-4 x` the largest reference magnitude (the sharded
    /// layer sums in another order; a lost or doubled shard moves outputs by percents).
    pub tolerance: f64,
    /// `max_abs <= tolerance`, and every value finite.
    pub passed: bool,
}

impl Check {
    /// Compares `output` with `reference`.
    pub fn of(output: &[f32], reference: &[f32]) -> Self {
        let scale = reference
            .iter()
            .fold(0f64, |m, v| m.max(f64::from(v.abs())));
        let tolerance = 1e-4 * scale.max(1e-3);
        let finite = output.len() == reference.len() && output.iter().all(|v| v.is_finite());
        let max_abs = output
            .iter()
            .zip(reference)
            .map(|(a, b)| f64::from((a - b).abs()))
            .fold(0f64, f64::max);
        let max_abs = if finite { max_abs } else { f64::INFINITY };
        Self {
            max_abs,
            tolerance,
            passed: finite && max_abs <= tolerance,
        }
    }
}
