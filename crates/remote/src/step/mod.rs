//! One call per layer: the attention of a batch of decode requests over a context held by
//! other instances, as a serving engine drives it from its decode loop.
//!
//! A [`Stepper`] is kept for the engine's lifetime: a [`Requester`] connected to the holders,
//! a selector calibrated on them ([`calibrate`]), and a cache of fetched chunks. Per layer the
//! engine calls [`Stepper::step`] with R requests, each its query rows (heads x new tokens),
//! the remote chunks it attends with the position its context places each at, and its own KV
//! (prompt prefix and generated tokens, paged as the engine keeps it). The step:
//!
//! - decides per (chunk, request) with the selector: dense, route or fetch; sparse (a top-k
//!   selection per query token), route or gather. A chunk already in the fetch cache at that
//!   position is attended from there. Local recompute of a remote chunk (re-prefill) needs the
//!   model and is not offered here;
//! - routes every request's routed chunks in one staged round of writes, one request per
//!   holder, with the query rows rotated so that the holder's keys, stored at the chunk's
//!   canonical positions, attend as if at the request's (RoPE scores depend on position
//!   differences only: rotating the query by `-(start - stored start)` is the splice of every
//!   key by `+(start - stored start)`); the calls of a holder lost mid-step go once to their
//!   chunk's next replica;
//! - fetches chunks into the cache, spliced once to the request's positions, kept across
//!   layers and steps within a byte budget (least recently used evicted first, dropped when the
//!   registry describes the chunk otherwise), and re-fetched from a replica if the first
//!   holder is lost; gathers the selected rows of sparse chunks for the layer;
//! - computes the local partials (fetched, gathered, the request's own KV) with
//!   `kvroute-kernels` and merges everything exactly (paper 000 section 3.3);
//! - reports the measured route and pull times to the selector.
//!
//! The answer is one [`Partial`] per request: `(o, m, l)`, its `lse` being `m + ln l`. A chunk
//! with no reachable copy fails the step with [`StepError::NoCopy`] naming it. The
//! [`BackgroundStepper`] runs a stepper on a thread of its own and answers with a
//! [`crate::Reply`], a future any executor can await.
//!
//! An engine's decode loop (here over one holder of one synthetic chunk, in one process over
//! the in-process `mem` fabric; over libfabric only the engines differ):
//!
//! ```
//! use std::net::TcpListener;
//! use kvroute_kernels::{Backend, Cache, RopeLayout};
//! use kvroute_kvstore::{ChunkId, CorpusSpec};
//! use kvroute_remote::probe::ProbeConfig;
//! use kvroute_remote::step::{CalibrationInputs, ChunkRef, LocalKv, StepConfig, StepRequest, Stepper};
//! use kvroute_remote::{HeldChunks, Holder, HolderConfig, Requester, RequesterConfig};
//! use kvroute_transport::{MemFabric, TransferEngine};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A holder of chunk 0 (200 tokens, 2 layers), somewhere else.
//! let spec = CorpusSpec { layers: 2, chunk_tokens: 200, chunks: 1, seed: 1, rope_theta: 1e4,
//!                         yarn: None, rope_layout: RopeLayout::Interleaved };
//! let fabric = MemFabric::new();
//! let engine = TransferEngine::mem(&fabric, 1)?;
//! let held = HeldChunks::generate(&engine, &spec, &[ChunkId(0)])?;
//! let holder = Holder::start(engine, TcpListener::bind("127.0.0.1:0")?, held,
//!                            HolderConfig::default())?;
//!
//! // The engine's side, kept for its lifetime: a requester, a calibrated selector, a cache.
//! let req = Requester::connect(TransferEngine::mem(&fabric, 1)?, &[holder.addr()],
//!                              RequesterConfig::new(0.1147))?;
//! let mut model = kvroute_costmodel::model_preset("deepseek-v2-lite")?.dims;
//! model.layers = spec.layers;
//! let probe_rows = vec![0x3f80u16; 16 * 576];
//! let quick = ProbeConfig { mq: vec![1, 16], reps: 4, ..ProbeConfig::default() };
//! let inputs = CalibrationInputs { model, rope: spec.rope()?, chunk_tokens: 200,
//!                                  probe_rows: &probe_rows, pull: None, probe: &quick };
//! let mut stepper = Stepper::calibrated(req, inputs, StepConfig::new(model, spec.rope()?))?;
//!
//! // Two requests: chunk 0 after a 10-token prompt, then their own KV (prompt and generated
//! // tokens, here 12 rows each); one query token of 16 heads each.
//! let context = [ChunkRef::dense(ChunkId(0), 10)];
//! let own = vec![vec![0x3e00u16; 12 * 576]; 2];
//! let queries = vec![vec![0x3c00u16; 16 * 576]; 2];
//! for layer in 0..spec.layers as u16 {
//!     let requests: Vec<StepRequest<'_>> = (0..2)
//!         .map(|r| StepRequest {
//!             queries: &queries[r],
//!             heads: 16,
//!             chunks: &context,
//!             local: Some(LocalKv::dense(Cache::contiguous(&own[r]).unwrap())),
//!         })
//!         .collect();
//!     let out = stepper.step(layer, &requests)?;
//!     // Request r's attention output at this layer: out.outputs[r] (o, m, l; lse = m + ln l),
//!     // which the engine multiplies by W_UV and carries on with.
//!     assert_eq!(out.outputs.len(), 2);
//!     assert!(out.outputs[0].lse(0).is_finite());
//! }
//! println!("{:?}", stepper.stats());
//! # Ok(()) }
//! ```

mod background;
mod cache;
mod calibrate;

use std::time::{Duration, Instant};

use kvroute_costmodel::{Allowed, CostModelError, ModelDims, Primitive, Request};
use kvroute_kernels::layout::D_QK;
use kvroute_kernels::{
    Backend, Cache, KernelError, Partial, Queries, Rope, Selection, merge, partial_dense,
    partial_sparse,
};
use kvroute_kvstore::ChunkId;
use kvroute_sched::SchedError;
use serde::Serialize;
use thiserror::Error;

pub use background::{BackgroundStepper, OwnedChunkRef, OwnedLocalKv, OwnedStepRequest};
pub use calibrate::{Calibrated, CalibrationInputs, calibrate, memcpy_gbps};

use crate::error::{RemoteError, RouteError};
use crate::requester::{Call, GatherPart, Requester, Sparse};
use cache::FetchCache;

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

/// How a [`Stepper`] runs.
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
    fn sparse(&self) -> bool {
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
    /// cached chunk or a forced primitive).
    pub predicted_us: Option<f64>,
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

/// The engine-facing object: a requester, its calibrated selector and the fetch cache.
#[derive(Debug)]
pub struct Stepper {
    req: Requester,
    cal: Calibrated,
    config: StepConfig,
    cache: FetchCache,
    stats: StepStats,
    polled: Option<Instant>,
}

/// One (request, chunk) pair's plan.
#[derive(Debug, Clone, Copy)]
struct Pair {
    request: usize,
    /// The chunk's position in the request's `chunks`.
    at: usize,
    how: How,
}

impl Stepper {
    /// A stepper over `req` with a selector already calibrated on its holders.
    pub fn new(req: Requester, cal: Calibrated, config: StepConfig) -> Result<Self, StepError> {
        if config.force == Some(Primitive::Local) {
            return Err(StepError::Config(
                "a remote chunk cannot be recomputed locally here (re-prefill needs the model)"
                    .into(),
            ));
        }
        let mut s = Self {
            cache: FetchCache::new(config.fetch_budget),
            req,
            cal,
            config,
            stats: StepStats::default(),
            polled: None,
        };
        s.cal.sync_holders(&s.req)?;
        Ok(s)
    }

    /// Connects nothing and calibrates: [`calibrate`] on `req`, then [`Stepper::new`].
    pub fn calibrated(
        mut req: Requester,
        inputs: CalibrationInputs<'_>,
        config: StepConfig,
    ) -> Result<Self, StepError> {
        let cal = calibrate(&mut req, inputs)?;
        Self::new(req, cal, config)
    }

    /// The requester (to add holders, follow a directory, read holders' stats).
    pub fn requester(&mut self) -> &mut Requester {
        &mut self.req
    }

    /// The calibrated selector and its clock.
    pub fn calibration(&self) -> &Calibrated {
        &self.cal
    }

    /// Counters over the stepper's lifetime.
    pub fn stats(&self) -> StepStats {
        StepStats {
            evicted: self.cache.evicted,
            dropped: self.cache.dropped,
            cache_bytes: self.cache.bytes(),
            ..self.stats.clone()
        }
    }

    /// Releases the fetch cache's pages and hands the requester back.
    pub fn into_requester(mut self) -> Requester {
        self.cache.clear(&mut self.req);
        self.req
    }

    /// The attention of `requests` at `layer`: one merged partial per request.
    pub fn step(
        &mut self,
        layer: u16,
        requests: &[StepRequest<'_>],
    ) -> Result<StepOutput, StepError> {
        let started = Instant::now();
        self.check(requests)?;
        self.refresh()?;
        let mut report = StepReport::default();
        let mut pairs = self.plan(requests, &mut report)?;

        // Fetches: each distinct (chunk, start) once, into the cache (or, where it does not
        // fit, for this step only). Where the requester's pool has no room even after the
        // cache gave back what this step does not use, the chunk is routed instead (unless
        // fetches are forced).
        let fetch_started = Instant::now();
        let pinned: Vec<(ChunkId, i64)> = pairs
            .iter()
            .filter(|p| matches!(p.how, How::Fetch | How::Cached))
            .map(|p| key(requests, p))
            .collect();
        let mut transient = Vec::new();
        for i in 0..pairs.len() {
            if pairs[i].how != How::Fetch {
                continue;
            }
            let (chunk, start) = key(requests, &pairs[i]);
            if self.cache.contains(chunk, start)
                || transient.iter().any(|(k, _)| *k == (chunk, start))
            {
                continue;
            }
            let pages = self
                .req
                .registry()
                .holders(chunk)
                .ok()
                .and_then(|h| h.first())
                .map_or(0, |e| e.layout.pages());
            if !self.cache.make_room(&mut self.req, pages, &pinned) {
                let free = self.req.free_pool_pages();
                if self.config.force == Some(Primitive::Fetch) || self.stored_start(chunk).is_none()
                {
                    return Err(StepError::Config(format!(
                        "{chunk} needs {pages} pool pages to be fetched and {free} are free with \
                         the chunks this step attends held: the requester's pool is too small"
                    )));
                }
                for p in pairs
                    .iter_mut()
                    .filter(|p| key(requests, p) == (chunk, start))
                {
                    p.how = How::Route;
                }
                for d in report
                    .decisions
                    .iter_mut()
                    .filter(|d| d.chunk == chunk && d.how == How::Fetch)
                {
                    d.how = How::Route;
                    d.predicted_us = None;
                }
                continue;
            }
            let fetched = self.fetch(chunk, start, &mut report)?;
            let entry = self
                .req
                .registry()
                .holders(chunk)
                .ok()
                .and_then(|h| h.first());
            let described = entry.map(|e| (e.layout, e.positions.clone()));
            let Some(described) = described else {
                transient.push(((chunk, start), fetched));
                continue;
            };
            if let Some(back) =
                self.cache
                    .insert(&mut self.req, (chunk, start), fetched, described, &pinned)
            {
                transient.push(((chunk, start), back));
            }
        }
        report.fetch_us = fetch_started.elapsed().as_secs_f64() * 1e6;

        // Routes: every request's routed chunks in one round.
        let mut outputs: Vec<Vec<Partial>> = vec![Vec::new(); requests.len()];
        let routes: Vec<&Pair> = pairs.iter().filter(|p| p.how == How::Route).collect();
        if !routes.is_empty() {
            let routed = self.route(layer, requests, &routes, &mut report)?;
            for (p, part) in routes.iter().zip(routed) {
                outputs[p.request].push(part);
            }
        }

        // Gathers: the selected rows of every gathered pair, for this layer, in one gather.
        let gathers: Vec<&Pair> = pairs.iter().filter(|p| p.how == How::Gather).collect();
        let gathered = if gathers.is_empty() {
            None
        } else {
            self.gather(layer, requests, &gathers, &mut report)?
        };

        let local_started = Instant::now();
        let result = self.attend_here(
            layer,
            requests,
            (&pairs, &transient, gathered.as_ref()),
            &mut outputs,
        );
        if let Some(g) = gathered {
            self.req.release_gathered(g.rows)?;
        }
        for (_, fetched) in transient {
            self.req.release(fetched)?;
        }
        result?;
        let merged = outputs
            .iter()
            .enumerate()
            .map(|(r, parts)| {
                let refs: Vec<&Partial> = parts.iter().collect();
                if refs.is_empty() {
                    return Ok(Partial::empty(requests[r].queries.len() / D_QK));
                }
                merge(&refs).map_err(StepError::from)
            })
            .collect::<Result<Vec<_>, _>>()?;
        report.local_us = local_started.elapsed().as_secs_f64() * 1e6;
        report.step_us = started.elapsed().as_secs_f64() * 1e6;
        self.stats.steps += 1;
        for p in &pairs {
            match p.how {
                How::Route => self.stats.routes += 1,
                How::Fetch => self.stats.fetches += 1,
                How::Cached => self.stats.cached += 1,
                How::Gather => self.stats.gathers += 1,
            }
        }
        self.stats.local += requests.iter().filter(|r| r.local.is_some()).count() as u64;
        Ok(StepOutput {
            outputs: merged,
            report,
        })
    }

    /// Checks the batch's shapes: query rows in whole rows and heads, chunks registered with
    /// picks of the right shape, dense and sparse not mixed within a request.
    fn check(&self, requests: &[StepRequest<'_>]) -> Result<(), StepError> {
        for (r, q) in requests.iter().enumerate() {
            let bad = |why: String| StepError::Request { request: r, why };
            let rows = Queries::new(q.queries)
                .map_err(|e| bad(e.to_string()))?
                .len();
            if rows == 0 || q.heads == 0 || !rows.is_multiple_of(q.heads) {
                return Err(bad(format!(
                    "{rows} query rows are not a positive multiple of {} heads",
                    q.heads
                )));
            }
            let tokens = rows / q.heads;
            let sparse = q.sparse();
            let picks_fit = |p: Option<Picks<'_>>, what: &str| match (sparse, p) {
                (false, None) => Ok(()),
                (true, Some(p)) if p.k > 0 && p.indices.len() == tokens * p.k => Ok(()),
                (true, Some(p)) => Err(bad(format!(
                    "{what}: {} indices for {tokens} query tokens at k = {}",
                    p.indices.len(),
                    p.k
                ))),
                _ => Err(bad(format!(
                    "{what}: dense and sparse parts in one request"
                ))),
            };
            for c in q.chunks {
                picks_fit(c.picks, &format!("chunk {}", c.chunk))?;
                if self.req.registry().holders(c.chunk).is_err()
                    && !self.cache.contains(c.chunk, c.start)
                {
                    return Err(StepError::NoCopy {
                        chunk: c.chunk,
                        why: "not registered by any holder".into(),
                    });
                }
            }
            if let Some(l) = &q.local {
                picks_fit(l.picks, "its own KV")?;
            }
        }
        Ok(())
    }

    /// Before a step: the selector's holders in step with the requester's, their load and
    /// kernel polled if due, and cached chunks whose description changed dropped.
    fn refresh(&mut self) -> Result<(), StepError> {
        self.cal.sync_holders(&self.req)?;
        let due = self
            .polled
            .is_none_or(|t| t.elapsed() >= self.config.poll_every);
        if due {
            for (h, why) in self.cal.poll_holders(&mut self.req)? {
                tracing::warn!(
                    holder = h,
                    why,
                    "holder stopped answering; its chunks go to their replicas"
                );
            }
            self.polled = Some(Instant::now());
        }
        self.cache.drop_changed(&mut self.req);
        Ok(())
    }

    /// The chunk's stored start position, if its tokens are stored at consecutive positions
    /// (then a route or gather can attend it at any start by rotating the query).
    fn stored_start(&self, chunk: ChunkId) -> Option<(i64, usize)> {
        let e = self.req.registry().holders(chunk).ok()?.first()?;
        let first = *e.positions.first()?;
        let consecutive = e
            .positions
            .iter()
            .enumerate()
            .all(|(i, &p)| p == first + i as i64);
        consecutive.then_some((first, e.positions.len()))
    }

    /// Decides every (request, chunk) pair.
    fn plan(
        &mut self,
        requests: &[StepRequest<'_>],
        report: &mut StepReport,
    ) -> Result<Vec<Pair>, StepError> {
        let mut pairs = Vec::new();
        let mut preferred: Vec<ChunkId> = Vec::new();
        for (r, q) in requests.iter().enumerate() {
            let rows = (q.queries.len() / D_QK) as u32;
            for (at, c) in q.chunks.iter().enumerate() {
                if self.cache.touch(c.chunk, c.start) {
                    pairs.push(Pair {
                        request: r,
                        at,
                        how: How::Cached,
                    });
                    report.decisions.push(Decided {
                        request: r,
                        chunk: c.chunk,
                        how: How::Cached,
                        holder: None,
                        predicted_us: None,
                    });
                    continue;
                }
                let entry = self
                    .req
                    .registry()
                    .holders(c.chunk)
                    .ok()
                    .and_then(|h| h.first());
                let tokens = entry.map_or(0, |e| e.layout.tokens);
                let mut request = match c.picks {
                    None => Request::contiguous(rows, tokens.max(1)),
                    Some(p) => {
                        let topk = (p.k as u32).clamp(1, tokens.max(1));
                        Request::sparse(rows, tokens.max(1), topk, 1)
                    }
                };
                request.allowed = Allowed {
                    route: self.stored_start(c.chunk).is_some(),
                    fetch: true,
                    local: false,
                };
                if let Some(p) = self.config.force {
                    if !request.allowed.contains(p) {
                        return Err(StepError::Request {
                            request: r,
                            why: format!("chunk {}: {p:?} forced and not possible", c.chunk),
                        });
                    }
                    request.allowed = Allowed::only(p);
                }
                let replicas = self.req.live_replicas(c.chunk);
                if replicas.is_empty() {
                    return Err(StepError::NoCopy {
                        chunk: c.chunk,
                        why: "no live holder".into(),
                    });
                }
                let chosen = self.cal.selector.decide(&replicas, request)?;
                if !preferred.contains(&c.chunk) {
                    // A chunk's routes and fetches of this step go where its first pair was
                    // priced.
                    self.req.prefer(c.chunk, chosen.holder);
                    preferred.push(c.chunk);
                }
                let how = match (chosen.primitive, c.picks.is_some()) {
                    (Primitive::Route, _) => How::Route,
                    (_, true) => How::Gather,
                    (_, false) => How::Fetch,
                };
                pairs.push(Pair {
                    request: r,
                    at,
                    how,
                });
                report.decisions.push(Decided {
                    request: r,
                    chunk: c.chunk,
                    how,
                    holder: chosen.holder,
                    predicted_us: self
                        .config
                        .force
                        .is_none()
                        .then(|| chosen.decision.cost(chosen.primitive).total_us),
                });
            }
        }
        Ok(pairs)
    }

    /// Fetches `chunk` spliced to `start..`, from a replica if its first holder is lost.
    fn fetch(
        &mut self,
        chunk: ChunkId,
        start: i64,
        report: &mut StepReport,
    ) -> Result<crate::requester::Fetched, StepError> {
        let tokens = self
            .req
            .registry()
            .holders(chunk)
            .ok()
            .and_then(|h| h.first())
            .map_or(0, |e| e.positions.len());
        let to: Vec<i64> = (0..tokens as i64).map(|i| start + i).collect();
        let mut lost = Vec::new();
        for _ in 0..2 {
            match self
                .req
                .fetch(chunk, &to, self.config.rope, self.config.backend)
            {
                Ok(f) => {
                    let bytes = self
                        .config
                        .model
                        .chunk_bytes(tokens as u32, f.layers as u32);
                    let now = self.cal.now_ms();
                    self.cal.selector.observe_pull(bytes, f.transfer_us, now);
                    self.stats.chunk_fetches += 1;
                    self.stats.fetched_bytes += bytes as u64;
                    return Ok(f);
                }
                Err(e) if e.holder_lost() => {
                    report.fallbacks.push((chunk, e.to_string()));
                    self.stats.fallbacks += 1;
                    lost.push(e.to_string());
                }
                Err(RouteError::NoHolder(_)) => break,
                Err(source) => return Err(StepError::Chunk { chunk, source }),
            }
        }
        Err(StepError::NoCopy {
            chunk,
            why: if lost.is_empty() {
                "no live holder".into()
            } else {
                lost.join("; ")
            },
        })
    }

    /// The query rows a pair sends to (or attends with) the chunk's stored rows: rotated by
    /// `-(start - stored start)`, or `None` where the delta is 0.
    fn rotated(&self, q: &StepRequest<'_>, c: &ChunkRef<'_>) -> Option<Vec<u16>> {
        let (stored, _) = self.stored_start(c.chunk)?;
        let delta = c.start - stored;
        if delta == 0 {
            return None;
        }
        let angles = self.config.rope.angles(-delta);
        let mut rows = q.queries.to_vec();
        for row in rows.chunks_exact_mut(D_QK) {
            kvroute_kernels::rope::rotate_row_f64(row, &angles, self.config.rope.layout());
        }
        Some(rows)
    }

    /// Routes the pairs `routes` in one round (one request per holder), re-sending once the
    /// calls of a lost holder; one partial per pair.
    fn route(
        &mut self,
        layer: u16,
        requests: &[StepRequest<'_>],
        routes: &[&Pair],
        report: &mut StepReport,
    ) -> Result<Vec<Partial>, StepError> {
        let rotated: Vec<Option<Vec<u16>>> = routes
            .iter()
            .map(|p| {
                let q = &requests[p.request];
                self.rotated(q, &q.chunks[p.at])
            })
            .collect();
        let calls: Vec<Call<'_>> = routes
            .iter()
            .zip(&rotated)
            .map(|(p, rot)| {
                let q = &requests[p.request];
                let c = &q.chunks[p.at];
                Call {
                    chunk: c.chunk,
                    layer,
                    queries: rot.as_deref().unwrap_or(q.queries),
                    sparse: c.picks.map(|s| Sparse {
                        indices: s.indices,
                        k: s.k as u32,
                        rows_per_token: q.heads as u32,
                    }),
                }
            })
            .collect();
        // Rows per holder (the selector prices a route by the rows one holder serves).
        let mut per_holder: Vec<(usize, u32)> = Vec::new();
        for call in &calls {
            if let Ok(h) = self.req.holder_for(call.chunk) {
                let rows = (call.queries.len() / D_QK) as u32;
                match per_holder.iter_mut().find(|(x, _)| *x == h) {
                    Some((_, n)) => *n += rows,
                    None => per_holder.push((h, rows)),
                }
            }
        }
        let mut out: Vec<Option<Partial>> = vec![None; calls.len()];
        let mut pending: Vec<usize> = (0..calls.len()).collect();
        let started = Instant::now();
        for retry in [false, true] {
            if pending.is_empty() {
                break;
            }
            let subset: Vec<Call<'_>> = pending.iter().map(|&i| calls[i]).collect();
            let round = Instant::now();
            let routed = self.req.stage_copied(&subset).route_wire();
            let round_us = round.elapsed().as_secs_f64() * 1e6;
            let kernel_us = (0..subset.len())
                .filter_map(|j| routed.holder_kernel_us(j, round_us))
                .fold(0.0, f64::max);
            let mut failed = Vec::new();
            for (j, &i) in pending.iter().enumerate() {
                match routed.partial(j) {
                    Ok(w) => {
                        let mut p = Partial::empty(0);
                        kvroute_kernels::merge_wire(&[w], &mut p)?;
                        out[i] = Some(p);
                    }
                    Err(error) if !retry && error.holder_lost() => {
                        report.fallbacks.push((calls[i].chunk, error.to_string()));
                        self.stats.fallbacks += 1;
                        failed.push(i);
                    }
                    Err(error)
                        if error.holder_lost() || matches!(error, RouteError::NoHolder(_)) =>
                    {
                        return Err(StepError::NoCopy {
                            chunk: calls[i].chunk,
                            why: error.to_string(),
                        });
                    }
                    Err(source) => {
                        return Err(StepError::Chunk {
                            chunk: calls[i].chunk,
                            source,
                        });
                    }
                }
            }
            if !retry && failed.is_empty() {
                // A clean round: the fabric's part of it, at the most rows one holder served.
                if let Some(&(_, rows)) = per_holder.iter().max_by_key(|(_, n)| *n) {
                    let now = self.cal.now_ms();
                    self.cal
                        .selector
                        .observe_route(rows, (round_us - kernel_us).max(0.0), now);
                }
            }
            pending = failed;
        }
        report.route_us = started.elapsed().as_secs_f64() * 1e6;
        out.into_iter()
            .zip(&calls)
            .map(|(p, c)| {
                p.ok_or(StepError::NoCopy {
                    chunk: c.chunk,
                    why: "no reply".into(),
                })
            })
            .collect()
    }

    /// Gathers the selected rows of every pair in `gathers` for `layer` (each pair's distinct
    /// valid indices once, pair after pair), re-trying once if a holder is lost. Returns the
    /// rows and, per pair, each of its picks' slot among them; `None` where every pick is
    /// padding (those pairs attend nothing).
    fn gather(
        &mut self,
        layer: u16,
        requests: &[StepRequest<'_>],
        gathers: &[&Pair],
        report: &mut StepReport,
    ) -> Result<Option<GatheredRows>, StepError> {
        let started = Instant::now();
        let mut tokens: Vec<Vec<i32>> = Vec::with_capacity(gathers.len());
        let mut remapped: Vec<Vec<i32>> = Vec::with_capacity(gathers.len());
        let mut offset = 0i32;
        for p in gathers {
            let c = &requests[p.request].chunks[p.at];
            let picks = c.picks.ok_or_else(|| StepError::Request {
                request: p.request,
                why: format!("chunk {}: gathered without picks", c.chunk),
            })?;
            let mut distinct: Vec<i32> =
                picks.indices.iter().copied().filter(|&i| i >= 0).collect();
            distinct.sort_unstable();
            distinct.dedup();
            let map = picks
                .indices
                .iter()
                .map(|&i| {
                    if i < 0 {
                        -1
                    } else {
                        // Present: `distinct` holds every valid index.
                        offset + distinct.binary_search(&i).unwrap_or(0) as i32
                    }
                })
                .collect();
            offset += distinct.len() as i32;
            tokens.push(distinct);
            remapped.push(map);
        }
        let parts: Vec<GatherPart<'_>> = gathers
            .iter()
            .zip(&tokens)
            .filter(|(_, t)| !t.is_empty())
            .map(|(p, t)| GatherPart {
                chunk: requests[p.request].chunks[p.at].chunk,
                tokens: t,
            })
            .collect();
        if parts.is_empty() {
            // Every pick is padding: nothing to gather; the pairs attend nothing.
            return Ok(None);
        }
        let mut last = None;
        for _ in 0..2 {
            match self.req.gather(&parts, &[layer]) {
                Ok(rows) => {
                    report.gather_us = started.elapsed().as_secs_f64() * 1e6;
                    return Ok(Some(GatheredRows { rows, remapped }));
                }
                Err(e) if e.holder_lost() => {
                    let chunk = parts[0].chunk;
                    report.fallbacks.push((chunk, e.to_string()));
                    self.stats.fallbacks += 1;
                    last = Some(e);
                }
                Err(RouteError::NoHolder(chunk)) => {
                    return Err(StepError::NoCopy {
                        chunk,
                        why: "no live holder".into(),
                    });
                }
                Err(source) => {
                    return Err(StepError::Chunk {
                        chunk: parts[0].chunk,
                        source,
                    });
                }
            }
        }
        // A lost holder twice: name a chunk none of whose holders answers.
        let dead = parts
            .iter()
            .find(|p| self.req.live_replicas(p.chunk).is_empty())
            .unwrap_or(&parts[0])
            .chunk;
        Err(StepError::NoCopy {
            chunk: dead,
            why: last.map_or_else(String::new, |e| e.to_string()),
        })
    }

    /// The partials computed here: fetched and cached chunks, gathered rows, and each
    /// request's own KV, pushed to `outputs`.
    fn attend_here(
        &self,
        layer: u16,
        requests: &[StepRequest<'_>],
        (pairs, transient, gathered): (&[Pair], &[Transient], Option<&GatheredRows>),
        outputs: &mut [Vec<Partial>],
    ) -> Result<(), StepError> {
        let scale = self.req_scale();
        let backend = self.config.backend;
        let mut gathered_seen = 0;
        for p in pairs {
            let q = &requests[p.request];
            let c = &q.chunks[p.at];
            let rows = Queries::new(q.queries)?;
            match p.how {
                How::Route => {}
                How::Fetch | How::Cached => {
                    let key = (c.chunk, c.start);
                    let fetched = self
                        .cache
                        .peek(c.chunk, c.start)
                        .or_else(|| transient.iter().find(|(k, _)| *k == key).map(|(_, f)| f));
                    let Some(fetched) = fetched else {
                        return Err(StepError::NoCopy {
                            chunk: c.chunk,
                            why: "fetched and gone before it was attended".into(),
                        });
                    };
                    let cache = self.req.fetched_cache(fetched, usize::from(layer))?;
                    let part = match c.picks {
                        None => partial_dense(backend, &rows, &cache, scale)?,
                        Some(s) => {
                            let sel = Selection::new(
                                s.indices,
                                s.k,
                                q.heads,
                                rows.len(),
                                cache.tokens(),
                            )?;
                            partial_sparse(backend, &rows, &cache, &sel, scale)?
                        }
                    };
                    outputs[p.request].push(part);
                }
                How::Gather => {
                    let Some(GatheredRows { rows: g, remapped }) = gathered else {
                        continue;
                    };
                    let idx = &remapped[gathered_seen];
                    gathered_seen += 1;
                    let s = c.picks.ok_or_else(|| StepError::Request {
                        request: p.request,
                        why: "gathered without picks".into(),
                    })?;
                    let cache = self.req.gathered_cache(g, 0)?;
                    let rot = self.rotated(q, c);
                    let rows = Queries::new(rot.as_deref().unwrap_or(q.queries))?;
                    let sel = Selection::new(idx, s.k, q.heads, rows.len(), cache.tokens())?;
                    outputs[p.request].push(partial_sparse(backend, &rows, &cache, &sel, scale)?);
                }
            }
        }
        for (r, q) in requests.iter().enumerate() {
            let Some(local) = &q.local else {
                continue;
            };
            let rows = Queries::new(q.queries)?;
            let part = match local.picks {
                None => partial_dense(backend, &rows, &local.cache, scale)?,
                Some(s) => {
                    let sel =
                        Selection::new(s.indices, s.k, q.heads, rows.len(), local.cache.tokens())?;
                    partial_sparse(backend, &rows, &local.cache, &sel, scale)?
                }
            };
            outputs[r].push(part);
        }
        Ok(())
    }

    /// The softmax scale the requester sends with every route: the local partials use it too.
    fn req_scale(&self) -> f32 {
        self.req.scale()
    }
}

/// A chunk fetched for one step only (the cache had no room), with its (chunk, start).
type Transient = ((ChunkId, i64), crate::requester::Fetched);

/// The rows of a step's gather, and per gathered pair its picks' slots among them.
struct GatheredRows {
    rows: crate::requester::Gathered,
    remapped: Vec<Vec<i32>>,
}

/// A pair's (chunk, start).
fn key(requests: &[StepRequest<'_>], p: &Pair) -> (ChunkId, i64) {
    let c = &requests[p.request].chunks[p.at];
    (c.chunk, c.start)
}
