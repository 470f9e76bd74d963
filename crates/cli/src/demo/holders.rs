//! The holder side of the demo: `kvroute holder` (one process serving chunks of the synthetic
//! corpus), the demo's holder processes, and the engines and corpora both sides open.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use kvroute_costmodel::model_preset;
use kvroute_kvstore::{ChunkId, CorpusSpec};
use kvroute_remote::{HeldChunks, Holder, HolderConfig};
use kvroute_transport::{EngineConfig, FabricConfig, Progress, ProviderChoice, TransferEngine};
use nix::sys::signal::{SigSet, Signal};

use crate::args::{CorpusArgs, DemoArgs, HolderArgs, Lifeline, ProgressArg};

/// `verbs` names kvroute's verbs domain (ConnectX and other RDMA NICs), not libfabric's
/// provider of that name. Commands that cannot drive it yet (the libfabric benchmarks) call
/// this: where the domain cannot open it names what is missing, where it can it says so.
pub(crate) fn refuse_verbs(name: &str) -> Result<()> {
    if name != "verbs" {
        return Ok(());
    }
    let engine = TransferEngine::verbs(
        &kvroute_transport::VerbsConfig::default(),
        EngineConfig::default(),
    )?;
    engine.shutdown();
    anyhow::bail!(
        "verbs: this command measures libfabric providers; for verbs, use perftest's ib_write_bw and ib_write_lat (docs/fabric.md)"
    )
}

/// Where the verbs domain cannot open, the error naming what is missing (checked before a
/// command starts processes that would each fail alike).
fn check_verbs(name: &str) -> Result<()> {
    if name == "verbs" {
        kvroute_transport::verbs::sys::probe(None)?;
    }
    Ok(())
}

pub(crate) fn provider_for(name: &str) -> Result<ProviderChoice> {
    check_verbs(name)?;
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

/// [`fabric_engine`] for a requester that waits `timeout` for a holder: a transfer is given
/// as long (at least the engine's 3 s) before the engine fails it, so that a requester told
/// to wait 20 s is not failed after 3 by a write that is slow to complete (32 requesters at
/// once over shm on two cores).
pub(crate) fn requester_engine(
    provider: &ProviderChoice,
    timeout: Duration,
) -> Result<(TransferEngine, String)> {
    engine_on(provider, ProgressArg::Thread, timeout.max(OP_TIMEOUT))
}

/// How long the engine gives a transfer before failing it, where not told otherwise.
const OP_TIMEOUT: Duration = Duration::from_secs(3);

/// An engine on `provider`; with worker threads, idle workers poll every 50 us (several
/// processes share two cores here), with manual progress the caller's thread polls.
pub(crate) fn fabric_engine_with(
    provider: &ProviderChoice,
    progress: ProgressArg,
) -> Result<(TransferEngine, String)> {
    engine_on(provider, progress, OP_TIMEOUT)
}

fn engine_on(
    provider: &ProviderChoice,
    progress: ProgressArg,
    op_timeout: Duration,
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
        op_timeout,
        ..FabricConfig::default()
    };
    if provider.to_string() == "verbs" {
        let engine =
            TransferEngine::verbs(&kvroute_transport::VerbsConfig::default(), engine_config)?;
        return Ok((engine, "verbs".to_owned()));
    }
    let (engine, report) = TransferEngine::fabric(&config, engine_config)?;
    Ok((engine, report.provider))
}

/// The corpus: DeepSeek-V2-Lite's 27 layers, RoPE theta 10000 with its YaRN scaling.
pub(super) fn corpus(args: &DemoArgs) -> Result<CorpusSpec> {
    v2_lite_corpus(args.tokens, args.holders as u32, args.seed)
}

/// The corpus `--corpus` gives, or DeepSeek-V2-Lite's of the sizes given.
pub(super) fn corpus_of(args: &CorpusArgs) -> Result<CorpusSpec> {
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

/// Tokens per block of a holder's paged cache of a model's chunks, where not given.
pub(crate) const DEFAULT_BLOCK_TOKENS: usize = 64;

/// `kvroute holder`.
pub(crate) fn holder(args: &HolderArgs) -> Result<()> {
    let started_unix_ms = kvroute_kvstore::directory::unix_ms();
    let backend: kvroute_kernels::Backend = args.backend.parse().context("--backend")?;
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
    let defaults = HolderConfig::default();
    let config = HolderConfig {
        backend,
        max_requesters: args.max_requesters,
        // Every session needs its control connection.
        max_connections: args.max_connections.max(args.max_requesters),
        max_per_source: args.max_per_source.max(args.max_requesters),
        proof_timeout: Duration::from_millis(args.proof_timeout_ms),
        idle_evict: Duration::from_millis(args.idle_evict_ms),
        open_timeout: Duration::from_millis(args.open_timeout_ms),
        slot_bytes: args.slot_bytes,
        reply_bytes: args.slot_bytes,
        ..defaults
    };
    let held = match (&args.model, &args.context) {
        (Some(dir), Some(context)) => {
            let model = kvroute_model::Model::load(dir)
                .with_context(|| format!("--model {}", dir.display()))?;
            let context: kvroute_decode::context::ContextSpec =
                serde_json::from_str(context).context("--context is not a ContextSpec")?;
            let block = args.block_tokens.unwrap_or(DEFAULT_BLOCK_TOKENS);
            kvroute_decode::held::held_chunks(&model, &engine, &context, &chunks, block)
                .context("prefilling the chunks")?
        }
        _ => {
            let spec = corpus_of(&args.corpus)?;
            match args.block_tokens {
                None => HeldChunks::generate(&engine, &spec, &chunks)?,
                Some(block) => {
                    HeldChunks::generate_paged(&engine, &spec, &chunks, block, spec.seed)?
                }
            }
        }
    };
    let listener =
        TcpListener::bind(&args.listen).with_context(|| format!("listening on {}", args.listen))?;
    let metrics = match &args.metrics_listen {
        Some(addr) => Some(crate::metrics_http::serve(addr)?),
        None => None,
    };
    let holder = Holder::start(engine, listener, held, config)?;
    let resident = holder.stats().gpu_resident_bytes;
    tracing::info!(
        backend = %args.backend,
        gpu_resident_mb = resident as f64 / 1e6,
        "serving"
    );
    // Registered before the address is printed: a parent that reads it knows the directory
    // offers this holder.
    let registration = match &args.directory.directory {
        None => None,
        Some(url) => {
            let dir = kvroute_kvstore::directory::open(
                url,
                Duration::from_secs(args.directory.directory_ttl),
            )?;
            let (mut record, chunks) = holder.directory_records(args.replica);
            record.started_unix_ms = started_unix_ms;
            let registration = dir
                .register(record, chunks)
                .with_context(|| format!("registering in {}", dir.describe()))?;
            tracing::info!(directory = %dir.describe(), "registered");
            Some((dir, registration))
        }
    };
    println!(
        "{}",
        serde_json::json!({
            "listen": holder.addr().to_string(),
            "metrics": metrics.map(|a| a.to_string()),
        })
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
    // Out of the directory first, so no requester picks a holder about to go.
    if let Some((dir, registration)) = registration
        && let Err(e) = registration.revoke()
    {
        tracing::warn!(directory = %dir.describe(), %e, "leaving the directory");
    }
    // Dropped, not killed: the engine closes its endpoints (shm unlinks its region).
    drop(holder);
    Ok(())
}

pub(crate) struct HolderProcess {
    pub(crate) child: Child,
    pub(crate) addr: SocketAddr,
    /// Where it serves its metrics, if asked to.
    pub(crate) metrics: Option<SocketAddr>,
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

pub(super) fn spawn_holders(
    args: &DemoArgs,
    spec: &CorpusSpec,
    provider: &ProviderChoice,
) -> Result<Vec<HolderProcess>> {
    let n = args.holders;
    // Every name checked before any holder starts.
    let backends = args
        .holder_backend
        .split(',')
        .map(|name| {
            let name = name.trim();
            name.parse::<kvroute_kernels::Backend>()
                .map(|_| name)
                .with_context(|| format!("--holder-backend {name}"))
        })
        .collect::<Result<Vec<_>>>()?;
    (0..n)
        .map(|h| {
            let chunks: Vec<u32> = (0..args.replicas)
                .map(|r| ((h + n - r) % n) as u32)
                .collect();
            let mut extra = directory_flags(&args.directory);
            let backend = backends[h % backends.len()];
            extra.extend(["--backend".to_owned(), backend.to_owned()]);
            if let Some(block) = args.holder_block_tokens {
                extra.extend(["--block-tokens".to_owned(), block.to_string()]);
            }
            spawn_holder(spec, provider, &chunks, &extra)
        })
        .collect()
}

/// The holder flags that register it in `dir`'s directory, if one is named.
pub(crate) fn directory_flags(dir: &crate::args::DirectoryArgs) -> Vec<String> {
    match &dir.directory {
        None => Vec::new(),
        Some(url) => vec![
            "--directory".to_owned(),
            url.clone(),
            "--directory-ttl".to_owned(),
            dir.directory_ttl.to_string(),
        ],
    }
}

/// Starts one `kvroute holder` process serving `chunks` of `spec`, with `extra` arguments,
/// and waits for its control address.
pub(crate) fn spawn_holder(
    spec: &CorpusSpec,
    provider: &ProviderChoice,
    chunks: &[u32],
    extra: &[String],
) -> Result<HolderProcess> {
    let corpus = serde_json::to_string(spec)?;
    let mut args = vec!["--corpus".to_owned(), corpus];
    args.extend_from_slice(extra);
    start_holder(provider, chunks, &args)?.ready()
}

/// A holder process started, its control address not read yet: holders that prefill their
/// chunks before serving start side by side, and are waited for after.
pub(crate) struct StartingHolder {
    child: Child,
    chunks: String,
}

/// Starts one `kvroute holder` process serving `chunks`, with `args` (where its chunks come
/// from, and any other flag); [`StartingHolder::ready`] waits for its control address.
pub(crate) fn start_holder(
    provider: &ProviderChoice,
    chunks: &[u32],
    args: &[String],
) -> Result<StartingHolder> {
    let exe = std::env::current_exe().context("finding the kvroute binary")?;
    let chunks: Vec<String> = chunks.iter().map(u32::to_string).collect();
    let h = chunks.join(",");
    let child = Command::new(&exe)
        .args([
            "holder",
            "--provider",
            &provider.to_string(),
            "--chunks",
            &h,
            "--lifeline",
            "stdin",
        ])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting a holder process")?;
    Ok(StartingHolder { child, chunks: h })
}

impl StartingHolder {
    /// Waits for the holder's control address (the line it prints once it serves).
    pub(crate) fn ready(mut self) -> Result<HolderProcess> {
        let h = std::mem::take(&mut self.chunks);
        let stdout: Option<ChildStdout> = self.child.stdout.take();
        // From here on a failure still stops the child (HolderProcess's drop).
        let mut proc = HolderProcess {
            child: self.child,
            addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            metrics: None,
        };
        let stdout = stdout.ok_or_else(|| anyhow!("no holder stdout"))?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let v: serde_json::Value = serde_json::from_str(&line)
            .with_context(|| format!("holder of chunks {h} said: {line:?}"))?;
        proc.addr = v["listen"]
            .as_str()
            .ok_or_else(|| anyhow!("holder of chunks {h} gave no address"))?
            .parse()?;
        proc.metrics = v["metrics"].as_str().and_then(|a| a.parse().ok());
        Ok(proc)
    }
}
