//! The fabric probe: the constants of paper 000 section 4.3 (`T_probe`, `BW`) as one
//! requester sees them, measured by routing real requests, so the cost model's route / fetch
//! predicate can be evaluated on the live system rather than profiled.

use std::time::Instant;

use kvroute_costmodel::Fabric;
use kvroute_costmodel::fit::{RoundTripSample, Weighting, fit_round_trips};
use kvroute_kernels::layout::D_QK;
use kvroute_kvstore::ChunkId;

use crate::error::RemoteError;
use crate::requester::{Call, Requester};

/// What to probe. [`Default`]: chunk 0's layer 0 at Mq 1, 16, 64 and 256, the fastest of 5
/// routes per point, up to 3 sweeps.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeConfig {
    /// The chunk routed to (its first live holder answers).
    pub chunk: ChunkId,
    /// The layer attended.
    pub layer: u16,
    /// Query-row counts of the sweep.
    pub mq: Vec<u32>,
    /// Routes per point; the fastest is kept (noise on a shared machine only adds).
    pub reps: usize,
    /// Sweeps tried before giving up on a line with a positive slope and intercept.
    pub attempts: usize,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        Self {
            chunk: ChunkId(0),
            layer: 0,
            mq: vec![1, 16, 64, 256],
            reps: 5,
            attempts: 3,
        }
    }
}

/// What [`probe_fabric`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbedFabric {
    /// (Mq, route round trip minus the holder's kernel, us) of the sweep used.
    pub points: Vec<(u32, f64)>,
    /// The fabric constants.
    pub fabric: Fabric,
    /// Why the constants are a bound from the points rather than a fit, if they are.
    pub fallback: Option<String>,
}

/// Probes the fabric. At each Mq of `config`, the fastest of `reps` routes of the first Mq
/// rows of `queries` (576 bf16 words a row), each timed from staging the rows to the checked
/// reply, minus the kernel time the reply's header reports for the batch that served it
/// (bounded: [`crate::wire::kernel_us_within`]): the cost model prices compute and merge in
/// their own terms, so they must not be in the fabric's. Other requesters may share the
/// holder: a route that queued behind their work only comes out slower, and the fastest of
/// the repetitions is kept, so nothing is dropped and no shared counter is read (a holder's
/// counters that never advance cost nothing). The points are fitted to
/// `T_probe + Mq * row_bytes / BW` by relative error. A sweep too noisy for a line with a
/// positive slope and intercept is measured again, up to `attempts` times, then bounded from
/// the last sweep ([`fabric_bound`]) and said so.
pub fn probe_fabric(
    req: &mut Requester,
    config: &ProbeConfig,
    queries: &[u16],
    row_bytes: u64,
) -> Result<ProbedFabric, RemoteError> {
    let largest = config.mq.iter().copied().max().unwrap_or(0) as usize;
    if config.mq.is_empty() || config.mq.contains(&0) || config.reps == 0 {
        return Err(RemoteError::Config(
            "a probe needs positive Mq values and repetitions".into(),
        ));
    }
    if queries.len() < largest * D_QK {
        return Err(RemoteError::Config(format!(
            "a probe to Mq {largest} needs {largest} query rows"
        )));
    }
    req.holder_for(config.chunk)?;
    let mut why = String::new();
    let mut last = Vec::new();
    for _ in 0..config.attempts.max(1) {
        let mut points = Vec::new();
        for &mq in &config.mq {
            let call = [Call {
                chunk: config.chunk,
                layer: config.layer,
                queries: &queries[..mq as usize * D_QK],
                sparse: None,
            }];
            let mut best = f64::INFINITY;
            for _ in 0..config.reps {
                let started = Instant::now();
                let routed = req.stage_copied(&call).route_wire();
                routed.partial(0)?;
                let us = started.elapsed().as_secs_f64() * 1e6;
                let kernel_us = routed.holder_kernel_us(0, us).unwrap_or(0.0);
                best = best.min(us - kernel_us);
            }
            points.push((mq, best));
        }
        let samples = round_trips(&points, |p| p.0, |p| p.1);
        match fit_round_trips(&samples, row_bytes, Weighting::Relative).and_then(|f| f.fabric()) {
            Ok(fabric) => {
                return Ok(ProbedFabric {
                    points,
                    fabric,
                    fallback: None,
                });
            }
            Err(e) => why = e.to_string(),
        }
        last = points;
    }
    // The machine is too loaded for a line through these points. A caller still needs
    // constants to decide with.
    let fabric = fabric_bound(&last, row_bytes).map_err(|e| {
        RemoteError::Probe(format!(
            "no fabric constants: {why}; then {e}; points {last:?}"
        ))
    })?;
    Ok(ProbedFabric {
        points: last,
        fabric,
        fallback: Some(format!(
            "no fit in {} probe sweeps ({why}); bounded from the last one",
            config.attempts.max(1)
        )),
    })
}

/// Fabric constants bounded from probe points that no line fits: the fastest point as the
/// fixed cost, and the largest request's bytes over that request's time as the bandwidth.
/// Both are positive, and the model is never faster than the largest request measured.
pub fn fabric_bound(points: &[(u32, f64)], row_bytes: u64) -> Result<Fabric, RemoteError> {
    let fastest = points.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let &(mq, us) = points
        .iter()
        .max_by_key(|p| p.0)
        .ok_or_else(|| RemoteError::Probe("no probe points".into()))?;
    let bw_gbps = (u64::from(mq) * row_bytes) as f64 / (us * 1e3);
    Ok(Fabric::measured(fastest, bw_gbps)?)
}

/// `(Mq, microseconds)` pairs as the cost model's round-trip samples.
pub fn round_trips<T>(
    of: &[T],
    mq: impl Fn(&T) -> u32,
    us: impl Fn(&T) -> f64,
) -> Vec<RoundTripSample> {
    of.iter()
        .map(|x| RoundTripSample {
            mq_rows: mq(x),
            round_trip_us: us(x),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The points of a probe sweep that failed to fit on an overloaded machine (measured: 8
    /// demos at once on 2 cores): the larger requests came back faster.
    const SHRINKING: [(u32, f64); 4] = [(1, 23577.0), (16, 35405.3), (64, 16005.4), (256, 2456.9)];

    #[test]
    fn a_probe_sweep_no_line_fits_is_bounded_by_its_points() {
        let row_bytes = 2184;
        let samples = round_trips(&SHRINKING, |p| p.0, |p| p.1);
        assert!(
            fit_round_trips(&samples, row_bytes, Weighting::Relative)
                .and_then(|f| f.fabric())
                .is_err(),
            "these points have no line with a positive slope"
        );
        let fabric = fabric_bound(&SHRINKING, row_bytes).expect("a bound");
        assert_eq!(fabric.probe_us, 2456.9);
        // The largest request: the model is not faster than measured.
        assert!(fabric.round_trip_us(256.0, row_bytes as f64) >= 2456.9);
        assert!((fabric.transfer_us(256.0 * row_bytes as f64) - 2456.9).abs() < 1e-6);
        // Unsorted points: the largest Mq is found, not the last.
        let mut shuffled = SHRINKING;
        shuffled.swap(1, 3);
        assert_eq!(fabric_bound(&shuffled, row_bytes).expect("a bound"), fabric);
        assert!(fabric_bound(&[], row_bytes).is_err());
        assert!(fabric_bound(&[(16, f64::NAN)], row_bytes).is_err());
        assert!(fabric_bound(&[(16, 0.0)], row_bytes).is_err());
    }
}
