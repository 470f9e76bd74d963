//! `kvroute demo`, `kvroute holder` and `kvroute requester`: the main job end to end (paper
//! 000), composed from `kvroute-remote`.
//!
//! The demo starts holder processes (copies of this binary running `kvroute holder`) that each
//! generate and serve chunks of a DeepSeek-V2-Lite-shaped synthetic corpus over libfabric,
//! connects a requester to them and calibrates the selector on them (`calibrate.rs`:
//! the fabric from a probe sweep, each holder's own kernel report, the merge and the splice
//! measured here, one pull), then runs decode steps: per (chunk, request) the selector picks
//! route, fetch or local (or `--force` does), dense steps attend every chunk of the document
//! and a sparse step attends a top-2048 selection scattered over all holders. Each route (one
//! chunk, one layer) and fetch (one chunk, every layer) is timed and printed beside the
//! selector's price of it, and fed back to the selector. Every merged output is checked
//! against single-instance attention over the whole document, computed here from a full copy.
//! Every checked output crossed the wire: routed partials (bf16 on the wire), chunks fetched
//! and spliced here, rows gathered from the holders. A failed check fails the run.
//!
//! `local` has no model weights to run here: its output is the full copy's attention and its
//! cost is the cost model's `ct x L x c` term, not a measurement.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use kvroute_costmodel::Primitive;
use kvroute_kernels::Partial;
use serde::Serialize;

use crate::args::{DemoArgs, RequesterArgs};
use crate::calibrate::CalibrationSummary;

mod follow;
pub(crate) mod holders;
mod steps;

pub use follow::DirectoryReport;
pub(crate) use holders::{
    HolderProcess, fabric_engine, fabric_engine_with, holder, provider_for, spawn_holder,
    v2_lite_corpus,
};
use holders::{corpus, corpus_of, spawn_holders};
use steps::{Discovery, decode_steps};

/// DeepSeek-V2-Lite's softmax scale (kernels' `deepseek_softmax_scale(192, 40, 0.707)`).
pub(crate) const SCALE: f32 = 0.1147;
/// Query heads of DeepSeek-V2-Lite: query rows per decode token.
const HEADS: usize = 16;
/// Top-k of the sparse step (DeepSeek-V3.2's `index_topk`).
const TOPK: usize = 2048;
/// Fetched chunks and gathered rows, attended here: exact bf16 KV, so f32 round-off. The
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

/// One decision, logged once per distinct input (every chunk of a dense step has the same
/// size, so one decision covers them all, and every step of the same shape).
#[derive(Debug, Clone, Serialize)]
pub struct Decided {
    /// The first decode step it was taken for.
    pub step: u32,
    /// The first chunk it covers (`u32::MAX`: the sparse step's selection, over every holder).
    pub chunk: u32,
    /// Every step it was taken for.
    pub steps: Vec<u32>,
    /// Every chunk it covers (empty for the sparse selection).
    pub chunks: Vec<u32>,
    /// Query rows.
    pub mq: u32,
    /// What was chosen.
    pub choice: String,
    /// The replica the selector priced it on (its control address; none for local and for
    /// the sparse step, which goes to every holder).
    pub holder: Option<String>,
    /// Why (the predicate's reason, or "forced").
    pub reason: String,
}

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

/// One prediction beside the measurement of the same thing.
#[derive(Debug, Clone, Serialize)]
pub struct Timing {
    /// The decode step.
    pub step: u32,
    /// The kind of thing timed: the unit both sides cover.
    pub kind: &'static str,
    /// The holder that served it (its control address), for a route or fetch of one chunk.
    pub holder: Option<String>,
    /// Which one (chunk, layer).
    pub what: String,
    /// The primitive run.
    pub primitive: Primitive,
    /// The calibrated selector's price of it, microseconds.
    pub predicted_us: f64,
    /// Its measured time, microseconds.
    pub measured_us: f64,
    /// The prediction term by term, as priced at the time: the start-up calibration at first,
    /// then as the selector refits it from the run's own routes and pulls and the holders
    /// refit their kernels from the calls they serve.
    pub predicted: kvroute_costmodel::CostBreakdown,
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
    /// Each decision.
    pub decisions: Vec<Decided>,
    /// Every prediction beside its measurement.
    pub timings: Vec<Timing>,
    /// Route round trips of the decode steps, one chunk and one layer each (submit to its
    /// partial merged from the wire), microseconds.
    pub route_us: Vec<f64>,
    /// Fetch transfer and splice times, microseconds.
    pub fetch_us: Vec<(f64, f64)>,
    /// Sparse fetches: gather transfer times (every checked layer's selected rows from every
    /// holder), microseconds.
    pub gather_us: Vec<f64>,
    /// Holder failures seen and what was done about them.
    pub failures: Vec<String>,
    /// What each holder still answering at the end served.
    pub served: Vec<Served>,
    /// The checks.
    pub checks: Vec<Check>,
    /// Whether every check passed.
    pub passed: bool,
    /// With a directory: what it held, what changed, and how each holder was used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub directory: Option<DirectoryReport>,
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
        write!(f, "{}", self.calibration)?;
        for d in &self.decisions {
            let what = if d.chunk == u32::MAX {
                "sparse".to_owned()
            } else {
                format!("chunks {}", spans(&d.chunks))
            };
            let on = d
                .holder
                .as_ref()
                .map_or_else(String::new, |h| format!(" on {h}"));
            writeln!(
                f,
                "  steps {} {what} Mq={}: {}{on} ({})",
                spans(&d.steps),
                d.mq,
                d.choice,
                d.reason
            )?;
        }
        if !self.timings.is_empty() {
            writeln!(
                f,
                "predicted (calibrated selector: the constants above, refitted as the run goes) vs measured, the same thing on both sides:"
            )?;
        }
        let mut keys: Vec<(u32, &str)> = self.timings.iter().map(|t| (t.step, t.kind)).collect();
        keys.dedup();
        for (step, kind) in keys {
            let ts: Vec<&Timing> = self
                .timings
                .iter()
                .filter(|t| t.step == step && t.kind == kind)
                .collect();
            let predicted: f64 = ts.iter().map(|t| t.predicted_us).sum();
            let measured: f64 = ts.iter().map(|t| t.measured_us).sum();
            // The fabric's fixed cost the step was priced with (it moves once live routes
            // refit it).
            let mut fixed: Vec<f64> = ts.iter().map(|t| t.predicted.probe_us).collect();
            fixed.sort_by(f64::total_cmp);
            let fixed = match (fixed.first(), fixed.last()) {
                (Some(&lo), Some(&hi)) if hi > 0.0 && hi - lo < 0.5 => {
                    format!(", fabric fixed cost {lo:.0} us")
                }
                (Some(&lo), Some(&hi)) if hi > 0.0 => {
                    format!(", fabric fixed cost {lo:.0}-{hi:.0} us")
                }
                _ => String::new(),
            };
            writeln!(
                f,
                "  step {step}: {} x {kind}: predicted {:.2} ms, measured {:.2} ms ({:+.0}%){fixed}",
                ts.len(),
                predicted / 1e3,
                measured / 1e3,
                100.0 * (predicted - measured) / measured
            )?;
        }
        let mut kinds: Vec<&str> = self.timings.iter().map(|t| t.kind).collect();
        kinds.sort_unstable();
        kinds.dedup();
        for kind in kinds {
            let mut errors: Vec<f64> = self
                .timings
                .iter()
                .filter(|t| t.kind == kind)
                .map(|t| (100.0 * (t.predicted_us - t.measured_us) / t.measured_us).abs())
                .collect();
            errors.sort_by(f64::total_cmp);
            writeln!(
                f,
                "  {kind}: median |error| {:.0}% over {}",
                errors[errors.len() / 2],
                errors.len()
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

/// `0-2, 5` for `[0, 1, 2, 5]`.
fn spans(values: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < values.len() {
        let mut j = i;
        while j + 1 < values.len() && values[j + 1] == values[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            values[i].to_string()
        } else {
            format!("{}-{}", values[i], values[j])
        });
        i = j + 1;
    }
    out.join(", ")
}

fn check(checks: &mut Vec<Check>, name: String, got: &Partial, want: &Partial, tolerance: f32) {
    let max_abs = if got.rows() == want.rows() {
        kvroute_remote::measure::max_abs(got, want)
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
    decode_steps("requester", &spec, &provider, discovery, steps, &mut |_| {
        Ok(None)
    })
}
