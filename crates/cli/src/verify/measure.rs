//! One chunk size of `verify-predicate`: its holders started, a requester calibrated on them,
//! the grid measured through the warm-up passes and the compared ones, and each point's
//! predictions beside its measurements.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kvroute_kernels::{Backend, Partial, Rope};
use kvroute_kvstore::corpus::queries;
use kvroute_kvstore::{ChunkId, CorpusSpec};
use kvroute_remote::{Requester, RequesterConfig};
use kvroute_sched::selector::Choice;
use kvroute_transport::ProviderChoice;

use super::{
    Cold, Measured, PREFIX, PROBE_MQ, RouteTimes, Samples, VerifyPoint, WARM, decide, point,
    route_once,
};
use crate::args::VerifyArgs;
use crate::calibrate::{Calibrated, CalibrationSummary, calibrate, corpus_model};
use crate::demo::{HolderProcess, SCALE, fabric_engine_with, spawn_holder, v2_lite_corpus};

/// What one chunk size gave.
pub(super) struct ChunkSize {
    /// The provider the requester's transport opened.
    pub(super) provider: String,
    /// The selector's calibration once the warm-up passes refitted it.
    pub(super) calibration: CalibrationSummary,
    /// The grid's points at this chunk size.
    pub(super) points: Vec<VerifyPoint>,
}

/// A grid point's inputs: `mq` query rows `q` against chunk `chunk`, and the positions `to`
/// a fetch splices the chunk at (after the prefix).
struct GridPoint {
    mq: u32,
    chunk: u32,
    q: Vec<u16>,
    to: Vec<i64>,
}

/// What the passes over the grid gave: each point's samples from the compared passes, and
/// the selector's choices (and its calibration) once the warm-up passes had refitted it.
struct Passes {
    samples: Vec<Samples>,
    warm: Vec<Choice>,
    calibration: CalibrationSummary,
}

/// A route's and a fetch's times at one grid point.
struct Times {
    route: RouteTimes,
    fetch_us: f64,
}

/// The live system at one chunk size: a requester on its holders, with the selector
/// calibrated on them.
struct Live {
    req: Requester,
    cal: Calibrated,
    /// Tokens per chunk.
    ct: u32,
    rope: Rope,
    /// Bytes of a chunk, every layer: what a fetch moves.
    chunk_bytes: f64,
}

/// Measures the grid at chunks of `ct` tokens, with requests' slots of `slot_bytes` and
/// partials of up to `largest` rows.
pub(super) fn at_chunk_size(
    args: &VerifyArgs,
    provider: &ProviderChoice,
    ct: u32,
    slot_bytes: usize,
    largest: usize,
) -> Result<ChunkSize> {
    let spec = v2_lite_corpus(ct, args.holders as u32, args.seed)?;
    let procs = start_holders(args, &spec, provider, slot_bytes)?;
    let addrs: Vec<_> = procs.iter().map(|p| p.addr).collect();
    let (engine, provider_name) = fabric_engine_with(provider, args.progress)?;
    let mut config = RequesterConfig::new(SCALE);
    config.link_bytes = slot_bytes;
    config.pool_pages = spec.layout().pages() as u32;
    config.timeout = Duration::from_secs(30);
    // Spin briefly, then sleep: a requester busy-polling through a long route takes a core
    // from the holder's kernel on a small machine.
    config.spin = Duration::from_millis(1);
    let mut req = Requester::connect(engine, &addrs, config)?;
    let rope = spec.rope()?;
    let doc = spec.tokens() as i64;
    let re_homed = |c: u32| -> Vec<i64> {
        spec.positions(ChunkId(c))
            .iter()
            .map(|p| p + PREFIX)
            .collect()
    };
    let probe_rows = queries(PROBE_MQ, doc, &rope, args.seed ^ 99);
    let to0 = re_homed(0);
    let cal = calibrate(&mut req, &spec, &probe_rows, Some((ChunkId(0), &to0)))
        .with_context(|| format!("calibrating at ct = {ct}"))?;
    let grid: Vec<GridPoint> = args
        .mq
        .iter()
        .enumerate()
        .map(|(i, &mq)| {
            let chunk = (i % args.holders) as u32;
            let q = queries(mq as usize, PREFIX + doc, &rope, args.seed ^ u64::from(mq));
            GridPoint {
                mq,
                chunk,
                q,
                to: re_homed(chunk),
            }
        })
        .collect();
    let mut live = Live {
        req,
        cal,
        ct,
        rope,
        chunk_bytes: corpus_model(&spec)?.chunk_bytes(ct, spec.layers),
    };
    // Predictions from the start-up calibration alone ("cold").
    let cold = live.decide_all(&grid)?;
    let passes = live.passes(&grid, largest, args.reps)?;
    let points = points_of(&grid, ct, passes.samples, &passes.warm, &cold);
    drop(live);
    drop(procs);
    Ok(ChunkSize {
        provider: provider_name,
        calibration: passes.calibration,
        points,
    })
}

/// One holder process per chunk of `spec`, each taking two requesters with slots of
/// `slot_bytes`.
fn start_holders(
    args: &VerifyArgs,
    spec: &CorpusSpec,
    provider: &ProviderChoice,
    slot_bytes: usize,
) -> Result<Vec<HolderProcess>> {
    (0..args.holders)
        .map(|h| {
            spawn_holder(
                spec,
                provider,
                &[h as u32],
                &[
                    "--progress".into(),
                    args.progress.to_string(),
                    "--max-requesters".into(),
                    "2".into(),
                    "--slot-bytes".into(),
                    slot_bytes.to_string(),
                    "--backend".into(),
                    args.holder_backend.clone(),
                ],
            )
        })
        .collect()
}

impl Live {
    /// The selector's choice at every point of `grid`, as it prices them now.
    fn decide_all(&self, grid: &[GridPoint]) -> Result<Vec<Choice>> {
        grid.iter()
            .map(|g| decide(&self.req, &self.cal, g.chunk, g.mq, self.ct))
            .collect()
    }

    /// Passes over `grid`, each point routed (partials of up to `largest` rows) and fetched,
    /// every measurement observed by the selector: passes of traffic the live system learns
    /// from (the selector refits the fabric and the pulls, the holders refit their kernels),
    /// then predictions are fixed and the next `reps` passes are what they are compared with.
    fn passes(&mut self, grid: &[GridPoint], largest: usize, reps: usize) -> Result<Passes> {
        let mut merged = Partial::empty(largest);
        let mut samples = vec![Samples::default(); grid.len()];
        let mut warm = Vec::new();
        let mut calibration = None;
        let warm_passes = WARM.max(kvroute_sched::selector::LIVE_FIXED.div_ceil(grid.len()));
        for rep in 0..warm_passes + reps {
            for k in 0..grid.len() {
                let i = if rep % 2 == 0 { k } else { grid.len() - 1 - k };
                let times = self.route_and_fetch(&grid[i], &mut merged)?;
                if rep >= warm_passes {
                    let s = &mut samples[i];
                    s.route.push(times.route.total_us);
                    s.kernel.push(times.route.kernel_us);
                    s.fetch.push(times.fetch_us);
                }
            }
            if rep + 1 == warm_passes {
                self.cal.poll_holders(&mut self.req)?;
                let _ = self.cal.selector.refit(self.cal.now_ms());
                calibration = Some(CalibrationSummary::of(&self.cal)?);
                warm = self.decide_all(grid)?;
            }
        }
        Ok(Passes {
            samples,
            warm,
            calibration: calibration.context("no warm-up pass")?,
        })
    }

    /// Routes `g`'s rows (merging the partial into `merged`) and fetches its chunk, each
    /// observed by the selector.
    fn route_and_fetch(&mut self, g: &GridPoint, merged: &mut Partial) -> Result<Times> {
        let route = route_once(&mut self.req, g.chunk, &g.q, merged)?;
        let started = Instant::now();
        let fetched = self
            .req
            .fetch(ChunkId(g.chunk), &g.to, self.rope, Backend::Cpu)
            .with_context(|| format!("fetching chunk {}", g.chunk))?;
        let fetch_us = started.elapsed().as_secs_f64() * 1e6;
        let now = self.cal.now_ms();
        self.cal.selector.observe_route(
            g.mq,
            route.total_us - route.kernel_us - route.merge_us,
            now,
        );
        self.cal
            .selector
            .observe_pull(self.chunk_bytes, fetched.transfer_us, now);
        self.req.release(fetched)?;
        Ok(Times { route, fetch_us })
    }
}

/// Each grid point's measurements (`samples`) beside the selector's predictions after the
/// warm-up (`warm`) and at start-up (`cold`).
fn points_of(
    grid: &[GridPoint],
    ct: u32,
    mut samples: Vec<Samples>,
    warm: &[Choice],
    cold: &[Choice],
) -> Vec<VerifyPoint> {
    let mut points = Vec::new();
    for (i, g) in grid.iter().enumerate() {
        let s = std::mem::take(&mut samples[i]);
        let choice = &warm[i];
        let mut p = point(
            g.mq,
            ct,
            choice.holder.unwrap_or(0),
            choice.primitive,
            (
                Measured::new(choice.decision.route.total_us, s.route),
                Measured::new(choice.decision.fetch.total_us, s.fetch),
            ),
        );
        p.route_kernel = Measured::new(choice.decision.route.breakdown.compute_us, s.kernel);
        p.cold = Cold {
            route_predicted_us: cold[i].decision.route.total_us,
            fetch_predicted_us: cold[i].decision.fetch.total_us,
            choice: cold[i].primitive,
        };
        points.push(p);
    }
    points
}
