//! The holder's own account of its partial-attention kernel, for a requester's cost model:
//! the roofline of [`HolderCompute`] (floor, memory bound, compute bound) measured on the
//! holder's machine and kernel backend when it starts, then kept current from the kernel calls
//! it serves. A requester reads it from [`crate::HolderStats::kernel`] and prices route's
//! compute term with it; the holder's GPU or CPU, its instruction set and its load are the
//! holder's to measure, not the requester's to guess.

use std::collections::VecDeque;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use kvroute_costmodel::{HolderCompute, KernelTable, SparsePremium};
use kvroute_kernels::layout::{D_QK, PARTIAL_ROW_BYTES};
use kvroute_kernels::{Backend, Cache, Queries, WireOut, partial_dense_wire};
use serde::{Deserialize, Serialize};

use crate::error::RemoteError;

/// Kernel calls whose compute-bound rate is kept (the median of these is reported).
const WINDOW: usize = 64;
/// Served calls needed before they rescale the start-up calibration.
const MIN_OBSERVED: usize = 3;
/// Distinct call shapes (predicted times 1.5x apart) needed to fit a fixed cost as well.
const MIN_SHAPES: usize = 3;
/// A served call counts toward one of [`KernelTable::ROWS`] when its rows are within this
/// factor of it.
const ROW_MATCH: f64 = 1.25;
/// Fewest entries the start-up calibration times a call over.
const FLOOR_TOKENS: usize = 64;
/// Repetitions of each start-up point; the fastest is kept.
const REPS: usize = 3;

/// What a holder reports about its kernel ([`crate::HolderStats::kernel`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HolderKernel {
    /// The roofline now: the start-up calibration as the recent served calls have rescaled it
    /// (see [`KernelRate::current`]).
    pub compute: HolderCompute,
    /// When the start-up calibration ran, milliseconds since the Unix epoch.
    pub calibrated_unix_ms: u64,
    /// Dense kernel calls observed since (the refit's evidence).
    pub observed_calls: u64,
    /// Of those, how many the reported roofline is fitted to.
    pub window: u32,
}

/// One served dense kernel call.
#[derive(Debug, Clone, Copy)]
struct Served {
    rows: f64,
    tokens: f64,
    /// The start-up roofline's time for the call's shape, microseconds.
    predicted: f64,
    /// The call's time, microseconds.
    us: f64,
}

/// The holder's kernel rate: the start-up roofline, refitted from served calls.
#[derive(Debug, Clone)]
pub struct KernelRate {
    start: HolderCompute,
    calibrated_unix_ms: u64,
    recent: VecDeque<Served>,
    observed: u64,
}

impl KernelRate {
    /// A rate from a start-up roofline measured now.
    pub fn new(start: HolderCompute) -> Self {
        let calibrated_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        Self {
            start,
            calibrated_unix_ms,
            recent: VecDeque::with_capacity(WINDOW),
            observed: 0,
        }
    }

    /// Records one served dense kernel call of `rows` rows over `tokens` entries that took
    /// `us`. A time that is not finite and positive is not evidence.
    pub fn observe(&mut self, rows: usize, tokens: usize, us: f64) {
        if !(us.is_finite() && us > 0.0) || rows == 0 || tokens == 0 {
            return;
        }
        let predicted = self.start.shape_us(rows as f64, tokens as f64);
        if !(predicted.is_finite() && predicted > 0.0) {
            return;
        }
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(Served {
            rows: rows as f64,
            tokens: tokens as f64,
            predicted,
            us,
        });
        self.observed += 1;
    }

    /// The kernel as it stands. A holder serving requests is not the idle machine it
    /// calibrated on at start (its cores are shared with its own serving and progress threads
    /// and whatever else runs there; its worker threads sleep between calls and take time to
    /// wake), so once 3 calls are in, the start-up calibration is refitted to them as
    /// `fixed + scale x shape`: a Theil-Sen line of the calls' times against what the
    /// start-up calibration says of their shapes, robust to a stalled call, its fixed cost no
    /// more than half the fastest call, the scale then the median ratio of what is left.
    /// Calls of fewer than 3 shapes (predicted times 1.5x apart) cannot split a fixed cost
    /// from a scale: the median ratio rescales alone.
    ///
    /// One scale keeps the start-up table's shape across row counts, and that shape is only
    /// as good as the start-up calls: on a shared machine one row count's fastest of three can
    /// still come out 1.5x slow while the next is right. So each of [`KernelTable::ROWS`] that
    /// 3 or more of the window's calls were served at (within a factor 1.25 of its rows) has
    /// its entry corrected by the median of those calls' time over what the rescaled table
    /// says of them: a row count served again and again is priced from its own calls.
    pub fn current(&self) -> HolderKernel {
        let compute = if self.recent.len() >= MIN_OBSERVED {
            self.refit().unwrap_or(self.start)
        } else {
            self.start
        };
        HolderKernel {
            compute,
            calibrated_unix_ms: self.calibrated_unix_ms,
            observed_calls: self.observed,
            window: self.recent.len() as u32,
        }
    }

    fn refit(&self) -> Option<HolderCompute> {
        let points: Vec<(f64, f64)> = self.recent.iter().map(|c| (c.predicted, c.us)).collect();
        let mut shapes: Vec<f64> = points.iter().map(|p| p.0).collect();
        shapes.sort_by(f64::total_cmp);
        shapes.dedup_by(|a, b| *a <= *b * 1.5);
        let fastest = points.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
        let line = kvroute_costmodel::fit::theil_sen(&points).ok();
        let (fixed, scale) = match line {
            // A fixed cost needs three shapes to be told from a scale, and can be no more
            // than half the fastest call it is part of.
            Some(l) if shapes.len() >= MIN_SHAPES && l.slope > 0.0 => {
                let fixed = l.intercept.clamp(0.0, 0.5 * fastest);
                // The upper middle ratio, not the median: a scale one call was served at,
                // never a blend of two row counts' (see the table test below).
                let mut ratios: Vec<f64> = points.iter().map(|p| (p.1 - fixed) / p.0).collect();
                ratios.sort_by(f64::total_cmp);
                (fixed, ratios[ratios.len() / 2])
            }
            _ => {
                let mut ratios: Vec<f64> = points.iter().map(|p| p.1 / p.0).collect();
                ratios.sort_by(f64::total_cmp);
                (0.0, ratios[ratios.len() / 2])
            }
        };
        let s = &self.start;
        let mut fitted = HolderCompute {
            fixed_us: s.fixed_us + fixed,
            floor_us: s.floor_us * scale,
            us_per_token: s.us_per_token * scale,
            us_per_row_token: s.us_per_row_token * scale,
            sparse: s.sparse,
            table: s.table.map(|t| KernelTable {
                fixed_us: t.fixed_us.map(|f| f * scale),
                us_per_token: t.us_per_token.map(|r| r * scale),
            }),
        };
        if let Some(table) = fitted.table.as_mut() {
            self.correct_rows(table, fitted.fixed_us);
        }
        fitted.validate().is_ok().then_some(fitted)
    }

    /// Corrects each of `table`'s row counts that enough calls were served at (see
    /// [`Self::current`]); `fixed_us` is the dispatch cost the calls carry besides the table.
    fn correct_rows(&self, table: &mut KernelTable, fixed_us: f64) {
        let rescaled = *table;
        for (i, &at) in KernelTable::ROWS.iter().enumerate() {
            let mut ratios: Vec<f64> = self
                .recent
                .iter()
                .filter(|c| c.rows <= at * ROW_MATCH && c.rows * ROW_MATCH >= at)
                .map(|c| (c.us - fixed_us) / rescaled.at(c.rows, c.tokens))
                .filter(|r| r.is_finite() && *r > 0.0)
                .collect();
            if ratios.len() < MIN_OBSERVED {
                continue;
            }
            let mid = ratios.len() / 2;
            let (_, &mut ratio, _) = ratios.select_nth_unstable_by(mid, f64::total_cmp);
            table.fixed_us[i] *= ratio;
            table.us_per_token[i] *= ratio;
        }
    }
}

/// Measures the dense wire kernel (what a holder runs for a route) on `backend` over one
/// held layer, `rows` of `tokens` 576-wide bf16 entries, the layer's own rows standing in
/// for the queries: at each of [`KernelTable::ROWS`] query rows, the fastest of a few calls
/// over a quarter of the entries (at least 64) and over all of them, the line through the two
/// as that row count's fixed cost and cost per entry. The roofline's bounds are filled from
/// the same calls (the floor from one row over the fewest entries, the memory bound from one
/// row over all, the compute bound from the most rows over all) for a reader; the table
/// prices. The sparse premium stays paper 000's (a dense calibration cannot see the indexed
/// gather).
pub fn calibrate(backend: Backend, rows: &[u16], scale: f32) -> Result<HolderCompute, RemoteError> {
    calibrate_with(rows, |q, tokens, out| {
        let cache = Cache::contiguous(&rows[..tokens * D_QK])?;
        Ok(partial_dense_wire(backend, q, &cache, scale, out)?)
    })
}

/// [`calibrate`] with the kernel call given: `run(q, tokens, out)` attends the first `tokens`
/// of the layer's `rows` with `q`, writing `out` (a holder whose layer is also resident on a
/// GPU times the call it serves with).
pub fn calibrate_with(
    rows: &[u16],
    mut run: impl FnMut(&Queries<'_>, usize, &mut WireOut<'_>) -> Result<(), RemoteError>,
) -> Result<HolderCompute, RemoteError> {
    let tokens = rows.len() / D_QK;
    if tokens == 0 {
        return Err(RemoteError::Config(
            "kernel calibration needs a held layer".into(),
        ));
    }
    let most = KernelTable::ROWS[KernelTable::ROWS.len() - 1] as usize;
    let queries: Vec<u16> = rows.iter().copied().cycle().take(most * D_QK).collect();
    let mut out = vec![0u8; most * PARTIAL_ROW_BYTES];
    let mut time = |r: usize, t: usize| -> Result<f64, RemoteError> {
        let q = Queries::new(&queries[..r * D_QK])?;
        let mut best = f64::INFINITY;
        for _ in 0..REPS {
            let mut wire = WireOut::new([&mut out[..r * PARTIAL_ROW_BYTES]])?;
            let started = Instant::now();
            run(&q, t, &mut wire)?;
            best = best.min(started.elapsed().as_secs_f64() * 1e6);
        }
        Ok(best)
    };
    let few = (tokens / 4).max(FLOOR_TOKENS).min(tokens);
    let mut table = KernelTable {
        fixed_us: [0.0; 5],
        us_per_token: [0.0; 5],
    };
    let mut ends = Vec::new();
    for (i, &r) in KernelTable::ROWS.iter().enumerate() {
        let (small, all) = (time(r as usize, few)?, time(r as usize, tokens)?);
        let rate = if tokens > few && all > small {
            (all - small) / (tokens - few) as f64
        } else {
            all / tokens as f64
        };
        table.fixed_us[i] = (all - rate * tokens as f64).max(0.0);
        table.us_per_token[i] = rate;
        ends.push((small, all));
    }
    let t = tokens as f64;
    let compute = HolderCompute {
        fixed_us: 0.0,
        floor_us: ends[0].0,
        us_per_token: ends[0].1 / t,
        us_per_row_token: ends[ends.len() - 1].1 / (most as f64 * t),
        sparse: SparsePremium::FLASHMLA_H100,
        table: Some(table),
    };
    compute
        .validate()
        .map_err(|e| RemoteError::Config(format!("kernel calibration: {e}")))?;
    Ok(compute)
}

#[cfg(test)]
mod tests {
    use super::*;

    const START: HolderCompute = HolderCompute {
        fixed_us: 0.0,
        floor_us: 5.0,
        us_per_token: 0.2,
        us_per_row_token: 0.08,
        sparse: SparsePremium::NONE,
        table: None,
    };

    #[test]
    fn served_calls_refit_a_fixed_cost_and_a_scale_and_a_stall_does_not_move_them() {
        let mut rate = KernelRate::new(START);
        assert_eq!(rate.current().compute, START);
        // The machine serves at half the start-up speed, with 150 us to wake its workers.
        let served = |rows: f64, tokens: f64| 150.0 + 2.0 * START.roofline_us(rows, tokens);
        for _ in 0..3 {
            for (rows, tokens) in [(16usize, 512usize), (256, 2048), (1, 2048), (64, 1024)] {
                rate.observe(rows, tokens, served(rows as f64, tokens as f64));
            }
        }
        rate.observe(256, 2048, 1e9);
        let now = rate.current();
        assert_eq!(now.observed_calls, 13);
        assert!((now.compute.fixed_us - 150.0).abs() < 1e-6, "{now:?}");
        for (rows, tokens) in [(16.0, 512.0), (1024.0, 4096.0), (1.0, 64.0)] {
            let want = served(rows, tokens);
            let got = now.compute.dense_us(rows, tokens);
            assert!(
                (got / want - 1.0).abs() < 1e-9,
                "{rows}x{tokens}: {got} vs {want}"
            );
        }
        // Bad times are not evidence.
        for us in [f64::NAN, -1.0, 0.0, f64::INFINITY] {
            rate.observe(256, 2048, us);
        }
        assert_eq!(rate.current().observed_calls, 13);
    }

    #[test]
    fn one_shape_rescales_and_the_window_forgets_old_calls() {
        let mut rate = KernelRate::new(START);
        for _ in 0..WINDOW {
            rate.observe(256, 2048, 2.0 * START.roofline_us(256.0, 2048.0));
        }
        assert!(
            (rate.current().compute.us_per_row_token / START.us_per_row_token - 2.0).abs() < 1e-9
        );
        for _ in 0..WINDOW {
            rate.observe(256, 2048, 3.0 * START.roofline_us(256.0, 2048.0));
        }
        let now = rate.current();
        assert_eq!(now.window as usize, WINDOW);
        assert_eq!(now.compute.fixed_us, 0.0);
        assert!((now.compute.us_per_row_token / START.us_per_row_token - 3.0).abs() < 1e-9);
    }

    /// A start-up table right at every row count but 256, which came out 1.6x slow; the
    /// machine then serves 1.3x slower than it calibrated. One scale cannot fit both served
    /// row counts; each corrects its own entry once 3 calls were served there, and a row
    /// count never served keeps the common scale.
    #[test]
    fn a_row_count_served_again_and_again_is_priced_from_its_own_calls() {
        let truth = KernelTable {
            fixed_us: [0.0; 5],
            us_per_token: [0.05, 0.3, 0.8, 2.0, 8.0],
        };
        let mut table = truth;
        table.us_per_token[3] *= 1.6;
        let start = HolderCompute {
            table: Some(table),
            ..START
        };
        let served = |rows: usize, tokens: usize| 1.3 * truth.at(rows as f64, tokens as f64);
        let mut rate = KernelRate::new(start);
        for _ in 0..2 {
            rate.observe(16, 2048, served(16, 2048));
            rate.observe(256, 2048, served(256, 2048));
        }
        // Two calls at 256 rows are not enough to move its entry: the common scale (the
        // median ratio, 1.3 from the 16-row calls) leaves it 1.6x high.
        let two = rate.current().compute;
        let err = |c: &HolderCompute, rows: usize, tokens: usize| {
            c.dense_us(rows as f64, tokens as f64) / served(rows, tokens) - 1.0
        };
        assert!((err(&two, 256, 2048) - 0.6).abs() < 1e-9, "{two:?}");
        rate.observe(16, 2048, served(16, 2048));
        rate.observe(256, 2048, served(256, 2048));
        let now = rate.current().compute;
        for (rows, tokens) in [(16, 2048), (256, 2048), (256, 512), (16, 4096)] {
            assert!(
                err(&now, rows, tokens).abs() < 1e-9,
                "{rows}x{tokens}: {now:?}"
            );
        }
        // 1024 rows were never served: the common scale.
        assert!(err(&now, 1024, 2048).abs() < 1e-9, "{now:?}");
        // A call 20% off a row count counts toward it; one further off does not.
        let mut near = KernelRate::new(start);
        let mut far = KernelRate::new(start);
        for _ in 0..3 {
            near.observe(16, 2048, served(16, 2048));
            near.observe(300, 2048, served(300, 2048));
            far.observe(16, 2048, served(16, 2048));
            far.observe(330, 2048, served(330, 2048));
        }
        let at_256 = |r: &KernelRate| r.current().compute.table.unwrap().us_per_token[3];
        assert!(
            at_256(&near) < 1.3 * table.us_per_token[3] * 0.9,
            "{near:?}"
        );
        assert!(
            (at_256(&far) / (1.3 * table.us_per_token[3]) - 1.0).abs() < 1e-9,
            "{far:?}"
        );
    }

    #[test]
    fn calibration_of_the_cpu_kernel_is_a_valid_roofline_that_grows_with_the_work() {
        let tokens = 512;
        let rows: Vec<u16> = (0..tokens * D_QK)
            .map(|i| kvroute_kernels::bf16::from_f32(((i % 97) as f32 - 48.0) / 64.0))
            .collect();
        let c = calibrate(Backend::Cpu, &rows, 0.1).unwrap();
        c.validate().unwrap();
        assert!(c.dense_us(256.0, 512.0) > c.dense_us(1.0, 512.0));
        assert!(calibrate(Backend::Cpu, &[], 0.1).is_err());
    }
}
