//! The main job, checked: decode steps of a batch of requests over a synthetic corpus held by
//! other instances, driven through a [`Stepper`] as an engine drives it, each output compared
//! with single-instance attention over the same context computed here from a full copy.
//!
//! A dense step gives R requests one query token each (`heads` rows). Request r's context is
//! its own prompt of [`CheckedConfig::prefix`] tokens, then the remote chunks it attends placed
//! right after (every chunk for even r, chunk `r / 2` alone for odd r: shared and private
//! chunks in one batch), then its own KV (prompt tail and generated tokens, one more a step),
//! which the stepper attends here. Chunks are stored at their canonical document positions, so
//! every route rotates the query and every fetch splices the chunk (paper 000 section 3.2).
//! The reference splices the full copy's rows with the same kernel and attends them with the
//! own rows in one call. The sparse step gives one request a top-k selection over the whole
//! document, chunk by chunk, at the stored positions, routed or gathered per chunk.
//!
//! Every check is of an output that crossed the wire (a routed partial, a fetched or cached
//! chunk, gathered rows); each layer call's route round and each step's fetches are timed and
//! shown beside the selector's price of the same work.

use kvroute_costmodel::{CostBreakdown, Primitive};
use kvroute_kernels::{
    Backend, Cache, KernelError, Partial, Queries, Rope, Selection, SpliceJob, partial_dense,
    partial_sparse, splice,
};
use kvroute_kvstore::corpus::queries;
use kvroute_kvstore::{ChunkId, CorpusSpec, FullBlock, StoreError};
use serde::Serialize;
use thiserror::Error;

use crate::step::{ChunkRef, How, LocalKv, Picks, StepError, StepOutput, StepRequest, Stepper};

/// Outputs attended here from exact bf16 KV (fetched, cached, gathered, own rows): f32
/// round-off. Paper 000 section 3.3 claims <= 4e-7 on an f64-accumulating reference; the CPU
/// kernel accumulates in f32 and orders the keys differently in one call over the whole
/// context than in per-chunk calls: ~n eps |v| (6144 x 6e-8 x 2 = 7e-4) at worst, ~sqrt(n)
/// eps |v| (1e-5) typically, observed <= 2e-6.
pub const F32_TOL: f32 = 1e-5;
/// Outputs with a routed part: o crossed the wire in bf16 (relative 2^-9) on values below ~2;
/// paper 000 section 3.3 measured 0.0012 for a two-instance route-merge.
pub const BF16_TOL: f32 = 8e-3;

/// What the checked run does.
#[derive(Debug, Clone)]
pub struct CheckedConfig {
    /// Requests per dense step (R).
    pub requests: usize,
    /// Query rows per request and token (the model's heads).
    pub heads: usize,
    /// Each request's own prompt before the document: its chunks are placed past it.
    pub prefix: i64,
    /// Rows of each request's own KV at step 0; one more each step.
    pub own_tokens: usize,
    /// The sparse step's top-k over the whole document (capped at its tokens).
    pub topk: usize,
    /// The layers stepped and checked.
    pub layers: Vec<u32>,
    /// Draws queries, own rows and the sparse selection.
    pub seed: u64,
}

/// Why a checked run stopped.
#[derive(Debug, Error)]
pub enum CheckedError {
    /// The step failed (no reachable copy of a chunk, a refused request).
    #[error(transparent)]
    Step(#[from] StepError),
    /// The corpus could not be generated.
    #[error("the corpus: {0}")]
    Corpus(#[from] StoreError),
    /// A reference could not be computed.
    #[error("the reference: {0}")]
    Kernel(#[from] KernelError),
}

/// One output against its single-instance reference.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// What was checked: step, layer, request, and how its chunks came.
    pub name: String,
    /// Largest absolute difference of o.
    pub max_abs: f32,
    /// The tolerance it had to meet.
    pub tolerance: f32,
    /// Whether it did.
    pub passed: bool,
}

/// One kind of decision, logged once: every (request, chunk) pair of the same chunk, shape,
/// choice and holder adds its step and request.
#[derive(Debug, Clone, Serialize)]
pub struct Decision {
    /// The chunk.
    pub chunk: u32,
    /// Whether the pair was sparse (a selection of the chunk's rows).
    pub sparse: bool,
    /// Query rows of the request.
    pub mq: u32,
    /// How it was attended: `Route`, `Fetch`, `Cached` or `Gather`.
    pub choice: String,
    /// The holder it was priced on (its control address), where one was.
    pub holder: Option<String>,
    /// Every step it was taken for.
    pub steps: Vec<u32>,
    /// Every request it was taken for.
    pub requests: Vec<usize>,
    /// Why: forced, or the selector's price of the choice.
    pub reason: String,
}

/// One prediction beside the measurement of the same work.
#[derive(Debug, Clone, Serialize)]
pub struct Timing {
    /// The decode step (the sparse step is the last).
    pub step: u32,
    /// The kind of work timed: the unit both sides cover.
    pub kind: &'static str,
    /// The holder priced slowest (a route round), its control address.
    pub holder: Option<String>,
    /// Which work.
    pub what: String,
    /// The primitive.
    pub primitive: Primitive,
    /// The selector's price, microseconds.
    pub predicted_us: f64,
    /// The measurement, microseconds.
    pub measured_us: f64,
    /// The price term by term: the sum of the pairs' prices it covers.
    pub predicted: CostBreakdown,
}

/// What a checked run did and found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CheckedReport {
    /// The decisions, one entry per distinct kind.
    pub decisions: Vec<Decision>,
    /// Predictions beside measurements.
    pub timings: Vec<Timing>,
    /// Every route round (one layer call), microseconds.
    pub route_us: Vec<f64>,
    /// Every step's fetches (transfer and splice of each chunk fetched), microseconds.
    pub fetch_us: Vec<f64>,
    /// Every gather (one layer call), microseconds.
    pub gather_us: Vec<f64>,
    /// Holder failures and what the stepper did about them.
    pub failures: Vec<String>,
    /// The checks.
    pub checks: Vec<Check>,
}

impl CheckedReport {
    /// Whether there were checks and every one passed.
    pub fn passed(&self) -> bool {
        !self.checks.is_empty() && self.checks.iter().all(|c| c.passed)
    }
}

/// A checked run in progress: the corpus's full copy, the configuration, the report so far.
#[derive(Debug)]
pub struct CheckedRun<'a> {
    spec: &'a CorpusSpec,
    config: CheckedConfig,
    blocks: Vec<Vec<u16>>,
    rope: Rope,
    report: CheckedReport,
}

/// A dense request's inputs for one layer.
struct DenseInputs {
    queries: Vec<u16>,
    chunks: Vec<u32>,
    own: Vec<u16>,
}

impl<'a> CheckedRun<'a> {
    /// Generates the full copy of `spec` the references are computed from.
    pub fn new(spec: &'a CorpusSpec, config: CheckedConfig) -> Result<Self, CheckedError> {
        if config.requests == 0 || config.heads == 0 || config.layers.is_empty() {
            return Err(
                StepError::Config("a checked run needs requests, heads and layers".into()).into(),
            );
        }
        if let Some(&l) = config.layers.iter().find(|&&l| l >= spec.layers) {
            return Err(StepError::Config(format!(
                "layer {l} is not one of the corpus's {}",
                spec.layers
            ))
            .into());
        }
        let blocks = (0..spec.chunks)
            .map(|c| spec.chunk(ChunkId(c)))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            spec,
            rope: spec.rope()?,
            config,
            blocks,
            report: CheckedReport::default(),
        })
    }

    /// The report so far.
    pub fn report(&self) -> &CheckedReport {
        &self.report
    }

    /// Notes a failure found outside the stepper (a holder killed, a directory change).
    pub fn note(&mut self, failure: String) {
        self.report.failures.push(failure);
    }

    /// Ends the run.
    pub fn finish(self) -> CheckedReport {
        self.report
    }

    /// The chunks request `r` attends.
    fn chunks_of(&self, r: usize) -> Vec<u32> {
        let n = self.spec.chunks;
        if r.is_multiple_of(2) {
            (0..n).collect()
        } else {
            vec![(r / 2) as u32 % n]
        }
    }

    /// Where request `r`'s context places chunk `c`: past its prompt, in document order.
    fn start(&self, c: u32) -> i64 {
        self.config.prefix + i64::from(c) * i64::from(self.spec.chunk_tokens)
    }

    fn dense_inputs(&self, step: u32, r: usize, layer: u32) -> DenseInputs {
        let cfg = &self.config;
        let seed = cfg.seed ^ (r as u64) << 40;
        let chunks = self.chunks_of(r);
        let context = cfg.prefix + self.spec.tokens() as i64 + i64::from(step);
        DenseInputs {
            queries: queries(cfg.heads, context, &self.rope, seed ^ u64::from(step) << 20),
            // The same rows every step, one more each: a prompt tail and generated tokens.
            own: queries(
                cfg.own_tokens + step as usize,
                context - 1,
                &self.rope,
                seed ^ u64::from(layer) << 8 ^ 0x0a11,
            ),
            chunks,
        }
    }

    /// Layer `layer` of chunk `c` as the requests place it: the stored rows spliced by
    /// `start - stored start` with the kernel a fetch splices with.
    fn spliced(&self, c: u32, layer: u32) -> Result<Vec<u16>, CheckedError> {
        let layout = self.spec.layout();
        let full = FullBlock::new(&self.blocks[c as usize], layout)?;
        let rows = full.layer(layer)?.rows();
        let from = self.spec.positions(ChunkId(c));
        let delta = self.start(c) - from[0];
        let to: Vec<i64> = from.iter().map(|p| p + delta).collect();
        let table: Vec<u32> = (0..layout.pages_per_layer() as u32).collect();
        let mut pool = vec![0u16; layout.layer_elems()];
        splice(
            Backend::Cpu,
            SpliceJob::new(rows, 1, &from, &to, self.rope, &mut pool, &table)?,
        )?;
        pool.truncate(rows.len());
        Ok(pool)
    }

    /// One dense decode step: every configured layer stepped for the R requests and each
    /// request's output checked. Returns the holders (the requester's indices) that served.
    pub fn dense_step(
        &mut self,
        stepper: &mut Stepper,
        step: u32,
    ) -> Result<Vec<usize>, CheckedError> {
        let scale = stepper.requester().scale();
        let mut served = Vec::new();
        let layers = self.config.layers.clone();
        for (i, &layer) in layers.iter().enumerate() {
            let inputs: Vec<DenseInputs> = (0..self.config.requests)
                .map(|r| self.dense_inputs(step, r, layer))
                .collect();
            let refs: Vec<Vec<ChunkRef<'_>>> = inputs
                .iter()
                .map(|x| {
                    x.chunks
                        .iter()
                        .map(|&c| ChunkRef::dense(ChunkId(c), self.start(c)))
                        .collect()
                })
                .collect();
            let requests = inputs
                .iter()
                .zip(&refs)
                .map(|(x, chunks)| {
                    Ok(StepRequest {
                        queries: &x.queries,
                        heads: self.config.heads,
                        chunks,
                        local: Some(LocalKv::dense(Cache::contiguous(&x.own)?)),
                    })
                })
                .collect::<Result<Vec<_>, KernelError>>()?;
            let out = stepper.step(layer as u16, &requests)?;
            self.record(stepper, (step, i == 0, false), &out, &mut served);
            let spliced: Vec<Vec<u16>> = (0..self.spec.chunks)
                .map(|c| self.spliced(c, layer))
                .collect::<Result<_, _>>()?;
            for (r, x) in inputs.iter().enumerate() {
                let mut rows: Vec<u16> = Vec::new();
                for &c in &x.chunks {
                    rows.extend_from_slice(&spliced[c as usize]);
                }
                rows.extend_from_slice(&x.own);
                let q = Queries::new(&x.queries)?;
                let want = partial_dense(Backend::Cpu, &q, &Cache::contiguous(&rows)?, scale)?;
                let hows = hows(&out, r);
                let name = format!(
                    "step {step} layer {layer} request {r}, chunks {}: {}, and {} rows of its own",
                    spans(&x.chunks),
                    said(&hows),
                    x.own.len() / kvroute_kernels::layout::D_QK,
                );
                self.check(name, &out.outputs[r], &want, &hows);
            }
        }
        Ok(served)
    }

    /// The sparse step: one request's query token selects top-k rows of the whole document,
    /// attended chunk by chunk at the stored positions, routed or gathered per chunk.
    pub fn sparse_step(
        &mut self,
        stepper: &mut Stepper,
        step: u32,
    ) -> Result<Vec<usize>, CheckedError> {
        let scale = stepper.requester().scale();
        let spec = self.spec;
        let tokens = spec.tokens();
        let k = self.config.topk.clamp(1, tokens);
        let global = selection(self.config.seed, k, tokens);
        let ct = spec.chunk_tokens as i32;
        let per_chunk: Vec<(u32, Vec<i32>)> = (0..spec.chunks)
            .map(|c| {
                let first = c as i32 * ct;
                let idx: Vec<i32> = global
                    .iter()
                    .filter(|&&g| g / ct == c as i32)
                    .map(|&g| g - first)
                    .collect();
                (c, idx)
            })
            .filter(|(_, idx)| !idx.is_empty())
            .collect();
        let heads = self.config.heads;
        let q = queries(heads, tokens as i64, &self.rope, self.config.seed ^ 0x5a5a);
        let mut served = Vec::new();
        let layers = self.config.layers.clone();
        for (i, &layer) in layers.iter().enumerate() {
            let chunks: Vec<ChunkRef<'_>> = per_chunk
                .iter()
                .map(|(c, idx)| ChunkRef {
                    chunk: ChunkId(*c),
                    start: i64::from(*c) * i64::from(spec.chunk_tokens),
                    picks: Some(Picks {
                        indices: idx,
                        k: idx.len(),
                    }),
                })
                .collect();
            let request = StepRequest {
                queries: &q,
                heads,
                chunks: &chunks,
                local: None,
            };
            let out = stepper.step(layer as u16, std::slice::from_ref(&request))?;
            self.record(stepper, (step, i == 0, true), &out, &mut served);
            let doc = spec.document_layer(&self.blocks, layer)?;
            let cache = Cache::contiguous(&doc)?;
            let sel = Selection::new(&global, k, heads, heads, cache.tokens())?;
            let want = partial_sparse(Backend::Cpu, &Queries::new(&q)?, &cache, &sel, scale)?;
            let hows = hows(&out, 0);
            let name = format!(
                "step {step} layer {layer} sparse top-{k} over chunks {}: {}",
                spans(&per_chunk.iter().map(|(c, _)| *c).collect::<Vec<_>>()),
                said(&hows)
            );
            self.check(name, &out.outputs[0], &want, &hows);
        }
        Ok(served)
    }

    fn check(&mut self, name: String, got: &Partial, want: &Partial, hows: &[How]) {
        let tolerance = if hows.contains(&How::Route) {
            BF16_TOL
        } else {
            F32_TOL
        };
        let max_abs = max_abs(got, want);
        self.report.checks.push(Check {
            name,
            max_abs,
            tolerance,
            passed: max_abs <= tolerance,
        });
    }

    /// Logs one layer call's decisions, failures and timings (its fetches only on the step's
    /// first layer: later layers read the cache).
    fn record(
        &mut self,
        stepper: &mut Stepper,
        (step, first_layer, sparse): (u32, bool, bool),
        out: &StepOutput,
        served: &mut Vec<usize>,
    ) {
        let report = &out.report;
        let addr = |stepper: &mut Stepper, h: usize| {
            stepper
                .requester()
                .holder_addr(h)
                .map_or_else(|| format!("holder {h}"), |a| a.to_string())
        };
        for (h, why) in &report.lost {
            let a = addr(stepper, *h);
            self.report.failures.push(format!(
                "{a} stopped answering ({why}) before step {step}: marked dead, its chunks go to their replicas"
            ));
        }
        for (chunk, error) in &report.fallbacks {
            self.report
                .failures
                .push(format!("{chunk}: {error}; retried on another replica"));
        }
        let forced = stepper.config().force.is_some();
        for d in &report.decisions {
            if let Some(h) = d.holder
                && matches!(d.how, How::Route | How::Fetch | How::Gather)
                && !served.contains(&h)
            {
                served.push(h);
            }
            let holder = d.holder.map(|h| addr(stepper, h));
            let mq = out.outputs.get(d.request).map_or(0, |p| p.rows() as u32);
            let choice = format!("{:?}", d.how);
            let reason = match (d.how, forced, d.predicted_us) {
                (How::Cached, _, _) => "in the fetch cache".to_owned(),
                (_, true, _) => "forced".to_owned(),
                (_, false, Some(us)) => format!("the selector's cheapest: {us:.0} us"),
                (_, false, None) => "routed: no pool room to fetch".to_owned(),
            };
            let same = self.report.decisions.iter_mut().find(|x| {
                x.chunk == d.chunk.0
                    && x.sparse == sparse
                    && x.mq == mq
                    && x.choice == choice
                    && x.holder == holder
            });
            match same {
                Some(x) => {
                    if !x.steps.contains(&step) {
                        x.steps.push(step);
                    }
                    if !x.requests.contains(&d.request) {
                        x.requests.push(d.request);
                    }
                }
                None => self.report.decisions.push(Decision {
                    chunk: d.chunk.0,
                    sparse,
                    mq,
                    choice,
                    holder,
                    steps: vec![step],
                    requests: vec![d.request],
                    reason,
                }),
            }
        }
        // The route round, priced as it ran (`StepReport::priced_route_round`).
        if report.route_us > 0.0 {
            self.report.route_us.push(report.route_us);
            if let Some(round) = report.priced_route_round() {
                self.report.timings.push(Timing {
                    step,
                    kind: "route round (one layer; one request per holder, holders in parallel)",
                    holder: Some(addr(stepper, round.holder)),
                    what: format!(
                        "{} routed pairs, {} on the slowest-priced holder",
                        round.routed, round.pairs
                    ),
                    primitive: Primitive::Route,
                    predicted_us: round.price.total_us(),
                    measured_us: report.route_us,
                    predicted: round.price,
                });
            }
        }
        if report.gather_us > 0.0 {
            self.report.gather_us.push(report.gather_us);
        }
        if first_layer && report.fetch_us > 0.0 {
            // Each chunk is fetched once, whichever requests attend it.
            if let Some((chunks, priced)) = report.priced_fetches() {
                self.report.fetch_us.push(report.fetch_us);
                self.report.timings.push(Timing {
                    step,
                    kind: "fetches (each chunk once, every layer, spliced)",
                    holder: None,
                    what: format!(
                        "fetch chunks {}",
                        spans(&chunks.iter().map(|c| c.0).collect::<Vec<_>>())
                    ),
                    primitive: Primitive::Fetch,
                    predicted_us: priced.total_us(),
                    measured_us: report.fetch_us,
                    predicted: priced,
                });
            }
        }
    }
}

/// How request `r`'s chunks were attended in a step.
fn hows(out: &StepOutput, r: usize) -> Vec<How> {
    out.report
        .decisions
        .iter()
        .filter(|d| d.request == r)
        .map(|d| d.how)
        .collect()
}

/// `2 routed through the wire, 1 fetched` for the pairs' hows.
fn said(hows: &[How]) -> String {
    let count = |h: How| hows.iter().filter(|&&x| x == h).count();
    let parts: Vec<String> = [
        (How::Route, "routed through the wire"),
        (How::Fetch, "fetched and spliced here"),
        (How::Cached, "from the fetch cache"),
        (How::Gather, "gathered here"),
    ]
    .iter()
    .filter(|(h, _)| count(*h) > 0)
    .map(|(h, what)| format!("{} {what}", count(*h)))
    .collect();
    parts.join(", ")
}

/// The largest absolute difference of two partials' o; infinite where their shapes differ or
/// either holds a NaN (which a plain max would skip).
pub fn max_abs(a: &Partial, b: &Partial) -> f32 {
    if a.o.len() != b.o.len() {
        return f32::INFINITY;
    }
    a.o.iter().zip(&b.o).fold(0.0, |m, (x, y)| {
        let d = (x - y).abs();
        if d.is_nan() { f32::INFINITY } else { m.max(d) }
    })
}

/// `0-2, 5` for `[0, 1, 2, 5]`.
pub fn spans(values: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < values.len() {
        let mut j = i;
        while j + 1 < values.len() && values[j + 1] == values[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            values[i].to_string()
        } else {
            format!("{}-{}", values[i], values[j])
        });
        i = j + 1;
    }
    out.join(", ")
}

/// `k` distinct document positions out of `tokens`, drawn from `seed` (xorshift).
fn selection(seed: u64, k: usize, tokens: usize) -> Vec<i32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut picked = std::collections::BTreeSet::new();
    while picked.len() < k.min(tokens) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        picked.insert((s % tokens as u64) as i32);
    }
    picked.into_iter().collect()
}
