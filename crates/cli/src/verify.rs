//! `kvroute verify-predicate`: paper 000's claim that the route / fetch predicate "can be
//! evaluated, not profiled", checked on this system. For each chunk size of the grid it starts
//! holder processes, calibrates the selector on them once ([`crate::calibrate`]: the fabric
//! from routed round trips, each holder's kernel roofline as it reports it, the merge and the
//! splice measured here, one pull), predicts route and fetch for every Mq from that
//! calibration alone, and only then measures both, repetitions interleaved over the points.
//!
//! - **route** measured: staging the Mq query rows, the round trip to the holder (its dense
//!   kernel over one layer of the chunk included), and the merge of the partial from its
//!   wire rows into f32: what the model's transport + compute + merge terms price.
//! - **fetch** measured: the whole chunk (every layer) pulled into the requester's pool and
//!   spliced in place 4096 positions on: the model's pull + splice.
//! - **local** is a re-prefill of the chunk through the model (`ct x L x c`). No weights run
//!   here, and a CPU recompute of the attention alone is not a fair stand-in (it skips the
//!   projections and the FFN that dominate a prefill), so local is neither measured nor
//!   offered to the selector here.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use kvroute_costmodel::{Allowed, Primitive, Request};
use kvroute_kernels::layout::D_QK;
use kvroute_kernels::{Partial, merge_wire};
use kvroute_kvstore::ChunkId;
use kvroute_remote::{Call, Requester};
use serde::Serialize;

use crate::args::VerifyArgs;
use crate::calibrate::CalibrationSummary;
use crate::demo::provider_for;

mod measure;

/// Target: median absolute prediction error of each primitive, percent.
pub(crate) const TARGET_ERROR_PCT: f64 = 15.0;
/// Target: share of decisive points where the choice was the measured fastest.
pub(crate) const TARGET_CORRECT: f64 = 0.95;
/// A point is decisive when its two measured times (medians) differ by more than this, and
/// their samples separate ([`Measured::quartiles`]).
pub(crate) const DECISIVE: f64 = 0.20;
/// Target: regret over the measured-fastest total, percent.
pub(crate) const TARGET_REGRET_PCT: f64 = 5.0;
/// The requester's own prompt before the document: fetched chunks are re-homed past it.
const PREFIX: i64 = 4096;
/// Passes over the grid the live system learns from before predictions are fixed: at least
/// this many, and enough for the selector's fixed cost to come from live routes
/// ([`kvroute_sched::selector::LIVE_FIXED`] of them) rather than from the start-up probe
/// alone, which a burst of load on the machine can inflate several times over.
const WARM: usize = 3;
/// The probe sweep's largest Mq ([`kvroute_remote::probe::ProbeConfig::default`]).
const PROBE_MQ: usize = 2048;

/// One primitive at one point.
#[derive(Debug, Clone, Serialize)]
pub struct Measured {
    /// The calibrated model's prediction, microseconds.
    pub predicted_us: f64,
    /// The median of the measurements, microseconds.
    pub measured_us: f64,
    /// Every measurement, microseconds.
    pub samples_us: Vec<f64>,
    /// (predicted - measured) / measured, percent.
    pub error_pct: f64,
}

impl Measured {
    fn new(predicted_us: f64, samples_us: Vec<f64>) -> Self {
        let mut sorted = samples_us.clone();
        sorted.sort_by(f64::total_cmp);
        let measured_us = sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN);
        Self {
            predicted_us,
            measured_us,
            samples_us,
            error_pct: 100.0 * (predicted_us - measured_us) / measured_us,
        }
    }

    /// The samples' lower and upper quartiles, by rank (of 5 samples the second and the
    /// fourth; of 3 or fewer the extremes); NaN without samples.
    fn quartiles(&self) -> (f64, f64) {
        let mut sorted = self.samples_us.clone();
        sorted.sort_by(f64::total_cmp);
        let Some(last) = sorted.len().checked_sub(1) else {
            return (f64::NAN, f64::NAN);
        };
        let cut = last / 4;
        (sorted[cut], sorted[last - cut])
    }
}

/// One (Mq, ct) point.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyPoint {
    /// Query rows.
    pub mq: u32,
    /// Chunk tokens.
    pub ct: u32,
    /// The holder (index) serving the point's chunk.
    pub holder: usize,
    /// Route.
    pub route: Measured,
    /// Fetch.
    pub fetch: Measured,
    /// Of route, the holder's kernel: the compute term against the holder's own timing of
    /// the kernel call that served it.
    pub route_kernel: Measured,
    /// The predictions of the start-up calibration alone, before any traffic.
    pub cold: Cold,
    /// What the selector chose.
    pub choice: Primitive,
    /// What measured fastest.
    pub fastest: Primitive,
    /// Whether the measurements say which is faster: the two medians differ by more than
    /// [`DECISIVE`], and the faster one's upper quartile is below the slower one's lower
    /// quartile (samples that overlap, as a loaded machine's do, say nothing).
    pub decisive: bool,
    /// Measured time of the choice minus the fastest's, microseconds.
    pub regret_us: f64,
}

/// Predictions made from the start-up calibration alone.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Cold {
    /// Route, microseconds.
    pub route_predicted_us: f64,
    /// Fetch, microseconds.
    pub fetch_predicted_us: f64,
    /// The choice.
    pub choice: Primitive,
}

/// The grid's verdict.
#[derive(Debug, Clone, Serialize)]
pub struct VerifySummary {
    /// Median absolute route prediction error, percent.
    pub route_median_abs_error_pct: f64,
    /// Median absolute fetch prediction error, percent.
    pub fetch_median_abs_error_pct: f64,
    /// The same two from the start-up calibration alone, before any traffic, percent.
    pub cold_median_abs_error_pct: (f64, f64),
    /// Decisive points where the start-up calibration's choice was the measured fastest.
    pub cold_decisive_correct: usize,
    /// Points.
    pub points: usize,
    /// Points whose measured times differ by more than 20%.
    pub decisive_points: usize,
    /// Of those, where the choice was the measured fastest.
    pub decisive_correct: usize,
    /// `decisive_correct / decisive_points` (1 with none).
    pub decisive_correct_share: f64,
    /// Share of all points where the choice was the measured fastest.
    pub correct_share: f64,
    /// Time lost against the measured fastest, summed, microseconds.
    pub regret_us: f64,
    /// The measured fastest, summed, microseconds.
    pub fastest_total_us: f64,
    /// `regret_us / fastest_total_us`, percent.
    pub regret_pct: f64,
    /// Every target met.
    pub targets_met: bool,
}

/// What `verify-predicate` found.
#[derive(Debug, Clone, Serialize)]
pub struct VerifyReport {
    /// The provider the transport opened.
    pub provider: String,
    /// This machine.
    pub machine: String,
    /// Holder processes per chunk size.
    pub holders: usize,
    /// The holders' kernels (`--holder-backend`).
    pub holder_backend: String,
    /// Repetitions per primitive per point.
    pub reps: usize,
    /// Each chunk size's calibration.
    pub calibrations: Vec<(u32, CalibrationSummary)>,
    /// The grid.
    pub points: Vec<VerifyPoint>,
    /// The verdict.
    pub summary: VerifySummary,
    /// What local means here.
    pub local: &'static str,
    /// The PNGs written.
    pub plots: Vec<PathBuf>,
}

const LOCAL: &str = "local (re-prefill, the model's ct x L x c) is neither measured nor offered: \
                     no weights run here, and recomputing the attention alone would skip the \
                     projections and FFN that dominate a prefill";

/// `kvroute verify-predicate`.
pub(crate) fn run(args: &VerifyArgs) -> Result<VerifyReport> {
    if !(1..=8).contains(&args.holders) {
        bail!("--holders must be 1 to 8");
    }
    if args.mq.is_empty() || args.mq.contains(&0) || args.ct.is_empty() || args.reps == 0 {
        bail!("--mq and --ct need positive values, --reps at least 1");
    }
    args.holder_backend
        .parse::<kvroute_kernels::Backend>()
        .context("--holder-backend")?;
    if let Some(ct) = args.ct.iter().find(|&&ct| ct < 64) {
        bail!("--ct {ct}: chunks of at least 64 tokens");
    }
    let provider = provider_for(&args.provider)?;
    let largest = args.mq.iter().copied().max().unwrap_or(1) as usize;
    let rows = largest.max(PROBE_MQ);
    // A request's rows (and the probe's indices) plus headers; a reply's rows fit too.
    let slot_bytes = (rows * (D_QK * 2 + 4) + (64 << 10)).next_power_of_two();
    let mut provider_name = String::new();
    let mut calibrations = Vec::new();
    let mut points = Vec::new();
    for &ct in &args.ct {
        let at = measure::at_chunk_size(args, &provider, ct, slot_bytes, largest)?;
        provider_name = at.provider;
        calibrations.push((ct, at.calibration));
        points.extend(at.points);
    }
    let summary = summarise(&points);
    let mut report = VerifyReport {
        provider: provider_name,
        machine: crate::bench::machine(),
        holders: args.holders,
        holder_backend: args.holder_backend.clone(),
        reps: args.reps,
        calibrations,
        points,
        summary,
        local: LOCAL,
        plots: Vec::new(),
    };
    if let Some(dir) = &args.plots {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        report.plots = plots(&report, dir)?;
    }
    Ok(report)
}

/// One route as the model prices it: the rows staged, the round trip (the holder's kernel
/// included), the partial merged from its wire rows. Microseconds.
fn route_once(
    req: &mut Requester,
    chunk: u32,
    q: &[u16],
    merged: &mut Partial,
) -> Result<RouteTimes> {
    let call = [Call {
        chunk: ChunkId(chunk),
        layer: 0,
        queries: q,
        sparse: None,
    }];
    let started = Instant::now();
    let routed = req.stage_copied(&call).route_wire();
    let part = routed.partial(0)?;
    let merging = Instant::now();
    merge_wire(&[part], merged)?;
    let merge_us = merging.elapsed().as_secs_f64() * 1e6;
    let total_us = started.elapsed().as_secs_f64() * 1e6;
    Ok(RouteTimes {
        total_us,
        kernel_us: routed.holder_kernel_us(0, total_us).unwrap_or(0.0),
        merge_us,
    })
}

/// One measured route: the whole of it, the holder's kernel as its reply says, the merge.
struct RouteTimes {
    total_us: f64,
    kernel_us: f64,
    merge_us: f64,
}

/// A point's measurements, microseconds.
#[derive(Debug, Clone, Default)]
struct Samples {
    route: Vec<f64>,
    kernel: Vec<f64>,
    fetch: Vec<f64>,
}

/// The selector's choice for `mq` rows against chunk `chunk` of `ct` tokens, route or fetch.
fn decide(
    req: &Requester,
    cal: &crate::calibrate::Calibrated,
    chunk: u32,
    mq: u32,
    ct: u32,
) -> Result<kvroute_sched::selector::Choice> {
    let replicas = req.live_replicas(ChunkId(chunk));
    let request = Request {
        allowed: Allowed {
            local: false,
            ..Allowed::ALL
        },
        ..Request::contiguous(mq, ct)
    };
    Ok(cal.selector.decide(&replicas, request)?)
}

fn point(
    mq: u32,
    ct: u32,
    holder: usize,
    choice: Primitive,
    (route, fetch): (Measured, Measured),
) -> VerifyPoint {
    let (fastest, faster, slower) = if route.measured_us <= fetch.measured_us {
        (Primitive::Route, &route, &fetch)
    } else {
        (Primitive::Fetch, &fetch, &route)
    };
    let (best, other) = (faster.measured_us, slower.measured_us);
    let separate = faster.quartiles().1 < slower.quartiles().0;
    let chosen = if choice == Primitive::Route {
        route.measured_us
    } else {
        fetch.measured_us
    };
    VerifyPoint {
        mq,
        ct,
        holder,
        decisive: other > best * (1.0 + DECISIVE) && separate,
        regret_us: chosen - best,
        route_kernel: Measured::new(f64::NAN, Vec::new()),
        cold: Cold {
            route_predicted_us: f64::NAN,
            fetch_predicted_us: f64::NAN,
            choice,
        },
        route,
        fetch,
        choice,
        fastest,
    }
}

/// The median of the absolute values ([`kvroute_costmodel::fit::median`]); NaN for none.
fn median_abs(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.map(f64::abs).collect();
    kvroute_costmodel::fit::median(&mut v).unwrap_or(f64::NAN)
}

/// The verdict over `points`.
pub(crate) fn summarise(points: &[VerifyPoint]) -> VerifySummary {
    let decisive: Vec<&VerifyPoint> = points.iter().filter(|p| p.decisive).collect();
    let decisive_correct = decisive.iter().filter(|p| p.choice == p.fastest).count();
    let correct = points.iter().filter(|p| p.choice == p.fastest).count();
    let regret_us: f64 = points.iter().map(|p| p.regret_us).sum();
    let fastest_total_us: f64 = points
        .iter()
        .map(|p| p.route.measured_us.min(p.fetch.measured_us))
        .sum();
    let share = |n: usize, of: usize| if of == 0 { 1.0 } else { n as f64 / of as f64 };
    let route = median_abs(points.iter().map(|p| p.route.error_pct));
    let fetch = median_abs(points.iter().map(|p| p.fetch.error_pct));
    let decisive_correct_share = share(decisive_correct, decisive.len());
    let cold_error = |pick: fn(&VerifyPoint) -> (f64, f64)| {
        median_abs(points.iter().map(|p| {
            let (predicted, measured) = pick(p);
            100.0 * (predicted - measured) / measured
        }))
    };
    let regret_pct = 100.0 * regret_us / fastest_total_us;
    VerifySummary {
        route_median_abs_error_pct: route,
        fetch_median_abs_error_pct: fetch,
        cold_median_abs_error_pct: (
            cold_error(|p| (p.cold.route_predicted_us, p.route.measured_us)),
            cold_error(|p| (p.cold.fetch_predicted_us, p.fetch.measured_us)),
        ),
        cold_decisive_correct: decisive
            .iter()
            .filter(|p| p.cold.choice == p.fastest)
            .count(),
        points: points.len(),
        decisive_points: decisive.len(),
        decisive_correct,
        decisive_correct_share,
        correct_share: share(correct, points.len()),
        regret_us,
        fastest_total_us,
        regret_pct,
        targets_met: route <= TARGET_ERROR_PCT
            && fetch <= TARGET_ERROR_PCT
            && decisive_correct_share >= TARGET_CORRECT
            && regret_pct < TARGET_REGRET_PCT,
    }
}

impl std::fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "kvroute verify-predicate: {} holder processes per chunk size ({} kernels) over libfabric {}, {} reps, {}",
            self.holders, self.holder_backend, self.provider, self.reps, self.machine
        )?;
        for (ct, c) in &self.calibrations {
            write!(f, "ct = {ct}: {c}")?;
        }
        writeln!(
            f,
            "{:>5} {:>5} {:>3}  {:>21} {:>7} {:>21}  {:>21} {:>7}  {:<6} {:<6}",
            "Mq",
            "ct",
            "h",
            "route pred/meas us",
            "err",
            "its kernel pred/meas",
            "fetch pred/meas us",
            "err",
            "choice",
            "fastest"
        )?;
        for p in &self.points {
            let mark = if p.choice == p.fastest {
                ""
            } else if p.decisive {
                "  WRONG"
            } else {
                "  (within 20%)"
            };
            writeln!(
                f,
                "{:>5} {:>5} {:>3}  {:>10.0}/{:<10.0} {:>+6.1}% {:>10.0}/{:<10.0}  {:>10.0}/{:<10.0} {:>+6.1}%  {:<6} {:<6}{mark}",
                p.mq,
                p.ct,
                p.holder,
                p.route.predicted_us,
                p.route.measured_us,
                p.route.error_pct,
                p.route_kernel.predicted_us,
                p.route_kernel.measured_us,
                p.fetch.predicted_us,
                p.fetch.measured_us,
                p.fetch.error_pct,
                p.choice.name(),
                p.fastest.name()
            )?;
        }
        let s = &self.summary;
        let verdict = |ok: bool| if ok { "met" } else { "MISSED" };
        writeln!(
            f,
            "median |error|: route {:.1}%, fetch {:.1}% (target <= {TARGET_ERROR_PCT}%: {}, {})",
            s.route_median_abs_error_pct,
            s.fetch_median_abs_error_pct,
            verdict(s.route_median_abs_error_pct <= TARGET_ERROR_PCT),
            verdict(s.fetch_median_abs_error_pct <= TARGET_ERROR_PCT)
        )?;
        writeln!(
            f,
            "  from the start-up calibration alone (before any traffic): route {:.1}%, fetch {:.1}%, choice right at {}/{} decisive points",
            s.cold_median_abs_error_pct.0,
            s.cold_median_abs_error_pct.1,
            s.cold_decisive_correct,
            s.decisive_points
        )?;
        writeln!(
            f,
            "choice = measured fastest at {}/{} decisive points ({:.0}%, target >= {:.0}%: {}), {:.0}% of all {}",
            s.decisive_correct,
            s.decisive_points,
            100.0 * s.decisive_correct_share,
            100.0 * TARGET_CORRECT,
            verdict(s.decisive_correct_share >= TARGET_CORRECT),
            100.0 * s.correct_share,
            s.points
        )?;
        writeln!(
            f,
            "regret {:.0} us of {:.0} us ({:.2}%, target < {TARGET_REGRET_PCT}%: {})",
            s.regret_us,
            s.fastest_total_us,
            s.regret_pct,
            verdict(s.regret_pct < TARGET_REGRET_PCT)
        )?;
        writeln!(f, "note: {}", self.local)?;
        for p in &self.plots {
            writeln!(f, "wrote {}", p.display())?;
        }
        Ok(())
    }
}

fn plots(r: &VerifyReport, dir: &Path) -> Result<Vec<PathBuf>> {
    use plotters::prelude::*;

    use crate::sweep::plots::{err, finish, font, legend, log_chart, range};
    font()?;
    let mut out = Vec::new();
    // Predicted against measured, both primitives, with the y = x line.
    let path = dir.join("predicted-vs-measured.png");
    {
        let (lo, hi) = range(r.points.iter().flat_map(|p| {
            [
                p.route.predicted_us,
                p.route.measured_us,
                p.fetch.predicted_us,
                p.fetch.measured_us,
            ]
        }))?;
        let root = BitMapBackend::new(&path, (900, 860)).into_drawing_area();
        let mut chart = log_chart(
            &root,
            format!("predicted vs measured ({}, {} reps)", r.provider, r.reps),
            ((lo, hi), "measured (us, median)"),
            ((lo, hi), "predicted (us)"),
            true,
        )?;
        chart
            .draw_series(LineSeries::new([(lo, lo), (hi, hi)], BLACK.stroke_width(1)))
            .map_err(err)?
            .label("predicted = measured")
            .legend(legend(BLACK));
        for (name, color, pick) in [
            (
                "route",
                RGBColor(0, 128, 0),
                (|p: &VerifyPoint| &p.route) as fn(&VerifyPoint) -> &Measured,
            ),
            ("fetch", RGBColor(200, 30, 30), |p: &VerifyPoint| &p.fetch),
        ] {
            chart
                .draw_series(r.points.iter().map(|p| {
                    let m = pick(p);
                    Circle::new((m.measured_us, m.predicted_us), 5, color.filled())
                }))
                .map_err(err)?
                .label(name)
                .legend(legend(color));
        }
        finish(&mut chart, &root, SeriesLabelPosition::UpperLeft)?;
    }
    out.push(path);
    // The decision map: (Mq, ct), coloured by the choice, wrong decisive choices crossed.
    let path = dir.join("decision-map.png");
    {
        let root = BitMapBackend::new(&path, (1000, 760)).into_drawing_area();
        let mut chart = log_chart(
            &root,
            format!(
                "decision map ({}): colour = choice, X = not the measured fastest",
                r.provider
            ),
            (
                range(r.points.iter().map(|p| f64::from(p.mq)))?,
                "Mq (query rows)",
            ),
            (
                range(r.points.iter().map(|p| f64::from(p.ct)))?,
                "ct (chunk tokens)",
            ),
            true,
        )?;
        for (name, prim, color) in [
            ("route chosen", Primitive::Route, RGBColor(0, 128, 0)),
            ("fetch chosen", Primitive::Fetch, RGBColor(200, 30, 30)),
        ] {
            chart
                .draw_series(
                    r.points.iter().filter(|p| p.choice == prim).map(|p| {
                        Circle::new((f64::from(p.mq), f64::from(p.ct)), 12, color.filled())
                    }),
                )
                .map_err(err)?
                .label(name)
                .legend(legend(color));
        }
        chart
            .draw_series(r.points.iter().filter(|p| p.choice != p.fastest).map(|p| {
                Cross::new(
                    (f64::from(p.mq), f64::from(p.ct)),
                    14,
                    BLACK.stroke_width(3),
                )
            }))
            .map_err(err)?
            .label("not the measured fastest")
            .legend(legend(BLACK));
        finish(&mut chart, &root, SeriesLabelPosition::UpperRight)?;
    }
    out.push(path);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(predicted_us: f64, measured: f64) -> Measured {
        Measured::new(predicted_us, vec![measured * 1.1, measured, measured * 0.9])
    }

    #[test]
    fn the_summary_counts_decisive_points_and_regret() {
        let points = vec![
            // Right and decisive.
            point(
                16,
                512,
                0,
                Primitive::Route,
                (m(100.0, 110.0), m(1000.0, 900.0)),
            ),
            // Wrong and decisive: 300 us lost.
            point(
                1024,
                512,
                1,
                Primitive::Route,
                (m(500.0, 1200.0), m(1000.0, 900.0)),
            ),
            // Wrong but within 20%: 50 us lost, not decisive.
            point(
                256,
                512,
                0,
                Primitive::Fetch,
                (m(900.0, 850.0), m(800.0, 900.0)),
            ),
        ];
        assert_eq!(points[1].regret_us, 300.0);
        assert!(!points[2].decisive);
        let s = summarise(&points);
        assert_eq!((s.decisive_points, s.decisive_correct), (2, 1));
        assert_eq!(s.decisive_correct_share, 0.5);
        assert_eq!(s.regret_us, 350.0);
        assert_eq!(s.fastest_total_us, 110.0 + 900.0 + 850.0);
        assert!(!s.targets_met);
        // Route errors: -9.1%, -58.3%, +5.9%: the median absolute is 9.1%.
        assert!((s.route_median_abs_error_pct - 100.0 * 10.0 / 110.0).abs() < 1e-9);
    }

    #[test]
    fn medians_apart_with_overlapping_samples_are_not_decisive() {
        let samples = |v: &[f64]| Measured::new(1.0, v.to_vec());
        // A loaded machine's samples: medians 10.7 and 8.0 ms (34% apart), every quartile
        // overlapping.
        let route = samples(&[6407.0, 11015.0, 10717.0, 10700.0, 5072.0]);
        let fetch = samples(&[6494.0, 5194.0, 9145.0, 7995.0, 8024.0]);
        assert_eq!(
            (route.quartiles(), fetch.quartiles()),
            ((6407.0, 10717.0), (6494.0, 8024.0))
        );
        let p = point(16, 256, 0, Primitive::Route, (route, fetch));
        assert_eq!(p.fastest, Primitive::Fetch);
        assert!(!p.decisive, "{p:?}");
        // One outlier apiece leaves the quartiles, and the point, decisive.
        let route = samples(&[589.0, 653.0, 3946.0, 541.0, 659.0]);
        let fetch = samples(&[1401.0, 1406.0, 4025.0, 1476.0, 1480.0]);
        let p = point(16, 256, 0, Primitive::Route, (route, fetch));
        assert!(p.decisive && p.fastest == Primitive::Route, "{p:?}");
        assert!(samples(&[]).quartiles().0.is_nan());
        assert_eq!(samples(&[3.0, 1.0, 2.0]).quartiles(), (1.0, 3.0));
        assert_eq!(samples(&[7.0]).quartiles(), (7.0, 7.0));
    }
}
