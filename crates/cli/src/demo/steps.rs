//! The requester side of the demo: connect, probe the fabric, decide per distinct input, run
//! the dense decode steps and the sparse step through the holders, and check every output
//! that crossed the wire against single-instance attention over the whole document.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kvroute_costmodel::request::Selection;
use kvroute_costmodel::{Allowed, CostBreakdown, Primitive, Request};
use kvroute_kernels::{
    Backend, Cache, Partial, Queries, Rope, merge, partial_dense, partial_sparse,
};
use kvroute_kvstore::corpus::queries;
use kvroute_kvstore::{ChunkId, CorpusSpec, FullBlock};
use kvroute_remote::dispatch::{MergedStep, route_merged};
use kvroute_remote::{Call, Fetched, GatherPart, Requester, RequesterConfig, Sparse};
use kvroute_transport::ProviderChoice;

use super::{
    BF16_TOL, Check, Decided, DemoReport, F32_TOL, HEADS, SCALE, Served, TOPK, Timing, check,
};
use crate::args::{PrimitiveArg, StepArgs};
use kvroute_sched::selector::HolderState;

use super::follow::Follower;
use crate::calibrate::{Calibrated, CalibrationSummary, calibrate, corpus_model};

/// The requester's own prompt before the document: fetched chunks are re-homed past it.
const PREFIX: i64 = 4096;

/// The primitive `--force` names.
fn forced(arg: PrimitiveArg) -> Primitive {
    match arg {
        PrimitiveArg::Route => Primitive::Route,
        PrimitiveArg::Fetch => Primitive::Fetch,
        PrimitiveArg::Local => Primitive::Local,
    }
}

/// How the requester finds its holders.
pub(super) enum Discovery<'a> {
    /// These control addresses, connected at start.
    Addrs(&'a [SocketAddr]),
    /// A directory, followed for the whole run.
    Directory {
        /// `etcd://...`.
        url: &'a str,
        /// The lease TTL the directory is opened with.
        ttl: Duration,
        /// How long a step waits for a chunk with no live holder.
        wait: Duration,
    },
}

/// The most holders a requester following a directory connects to over a run (each reserves
/// a link of staging and reply region).
const MAX_DIRECTORY_HOLDERS: usize = 16;

/// What the steps share: the requester, the corpus and its full copy (the reference), the
/// cost model, and the report being filled.
struct Run<'a> {
    req: Requester,
    /// The directory followed, if holders are found in one.
    follower: Option<Follower>,
    spec: &'a CorpusSpec,
    blocks: Vec<Vec<u16>>,
    rope: Rope,
    cal: Calibrated,
    force: Option<Primitive>,
    /// The layers each step checks: first, middle, last.
    layers: [u32; 3],
    report: DemoReport,
}

/// Connects a requester to `holders`, measures the start-up probe sweep, and runs the decode
/// steps `plan` asks for, with queries and the sparse selection drawn from `seed`;
/// `before_step` may act before each step (the demo's kill) and report what it did.
pub(super) fn decode_steps(
    command: &str,
    spec: &CorpusSpec,
    provider: &ProviderChoice,
    discovery: Discovery<'_>,
    (plan, seed): (&StepArgs, u64),
    before_step: &mut dyn FnMut(u32) -> Result<Option<String>>,
) -> Result<DemoReport> {
    let (engine, provider_name) = super::fabric_engine(provider)?;
    let config = RequesterConfig {
        timeout: Duration::from_millis(plan.timeout_ms),
        link_bytes: 4 << 20,
        pool_pages: spec.layout().pages() as u32 * spec.chunks,
        scale: SCALE,
        tag: 0,
        spin: Duration::from_millis(1),
        max_holders: 0,
    };
    let (mut req, follower) = match discovery {
        Discovery::Addrs(holders) => (Requester::connect(engine, holders, config)?, None),
        Discovery::Directory { url, ttl, wait } => {
            let mut follower = Follower::open(url, ttl, wait)?;
            let config = RequesterConfig {
                max_holders: MAX_DIRECTORY_HOLDERS,
                ..config
            };
            let mut req = Requester::connect(engine, &[], config)?;
            follower.await_chunks(&mut req, spec.chunks, 0)?;
            (req, Some(follower))
        }
    };
    let rope = spec.rope()?;
    let doc_tokens = spec.tokens() as i64;
    let probe_rows = queries(2048, doc_tokens, &rope, 99);
    let to0: Vec<i64> = spec
        .positions(ChunkId(0))
        .iter()
        .map(|p| p + PREFIX)
        .collect();
    let cal = calibrate(&mut req, spec, &probe_rows, Some((ChunkId(0), &to0)))?;
    let summary = CalibrationSummary::of(&cal)?;
    let mut run = Run {
        req,
        follower,
        spec,
        // The full copy the references are computed from.
        blocks: (0..spec.chunks)
            .map(|c| spec.chunk(ChunkId(c)))
            .collect::<Result<_, _>>()?,
        rope,
        force: plan.force.map(forced),
        layers: [0, spec.layers / 2, spec.layers - 1],
        report: DemoReport {
            command: command.to_owned(),
            provider: provider_name,
            holders: 0,
            chunks: spec.chunks,
            chunk_tokens: spec.chunk_tokens,
            layers: spec.layers,
            probe_sweep: cal.probe.points.clone(),
            fitted: (summary.probe_us, summary.bw_gbps),
            probe_fallback: cal.probe.fallback.clone(),
            calibration: summary,
            decisions: Vec::new(),
            timings: Vec::new(),
            route_us: Vec::new(),
            fetch_us: Vec::new(),
            gather_us: Vec::new(),
            failures: Vec::new(),
            served: Vec::new(),
            checks: Vec::new(),
            passed: false,
            directory: None,
        },
        cal,
    };
    let mq = plan.batch as usize * HEADS;
    for step in 0..plan.steps {
        if step > 0 && plan.pause_ms > 0 {
            let pause = Duration::from_millis(plan.pause_ms);
            match run.follower.as_mut() {
                Some(f) => f.pause(&mut run.req, pause, step),
                None => std::thread::sleep(pause),
            }
        }
        if let Some(what) = before_step(step)? {
            run.report.failures.push(what);
        }
        run.follow(step)?;
        run.dense_step(step, mq, seed)?;
    }
    run.follow(plan.steps)?;
    run.sparse_step(plan.steps, seed)?;
    run.report.holders = run.req.holders();
    let live: Vec<usize> = (0..run.req.holders())
        .filter(|&h| run.req.is_alive(h))
        .collect();
    run.report.served = live
        .into_iter()
        .filter_map(|h| {
            let stats = run.req.holder_stats(h).ok()?;
            Some(Served {
                holder: run.req.holder_addr(h)?.to_string(),
                rows: stats.rows,
                gpu_rows: stats.gpu_rows,
                fetches: stats.fetches,
            })
        })
        .collect();
    run.report.directory = run.follower.take().map(|f| f.report);
    let report = run.report;
    let passed = report.checks.iter().all(|c| c.passed) && !report.checks.is_empty();
    Ok(DemoReport { passed, ..report })
}

impl Run<'_> {
    /// With a directory: applies its newest view, waits for every chunk to have a live
    /// holder, and keeps the selector's holders in step with the requester's.
    fn follow(&mut self, step: u32) -> Result<()> {
        let Some(follower) = self.follower.as_mut() else {
            return Ok(());
        };
        // A route or fetch that failed since the last step took its holder out of use inside
        // the requester; the report notes when (the earliest way it was found dead wins).
        for h in 0..self.req.holders() {
            if !self.req.is_alive(h) {
                follower.dead(h, "a route or fetch to it failed");
            }
        }
        // Applies the newest view first.
        follower.await_chunks(&mut self.req, self.spec.chunks, step)?;
        for h in 0..self.req.holders() {
            let alive = self.req.is_alive(h);
            if h >= self.cal.selector.holders().len() {
                let state = HolderState {
                    alive,
                    ..HolderState::new(8)
                };
                self.cal.selector.add_holder(state);
            } else {
                self.cal.selector.set_alive(h, alive)?;
            }
        }
        Ok(())
    }

    /// Notes which holder now serves `chunk` (after a route or fetch of it), for the
    /// directory's report.
    fn served(&mut self, chunk: ChunkId) {
        if let (Some(f), Ok(h)) = (self.follower.as_mut(), self.req.holder_for(chunk)) {
            f.served(h);
        }
    }

    /// The selector's choice for `request` against the holders of `chunk` (or the forced
    /// one), with the selector's priced options; logged once per distinct input: a decision
    /// equal to one already logged only adds its step. The holders' load, liveness and kernel
    /// reports are refreshed first.
    fn decide(
        &mut self,
        step: u32,
        request: &Request,
        (chunk, chunks): (ChunkId, Vec<u32>),
    ) -> Result<(Primitive, kvroute_costmodel::Decision)> {
        for (h, why) in self.cal.poll_holders(&mut self.req)? {
            if let Some(f) = self.follower.as_mut() {
                f.dead(h, &format!("stopped answering: {why}"));
            }
            let addr = self
                .req
                .holder_addr(h)
                .map_or_else(|| format!("holder {h}"), |a| a.to_string());
            self.report.failures.push(format!(
                "{addr} stopped answering ({why}) before step {step}: marked dead, its chunks go to their replicas"
            ));
        }
        let sparse = chunks.is_empty();
        let replicas: Vec<usize> = if sparse {
            (0..self.req.holders()).collect()
        } else {
            self.req.live_replicas(chunk)
        };
        // A forced primitive is the only one the selector may choose: it still picks the
        // holder, priced for that primitive.
        let request = match self.force {
            Some(p) => Request {
                allowed: Allowed::only(p),
                ..*request
            },
            None => *request,
        };
        let chosen = self.cal.selector.decide(&replicas, request)?;
        let holder = if sparse {
            None
        } else {
            // The chunk's routes and fetches go where the selector priced them (its holders
            // are the requester's, index for index).
            self.req.prefer(chunk, chosen.holder);
            chosen
                .holder
                .and_then(|h| self.req.holder_addr(h))
                .map(|a| a.to_string())
        };
        let (choice, reason) = match self.force {
            Some(p) => (p, "forced".to_owned()),
            None => {
                let line = chosen
                    .decision
                    .to_string()
                    .lines()
                    .next()
                    .unwrap_or_default()
                    .to_owned();
                (chosen.primitive, line)
            }
        };
        let reason = match request.selection {
            Selection::Sparse { topk, holders } if sparse => {
                format!("sparse top-{topk} over {holders} holders: {reason}")
            }
            _ => reason,
        };
        let chosen_name = format!("{choice:?}");
        let mq = request.mq_rows;
        // The prices move as the calibration refits; the first step's reason stands for the
        // rest (each step's prices are in the timings).
        let same = self.report.decisions.iter_mut().find(|d| {
            d.mq == mq && d.chunks == chunks && d.choice == chosen_name && d.holder == holder
        });
        match same {
            Some(d) => d.steps.push(step),
            None => self.report.decisions.push(Decided {
                step,
                chunk: chunks.first().copied().unwrap_or(u32::MAX),
                steps: vec![step],
                chunks,
                mq,
                choice: chosen_name,
                holder,
                reason,
            }),
        }
        Ok((choice, chosen.decision))
    }

    /// Records one prediction, term by term as it was priced, beside its measurement.
    /// `chunk`: the one chunk it routed or fetched, whose holder is noted.
    fn timed(
        &mut self,
        (step, kind): (u32, &'static str),
        (what, chunk): (String, Option<u32>),
        primitive: Primitive,
        (predicted, measured_us): (&CostBreakdown, f64),
    ) {
        let holder = chunk
            .and_then(|c| self.req.holder_for(ChunkId(c)).ok())
            .and_then(|h| self.req.holder_addr(h))
            .map(|a| a.to_string());
        self.report.timings.push(Timing {
            step,
            kind,
            holder,
            what,
            primitive,
            predicted_us: predicted.total_us(),
            measured_us,
            predicted: *predicted,
        });
    }

    /// One dense decode step: every chunk attended by the primitive chosen for it, each
    /// checked layer's merged output against one call over the whole document. Fetched
    /// chunks are fetched once for the step and read for every layer.
    fn dense_step(&mut self, step: u32, mq: usize, seed: u64) -> Result<()> {
        let spec = self.spec;
        // The requester's own prompt precedes the document: a fetched chunk is re-homed past
        // it, and decode queries sit at the end of the document as the requester sees it.
        let prefix = PREFIX;
        let doc_tokens = spec.tokens() as i64;
        let q = queries(
            mq,
            prefix + doc_tokens + i64::from(step),
            &self.rope,
            seed ^ u64::from(step),
        );
        // One decision per chunk: its holders differ in kernel, load and liveness.
        let request = Request::contiguous(mq as u32, spec.chunk_tokens);
        let mut choice = Vec::with_capacity(spec.chunks as usize);
        let mut priced = Vec::with_capacity(spec.chunks as usize);
        for c in 0..spec.chunks {
            let (primitive, decision) = self.decide(step, &request, (ChunkId(c), vec![c]))?;
            choice.push(primitive);
            priced.push(decision);
        }
        let mut fetched: Vec<(u32, Fetched, Vec<Vec<u16>>)> = Vec::new();
        for c in 0..spec.chunks {
            if choice[c as usize] == Primitive::Fetch {
                let (chunk, spliced) = self.fetch_spliced(c, prefix)?;
                let measured = chunk.transfer_us + chunk.splice_us;
                let predicted = priced[c as usize].fetch.breakdown;
                self.timed(
                    (step, "fetch (one chunk, every layer, spliced)"),
                    (format!("fetch chunk {c}"), Some(c)),
                    Primitive::Fetch,
                    (&predicted, measured),
                );
                let bytes = corpus_model(spec)?.chunk_bytes(spec.chunk_tokens, spec.layers);
                let now = self.cal.now_ms();
                self.cal
                    .selector
                    .observe_pull(bytes, chunk.transfer_us, now);
                self.served(ChunkId(c));
                fetched.push((c, chunk, spliced));
            }
        }
        let queries_q = Queries::new(&q)?;
        for (l, layer) in self.layers.into_iter().enumerate() {
            let calls: Vec<Call<'_>> = (0..spec.chunks)
                .filter(|&c| choice[c as usize] == Primitive::Route)
                .map(|c| Call {
                    chunk: ChunkId(c),
                    layer: layer as u16,
                    queries: &q,
                    sparse: None,
                })
                .collect();
            // Each routed chunk on its own round trip, timed as the model prices it: one
            // chunk, one layer, submit to its partial merged from the wire.
            let mut parts = Vec::new();
            for call in &calls {
                let started = Instant::now();
                let merged = route_merged(&mut self.req, std::slice::from_ref(call))?;
                let us = started.elapsed().as_secs_f64() * 1e6;
                self.report.route_us.push(us);
                let c = call.chunk.0;
                let predicted = priced[c as usize].route.breakdown;
                self.timed(
                    (step, "route (one chunk, one layer)"),
                    (format!("route chunk {c} layer {layer}"), Some(c)),
                    Primitive::Route,
                    (&predicted, us),
                );
                if merged.fallbacks.is_empty() {
                    let now = self.cal.now_ms();
                    self.cal
                        .selector
                        .observe_route(mq as u32, us - merged.kernel_us, now);
                }
                parts.extend(self.note_fallbacks(merged));
                self.served(call.chunk);
            }
            // The reference attends each chunk as its primitive does: routed and local ones at
            // their stored positions, fetched ones spliced to the requester's.
            let mut whole_rows: Vec<u16> = Vec::new();
            let mut local = 0;
            for c in 0..spec.chunks {
                let full = FullBlock::new(&self.blocks[c as usize], spec.layout())?;
                let rows = full.layer(layer)?.rows();
                match choice[c as usize] {
                    Primitive::Route => whole_rows.extend_from_slice(rows),
                    Primitive::Fetch => {
                        let Some((_, chunk, spliced)) = fetched.iter().find(|f| f.0 == c) else {
                            continue;
                        };
                        let cache = self.req.fetched_cache(chunk, layer as usize)?;
                        parts.push(partial_dense(Backend::Cpu, &queries_q, &cache, SCALE)?);
                        whole_rows.extend_from_slice(&spliced[l]);
                    }
                    Primitive::Local => {
                        // No weights: the full copy's attention stands in for a re-prefill.
                        let cache = Cache::contiguous(rows)?;
                        parts.push(partial_dense(Backend::Cpu, &queries_q, &cache, SCALE)?);
                        whole_rows.extend_from_slice(rows);
                        local += 1;
                    }
                }
            }
            if local == spec.chunks {
                // Nothing crossed the wire: there is no holder output to check.
                continue;
            }
            let whole = partial_dense(
                Backend::Cpu,
                &queries_q,
                &Cache::contiguous(&whole_rows)?,
                SCALE,
            )?;
            let merged = merge(&parts.iter().collect::<Vec<_>>())?;
            let (via, tolerance) = if calls.is_empty() {
                ("fetched and spliced here", F32_TOL)
            } else {
                ("through the wire", BF16_TOL)
            };
            let with_local = if local > 0 {
                format!(" ({local} local parts)")
            } else {
                String::new()
            };
            check(
                &mut self.report.checks,
                format!("step {step} layer {layer} dense, {via}{with_local}"),
                &merged,
                &whole,
                tolerance,
            );
        }
        for (_, chunk, _) in fetched {
            self.req.release(chunk)?;
        }
        Ok(())
    }

    /// Fetches chunk `c` re-homed `prefix` positions later, and the same splice applied to
    /// the full copy's checked layers for the reference.
    fn fetch_spliced(&mut self, c: u32, prefix: i64) -> Result<(Fetched, Vec<Vec<u16>>)> {
        let spec = self.spec;
        let from = spec.positions(ChunkId(c));
        let to: Vec<i64> = from.iter().map(|p| p + prefix).collect();
        let fetched = self
            .req
            .fetch(ChunkId(c), &to, self.rope, Backend::Cpu)
            .with_context(|| format!("fetching chunk {c}"))?;
        self.report
            .fetch_us
            .push((fetched.transfer_us, fetched.splice_us));
        let layout = spec.layout();
        let full = FullBlock::new(&self.blocks[c as usize], layout)?;
        let table: Vec<u32> = (0..layout.pages_per_layer() as u32).collect();
        let mut spliced = Vec::with_capacity(self.layers.len());
        for layer in self.layers {
            let rows = full.layer(layer)?.rows();
            let mut pool = vec![0u16; layout.layer_elems()];
            let job =
                kvroute_kernels::SpliceJob::new(rows, 1, &from, &to, self.rope, &mut pool, &table)?;
            kvroute_kernels::splice(Backend::Cpu, job)?;
            pool.truncate(rows.len());
            spliced.push(pool);
        }
        Ok((fetched, spliced))
    }

    /// The partials of a routed step; its fallbacks go to the report's failures.
    fn note_fallbacks(&mut self, merged: MergedStep) -> Vec<Partial> {
        for f in &merged.fallbacks {
            self.report.failures.push(format!(
                "{}: {}; retried on another replica",
                f.chunk, f.error
            ));
        }
        merged.parts
    }

    /// The sparse step: one decode token's 16 heads select top-2048 of the whole document,
    /// scattered over every holder. Route: each holder attends its subset in place (no
    /// splice) and the partials are merged here. Fetch: every holder that has some sends its
    /// selected rows (a gather, no splice) and they are attended here.
    fn sparse_step(&mut self, step: u32, seed: u64) -> Result<()> {
        let spec = self.spec;
        let ct = spec.chunk_tokens as i32;
        let sel_k = TOPK.min(spec.tokens());
        let global = selection(seed, sel_k, spec.tokens());
        let q = queries(HEADS, spec.tokens() as i64, &self.rope, seed ^ 0x5a5a);
        let per_chunk: Vec<Vec<i32>> = (0..spec.chunks as i32)
            .map(|c| {
                global
                    .iter()
                    .filter(|&&g| g / ct == c)
                    .map(|&g| g - c * ct)
                    .collect()
            })
            .collect();
        let spanned = per_chunk.iter().filter(|idx| !idx.is_empty()).count() as u32;
        let request = Request::sparse(HEADS as u32, spec.tokens() as u32, sel_k as u32, spanned);
        // Local has no sparse path here (no weights to recompute a selection with): routed.
        let (choice, priced) = self.decide(step, &request, (ChunkId(0), Vec::new()))?;
        let qq = Queries::new(&q)?;
        // Single-instance sparse attention over the whole document, per checked layer: what
        // every path must give.
        let mut wholes = Vec::with_capacity(self.layers.len());
        for layer in self.layers {
            let doc = spec.document_layer(&self.blocks, layer)?;
            let cache = Cache::contiguous(&doc)?;
            let selection =
                kvroute_kernels::Selection::new(&global, sel_k, HEADS, HEADS, cache.tokens())?;
            wholes.push(partial_sparse(
                Backend::Cpu,
                &qq,
                &cache,
                &selection,
                SCALE,
            )?);
        }
        let mut checks: Vec<Check> = Vec::new();
        if choice == Primitive::Fetch {
            let parts: Vec<GatherPart<'_>> = per_chunk
                .iter()
                .enumerate()
                .filter(|(_, idx)| !idx.is_empty())
                .map(|(c, idx)| GatherPart {
                    chunk: ChunkId(c as u32),
                    tokens: idx,
                })
                .collect();
            // The checked layers only (a holder stages one request's gathered rows, and every
            // layer's would not fit); the prediction is priced for as many layers.
            let wanted: Vec<u16> = self.layers.iter().map(|&l| l as u16).collect();
            let gathered = self
                .req
                .gather(&parts, &wanted)
                .context("gathering the sparse selection")?;
            self.report.gather_us.push(gathered.transfer_us);
            let mut params = self.cal.selector.params_for(None)?;
            params.model.layers = wanted.len() as u32;
            let predicted = kvroute_costmodel::CostModel::new(params)?.fetch(&request)?;
            self.timed(
                (
                    step,
                    "sparse fetch (gather from every holder, the checked layers)",
                ),
                (
                    format!(
                        "gather top-{sel_k} from {spanned} holders, {} layers",
                        wanted.len()
                    ),
                    None,
                ),
                Primitive::Fetch,
                (&predicted, gathered.transfer_us),
            );
            for (i, &layer) in self.layers.iter().enumerate() {
                // The gathered rows are the selection, in order: attend all of them.
                let cache = self.req.gathered_cache(&gathered, i)?;
                let got = partial_dense(Backend::Cpu, &qq, &cache, SCALE)?;
                let name = format!(
                    "sparse top-{sel_k} gathered from {spanned} holders, layer {layer}, attended here"
                );
                check(&mut checks, name, &got, &wholes[i], F32_TOL);
            }
            self.req.release_gathered(gathered)?;
            for (c, idx) in per_chunk.iter().enumerate() {
                if !idx.is_empty() {
                    self.served(ChunkId(c as u32));
                }
            }
        } else {
            for (i, layer) in self.layers.into_iter().enumerate() {
                let calls: Vec<Call<'_>> = per_chunk
                    .iter()
                    .enumerate()
                    .filter(|(_, idx)| !idx.is_empty())
                    .map(|(c, idx)| Call {
                        chunk: ChunkId(c as u32),
                        layer: layer as u16,
                        queries: &q,
                        sparse: Some(Sparse {
                            indices: idx,
                            k: idx.len() as u32,
                            rows_per_token: HEADS as u32,
                        }),
                    })
                    .collect();
                let started = Instant::now();
                let merged = route_merged(&mut self.req, &calls)?;
                let us = started.elapsed().as_secs_f64() * 1e6;
                self.timed(
                    (step, "sparse route (every holder at once, one layer)"),
                    (
                        format!("sparse route to {} holders, layer {layer}", calls.len()),
                        None,
                    ),
                    Primitive::Route,
                    (&priced.route.breakdown, us),
                );
                let parts = self.note_fallbacks(merged);
                for call in &calls {
                    self.served(call.chunk);
                }
                let merged = merge(&parts.iter().collect::<Vec<_>>())?;
                let name = format!(
                    "sparse top-{sel_k} over {} holders, layer {layer}, through the wire",
                    calls.len()
                );
                check(&mut checks, name, &merged, &wholes[i], BF16_TOL);
            }
        }
        self.report.checks.extend(checks);
        Ok(())
    }
}

/// `k` distinct document positions out of `tokens`, drawn from `seed` (xorshift).
fn selection(seed: u64, k: usize, tokens: usize) -> Vec<i32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut picked = std::collections::BTreeSet::new();
    while picked.len() < k {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        picked.insert((s % tokens as u64) as i32);
    }
    picked.into_iter().collect()
}
