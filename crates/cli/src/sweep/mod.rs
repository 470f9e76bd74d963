//! `kvroute sweep`: route and fetch measured between processes on one provider, fitted to the
//! cost model of paper 000 section 4, plotted like its figures 2b / 6b (route round trip
//! against Mq with the model line, fetch and local as reference lines) and 3b (the wire-byte
//! winner map over (Mq, ct)).
//!
//! Four measurements, each with its baseline from the same run:
//! - **route** over Mq (one layer of a `route_ct`-token chunk): per sample a *ping* first (the
//!   transport's raw write round trip for the same request and reply bytes, through the same
//!   engines, slot, reply region and serving thread, no parsing and no kernel), then the
//!   route round trip (submit to decoded partial), then the holder's own account of the
//!   kernel and serving time for that request. Host overhead = route - ping - kernel.
//!   Repetitions interleave the Mq points (one sample of each per repetition), so a slow
//!   spell of this shared machine spreads over every point's repetitions.
//! - **fetch** over ct (every layer, written into the requester's pool pages, then the in-place
//!   delta-rotation splice to new positions).
//! - **holder capacity**: N requesters (one shared engine, a thread each) route a decode
//!   token's rows at once; the holder's kernel time per call against N, beside one in-process
//!   kernel call over the same N x rows (paper 000 section 6.3's flat-then-linear question).
//! - **local** has no model weights here: its cost is the cost model's `ct x L x c` term with
//!   the paper's c = 1 us per token-layer, a model line, never a measurement.
//!
//! The fit is the paper's affine model `T = T_probe + Mq (q + p) / BW` (section 4.3) over the
//! route round trip minus the holder's kernel time (the model prices compute separately),
//! fitted to one point per Mq (the median of its repetitions: the paper's figure 2b has one
//! measured point per Mq), with MAPE over the amortised regime (Mq >= 512) and over every
//! point, and the same line's MAPE over every repetition, which adds this machine's noise.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use indicatif::{ProgressBar, ProgressStyle};
use kvroute_costmodel::crossover::byte_crossover_rows;
use kvroute_costmodel::fit::{
    Mape, RoundTripSample, TransferSample, Weighting, fit_round_trips, fit_transfers,
};
use kvroute_costmodel::{CostModel, CostParams, Fabric, Request, model_preset};
use kvroute_kernels::layout::{PARTIAL_ROW_BYTES, QUERY_ROW_BYTES};
use kvroute_kernels::{Backend, Queries, partial_dense};
use kvroute_kvstore::corpus::queries;
use kvroute_kvstore::{ChunkId, CorpusSpec, FullBlock};
use kvroute_transport::ProviderChoice;
use serde::Serialize;

use crate::args::SweepArgs;
use crate::demo::{
    BF16_TOL, HolderProcess, SCALE, fabric_engine_with, provider_for, spawn_holder, v2_lite_corpus,
};
use kvroute_remote::measure::{
    ConcurrencyPoint, ConcurrencySample, CopyFloor, FetchPoint, FetchSample, RoutePoint,
    RoutePointState, RouteSample, concurrent_rounds, interleaved, median, route_sample,
};
use kvroute_remote::probe::round_trips;
use kvroute_remote::{
    Call, PING_HEADER, Pong, Requester, RequesterConfig, reply_len, route_request_len,
};

/// Routed bytes per query row: q + p (paper 000 section 3.2: 1152 + 1032).
const ROW_BYTES: u64 = (QUERY_ROW_BYTES + PARTIAL_ROW_BYTES) as u64;

/// The decode point (Mq = 256, ct = route_ct) as measured and modelled.
#[derive(Debug, Clone, Serialize)]
pub struct DecodePoint {
    /// Query rows.
    pub mq: u32,
    /// Chunk tokens.
    pub ct: u32,
    /// Measured route round trip (kernel included).
    pub route_us: Option<f64>,
    /// Measured fetch, transfer plus splice.
    pub fetch_us: Option<f64>,
    /// Local: the cost model's `ct x L x c` (c = 1 us per token-layer), not measured.
    pub local_model_us: f64,
    /// Fraction of wire bytes route saves against pulling one layer (paper: 76%).
    pub route_bytes_saved: f64,
}

/// Everything `kvroute sweep` measured.
#[derive(Debug, Clone, Serialize)]
pub struct SweepReport {
    /// The libfabric provider.
    pub provider: String,
    /// Who progressed the engines.
    pub progress: String,
    /// Chunk tokens of the route sweep.
    pub route_ct: u32,
    /// Per Mq.
    pub route: Vec<RoutePoint>,
    /// Every route sample.
    pub route_samples: Vec<RouteSample>,
    /// The paper's affine model fitted to route minus kernel.
    pub fit: Option<SweepFit>,
    /// Why [`SweepReport::fit`] is missing, when it is.
    pub fit_error: Option<String>,
    /// The same model fitted to the raw write round trips.
    pub raw_fit: Option<SweepFit>,
    /// Worst `max |o - o_local|` of the routed partials against the same kernel run here.
    pub route_max_abs: f32,
    /// Per ct.
    pub fetch: Vec<FetchPoint>,
    /// Every fetch sample.
    pub fetch_samples: Vec<FetchSample>,
    /// `time = fixed + bytes / BW` over the fetch transfers: (fixed us, GB/s).
    pub fetch_fit: Option<(f64, f64)>,
    /// Per N.
    pub concurrency: Vec<ConcurrencyPoint>,
    /// Every concurrency round.
    pub concurrency_samples: Vec<ConcurrencySample>,
    /// Route vs fetch vs local at the decode point.
    pub decode: DecodePoint,
    /// The PNGs written.
    pub plots: Vec<PathBuf>,
    /// The raw report, as JSON.
    pub json: PathBuf,
}

/// The paper's affine model fitted to a route sweep: to one point per Mq (the median of its
/// repetitions), scored on those points and on every repetition.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SweepFit {
    /// Fixed cost, microseconds.
    pub probe_us: f64,
    /// Bandwidth, GB/s.
    pub bw_gbps: f64,
    /// MAPE over the per-Mq medians the line was fitted to.
    pub mape: Mape,
    /// MAPE of the same line over every repetition (the run's noise included).
    pub sample_mape: Mape,
}

impl SweepFit {
    /// The model's round trip at `mq` rows, microseconds.
    pub fn model_us(&self, mq: f64) -> f64 {
        self.probe_us + mq * ROW_BYTES as f64 / (self.bw_gbps * 1e3)
    }
}

/// Fits `T = T_probe + Mq (q + p) / BW` to `medians` (one point per Mq) and scores it on
/// those and on `every` repetition; `Err` says why there is no fit.
fn fit_medians(
    medians: &[RoundTripSample],
    every: &[RoundTripSample],
) -> std::result::Result<SweepFit, String> {
    if medians.len() < 2 {
        return Err("fewer than two distinct Mq".to_owned());
    }
    let fit =
        fit_round_trips(medians, ROW_BYTES, Weighting::Relative).map_err(|e| e.to_string())?;
    let sample_mape = fit.score(ROW_BYTES, every).map_err(|e| e.to_string())?;
    Ok(SweepFit {
        probe_us: fit.probe_us,
        bw_gbps: fit.bw_gbps,
        mape: fit.mape,
        sample_mape,
    })
}

fn corpus(tokens: u32, seed: u64) -> Result<CorpusSpec> {
    v2_lite_corpus(tokens, 1, seed)
}

/// What one holder process and the requester talking to it are for.
struct Setup {
    holder: HolderProcess,
    requester: Requester,
}

fn setup(
    args: &SweepArgs,
    provider: &ProviderChoice,
    spec: &CorpusSpec,
    slot_bytes: usize,
    requesters: usize,
    pool_pages: u32,
) -> Result<Setup> {
    let holder = spawn_holder(
        spec,
        provider,
        &[0],
        &[
            "--progress".into(),
            args.progress.to_string(),
            "--max-requesters".into(),
            requesters.to_string(),
            "--slot-bytes".into(),
            slot_bytes.to_string(),
        ],
    )?;
    let (engine, _) = fabric_engine_with(provider, args.progress)?;
    let requester = Requester::connect(engine, &[holder.addr], config(slot_bytes, pool_pages))?;
    Ok(Setup { holder, requester })
}

fn config(link_bytes: usize, pool_pages: u32) -> RequesterConfig {
    let mut c = RequesterConfig::new(SCALE);
    c.link_bytes = link_bytes;
    c.pool_pages = pool_pages.max(1);
    c.timeout = Duration::from_secs(30);
    // A measurement: poll for the whole wait, never sleep.
    c.spin = c.timeout;
    c
}

fn bar(args: &SweepArgs, len: u64) -> ProgressBar {
    if args.quiet {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    if let Ok(style) = ProgressStyle::with_template("{prefix:>8} [{bar:40}] {pos}/{len} {msg}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// `kvroute sweep`.
pub(crate) fn run(args: &SweepArgs) -> Result<SweepReport> {
    ensure!(args.reps >= 1, "--reps must be at least 1");
    ensure!(
        args.mq.iter().all(|&m| (1..=1 << 16).contains(&m)),
        "--mq values are 1 to 65536"
    );
    ensure!(
        args.ct
            .iter()
            .chain([&args.route_ct])
            .all(|&c| (1..=1 << 14).contains(&c)),
        "--ct and --route-ct values are 1 to 16384"
    );
    ensure!(
        args.concurrency.iter().all(|&n| (1..=1024).contains(&n)),
        "--concurrency values are 1 to 1024"
    );
    ensure!(
        (1..=4096).contains(&args.concurrency_mq),
        "--concurrency-mq is 1 to 4096"
    );
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let provider = provider_for(&args.provider)?;
    let bar = bar(
        args,
        (args.mq.len() + args.ct.len() + args.concurrency.len()) as u64 * u64::from(args.reps),
    );

    bar.set_prefix("route");
    let (route_samples, route_max_abs) = route_sweep(args, &provider, &bar)?;
    bar.set_prefix("fetch");
    let fetch_samples = fetch_sweep(args, &provider, &bar)?;
    bar.set_prefix("capacity");
    let (concurrency_samples, kernel_alone) = concurrency_sweep(args, &provider, &bar)?;
    bar.finish_and_clear();

    let mut route = Vec::new();
    for &mq in &args.mq {
        route.push(RoutePoint::of(mq, &route_samples));
    }
    // Fits: route minus kernel (the model's transport), and the raw pings; each to one point
    // per Mq (the median of its repetitions, as paper 000's figure 2b has one point per Mq),
    // then scored against every repetition too.
    let (fit, fit_error) = match fit_medians(
        &round_trips(&route, |p| p.mq, |p| p.transport_us),
        &round_trips(&route_samples, |s| s.mq, |s| s.route_us - s.kernel_us),
    ) {
        Ok(fit) => (Some(fit), None),
        Err(e) => (None, Some(e)),
    };
    let raw_fit = fit_medians(
        &round_trips(&route, |p| p.mq, |p| p.raw_us),
        &round_trips(&route_samples, |s| s.mq, |s| s.raw_us),
    )
    .ok();
    for p in &mut route {
        p.model_us = fit
            .as_ref()
            .map_or(f64::NAN, |f| f.model_us(f64::from(p.mq)));
    }

    let mut fetch = Vec::new();
    for &ct in &args.ct {
        fetch.push(FetchPoint::of(ct, &fetch_samples));
    }
    let fetch_fit = (fetch.len() >= 2)
        .then(|| {
            fit_transfers(
                &fetch_samples
                    .iter()
                    .map(|s| TransferSample {
                        bytes: s.bytes as f64,
                        time_us: s.transfer_us,
                    })
                    .collect::<Vec<_>>(),
                Weighting::Relative,
            )
        })
        .transpose()
        .ok()
        .flatten();

    let mut concurrency = Vec::new();
    for (&n, alone) in args.concurrency.iter().zip(&kernel_alone) {
        concurrency.push(ConcurrencyPoint::of(
            n,
            n * args.concurrency_mq,
            *alone,
            &concurrency_samples,
        ));
    }

    let dims = model_preset("deepseek-v2-lite")?.dims;
    let decode_mq = 256;
    let local_model_us = CostModel::new(CostParams::paper_defaults(
        dims,
        Fabric::measured(16.0, 25.0)?,
    ))?
    .local(&Request::contiguous(decode_mq, args.route_ct))?
    .total_us();
    let decode = DecodePoint {
        mq: decode_mq,
        ct: args.route_ct,
        route_us: route.iter().find(|p| p.mq == decode_mq).map(|p| p.route_us),
        fetch_us: fetch
            .iter()
            .find(|p| p.ct == args.route_ct)
            .map(|p| p.total_us),
        local_model_us,
        route_bytes_saved: 1.0 - f64::from(decode_mq) / byte_crossover_rows(&dims, args.route_ct)?,
    };

    let json = args.out.join("sweep.json");
    let mut report = SweepReport {
        provider: provider.to_string(),
        progress: args.progress.to_string(),
        route_ct: args.route_ct,
        route,
        route_samples,
        fit,
        fit_error,
        raw_fit,
        route_max_abs,
        fetch,
        fetch_samples,
        fetch_fit,
        concurrency,
        concurrency_samples,
        decode,
        plots: Vec::new(),
        json: json.clone(),
    };
    report.plots = plots::all(&report, &args.out)?;
    std::fs::write(&json, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", json.display()))?;
    Ok(report)
}

fn route_sweep(
    args: &SweepArgs,
    provider: &ProviderChoice,
    bar: &ProgressBar,
) -> Result<(Vec<RouteSample>, f32)> {
    let mut samples = Vec::new();
    let Some(&max_mq) = args.mq.iter().max() else {
        return Ok((samples, 0.0));
    };
    let spec = corpus(args.route_ct, args.seed)?;
    let slot = route_request_len(max_mq as usize)
        .max(reply_len(1, max_mq as usize))
        .next_multiple_of(1 << 20);
    bar.set_message(format!("starting a holder ({} tokens)", args.route_ct));
    let mut s = setup(args, provider, &spec, slot, 2, 1)?;
    // The holder's layer 0, here too: every routed partial is checked against it.
    let block = spec.chunk(ChunkId(0))?;
    let full = FullBlock::new(&block, spec.layout())?;
    let cache = full.layer(0)?.cache()?;
    let rope = spec.rope()?;
    let mut worst = 0f32;
    let mut floor = CopyFloor::new(max_mq as usize);
    // Warm-up: fault in the slot, the reply region and the kernel's threads.
    let warm = queries(max_mq as usize, i64::from(args.route_ct), &rope, args.seed);
    for q in [&warm[..QUERY_ROW_BYTES / 2], &warm[..]] {
        let call = Call {
            chunk: ChunkId(0),
            layer: 0,
            queries: q,
            sparse: None,
        };
        s.requester.route(&[call]).remove(0)?;
        s.requester.ping(0, PING_HEADER, 1, Pong::Staged)?;
    }
    // Every Mq's rows, its local reference, and the partials it decodes into (reused every
    // repetition, as a decode loop would; the first repetition of each Mq pays for growing
    // them).
    let mut points = args
        .mq
        .iter()
        .map(|&mq| {
            let q = queries(
                mq as usize,
                i64::from(args.route_ct),
                &rope,
                args.seed ^ u64::from(mq),
            );
            let local = partial_dense(Backend::Cpu, &Queries::new(&q)?, &cache, SCALE)?;
            Ok(RoutePointState::new(mq, q, local))
        })
        .collect::<Result<Vec<_>>>()?;
    // The copy baselines first: their cache eviction must not slow the pings and routes. One
    // ping afterwards, not counted, warms up the transport again.
    let floors: Vec<Vec<f64>> = (0..args.reps)
        .map(|_| points.iter().map(|p| floor.us(p.mq as usize)).collect())
        .collect();
    s.requester.ping(0, PING_HEADER, 1, Pong::Staged)?;
    // Repetitions interleave the Mq points, so a slow spell of this shared machine lands on a
    // few repetitions of every point instead of on every repetition of one, where a median
    // cannot remove it.
    for (rep, i) in interleaved(floors.len(), points.len()) {
        let p = &mut points[i];
        bar.set_message(format!("Mq = {}, repetition {}", p.mq, rep + 1));
        let (sample, diff) = route_sample(&mut s.requester, p, floors[rep][i])?;
        worst = worst.max(diff);
        samples.push(sample);
        bar.inc(1);
    }
    samples.sort_by_key(|x| x.mq);
    ensure!(
        worst <= BF16_TOL,
        "a routed partial differs from the local kernel by {worst} (tolerance {BF16_TOL})"
    );
    drop(s);
    Ok((samples, worst))
}

fn fetch_sweep(
    args: &SweepArgs,
    provider: &ProviderChoice,
    bar: &ProgressBar,
) -> Result<Vec<FetchSample>> {
    let mut samples = Vec::new();
    for &ct in &args.ct {
        bar.set_message(format!("starting a holder ({ct} tokens)"));
        let spec = corpus(ct, args.seed)?;
        let layout = spec.layout();
        let mut s = setup(args, provider, &spec, 1 << 20, 2, layout.pages() as u32)?;
        let rope = spec.rope()?;
        // The requester's positions: the chunk re-homed 4096 positions later (a real splice).
        let to: Vec<i64> = spec
            .positions(ChunkId(0))
            .iter()
            .map(|p| p + 4096)
            .collect();
        bar.set_message(format!("ct = {ct}"));
        for _ in 0..args.reps {
            let fetched = s.requester.fetch(ChunkId(0), &to, rope, Backend::Cpu)?;
            samples.push(FetchSample {
                ct,
                bytes: u64::from(ct) * u64::from(spec.layers) * QUERY_ROW_BYTES as u64,
                transfer_us: fetched.transfer_us,
                splice_us: fetched.splice_us,
            });
            s.requester.release(fetched)?;
            bar.inc(1);
        }
        drop(s.requester);
        drop(s.holder);
    }
    Ok(samples)
}

/// N requesters on one shared engine, a thread each, route `concurrency_mq` rows of layer 0 at
/// the same moment (a barrier), `reps` rounds per N; the holder's counters are read between
/// rounds over an extra control session.
fn concurrency_sweep(
    args: &SweepArgs,
    provider: &ProviderChoice,
    bar: &ProgressBar,
) -> Result<(Vec<ConcurrencySample>, Vec<f64>)> {
    let mut samples = Vec::new();
    let mut alone = Vec::new();
    let Some(&max_n) = args.concurrency.iter().max() else {
        return Ok((samples, alone));
    };
    let spec = corpus(args.route_ct, args.seed)?;
    let rows = args.concurrency_mq as usize;
    let link = route_request_len(rows)
        .max(reply_len(1, rows))
        .next_multiple_of(64 << 10);
    bar.set_message("starting a holder");
    // One session more than requesters: the control session that reads the counters.
    let mut control = setup(args, provider, &spec, link, max_n as usize + 1, 1)?;
    let engine = control.requester.engine().clone();
    let addr = control.holder.addr;
    let mut requesters = (0..max_n)
        .map(|_| Requester::connect(engine.clone(), &[addr], config(link, 1)))
        .collect::<Result<Vec<_>, _>>()?;
    let rope = spec.rope()?;
    let block = spec.chunk(ChunkId(0))?;
    let full = FullBlock::new(&block, spec.layout())?;
    let cache = full.layer(0)?.cache()?;
    let per_token: Vec<Vec<u16>> = (0..max_n)
        .map(|i| {
            queries(
                rows,
                i64::from(args.route_ct),
                &rope,
                args.seed + u64::from(i),
            )
        })
        .collect();
    for &n in &args.concurrency {
        bar.set_message(format!("N = {n}"));
        // The same rows in one in-process call: what the holder would spend if every request
        // of a round arrived in one batch.
        let all: Vec<u16> = per_token[..n as usize].concat();
        let mut times = Vec::new();
        for _ in 0..args.reps {
            let started = Instant::now();
            partial_dense(Backend::Cpu, &Queries::new(&all)?, &cache, SCALE)?;
            times.push(started.elapsed().as_secs_f64() * 1e6);
        }
        alone.push(median(&times));
        let mut tick = || bar.inc(1);
        let rounds = concurrent_rounds(
            &mut control.requester,
            &mut requesters[..n as usize],
            &per_token[..n as usize],
            args.reps,
            &mut tick,
        )?;
        samples.extend(rounds);
    }
    drop(requesters);
    Ok((samples, alone))
}

pub(crate) mod plots;
mod report;

#[cfg(test)]
mod tests {
    use super::*;

    /// The line goes through the medians, not the repetitions: a sweep whose repetitions
    /// scatter +-20% around a line gets that line back, MAPE 0 on its medians and about 14%
    /// on the repetitions; one Mq gives no fit, with the reason.
    #[test]
    fn the_fit_is_to_the_medians_and_scored_on_both() {
        let line = |mq: u32| 20.0 + f64::from(mq) * ROW_BYTES as f64 / 4e3;
        let mqs = [1u32, 64, 512, 1024, 2048, 4096];
        let medians = round_trips(&mqs, |&m| m, |&m| line(m));
        let every: Vec<RoundTripSample> = mqs
            .iter()
            .flat_map(|&m| [0.8, 1.0, 1.2].map(|k| (m, k * line(m))))
            .map(|(m, us)| RoundTripSample {
                mq_rows: m,
                round_trip_us: us,
            })
            .collect();
        let fit = fit_medians(&medians, &every).expect("a fit");
        assert!((fit.probe_us - 20.0).abs() < 1e-6, "{fit:?}");
        assert!((fit.bw_gbps - 4.0).abs() < 1e-9, "{fit:?}");
        assert!(fit.mape.amortised_pct.expect("amortised points") < 1e-6);
        assert_eq!(fit.mape.amortised_samples, 4);
        let scattered = fit.sample_mape.amortised_pct.expect("amortised samples");
        // |model - y| / y at y = 0.8, 1.0, 1.2 times the line: 25%, 0, 16.7%.
        assert!(
            (scattered - (25.0 + 50.0 / 3.0) / 3.0).abs() < 1e-6,
            "{scattered}"
        );
        assert_eq!(fit.sample_mape.samples, 18);
        let one = fit_medians(&medians[..1], &every).expect_err("one Mq");
        assert!(one.contains("Mq"), "{one}");
    }
}
