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

use kvroute_costmodel::fit::theil_sen;
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
    /// Median absolute relative residual of those samples, percent.
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

/// A window of `(bytes, microseconds)` transfer samples and the robust line through them.
/// Bounded: the oldest sample leaves when a new one arrives at capacity.
#[derive(Debug, Clone)]
pub struct FabricEstimator {
    window: VecDeque<(f64, f64)>,
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
            capacity,
            bounds,
            refit_every,
            since_fit: 0,
            fit: None,
            rejected: None,
        })
    }

    /// Adds one sample; refits when `refit_every` have arrived since the last fit. A sample
    /// that is not finite and positive is dropped.
    pub fn observe(&mut self, bytes: f64, us: f64, now_ms: u64) {
        if self.push(bytes, us) && self.since_fit >= self.refit_every {
            let _ = self.refit(now_ms);
        }
    }

    /// Adds samples without refitting (a start-up sweep, fitted once after).
    pub fn extend(&mut self, samples: impl IntoIterator<Item = (f64, f64)>) {
        for (bytes, us) in samples {
            self.push(bytes, us);
        }
    }

    /// Adds one sample if it is finite and positive; says whether it did.
    fn push(&mut self, bytes: f64, us: f64) -> bool {
        if !(bytes.is_finite() && bytes > 0.0 && us.is_finite() && us > 0.0) {
            return false;
        }
        if self.window.len() == self.capacity {
            self.window.pop_front();
        }
        self.window.push_back((bytes, us));
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
        let points: Vec<(f64, f64)> = self.window.iter().copied().collect();
        let line = theil_sen(&points)?;
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
        let mut residuals: Vec<f64> = points
            .iter()
            .map(|&(x, y)| (line.intercept + line.slope * x - y).abs() / y)
            .collect();
        residuals.sort_by(f64::total_cmp);
        Ok(LineFit {
            fixed_us: line.intercept,
            bw_gbps,
            samples: points.len(),
            median_residual_pct: 100.0 * residuals[residuals.len() / 2],
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
        } else if let Some(bw) = self.single_size_pull_gbps() {
            p.pull = Some(Fabric::measured(p.fabric.probe_us, bw)?);
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

    /// Pulls of one size only: no line, but their median rate with the routed fabric's
    /// fixed cost taken out.
    fn single_size_pull_gbps(&self) -> Option<f64> {
        if self.pull.is_empty() {
            return None;
        }
        let fixed = self.fabric.fit().map_or(0.0, |f| f.fixed_us);
        let mut rates: Vec<f64> = self
            .pull
            .window
            .iter()
            .filter(|(_, us)| *us > fixed)
            .map(|(bytes, us)| bytes / ((us - fixed) * 1e3))
            .collect();
        if rates.is_empty() {
            return None;
        }
        rates.sort_by(f64::total_cmp);
        Some(rates[rates.len() / 2])
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
mod tests {
    use kvroute_costmodel::{SparsePremium, model_preset};

    use super::*;

    const ROW: f64 = 2184.0;

    fn estimator() -> FabricEstimator {
        FabricEstimator::new(256, 1_000_000, FabricBounds::default()).unwrap()
    }

    /// A deterministic jitter in [0, 1).
    fn jitter(i: usize) -> f64 {
        ((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Samples of a 40 us + 3 GB/s path with one-sided noise, and `stalls` of every 10
    /// slowed 20x (a preempted process).
    fn sweep(e: &mut FabricEstimator, stalls: usize) {
        let mut i = 0;
        for rep in 0..8 {
            for mq in [1u32, 16, 64, 256, 1024, 2048] {
                let bytes = f64::from(mq) * ROW;
                let mut us = (40.0 + bytes / 3e3) * (1.0 + 0.1 * jitter(i));
                if (i % 10) < stalls {
                    us *= 20.0;
                }
                e.observe(bytes, us, rep);
                i += 1;
            }
        }
    }

    #[test]
    fn the_fabric_fit_holds_its_bandwidth_through_stalls_that_move_least_squares() {
        let mut clean = estimator();
        sweep(&mut clean, 0);
        let clean = clean.refit(10).unwrap();
        assert!((clean.bw_gbps / 3.0 - 1.0).abs() < 0.1, "{clean:?}");
        let mut stalled = estimator();
        sweep(&mut stalled, 2);
        let fit = stalled.refit(10).unwrap();
        assert!(
            (fit.bw_gbps / clean.bw_gbps - 1.0).abs() < 0.25,
            "{fit:?} against {clean:?}"
        );
        // The same samples through least squares: 20% stalls move it far more.
        let points: Vec<(f64, f64)> = stalled.window.iter().copied().collect();
        let ls = kvroute_costmodel::fit::least_squares(points.iter().copied()).unwrap();
        let ls_gbps = 1.0 / (ls.slope * 1e3);
        assert!((ls_gbps / clean.bw_gbps - 1.0).abs() > 0.25, "{ls_gbps}");
    }

    #[test]
    fn an_unphysical_refit_is_refused_and_the_last_fit_stays() {
        let mut e = FabricEstimator::new(
            64,
            1_000_000,
            FabricBounds {
                max_gbps: 10.0,
                ..FabricBounds::default()
            },
        )
        .unwrap();
        sweep(&mut e, 0);
        let good = e.refit(1).unwrap();
        // Larger transfers coming back faster: a falling line.
        for mq in [1u32, 4096, 1, 4096, 1, 4096] {
            for _ in 0..20 {
                let bytes = f64::from(mq) * ROW;
                e.observe(bytes, if mq == 1 { 5000.0 } else { 100.0 }, 2);
            }
        }
        assert!(e.refit(3).is_err());
        assert_eq!(e.fit(), Some(good));
        assert!(e.rejected().is_some());
        // Bad samples are dropped, not stored.
        let before = e.len();
        e.observe(f64::NAN, 1.0, 4);
        e.observe(1.0, -1.0, 4);
        assert_eq!(e.len(), before);
        assert!(FabricEstimator::new(1, 1, FabricBounds::default()).is_err());
        assert!(FabricEstimator::new(8, 0, FabricBounds::default()).is_err());
    }

    #[test]
    fn routes_refit_the_fabric_as_they_run() {
        let mut e = FabricEstimator::new(32, 8, FabricBounds::default()).unwrap();
        sweep(&mut e, 0);
        let first = e.fit().unwrap();
        // The path slows to 1 GB/s: the window turns over and the fit follows.
        for i in 0..64u64 {
            let mq = [16u32, 256, 1024, 2048][(i % 4) as usize];
            let bytes = f64::from(mq) * ROW;
            e.observe(bytes, 40.0 + bytes / 1e3, 100 + i);
        }
        let now = e.fit().unwrap();
        assert!(now.fits > first.fits);
        assert!((now.bw_gbps - 1.0).abs() < 0.05, "{now:?}");
        assert!(now.fitted_at_ms > first.fitted_at_ms);
    }

    fn cpu_kernel() -> HolderCompute {
        HolderCompute {
            fixed_us: 0.0,
            floor_us: 5.0,
            us_per_token: 0.2,
            us_per_row_token: 0.08,
            sparse: SparsePremium::NONE,
            table: None,
        }
    }

    fn selector(holders: usize) -> Selector {
        let v2 = model_preset("deepseek-v2-lite").unwrap().dims;
        let base = CostParams::paper_defaults(v2, Fabric::measured(40.0, 3.0).unwrap());
        let mut s = Selector::new(
            base,
            vec![HolderState::new(8); holders],
            (estimator(), estimator()),
        )
        .unwrap();
        for h in 0..holders {
            s.holder_report(h, (0, 8, Some(cpu_kernel())), 0).unwrap();
        }
        s
    }

    #[test]
    fn a_measured_kernel_prices_route_by_rows_and_entries_and_moves_the_choice() {
        let s = selector(1);
        let req = |mq, ct| Request {
            allowed: Allowed {
                local: false,
                ..Allowed::ALL
            },
            ..Request::contiguous(mq, ct)
        };
        let small = s.decide(&[0], req(16, 2048)).unwrap();
        assert_eq!(small.primitive, Primitive::Route);
        assert!(
            (small.decision.route.breakdown.compute_us - 16.0 * 2048.0 * 0.08).abs() < 1e-6,
            "{:?}",
            small.decision.route.breakdown
        );
        // A CPU kernel at 4096 rows costs more than pulling 64 MB at 3 GB/s and splicing.
        let big = s.decide(&[0], req(4096, 2048)).unwrap();
        assert_eq!(big.primitive, Primitive::Fetch, "{}", big.decision);
        let p = s.params_for(Some(0)).unwrap();
        assert_eq!(p.sources.holder, Source::Measured);
        assert_eq!(s.params_for(None).unwrap().sources.holder, Source::Paper);
    }

    #[test]
    fn a_holder_added_later_is_decided_for_by_its_index() {
        let mut s = selector(1);
        let req = Request::contiguous(16, 2048);
        assert_eq!(s.add_holder(HolderState::new(8)), 1);
        s.set_alive(0, false).unwrap();
        let c = s.decide(&[0, 1], req).unwrap();
        assert_eq!((c.primitive, c.holder), (Primitive::Route, Some(1)));
        assert!(s.holder_report(1, (0, 8, None), 1).is_ok());
        assert!(s.holder_report(2, (0, 8, None), 1).is_err());
    }

    #[test]
    fn a_dead_or_capped_holder_is_passed_over_for_a_replica() {
        let mut s = selector(3);
        let req = Request::contiguous(16, 2048);
        s.set_alive(0, false).unwrap();
        let c = s.decide(&[0, 1], req).unwrap();
        assert_eq!((c.primitive, c.holder), (Primitive::Route, Some(1)));
        assert_eq!(c.skipped, vec![(0, "dead".to_owned())]);
        // Holder 1 at its cap: route goes to holder 2.
        s.holder_report(1, (8, 8, None), 5).unwrap();
        let c = s.decide(&[1, 2], req).unwrap();
        assert_eq!((c.primitive, c.holder), (Primitive::Route, Some(2)));
        // A loaded holder prices its batch: 7 others make the kernel 8x the rows.
        s.holder_report(2, (7, 8, None), 5).unwrap();
        let loaded = s.decide(&[2], req).unwrap();
        assert_eq!(
            loaded.decision.route.breakdown.compute_us,
            8.0 * 16.0 * 2048.0 * 0.08
        );
        // No live replica: local, or an error where local is not allowed.
        s.set_alive(1, false).unwrap();
        s.set_alive(2, false).unwrap();
        let c = s.decide(&[0, 1, 2], req).unwrap();
        assert_eq!((c.primitive, c.holder), (Primitive::Local, None));
        let no_local = Request {
            allowed: Allowed {
                local: false,
                ..Allowed::ALL
            },
            ..req
        };
        assert!(matches!(
            s.decide(&[0, 1, 2], no_local),
            Err(SchedError::NoHolder { replicas: 3 })
        ));
        assert!(s.set_alive(9, true).is_err());
    }

    #[test]
    fn the_calibration_says_what_was_measured_and_how_old_it_is() {
        let mut s = selector(2);
        assert!(s.calibration(0).fabric.is_none());
        for mq in [1u32, 64, 1024, 1, 64, 1024] {
            s.observe_route(mq, 40.0 + f64::from(mq) * ROW / 3e3, 100);
        }
        s.observe_pull(64e6, 40.0 + 64e6 / 2e3, 100);
        s.refit(100).unwrap();
        s.set_merge(
            MergeCost {
                fixed_us: 2.0,
                us_per_row_part: 0.01,
            },
            120,
        )
        .unwrap();
        let cal = s.calibration(1100);
        assert_eq!(cal.ages_ms.fabric, Some(1000));
        assert_eq!(cal.ages_ms.merge, Some(980));
        assert_eq!(cal.ages_ms.splice, None);
        assert_eq!(cal.ages_ms.holder_kernels, vec![Some(1100), Some(1100)]);
        let p = s.params_for(Some(0)).unwrap();
        assert_eq!(p.sources.fabric, Source::Measured);
        assert_eq!(p.sources.merge, Source::Measured);
        assert_eq!(p.sources.splice, Source::Paper);
        // One pull size: its rate with the fabric's fixed cost taken out.
        let pull = p.pull.unwrap();
        assert!((pull.bw_gbps - 2.0).abs() < 1e-6, "{pull:?}");
        let json = serde_json::to_value(&cal).unwrap();
        assert!(json["fabric"]["bw_gbps"].as_f64().unwrap() > 2.9);
        // A bad kernel report is not believed.
        let bad = HolderCompute {
            us_per_row_token: f64::NAN,
            ..cpu_kernel()
        };
        s.holder_report(0, (0, 8, Some(bad)), 2000).unwrap();
        assert_eq!(s.holders()[0].kernel, Some(cpu_kernel()));
    }
}
