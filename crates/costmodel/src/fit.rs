//! Fitting fabric constants from measured round trips, and scoring a model against them.
//!
//! Paper 000 ("Move the Query, Not the Cache") section 4.3 fits `T_route = T_probe +
//! Mq (q + p) / BW` to a query-batch sweep and reports the mean absolute percentage error
//! (MAPE) over the amortised regime (`Mq >= 512`) and over every point. [`fit_round_trips`]
//! does the same from any sweep, [`mape`] scores given constants without refitting.
//!
//! Round trips span two to three orders of magnitude across a sweep, so the default fit
//! minimises relative error ([`Weighting::Relative`], weights `1/y^2`): with plain least
//! squares the largest batches dictate both constants and the probe comes out as their noise.
//! Everything here works in one or two passes over a slice and allocates nothing.

use serde::{Deserialize, Serialize};

use crate::error::{CostModelError, Result, count, finite, positive};
use crate::fabric::{BYTES_PER_US_PER_GBPS, Fabric};

/// The batch size from which paper 000 counts a round trip as amortised.
pub const AMORTISED_MIN_MQ: u32 = 512;

/// A straight line `y = intercept + slope x`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Line {
    /// Value at x = 0.
    pub intercept: f64,
    /// Increase of y per unit of x.
    pub slope: f64,
}

/// Ordinary least squares through `(x, y)` points. Errors on non-finite input or fewer than
/// two distinct abscissae.
pub fn least_squares<I>(points: I) -> Result<Line>
where
    I: Iterator<Item = (f64, f64)> + Clone,
{
    weighted_least_squares(points.map(|(x, y)| (x, y, 1.0)))
}

/// Weighted least squares through `(x, y, weight)` points.
pub fn weighted_least_squares<I>(points: I) -> Result<Line>
where
    I: Iterator<Item = (f64, f64, f64)> + Clone,
{
    // Two passes (means, then centred sums) keep the sums well conditioned without storing
    // the points.
    let (mut sw, mut swx, mut swy) = (0.0, 0.0, 0.0);
    let (mut min_x, mut max_x) = (f64::INFINITY, f64::NEG_INFINITY);
    for (x, y, w) in points.clone() {
        finite("sample x", x)?;
        finite("sample y", y)?;
        positive("sample weight", w)?;
        sw += w;
        swx += w * x;
        swy += w * y;
        min_x = min_x.min(x);
        max_x = max_x.max(x);
    }
    if sw == 0.0 {
        return Err(CostModelError::TooFewSamples { needed: 2, got: 0 });
    }
    if max_x <= min_x {
        return Err(CostModelError::TooFewSamples { needed: 2, got: 1 });
    }
    let (mean_x, mean_y) = (swx / sw, swy / sw);
    let (mut sxx, mut sxy) = (0.0, 0.0);
    for (x, y, w) in points {
        sxx += w * (x - mean_x) * (x - mean_x);
        sxy += w * (x - mean_x) * (y - mean_y);
    }
    let slope = sxy / sxx;
    Ok(Line {
        intercept: mean_y - slope * mean_x,
        slope,
    })
}

/// How the fit weighs the samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Weighting {
    /// Minimise relative error (weights `1 / y^2`): every batch size counts alike.
    #[default]
    Relative,
    /// Minimise absolute error (plain least squares).
    Absolute,
}

/// One measured route round trip.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RoundTripSample {
    /// Query rows in the batch.
    pub mq_rows: u32,
    /// Measured round trip, microseconds.
    pub round_trip_us: f64,
}

/// One measured transfer of a known size (for instance a fetch of `ct` tokens).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TransferSample {
    /// Bytes moved.
    pub bytes: f64,
    /// Measured time, microseconds.
    pub time_us: f64,
}

/// Mean absolute percentage errors of a model against a sweep.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Mape {
    /// Over samples with `Mq >= 512`; `None` if the sweep has none.
    pub amortised_pct: Option<f64>,
    /// Over every sample.
    pub all_pct: f64,
    /// How many samples were amortised.
    pub amortised_samples: usize,
    /// How many samples there were.
    pub samples: usize,
}

/// Fabric constants fitted to a route sweep.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FabricFit {
    /// The intercept: probe plus any fixed turnaround, microseconds (may come out <= 0 from
    /// bad data; [`FabricFit::fabric`] refuses that).
    pub probe_us: f64,
    /// Bandwidth from the slope, GB/s.
    pub bw_gbps: f64,
    /// How well the fitted line matches the samples.
    pub mape: Mape,
}

impl FabricFit {
    /// The fitted constants as a [`Fabric`], if they are physical.
    pub fn fabric(&self) -> Result<Fabric> {
        Fabric::measured(self.probe_us, self.bw_gbps)
    }

    /// How well the fitted line matches `samples` (for example every repetition of a sweep
    /// whose medians it was fitted to), scored as [`FabricFit::mape`] is: a line whose
    /// intercept came out <= 0 is scored too, where [`mape`] refuses it.
    pub fn score(&self, row_bytes: u64, samples: &[RoundTripSample]) -> Result<Mape> {
        validate_round_trips(samples)?;
        Ok(score(
            &line(self.probe_us, self.bw_gbps),
            row_bytes as f64,
            samples,
        ))
    }
}

/// A fitted line as a [`Fabric`], unchecked (its intercept may be <= 0), for scoring only.
fn line(probe_us: f64, bw_gbps: f64) -> Fabric {
    Fabric {
        probe_us,
        bw_gbps,
        turnaround_us: 0.0,
        link_gbps: None,
    }
}

/// Fits `round_trip = probe + Mq row_bytes / BW` to a route sweep.
pub fn fit_round_trips(
    samples: &[RoundTripSample],
    row_bytes: u64,
    weighting: Weighting,
) -> Result<FabricFit> {
    validate_round_trips(samples)?;
    let row_bytes = row_bytes as f64;
    positive("row_bytes", row_bytes)?;
    let line = fit_line(
        samples
            .iter()
            .map(|s| (f64::from(s.mq_rows) * row_bytes, s.round_trip_us)),
        weighting,
    )?;
    let bw_gbps = bandwidth_from_slope(line.slope)?;
    Ok(FabricFit {
        probe_us: line.intercept,
        bw_gbps,
        mape: score(&self::line(line.intercept, bw_gbps), row_bytes, samples),
    })
}

/// Fits `time = fixed + bytes / BW` to transfers of several sizes; returns (fixed_us, BW).
pub fn fit_transfers(samples: &[TransferSample], weighting: Weighting) -> Result<(f64, f64)> {
    for s in samples {
        positive("bytes", s.bytes)?;
        positive("time_us", s.time_us)?;
    }
    let line = fit_line(samples.iter().map(|s| (s.bytes, s.time_us)), weighting)?;
    Ok((line.intercept, bandwidth_from_slope(line.slope)?))
}

/// Scores `fabric` against a route sweep without refitting (paper 000 section 4.3 scores the
/// measured constants this way, "with no refit").
pub fn mape(fabric: &Fabric, row_bytes: u64, samples: &[RoundTripSample]) -> Result<Mape> {
    fabric.validate()?;
    validate_round_trips(samples)?;
    Ok(score(fabric, row_bytes as f64, samples))
}

fn fit_line<I>(points: I, weighting: Weighting) -> Result<Line>
where
    I: Iterator<Item = (f64, f64)> + Clone,
{
    match weighting {
        Weighting::Absolute => least_squares(points),
        Weighting::Relative => weighted_least_squares(points.map(|(x, y)| (x, y, 1.0 / (y * y)))),
    }
}

fn bandwidth_from_slope(slope_us_per_byte: f64) -> Result<f64> {
    // NaN slopes (from degenerate weights) fail this too.
    if slope_us_per_byte.is_nan() || slope_us_per_byte <= 0.0 {
        return Err(CostModelError::NonIncreasingSamples { slope_us_per_byte });
    }
    Ok(1.0 / (slope_us_per_byte * BYTES_PER_US_PER_GBPS))
}

fn validate_round_trips(samples: &[RoundTripSample]) -> Result<()> {
    if samples.is_empty() {
        return Err(CostModelError::TooFewSamples { needed: 2, got: 0 });
    }
    for s in samples {
        count("mq_rows", s.mq_rows)?;
        positive("round_trip_us", s.round_trip_us)?;
    }
    Ok(())
}

fn score(fabric: &Fabric, row_bytes: f64, samples: &[RoundTripSample]) -> Mape {
    let (mut all, mut amortised, mut amortised_samples) = (0.0, 0.0, 0usize);
    for s in samples {
        let predicted = fabric.round_trip_us(f64::from(s.mq_rows), row_bytes);
        let error = (predicted - s.round_trip_us).abs() / s.round_trip_us;
        all += error;
        if s.mq_rows >= AMORTISED_MIN_MQ {
            amortised += error;
            amortised_samples += 1;
        }
    }
    Mape {
        amortised_pct: (amortised_samples > 0)
            .then(|| 100.0 * amortised / amortised_samples as f64),
        all_pct: 100.0 * all / samples.len() as f64,
        amortised_samples,
        samples: samples.len(),
    }
}

/// The Theil-Sen line through `(x, y)` points: the median of the slopes of every pair with
/// distinct abscissae, then the median of `y - slope x` as the intercept. Up to ~29% of the
/// points can be arbitrarily wrong (a preempted round trip, a page-cache miss) without moving
/// it, where one such point can drag a least-squares line anywhere. `O(n^2)` time and memory
/// in the points: meant for windows of a few hundred. Errors on non-finite input or fewer
/// than two distinct abscissae.
pub fn theil_sen(points: &[(f64, f64)]) -> Result<Line> {
    for &(x, y) in points {
        finite("sample x", x)?;
        finite("sample y", y)?;
    }
    let mut slopes = Vec::with_capacity(points.len() * points.len().saturating_sub(1) / 2);
    for (i, &(x0, y0)) in points.iter().enumerate() {
        for &(x1, y1) in &points[i + 1..] {
            if x1 != x0 {
                slopes.push((y1 - y0) / (x1 - x0));
            }
        }
    }
    let too_few = || CostModelError::TooFewSamples {
        needed: 2,
        got: points.len().min(1),
    };
    let slope = median(&mut slopes).ok_or_else(too_few)?;
    let mut intercepts: Vec<f64> = points.iter().map(|&(x, y)| y - slope * x).collect();
    Ok(Line {
        intercept: median(&mut intercepts).ok_or_else(too_few)?,
        slope,
    })
}

/// Mean and nearest-rank percentiles of a set of samples, in the samples' unit: the one
/// percentile summary of the workspace (the simulators' latencies, the transport bench's).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, Default)]
pub struct Percentiles {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean: f64,
    /// 50th percentile (nearest rank: the lower middle of an even count; [`median`] is the
    /// mean of the two middles).
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

impl Percentiles {
    /// Summarises `samples` (sorted in place; NaNs sort last). Nearest rank: the `q`
    /// percentile is the smallest sample with at least a share `q` of the samples at or below
    /// it. All zeros for no samples.
    pub fn of(samples: &mut [f64]) -> Self {
        if samples.is_empty() {
            return Self::default();
        }
        samples.sort_unstable_by(f64::total_cmp);
        let n = samples.len();
        let rank = |q: f64| samples[((q * n as f64).ceil() as usize).clamp(1, n) - 1];
        Self {
            count: n as u64,
            mean: samples.iter().sum::<f64>() / n as f64,
            p50: rank(0.50),
            p90: rank(0.90),
            p99: rank(0.99),
            max: samples[n - 1],
        }
    }
}

/// The median of `values` (the mean of the middle two for an even count), reordering them.
/// A selection, not a sort: linear in the count, which for Theil-Sen's pairwise slopes is
/// the square of the samples'. `None` for no values.
pub fn median(values: &mut [f64]) -> Option<f64> {
    let n = values.len();
    if n == 0 {
        return None;
    }
    let (below, &mut upper, _) = values.select_nth_unstable_by(n / 2, f64::total_cmp);
    Some(if n % 2 == 1 {
        upper
    } else {
        // The lower middle is the largest of everything selected below the upper one.
        let lower = below
            .iter()
            .copied()
            .max_by(f64::total_cmp)
            .unwrap_or(upper);
        (lower + upper) / 2.0
    })
}

#[cfg(test)]
mod tests {

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let p = Percentiles::of(&mut v);
        assert_eq!(
            (p.count, p.p50, p.p90, p.p99, p.max),
            (100, 50.0, 90.0, 99.0, 100.0)
        );
        assert!((p.mean - 50.5).abs() < 1e-12);
        assert_eq!(Percentiles::of(&mut []), Percentiles::default());
    }
    use super::*;

    fn sweep(probe_us: f64, bw_gbps: f64) -> Vec<RoundTripSample> {
        let f = Fabric::measured(probe_us, bw_gbps).unwrap();
        (0..7)
            .map(|i| {
                let mq = 4u32.pow(i);
                RoundTripSample {
                    mq_rows: mq,
                    round_trip_us: f.round_trip_us(f64::from(mq), 2184.0),
                }
            })
            .collect()
    }

    #[test]
    fn exact_samples_are_fitted_exactly_by_both_weightings() {
        for weighting in [Weighting::Relative, Weighting::Absolute] {
            let fit = fit_round_trips(&sweep(16.0, 25.0), 2184, weighting).unwrap();
            assert!((fit.probe_us - 16.0).abs() < 1e-9, "{fit:?}");
            assert!((fit.bw_gbps - 25.0).abs() < 1e-9, "{fit:?}");
            assert!(fit.mape.all_pct < 1e-9);
            assert_eq!(fit.mape.amortised_samples, 2, "1024 and 4096");
        }
    }

    /// Scoring the IBGDA constants without the turnaround against round trips that carry it
    /// shows the small-Mq error paper 000 section 4.3 attributes to the turnaround: the full
    /// MAPE far exceeds the amortised one.
    #[test]
    fn omitted_turnaround_inflates_full_mape_over_amortised_mape() {
        let with_turnaround = Fabric::measured(16.0, 25.0)
            .unwrap()
            .with_turnaround_us(9.0)
            .unwrap();
        let samples: Vec<_> = [1u32, 16, 128, 512, 1024, 2048, 4096]
            .iter()
            .map(|&mq| RoundTripSample {
                mq_rows: mq,
                round_trip_us: with_turnaround.round_trip_us(f64::from(mq), 2184.0),
            })
            .collect();
        let m = mape(&Fabric::measured(16.0, 25.0).unwrap(), 2184, &samples).unwrap();
        let amortised = m.amortised_pct.unwrap();
        assert!(amortised < 7.0 && m.all_pct > 2.0 * amortised, "{m:?}");
    }

    #[test]
    fn degenerate_sweeps_are_typed_errors() {
        let one_size = [RoundTripSample {
            mq_rows: 8,
            round_trip_us: 20.0,
        }; 3];
        assert_eq!(
            fit_round_trips(&one_size, 2184, Weighting::Relative),
            Err(CostModelError::TooFewSamples { needed: 2, got: 1 })
        );
        assert!(fit_round_trips(&[], 2184, Weighting::Relative).is_err());
        let shrinking = [
            RoundTripSample {
                mq_rows: 1,
                round_trip_us: 50.0,
            },
            RoundTripSample {
                mq_rows: 1024,
                round_trip_us: 20.0,
            },
        ];
        assert!(matches!(
            fit_round_trips(&shrinking, 2184, Weighting::Absolute),
            Err(CostModelError::NonIncreasingSamples { .. })
        ));
        let nan = [
            RoundTripSample {
                mq_rows: 1,
                round_trip_us: f64::NAN,
            },
            RoundTripSample {
                mq_rows: 2,
                round_trip_us: 1.0,
            },
        ];
        assert!(fit_round_trips(&nan, 2184, Weighting::Relative).is_err());
        let zero_rows = [
            RoundTripSample {
                mq_rows: 0,
                round_trip_us: 1.0,
            },
            RoundTripSample {
                mq_rows: 2,
                round_trip_us: 2.0,
            },
        ];
        assert!(fit_round_trips(&zero_rows, 2184, Weighting::Relative).is_err());
    }

    /// A fitted line is scored on other samples as on its own, even when its intercept came
    /// out <= 0 (which `mape`, for measured constants, refuses), and bad samples are refused.
    #[test]
    fn a_fit_scores_other_samples_as_its_own() {
        let samples = sweep(16.0, 25.0);
        let fit = fit_round_trips(&samples, 2184, Weighting::Relative).unwrap();
        assert_eq!(fit.score(2184, &samples).unwrap(), fit.mape);
        let below = FabricFit {
            probe_us: -4.0,
            ..fit
        };
        let scored = below.score(2184, &samples).unwrap();
        assert!(scored.all_pct > 0.0 && scored.samples == samples.len());
        assert!(
            mape(
                &Fabric {
                    probe_us: -4.0,
                    ..fit.fabric().unwrap()
                },
                2184,
                &samples
            )
            .is_err()
        );
        assert!(fit.score(2184, &[]).is_err());
    }

    #[test]
    fn transfer_fit_recovers_fixed_cost_and_bandwidth() {
        let samples: Vec<_> = [64.0, 512.0, 2048.0, 8192.0]
            .iter()
            .map(|ct| TransferSample {
                bytes: ct * 31104.0,
                time_us: 40.0 + ct * 31104.0 / 12e3,
            })
            .collect();
        let (fixed, bw) = fit_transfers(&samples, Weighting::Relative).unwrap();
        assert!(
            (fixed - 40.0).abs() < 1e-6 && (bw - 12.0).abs() < 1e-9,
            "{fixed} {bw}"
        );
    }

    #[test]
    fn theil_sen_ignores_a_minority_of_wild_points_that_least_squares_follows() {
        let mut points: Vec<(f64, f64)> = (0..20)
            .map(|i| {
                let x = f64::from(i) * 1e5;
                (x, 50.0 + x / 3e3)
            })
            .collect();
        // Five preempted round trips, 10x to 100x slow, at the small end.
        for (i, p) in points.iter_mut().take(5).enumerate() {
            p.1 *= 10.0 * (i + 1) as f64;
        }
        let robust = theil_sen(&points).unwrap();
        assert!(
            (robust.slope - 1.0 / 3e3).abs() / (1.0 / 3e3) < 1e-9,
            "{robust:?}"
        );
        assert!((robust.intercept - 50.0).abs() < 1e-6, "{robust:?}");
        let plain = least_squares(points.iter().copied()).unwrap();
        assert!(
            (plain.slope - 1.0 / 3e3).abs() / (1.0 / 3e3) > 0.05,
            "{plain:?}"
        );
        assert!(theil_sen(&[(1.0, 2.0), (1.0, 3.0)]).is_err());
        assert!(theil_sen(&[]).is_err());
        assert_eq!(median(&mut []), None);
        assert!(theil_sen(&[(1.0, f64::NAN), (2.0, 3.0)]).is_err());
    }

    proptest::proptest! {
        /// The selection-based median agrees with sorting and reading the middle (the mean
        /// of the middle two for an even count), ties and signed zeros included.
        #[test]
        fn median_matches_the_sorted_middle(
            values in proptest::collection::vec(
                proptest::prop_oneof![-1e6f64..1e6, proptest::sample::select(vec![0.0, -0.0, 1.0, 7.5])],
                1..200,
            )
        ) {
            let mut sorted = values.clone();
            sorted.sort_by(f64::total_cmp);
            let n = sorted.len();
            let expected = if n % 2 == 1 {
                sorted[n / 2]
            } else {
                (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
            };
            let mut scratch = values;
            proptest::prop_assert_eq!(median(&mut scratch).map(f64::to_bits), Some(expected.to_bits()));
        }
    }
}
