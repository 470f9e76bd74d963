//! `kvroute demo` and `kvroute holder`: the main job end to end (issue 6, paper 000).
//!
//! The demo starts holder processes (copies of this binary running `kvroute holder`) that each
//! generate and serve chunks of a DeepSeek-V2-Lite-shaped synthetic corpus over libfabric,
//! connects a requester to them, measures route round trips to fit the cost model's fabric
//! constants, then runs decode steps: per (chunk, request) the predicate picks route, fetch or
//! local (or `--force` does), dense steps attend every chunk of the document and a sparse step
//! attends a top-2048 selection scattered over all holders. Every merged output is checked
//! against single-instance attention over the whole document, computed here from a full copy:
//! before the wire (the holders' partials recomputed here and merged: f32 round-off) and
//! through it (what the holders sent, bf16 on the wire). A failed check fails the run.
//!
//! `local` has no model weights to run here: its output is the full copy's attention and its
//! cost is the cost model's `ct x L x c` term, not a measurement.

use std::fmt;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use kvroute_costmodel::fit::{Weighting, fit_round_trips};
use kvroute_costmodel::{CostModel, CostParams, Fabric, Primitive, Request, model_preset};
use kvroute_kernels::{
    Backend, Cache, Partial, Queries, Rope, Selection, merge, merge_wire, partial_dense,
    partial_sparse,
};
use kvroute_kvstore::corpus::queries;
use kvroute_kvstore::{ChunkId, CorpusSpec, FullBlock};
use kvroute_transport::{EngineConfig, FabricConfig, Progress, ProviderChoice, TransferEngine};
use nix::sys::signal::{SigSet, Signal};
use serde::Serialize;

use crate::args::{
    CorpusArgs, DemoArgs, HolderArgs, Lifeline, PrimitiveArg, ProgressArg, RequesterArgs, StepArgs,
};
use crate::route::{
    Call, GatherPart, Holder, HolderConfig, Requester, RequesterConfig, RouteError, Sparse,
};
use crate::sweep::round_trips;

/// DeepSeek-V2-Lite's softmax scale (kernels' `deepseek_softmax_scale(192, 40, 0.707)`).
pub(crate) const SCALE: f32 = 0.1147;
/// Query heads of DeepSeek-V2-Lite: query rows per decode token.
const HEADS: usize = 16;
/// Top-k of the sparse step (DeepSeek-V3.2's `index_topk`).
const TOPK: usize = 2048;
/// Before the wire: merged f32 partials against one call over the whole document. The
/// exactness claim of paper 000 section 3.3 (<= 4e-7 on its f64-accumulating reference). The
/// CPU kernel accumulates in f32 and splits the keys differently for one call over the whole
/// document than for per-chunk calls: for n keys the order alone moves o by up to ~n eps |v|
/// (6144 x 6e-8 x 2 = 7e-4) in the worst case and ~sqrt(n) eps |v| (1e-5) typically; observed
/// <= 2e-6 on the default demo.
const F32_TOL: f32 = 1e-5;
/// Through the wire: o in bf16 (relative 2^-9) on values below ~2 in magnitude; paper 000
/// section 3.3 measured 0.0012 for a two-instance route-merge.
pub(crate) const BF16_TOL: f32 = 8e-3;

/// One check: an output against its single-instance reference.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// What was checked.
    pub name: String,
    /// Max abs difference of o.
    pub max_abs: f32,
    /// The tolerance it had to meet.
    pub tolerance: f32,
    /// Whether it did.
    pub passed: bool,
}

/// One logged (chunk, request) decision.
#[derive(Debug, Clone, Serialize)]
pub struct Decided {
    /// Decode step.
    pub step: u32,
    /// The chunk (`u32::MAX`: the sparse step's selection, over every holder).
    pub chunk: u32,
    /// Query rows.
    pub mq: u32,
    /// What was chosen.
    pub choice: String,
    /// Why (the predicate's reason, or "forced").
    pub reason: String,
}

/// What the demo did and found.
#[derive(Debug, Clone, Serialize)]
pub struct DemoReport {
    /// `demo` (holders started here) or `requester` (holders already running).
    pub command: String,
    /// The provider the transport opened.
    pub provider: String,
    /// Holder processes.
    pub holders: usize,
    /// Chunks, tokens each, layers.
    pub chunks: u32,
    /// Tokens per chunk.
    pub chunk_tokens: u32,
    /// Layers per chunk.
    pub layers: u32,
    /// The start-up probe sweep: (Mq, route round trip minus the holder's
    /// kernel, us).
    pub probe_sweep: Vec<(u32, f64)>,
    /// The fitted T_probe (us) and BW (GB/s).
    pub fitted: (f64, f64),
    /// Set when no line fitted the probe sweep (a loaded machine) and `fitted` is a bound
    /// from its points instead: why.
    pub probe_fallback: Option<String>,
    /// Each decision.
    pub decisions: Vec<Decided>,
    /// Route round trips of the decode steps (submit to merged output), microseconds.
    pub route_us: Vec<f64>,
    /// Fetch transfer and splice times, microseconds.
    pub fetch_us: Vec<(f64, f64)>,
    /// Sparse fetches: gather transfer times (every checked layer's selected rows from every
    /// holder), microseconds.
    pub gather_us: Vec<f64>,
    /// Holder failures seen and what was done about them.
    pub failures: Vec<String>,
    /// The checks.
    pub checks: Vec<Check>,
    /// Whether every check passed.
    pub passed: bool,
}

impl fmt::Display for DemoReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "kvroute {}: {} holder processes over libfabric {}, DeepSeek-V2-Lite corpus of {} chunks x {} tokens x {} layers",
            self.command, self.holders, self.provider, self.chunks, self.chunk_tokens, self.layers
        )?;
        let sweep: Vec<String> = self
            .probe_sweep
            .iter()
            .map(|(m, t)| format!("Mq={m}: {t:.0} us"))
            .collect();
        writeln!(
            f,
            "probe sweep (route, staging to checked reply, minus the holder's kernel; best of {PROBE_REPS}): {}",
            sweep.join(", ")
        )?;
        let how = match &self.probe_fallback {
            None => "fitted:".to_owned(),
            Some(why) => format!("not fitted: {why}:"),
        };
        writeln!(
            f,
            "{how} T_probe = {:.1} us, BW = {:.2} GB/s",
            self.fitted.0, self.fitted.1
        )?;
        for d in &self.decisions {
            let what = if d.chunk == u32::MAX {
                "sparse".to_owned()
            } else {
                format!("chunk {}", d.chunk)
            };
            writeln!(
                f,
                "  step {} {what} Mq={}: {} ({})",
                d.step, d.mq, d.choice, d.reason
            )?;
        }
        if !self.route_us.is_empty() {
            let mut v = self.route_us.clone();
            v.sort_by(f64::total_cmp);
            writeln!(
                f,
                "route round trips (all of a step's routed chunks, submit to merged output): {}, median {:.0} us",
                v.len(),
                v[v.len() / 2]
            )?;
        }
        for (t, s) in &self.fetch_us {
            writeln!(f, "fetch: transfer {t:.0} us, splice {s:.0} us")?;
        }
        for t in &self.gather_us {
            writeln!(f, "sparse fetch (gather): transfer {t:.0} us")?;
        }
        for e in &self.failures {
            writeln!(f, "failure: {e}")?;
        }
        writeln!(
            f,
            "checks (max abs of o against single-instance attention over the whole document):"
        )?;
        for c in &self.checks {
            writeln!(
                f,
                "  [{}] {}: {:.3e} (tolerance {:.0e})",
                if c.passed { "ok" } else { "FAIL" },
                c.name,
                c.max_abs,
                c.tolerance
            )?;
        }
        write!(
            f,
            "{}",
            if self.passed {
                "all checks passed\n"
            } else {
                "SOME CHECKS FAILED\n"
            }
        )
    }
}

pub(crate) fn provider_for(name: &str) -> Result<ProviderChoice> {
    if name != "auto" {
        return Ok(name.parse()?);
    }
    let available = kvroute_transport::fabric::available_providers()?;
    Ok(if available.iter().any(|p| p == "shm") {
        ProviderChoice::Shm
    } else {
        ProviderChoice::Tcp
    })
}

pub(crate) fn fabric_engine(provider: &ProviderChoice) -> Result<(TransferEngine, String)> {
    fabric_engine_with(provider, ProgressArg::Thread)
}

/// An engine on `provider`; with worker threads, idle workers poll every 50 us (several
/// processes share two cores here), with manual progress the caller's thread polls.
pub(crate) fn fabric_engine_with(
    provider: &ProviderChoice,
    progress: ProgressArg,
) -> Result<(TransferEngine, String)> {
    let engine_config = EngineConfig {
        progress: match progress {
            ProgressArg::Thread => Progress::Thread,
            ProgressArg::Manual => Progress::Manual,
        },
        ..EngineConfig::default()
    };
    let config = FabricConfig {
        provider: provider.clone(),
        required: true,
        node: (*provider == ProviderChoice::Tcp).then(|| "127.0.0.1".to_owned()),
        // Several processes share two cores here: idle workers poll every 50 us instead of
        // spinning a core each.
        idle_poll: Some(Duration::from_micros(50)),
        op_timeout: Duration::from_secs(3),
        ..FabricConfig::default()
    };
    let (engine, report) = TransferEngine::fabric(&config, engine_config)?;
    Ok((engine, report.provider))
}

/// The corpus: DeepSeek-V2-Lite's 27 layers, RoPE theta 10000 with its YaRN scaling.
fn corpus(args: &DemoArgs) -> Result<CorpusSpec> {
    v2_lite_corpus(args.tokens, args.holders as u32, args.seed)
}

/// The corpus `--corpus` gives, or DeepSeek-V2-Lite's of the sizes given.
fn corpus_of(args: &CorpusArgs) -> Result<CorpusSpec> {
    match &args.corpus {
        Some(json) => {
            let spec: CorpusSpec =
                serde_json::from_str(json).context("--corpus is not a CorpusSpec")?;
            spec.validate()?;
            Ok(spec)
        }
        None => v2_lite_corpus(args.tokens, args.doc_chunks, args.corpus_seed),
    }
}

/// `chunks` chunks of `tokens` tokens with DeepSeek-V2-Lite's 27 layers, RoPE theta 10000 and
/// its YaRN scaling, interleaved RoPE pairs.
pub(crate) fn v2_lite_corpus(tokens: u32, chunks: u32, seed: u64) -> Result<CorpusSpec> {
    let layers = model_preset("deepseek-v2-lite")?.dims.layers;
    let spec = CorpusSpec {
        layers,
        chunk_tokens: tokens,
        chunks,
        seed,
        rope_theta: 10_000.0,
        yarn: Some(kvroute_kernels::Yarn::DEEPSEEK),
        rope_layout: kvroute_kernels::RopeLayout::Interleaved,
    };
    spec.validate()?;
    Ok(spec)
}

/// `kvroute holder`.
pub(crate) fn holder(args: &HolderArgs) -> Result<()> {
    let spec = corpus_of(&args.corpus)?;
    let chunks = args
        .chunks
        .split(',')
        .map(|c| c.trim().parse().map(ChunkId))
        .collect::<Result<Vec<_>, _>>()
        .context("--chunks: comma-separated ids")?;
    // Blocked (not handled) before the engine starts its threads, which inherit the mask:
    // no handler runs, in particular not the one libfabric's shm installs (it unlinks the
    // regions and re-raises), and this thread takes the signal with sigwait below.
    let stop = match args.lifeline {
        Lifeline::Signal => {
            let mut set = SigSet::empty();
            for s in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
                set.add(s);
            }
            set.thread_block().context("blocking the stop signals")?;
            Some(set)
        }
        Lifeline::Stdin => None,
    };
    let (engine, _) = fabric_engine_with(&args.provider.parse()?, args.progress)?;
    let mut config = HolderConfig::new(spec, chunks);
    config.max_requesters = args.max_requesters;
    config.slot_bytes = args.slot_bytes;
    config.reply_bytes = args.slot_bytes;
    let holder = Holder::start(engine, TcpListener::bind(&args.listen)?, config)?;
    println!(
        "{}",
        serde_json::json!({ "listen": holder.addr().to_string() })
    );
    std::io::stdout().flush()?;
    match stop {
        // Until the parent closes stdin (or dies).
        None => {
            let mut sink = Vec::new();
            let _ = std::io::stdin().read_to_end(&mut sink);
        }
        Some(set) => {
            let signal = set.wait().context("waiting for a stop signal")?;
            tracing::info!(%signal, "stopping");
        }
    }
    // Dropped, not killed: the engine closes its endpoints (shm unlinks its region).
    drop(holder);
    Ok(())
}

pub(crate) struct HolderProcess {
    child: Child,
    pub(crate) addr: SocketAddr,
}

impl Drop for HolderProcess {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_holders(
    args: &DemoArgs,
    spec: &CorpusSpec,
    provider: &ProviderChoice,
) -> Result<Vec<HolderProcess>> {
    let n = args.holders;
    (0..n)
        .map(|h| {
            let chunks: Vec<u32> = (0..args.replicas)
                .map(|r| ((h + n - r) % n) as u32)
                .collect();
            spawn_holder(spec, provider, &chunks, &[])
        })
        .collect()
}

/// Starts one `kvroute holder` process serving `chunks` of `spec`, with `extra` arguments,
/// and waits for its control address.
pub(crate) fn spawn_holder(
    spec: &CorpusSpec,
    provider: &ProviderChoice,
    chunks: &[u32],
    extra: &[String],
) -> Result<HolderProcess> {
    let exe = std::env::current_exe().context("finding the kvroute binary")?;
    let corpus = serde_json::to_string(spec)?;
    let chunks: Vec<String> = chunks.iter().map(u32::to_string).collect();
    let h = chunks.join(",");
    {
        let mut child = Command::new(&exe)
            .args([
                "holder",
                "--provider",
                &provider.to_string(),
                "--corpus",
                &corpus,
                "--chunks",
                &h,
                "--lifeline",
                "stdin",
            ])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting a holder process")?;
        let stdout: ChildStdout = child
            .stdout
            .take()
            .ok_or_else(|| anyhow!("no holder stdout"))?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let v: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("holder {h} said: {line:?}"))?;
        let addr = v["listen"]
            .as_str()
            .ok_or_else(|| anyhow!("holder {h} gave no address"))?
            .parse()?;
        Ok(HolderProcess { child, addr })
    }
}

/// Max abs difference of two partials' `o` (infinite when their shapes differ).
pub(crate) fn max_abs(a: &Partial, b: &Partial) -> f32 {
    if a.o.len() != b.o.len() {
        return f32::INFINITY;
    }
    a.o.iter()
        .zip(&b.o)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn check(checks: &mut Vec<Check>, name: String, got: &Partial, want: &Partial, tolerance: f32) {
    let max_abs = if got.rows() == want.rows() {
        max_abs(got, want)
    } else {
        f32::INFINITY
    };
    checks.push(Check {
        name,
        max_abs,
        tolerance,
        passed: max_abs <= tolerance,
    });
}

/// Routes `calls` the way a decode step should (paper 000 section 5.3's reductions, carried
/// to both ends): each call's query rows are written straight into registered staging
/// ([`Requester::stage_copied`]; here by copying them, where a model's query projection would
/// write them through [`Requester::stage`]), and the replies are merged from the bf16 rows where they landed
/// ([`StagedRoute::route_wire`](crate::route::StagedRoute::route_wire),
/// [`merge_wire`]), with no decode pass. Calls whose holder failed are re-staged once on their
/// chunk's next replica. Returns one merged partial per attempt that brought rows back (one,
/// or two after a fallback), for the caller to merge with its other parts; any other
/// failure is an error naming the chunk.
fn route_merged(
    req: &mut Requester,
    calls: &[Call<'_>],
    failures: &mut Vec<String>,
) -> Result<Vec<Partial>> {
    let mut merged = Vec::new();
    let mut pending: Vec<usize> = (0..calls.len()).collect();
    for retry in [false, true] {
        if pending.is_empty() {
            break;
        }
        let subset: Vec<Call<'_>> = pending.iter().map(|&i| calls[i]).collect();
        let routed = req.stage_copied(&subset).route_wire();
        let mut parts = Vec::with_capacity(pending.len());
        let mut failed = Vec::new();
        for (j, &i) in pending.iter().enumerate() {
            match routed.partial(j) {
                Ok(p) => parts.push(p),
                Err(e @ RouteError::HolderFailed { .. }) if !retry => {
                    failures.push(format!(
                        "{}: {e}; retrying on another replica",
                        calls[i].chunk
                    ));
                    failed.push(i);
                }
                Err(e) => bail!(
                    "routing {}: {e} (failures so far: {})",
                    calls[i].chunk,
                    failures.join("; ")
                ),
            }
        }
        if !parts.is_empty() {
            let mut out = Partial::empty(0);
            merge_wire(&parts, &mut out)
                .with_context(|| format!("merging the replies of {} calls", parts.len()))?;
            merged.push(out);
        }
        pending = failed;
    }
    Ok(merged)
}

/// The primitive `--force` names.
fn forced(arg: PrimitiveArg) -> Primitive {
    match arg {
        PrimitiveArg::Route => Primitive::Route,
        PrimitiveArg::Fetch => Primitive::Fetch,
        PrimitiveArg::Local => Primitive::Local,
    }
}

/// `kvroute demo`.
pub(crate) fn run(args: &DemoArgs) -> Result<DemoReport> {
    if !(2..=8).contains(&args.holders) || args.replicas == 0 || args.replicas > args.holders {
        bail!("--holders must be 2 to 8 and --replicas 1 to --holders");
    }
    let spec = corpus(args)?;
    let provider = provider_for(&args.provider)?;
    let mut procs = spawn_holders(args, &spec, &provider)?;
    let addrs: Vec<SocketAddr> = procs.iter().map(|p| p.addr).collect();
    let steps = (&args.run, args.seed);
    let report = decode_steps("demo", &spec, &provider, &addrs, steps, &mut |step| {
        if args.kill_holder_at_step != Some(step) {
            return Ok(None);
        }
        let p = &mut procs[0];
        p.child.kill().context("killing holder 0")?;
        let _ = p.child.wait();
        // SIGKILL leaves its shm regions behind; it is reaped, so they are garbage.
        let _ = kvroute_transport::fabric::remove_shm_regions_of_dead_process(p.child.id());
        Ok(Some(format!(
            "holder 0 ({}) killed before step {step}",
            p.addr
        )))
    });
    drop(procs);
    report
}

/// The holder addresses of `kvroute requester`: `--holders`, or the lines of `--peers`.
fn holder_addrs(args: &RequesterArgs) -> Result<Vec<SocketAddr>> {
    let text;
    let listed: Vec<&str> = match &args.peers {
        Some(path) => {
            text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the peer file {}", path.display()))?;
            text.lines()
                .map(|l| l.split('#').next().unwrap_or_default().trim())
                .filter(|l| !l.is_empty())
                .collect()
        }
        None => args.holders.iter().map(|h| h.trim()).collect(),
    };
    let addrs = listed
        .iter()
        .map(|a| {
            std::net::ToSocketAddrs::to_socket_addrs(a)
                .with_context(|| format!("holder address {a:?}"))?
                .next()
                .ok_or_else(|| anyhow!("holder address {a:?} resolves to nothing"))
        })
        .collect::<Result<Vec<_>>>()?;
    if addrs.is_empty() {
        bail!("no holder addresses given");
    }
    Ok(addrs)
}

/// Query-row counts of the start-up probe sweep.
const PROBE_MQ: [u32; 4] = [1, 16, 64, 256];
/// Routes per probe point; the fastest is kept (noise on a shared machine only adds).
const PROBE_REPS: usize = 5;
/// Probe sweeps tried before giving up on a fit with a positive slope and intercept.
const PROBE_ATTEMPTS: usize = 3;

/// The start-up probe sweep: the fabric constants of paper 000 section 4.3 (`T_probe`, `BW`)
/// as this requester sees them. At each of [`PROBE_MQ`], the fastest of [`PROBE_REPS`]
/// routes of chunk 0's layer 0, each timed from staging the rows to the checked reply,
/// minus the holder's own kernel time for it: the cost model prices compute and merge in
/// their own terms, so they must not be in the fabric's. A route whose holder served
/// anything else meanwhile is not kept. Fitted to
/// `T_probe + Mq (q + p) / BW` (relative error, as `kvroute sweep` fits). A sweep too noisy
/// for a line with a positive slope and intercept is measured again, up to
/// [`PROBE_ATTEMPTS`] times, then bounded from the last sweep (and said so).
fn probe_fabric(
    req: &mut Requester,
    rope: &Rope,
    doc_tokens: i64,
    row_bytes: u64,
) -> Result<Probed> {
    let holder = req.holder_for(ChunkId(0))?;
    let rows: Vec<Vec<u16>> = PROBE_MQ
        .iter()
        .map(|&mq| queries(mq as usize, doc_tokens, rope, 99))
        .collect();
    let mut why = String::new();
    let mut last = Vec::new();
    for _ in 0..PROBE_ATTEMPTS {
        let mut points = Vec::new();
        for (&mq, q) in PROBE_MQ.iter().zip(&rows) {
            let call = [Call {
                chunk: ChunkId(0),
                layer: 0,
                queries: q,
                sparse: None,
            }];
            let mut best = f64::INFINITY;
            for _ in 0..PROBE_REPS {
                let before = req.holder_stats(holder)?;
                let started = Instant::now();
                let routed = req.stage_copied(&call).route_wire();
                routed.partial(0)?;
                drop(routed);
                let us = started.elapsed().as_secs_f64() * 1e6;
                let after = req.holder_stats_counting(holder, before.requests + 1)?;
                // Another requester's request in between would bring its kernel time too.
                if after.requests == before.requests + 1 {
                    best = best.min(us - (after.kernel_us - before.kernel_us));
                }
            }
            if best.is_finite() {
                points.push((mq, best));
            }
        }
        let samples = round_trips(&points, |p| p.0, |p| p.1);
        match fit_round_trips(&samples, row_bytes, Weighting::Relative).and_then(|f| f.fabric()) {
            Ok(fabric) => {
                return Ok(Probed {
                    points,
                    fabric,
                    fallback: None,
                });
            }
            Err(e) => why = e.to_string(),
        }
        last = points;
    }
    // The machine is too loaded for a line through these points. The decisions still need
    // constants, and measuring is not what the run checks.
    let fabric = fabric_bound(&last, row_bytes).with_context(|| {
        format!("the start-up probe sweep found no fabric constants: {why}; points {last:?}")
    })?;
    Ok(Probed {
        points: last,
        fabric,
        fallback: Some(format!(
            "no fit in {PROBE_ATTEMPTS} probe sweeps ({why}); bounded from the last one"
        )),
    })
}

/// Fabric constants bounded from probe points that no line fits: the fastest point as the
/// fixed cost, and the largest request's bytes over that request's time as the bandwidth.
/// Both are positive, and the model is never faster than the largest request measured.
fn fabric_bound(points: &[(u32, f64)], row_bytes: u64) -> Result<Fabric> {
    let fastest = points.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let &(mq, us) = points
        .iter()
        .max_by_key(|p| p.0)
        .context("no probe points")?;
    let bw_gbps = (u64::from(mq) * row_bytes) as f64 / (us * 1e3);
    Ok(Fabric::measured(fastest, bw_gbps)?)
}

/// What [`probe_fabric`] measured.
struct Probed {
    /// (Mq, route round trip minus the holder's kernel, us) of the sweep used.
    points: Vec<(u32, f64)>,
    /// The fabric constants the decisions use.
    fabric: Fabric,
    /// Why the constants are a bound from the points rather than a fit, if they are.
    fallback: Option<String>,
}

/// `kvroute requester`.
pub(crate) fn requester(args: &RequesterArgs) -> Result<DemoReport> {
    let spec = corpus_of(&args.corpus)?;
    let addrs = holder_addrs(args)?;
    let provider = provider_for(&args.provider)?;
    let steps = (&args.run, args.seed);
    decode_steps("requester", &spec, &provider, &addrs, steps, &mut |_| {
        Ok(None)
    })
}

/// Connects a requester to `holders`, measures the start-up probe sweep, and runs the decode
/// steps `plan` asks for, with queries and the sparse selection drawn from `seed`;
/// `before_step` may act before each step (the demo's kill) and report what it did.
fn decode_steps(
    command: &str,
    spec: &CorpusSpec,
    provider: &ProviderChoice,
    holders: &[SocketAddr],
    (plan, seed): (&StepArgs, u64),
    before_step: &mut dyn FnMut(u32) -> Result<Option<String>>,
) -> Result<DemoReport> {
    let force = plan.force.map(forced);
    let (engine, provider_name) = fabric_engine(provider)?;
    let config = RequesterConfig {
        timeout: Duration::from_millis(plan.timeout_ms),
        link_bytes: 4 << 20,
        pool_pages: spec.layout().pages() as u32 * spec.chunks,
        scale: SCALE,
        tag: 0,
        spin: Duration::from_millis(1),
    };
    let mut req = Requester::connect(engine, holders, config)?;
    // The full copy the checks are computed against.
    let blocks: Vec<Vec<u16>> = (0..spec.chunks)
        .map(|c| spec.chunk(ChunkId(c)))
        .collect::<Result<_, _>>()?;
    let rope = spec.rope()?;
    let model = model_preset("deepseek-v2-lite")?.dims;
    let ct = spec.chunk_tokens;
    let doc_tokens = spec.tokens() as i64;

    let probed = probe_fabric(&mut req, &rope, doc_tokens, model.routed_row_bytes())?;
    let fabric = probed.fabric;
    let costs = CostModel::new(CostParams::paper_defaults(model, fabric))?;

    let mut report = DemoReport {
        command: command.to_owned(),
        provider: provider_name,
        holders: holders.len(),
        chunks: spec.chunks,
        chunk_tokens: ct,
        layers: spec.layers,
        probe_sweep: probed.points,
        fitted: (fabric.probe_us, fabric.bw_gbps),
        probe_fallback: probed.fallback,
        decisions: Vec::new(),
        route_us: Vec::new(),
        fetch_us: Vec::new(),
        gather_us: Vec::new(),
        failures: Vec::new(),
        checks: Vec::new(),
        passed: false,
    };
    let layers = [0, spec.layers / 2, spec.layers - 1];
    // The requester's own prompt precedes the document: a fetched chunk is re-homed past it.
    let prefix = 4096i64;
    let mq = plan.batch as usize * HEADS;
    for step in 0..plan.steps {
        if let Some(what) = before_step(step)? {
            report.failures.push(what);
        }
        // Decode queries at the end of the document (as the requester sees it: after its prefix).
        let q = queries(
            mq,
            prefix + doc_tokens + i64::from(step),
            &rope,
            seed ^ u64::from(step),
        );
        let mut choice = Vec::new();
        for c in 0..spec.chunks {
            let (primitive, reason) = match force {
                Some(p) => (p, "forced".to_owned()),
                None => {
                    let d = costs.decide(&Request::contiguous(mq as u32, ct))?;
                    (
                        d.choice,
                        d.to_string().lines().next().unwrap_or_default().to_owned(),
                    )
                }
            };
            report.decisions.push(Decided {
                step,
                chunk: c,
                mq: mq as u32,
                choice: format!("{primitive:?}"),
                reason,
            });
            choice.push(primitive);
        }
        for &layer in &layers {
            // Routed chunks attend at their stored positions, fetched ones at the requester's,
            // so each chunk's reference is computed the way its primitive attends.
            let routed: Vec<u32> = (0..spec.chunks)
                .filter(|&c| choice[c as usize] == Primitive::Route)
                .collect();
            let calls: Vec<Call<'_>> = routed
                .iter()
                .map(|&c| Call {
                    chunk: ChunkId(c),
                    layer: layer as u16,
                    queries: &q,
                    sparse: None,
                })
                .collect();
            let started = Instant::now();
            let got = if calls.is_empty() {
                Vec::new()
            } else {
                route_merged(&mut req, &calls, &mut report.failures)?
            };
            if !calls.is_empty() {
                report.route_us.push(started.elapsed().as_secs_f64() * 1e6);
            }
            let mut parts: Vec<Partial> = got;
            let mut before_wire: Vec<Partial> = Vec::new();
            let mut whole_rows: Vec<u16> = Vec::new();
            let queries_q = Queries::new(&q)?;
            for c in 0..spec.chunks {
                let full = FullBlock::new(&blocks[c as usize], spec.layout())?;
                let rows = full.layer(layer)?.rows();
                match choice[c as usize] {
                    Primitive::Route => {
                        before_wire.push(partial_dense(
                            Backend::Cpu,
                            &queries_q,
                            &Cache::contiguous(rows)?,
                            SCALE,
                        )?);
                        whole_rows.extend_from_slice(rows);
                    }
                    Primitive::Fetch => {
                        let to: Vec<i64> = spec
                            .positions(ChunkId(c))
                            .iter()
                            .map(|p| p + prefix)
                            .collect();
                        let fetched = req
                            .fetch(ChunkId(c), &to, rope, Backend::Cpu)
                            .map_err(|e| anyhow!("{e}"))?;
                        report
                            .fetch_us
                            .push((fetched.transfer_us, fetched.splice_us));
                        let p = partial_dense(
                            Backend::Cpu,
                            &queries_q,
                            &req.fetched_cache(&fetched, layer as usize)?,
                            SCALE,
                        )?;
                        // The same splice on the full copy.
                        let mut spliced = rows.to_vec();
                        let mut pool = vec![0u16; spec.layout().layer_elems()];
                        let table: Vec<u32> = (0..spec.layout().pages_per_layer() as u32).collect();
                        let from = spec.positions(ChunkId(c));
                        let job = kvroute_kernels::SpliceJob::new(
                            &spliced, 1, &from, &to, rope, &mut pool, &table,
                        )?;
                        kvroute_kernels::splice(Backend::Cpu, job)?;
                        spliced.copy_from_slice(&pool[..rows.len()]);
                        before_wire.push(partial_dense(
                            Backend::Cpu,
                            &queries_q,
                            &Cache::contiguous(&spliced)?,
                            SCALE,
                        )?);
                        whole_rows.extend_from_slice(&spliced);
                        parts.push(p);
                        req.release(fetched)?;
                    }
                    Primitive::Local => {
                        // No weights: the full copy's attention stands in for a re-prefill.
                        let p = partial_dense(
                            Backend::Cpu,
                            &queries_q,
                            &Cache::contiguous(rows)?,
                            SCALE,
                        )?;
                        before_wire.push(p.clone());
                        parts.push(p);
                        whole_rows.extend_from_slice(rows);
                    }
                }
            }
            let whole = partial_dense(
                Backend::Cpu,
                &queries_q,
                &Cache::contiguous(&whole_rows)?,
                SCALE,
            )?;
            let merged_before = merge(&before_wire.iter().collect::<Vec<_>>())?;
            let merged = merge(&parts.iter().collect::<Vec<_>>())?;
            check(
                &mut report.checks,
                format!("step {step} layer {layer} dense, merged f32 partials"),
                &merged_before,
                &whole,
                F32_TOL,
            );
            check(
                &mut report.checks,
                format!("step {step} layer {layer} dense, through the wire"),
                &merged,
                &whole,
                BF16_TOL,
            );
        }
    }
    // Sparse: one decode token's 16 heads select top-2048 of the whole document, scattered
    // over every holder. Route: each holder attends its subset in place (no splice), we
    // merge. Fetch: every holder that has some sends its selected rows (a gather, no splice)
    // and we attend them here.
    let sel_k = TOPK.min(spec.tokens());
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut picked = std::collections::BTreeSet::new();
    while picked.len() < sel_k {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        picked.insert((s % spec.tokens() as u64) as i32);
    }
    let global: Vec<i32> = picked.into_iter().collect();
    let q = queries(HEADS, doc_tokens, &rope, seed ^ 0x5a5a);
    let per_chunk: Vec<Vec<i32>> = (0..spec.chunks as i32)
        .map(|c| {
            global
                .iter()
                .filter(|&&g| g / ct as i32 == c)
                .map(|&g| g - c * ct as i32)
                .collect()
        })
        .collect();
    let spanned = per_chunk.iter().filter(|idx| !idx.is_empty()).count() as u32;
    let qq = Queries::new(&q)?;
    // Single-instance sparse attention over the whole document: what every path must give.
    let sparse_whole = |layer: u32| -> Result<Partial> {
        let doc = spec.document_layer(&blocks, layer)?;
        let cache = Cache::contiguous(&doc)?;
        let selection = Selection::new(&global, sel_k, HEADS, HEADS, cache.tokens())?;
        Ok(partial_sparse(
            Backend::Cpu,
            &qq,
            &cache,
            &selection,
            SCALE,
        )?)
    };
    let (sparse_choice, reason) = match force {
        Some(p) => (p, "forced".to_owned()),
        None => {
            let d = costs.decide(&Request::sparse(
                HEADS as u32,
                spec.tokens() as u32,
                sel_k as u32,
                spanned,
            ))?;
            (
                d.choice,
                d.to_string().lines().next().unwrap_or_default().to_owned(),
            )
        }
    };
    report.decisions.push(Decided {
        step: plan.steps,
        chunk: u32::MAX,
        mq: HEADS as u32,
        choice: format!("{sparse_choice:?}"),
        reason: format!("sparse top-{sel_k} over {spanned} holders: {reason}"),
    });
    if sparse_choice == Primitive::Fetch {
        let parts: Vec<GatherPart<'_>> = per_chunk
            .iter()
            .enumerate()
            .filter(|(_, idx)| !idx.is_empty())
            .map(|(c, idx)| GatherPart {
                chunk: ChunkId(c as u32),
                tokens: idx,
            })
            .collect();
        let wanted: Vec<u16> = layers.iter().map(|&l| l as u16).collect();
        let gathered = req
            .gather(&parts, &wanted)
            .map_err(|e| anyhow!("gathering the sparse selection: {e}"))?;
        report.gather_us.push(gathered.transfer_us);
        for (i, &layer) in layers.iter().enumerate() {
            let whole = sparse_whole(layer)?;
            // The gathered rows are the selection, in order: attend all of them.
            let got = partial_dense(Backend::Cpu, &qq, &req.gathered_cache(&gathered, i)?, SCALE)?;
            check(
                &mut report.checks,
                format!(
                    "sparse top-{sel_k} gathered from {spanned} holders, layer {layer}, attended here"
                ),
                &got,
                &whole,
                F32_TOL,
            );
        }
        req.release_gathered(gathered)?;
    }
    for &layer in &layers {
        if sparse_choice == Primitive::Fetch {
            break;
        }
        let calls: Vec<Call<'_>> = per_chunk
            .iter()
            .enumerate()
            .filter(|(_, idx)| !idx.is_empty())
            .map(|(c, idx)| Call {
                chunk: ChunkId(c as u32),
                layer: layer as u16,
                queries: &q,
                sparse: Some(Sparse {
                    indices: idx,
                    k: idx.len() as u32,
                    rows_per_token: HEADS as u32,
                }),
            })
            .collect();
        let parts = route_merged(&mut req, &calls, &mut report.failures)?;
        let whole = sparse_whole(layer)?;
        let mut before = Vec::new();
        for call in &calls {
            let full = FullBlock::new(&blocks[call.chunk.0 as usize], spec.layout())?;
            let chunk_cache = full.layer(layer)?.cache()?;
            let Some(sp) = call.sparse else { continue };
            let sel = Selection::new(
                sp.indices,
                sp.k as usize,
                HEADS,
                HEADS,
                chunk_cache.tokens(),
            )?;
            before.push(partial_sparse(
                Backend::Cpu,
                &qq,
                &chunk_cache,
                &sel,
                SCALE,
            )?);
        }
        let merged_before = merge(&before.iter().collect::<Vec<_>>())?;
        let merged = merge(&parts.iter().collect::<Vec<_>>())?;
        let name = format!(
            "sparse top-{sel_k} over {} holders, layer {layer}",
            calls.len()
        );
        check(
            &mut report.checks,
            format!("{name}, merged f32 partials"),
            &merged_before,
            &whole,
            F32_TOL,
        );
        check(
            &mut report.checks,
            format!("{name}, through the wire"),
            &merged,
            &whole,
            BF16_TOL,
        );
    }
    report.passed = report.checks.iter().all(|c| c.passed) && !report.checks.is_empty();
    drop(req);
    Ok(report)
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
