//! `kvroute generate` and the demo's main job: holder processes prefill the context's chunks
//! through the model and serve them over libfabric; this process connects a requester,
//! calibrates the selector and runs `kvroute_decode::generate::generate`, which decodes
//! through the step API and checks every token against the same generation with the whole
//! context here. Process orchestration and printing only.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvroute_costmodel::Primitive;
use kvroute_decode::context::ContextSpec;
use kvroute_decode::generate::{
    GenerateConfig, GenerateReport, TokenTiming, calibrated_stepper, generate, requester_config,
};
use kvroute_decode::held::prefill_chunk;
use kvroute_kernels::Backend;
use kvroute_kvstore::ChunkId;
use kvroute_model::{Model, ModelConfig};
use kvroute_remote::Requester;
use kvroute_remote::probe::ProbeConfig;
use kvroute_remote::step::Stepper;
use kvroute_transport::{ProviderChoice, TransferEngine};
use serde::Serialize;

use super::Served;
use super::follow::{DirectoryReport, Follower};
use super::holders::{
    HolderProcess, StartingHolder, directory_flags, provider_for, requester_engine, start_holder,
};
use crate::args::{GenerateArgs, PrimitiveArg};
use crate::calibrate::CalibrationSummary;

/// The most holders a requester following a directory connects to over a run.
const MAX_DIRECTORY_HOLDERS: usize = 16;

/// What a generation did and found.
#[derive(Debug, Clone, Serialize)]
pub struct GenerationReport {
    /// `generate` or `demo`.
    pub command: String,
    /// The provider the transport opened.
    pub provider: String,
    /// Holder processes.
    pub holders: usize,
    /// Copies of each chunk.
    pub replicas: usize,
    /// The model's configuration, where it came from, and its parameters.
    pub model: ModelSummary,
    /// Seconds from starting the holders to every one serving (their prefill).
    pub holders_ready_s: f64,
    /// The selector's start-up calibration.
    pub calibration: CalibrationSummary,
    /// The generation, its check and its times.
    #[serde(flatten)]
    pub generation: GenerateReport,
    /// What each holder still answering at the end served.
    pub served: Vec<Served>,
    /// With a directory: what it held and what changed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub directory: Option<DirectoryReport>,
    /// With `--metrics-listen`: each process's `/metrics` address (`requester`, `holder N`).
    pub metrics: Vec<(String, SocketAddr)>,
}

/// The model a generation ran.
#[derive(Debug, Clone, Serialize)]
pub struct ModelSummary {
    /// The checkpoint directory, or where the default model was drawn from.
    pub source: String,
    /// Its configuration.
    pub config: ModelConfig,
    /// Parameters.
    pub parameters: Option<u64>,
}

/// Removes the default model's temporary checkpoint when the run ends.
struct TempCheckpoint(PathBuf);

impl Drop for TempCheckpoint {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The checkpoint `--model` names, or a tiny one drawn from `seed` into a temporary
/// directory (removed with the guard).
fn checkpoint(model: Option<&Path>, seed: u64) -> Result<(PathBuf, Option<TempCheckpoint>)> {
    if let Some(dir) = model {
        return Ok((dir.to_owned(), None));
    }
    let dir =
        std::env::temp_dir().join(format!("kvroute-model-tiny-{seed}-{}", std::process::id()));
    let guard = TempCheckpoint(dir.clone());
    Model::init(ModelConfig::tiny(), seed)?
        .save(&dir)
        .with_context(|| format!("writing the default model to {}", dir.display()))?;
    Ok((dir, Some(guard)))
}

/// `kvroute generate` (and the demo's generation): `command` names which.
pub(crate) fn run(command: &str, args: &GenerateArgs) -> Result<GenerationReport> {
    let g = &args.generation;
    if args.replicas > args.holders {
        bail!("--replicas must be at most --holders");
    }
    let provider = provider_for(&args.provider)?;
    let (dir, _guard) = checkpoint(g.model.as_deref(), g.model_seed)?;
    let model = Model::load(&dir).with_context(|| format!("--model {}", dir.display()))?;
    let context = ContextSpec {
        chunks: args.holders as u32,
        chunk_tokens: args.tokens,
        requests: args.requests,
        prompt_tokens: g.prompt_tokens,
        seed: args.seed,
    };
    context.validate()?;
    let backends: Vec<&str> = args.holder_backend.split(',').map(str::trim).collect();
    for b in &backends {
        b.parse::<Backend>()
            .with_context(|| format!("--holder-backend {b}"))?;
    }
    let mut metrics = Vec::new();
    let mut holder_metrics = Vec::new();
    if let Some(addr) = &args.metrics_listen {
        let at = crate::metrics_http::serve(addr)?;
        metrics.push(("requester".to_owned(), at));
        holder_metrics = vec!["--metrics-listen".to_owned(), format!("{}:0", at.ip())];
    }
    // Every holder starts prefilling at once; the reference's chunks are prefilled here
    // meanwhile.
    let started = Instant::now();
    let starting = start_holders(
        args,
        &provider,
        &HolderFlags {
            model: &dir,
            context: &context,
            backends: &backends,
            metrics: &holder_metrics,
        },
    )?;
    let chunks = (0..context.chunks)
        .map(|c| prefill_chunk(&model, &context, ChunkId(c)))
        .collect::<Result<Vec<_>, _>>()
        .context("prefilling the reference's chunks")?;
    let procs: Vec<HolderProcess> = starting
        .into_iter()
        .map(|s| s.ready())
        .collect::<Result<_>>()?;
    let holders_ready_s = started.elapsed().as_secs_f64();
    for (h, p) in procs.iter().enumerate() {
        if let Some(at) = p.metrics {
            metrics.push((format!("holder {h}"), at));
        }
    }
    let addrs: Vec<SocketAddr> = procs.iter().map(|p| p.addr).collect();

    let (engine, provider_name) =
        requester_engine(&provider, Duration::from_millis(args.timeout_ms))?;
    let (req, follower) = connect(args, engine, &model, &context, &addrs)?;
    let force = args.force.map(|f| match f {
        PrimitiveArg::Route => Primitive::Route,
        PrimitiveArg::Fetch => Primitive::Fetch,
        PrimitiveArg::Local => Primitive::Local,
    });
    let poll = Duration::from_millis(args.poll_ms);
    let mut stepper = calibrated_stepper(req, &model, &context, &ProbeConfig::default(), |c| {
        c.force = force;
        c.poll_every = poll;
        c.backend = Backend::Cpu;
    })?;
    let calibration = CalibrationSummary::of(stepper.calibration())?;
    let mut between = BetweenTokens {
        procs,
        follower,
        kill_at: g.kill_holder_at_token,
        killed: false,
        chunks: context.chunks,
    };
    let report = generate(
        &model,
        &mut stepper,
        &context,
        &chunks,
        GenerateConfig {
            new_tokens: g.new_tokens,
            block_tokens: g.block_tokens,
        },
        &mut |step, generated, last, stepper| between.act(step, generated, last, stepper),
    )?;
    let served = Served::by_live_holders(stepper.requester());
    let BetweenTokens {
        procs, follower, ..
    } = between;
    drop(procs);
    Ok(GenerationReport {
        command: command.to_owned(),
        provider: provider_name,
        holders: args.holders,
        replicas: args.replicas,
        model: ModelSummary {
            source: match &g.model {
                Some(d) => d.display().to_string(),
                None => format!("tiny, drawn from seed {}", g.model_seed),
            },
            parameters: model.config().parameters(),
            config: model.config().clone(),
        },
        holders_ready_s,
        calibration,
        generation: report,
        served,
        directory: follower.map(|f| f.report),
        metrics,
    })
}

/// What every holder process is started with besides its chunks and the provider.
struct HolderFlags<'a> {
    /// The checkpoint directory.
    model: &'a Path,
    context: &'a ContextSpec,
    /// Kernel backends, one per holder in turn.
    backends: &'a [&'a str],
    /// `--metrics-listen` and its address, or nothing.
    metrics: &'a [String],
}

/// Starts the holder processes (prefilling as they start): holder `h` serves chunk `h` and
/// the `replicas - 1` chunks before it.
fn start_holders(
    args: &GenerateArgs,
    provider: &ProviderChoice,
    flags: &HolderFlags<'_>,
) -> Result<Vec<StartingHolder>> {
    let n = args.holders;
    let context_json = serde_json::to_string(flags.context)?;
    (0..n)
        .map(|h| {
            let chunks: Vec<u32> = (0..args.replicas)
                .map(|r| ((h + n - r) % n) as u32)
                .collect();
            let mut extra = vec![
                "--model".to_owned(),
                flags.model.display().to_string(),
                "--context".to_owned(),
                context_json.clone(),
                "--block-tokens".to_owned(),
                args.generation.block_tokens.to_string(),
                "--backend".to_owned(),
                flags.backends[h % flags.backends.len()].to_owned(),
            ];
            extra.extend(directory_flags(&args.directory));
            extra.extend(flags.metrics.iter().cloned());
            start_holder(provider, &chunks, &extra)
        })
        .collect()
}

/// Connects the requester on `engine` to the holders at `addrs`, or (with a directory) to the
/// holders the directory names once it covers every chunk, with a follower of the directory.
fn connect(
    args: &GenerateArgs,
    engine: TransferEngine,
    model: &Model,
    context: &ContextSpec,
    addrs: &[SocketAddr],
) -> Result<(Requester, Option<Follower>)> {
    let config = requester_config(model, context, Duration::from_millis(args.timeout_ms));
    Ok(match &args.directory.directory {
        None => (Requester::connect(engine, addrs, config)?, None),
        Some(url) => {
            let ttl = Duration::from_secs(args.directory.directory_ttl);
            let wait = Duration::from_millis(args.timeout_ms.max(10_000));
            let mut follower = Follower::open(url, ttl, wait)?;
            let config = kvroute_remote::RequesterConfig {
                max_holders: MAX_DIRECTORY_HOLDERS,
                ..config
            };
            let mut req = Requester::connect(engine, &[], config)?;
            follower.await_chunks(&mut req, context.chunks, 0)?;
            (req, Some(follower))
        }
    })
}

/// What the generation does between tokens: kills holder 0 at `--kill-holder-at-token`, and
/// with a directory, tells the follower which holders served and which died and waits for
/// the directory to cover the context's `chunks` again.
struct BetweenTokens {
    procs: Vec<HolderProcess>,
    follower: Option<Follower>,
    kill_at: Option<usize>,
    killed: bool,
    chunks: u32,
}

impl BetweenTokens {
    /// Acts before step `step` (`generated` tokens so far, `last` the previous step's
    /// timing): what it did, if worth saying.
    fn act(
        &mut self,
        step: usize,
        generated: usize,
        last: Option<&TokenTiming>,
        stepper: &mut Stepper,
    ) -> Result<Option<String>, String> {
        let mut said = None;
        if !self.killed && self.kill_at == Some(generated) {
            self.killed = true;
            let p = &mut self.procs[0];
            p.child
                .kill()
                .map_err(|e| format!("killing holder 0: {e}"))?;
            let _ = p.child.wait();
            // SIGKILL leaves its shm regions behind; it is reaped, so they are garbage.
            let _ = kvroute_transport::fabric::remove_shm_regions_of_dead_process(p.child.id());
            said = Some(format!("holder 0 ({}) killed", p.addr));
        }
        if let Some(f) = self.follower.as_mut() {
            for &h in last.map_or(&[][..], |t| &t.holders) {
                f.served(h);
            }
            let req = stepper.requester();
            for h in 0..req.holders() {
                if !req.is_alive(h) {
                    f.dead(h, "a route or fetch to it failed");
                }
            }
            f.await_chunks(req, self.chunks, step as u32)
                .map_err(|e| e.to_string())?;
        }
        Ok(said)
    }
}

impl fmt::Display for GenerationReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = &self.generation;
        let c = &self.model.config;
        let ctx = &g.context;
        writeln!(
            f,
            "kvroute {}: {} holder processes over libfabric {} ({} cop{} of each chunk), model {} \
             ({} layers, {} heads, hidden {}, {:.1}M parameters)",
            self.command,
            self.holders,
            self.provider,
            self.replicas,
            if self.replicas == 1 { "y" } else { "ies" },
            self.model.source,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.hidden_size,
            self.model.parameters.unwrap_or(0) as f64 / 1e6
        )?;
        writeln!(
            f,
            "context: {} chunks x {} tokens, each prefilled by its holder at its canonical \
             positions (holders serving after {:.1} s); {} requests, {}-token prompts",
            ctx.chunks, ctx.chunk_tokens, self.holders_ready_s, ctx.requests, ctx.prompt_tokens
        )?;
        write!(f, "{}", self.calibration)?;
        for r in &g.requests {
            let chunks: Vec<String> = r
                .chunks
                .iter()
                .map(|(c, start)| format!("chunk {c} at {start}"))
                .collect();
            writeln!(f, "request {} ({}):", r.request, chunks.join(", "))?;
            writeln!(f, "  tokens    {:?}", r.tokens)?;
            writeln!(f, "  reference {:?}", r.reference_tokens)?;
            if let Some(d) = &r.first_difference {
                writeln!(
                    f,
                    "  differs at token {}: {} against {}; the reference's top-2 margin there \
                     {:.4} ({} the bf16 bound {})",
                    d.index,
                    d.token,
                    d.reference_token,
                    d.reference_margin,
                    if d.within_bound { "below" } else { "NOT below" },
                    g.margin_bound
                )?;
            }
        }
        let diffs: Vec<String> = g
            .layer_max_abs
            .iter()
            .enumerate()
            .map(|(l, d)| format!("{l}: {d:.2e}"))
            .collect();
        writeln!(
            f,
            "largest hidden-state difference after each layer, step API against one instance: {}",
            diffs.join(", ")
        )?;
        writeln!(f, "largest logit difference: {:.2e}", g.max_logit_diff)?;
        writeln!(
            f,
            "per decode step (every layer; predicted = the calibrated selector's price of the \
             same route rounds and fetches):"
        )?;
        for t in &g.steps {
            writeln!(
                f,
                "  step {:>3}{}: {:>7.2} ms (step API {:.2}: route {:.2} predicted {:.2}, fetch \
                 {:.2} predicted {:.2}, local {:.2}); {} routed, {} fetched, {} cached",
                t.step,
                if t.generating { "" } else { " (prompt)" },
                t.measured_us / 1e3,
                t.attention_us / 1e3,
                t.route_us / 1e3,
                t.predicted_route_us / 1e3,
                t.fetch_us / 1e3,
                t.predicted_fetch_us / 1e3,
                t.local_us / 1e3,
                t.routes,
                t.fetches,
                t.cached
            )?;
        }
        let s = &g.stats;
        writeln!(
            f,
            "step API: {} layer calls; (request, chunk) pairs {} routed, {} fetched, {} from the \
             fetch cache; {} chunk fetches ({:.1} MB), {} fallbacks to a replica",
            s.steps,
            s.routes,
            s.fetches,
            s.cached,
            s.chunk_fetches,
            s.fetched_bytes as f64 / 1e6,
            s.fallbacks
        )?;
        for e in &g.events {
            writeln!(f, "event: {e}")?;
        }
        for e in &g.fallbacks {
            writeln!(f, "fallback: {e}")?;
        }
        if let Some(d) = &self.directory {
            write!(f, "{d}")?;
        }
        for (process, at) in &self.metrics {
            writeln!(f, "metrics of {process}: http://{at}/metrics")?;
        }
        for s in &self.served {
            writeln!(
                f,
                "holder {}: {} query rows attended, {} fetches",
                s.holder, s.rows, s.fetches
            )?;
        }
        writeln!(
            f,
            "{:.1} tokens/s through the step API ({} requests); the single-instance reference \
             in the same run: {:.1} tokens/s ({:.2}x)",
            g.tokens_per_s,
            ctx.requests,
            g.reference_tokens_per_s,
            g.tokens_per_s / g.reference_tokens_per_s
        )?;
        for e in &g.failures {
            writeln!(f, "failure: {e}")?;
        }
        let generated: usize = g.requests.iter().map(|r| r.tokens.len()).sum();
        let same = g
            .requests
            .iter()
            .filter(|r| r.tokens == r.reference_tokens)
            .count();
        write!(
            f,
            "{}",
            if g.passed {
                format!(
                    "passed: {generated} tokens generated, {same} of {} requests identical to \
                     the single-instance reference\n",
                    g.requests.len()
                )
            } else {
                "GENERATION CHECK FAILED\n".to_owned()
            }
        )
    }
}
