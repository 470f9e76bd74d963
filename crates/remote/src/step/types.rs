//! What a step takes and gives back: the requests, the configuration, the outputs and
//! reports, the counters, the errors.

use std::time::Duration;

use kvroute_costmodel::{CostBreakdown, CostModelError, ModelDims, Primitive};
use kvroute_kernels::{Backend, Cache, KernelError, Partial, Rope};
use kvroute_kvstore::ChunkId;
use kvroute_sched::SchedError;
use serde::Serialize;
use thiserror::Error;

use crate::error::{RemoteError, RouteError};

/// Why a step failed.
#[derive(Debug, Error)]
pub enum StepError {
    /// No holder of the chunk could be reached (each tried was lost), or none is registered.
    #[error("{chunk}: no reachable copy ({why})")]
    NoCopy {
        /// The chunk.
        chunk: ChunkId,
        /// What happened to the copies tried.
        why: String,
    },
    /// A call about a chunk failed for another reason than a lost holder (refused, a bad
    /// reply).
    #[error("{chunk}: {source}")]
    Chunk {
        /// The chunk.
        chunk: ChunkId,
        /// What failed.
        source: RouteError,
    },
    /// A request of the batch is malformed.
    #[error("request {request}: {why}")]
    Request {
        /// Its position in the batch.
        request: usize,
        /// What is wrong.
        why: String,
    },
    /// The stepper's configuration.
    #[error("step configuration: {0}")]
    Config(String),
    /// The requester.
    #[error(transparent)]
    Remote(#[from] RemoteError),
    /// A route or transfer.
    #[error(transparent)]
    Route(#[from] RouteError),
    /// A kernel refused its inputs (a non-finite row, a bad shape).
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The selector.
    #[error(transparent)]
    Sched(#[from] SchedError),
    /// The cost model.
    #[error(transparent)]
    CostModel(#[from] CostModelError),
}

/// How a [`Stepper`](super::Stepper) runs.
#[derive(Debug, Clone)]
pub struct StepConfig {
    /// The model the chunks are the KV of (the cost model's dimensions).
    pub model: ModelDims,
    /// The rotation the chunks were stored with (fetched chunks are spliced with it, routed
    /// queries rotated with it).
    pub rope: Rope,
    /// Bytes of fetched chunks kept across layers and steps (each a chunk's full block, every
    /// layer); at most the requester's pool.
    pub fetch_budget: usize,
    /// One primitive for every (chunk, request) (`Fetch` means gather for sparse requests),
    /// the selector still choosing the holder; `None` lets the selector choose. `Local` is
    /// refused: re-prefilling a chunk needs the model.
    pub force: Option<Primitive>,
    /// The backend of the local partials.
    pub backend: Backend,
    /// How often the holders are asked for their load and kernel (at most once a step).
    pub poll_every: Duration,
}

impl StepConfig {
    /// Defaults for `model` and `rope`: a 1 GiB fetch budget, the selector choosing, the
    /// CPU's kernels, holders polled every 500 ms.
    pub fn new(model: ModelDims, rope: Rope) -> Self {
        Self {
            model,
            rope,
            fetch_budget: 1 << 30,
            force: None,
            backend: Backend::Cpu,
            poll_every: Duration::from_millis(500),
        }
    }
}

/// Selected tokens: per query token, `k` indices (-1 = padding; a repeated index counts once
/// per occurrence), shared by the token's heads.
#[derive(Debug, Clone, Copy)]
pub struct Picks<'a> {
    /// `[query tokens, k]`.
    pub indices: &'a [i32],
    /// Indices per query token.
    pub k: usize,
}

/// A remote chunk a request attends: the chunk, the position its first token has in the
/// request's context (its tokens at `start..start + tokens`), and for sparse attention the
/// chunk-local indices selected.
#[derive(Debug, Clone, Copy)]
pub struct ChunkRef<'a> {
    /// The chunk.
    pub chunk: ChunkId,
    /// Position of its first token in this request's context.
    pub start: i64,
    /// Sparse: the chunk-local tokens selected.
    pub picks: Option<Picks<'a>>,
}

impl ChunkRef<'_> {
    /// Every token of `chunk`, placed at `start`.
    pub fn dense(chunk: ChunkId, start: i64) -> Self {
        Self {
            chunk,
            start,
            picks: None,
        }
    }
}

/// A request's own KV at the layer: its prompt prefix and generated tokens, as the engine
/// keeps them (contiguous, or paged with any block size: [`Cache::paged_blocks`]), at the
/// request's positions; for sparse attention the indices selected in it.
#[derive(Debug, Clone, Copy)]
pub struct LocalKv<'a> {
    /// The rows.
    pub cache: Cache<'a>,
    /// Sparse: the tokens selected.
    pub picks: Option<Picks<'a>>,
}

impl<'a> LocalKv<'a> {
    /// Every row of `cache`.
    pub fn dense(cache: Cache<'a>) -> Self {
        Self { cache, picks: None }
    }
}

/// One request of a step.
#[derive(Debug, Clone, Copy)]
pub struct StepRequest<'a> {
    /// Query rows, `[heads x new tokens, 576]` bf16 (raw bits), rotated at their positions.
    pub queries: &'a [u16],
    /// Query rows per query token (its heads).
    pub heads: usize,
    /// The remote chunks attended. Sparse requests give every chunk its picks.
    pub chunks: &'a [ChunkRef<'a>],
    /// The request's own KV.
    pub local: Option<LocalKv<'a>>,
}

impl StepRequest<'_> {
    pub(crate) fn sparse(&self) -> bool {
        self.chunks.first().is_some_and(|c| c.picks.is_some())
            || self.local.is_some_and(|l| l.picks.is_some())
    }
}

/// How one (request, chunk) pair was attended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum How {
    /// Routed to a holder.
    Route,
    /// Fetched into the cache in this step, then attended here.
    Fetch,
    /// Attended from the fetch cache (fetched in an earlier step or layer).
    Cached,
    /// Its selected rows gathered for this layer, then attended here.
    Gather,
}

/// One (request, chunk) decision of a step.
#[derive(Debug, Clone, Serialize)]
pub struct Decided {
    /// The request's position in the batch.
    pub request: usize,
    /// The chunk.
    pub chunk: ChunkId,
    /// How it was attended.
    pub how: How,
    /// The holder (the requester's index) it was priced on, where one was.
    pub holder: Option<usize>,
    /// The selector's predicted time of the chosen primitive, microseconds (`None` for a
    /// cached chunk, or a fetch routed for want of pool room): one layer for a route or a
    /// gather, every layer for a fetch, as the cost model prices them.
    pub predicted_us: Option<f64>,
    /// The same prediction term by term.
    pub predicted: Option<CostBreakdown>,
}

/// What one step did, besides its outputs.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StepReport {
    /// Every (request, chunk) decision.
    pub decisions: Vec<Decided>,
    /// The step's routes, submit to every reply merged, microseconds (0 without routes).
    pub route_us: f64,
    /// Fetches of this step, microseconds (transfer and splice).
    pub fetch_us: f64,
    /// The gather of this step, microseconds.
    pub gather_us: f64,
    /// Local partials (fetched, gathered, own KV) and the merge, microseconds.
    pub local_us: f64,
    /// The whole step, microseconds.
    pub step_us: f64,
    /// Calls re-sent to a replica after their holder was lost.
    pub fallbacks: Vec<(ChunkId, String)>,
    /// Holders that stopped answering the poll before this step (the requester's index, and
    /// why): marked dead, their chunks go to their replicas.
    pub lost: Vec<(usize, String)>,
}

/// The selector's price of a step's route round, comparable with [`StepReport::route_us`].
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RoundPrice {
    /// The holder (the requester's index) whose request was priced slowest.
    pub holder: usize,
    /// Routed pairs on it.
    pub pairs: usize,
    /// Routed pairs of the round, on every holder.
    pub routed: usize,
    /// Its price, term by term.
    pub price: CostBreakdown,
}

impl StepReport {
    /// The route round priced as it ran: every routed pair of the step in one round, one
    /// staged request per holder and the holders in parallel. A holder's request is priced
    /// as its pairs' prices summed but for the fabric's fixed cost (probe and turnaround),
    /// paid once; the round as its slowest holder's. `None` without routes (or prices).
    pub fn priced_route_round(&self) -> Option<RoundPrice> {
        let mut per_holder: std::collections::BTreeMap<usize, (usize, CostBreakdown)> =
            std::collections::BTreeMap::new();
        let routed = self.decisions.iter().filter(|d| d.how == How::Route);
        for d in routed.clone() {
            if let (Some(h), Some(b)) = (d.holder, d.predicted) {
                let e = per_holder.entry(h).or_default();
                e.0 += 1;
                e.1 = add_once_fixed(&e.1, &b);
            }
        }
        let routed = routed.count();
        per_holder
            .into_iter()
            .max_by(|a, b| a.1.1.total_us().total_cmp(&b.1.1.total_us()))
            .map(|(holder, (pairs, price))| RoundPrice {
                holder,
                pairs,
                routed,
                price,
            })
    }

    /// The step's fetches priced as they ran, comparable with [`StepReport::fetch_us`]: each
    /// chunk fetched once (every layer, spliced), whichever requests attend it; the chunks,
    /// and the price. `None` without fetches.
    pub fn priced_fetches(&self) -> Option<(Vec<ChunkId>, CostBreakdown)> {
        let mut chunks: Vec<ChunkId> = Vec::new();
        let mut price = CostBreakdown::default();
        for d in self.decisions.iter().filter(|d| d.how == How::Fetch) {
            if let Some(b) = d.predicted
                && !chunks.contains(&d.chunk)
            {
                chunks.push(d.chunk);
                price = price + b;
            }
        }
        (!chunks.is_empty()).then_some((chunks, price))
    }
}

/// Two pairs' prices as one request: the fabric's fixed cost (probe and turnaround) once,
/// every other term summed.
fn add_once_fixed(a: &CostBreakdown, b: &CostBreakdown) -> CostBreakdown {
    let mut sum = *a + *b;
    sum.probe_us = a.probe_us.max(b.probe_us);
    sum.turnaround_us = a.turnaround_us.max(b.turnaround_us);
    sum.transport_total_us = sum.transport_us();
    sum
}

/// A step's answer: one merged partial per request, and what it did.
#[derive(Debug, Clone)]
pub struct StepOutput {
    /// Request `r`'s merged partial.
    pub outputs: Vec<Partial>,
    /// What the step did.
    pub report: StepReport,
}

/// Counters over a stepper's lifetime.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StepStats {
    /// Steps run.
    pub steps: u64,
    /// (request, chunk) pairs routed, fetched in the step, attended from the cache, gathered.
    pub routes: u64,
    /// See `routes`.
    pub fetches: u64,
    /// See `routes`.
    pub cached: u64,
    /// See `routes`.
    pub gathers: u64,
    /// Local partials over requests' own KV.
    pub local: u64,
    /// Chunk fetches (transfers), and bytes fetched.
    pub chunk_fetches: u64,
    /// See `chunk_fetches`.
    pub fetched_bytes: u64,
    /// Fetch-cache entries evicted for room, and dropped as changed.
    pub evicted: u64,
    /// See `evicted`.
    pub dropped: u64,
    /// Bytes the fetch cache holds now.
    pub cache_bytes: usize,
    /// Calls and fetches re-sent to a replica.
    pub fallbacks: u64,
}
