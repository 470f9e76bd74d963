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
mod transfer;
mod types;

use std::time::Instant;

use kvroute_costmodel::{Allowed, Primitive, Request};
use kvroute_kernels::layout::D_QK;
use kvroute_kernels::{Partial, Queries, Selection, merge, partial_dense, partial_sparse};
use kvroute_kvstore::ChunkId;

pub use background::{BackgroundStepper, OwnedChunkRef, OwnedLocalKv, OwnedStepRequest};
pub use calibrate::{Calibrated, CalibrationInputs, calibrate, memcpy_gbps};
pub use types::{
    ChunkRef, Decided, How, LocalKv, Picks, RoundPrice, StepConfig, StepError, StepOutput,
    StepReport, StepRequest, StepStats,
};

use crate::requester::Requester;
use cache::FetchCache;

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

    /// The configuration it was built with.
    pub fn config(&self) -> &StepConfig {
        &self.config
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
        let mut report = StepReport::default();
        self.refresh(&mut report)?;
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
            let pages = self.req.entry(chunk).ok().map_or(0, |e| e.layout.pages());
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
                    d.predicted = None;
                }
                continue;
            }
            let fetched = self.fetch(chunk, start, &mut report)?;
            let entry = self.req.entry(chunk).ok();
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
        crate::observe::step(&report, &self.stats());
        crate::observe::selector(&self.cal);
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
                if self.req.entry(c.chunk).is_err() && !self.cache.contains(c.chunk, c.start) {
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
    /// kernel polled if due (holders that do not answer noted in `report`), and cached chunks
    /// whose description changed dropped.
    fn refresh(&mut self, report: &mut StepReport) -> Result<(), StepError> {
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
                report.lost.push((h, why));
            }
            self.polled = Some(Instant::now());
        }
        self.cache.drop_changed(&mut self.req);
        Ok(())
    }

    /// The chunk's stored start position, if its tokens are stored at consecutive positions
    /// (then a route or gather can attend it at any start by rotating the query).
    fn stored_start(&self, chunk: ChunkId) -> Option<(i64, usize)> {
        let e = self.req.entry(chunk).ok()?;
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
                        predicted: None,
                    });
                    continue;
                }
                let entry = self.req.entry(c.chunk).ok();
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
                // Forced or chosen, the primitive was priced (a forced one among one option).
                let cost = chosen.decision.cost(chosen.primitive);
                let priced = cost.total_us.is_finite();
                report.decisions.push(Decided {
                    request: r,
                    chunk: c.chunk,
                    how,
                    holder: chosen.holder,
                    predicted_us: priced.then_some(cost.total_us),
                    predicted: priced.then_some(cost.breakdown),
                });
            }
        }
        Ok(pairs)
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
