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

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use indicatif::{ProgressBar, ProgressStyle};
use kvroute_costmodel::crossover::byte_crossover_rows;
use kvroute_costmodel::fit::{
    Mape, RoundTripSample, TransferSample, Weighting, fit_round_trips, fit_transfers,
};
use kvroute_costmodel::{CostModel, CostParams, Fabric, Request, model_preset};
use kvroute_kernels::layout::{D_LATENT, D_QK, PARTIAL_ROW_BYTES, QUERY_ROW_BYTES};
use kvroute_kernels::{Backend, Partial, Queries, merge_wire, partial_dense};
use kvroute_kvstore::corpus::queries;
use kvroute_kvstore::{ChunkId, CorpusSpec, FullBlock};
use kvroute_transport::ProviderChoice;
use serde::Serialize;

use crate::args::SweepArgs;
use crate::demo::{
    BF16_TOL, HolderProcess, SCALE, fabric_engine_with, max_abs, provider_for, spawn_holder,
    v2_lite_corpus,
};
use kvroute_remote::probe::round_trips;
use kvroute_remote::{Call, Requester, RequesterConfig, StagedCall, wire};

/// Routed bytes per query row: q + p (paper 000 section 3.2: 1152 + 1032).
const ROW_BYTES: u64 = (QUERY_ROW_BYTES + PARTIAL_ROW_BYTES) as u64;

/// One route sample.
#[derive(Debug, Clone, Serialize)]
pub struct RouteSample {
    /// Query rows.
    pub mq: u32,
    /// Request bytes (one write).
    pub request_bytes: usize,
    /// Reply bytes (one write).
    pub reply_bytes: usize,
    /// Raw write round trip of the same bytes, microseconds.
    pub raw_us: f64,
    /// The same raw round trip with a pong the holder has just written ([`wire::Pong::Written`],
    /// as a route's reply rows always are), the holder's writing taken out, microseconds.
    #[serde(default)]
    pub written_raw_us: f64,
    /// Route round trip, submit to decoded partial, microseconds.
    pub route_us: f64,
    /// The holder's kernel time for this request, microseconds.
    pub kernel_us: f64,
    /// The holder's time serving this request (parse, kernel, encode, post), microseconds.
    pub serve_us: f64,
    /// Of `serve_us`, encoding the partial rows to bf16, microseconds.
    pub holder_encode_us: f64,
    /// The requester's copy of the query rows into the request, microseconds.
    pub requester_encode_us: f64,
    /// The requester's decode and validation of the reply rows, microseconds.
    pub requester_decode_us: f64,
    /// Baseline for the three conversions, this run: one `memcpy` that reads and writes as
    /// many bytes as they do together ([`CODEC_BYTES_PER_ROW`] per row), from caches evicted
    /// as the holder's kernel evicts them, microseconds.
    pub copy_floor_us: f64,
    /// The same route with no byte conversion on the requester, right after it in the same
    /// rep: staging the request ([`Requester::stage`]), sending it and checking the reply in
    /// place ([`crate::route::StagedRoute::route_wire`], `m` and `l` of every row), microseconds. Excludes
    /// the producer writing the query rows into staging (`producer_us`).
    pub zero_copy_us: f64,
    /// The holder's kernel time for that request, microseconds.
    pub zero_copy_kernel_us: f64,
    /// The producer's write of the query rows into registered staging (here a `memcpy` from
    /// the sweep's rows; in a model, the query projection's output), microseconds.
    pub producer_us: f64,
    /// Merging that one partial from its wire rows into f32 ([`merge_wire`], for one part an
    /// exact decode: the cost model's merge term), microseconds.
    pub merge_us: f64,
}

/// Bytes the route's byte conversions read plus write per query row: the query copy (1152 in,
/// 1152 out), the holder's bf16 encode (2048 f32 + 8 in, 1032 out) and the requester's
/// decode (1032 in, 2048 + 8 out).
pub(crate) const CODEC_BYTES_PER_ROW: usize =
    2 * QUERY_ROW_BYTES + 2 * (D_LATENT * 4 + 8 + PARTIAL_ROW_BYTES);

/// The baseline of [`RouteSample::copy_floor_us`]: a cold `memcpy` of the codec's bytes.
struct CopyFloor {
    evict: Vec<u8>,
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl CopyFloor {
    fn new(max_rows: usize) -> Self {
        let n = max_rows * CODEC_BYTES_PER_ROW / 2;
        Self {
            evict: vec![1; 64 << 20],
            src: vec![2; n],
            dst: vec![0; n],
        }
    }

    /// Reads 64 MiB (evicting the copy's buffers from every private cache), then times the
    /// copy of `rows` rows' worth of bytes.
    fn us(&mut self, rows: usize) -> f64 {
        let n = (rows * CODEC_BYTES_PER_ROW / 2).min(self.src.len());
        let sum: u64 = self.evict.iter().step_by(64).map(|&b| u64::from(b)).sum();
        std::hint::black_box(sum);
        let started = Instant::now();
        self.dst[..n].copy_from_slice(&self.src[..n]);
        std::hint::black_box(&self.dst);
        started.elapsed().as_secs_f64() * 1e6
    }
}

impl RouteSample {
    /// Byte conversions (query copy, bf16 encode, decode) that a GPU deployment does in
    /// kernels: the part of the overhead that grows with the bytes.
    fn codec_us(&self) -> f64 {
        self.holder_encode_us + self.requester_encode_us + self.requester_decode_us
    }
}

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
            Ok(RoutePointState {
                mq,
                q,
                local,
                got: [Partial::empty(mq as usize)],
                merged: Partial::empty(mq as usize),
            })
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

/// The order of `reps` repetitions over `points` points, as (repetition, point): one sample
/// of every point per repetition, in alternating directions, so each point follows its
/// neighbours (or itself) and never the far end of the sweep.
fn interleaved(reps: usize, points: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..reps).flat_map(move |rep| {
        (0..points).map(move |i| (rep, if rep % 2 == 0 { i } else { points - 1 - i }))
    })
}

/// One Mq point of [`route_sweep`]: its rows, the local kernel's partial for them, and the
/// partials its routes decode and merge into.
struct RoutePointState {
    mq: u32,
    q: Vec<u16>,
    local: Partial,
    got: [Partial; 1],
    merged: Partial,
}

/// One repetition at one Mq point: the staged ping, the written ping, the copying route, then
/// the zero-copy route, each checked; with the worst difference from the local kernel.
fn route_sample(
    requester: &mut Requester,
    p: &mut RoutePointState,
    copy_floor_us: f64,
) -> Result<(RouteSample, f32)> {
    let mq = p.mq;
    let call = Call {
        chunk: ChunkId(0),
        layer: 0,
        queries: &p.q,
        sparse: None,
    };
    let request_bytes = wire::REQUEST_HEADER + wire::SEGMENT_BYTES + p.q.len() * 2;
    let reply_bytes = wire::reply_len(1, mq as usize);
    let raw = requester.ping(0, request_bytes, reply_bytes, wire::Pong::Staged)?;
    let unwritten = requester.holder_stats(0)?;
    let written = requester.ping(0, request_bytes, reply_bytes, wire::Pong::Written)?;
    let before = requester.holder_stats(0)?;
    let pong_write_us = before.pong_write_us - unwritten.pong_write_us;
    let codec = requester.codec_times();
    let started = Instant::now();
    let done = requester.route_into(&[call], &mut p.got).remove(0);
    let route_us = started.elapsed().as_secs_f64() * 1e6;
    let codec_after = requester.codec_times();
    let after = requester.holder_stats_counting(0, before.requests + 1)?;
    done?;
    let mut worst = max_abs(&p.got[0], &p.local);
    ensure!(
        after.requests == before.requests + 1,
        "the holder served {} requests for one route",
        after.requests - before.requests
    );
    let zero_copy = zero_copy_route(requester, &p.q, &mut p.merged)?;
    let after_zc = requester.holder_stats_counting(0, after.requests + 1)?;
    ensure!(
        after_zc.requests == after.requests + 1,
        "the holder served {} requests for one zero-copy route",
        after_zc.requests - after.requests
    );
    worst = worst.max(max_abs(&p.merged, &p.local));
    let sample = RouteSample {
        mq,
        request_bytes,
        reply_bytes,
        raw_us: raw.as_secs_f64() * 1e6,
        written_raw_us: written.as_secs_f64() * 1e6 - pong_write_us,
        route_us,
        kernel_us: after.kernel_us - before.kernel_us,
        serve_us: after.serve_us - before.serve_us,
        holder_encode_us: after.encode_us - before.encode_us,
        requester_encode_us: codec_after.encode_us - codec.encode_us,
        requester_decode_us: codec_after.decode_us - codec.decode_us,
        copy_floor_us,
        zero_copy_us: zero_copy.route_us,
        zero_copy_kernel_us: after_zc.kernel_us - after.kernel_us,
        producer_us: zero_copy.producer_us,
        merge_us: zero_copy.merge_us,
    };
    Ok((sample, worst))
}

/// Times of one [`zero_copy_route`].
struct ZeroCopy {
    route_us: f64,
    producer_us: f64,
    merge_us: f64,
}

/// Routes `q` to chunk 0 layer 0 with no byte conversion on the requester: the rows are
/// written into registered staging by their "producer" (timed apart, not part of the route),
/// the reply is checked where it landed, then merged from its wire rows into `merged`.
fn zero_copy_route(requester: &mut Requester, q: &[u16], merged: &mut Partial) -> Result<ZeroCopy> {
    let call = StagedCall {
        chunk: ChunkId(0),
        layer: 0,
        rows: q.len() / D_QK,
        sparse: None,
    };
    let started = Instant::now();
    let mut staged = requester.stage(&[call]);
    let stage_us = started.elapsed().as_secs_f64() * 1e6;
    let produced = Instant::now();
    staged
        .queries_mut(0)
        .context("no staging for the query rows")?
        .copy_from_slice(q);
    let producer_us = produced.elapsed().as_secs_f64() * 1e6;
    let sent = Instant::now();
    let routed = staged.route_wire();
    let part = routed.partial(0)?;
    let route_us = stage_us + sent.elapsed().as_secs_f64() * 1e6;
    let merging = Instant::now();
    merge_wire(&[part], merged)?;
    let merge_us = merging.elapsed().as_secs_f64() * 1e6;
    Ok(ZeroCopy {
        route_us,
        producer_us,
        merge_us,
    })
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

impl fmt::Display for SweepReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let us = |x: f64| {
            if x.is_finite() {
                format!("{x:.1}")
            } else {
                "-".to_owned()
            }
        };
        let pct = |m: Option<f64>| m.map_or("-".to_owned(), |m| format!("{m:.1}%"));
        writeln!(
            f,
            "kvroute sweep over {} ({} progress), one holder process and this requester",
            self.provider, self.progress
        )?;
        writeln!(
            f,
            "\nroute, one layer of a {}-token chunk (medians, us; raw = the transport's write \
             round trip for the same bytes, this run; overhead = route - raw - kernel; of it, \
             holder = the holder's serve - kernel, codec = byte conversions on both sides, \
             memcpy = a cold copy of as many bytes as codec moves, this run, rest = overhead - \
             codec; zc = the zero-copy route right after it: query rows written into staging \
             by their producer, reply checked in place, zc-ovh = zc-route - raw - its kernel, \
             raw-w = raw with a pong the holder has just written, its writing taken out, \
             zc-wovh = zc-route - raw-w - its kernel, merge = merging its wire rows into f32, \
             not in zc-route):",
            self.route_ct
        )?;
        writeln!(
            f,
            "{:>6} {:>10} {:>9} {:>10} {:>9} {:>8} {:>8} {:>8} {:>8} {:>10} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8}",
            "Mq",
            "route",
            "raw",
            "kernel",
            "overhead",
            "holder",
            "codec",
            "memcpy",
            "rest",
            "route-krn",
            "model",
            "zc-route",
            "zc-ovh",
            "raw-w",
            "zc-wovh",
            "merge"
        )?;
        for p in &self.route {
            writeln!(
                f,
                "{:>6} {:>10} {:>9} {:>10} {:>9} {:>8} {:>8} {:>8} {:>8} {:>10} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8}",
                p.mq,
                us(p.route_us),
                us(p.raw_us),
                us(p.kernel_us),
                us(p.overhead_us),
                us(p.holder_overhead_us),
                us(p.codec_us),
                us(p.copy_floor_us),
                us(p.rest_us),
                us(p.transport_us),
                us(p.model_us),
                us(p.zero_copy_us),
                us(p.zero_copy_overhead_us),
                us(p.written_raw_us),
                us(p.zero_copy_written_overhead_us),
                us(p.merge_us)
            )?;
        }
        writeln!(
            f,
            "routed partials against the local kernel: max |o| difference {:.2e} (bf16 wire)",
            self.route_max_abs
        )?;
        for (name, fit) in [("route - kernel", &self.fit), ("raw write", &self.raw_fit)] {
            match fit {
                Some(fit) => writeln!(
                    f,
                    "fit T = T_probe + Mq (q + p) / BW to {name} (medians per Mq): T_probe {:.1} \
                     us, BW {:.2} GB/s; MAPE {} amortised (Mq >= 512, {} points), {:.1}% over \
                     all {}; over every repetition: {} amortised, {:.1}% over all {}",
                    fit.probe_us,
                    fit.bw_gbps,
                    pct(fit.mape.amortised_pct),
                    fit.mape.amortised_samples,
                    fit.mape.all_pct,
                    fit.mape.samples,
                    pct(fit.sample_mape.amortised_pct),
                    fit.sample_mape.all_pct,
                    fit.sample_mape.samples
                )?,
                None => writeln!(
                    f,
                    "fit to {name}: none (fewer than two distinct Mq, or times that do not \
                     grow with Mq: see the samples)"
                )?,
            }
        }
        if !self.fetch.is_empty() {
            writeln!(
                f,
                "\nfetch, every layer into pool pages, then the in-place splice (medians):"
            )?;
            writeln!(
                f,
                "{:>6} {:>12} {:>12} {:>10} {:>12} {:>8}",
                "ct", "bytes", "transfer us", "splice us", "total us", "GB/s"
            )?;
            for p in &self.fetch {
                writeln!(
                    f,
                    "{:>6} {:>12} {:>12} {:>10} {:>12} {:>8.2}",
                    p.ct,
                    p.bytes,
                    us(p.transfer_us),
                    us(p.splice_us),
                    us(p.total_us),
                    p.gbps
                )?;
            }
            if let Some((fixed, bw)) = self.fetch_fit {
                writeln!(f, "fit: {fixed:.1} us + bytes / {bw:.2} GB/s")?;
            }
        }
        if !self.concurrency.is_empty() {
            writeln!(
                f,
                "\nholder capacity: N requesters route {} rows each at once (medians):",
                self.concurrency.first().map_or(0, |p| p.rows / p.n.max(1))
            )?;
            writeln!(
                f,
                "{:>4} {:>6} {:>14} {:>10} {:>14} {:>14} {:>10}",
                "N",
                "rows",
                "kernel/call us",
                "rows/call",
                "kernel/round",
                "one call here",
                "route us"
            )?;
            for p in &self.concurrency {
                writeln!(
                    f,
                    "{:>4} {:>6} {:>14} {:>10.1} {:>14} {:>14} {:>10}",
                    p.n,
                    p.rows,
                    us(p.kernel_us_per_call),
                    p.rows_per_call,
                    us(p.kernel_us_per_round),
                    us(p.kernel_alone_us),
                    us(p.route_us)
                )?;
            }
        }
        let d = &self.decode;
        writeln!(
            f,
            "\ndecode point Mq = {}, ct = {}: route {} us, fetch {} us (transfer + splice), \
             local {} us (cost model ct x L x c, c = 1 us: no weights here, not measured); \
             route moves {:.0}% fewer wire bytes than one layer of the chunk",
            d.mq,
            d.ct,
            d.route_us.map_or("-".to_owned(), us),
            d.fetch_us.map_or("-".to_owned(), us),
            us(d.local_model_us),
            d.route_bytes_saved * 100.0
        )?;
        for p in &self.plots {
            writeln!(f, "wrote {}", p.display())?;
        }
        writeln!(f, "raw samples: {}", self.json.display())
    }
}

/// The PNGs, drawn with plotters' bitmap backend and a TrueType font from the system.
mod plots {
    use plotters::coord::Shift;
    use plotters::prelude::*;
    use plotters::style::{FontStyle, register_font};

    use super::{
        OnceLock, Path, PathBuf, Result, SweepReport, anyhow, bail, byte_crossover_rows,
        model_preset,
    };

    /// Where the font may be (Debian's fonts-dejavu-core first, which `cargo xtask deps`
    /// installs); `KVROUTE_FONT` overrides.
    const FONTS: &[&str] = &[
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    ];

    fn font() -> Result<()> {
        static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
        LOADED
            .get_or_init(|| {
                let candidates: Vec<PathBuf> = std::env::var_os("KVROUTE_FONT")
                    .map(PathBuf::from)
                    .into_iter()
                    .chain(FONTS.iter().map(PathBuf::from))
                    .collect();
                let path = candidates.iter().find(|p| p.is_file()).ok_or_else(|| {
                    "the plots need a TrueType font: install fonts-dejavu-core \
                     (`cargo xtask deps` does) or set KVROUTE_FONT"
                        .to_owned()
                })?;
                let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
                // Registered for the life of the process, once.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                register_font("sans-serif", FontStyle::Normal, bytes)
                    .map_err(|_| format!("{} is not a usable font", path.display()))
            })
            .clone()
            .map_err(|e| anyhow!(e))
    }

    /// A plotted series: legend, colour, and the value it draws from each sample.
    type Series<T> = (&'static str, RGBColor, fn(&T) -> f64);

    fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
        anyhow!("drawing: {e:?}")
    }

    pub(super) fn all(r: &SweepReport, dir: &Path) -> Result<Vec<PathBuf>> {
        font()?;
        let mut out = Vec::new();
        if !r.route.is_empty() {
            out.push(route(r, &dir.join("route.png"))?);
        }
        if !r.fetch.is_empty() {
            out.push(fetch(r, &dir.join("fetch.png"))?);
        }
        out.push(winner(r, &dir.join("winner.png"))?);
        if !r.concurrency.is_empty() {
            out.push(capacity(r, &dir.join("capacity.png"))?);
        }
        Ok(out)
    }

    /// A log-log chart on a white `root`: the caption, ((range, description)) of each axis,
    /// and whether to draw the grid.
    fn log_chart<'a, 'b>(
        root: &'a DrawingArea<BitMapBackend<'b>, Shift>,
        caption: impl AsRef<str>,
        ((x0, x1), x_desc): ((f64, f64), &str),
        ((y0, y1), y_desc): ((f64, f64), &str),
        grid: bool,
    ) -> Result<Chart<'a, 'b>> {
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(root)
            .caption(caption.as_ref(), ("sans-serif", 24))
            .margin(18)
            .x_label_area_size(50)
            .y_label_area_size(80)
            .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
            .map_err(err)?;
        let mut mesh = chart.configure_mesh();
        if !grid {
            mesh.disable_mesh();
        }
        mesh.x_desc(x_desc)
            .y_desc(y_desc)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .draw()
            .map_err(err)?;
        Ok(chart)
    }

    /// Draws the legend at `at` and writes the PNG.
    fn finish<'a, 'b: 'a>(
        chart: &mut Chart<'a, 'b>,
        root: &DrawingArea<BitMapBackend<'b>, Shift>,
        at: SeriesLabelPosition,
    ) -> Result<()> {
        chart
            .configure_series_labels()
            .position(at)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 15))
            .draw()
            .map_err(err)?;
        root.present().map_err(err)
    }

    /// The charts here: log-scaled f64 on both axes, over a bitmap of lifetime `'b`.
    type Chart<'a, 'b> =
        ChartContext<'a, BitMapBackend<'b>, Cartesian2d<LogCoord<f64>, LogCoord<f64>>>;

    fn range(values: impl Iterator<Item = f64>) -> Result<(f64, f64)> {
        let (lo, hi) = values
            .filter(|v| v.is_finite() && *v > 0.0)
            .fold((f64::INFINITY, 0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
        if !lo.is_finite() {
            bail!("nothing to plot");
        }
        Ok((lo / 1.6, hi * 1.6))
    }

    fn legend(color: RGBColor) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
        move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
    }

    /// Figures 2b / 6b: route round trip against Mq, the fitted model, the raw write round
    /// trip, fetch (measured) and local (model) at this ct as reference lines.
    fn route(r: &SweepReport, path: &Path) -> Result<PathBuf> {
        let fetch = r.decode.fetch_us;
        let local = r.decode.local_model_us;
        let (x0, x1) = range(r.route.iter().map(|p| f64::from(p.mq)))?;
        let (y0, y1) = range(
            r.route_samples
                .iter()
                .flat_map(|s| [s.route_us, s.raw_us, s.route_us - s.kernel_us])
                .chain(fetch)
                .chain([local]),
        )?;
        let root = BitMapBackend::new(path, (1100, 720)).into_drawing_area();
        let mut chart = log_chart(
            &root,
            format!(
                "route round trip vs Mq ({}, ct = {}, one layer)",
                r.provider, r.route_ct
            ),
            ((x0, x1), "Mq (query rows)"),
            ((y0, y1), "microseconds"),
            true,
        )?;
        let series: [Series<super::RouteSample>; 3] = [
            (
                "route (measured, kernel included)",
                RGBColor(0, 128, 0),
                |s| s.route_us,
            ),
            (
                "route - holder kernel (measured)",
                RGBColor(0, 90, 200),
                |s| s.route_us - s.kernel_us,
            ),
            (
                "raw write round trip, same bytes",
                RGBColor(120, 120, 120),
                |s| s.raw_us,
            ),
        ];
        for (name, color, value) in series {
            chart
                .draw_series(
                    r.route_samples
                        .iter()
                        .map(|s| Circle::new((f64::from(s.mq), value(s)), 3, color.filled())),
                )
                .map_err(err)?
                .label(name)
                .legend(legend(color));
        }
        if let Some(fit) = &r.fit {
            let line: Vec<(f64, f64)> = (0..=60)
                .map(|i| {
                    let mq = x0 * (x1 / x0).powf(f64::from(i) / 60.0);
                    (mq, fit.model_us(mq))
                })
                .collect();
            let color = RGBColor(0, 90, 200);
            chart
                .draw_series(LineSeries::new(line, color.stroke_width(2)))
                .map_err(err)?
                .label(format!(
                    "model T_probe + Mq (q+p)/BW: {:.0} us, {:.2} GB/s (MAPE amortised {})",
                    fit.probe_us,
                    fit.bw_gbps,
                    fit.mape
                        .amortised_pct
                        .map_or("-".to_owned(), |m| format!("{m:.1}%"))
                ))
                .legend(legend(color));
        }
        let mut flat = |y: f64, name: String, color: RGBColor| -> Result<()> {
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(x0, y), (x1, y)],
                    8,
                    5,
                    color.stroke_width(2),
                ))
                .map_err(err)?
                .label(name)
                .legend(legend(color));
            Ok(())
        };
        if let Some(fetch) = fetch {
            flat(
                fetch,
                format!("fetch at ct = {} (measured: pull + splice)", r.route_ct),
                RGBColor(200, 0, 0),
            )?;
        }
        flat(
            local,
            format!(
                "local at ct = {} (model: ct x L x 1 us, no weights)",
                r.route_ct
            ),
            RGBColor(128, 0, 128),
        )?;
        finish(&mut chart, &root, SeriesLabelPosition::UpperLeft)?;
        Ok(path.to_path_buf())
    }

    /// Fetch time against ct: transfer, splice, total, the fitted transfer line.
    fn fetch(r: &SweepReport, path: &Path) -> Result<PathBuf> {
        let (x0, x1) = range(r.fetch.iter().map(|p| f64::from(p.ct)))?;
        let (y0, y1) = range(
            r.fetch_samples
                .iter()
                .flat_map(|s| [s.transfer_us, s.splice_us, s.transfer_us + s.splice_us]),
        )?;
        let root = BitMapBackend::new(path, (1100, 720)).into_drawing_area();
        let mut chart = log_chart(
            &root,
            format!(
                "fetch vs ct ({}, 27 layers, pool pages + splice)",
                r.provider
            ),
            ((x0, x1), "ct (chunk tokens)"),
            ((y0, y1), "microseconds"),
            true,
        )?;
        let series: [Series<super::FetchSample>; 3] = [
            ("transfer (measured)", RGBColor(200, 0, 0), |s| {
                s.transfer_us
            }),
            ("splice (measured)", RGBColor(230, 140, 0), |s| s.splice_us),
            ("fetch total", RGBColor(90, 0, 0), |s| {
                s.transfer_us + s.splice_us
            }),
        ];
        for (name, color, value) in series {
            chart
                .draw_series(
                    r.fetch_samples
                        .iter()
                        .map(|s| Circle::new((f64::from(s.ct), value(s)), 3, color.filled())),
                )
                .map_err(err)?
                .label(name)
                .legend(legend(color));
        }
        if let Some((fixed, bw)) = r.fetch_fit {
            let bytes_per_token = r
                .fetch
                .first()
                .map_or(0.0, |p| p.bytes as f64 / f64::from(p.ct));
            let line: Vec<(f64, f64)> = (0..=60)
                .map(|i| {
                    let ct = x0 * (x1 / x0).powf(f64::from(i) / 60.0);
                    (ct, fixed + ct * bytes_per_token / (bw * 1e3))
                })
                .collect();
            let color = RGBColor(200, 0, 0);
            chart
                .draw_series(LineSeries::new(line, color.stroke_width(2)))
                .map_err(err)?
                .label(format!("fit: {fixed:.0} us + bytes / {bw:.2} GB/s"))
                .legend(legend(color));
        }
        if let Some(route) = r.decode.route_us {
            let color = RGBColor(0, 128, 0);
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(x0, route), (x1, route)],
                    8,
                    5,
                    color.stroke_width(2),
                ))
                .map_err(err)?
                .label(format!("route at Mq = {} (measured)", r.decode.mq))
                .legend(legend(color));
        }
        finish(&mut chart, &root, SeriesLabelPosition::UpperLeft)?;
        Ok(path.to_path_buf())
    }

    /// Figure 3b: route vs fetch on wire bytes over (Mq, ct), DeepSeek-V2-Lite bf16, with the
    /// break-even line `Mq = ct b_KV / (q + p)` and the decode point.
    fn winner(r: &SweepReport, path: &Path) -> Result<PathBuf> {
        let dims = model_preset("deepseek-v2-lite")?.dims;
        let (x0, x1) = (1.0f64, 8192.0f64);
        let (y0, y1) = (64.0f64, 65536.0f64);
        let root = BitMapBackend::new(path, (1000, 760)).into_drawing_area();
        let mut chart = log_chart(
            &root,
            "wire-byte winner: route (green) vs fetch of one layer (red)",
            ((x0, x1), "Mq (query rows)"),
            ((y0, y1), "ct (chunk tokens)"),
            false,
        )?;
        let (nx, ny) = (52, 40);
        let mut cells = Vec::new();
        for i in 0..nx {
            for j in 0..ny {
                let xa = x0 * (x1 / x0).powf(f64::from(i) / f64::from(nx));
                let xb = x0 * (x1 / x0).powf(f64::from(i + 1) / f64::from(nx));
                let ya = y0 * (y1 / y0).powf(f64::from(j) / f64::from(ny));
                let yb = y0 * (y1 / y0).powf(f64::from(j + 1) / f64::from(ny));
                let (mq, ct) = ((xa * xb).sqrt(), (ya * yb).sqrt());
                let crossover = byte_crossover_rows(&dims, ct.round() as u32)?;
                let saved = 1.0 - mq / crossover;
                // Saturation shows the margin: pale near the line, deep far from it.
                let t = saved.abs().min(1.0);
                let shade =
                    |full: u8| (255.0 - (255.0 - f64::from(full)) * (0.25 + 0.75 * t)) as u8;
                let color = if saved > 0.0 {
                    RGBColor(shade(40), shade(160), shade(40))
                } else {
                    RGBColor(shade(200), shade(40), shade(40))
                };
                cells.push(Rectangle::new([(xa, ya), (xb, yb)], color.filled()));
            }
        }
        chart.draw_series(cells).map_err(err)?;
        let line: Vec<(f64, f64)> = (0..=60)
            .map(|i| {
                let ct = y0 * (y1 / y0).powf(f64::from(i) / 60.0);
                let mq = byte_crossover_rows(&dims, ct.round() as u32).unwrap_or(f64::NAN);
                (mq, ct)
            })
            .filter(|(mq, _)| *mq >= x0 && *mq <= x1)
            .collect();
        chart
            .draw_series(DashedLineSeries::new(line, 8, 5, BLACK.stroke_width(2)))
            .map_err(err)?
            .label("break-even Mq = ct b_KV / (q + p)")
            .legend(legend(BLACK));
        let (mq, ct) = (f64::from(r.decode.mq), f64::from(r.decode.ct));
        chart
            .draw_series([Circle::new((mq, ct), 7, BLACK.filled())])
            .map_err(err)?
            .label(format!(
                "decode point Mq = {}, ct = {}: route moves {:.0}% fewer bytes",
                r.decode.mq,
                r.decode.ct,
                r.decode.route_bytes_saved * 100.0
            ))
            .legend(|(x, y)| Circle::new((x + 10, y), 5, BLACK.filled()));
        finish(&mut chart, &root, SeriesLabelPosition::LowerRight)?;
        Ok(path.to_path_buf())
    }

    /// Paper 000 figure 5a's question: holder kernel time against concurrent requesters.
    fn capacity(r: &SweepReport, path: &Path) -> Result<PathBuf> {
        let (x0, x1) = range(r.concurrency.iter().map(|p| f64::from(p.n)))?;
        let (y0, y1) = range(r.concurrency.iter().flat_map(|p| {
            [
                p.kernel_us_per_call,
                p.kernel_alone_us,
                p.route_us,
                p.kernel_us_per_round,
            ]
        }))?;
        let root = BitMapBackend::new(path, (1100, 720)).into_drawing_area();
        let mut chart = log_chart(
            &root,
            format!(
                "holder partial attention vs concurrent requesters ({}, ct = {})",
                r.provider, r.route_ct
            ),
            ((x0, x1), "N concurrent requesters"),
            ((y0, y1), "microseconds"),
            true,
        )?;
        let series: [Series<super::ConcurrencyPoint>; 4] = [
            ("holder kernel per call", RGBColor(0, 128, 0), |p| {
                p.kernel_us_per_call
            }),
            ("holder kernel per round", RGBColor(0, 90, 200), |p| {
                p.kernel_us_per_round
            }),
            (
                "one in-process call over all N requests' rows",
                RGBColor(120, 120, 120),
                |p| p.kernel_alone_us,
            ),
            ("requester round trip (median)", RGBColor(200, 0, 0), |p| {
                p.route_us
            }),
        ];
        for (name, color, value) in series {
            let pts: Vec<(f64, f64)> = r
                .concurrency
                .iter()
                .map(|p| (f64::from(p.n), value(p)))
                .collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map_err(err)?
                .label(name)
                .legend(legend(color));
            chart
                .draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled())))
                .map_err(err)?;
        }
        finish(&mut chart, &root, SeriesLabelPosition::UpperLeft)?;
        Ok(path.to_path_buf())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The line goes through the medians, not the repetitions: a sweep whose repetitions
    /// scatter +-20% around a line gets that line back, MAPE 0 on its medians and about 14%
    /// on the repetitions; one Mq gives no fit, with the reason.
    #[test]
    fn repetitions_visit_every_point_once_each_in_alternating_directions() {
        let order: Vec<_> = interleaved(3, 4).collect();
        assert_eq!(order.len(), 12);
        for rep in 0..3 {
            let mut seen: Vec<usize> = order.iter().filter(|o| o.0 == rep).map(|o| o.1).collect();
            let walked = seen.clone();
            seen.sort_unstable();
            assert_eq!(seen, [0, 1, 2, 3], "repetition {rep}");
            let forward = walked.windows(2).all(|w| w[0] < w[1]);
            assert_eq!(forward, rep % 2 == 0, "repetition {rep} walks {walked:?}");
        }
        // No point follows the far end of the sweep.
        assert!(order.windows(2).all(|w| w[0].1.abs_diff(w[1].1) <= 1));
        assert_eq!(interleaved(0, 4).count(), 0);
        assert_eq!(interleaved(2, 0).count(), 0);
    }

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
