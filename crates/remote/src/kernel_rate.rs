//! The holder's own account of its partial-attention kernel, for a requester's cost model:
//! the roofline of [`HolderCompute`] (floor, memory bound, compute bound) measured on the
//! holder's machine and kernel backend when it starts, then kept current from the kernel calls
//! it serves. A requester reads it from [`crate::HolderStats::kernel`] and prices route's
//! compute term with it; the holder's GPU or CPU, its instruction set and its load are the
//! holder's to measure, not the requester's to guess.

use std::collections::VecDeque;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use kvroute_costmodel::{HolderCompute, SparsePremium};
use kvroute_kernels::layout::{D_QK, PARTIAL_ROW_BYTES};
use kvroute_kernels::{Backend, Cache, Queries, WireOut, partial_dense_wire};
use serde::{Deserialize, Serialize};

use crate::error::RemoteError;

/// Kernel calls whose compute-bound rate is kept (the median of these is reported).
const WINDOW: usize = 64;
/// Compute-bound calls needed before they replace the start-up rate.
const MIN_OBSERVED: usize = 4;
/// Rows of the start-up calibration's compute-bound point.
const CALIBRATION_ROWS: usize = 256;
/// Entries of the start-up calibration's floor point.
const FLOOR_TOKENS: usize = 64;
/// Repetitions of each start-up point; the fastest is kept.
const REPS: usize = 3;

/// What a holder reports about its kernel ([`crate::HolderStats::kernel`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HolderKernel {
    /// The roofline now: the start-up calibration with its compute bound replaced by the
    /// median of recent compute-bound calls once there are enough.
    pub compute: HolderCompute,
    /// When the start-up calibration ran, milliseconds since the Unix epoch.
    pub calibrated_unix_ms: u64,
    /// Compute-bound kernel calls observed since (the refit's evidence).
    pub observed_calls: u64,
    /// Of those, how many the reported compute bound is the median of.
    pub window: u32,
}

/// The holder's kernel rate: the start-up roofline, refitted from served calls.
#[derive(Debug, Clone)]
pub struct KernelRate {
    start: HolderCompute,
    calibrated_unix_ms: u64,
    recent: VecDeque<f64>,
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

    /// Records one served kernel call of `rows` rows over `tokens` entries that took `us`.
    /// Only calls the start-up roofline puts on its compute bound (by a factor of two, so
    /// the memory bound and the floor do not leak in) update the compute rate.
    pub fn observe(&mut self, rows: usize, tokens: usize, us: f64) {
        let (r, t) = (rows as f64, tokens as f64);
        let compute = r * t * self.start.us_per_row_token;
        let other = self.start.floor_us.max(t * self.start.us_per_token);
        if !(us.is_finite() && us > 0.0) || rows == 0 || tokens == 0 || compute < 2.0 * other {
            return;
        }
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(us / (r * t));
        self.observed += 1;
    }

    /// The roofline as it stands.
    pub fn current(&self) -> HolderKernel {
        let mut compute = self.start;
        if self.recent.len() >= MIN_OBSERVED {
            let mut v: Vec<f64> = self.recent.iter().copied().collect();
            v.sort_by(f64::total_cmp);
            compute.us_per_row_token = v[v.len() / 2];
        }
        HolderKernel {
            compute,
            calibrated_unix_ms: self.calibrated_unix_ms,
            observed_calls: self.observed,
            window: self.recent.len() as u32,
        }
    }
}

/// Measures the roofline of the dense wire kernel (what a holder runs for a route) on
/// `backend` over one held layer, `rows` of `tokens` 576-wide bf16 entries: the fastest of a
/// few calls at (1 row, 64 entries) for the floor, (1 row, every entry) for the memory
/// bound and (256 rows, every entry) for the compute bound; the layer's own rows stand in
/// for the queries. The sparse premium stays paper 000's (a dense calibration cannot see
/// the indexed gather).
pub fn calibrate(backend: Backend, rows: &[u16], scale: f32) -> Result<HolderCompute, RemoteError> {
    let tokens = rows.len() / D_QK;
    if tokens == 0 {
        return Err(RemoteError::Config(
            "kernel calibration needs a held layer".into(),
        ));
    }
    let queries: Vec<u16> = rows
        .iter()
        .copied()
        .cycle()
        .take(CALIBRATION_ROWS * D_QK)
        .collect();
    let mut out = vec![0u8; CALIBRATION_ROWS * PARTIAL_ROW_BYTES];
    let mut time = |r: usize, t: usize| -> Result<f64, RemoteError> {
        let q = Queries::new(&queries[..r * D_QK])?;
        let cache = Cache::contiguous(&rows[..t * D_QK])?;
        let mut best = f64::INFINITY;
        for _ in 0..REPS {
            let mut wire = WireOut::new([&mut out[..r * PARTIAL_ROW_BYTES]])?;
            let started = Instant::now();
            partial_dense_wire(backend, &q, &cache, scale, &mut wire)?;
            best = best.min(started.elapsed().as_secs_f64() * 1e6);
        }
        Ok(best)
    };
    let floor_us = time(1, FLOOR_TOKENS.min(tokens))?;
    let memory_us = time(1, tokens)?;
    let compute_us = time(CALIBRATION_ROWS, tokens)?;
    let t = tokens as f64;
    let compute = HolderCompute {
        floor_us,
        us_per_token: memory_us / t,
        us_per_row_token: compute_us / (CALIBRATION_ROWS as f64 * t),
        sparse: SparsePremium::FLASHMLA_H100,
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
        floor_us: 5.0,
        us_per_token: 0.2,
        us_per_row_token: 0.08,
        sparse: SparsePremium::NONE,
    };

    #[test]
    fn only_compute_bound_calls_move_the_rate_and_the_median_resists_outliers() {
        let mut rate = KernelRate::new(START);
        // One row over 2048 entries is memory-bound (0.08 < 2 x 0.2 per entry): ignored.
        for _ in 0..10 {
            rate.observe(1, 2048, 999.0);
        }
        assert_eq!(rate.current().observed_calls, 0);
        assert_eq!(rate.current().compute, START);
        // Compute-bound calls at 0.05 us per row-entry, and one stalled call.
        for _ in 0..5 {
            rate.observe(256, 2048, 0.05 * 256.0 * 2048.0);
        }
        rate.observe(256, 2048, 1e9);
        let now = rate.current();
        assert_eq!(now.observed_calls, 6);
        assert!(
            (now.compute.us_per_row_token - 0.05).abs() < 1e-12,
            "{now:?}"
        );
        assert_eq!(now.compute.floor_us, START.floor_us);
        // Bad times are not evidence.
        for us in [f64::NAN, -1.0, 0.0, f64::INFINITY] {
            rate.observe(256, 2048, us);
        }
        assert_eq!(rate.current().observed_calls, 6);
    }

    #[test]
    fn the_window_forgets_old_calls() {
        let mut rate = KernelRate::new(START);
        for _ in 0..WINDOW {
            rate.observe(256, 2048, 0.05 * 256.0 * 2048.0);
        }
        for _ in 0..WINDOW {
            rate.observe(256, 2048, 0.1 * 256.0 * 2048.0);
        }
        let now = rate.current();
        assert_eq!(now.window as usize, WINDOW);
        assert!((now.compute.us_per_row_token - 0.1).abs() < 1e-12);
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
