//! `kvroute demo`, `kvroute holder` and `kvroute requester`: the main job end to end (paper
//! 000), composed from `kvroute-remote`.
//!
//! By default the demo is `kvroute generate` (`generation.rs`): holder processes prefill a
//! shared context through a model and serve it, and this process generates tokens through the
//! step API, checked against one instance (`kvroute_decode`). With `--attention-checks` it
//! starts holder processes (copies of this binary running `kvroute holder`) that each
//! generate and serve chunks of a DeepSeek-V2-Lite-shaped synthetic corpus over libfabric,
//! connects a requester to them, calibrates the selector on them, and drives the checked
//! decode steps of `kvroute_remote::checked` through the step API: R requests a step, each
//! with its own KV and shared or private chunks placed past its prompt, then a sparse step
//! whose top-2048 selection is scattered over every holder. Per (request, chunk) the selector
//! picks route or fetch (sparse: route or gather), or `--force` does; each route round and
//! each step's fetches are printed beside the selector's price of the same work. Every output
//! is checked against single-instance attention over the same context, computed from a full
//! copy; every checked output has a part that crossed the wire. A failed check fails the run.
//!
//! This module holds the processes (`holders.rs`), the directory's follower (`follow.rs`),
//! the generation's orchestration and printing (`generation.rs`), the attention checks'
//! connection and loop (`steps.rs`) and their report's printing.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use kvroute_remote::checked::{CheckedReport, Timing, spans};
use kvroute_remote::step::StepStats;
use serde::Serialize;

use crate::args::{DemoArgs, RequesterArgs};
use crate::calibrate::CalibrationSummary;

mod follow;
mod generation;
pub(crate) mod holders;
mod steps;

pub use follow::DirectoryReport;
pub use generation::{GenerationReport, ModelSummary};
pub(crate) use holders::{
    HolderProcess, fabric_engine_with, holder, provider_for, spawn_holder, v2_lite_corpus,
};
use holders::{corpus, corpus_of, spawn_holders};
use steps::{Discovery, decode_steps};

/// DeepSeek-V2-Lite's softmax scale (kernels' `deepseek_softmax_scale(192, 40, 0.707)`).
pub(crate) const SCALE: f32 = 0.1147;
/// Query heads of DeepSeek-V2-Lite: query rows per decode token.
const HEADS: usize = 16;
/// Top-k of the sparse step (DeepSeek-V3.2's `index_topk`).
const TOPK: usize = 2048;
/// Through the wire: o in bf16 (the step API's bound for routed outputs).
pub(crate) use kvroute_remote::checked::BF16_TOL;

/// What one holder served over the run, from its own counters.
#[derive(Debug, Clone, Serialize)]
pub struct Served {
    /// Its control address.
    pub holder: String,
    /// Query rows it attended (the start-up probe's routes included).
    pub rows: u64,
    /// Of `rows`, those attended on a GPU.
    pub gpu_rows: u64,
    /// Chunks fetched from it.
    pub fetches: u64,
}

impl Served {
    /// What each holder of `req` still answering served, from its own counters.
    pub(crate) fn by_live_holders(req: &mut kvroute_remote::Requester) -> Vec<Self> {
        let live: Vec<usize> = (0..req.holders()).filter(|&h| req.is_alive(h)).collect();
        live.into_iter()
            .filter_map(|h| {
                let stats = req.holder_stats(h).ok()?;
                Some(Self {
                    holder: req.holder_addr(h)?.to_string(),
                    rows: stats.rows,
                    gpu_rows: stats.gpu_rows,
                    fetches: stats.fetches,
                })
            })
            .collect()
    }
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
    /// The selector's start-up calibration: every constant it prices with, where it came
    /// from and how old it is.
    pub calibration: CalibrationSummary,
    /// Requests a dense step.
    pub requests: usize,
    /// Decisions, timings, checks and failures of the checked steps.
    #[serde(flatten)]
    pub checked: CheckedReport,
    /// The step API's counters over the run.
    pub stats: StepStats,
    /// What each holder still answering at the end served.
    pub served: Vec<Served>,
    /// Whether every check passed.
    pub passed: bool,
    /// Each decode step's wall time, ms: applying the directory's newest view (with one),
    /// the step's layer calls and their checks; the pauses between steps are not counted.
    pub step_ms: Vec<f64>,
    /// With a directory: what it held, what changed, and how each holder was used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub directory: Option<DirectoryReport>,
}

impl fmt::Display for DemoReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write_setup(f)?;
        self.write_decisions(f)?;
        self.write_timings(f)?;
        self.write_served(f)?;
        self.write_checks(f)
    }
}

impl DemoReport {
    /// What ran, the probe sweep and its fit, and the selector's calibration.
    fn write_setup(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "kvroute {}: {} holder processes over libfabric {}, DeepSeek-V2-Lite corpus of {} chunks x {} tokens x {} layers, {} requests a step",
            self.command,
            self.holders,
            self.provider,
            self.chunks,
            self.chunk_tokens,
            self.layers,
            self.requests
        )?;
        let sweep: Vec<String> = self
            .probe_sweep
            .iter()
            .map(|(m, t)| format!("Mq={m}: {t:.0} us"))
            .collect();
        writeln!(
            f,
            "probe sweep (one-entry routes, staging to checked reply, minus the holder's kernel; median of {}): {}",
            kvroute_remote::probe::ProbeConfig::default().reps,
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
        write!(f, "{}", self.calibration)
    }

    /// The selector's decisions, one line per kind with every step and request it covers.
    fn write_decisions(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.checked;
        writeln!(f, "decisions (request, chunk):")?;
        for d in &c.decisions {
            let on = d
                .holder
                .as_ref()
                .map_or_else(String::new, |h| format!(" on {h}"));
            let requests: Vec<u32> = d.requests.iter().map(|&r| r as u32).collect();
            writeln!(
                f,
                "  steps {} requests {} {}chunk {} Mq={}: {}{on} ({})",
                spans(&d.steps),
                spans(&requests),
                if d.sparse { "sparse " } else { "" },
                d.chunk,
                d.mq,
                d.choice,
                d.reason
            )?;
        }
        Ok(())
    }

    /// Predicted against measured times: per step and kind, then each kind's median error.
    fn write_timings(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.checked;
        if !c.timings.is_empty() {
            writeln!(
                f,
                "predicted (calibrated selector: the constants above, refitted as the run goes) vs measured, the same work on both sides:"
            )?;
        }
        let mut keys: Vec<(u32, &str)> = Vec::new();
        for t in &c.timings {
            if !keys.contains(&(t.step, t.kind)) {
                keys.push((t.step, t.kind));
            }
        }
        for (step, kind) in keys {
            let ts: Vec<&Timing> = c
                .timings
                .iter()
                .filter(|t| t.step == step && t.kind == kind)
                .collect();
            let predicted: f64 = ts.iter().map(|t| t.predicted_us).sum();
            let measured: f64 = ts.iter().map(|t| t.measured_us).sum();
            writeln!(
                f,
                "  step {step}: {} x {kind}: predicted {:.2} ms, measured {:.2} ms ({:+.0}%)",
                ts.len(),
                predicted / 1e3,
                measured / 1e3,
                100.0 * (predicted - measured) / measured
            )?;
        }
        let mut kinds: Vec<&str> = c.timings.iter().map(|t| t.kind).collect();
        kinds.sort_unstable();
        kinds.dedup();
        for kind in kinds {
            let mut errors: Vec<f64> = c
                .timings
                .iter()
                .filter(|t| t.kind == kind)
                .map(|t| (100.0 * (t.predicted_us - t.measured_us) / t.measured_us).abs())
                .collect();
            let count = errors.len();
            writeln!(
                f,
                "  {kind}: median |error| {:.0}% over {count}",
                kvroute_costmodel::fit::median(&mut errors).unwrap_or(f64::NAN),
            )?;
        }
        Ok(())
    }

    /// The step API's counters, gathers, failures, the directory and what each holder served.
    fn write_served(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.checked;
        let s = &self.stats;
        writeln!(
            f,
            "step API: {} layer calls; (request, chunk) pairs {} routed, {} fetched, {} from the fetch cache, {} gathered; {} chunk fetches ({:.1} MB), {} fallbacks to a replica",
            s.steps,
            s.routes,
            s.fetches,
            s.cached,
            s.gathers,
            s.chunk_fetches,
            s.fetched_bytes as f64 / 1e6,
            s.fallbacks
        )?;
        for t in &c.gather_us {
            writeln!(f, "sparse gather (one layer): {t:.0} us")?;
        }
        for e in &c.failures {
            writeln!(f, "failure: {e}")?;
        }
        if let Some(d) = &self.directory {
            write!(f, "{d}")?;
        }
        for s in &self.served {
            writeln!(
                f,
                "holder {}: {} query rows attended ({} on a GPU), {} fetches",
                s.holder, s.rows, s.gpu_rows, s.fetches
            )?;
        }
        Ok(())
    }

    /// Every check against single-instance attention, and the verdict.
    fn write_checks(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.checked;
        writeln!(
            f,
            "checks (max abs of o against single-instance attention over the same context):"
        )?;
        for c in &c.checks {
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

/// `kvroute generate`.
pub(crate) fn generate(args: &crate::args::GenerateArgs) -> Result<GenerationReport> {
    generation::run("generate", args)
}

/// `kvroute demo` without `--attention-checks`: the generation, with the demo's flags.
pub(crate) fn demo_generation(args: &DemoArgs) -> Result<GenerationReport> {
    let run = &args.run;
    if args.kill_holder_at_step.is_some() {
        bail!(
            "--kill-holder-at-step is for --attention-checks; the generation takes --kill-holder-at-token"
        );
    }
    let generate = crate::args::GenerateArgs {
        holders: args.holders,
        provider: args.provider.clone(),
        seed: args.seed,
        tokens: args.tokens,
        requests: run.batch,
        replicas: args.replicas,
        force: run.force,
        timeout_ms: run.timeout_ms,
        poll_ms: run.poll_ms,
        directory: args.directory.clone(),
        holder_backend: args.holder_backend.clone(),
        metrics_listen: args.metrics_listen.clone(),
        generation: args.generation.clone(),
    };
    generation::run("demo", &generate)
}

/// `kvroute demo --attention-checks`.
pub(crate) fn run(args: &DemoArgs) -> Result<DemoReport> {
    if !(2..=8).contains(&args.holders) || args.replicas == 0 || args.replicas > args.holders {
        bail!("--holders must be 2 to 8 and --replicas 1 to --holders");
    }
    let spec = corpus(args)?;
    let provider = provider_for(&args.provider)?;
    let mut procs = spawn_holders(args, &spec, &provider)?;
    let addrs: Vec<SocketAddr> = procs.iter().map(|p| p.addr).collect();
    let steps = (&args.run, args.seed);
    let discovery = match &args.directory.directory {
        None => Discovery::Addrs(&addrs),
        Some(url) => Discovery::Directory {
            url,
            ttl: Duration::from_secs(args.directory.directory_ttl),
            wait: Duration::from_millis(args.run.timeout_ms.max(10_000)),
        },
    };
    let report = decode_steps("demo", &spec, &provider, discovery, steps, &mut |step| {
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

/// `kvroute requester`.
pub(crate) fn requester(args: &RequesterArgs) -> Result<DemoReport> {
    if let Some(addr) = &args.metrics_listen {
        let at = crate::metrics_http::serve(addr)?;
        eprintln!("metrics at http://{at}/metrics");
    }
    let spec = corpus_of(&args.corpus)?;
    let provider = provider_for(&args.provider)?;
    let steps = (&args.run, args.seed);
    let addrs;
    let discovery = match &args.directory.directory {
        Some(url) => Discovery::Directory {
            url,
            ttl: Duration::from_secs(args.directory.directory_ttl),
            wait: Duration::from_millis(args.wait_ms),
        },
        None => {
            addrs = holder_addrs(args)?;
            Discovery::Addrs(&addrs)
        }
    };
    let report = decode_steps("requester", &spec, &provider, discovery, steps, &mut |_| {
        Ok(None)
    });
    if args.metrics_listen.is_some() {
        std::thread::sleep(Duration::from_millis(args.metrics_linger_ms));
    }
    report
}
