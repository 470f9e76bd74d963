//! `kvroute helix run`: one Helix decode layer over N ranks, every output checked against the
//! same layer on one rank, with the phases and the communication HOP-B leaves exposed; and
//! `kvroute helix rank`, one rank process of it.

use std::fmt;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvroute_costmodel::helix::HelixLayout;
use kvroute_helix::{
    Attention, Check, DirRendezvous, Ffn, HelixConfig, HelixRank, Layout, Phases, Reference, Shape,
    StepReport, run_threads,
};
use kvroute_transport::{MemFabric, TransferEngine};
use serde::{Deserialize, Serialize};

use crate::args::{HelixModel, HelixRankArgs, HelixRunArgs, OnOff};
use crate::demo::holders::{fabric_engine, provider_for};

/// One rank's output of one step against the reference.
#[derive(Debug, Clone, Serialize)]
pub struct CheckRow {
    /// The rank.
    pub rank: usize,
    /// The step.
    pub step: u64,
    /// Whether the step ran with HOP-B.
    pub hopb: bool,
    /// Largest absolute difference from the single-rank layer.
    pub max_abs: f64,
    /// What f32 round-off allows.
    pub tolerance: f64,
    /// Within it.
    pub passed: bool,
}

/// Exposed communication with and without HOP-B (medians over ranks and steps), us.
#[derive(Debug, Clone, Serialize)]
pub struct Exposed {
    /// Without HOP-B.
    pub hopb_off: Option<f64>,
    /// With HOP-B.
    pub hopb_on: Option<f64>,
    /// The share of the off setting's exposed time HOP-B hid.
    pub hidden_fraction: Option<f64>,
}

/// Paper 004 appendix A's read times at this shape, beside the phases measured.
#[derive(Debug, Clone, Serialize)]
pub struct RooflineRow {
    /// Read bandwidth of one core here (a 256 MiB sum, best of 3), GB/s: the roofline's
    /// MemBW.
    pub mem_read_gbps: f64,
    /// The model's KV read time per rank, us (f32 elements).
    pub kv_read_us: f64,
    /// The model's weight read time per rank, us (QKV, output projection and FFN, f32).
    pub weight_read_us: f64,
    /// Measured attention per rank and step (median), us.
    pub attention_us: f64,
    /// Measured projection + FFN per rank and step (median), us.
    pub dense_us: f64,
}

/// What `kvroute helix run` prints.
#[derive(Debug, Clone, Serialize)]
pub struct HelixRunReport {
    /// The layer and workload.
    pub config: HelixConfig,
    /// `mem` or the libfabric provider.
    pub provider: String,
    /// CPU and cores.
    pub machine: String,
    /// Every rank's output of every step.
    pub checks: Vec<CheckRow>,
    /// Every rank ran every step and every check passed.
    pub passed: bool,
    /// What failed, per rank.
    pub errors: Vec<String>,
    /// Median phases per rank and step without HOP-B (the first step, a warm-up, left out
    /// when there are more).
    pub phases_hopb_off: Option<Phases>,
    /// The same with HOP-B.
    pub phases_hopb_on: Option<Phases>,
    /// `exposed_comm_us` of both settings.
    pub exposed_comm_us: Exposed,
    /// Bytes of partials each rank writes per step in the all-to-all.
    pub all_to_all_bytes_per_rank: u64,
    /// Those bytes over the exposed time without HOP-B (the all-to-all alone), GB/s.
    pub all_to_all_gbps: Option<f64>,
    /// The model's read times beside the measured phases.
    pub roofline: RooflineRow,
}

/// The KV tokens a run may hold, every request's context and steps together: the ranks' shards
/// and the single-rank reference each hold all of them. Measured with the GQA layer (the
/// larger): 2^19 tokens peak at 2.1 GB resident; 2^20 aborted in an 8 GB address space.
const MAX_KV_TOKENS: u64 = 1 << 19;

fn shape_of(args: &HelixRunArgs) -> Shape {
    match args.model {
        HelixModel::Mla => Shape::deepseek_v3_scaled(args.moe),
        HelixModel::Gqa => Shape::llama_405b_scaled(args.moe),
    }
}

fn config_of(args: &HelixRunArgs) -> Result<HelixConfig> {
    let n = args.ranks;
    if n == 0 || args.tpa == 0 || args.ep == 0 {
        bail!("--ranks, --tpa and --ep must be at least 1");
    }
    let layout = Layout::new(
        args.kvp.unwrap_or(n / args.tpa),
        args.tpa,
        args.tpf.unwrap_or(n / args.ep),
        args.ep,
    )?;
    if layout.ranks() != n {
        bail!("KVP x TPA = {} ranks, not --ranks {n}", layout.ranks());
    }
    let config = HelixConfig {
        layout,
        shape: shape_of(args),
        batch: args.batch,
        ctx: args.ctx,
        stage: args.stage,
        seed: args.seed,
        timeout: Duration::from_millis(args.timeout_ms),
    };
    config.validate()?;
    if args.steps == 0 {
        bail!("--steps must be at least 1");
    }
    let tokens = args.batch as u64 * (args.ctx + args.steps as u64);
    if tokens > MAX_KV_TOKENS {
        bail!(
            "--batch x (--ctx + --steps) = {tokens} tokens of KV: at most {MAX_KV_TOKENS} (the \
             ranks' shards and the reference hold them all in memory)"
        );
    }
    Ok(config)
}

/// One core's read bandwidth: the sum of a 256 MiB buffer, best of 3.
fn read_bandwidth_gbps() -> f64 {
    let data = vec![1f32; 64 << 20];
    let mut best = f64::INFINITY;
    let mut total = 0f32;
    for _ in 0..3 {
        let t = Instant::now();
        total += data.chunks_exact(16).fold([0f32; 16], |mut acc, c| {
            for (a, v) in acc.iter_mut().zip(c) {
                *a += v;
            }
            acc
        })[0];
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(total);
    (data.len() * 4) as f64 / best / 1e9
}

/// What every rank reported, or why it failed.
type RankResults = Vec<std::result::Result<Vec<StepReport>, String>>;

pub(crate) fn run(args: &HelixRunArgs) -> Result<HelixRunReport> {
    let config = config_of(args)?;
    let hopb: Vec<bool> = match args.hopb {
        Some(OnOff::On) => vec![true; args.steps],
        Some(OnOff::Off) => vec![false; args.steps],
        None => (0..args.steps).map(|s| s % 2 == 1).collect(),
    };
    let mem_read_gbps = read_bandwidth_gbps();
    let (results, provider) = if args.provider == "mem" {
        let fabric = MemFabric::new();
        let engines = (0..config.layout.ranks())
            .map(|_| TransferEngine::mem(&fabric, 1))
            .collect::<Result<Vec<_>, _>>()?;
        let results = run_threads(config, engines, &hopb)
            .into_iter()
            .map(|r| r.map_err(|e| e.to_string()))
            .collect();
        (results, "mem".to_owned())
    } else {
        let provider = provider_for(&args.provider)?;
        (
            run_processes(args, &config, &hopb, &provider.to_string())?,
            provider.to_string(),
        )
    };
    // The reference runs the steps some rank completed (all of them, unless one failed).
    let ran = results
        .iter()
        .filter_map(|r| r.as_ref().ok().map(Vec::len))
        .max()
        .unwrap_or(0);
    let mut reference = Reference::new(config)?;
    let expected = (0..ran)
        .map(|_| reference.step())
        .collect::<Result<Vec<_>, _>>()?;
    Ok(report(
        args.steps,
        config,
        provider,
        &results,
        &expected,
        mem_read_gbps,
    ))
}

fn report(
    steps: usize,
    config: HelixConfig,
    provider: String,
    results: &RankResults,
    expected: &[Vec<f32>],
    mem_read_gbps: f64,
) -> HelixRunReport {
    let mut checks = Vec::new();
    let mut errors = Vec::new();
    for (rank, result) in results.iter().enumerate() {
        match result {
            // The library's errors name their rank already.
            Err(e) if e.starts_with(&format!("rank {rank}:")) => errors.push(e.clone()),
            Err(e) => errors.push(format!("rank {rank}: {e}")),
            Ok(reports) => {
                if reports.len() != steps {
                    errors.push(format!("rank {rank}: {} of {steps} steps", reports.len()));
                }
                for (r, want) in reports.iter().zip(expected) {
                    let c = Check::of(&r.output, want);
                    checks.push(CheckRow {
                        rank,
                        step: r.step,
                        hopb: r.hopb,
                        max_abs: c.max_abs,
                        tolerance: c.tolerance,
                        passed: c.passed,
                    });
                }
            }
        }
    }
    let passed = errors.is_empty() && !checks.is_empty() && checks.iter().all(|c| c.passed);
    let steps: Vec<&StepReport> = results
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .flatten()
        .filter(|s| s.step > 0 || steps == 1)
        .collect();
    let phases = |hopb: bool| median_phases(steps.iter().filter(|s| s.hopb == hopb).copied());
    let (off, on) = (phases(false), phases(true));
    let exposed = Exposed {
        hopb_off: off.map(|p| p.exposed_comm_us),
        hopb_on: on.map(|p| p.exposed_comm_us),
        hidden_fraction: off
            .zip(on)
            .map(|(a, b)| 1.0 - b.exposed_comm_us / a.exposed_comm_us),
    };
    let bytes = steps.first().map_or(0, |s| s.all_to_all_bytes);
    let all_to_all_gbps = off
        .filter(|p| p.exposed_comm_us > 0.0 && bytes > 0)
        .map(|p| bytes as f64 / p.exposed_comm_us / 1e3);
    let measured = off.or(on).unwrap_or_default();
    let roofline = roofline(&config, mem_read_gbps, &measured);
    HelixRunReport {
        config,
        provider,
        machine: crate::bench::machine(),
        checks,
        passed,
        errors,
        phases_hopb_off: off,
        phases_hopb_on: on,
        exposed_comm_us: exposed,
        all_to_all_bytes_per_rank: bytes,
        all_to_all_gbps,
        roofline,
    }
}

/// The workspace's one median ([`kvroute_costmodel::fit::median`]); 0 for no values.
fn median(mut v: Vec<f64>) -> f64 {
    kvroute_costmodel::fit::median(&mut v).unwrap_or(0.0)
}

fn median_phases<'a>(steps: impl Iterator<Item = &'a StepReport>) -> Option<Phases> {
    let phases: Vec<Phases> = steps.map(|s| s.phases).collect();
    if phases.is_empty() {
        return None;
    }
    let m = |f: fn(&Phases) -> f64| median(phases.iter().map(f).collect());
    Some(Phases {
        attention_us: m(|p| p.attention_us),
        exposed_comm_us: m(|p| p.exposed_comm_us),
        merge_us: m(|p| p.merge_us),
        projection_us: m(|p| p.projection_us),
        all_reduce_us: m(|p| p.all_reduce_us),
        ffn_us: m(|p| p.ffn_us),
        total_us: m(|p| p.total_us),
    })
}

/// Paper 004 appendix A (kvroute-costmodel's `HelixLayout`) at this layer's shape: MLA's
/// 576-wide latent as one KV head of 2 x 288, a MoE's FFN as the experts a batch can reach
/// per expert group, f32 throughout, MemBW measured here.
fn roofline(config: &HelixConfig, mem_read_gbps: f64, measured: &Phases) -> RooflineRow {
    let shape = config.shape;
    let (kv_heads, head_size) = match shape.attention {
        Attention::Mla => (1, 288),
        Attention::Gqa { kv_heads, head_dim } => (kv_heads, head_dim),
    };
    let ffn_dim = match shape.ffn {
        Ffn::Dense { dim } => dim,
        Ffn::Moe {
            experts,
            top_k,
            dim,
        } => (config.batch * top_k).min(experts) * dim / config.layout.ep,
    };
    let model = HelixLayout {
        batch: config.batch as u32,
        q_heads: shape.q_heads as u32,
        kv_heads: kv_heads as u32,
        head_size: head_size as u32,
        seq_len: config.ctx.max(1),
        ffn_dim: ffn_dim as u32,
        tpa: config.layout.tpa as u32,
        tpf: config.layout.tpf as u32,
        kvp: config.layout.kvp as u32,
        bytes_per_param: 4.0,
        mem_bw_gbps: mem_read_gbps,
    }
    .roofline();
    let (kv_read_us, weight_read_us) =
        model.map_or((f64::NAN, f64::NAN), |r| (r.kv_read_us, r.weight_read_us));
    RooflineRow {
        mem_read_gbps,
        kv_read_us,
        weight_read_us,
        attention_us: measured.attention_us,
        dense_us: measured.projection_us + measured.ffn_us,
    }
}

/// Starts one `kvroute helix rank` process per rank, meeting in a fresh directory, and
/// collects their reports (one JSON line per step, or an error line).
fn run_processes(
    args: &HelixRunArgs,
    config: &HelixConfig,
    hopb: &[bool],
    provider: &str,
) -> Result<RankResults> {
    let (dir, created) = match &args.dir {
        Some(d) => (d.clone(), false),
        None => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let d =
                std::env::temp_dir().join(format!("kvroute-helix-{}-{nanos}", std::process::id()));
            (d, true)
        }
    };
    if std::fs::read_dir(&dir).is_ok_and(|mut d| d.next().is_some()) {
        bail!(
            "{} is not empty: the ranks need a fresh directory",
            dir.display()
        );
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let exe = std::env::current_exe().context("finding the kvroute binary")?;
    let config_json = serde_json::to_string(config)?;
    let schedule: String = hopb.iter().map(|&on| if on { '1' } else { '0' }).collect();
    let mut children = Vec::new();
    for rank in 0..config.layout.ranks() {
        let mut child = Command::new(&exe)
            .args([
                "helix",
                "rank",
                "--provider",
                provider,
                "--schedule",
                &schedule,
            ])
            .args(["--rank", &rank.to_string(), "--config", &config_json])
            .arg("--dir")
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting a rank process")?;
        let stdout = child.stdout.take().context("no rank stdout")?;
        let reader = std::thread::spawn(move || {
            BufReader::new(stdout)
                .lines()
                .map_while(std::result::Result::ok)
                .collect::<Vec<String>>()
        });
        children.push((child, reader));
    }
    // Every rank fails by itself within its timeout once a peer is gone; this is the backstop.
    let deadline =
        Instant::now() + config.timeout * (hopb.len() as u32 + 3) + Duration::from_secs(120);
    let mut results = Vec::new();
    for (rank, (mut child, reader)) in children.into_iter().enumerate() {
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break Some(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let lines = reader.join().unwrap_or_default();
        results.push(parse_rank(rank, status, &lines));
    }
    if created {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(results)
}

/// A rank process's one line per step.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum RankLine {
    Report(StepReport),
    Error(String),
}

fn parse_rank(
    rank: usize,
    status: Option<std::process::ExitStatus>,
    lines: &[String],
) -> std::result::Result<Vec<StepReport>, String> {
    let mut reports = Vec::new();
    for line in lines {
        match serde_json::from_str::<RankLine>(line) {
            Ok(RankLine::Report(r)) => reports.push(r),
            Ok(RankLine::Error(e)) => return Err(e),
            Err(e) => return Err(format!("unreadable line from rank {rank}: {e}")),
        }
    }
    match status {
        None => Err("killed: still running at the run's deadline".to_owned()),
        Some(s) if !s.success() => Err(format!("exited with {s}")),
        Some(_) => Ok(reports),
    }
}

pub(crate) fn rank(args: &HelixRankArgs) -> Result<()> {
    let config: HelixConfig =
        serde_json::from_str(&args.config).context("--config is not a HelixConfig")?;
    let schedule: Vec<bool> = args
        .schedule
        .chars()
        .map(|c| match c {
            '0' => Ok(false),
            '1' => Ok(true),
            other => Err(anyhow::anyhow!("--schedule: {other:?} is neither 0 nor 1")),
        })
        .collect::<Result<_>>()?;
    let print = |line: &RankLine| -> Result<()> {
        println!("{}", serde_json::to_string(line)?);
        Ok(())
    };
    if let Some(addr) = &args.metrics_listen {
        let at = crate::metrics_http::serve(addr)?;
        eprintln!("metrics at http://{at}/metrics");
    }
    let run = || -> Result<()> {
        let provider = provider_for(&args.provider)?;
        let (engine, _) = fabric_engine(&provider)?;
        let rendezvous = DirRendezvous::new(&args.dir);
        let mut rank = HelixRank::start(config, args.rank, engine, &rendezvous)?;
        for &on in &schedule {
            print(&RankLine::Report(rank.step(on)?))?;
        }
        Ok(())
    };
    run().inspect_err(|e| {
        let _ = print(&RankLine::Error(format!("{e:#}")));
    })
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"))
}

impl fmt::Display for HelixRunReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        let l = c.layout;
        writeln!(
            f,
            "helix: {} ranks over {} (KVP {} x TPA {} -> TPF {} x EP {}), {:?} attention, {} FFN",
            l.ranks(),
            self.provider,
            l.kvp,
            l.tpa,
            l.tpf,
            l.ep,
            c.shape.attention,
            match c.shape.ffn {
                Ffn::Dense { dim } => format!("dense {dim}"),
                Ffn::Moe {
                    experts,
                    top_k,
                    dim,
                } => format!("MoE top-{top_k} of {experts} x {dim}"),
            }
        )?;
        writeln!(
            f,
            "  batch {}, context {} (+1 per step, staged by {}), {}",
            c.batch, c.ctx, c.stage, self.machine
        )?;
        let worst = self.checks.iter().map(|c| c.max_abs).fold(0f64, f64::max);
        let failed = self.checks.iter().filter(|c| !c.passed).count();
        writeln!(
            f,
            "checks: {} outputs against the single-rank layer, {failed} failed, max |error| {worst:.2e}",
            self.checks.len()
        )?;
        for e in &self.errors {
            writeln!(f, "  error: {e}")?;
        }
        writeln!(
            f,
            "phases per rank and step (median, us): attention | exposed comm | merge | projection | all-reduces | FFN | total"
        )?;
        for (name, p) in [
            ("HOP-B off", self.phases_hopb_off),
            ("HOP-B on ", self.phases_hopb_on),
        ] {
            if let Some(p) = p {
                writeln!(
                    f,
                    "  {name}: {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0}",
                    p.attention_us,
                    p.exposed_comm_us,
                    p.merge_us,
                    p.projection_us,
                    p.all_reduce_us,
                    p.ffn_us,
                    p.total_us
                )?;
            }
        }
        let e = &self.exposed_comm_us;
        writeln!(
            f,
            "exposed all-to-all: {} us without HOP-B, {} us with{}",
            opt(e.hopb_off),
            opt(e.hopb_on),
            e.hidden_fraction
                .map_or(String::new(), |h| format!(" ({:.0}% hidden)", 100.0 * h))
        )?;
        writeln!(
            f,
            "all-to-all: {} B written per rank and step{}",
            self.all_to_all_bytes_per_rank,
            self.all_to_all_gbps.map_or(String::new(), |g| format!(
                ", {g:.2} GB/s over its exposed time"
            ))
        )?;
        let r = &self.roofline;
        writeln!(
            f,
            "roofline (paper 004 appendix A, f32, MemBW {:.1} GB/s measured): KV {:.0} us, weights {:.0} us; measured attention {:.0} us, projection + FFN {:.0} us",
            r.mem_read_gbps, r.kv_read_us, r.weight_read_us, r.attention_us, r.dense_us
        )?;
        write!(f, "{}", if self.passed { "passed\n" } else { "FAILED\n" })
    }
}
