//! The per-request route / fetch / local selector of paper 000 ("Move the Query, Not the
//! Cache", section 5.1: evaluate the three costs and take the least, per (chunk, request)),
//! fed constants calibrated on the live system instead of a paper's:
//!
//! - the fabric (`T_probe`, `BW`) from routed round trips, the holder's kernel time taken
//!   out: a Theil-Sen line over a window of samples ([`FabricEstimator`]), refused when it
//!   leaves physical bounds, refitted as the routes the requester actually runs come in;
//! - whole-chunk pulls from the fetches actually run, fitted the same way;
//! - each holder's kernel roofline as the holder reports it (measured on its machine and
//!   backend, [`HolderState::kernel`]), its load against its cap (paper 000 section 6.3's
//!   elbow: a holder at its cap turns new requesters away), and whether it is alive;
//! - the requester's own merge and splice, measured locally by the caller.
//!
//! Like the rest of the crate it is a state machine with no I/O and no clock: every update
//! carries the caller's time in milliseconds, and every value in a [`Calibration`] says how
//! old it is. Decisions and calibration changes are logged through `tracing`.

use std::collections::VecDeque;

use kvroute_costmodel::fit::{median, theil_sen};
use kvroute_costmodel::{
    Allowed, CostModel, CostModelError, CostParams, Decision, Fabric, HolderCompute, MergeCost,
    Primitive, Request, Source, SpliceCost,
};
use serde::Serialize;

use crate::error::{Result, SchedError};

/// Where a fitted line must land to be believed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct FabricBounds {
    /// Slowest believable bandwidth, GB/s.
    pub min_gbps: f64,
    /// Fastest believable bandwidth, GB/s (on a host path: the machine's memory copy rate).
    pub max_gbps: f64,
    /// Largest believable fixed cost, microseconds.
    pub max_fixed_us: f64,
}

impl Default for FabricBounds {
    fn default() -> Self {
        Self {
            min_gbps: 0.01,
            max_gbps: 1000.0,
            max_fixed_us: 100_000.0,
        }
    }
}

/// A fitted transfer line: `fixed_us + bytes / BW`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LineFit {
    /// The fixed cost, microseconds.
    pub fixed_us: f64,
    /// The bandwidth, GB/s.
    pub bw_gbps: f64,
    /// Samples it was fitted to.
    pub samples: usize,
    /// Of those, the live ones (observed, not seeded) that set the fixed cost; 0 when too
    /// few were live and the fixed cost is the whole window's.
    pub live_fixed: usize,
    /// Median absolute relative residual, percent, of the samples the fixed cost speaks for
    /// (the live ones when they set it, else the whole window).
    pub median_residual_pct: f64,
    /// When (caller's clock, ms).
    pub fitted_at_ms: u64,
    /// Fits accepted so far, this one included.
    pub fits: u64,
}

impl LineFit {
    /// As the cost model's fabric.
    pub fn fabric(&self) -> Result<Fabric> {
        Ok(Fabric::measured(self.fixed_us, self.bw_gbps)?)
    }
}

/// Live samples needed before they alone set the fixed cost.
pub const LIVE_FIXED: usize = 8;

/// One transfer sample.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    bytes: f64,
    us: f64,
    /// Observed as it ran ([`FabricEstimator::observe`]), not seeded by a start-up sweep
    /// ([`FabricEstimator::extend`]).
    live: bool,
}

/// A window of `(bytes, microseconds)` transfer samples and the robust line through them.
/// Bounded: the oldest sample leaves when a new one arrives at capacity.
///
/// The bandwidth is the slope of the Theil-Sen line through the whole window. The fixed cost
/// is its intercept until 8 live samples are in; from then on it is the median of the live
/// samples' time less that slope's transfer. A start-up sweep runs its transfers back to back,
/// every thread on the path awake; the transfers of real traffic come between other work,
/// after the threads on the path went to sleep, and pay their wake-ups. Measured on two
/// shared cores (`kvroute verify-predicate`, shm), routes of Mq 16 to 1024 cost 57-615 us more
/// than the sweep's line besides their kernels, about 200 us at the median, twice the sweep's
/// own fixed cost: a window of hundreds of sweep samples would hide that for hundreds of
/// routes, the median over all of them barely moving.
#[derive(Debug, Clone)]
pub struct FabricEstimator {
    window: VecDeque<Sample>,
    /// Live samples in the window.
    live: usize,
    capacity: usize,
    bounds: FabricBounds,
    refit_every: usize,
    since_fit: usize,
    fit: Option<LineFit>,
    rejected: Option<String>,
}

impl FabricEstimator {
    /// An estimator keeping `capacity` samples (at least 2) and refitting after every
    /// `refit_every` new ones (at least 1).
    pub fn new(capacity: usize, refit_every: usize, bounds: FabricBounds) -> Result<Self> {
        if capacity < 2 {
            return Err(SchedError::Zero {
                name: "estimator capacity - 1",
                value: capacity.saturating_sub(1) as u64,
            });
        }
        crate::error::count("refit_every", refit_every as u64)?;
        for (name, v) in [
            ("min_gbps", bounds.min_gbps),
            ("max_gbps", bounds.max_gbps),
            ("max_fixed_us", bounds.max_fixed_us),
        ] {
            crate::error::positive(name, v)?;
        }
        Ok(Self {
            window: VecDeque::with_capacity(capacity),
            live: 0,
            capacity,
            bounds,
            refit_every,
            since_fit: 0,
            fit: None,
            rejected: None,
        })
    }

    /// Adds one live sample; refits when `refit_every` have arrived since the last fit. A
    /// sample that is not finite and positive is dropped.
    ///
    /// The eighth live sample in the window refits at once: from it on the live samples set
    /// the fixed cost.
    pub fn observe(&mut self, bytes: f64, us: f64, now_ms: u64) {
        if self.push(bytes, us, true)
            && (self.since_fit >= self.refit_every || self.live == LIVE_FIXED)
        {
            let _ = self.refit(now_ms);
        }
    }

    /// Adds samples without refitting (a start-up sweep, fitted once after).
    pub fn extend(&mut self, samples: impl IntoIterator<Item = (f64, f64)>) {
        for (bytes, us) in samples {
            self.push(bytes, us, false);
        }
    }

    /// Adds one sample if it is finite and positive; says whether it did.
    fn push(&mut self, bytes: f64, us: f64, live: bool) -> bool {
        if !(bytes.is_finite() && bytes > 0.0 && us.is_finite() && us > 0.0) {
            return false;
        }
        if self.window.len() == self.capacity
            && let Some(old) = self.window.pop_front()
        {
            self.live -= usize::from(old.live);
        }
        self.window.push_back(Sample { bytes, us, live });
        self.live += usize::from(live);
        self.since_fit += 1;
        true
    }

    /// Fits the window now. A line outside the bounds (or none at all) is refused: the last
    /// accepted fit stays, and the refusal is kept for [`FabricEstimator::rejected`].
    pub fn refit(&mut self, now_ms: u64) -> Result<LineFit> {
        self.since_fit = 0;
        match self.fit_window(now_ms) {
            Ok(fit) => {
                if let Some(old) = &self.fit {
                    tracing::info!(
                        fixed_us = fit.fixed_us,
                        bw_gbps = fit.bw_gbps,
                        was_gbps = old.bw_gbps,
                        samples = fit.samples,
                        "fabric refitted"
                    );
                }
                self.fit = Some(fit);
                self.rejected = None;
                Ok(fit)
            }
            // Samples of one size only (a window of same-sized pulls) have no line yet:
            // nothing was refused.
            Err(e @ SchedError::CostModel(CostModelError::TooFewSamples { .. })) => {
                tracing::debug!(%e, "no line through the window yet");
                Err(e)
            }
            Err(e) => {
                tracing::warn!(%e, "fabric fit refused; keeping the last one");
                self.rejected = Some(e.to_string());
                Err(e)
            }
        }
    }

    fn fit_window(&self, now_ms: u64) -> Result<LineFit> {
        let points: Vec<(f64, f64)> = self.window.iter().map(|s| (s.bytes, s.us)).collect();
        let mut line = theil_sen(&points)?;
        let mut live: Vec<f64> = self
            .window
            .iter()
            .filter(|s| s.live)
            .map(|s| s.us - line.slope * s.bytes)
            .collect();
        let live_fixed = if live.len() >= LIVE_FIXED
            && let Some(fixed) = median(&mut live)
        {
            line.intercept = fixed;
            live.len()
        } else {
            0
        };
        let bounds = &self.bounds;
        let bw_gbps = if line.slope > 0.0 {
            1.0 / (line.slope * 1e3)
        } else {
            f64::INFINITY
        };
        if !(bounds.min_gbps..=bounds.max_gbps).contains(&bw_gbps) {
            return Err(SchedError::OutOfRange {
                name: "fitted bandwidth (GB/s)",
                value: bw_gbps,
                range: "the estimator's bounds",
            });
        }
        if !(line.intercept > 0.0 && line.intercept <= bounds.max_fixed_us) {
            return Err(SchedError::OutOfRange {
                name: "fitted fixed cost (us)",
                value: line.intercept,
                range: "(0, the estimator's max_fixed_us]",
            });
        }
        // Over the samples the fixed cost speaks for: the live ones once they set it.
        let mut residuals: Vec<f64> = self
            .window
            .iter()
            .filter(|s| s.live || live_fixed == 0)
            .map(|s| (line.intercept + line.slope * s.bytes - s.us).abs() / s.us)
            .collect();
        Ok(LineFit {
            fixed_us: line.intercept,
            bw_gbps,
            samples: points.len(),
            live_fixed,
            median_residual_pct: 100.0 * median(&mut residuals).unwrap_or(f64::NAN),
            fitted_at_ms: now_ms,
            fits: self.fit.map_or(1, |f| f.fits + 1),
        })
    }

    /// The last accepted fit.
    pub fn fit(&self) -> Option<LineFit> {
        self.fit
    }

    /// Why the last refit was refused, if it was.
    pub fn rejected(&self) -> Option<&str> {
        self.rejected.as_deref()
    }

    /// Samples held.
    pub fn len(&self) -> usize {
        self.window.len()
    }

    /// Whether no sample is held.
    pub fn is_empty(&self) -> bool {
        self.window.is_empty()
    }
}

/// What the selector knows of one holder.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct HolderState {
    /// Whether it answered last time (a dead holder is never chosen).
    pub alive: bool,
    /// Other requesters it is serving now (this one not counted).
    pub others: u32,
    /// Requesters it serves at once before turning new ones away.
    pub cap: u32,
    /// Its kernel roofline as it reported it, if it did and the report was valid.
    pub kernel: Option<HolderCompute>,
    /// When that report arrived (caller's clock, ms).
    pub reported_at_ms: u64,
}

impl HolderState {
    /// A live holder nobody else is using, with no kernel report yet.
    pub const fn new(cap: u32) -> Self {
        Self {
            alive: true,
            others: 0,
            cap,
            kernel: None,
            reported_at_ms: 0,
        }
    }
}

/// One decision: the primitive, the holder it goes to, and every priced option.
#[derive(Debug, Clone, Serialize)]
pub struct Choice {
    /// What to do.
    pub primitive: Primitive,
    /// The holder (an index into the selector's holders); `None` for local.
    pub holder: Option<usize>,
    /// The predicate's answer for that holder: all three costs and the reason.
    pub decision: Decision,
    /// Replicas passed over, and why.
    pub skipped: Vec<(usize, String)>,
}

/// The constants the selector decides with, where each came from and how old it is.
#[derive(Debug, Clone, Serialize)]
pub struct Calibration {
    /// The routed round trip's line, if fitted.
    pub fabric: Option<LineFit>,
    /// Why the last fabric refit was refused, if it was.
    pub fabric_rejected: Option<String>,
    /// The pull line, if fitted.
    pub pull: Option<LineFit>,
    /// The merge, and when it was measured (ms; `None`: the paper's bound).
    pub merge: (MergeCost, Option<u64>),
    /// The splice, and when it was measured (ms; `None`: the paper's line).
    pub splice: (SpliceCost, Option<u64>),
    /// Each holder's state.
    pub holders: Vec<HolderState>,
    /// Ages now, ms: fabric, pull, merge, splice, then each holder's kernel report.
    pub ages_ms: CalibrationAges,
}

/// How old each calibrated value is.
#[derive(Debug, Clone, Serialize)]
pub struct CalibrationAges {
    /// The fabric fit.
    pub fabric: Option<u64>,
    /// The newest pull sample (a pull fit or, with one size only, their median rate).
    pub pull: Option<u64>,
    /// The merge measurement.
    pub merge: Option<u64>,
    /// The splice measurement.
    pub splice: Option<u64>,
    /// Each holder's kernel report.
    pub holder_kernels: Vec<Option<u64>>,
}

/// The per-request selector.
#[derive(Debug, Clone)]
pub struct Selector {
    base: CostParams,
    fabric: FabricEstimator,
    pull: FabricEstimator,
    merge_at_ms: Option<u64>,
    splice_at_ms: Option<u64>,
    pull_at_ms: Option<u64>,
    holders: Vec<HolderState>,
}

impl Selector {
    /// A selector over `holders` holders, pricing with `base` (its model, gather and local
    /// terms, and its fabric, merge, splice and holder compute until measured ones arrive),
    /// fitting the fabric and the pulls with `fabric` and `pull`.
    pub fn new(
        base: CostParams,
        holders: Vec<HolderState>,
        (fabric, pull): (FabricEstimator, FabricEstimator),
    ) -> Result<Self> {
        CostModel::new(base)?;
        Ok(Self {
            base,
            fabric,
            pull,
            merge_at_ms: None,
            splice_at_ms: None,
            pull_at_ms: None,
            holders,
        })
    }

    /// A routed round trip of `rows` rows of `routed_row_bytes` (query plus partial) that
    /// took `us` with the holder's kernel taken out.
    pub fn observe_route(&mut self, rows: u32, us: f64, now_ms: u64) {
        let bytes = f64::from(rows) * self.base.model.routed_row_bytes() as f64;
        self.fabric.observe(bytes, us, now_ms);
    }

    /// A start-up sweep of routes, `(rows, microseconds)` as [`Selector::observe_route`]
    /// takes them, added without refitting: call [`Selector::refit`] after.
    pub fn seed_routes(&mut self, samples: &[(u32, f64)]) {
        let row = self.base.model.routed_row_bytes() as f64;
        self.fabric.extend(
            samples
                .iter()
                .map(|&(rows, us)| (f64::from(rows) * row, us)),
        );
    }

    /// A whole-chunk pull of `bytes` that took `us`.
    pub fn observe_pull(&mut self, bytes: f64, us: f64, now_ms: u64) {
        self.pull.observe(bytes, us, now_ms);
        self.pull_at_ms = Some(now_ms);
    }

    /// Refits both lines now (after a start-up sweep).
    pub fn refit(&mut self, now_ms: u64) -> Result<()> {
        self.fabric.refit(now_ms)?;
        if !self.pull.is_empty() {
            // One pull size gives no line; the routed fabric's fixed cost then stands in.
            let _ = self.pull.refit(now_ms);
        }
        Ok(())
    }

    /// The merge measured here.
    pub fn set_merge(&mut self, merge: MergeCost, now_ms: u64) -> Result<()> {
        merge.validate()?;
        self.base.merge = merge;
        self.base.sources.merge = Source::Measured;
        self.merge_at_ms = Some(now_ms);
        Ok(())
    }

    /// The splice measured here.
    pub fn set_splice(&mut self, splice: SpliceCost, now_ms: u64) -> Result<()> {
        splice.validate()?;
        self.base.splice = splice;
        self.base.sources.splice = Source::Measured;
        self.splice_at_ms = Some(now_ms);
        Ok(())
    }

    /// What holder `h` reported: its other requesters, its cap and its kernel. A kernel
    /// roofline that does not validate is dropped (the previous one stays).
    pub fn holder_report(
        &mut self,
        h: usize,
        (others, cap, kernel): (u32, u32, Option<HolderCompute>),
        now_ms: u64,
    ) -> Result<()> {
        let state = self.holder_mut(h)?;
        state.alive = true;
        state.others = others;
        state.cap = cap;
        match kernel {
            Some(k) if k.validate().is_ok() => {
                state.kernel = Some(k);
                state.reported_at_ms = now_ms;
            }
            Some(k) => tracing::warn!(holder = h, ?k, "invalid kernel report ignored"),
            None => {}
        }
        Ok(())
    }

    /// Marks holder `h` dead (or alive again).
    pub fn set_alive(&mut self, h: usize, alive: bool) -> Result<()> {
        self.holder_mut(h)?.alive = alive;
        Ok(())
    }

    /// A holder that joined after the selector was built (found in a directory); returns its
    /// index, the next one (the caller keeps them equal to its requester's).
    pub fn add_holder(&mut self, state: HolderState) -> usize {
        self.holders.push(state);
        self.holders.len() - 1
    }

    fn holder_mut(&mut self, h: usize) -> Result<&mut HolderState> {
        self.holders.get_mut(h).ok_or(SchedError::OutOfRange {
            name: "holder",
            value: h as f64,
            range: "the selector's holders",
        })
    }

    /// The cost parameters for `holder` (its kernel if it reported one), calibrated.
    pub fn params_for(&self, holder: Option<usize>) -> Result<CostParams> {
        let mut p = self.base;
        if let Some(fit) = self.fabric.fit() {
            p.fabric = fit.fabric()?;
            p.sources.fabric = Source::Measured;
        }
        if let Some(fit) = self.pull.fit() {
            p.pull = Some(fit.fabric()?);
            p.sources.pull = Source::Measured;
        } else if let Some((probe_us, bw)) = self.single_size_pull(&p.fabric) {
            p.pull = Some(Fabric::measured(probe_us, bw)?);
            p.sources.pull = Source::Measured;
        }
        if let Some(k) = holder
            .and_then(|h| self.holders.get(h))
            .and_then(|s| s.kernel)
        {
            p.holder = k;
            p.sources.holder = Source::Measured;
        }
        Ok(p)
    }

    /// Pulls of one size only give no line: their fixed cost is taken to be `routed`'s, and
    /// their rate the median over what remains of each pull's time, as `(probe_us, bw_gbps)`.
    /// Where no pull took longer than that fixed cost (fitted high on a loaded machine), the
    /// median pull is split into fixed cost and transfer in the proportion `routed` splits a
    /// message of the same size.
    fn single_size_pull(&self, routed: &Fabric) -> Option<(f64, f64)> {
        let fixed = routed.probe_us;
        let mut rates: Vec<f64> = self
            .pull
            .window
            .iter()
            .filter(|s| s.us > fixed)
            .map(|s| s.bytes / ((s.us - fixed) * 1e3))
            .collect();
        if let Some(rate) = median(&mut rates) {
            return Some((fixed, rate));
        }
        let mut pulls: Vec<(f64, f64)> = self.pull.window.iter().map(|s| (s.us, s.bytes)).collect();
        pulls.sort_by(|a, b| a.0.total_cmp(&b.0));
        let &(us, bytes) = pulls.get(pulls.len() / 2)?;
        let probe_us = us * fixed / (fixed + routed.transfer_us(bytes));
        Some((probe_us, bytes / ((us - probe_us) * 1e3)))
    }

    /// Decides `request` for a chunk held by the holders `replicas`: for each live one, the
    /// predicate with that holder's kernel and load (`holder_requesters` = its other
    /// requesters plus this one; route is not allowed on a holder at its cap), then the
    /// cheapest (primitive, holder) pair; ties go to the first replica. With no live
    /// replica only local remains, and without local that is an error.
    pub fn decide(&self, replicas: &[usize], request: Request) -> Result<Choice> {
        let mut skipped = Vec::new();
        let mut best: Option<Choice> = None;
        for &h in replicas {
            let Some(state) = self.holders.get(h) else {
                skipped.push((h, "unknown holder".to_owned()));
                continue;
            };
            if !state.alive {
                skipped.push((h, "dead".to_owned()));
                continue;
            }
            let mut req = Request {
                holder_requesters: state.others.saturating_add(1),
                ..request
            };
            if state.others >= state.cap {
                req.allowed.route = false;
                skipped.push((
                    h,
                    format!(
                        "route not offered: {} of {} requesters",
                        state.others, state.cap
                    ),
                ));
                if !(req.allowed.fetch || req.allowed.local) {
                    continue;
                }
            }
            let decision = CostModel::new(self.params_for(Some(h))?)?.decide(&req)?;
            let better = best
                .as_ref()
                .is_none_or(|b| decision.chosen().total_us < b.decision.chosen().total_us);
            if better {
                best = Some(Choice {
                    primitive: decision.choice,
                    holder: (decision.choice != Primitive::Local).then_some(h),
                    decision,
                    skipped: Vec::new(),
                });
            }
        }
        let mut choice = match best {
            Some(c) => c,
            None => {
                if !request.allowed.local {
                    return Err(SchedError::NoHolder {
                        replicas: replicas.len(),
                    });
                }
                let req = Request {
                    allowed: Allowed::only(Primitive::Local),
                    ..request
                };
                let decision = CostModel::new(self.params_for(None)?)?.decide(&req)?;
                Choice {
                    primitive: Primitive::Local,
                    holder: None,
                    decision,
                    skipped: Vec::new(),
                }
            }
        };
        choice.skipped = skipped;
        tracing::debug!(
            primitive = %choice.primitive,
            holder = ?choice.holder,
            total_us = choice.decision.chosen().total_us,
            mq = request.mq_rows,
            ct = request.chunk_tokens,
            "decided"
        );
        Ok(choice)
    }

    /// Every calibrated value with its age at `now_ms`.
    pub fn calibration(&self, now_ms: u64) -> Calibration {
        let age = |at: u64| now_ms.saturating_sub(at);
        Calibration {
            fabric: self.fabric.fit(),
            fabric_rejected: self.fabric.rejected().map(str::to_owned),
            pull: self.pull.fit(),
            merge: (self.base.merge, self.merge_at_ms),
            splice: (self.base.splice, self.splice_at_ms),
            holders: self.holders.clone(),
            ages_ms: CalibrationAges {
                fabric: self.fabric.fit().map(|f| age(f.fitted_at_ms)),
                pull: self.pull_at_ms.map(age),
                merge: self.merge_at_ms.map(age),
                splice: self.splice_at_ms.map(age),
                holder_kernels: self
                    .holders
                    .iter()
                    .map(|h| h.kernel.map(|_| age(h.reported_at_ms)))
                    .collect(),
            },
        }
    }

    /// The fabric estimator.
    pub fn fabric(&self) -> &FabricEstimator {
        &self.fabric
    }

    /// The holders as the selector sees them.
    pub fn holders(&self) -> &[HolderState] {
        &self.holders
    }
}

#[cfg(test)]
mod tests;
