//! The selector's start-up calibration on live holders: the fabric from routed round trips,
//! each holder's kernel roofline and load as it reports them, the requester's merge and splice
//! measured here, and one whole-chunk pull. What [`crate::step::Stepper::new`] runs, and what a
//! caller that drives the primitives itself (`kvroute verify-predicate`) can run alone.

use std::time::Instant;

use kvroute_costmodel::{CostParams, ModelDims, Source};
use kvroute_kernels::{Backend, Rope};
use kvroute_kvstore::ChunkId;
use kvroute_sched::selector::{FabricBounds, FabricEstimator, HolderState, Selector};

use super::StepError;
use crate::probe::{ProbeConfig, ProbedFabric, measure_merge, measure_splice, probe_fabric};
use crate::requester::Requester;

/// Route samples the fabric estimator keeps (the start-up sweep is 480; routes run later
/// replace them one by one).
const WINDOW: usize = 512;
/// New route samples between two refits (a refit of the full window takes about 0.3 ms).
const REFIT_EVERY: usize = 32;

/// What the calibration needs to know of the model and the chunks.
#[derive(Debug, Clone, Copy)]
pub struct CalibrationInputs<'a> {
    /// The model the chunks are the KV of (its `layers` the chunks' layers).
    pub model: ModelDims,
    /// The rotation the chunks were stored with (the splice is measured with it).
    pub rope: Rope,
    /// Tokens of a chunk (the splice is measured at this size).
    pub chunk_tokens: u32,
    /// Query rows for the probe sweep (`[n, 576]` bf16, at least as many as its largest
    /// point).
    pub probe_rows: &'a [u16],
    /// A chunk to fetch once, with the positions it is re-homed to, to seed the pull
    /// estimator; `None` leaves the pull to the preset until the first fetch.
    pub pull: Option<(ChunkId, &'a [i64])>,
    /// The probe sweep (its bounds are set from the copy rate measured here).
    pub probe: &'a ProbeConfig,
}

/// A calibrated selector and what its calibration measured.
#[derive(Debug)]
pub struct Calibrated {
    /// The selector.
    pub selector: Selector,
    /// The start-up probe sweep.
    pub probe: ProbedFabric,
    /// The memory copy rate measured here, GB/s (the fabric's upper bound).
    pub memcpy_gbps: f64,
    epoch: Instant,
}

impl Calibrated {
    /// Milliseconds since the calibration started: the selector's clock.
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Asks every live holder for its kernel roofline and load and hands them to the selector.
    /// A holder that does not answer is marked dead, here and in the requester (its chunks go
    /// to their replicas); returns those, each with why.
    pub fn poll_holders(&mut self, req: &mut Requester) -> Result<Vec<(usize, String)>, StepError> {
        let now = self.now_ms();
        let mut dead = Vec::new();
        for h in 0..req.holders() {
            if !self.selector.holders().get(h).is_some_and(|s| s.alive) {
                continue;
            }
            match req.holder_stats(h) {
                Ok(stats) => {
                    // This requester's own session is one of the holder's active ones.
                    let others = stats.active.saturating_sub(1) as u32;
                    let cap = if stats.cap == 0 { 8 } else { stats.cap as u32 };
                    let kernel = stats.kernel.map(|k| k.compute);
                    self.selector.holder_report(h, (others, cap, kernel), now)?;
                }
                Err(e) => {
                    tracing::warn!(holder = h, %e, "holder did not report; marked dead");
                    self.selector.set_alive(h, false)?;
                    req.mark_dead(h)?;
                    dead.push((h, e.to_string()));
                }
            }
        }
        Ok(dead)
    }

    /// Keeps the selector's holders in step with the requester's: holders the requester added
    /// since (a directory) join alive, and holders it marked dead are dead here too.
    pub fn sync_holders(&mut self, req: &Requester) -> Result<(), StepError> {
        while self.selector.holders().len() < req.holders() {
            self.selector.add_holder(HolderState::new(8));
        }
        for h in 0..req.holders() {
            let alive = req.is_alive(h);
            if self.selector.holders()[h].alive != alive {
                self.selector.set_alive(h, alive)?;
            }
        }
        Ok(())
    }
}

/// One large copy's rate here, GB/s: the most a host-memory path can move.
pub fn memcpy_gbps() -> f64 {
    let n = 64 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let started = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        best = best.min(started.elapsed().as_secs_f64());
    }
    n as f64 / best / 1e9
}

/// Calibrates a selector on `req`'s holders: the probe sweep (its route samples fitted by the
/// selector's estimator), every holder's report, the merge and the splice measured here, and
/// the pull of `inputs.pull` if given.
pub fn calibrate(
    req: &mut Requester,
    inputs: CalibrationInputs<'_>,
) -> Result<Calibrated, StepError> {
    let epoch = Instant::now();
    let model = inputs.model;
    let memcpy_gbps = memcpy_gbps();
    let bounds = FabricBounds {
        // Over host memory nothing beats a copy (with margin for a slow moment of the copy).
        max_gbps: 2.0 * memcpy_gbps,
        ..FabricBounds::default()
    };
    // A sweep whose line the selector would refuse is measured again.
    let probe_config = ProbeConfig {
        max_gbps: bounds.max_gbps,
        max_fixed_us: bounds.max_fixed_us,
        ..inputs.probe.clone()
    };
    let probe = probe_fabric(
        req,
        &probe_config,
        inputs.probe_rows,
        model.routed_row_bytes(),
    )?;
    let mut base = CostParams::paper_defaults(model, probe.fabric);
    base.sources.fabric = Source::Measured;
    let estimators = (
        FabricEstimator::new(WINDOW, REFIT_EVERY, bounds)?,
        FabricEstimator::new(64, 4, bounds)?,
    );
    let holders = vec![HolderState::new(8); req.holders()];
    let mut c = Calibrated {
        selector: Selector::new(base, holders, estimators)?,
        probe,
        memcpy_gbps,
        epoch,
    };
    let now = c.now_ms();
    c.selector.seed_routes(&c.probe.samples);
    if let Err(e) = c.selector.refit(now) {
        // The probe's own constants (a bound, said so in its fallback) stay in the base.
        tracing::warn!(%e, "no fabric fit from the probe sweep");
    }
    c.poll_holders(req)?;
    let merge = measure_merge(5)?;
    c.selector.set_merge(merge, c.now_ms())?;
    let splice = measure_splice(
        Backend::Cpu,
        inputs.rope,
        model.layers as usize,
        (inputs.chunk_tokens as usize, 3),
    )?;
    c.selector.set_splice(splice, c.now_ms())?;
    if let Some((chunk, to)) = inputs.pull {
        let fetched = req.fetch(chunk, to, inputs.rope, Backend::Cpu)?;
        let bytes = model.chunk_bytes(inputs.chunk_tokens, model.layers);
        c.selector
            .observe_pull(bytes, fetched.transfer_us, c.now_ms());
        req.release(fetched)?;
    }
    let cal = c.selector.calibration(c.now_ms());
    tracing::info!(
        fabric = ?cal.fabric,
        merge = ?cal.merge.0,
        splice = ?cal.splice.0,
        "selector calibrated"
    );
    Ok(c)
}
