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
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, ensure};
use indicatif::{ProgressBar, ProgressStyle};
use kvroute_costmodel::crossover::byte_crossover_rows;
use kvroute_costmodel::fit::{
    Mape, RoundTripSample, TransferSample, Weighting, fit_round_trips, fit_transfers,
};
use kvroute_costmodel::{CostModel, CostParams, Fabric, Request, model_preset};
use kvroute_kernels::layout::{PARTIAL_ROW_BYTES, QUERY_ROW_BYTES};
use kvroute_kernels::{Backend, Partial, Queries, partial_dense};
use kvroute_kvstore::corpus::queries;
use kvroute_kvstore::{ChunkId, CorpusSpec, FullBlock};
use kvroute_transport::ProviderChoice;
use serde::Serialize;

use crate::args::SweepArgs;
use crate::demo::{
    BF16_TOL, HolderProcess, SCALE, fabric_engine_with, provider_for, spawn_holder,
    v2_lite_corpus,
};
use kvroute_remote::measure::{
    CopyFloor, RoutePointState, RouteSample, interleaved, route_sample,
};
use kvroute_remote::probe::round_trips;
use kvroute_remote::{Call, Requester, RequesterConfig, wire};

/// Routed bytes per query row: q + p (paper 000 section 3.2: 1152 + 1032).
const ROW_BYTES: u64 = (QUERY_ROW_BYTES + PARTIAL_ROW_BYTES) as u64;

/// Medians of one Mq point.
#[derive(Debug, Clone, Serialize)]
pub struct RoutePoint {
    /// Query rows.
    pub mq: u32,
    /// Route round trip.
    pub route_us: f64,
    /// Raw write round trip of the same bytes.
    pub raw_us: f64,
    /// Holder kernel.
    pub kernel_us: f64,
    /// Route minus kernel: what the fabric model prices.
    pub transport_us: f64,
    /// Route - raw - kernel (median of the per-sample differences).
    pub overhead_us: f64,
    /// Of it, the holder's part: serve - kernel.
    pub holder_overhead_us: f64,
    /// Of it, byte conversions on both sides (see [`RouteSample`]).
    pub codec_us: f64,
    /// Overhead minus byte conversions: bookkeeping, posting, polling, wake-ups.
    pub rest_us: f64,
    /// A cold `memcpy` of the conversions' bytes (their floor on this machine, this run).
    pub copy_floor_us: f64,
    /// The zero-copy route ([`RouteSample::zero_copy_us`]).
    pub zero_copy_us: f64,
    /// Raw round trip with a freshly written pong ([`RouteSample::written_raw_us`]).
    pub written_raw_us: f64,
    /// `zero_copy_us - written_raw_us -` its kernel: the host overhead against a baseline
    /// whose reply bytes are as fresh as the route's.
    pub zero_copy_written_overhead_us: f64,
    /// Its host overhead: zero-copy route - raw - its kernel (median of per-sample values).
    pub zero_copy_overhead_us: f64,
    /// The merge of its partial from wire rows ([`RouteSample::merge_us`]).
    pub merge_us: f64,
    /// The fitted model at this Mq.
    pub model_us: f64,
}

/// One fetch sample.
#[derive(Debug, Clone, Serialize)]
pub struct FetchSample {
    /// Chunk tokens.
    pub ct: u32,
    /// Bytes pulled (every layer).
    pub bytes: u64,
    /// Submit to the last page landed, microseconds.
    pub transfer_us: f64,
    /// The in-place splice, microseconds.
    pub splice_us: f64,
}

/// Medians of one ct point.
#[derive(Debug, Clone, Serialize)]
pub struct FetchPoint {
    /// Chunk tokens.
    pub ct: u32,
    /// Bytes pulled.
    pub bytes: u64,
    /// Transfer.
    pub transfer_us: f64,
    /// Splice.
    pub splice_us: f64,
    /// Transfer plus splice (median of sums).
    pub total_us: f64,
    /// Bytes per transfer time, GB/s.
    pub gbps: f64,
}

/// One round of N concurrent requesters.
#[derive(Debug, Clone, Serialize)]
pub struct ConcurrencySample {
    /// Requesters.
    pub n: u32,
    /// Each requester's round trip, microseconds.
    pub route_us: Vec<f64>,
    /// Kernel calls the holder made for the round.
    pub kernel_calls: u64,
    /// Its kernel time for the round, microseconds.
    pub kernel_us: f64,
    /// Rows it attended.
    pub rows: u64,
}

/// Medians of one N.
#[derive(Debug, Clone, Serialize)]
pub struct ConcurrencyPoint {
    /// Requesters.
    pub n: u32,
    /// Rows routed per round (N x rows each).
    pub rows: u32,
    /// Holder kernel time per call.
    pub kernel_us_per_call: f64,
    /// Rows per holder kernel call (N x rows when every request of a round was batched).
    pub rows_per_call: f64,
    /// Holder kernel time per round.
    pub kernel_us_per_round: f64,
    /// One in-process kernel call over all N x rows rows (no transport), the same run.
    pub kernel_alone_us: f64,
    /// Median requester round trip.
    pub route_us: f64,
}

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

fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return f64::NAN;
    }
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
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
    let requester = Requester::connect(engine, &[holder.addr], config(slot_bytes, pool_pages, 0))?;
    Ok(Setup { holder, requester })
}

fn config(link_bytes: usize, pool_pages: u32, tag: u16) -> RequesterConfig {
    let mut c = RequesterConfig::new(SCALE);
    c.link_bytes = link_bytes;
    c.pool_pages = pool_pages.max(1);
    c.tag = tag;
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
            .all(|&c| (1..=1 << 17).contains(&c)),
        "--ct and --route-ct values are 1 to 131072"
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
        let s: Vec<&RouteSample> = route_samples.iter().filter(|s| s.mq == mq).collect();
        let pick =
            |f: &dyn Fn(&RouteSample) -> f64| median(&s.iter().map(|x| f(x)).collect::<Vec<_>>());
        route.push(RoutePoint {
            mq,
            route_us: pick(&|x| x.route_us),
            raw_us: pick(&|x| x.raw_us),
            kernel_us: pick(&|x| x.kernel_us),
            transport_us: pick(&|x| x.route_us - x.kernel_us),
            overhead_us: pick(&|x| x.route_us - x.raw_us - x.kernel_us),
            holder_overhead_us: pick(&|x| x.serve_us - x.kernel_us),
            codec_us: pick(&|x| x.codec_us()),
            rest_us: pick(&|x| x.route_us - x.raw_us - x.kernel_us - x.codec_us()),
            copy_floor_us: pick(&|x| x.copy_floor_us),
            zero_copy_us: pick(&|x| x.zero_copy_us),
            zero_copy_overhead_us: pick(&|x| x.zero_copy_us - x.raw_us - x.zero_copy_kernel_us),
            written_raw_us: pick(&|x| x.written_raw_us),
            zero_copy_written_overhead_us: pick(&|x| {
                x.zero_copy_us - x.written_raw_us - x.zero_copy_kernel_us
            }),
            merge_us: pick(&|x| x.merge_us),
            model_us: f64::NAN,
        });
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
        let s: Vec<&FetchSample> = fetch_samples.iter().filter(|s| s.ct == ct).collect();
        let transfer = median(&s.iter().map(|x| x.transfer_us).collect::<Vec<_>>());
        let bytes = s.first().map_or(0, |x| x.bytes);
        fetch.push(FetchPoint {
            ct,
            bytes,
            transfer_us: transfer,
            splice_us: median(&s.iter().map(|x| x.splice_us).collect::<Vec<_>>()),
            total_us: median(
                &s.iter()
                    .map(|x| x.transfer_us + x.splice_us)
                    .collect::<Vec<_>>(),
            ),
            gbps: bytes as f64 / (transfer * 1e3),
        });
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
        let s: Vec<&ConcurrencySample> = concurrency_samples.iter().filter(|s| s.n == n).collect();
        concurrency.push(ConcurrencyPoint {
            n,
            rows: n * args.concurrency_mq,
            kernel_us_per_call: median(
                &s.iter()
                    .map(|x| x.kernel_us / x.kernel_calls.max(1) as f64)
                    .collect::<Vec<_>>(),
            ),
            rows_per_call: median(
                &s.iter()
                    .map(|x| x.rows as f64 / x.kernel_calls.max(1) as f64)
                    .collect::<Vec<_>>(),
            ),
            kernel_us_per_round: median(&s.iter().map(|x| x.kernel_us).collect::<Vec<_>>()),
            kernel_alone_us: *alone,
            route_us: median(
                &s.iter()
                    .flat_map(|x| x.route_us.clone())
                    .collect::<Vec<_>>(),
            ),
        });
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
    let slot = (wire::REQUEST_HEADER + wire::SEGMENT_BYTES + max_mq as usize * QUERY_ROW_BYTES)
        .max(wire::reply_len(1, max_mq as usize))
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
        s.requester
            .ping(0, wire::PING_HEADER, 1, wire::Pong::Staged)?;
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
    s.requester
        .ping(0, wire::PING_HEADER, 1, wire::Pong::Staged)?;
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
    let link = (wire::REQUEST_HEADER + wire::SEGMENT_BYTES + rows * QUERY_ROW_BYTES)
        .max(wire::reply_len(1, rows))
        .next_multiple_of(64 << 10);
    bar.set_message("starting a holder");
    // One session more than requesters: the control session that reads the counters.
    let mut control = setup(args, provider, &spec, link, max_n as usize + 1, 1)?;
    let engine = control.requester.engine().clone();
    let addr = control.holder.addr;
    let mut requesters = (0..max_n)
        .map(|i| Requester::connect(engine.clone(), &[addr], config(link, 1, i as u16 + 1)))
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
        let barrier = Arc::new(Barrier::new(n as usize + 1));
        let rounds: Result<Vec<ConcurrencySample>> = std::thread::scope(|scope| {
            let handles: Vec<_> = requesters[..n as usize]
                .iter_mut()
                .zip(&per_token)
                .map(|(r, q)| {
                    let barrier = barrier.clone();
                    scope.spawn(move || -> Result<Vec<f64>> {
                        let mut times = Vec::new();
                        let mut part = [Partial::empty(0)];
                        for _ in 0..args.reps {
                            barrier.wait();
                            let started = Instant::now();
                            let call = Call {
                                chunk: ChunkId(0),
                                layer: 0,
                                queries: q,
                                sparse: None,
                            };
                            let got = r.route_into(&[call], &mut part).remove(0);
                            times.push(started.elapsed().as_secs_f64() * 1e6);
                            barrier.wait();
                            got?;
                        }
                        Ok(times)
                    })
                })
                .collect();
            let mut rounds = Vec::new();
            let mut failed = None;
            for _ in 0..args.reps {
                let before = control.requester.holder_stats(0);
                barrier.wait();
                barrier.wait();
                // Every requester has its reply; the holder may not have counted the last
                // batch yet.
                let counted = before.as_ref().map_or(0, |b| b.requests + u64::from(n));
                let after = control.requester.holder_stats_counting(0, counted);
                match (before, after) {
                    (Ok(b), Ok(a)) => rounds.push(ConcurrencySample {
                        n,
                        route_us: Vec::new(),
                        kernel_calls: a.kernel_calls - b.kernel_calls,
                        kernel_us: a.kernel_us - b.kernel_us,
                        rows: a.rows - b.rows,
                    }),
                    (Err(e), _) | (_, Err(e)) => failed = Some(anyhow::Error::from(e)),
                }
                bar.inc(1);
            }
            for (i, h) in handles.into_iter().enumerate() {
                let times = h
                    .join()
                    .map_err(|_| anyhow!("requester thread {i} panicked"))??;
                for (round, t) in rounds.iter_mut().zip(times) {
                    round.route_us.push(t);
                }
            }
            match failed {
                Some(e) => Err(e),
                None => Ok(rounds),
            }
        });
        samples.extend(rounds?);
    }
    drop(requesters);
    Ok((samples, alone))
}


mod plots;
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
