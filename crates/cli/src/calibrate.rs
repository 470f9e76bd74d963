//! The selector's start-up calibration for `kvroute demo` / `kvroute requester` and
//! `kvroute verify-predicate`: [`kvroute_remote::step::calibrate`] over the synthetic
//! corpus's chunks, and what it measured, as printed.

use anyhow::{Context, Result};
use kvroute_costmodel::{KernelTable, ModelDims, model_preset};
use kvroute_kvstore::{ChunkId, CorpusSpec};
use kvroute_remote::Requester;
use kvroute_remote::probe::ProbeConfig;
pub(crate) use kvroute_remote::step::Calibrated;
use kvroute_remote::step::CalibrationInputs;
use serde::Serialize;

/// The model the corpus is shaped like: DeepSeek-V2-Lite with the corpus's layer count.
pub(crate) fn corpus_model(spec: &CorpusSpec) -> Result<ModelDims> {
    let mut dims = model_preset("deepseek-v2-lite")?.dims;
    dims.layers = spec.layers;
    Ok(dims)
}

/// Calibrates a selector on `req`'s holders for `spec`'s chunks: the probe sweep, every
/// holder's report, the merge and the splice measured here, and one fetch of `pull` (a chunk
/// and its new positions) if given.
pub(crate) fn calibrate(
    req: &mut Requester,
    spec: &CorpusSpec,
    probe_rows: &[u16],
    pull: Option<(ChunkId, &[i64])>,
) -> Result<Calibrated> {
    let inputs = CalibrationInputs {
        model: corpus_model(spec)?,
        rope: spec.rope()?,
        chunk_tokens: spec.chunk_tokens,
        probe_rows,
        pull,
        probe: &ProbeConfig::default(),
    };
    kvroute_remote::step::calibrate(req, inputs).context("calibrating the selector")
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
