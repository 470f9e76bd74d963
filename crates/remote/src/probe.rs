//! The fabric probe: the constants of paper 000 section 4.3 (`T_probe`, `BW`) as one
//! requester sees them, measured by routing real requests, so the cost model's route / fetch
//! predicate can be evaluated on the live system rather than profiled.

use std::time::Instant;

use kvroute_costmodel::fit::RoundTripSample;
use kvroute_costmodel::{Fabric, MergeCost, SpliceCost};
use kvroute_kernels::layout::D_QK;
use kvroute_kvstore::ChunkId;

use crate::error::RemoteError;
use crate::requester::{Call, Requester, Sparse};

/// What to probe. [`Default`]: chunk 0's layer 0 at Mq 1, 16, 64, 256, 1024 and 2048, 80
/// routes per point, up to 3 sweeps, any bandwidth and fixed cost believed.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeConfig {
    /// The chunk routed to (its first live holder answers).
    pub chunk: ChunkId,
    /// The layer attended.
    pub layer: u16,
    /// Query-row counts of the sweep. The largest sets how well the bandwidth is seen: its
    /// transfer must stand well above the round trip's noise.
    pub mq: Vec<u32>,
    /// Routes per point, taken in alternating sweeps over the points.
    pub reps: usize,
    /// Sweeps tried before giving up on a line with a positive slope and intercept inside
    /// the bounds below.
    pub attempts: usize,
    /// Fastest believable bandwidth, GB/s: a line above it is measured again. Over host
    /// memory, a multiple of the machine's copy rate; a sweep slowed at its small points
    /// (a loaded machine) flattens the line into an impossible bandwidth.
    pub max_gbps: f64,
    /// Largest believable fixed cost, microseconds: a line above it is measured again.
    pub max_fixed_us: f64,
}

impl Default for ProbeConfig {
    fn default() -> Self {
        Self {
            chunk: ChunkId(0),
            layer: 0,
            mq: vec![1, 16, 64, 256, 1024, 2048],
            reps: 80,
            attempts: 3,
            max_gbps: f64::INFINITY,
            max_fixed_us: f64::INFINITY,
        }
    }
}

/// What [`probe_fabric`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbedFabric {
    /// (Mq, median round trip minus the holder's kernel, us) per point of the sweep used.
    pub points: Vec<(u32, f64)>,
    /// Every sample of that sweep: (Mq, round trip minus the holder's kernel, us).
    pub samples: Vec<(u32, f64)>,
    /// The fabric constants.
    pub fabric: Fabric,
    /// Why the constants are a bound from the points rather than a fit, if they are.
    pub fallback: Option<String>,
}

/// Probes the fabric with the route path itself. Each sample routes the first Mq rows of
/// `queries` (576 bf16 words a row) to `config.chunk` as a one-entry selection (every row
/// attends entry 0 of the chunk: the request, the reply and every byte conversion are a
/// dense route's, the holder's kernel is next to nothing), timed from staging the rows to
/// the checked reply, minus the kernel time the reply's header reports (bounded by the
/// round trip): the cost model prices compute and merge in their own
/// terms. The reps go over the points in alternating directions, so slow spells of a shared
/// machine spread over every point. Other requesters may share the holder: a route that
/// queued behind their work only comes out slower, and the line is robust to that. The line
/// `T_probe + Mq * row_bytes / BW` is a Theil-Sen fit through every sample
/// ([`kvroute_costmodel::fit::theil_sen`]): a minority of stalled routes cannot move it. A
/// sweep with no line of positive slope and intercept, or whose line is outside
/// `config.max_gbps` / `config.max_fixed_us`, is measured again, up to `attempts` times, then
/// bounded from the last sweep's medians ([`fabric_bound`]) and said so.
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
    if !(config.max_gbps > 0.0 && config.max_fixed_us > 0.0) {
        return Err(RemoteError::Config(format!(
            "a probe's bounds must be positive (max_gbps {}, max_fixed_us {})",
            config.max_gbps, config.max_fixed_us
        )));
    }
    if queries.len() < largest * D_QK {
        return Err(RemoteError::Config(format!(
            "a probe to Mq {largest} needs {largest} query rows"
        )));
    }
    req.holder_for(config.chunk)?;
    let entry_zero = vec![0i32; largest];
    let mut why = String::new();
    let mut last = (Vec::new(), Vec::new());
    for _ in 0..config.attempts.max(1) {
        let n = config.mq.len();
        let mut samples = Vec::with_capacity(n * config.reps);
        for rep in 0..config.reps {
            for i in 0..n {
                let mq = config.mq[if rep % 2 == 0 { i } else { n - 1 - i }];
                let call = [Call {
                    chunk: config.chunk,
                    layer: config.layer,
                    queries: &queries[..mq as usize * D_QK],
                    sparse: Some(Sparse {
                        indices: &entry_zero[..mq as usize],
                        k: 1,
                        rows_per_token: 1,
                    }),
                }];
                let started = Instant::now();
                let routed = req.stage_copied(&call).route_wire();
                routed.partial(0)?;
                let us = started.elapsed().as_secs_f64() * 1e6;
                let kernel_us = routed.holder_kernel_us(0, us).unwrap_or(0.0);
                samples.push((mq, us - kernel_us));
            }
        }
        let points = medians(&config.mq, &samples);
        match line_through(&samples, row_bytes).and_then(|f| within(f, config)) {
            Ok(fabric) => {
                return Ok(ProbedFabric {
                    points,
                    samples,
                    fabric,
                    fallback: None,
                });
            }
            Err(e) => why = e.to_string(),
        }
        last = (points, samples);
    }
    // The machine is too loaded for a line through these points. A caller still needs
    // constants to decide with.
    let (points, samples) = last;
    let fabric = fabric_bound(&points, row_bytes).map_err(|e| {
        RemoteError::Probe(format!(
            "no fabric constants: {why}; then {e}; points {points:?}"
        ))
    })?;
    Ok(ProbedFabric {
        points,
        samples,
        fabric,
        fallback: Some(format!(
            "no fit in {} probe sweeps ({why}); bounded from the last one",
            config.attempts.max(1)
        )),
    })
}

/// `fabric` if `config` believes it.
fn within(fabric: Fabric, config: &ProbeConfig) -> Result<Fabric, RemoteError> {
    if fabric.bw_gbps > config.max_gbps {
        return Err(RemoteError::Probe(format!(
            "fitted {:.2} GB/s is above the believable {:.2} GB/s",
            fabric.bw_gbps, config.max_gbps
        )));
    }
    if fabric.probe_us > config.max_fixed_us {
        return Err(RemoteError::Probe(format!(
            "fitted fixed cost {:.1} us is above the believable {:.1} us",
            fabric.probe_us, config.max_fixed_us
        )));
    }
    Ok(fabric)
}

/// The median of each point's samples, in the order of `mq` (NaN for a point without any).
fn medians(mq: &[u32], samples: &[(u32, f64)]) -> Vec<(u32, f64)> {
    mq.iter()
        .map(|&m| {
            let mut v: Vec<f64> = samples.iter().filter(|s| s.0 == m).map(|s| s.1).collect();
            (
                m,
                kvroute_costmodel::fit::median(&mut v).unwrap_or(f64::NAN),
            )
        })
        .collect()
}

/// The Theil-Sen line through (Mq x `row_bytes`, us) samples, as fabric constants.
pub fn line_through(samples: &[(u32, f64)], row_bytes: u64) -> Result<Fabric, RemoteError> {
    let points: Vec<(f64, f64)> = samples
        .iter()
        .map(|&(mq, us)| (f64::from(mq) * row_bytes as f64, us))
        .collect();
    let line = kvroute_costmodel::fit::theil_sen(&points)?;
    if line.slope.is_nan() || line.slope <= 0.0 {
        return Err(RemoteError::Probe(format!(
            "larger routes were not slower (slope {:.3e} us/B)",
            line.slope
        )));
    }
    Ok(Fabric::measured(line.intercept, 1.0 / (line.slope * 1e3))?)
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

/// The requester's own merge, measured here: [`merge_wire`](kvroute_kernels::merge_wire) of
/// `parts` wire partials of `rows` rows at (64, 1), (64, 8), (1024, 1) and (1024, 8), the
/// fastest of `reps` each, as the cost model's `fixed + rows x parts x rate` (least squares in
/// rows x parts, the fixed part no less than zero). The partials are synthetic but valid:
/// the merge's work does not depend on their values.
pub fn measure_merge(reps: usize) -> Result<MergeCost, RemoteError> {
    use kvroute_kernels::layout::PARTIAL_ROW_BYTES;
    use kvroute_kernels::{Partial, WirePartial, merge_wire};
    let max_rows = 1024;
    let max_parts = 8;
    // One wire row: o (512 bf16 of 0.5), m = 0.0 and l = 1.0 as f32.
    let mut row = vec![0u8; PARTIAL_ROW_BYTES];
    for o in row[..PARTIAL_ROW_BYTES - 8].chunks_exact_mut(2) {
        o.copy_from_slice(&kvroute_kernels::bf16::from_f32(0.5).to_le_bytes());
    }
    row[PARTIAL_ROW_BYTES - 4..].copy_from_slice(&1.0f32.to_le_bytes());
    let bytes: Vec<u8> = row.repeat(max_rows);
    let mut out = Partial::empty(max_rows);
    let mut points = Vec::new();
    for rows in [64usize, max_rows] {
        for parts in [1usize, max_parts] {
            let wire: Vec<WirePartial<'_>> = (0..parts)
                .map(|_| WirePartial::new(&bytes[..rows * PARTIAL_ROW_BYTES]))
                .collect::<Result<_, _>>()?;
            let mut best = f64::INFINITY;
            for _ in 0..reps.max(1) {
                let started = Instant::now();
                merge_wire(&wire, &mut out)?;
                best = best.min(started.elapsed().as_secs_f64() * 1e6);
            }
            points.push(((rows * parts) as f64, best));
        }
    }
    let line = kvroute_costmodel::fit::least_squares(points.iter().copied())?;
    let merge = MergeCost {
        fixed_us: line.intercept.max(0.0),
        us_per_row_part: line.slope.max(0.0),
    };
    merge.validate()?;
    Ok(merge)
}

/// The requester's own splice of a fetched chunk, measured here as a fetch runs it (in place
/// over pool pages, every layer): `layers` layers at `tokens` of 64 and 2048 (or `max_tokens`
/// if smaller, at least 128), re-homed 4096 positions on with `rope`, the fastest of `reps`
/// each, as the cost model's `fixed + per_token x ct` line.
pub fn measure_splice(
    backend: kvroute_kernels::Backend,
    rope: kvroute_kernels::Rope,
    layers: usize,
    (max_tokens, reps): (usize, usize),
) -> Result<SpliceCost, RemoteError> {
    use kvroute_kernels::layout::PAGE_TOKENS;
    use kvroute_kernels::{SpliceJob, splice};
    let big = max_tokens.clamp(2 * PAGE_TOKENS, 2048);
    let small = PAGE_TOKENS;
    let pages_of = |n: usize| layers * n.div_ceil(PAGE_TOKENS);
    let mut pool = vec![0x3f00u16; pages_of(big) * PAGE_TOKENS * D_QK];
    let mut points = Vec::new();
    for n in [small, big] {
        let from: Vec<i64> = (0..n as i64).collect();
        let to: Vec<i64> = from.iter().map(|p| p + 4096).collect();
        let table: Vec<u32> = (0..pages_of(n) as u32).collect();
        let mut best = f64::INFINITY;
        for _ in 0..reps.max(1) {
            let view = &mut pool[..pages_of(n) * PAGE_TOKENS * D_QK];
            let started = Instant::now();
            splice(
                backend,
                SpliceJob::in_place(layers, &from, &to, rope, view, &table)?,
            )?;
            best = best.min(started.elapsed().as_secs_f64() * 1e6);
        }
        points.push((n as f64, best));
    }
    let line = kvroute_costmodel::fit::least_squares(points.iter().copied())?;
    let splice = SpliceCost {
        // A splice is never free: a line through two points may put zero below the fixed part.
        fixed_us: line.intercept.max(points[0].1 * 0.5).max(1e-3),
        per_token_us: line.slope.max(0.0),
    };
    splice.validate()?;
    Ok(splice)
}

#[cfg(test)]
mod tests {
    use kvroute_costmodel::fit::{Weighting, fit_round_trips};

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

    #[test]
    fn a_line_outside_the_believable_bounds_is_refused() {
        let row_bytes = 2184;
        // 10 us + bytes at 2 GB/s, exactly.
        let samples: Vec<(u32, f64)> = [1u32, 16, 64, 256]
            .iter()
            .map(|&mq| (mq, 10.0 + f64::from(mq) * row_bytes as f64 / 2e3))
            .collect();
        let line = line_through(&samples, row_bytes).unwrap();
        assert!((line.bw_gbps - 2.0).abs() < 1e-9 && (line.probe_us - 10.0).abs() < 1e-9);
        let config = |max_gbps, max_fixed_us| ProbeConfig {
            max_gbps,
            max_fixed_us,
            ..ProbeConfig::default()
        };
        assert_eq!(within(line, &ProbeConfig::default()).unwrap(), line);
        assert_eq!(within(line, &config(2.5, 10.5)).unwrap(), line);
        let fast = within(line, &config(1.5, 100.0)).unwrap_err().to_string();
        assert!(fast.contains("above the believable 1.50 GB/s"), "{fast}");
        let slow = within(line, &config(100.0, 9.5)).unwrap_err().to_string();
        assert!(slow.contains("fixed cost 10.0 us is above"), "{slow}");
    }

    #[test]
    fn local_merge_and_splice_lines_grow_with_their_work() {
        let merge = measure_merge(2).unwrap();
        assert!(merge.at(1024.0, 8.0) > merge.at(64.0, 1.0), "{merge:?}");
        let rope = kvroute_kernels::Rope::plain(10_000.0, kvroute_kernels::RopeLayout::Interleaved)
            .unwrap();
        let splice = measure_splice(kvroute_kernels::Backend::Cpu, rope, 2, (512, 2)).unwrap();
        splice.validate().unwrap();
        assert!(splice.at(512.0) > splice.at(64.0) * 0.99, "{splice:?}");
    }
}
