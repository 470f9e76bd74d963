//! The selector's start-up calibration on live holders, shared by `kvroute demo` /
//! `kvroute requester` and `kvroute verify-predicate`: the fabric from routed round trips,
//! each holder's kernel roofline and load as it reports them, the requester's merge and splice
//! measured here, and one whole-chunk pull.

use std::time::Instant;

use anyhow::{Context, Result};
use kvroute_costmodel::{CostParams, KernelTable, ModelDims, Source, model_preset};
use kvroute_kernels::Backend;
use kvroute_kvstore::{ChunkId, CorpusSpec};
use kvroute_remote::Requester;
use kvroute_remote::probe::{
    ProbeConfig, ProbedFabric, measure_merge, measure_splice, probe_fabric,
};
use kvroute_sched::selector::{FabricBounds, FabricEstimator, HolderState, Selector};
use serde::Serialize;

/// Route samples the fabric estimator keeps (the start-up sweep is 480; routes run later
/// replace them one by one).
const WINDOW: usize = 512;
/// New route samples between two refits (a refit of the full window takes about 0.3 ms).
const REFIT_EVERY: usize = 32;

/// A calibrated selector and what its calibration measured.
pub(crate) struct Calibrated {
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
    pub(crate) fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Asks every live holder for its kernel roofline and load and hands them to the selector.
    /// A holder that does not answer is marked dead, here and in the requester (its chunks go
    /// to their replicas); returns those, each with why.
    pub(crate) fn poll_holders(&mut self, req: &mut Requester) -> Result<Vec<(usize, String)>> {
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
}

/// The model the corpus is shaped like: DeepSeek-V2-Lite with the corpus's layer count.
pub(crate) fn corpus_model(spec: &CorpusSpec) -> Result<ModelDims> {
    let mut dims = model_preset("deepseek-v2-lite")?.dims;
    dims.layers = spec.layers;
    Ok(dims)
}

/// One large copy's rate here, GB/s: the most a host-memory path can move.
pub(crate) fn memcpy_gbps() -> f64 {
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

/// Calibrates a selector on `req`'s holders for `spec`'s chunks: the probe sweep (its route
/// samples fitted by the selector's estimator), every holder's report, the merge and the
/// splice measured here, and one fetch of `pull` (a chunk and its new positions) if given.
pub(crate) fn calibrate(
    req: &mut Requester,
    spec: &CorpusSpec,
    probe_rows: &[u16],
    pull: Option<(ChunkId, &[i64])>,
) -> Result<Calibrated> {
    let epoch = Instant::now();
    let model = corpus_model(spec)?;
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
        ..ProbeConfig::default()
    };
    let probe = probe_fabric(req, &probe_config, probe_rows, model.routed_row_bytes())
        .context("probing the fabric")?;
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
        spec.rope()?,
        spec.layers as usize,
        (spec.chunk_tokens as usize, 3),
    )?;
    c.selector.set_splice(splice, c.now_ms())?;
    if let Some((chunk, to)) = pull {
        let fetched = req
            .fetch(chunk, to, spec.rope()?, Backend::Cpu)
            .context("the calibration's pull")?;
        let bytes = model.chunk_bytes(spec.chunk_tokens, spec.layers);
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

/// The calibration as printed: the constants each prediction used and their age.
#[derive(Debug, Clone, Serialize)]
pub struct CalibrationSummary {
    /// Fabric fixed cost, microseconds.
    pub probe_us: f64,
    /// Fabric bandwidth, GB/s.
    pub bw_gbps: f64,
    /// Whether the fabric is the estimator's fit (else the probe's own constants, with the
    /// estimator's refusal in `detail.fabric_rejected`).
    pub fabric_fitted: bool,
    /// Median absolute residual of the fabric fit, percent.
    pub fabric_residual_pct: Option<f64>,
    /// Samples behind the fabric fit.
    pub fabric_samples: usize,
    /// Pull bandwidth, GB/s, if measured.
    pub pull_gbps: Option<f64>,
    /// Merge: fixed us and us per row-part.
    pub merge: (f64, f64),
    /// Splice: fixed us and us per token.
    pub splice: (f64, f64),
    /// Each holder's kernel as it reported it: its fixed cost (us) and its cost per
    /// row-entry (ns) at each of the table's row counts over 2048 entries, if reported.
    pub holder_kernels: Vec<Option<(f64, Vec<f64>)>>,
    /// The memory copy rate here, GB/s (the fabric fit's upper bound is twice it).
    pub memcpy_gbps: f64,
    /// Ages, milliseconds, and every other detail.
    pub detail: kvroute_sched::selector::Calibration,
}

impl CalibrationSummary {
    pub(crate) fn of(c: &Calibrated) -> Result<Self> {
        let cal = c.selector.calibration(c.now_ms());
        let params = c.selector.params_for(None)?;
        Ok(Self {
            probe_us: params.fabric.probe_us,
            bw_gbps: params.fabric.bw_gbps,
            fabric_fitted: cal.fabric.is_some(),
            fabric_residual_pct: cal.fabric.map(|f| f.median_residual_pct),
            fabric_samples: cal.fabric.map_or(0, |f| f.samples),
            pull_gbps: params.pull.map(|p| p.bw_gbps),
            merge: (cal.merge.0.fixed_us, cal.merge.0.us_per_row_part),
            splice: (cal.splice.0.fixed_us, cal.splice.0.per_token_us),
            holder_kernels: cal
                .holders
                .iter()
                .map(|h| {
                    h.kernel.map(|k| {
                        let per = KernelTable::ROWS
                            .iter()
                            .map(|&r| 1e3 * k.shape_us(r, 2048.0) / (r * 2048.0))
                            .collect();
                        (k.fixed_us, per)
                    })
                })
                .collect(),
            memcpy_gbps: c.memcpy_gbps,
            detail: cal,
        })
    }
}

impl std::fmt::Display for CalibrationSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "calibration (measured here): fabric {:.1} us + bytes at {:.2} GB/s ({}{}), pull {}, \
             merge {:.1} us + {:.4} us/row-part, splice {:.0} us + {:.3} us/token",
            self.probe_us,
            self.bw_gbps,
            if self.fabric_fitted {
                let live = self.detail.fabric.map_or(0, |f| f.live_fixed);
                if live > 0 {
                    format!(
                        "Theil-Sen slope over {} route samples, fixed cost from the {live} live ones",
                        self.fabric_samples
                    )
                } else {
                    format!("Theil-Sen over {} route samples", self.fabric_samples)
                }
            } else {
                format!(
                    "the probe's constants; the estimator refused its line: {}",
                    self.detail
                        .fabric_rejected
                        .as_deref()
                        .unwrap_or("no line through the samples")
                )
            },
            self.fabric_residual_pct
                .map(|r| format!(", median residual {r:.0}%"))
                .unwrap_or_default(),
            self.pull_gbps
                .map_or("not measured".to_owned(), |g| format!("{g:.2} GB/s")),
            self.merge.0,
            self.merge.1,
            self.splice.0,
            self.splice.1
        )?;
        for (h, k) in self.holder_kernels.iter().enumerate() {
            match k {
                Some((fixed, per)) => {
                    let per: Vec<String> = per.iter().map(|ns| format!("{ns:.1}")).collect();
                    writeln!(
                        f,
                        "  holder {h} kernel (its own report): {fixed:.0} us + ns/row-entry at 1/16/64/256/1024 rows over 2048 entries: {}",
                        per.join("/")
                    )?
                }
                None => writeln!(
                    f,
                    "  holder {h} kernel: no report, paper 000's H100 roofline"
                )?,
            }
        }
        Ok(())
    }
}
