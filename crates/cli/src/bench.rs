//! `kvroute bench transport`: the transfer engine's measurements with their baselines and the
//! targets they are held to.

use std::fmt;

use anyhow::Result;
use kvroute_transport::bench::{self, PagedThroughput, ScatterPosting, SubmitLatency};
use serde::Serialize;

use crate::args::TransportBenchArgs;

/// Paper 002 table 8 reports ~1.4 us p50 from the application call to the first posted write;
/// the target here is 1.0 us or less.
const SUBMIT_P50_TARGET_NS: f64 = 1000.0;
/// Paged writes of 1 KiB pages on one worker.
const PAGED_1K_TARGET_PER_S: f64 = 5e6;
/// The same, against one thread copying the same pages.
const PAGED_OF_MEMCPY_TARGET: f64 = 0.8;
/// Paper 002 table 9: 8.5 us p50 to post 64 scatter writes on ConnectX-7; the target is 5 us.
const SCATTER_64_TARGET_NS: f64 = 5000.0;

/// One target and whether the run met it.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    /// What is held to it.
    pub what: &'static str,
    /// The bound.
    pub target: &'static str,
    /// The measured value, in the bound's unit.
    pub measured: f64,
    /// Whether it was met.
    pub met: bool,
    /// What bounds it on this machine, measured in the same run (printed where the target
    /// is missed): a baseline that misses the target itself shows the target out of reach.
    pub bound: Option<String>,
}

impl Target {
    /// A target without a bound.
    pub(crate) fn new(what: &'static str, target: &'static str, measured: f64, met: bool) -> Self {
        Self {
            what,
            target,
            measured,
            met,
            bound: None,
        }
    }
}

/// Writes a report's `targets` section, measured values with `decimals` places (at least two
/// below 10, where the value is a ratio).
pub(crate) fn write_targets(
    f: &mut fmt::Formatter<'_>,
    targets: &[Target],
    decimals: usize,
) -> fmt::Result {
    writeln!(f, "\ntargets")?;
    for t in targets {
        writeln!(
            f,
            "  [{}] {}: {:.*} (target {}{})",
            if t.met { "met" } else { "MISSED" },
            t.what,
            // Ratios keep two places whatever the report's unit.
            if t.measured.abs() < 10.0 {
                decimals.max(2)
            } else {
                decimals
            },
            t.measured,
            t.target,
            match (&t.bound, t.met) {
                (Some(b), false) => format!("; bound: {b}"),
                _ => String::new(),
            }
        )?;
    }
    Ok(())
}

/// Everything `bench transport` measured.
#[derive(Debug, Clone, Serialize)]
pub struct TransportBenchReport {
    /// The machine, as `/proc/cpuinfo` and the scheduler describe it.
    pub machine: String,
    /// Submit-to-post latency.
    pub submit: SubmitLatency,
    /// Paged-write throughput per page size; the first row is cache-resident.
    pub paged: Vec<PagedThroughput>,
    /// Scatter posting time per peer count.
    pub scatter: Vec<ScatterPosting>,
    /// The engine's targets and whether this run met them.
    pub targets: Vec<Target>,
}

/// The machine as `/proc/cpuinfo` and the scheduler describe it: model name, family and
/// model (a model name such as "AMD EPYC" alone does not tell the generations apart), the
/// vector extensions the kernels dispatch on, and the cores this process may use.
pub(crate) fn machine() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        info.lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
            .and_then(|l| l.split(':').nth(1))
            .map(|v| v.trim().to_owned())
    };
    let cpu = field("model name").unwrap_or_else(|| "unknown CPU".to_owned());
    let flags = field("flags").unwrap_or_default();
    let isa: Vec<&str> = [
        "avx2",
        "fma",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512_bf16",
    ]
    .into_iter()
    .filter(|f| flags.split_whitespace().any(|g| g == *f))
    .collect();
    let family = match (field("cpu family"), field("model")) {
        (Some(f), Some(m)) => format!(" (family {f}, model {m})"),
        _ => String::new(),
    };
    let cores = std::thread::available_parallelism().map_or(0, std::num::NonZero::get);
    format!(
        "{cpu}{family}, {}, {cores} cores available",
        if isa.is_empty() {
            "no AVX2".to_owned()
        } else {
            isa.join(" ")
        }
    )
}

pub(crate) fn transport(args: &TransportBenchArgs) -> Result<TransportBenchReport> {
    let (samples, repeats) = if args.quick { (2_000, 3) } else { (50_000, 15) };
    let submit = bench::submit_latency(samples)?;
    let mut paged = vec![bench::paged_throughput(1024, 2048, repeats * 3)?];
    for page in [1024usize, 4096, 16384, 65536] {
        let pages = ((20usize << 20) / page).min(20_000) as u32;
        paged.push(bench::paged_throughput(page, pages, repeats)?);
    }
    let scatter = [8, 16, 32, 64]
        .iter()
        .map(|&p| bench::scatter_posting(p, 256, samples / 10))
        .collect::<Result<Vec<_>, _>>()?;
    let scatter64 = scatter.last().map_or(f64::NAN, |s| s.engine.p50_ns);
    let of_memcpy = |p: &PagedThroughput| p.engine_pages_per_s / p.memcpy_pages_per_s;
    // Both 1 KiB rows (paged[0] in cache, paged[1] out of it) against memcpy: in cache, the
    // engine's per-page work (a descriptor, the checks of both ranges, the immediate) weighs
    // most beside a 1 KiB copy.
    let (in_cache, out_of_cache) = (of_memcpy(&paged[0]), of_memcpy(&paged[1]));
    let targets = vec![
        Target::new(
            "submit to first posted write, p50",
            "<= 1000 ns",
            submit.engine.p50_ns,
            submit.engine.p50_ns <= SUBMIT_P50_TARGET_NS,
        ),
        Target::new(
            "paged writes, 1 KiB pages, one worker (cache-resident row)",
            ">= 5e6 pages/s",
            paged[0].engine_pages_per_s,
            paged[0].engine_pages_per_s >= PAGED_1K_TARGET_PER_S,
        ),
        Target::new(
            "paged writes, 1 KiB pages, engine / memcpy (cache-resident row)",
            ">= 0.8",
            in_cache,
            in_cache >= PAGED_OF_MEMCPY_TARGET,
        ),
        Target::new(
            "paged writes, 1 KiB pages, engine / memcpy (20,000-page row)",
            ">= 0.8",
            out_of_cache,
            out_of_cache >= PAGED_OF_MEMCPY_TARGET,
        ),
        Target::new(
            "scatter posting to 64 peers, p50",
            "< 5000 ns",
            scatter64,
            scatter64 < SCATTER_64_TARGET_NS,
        ),
    ];
    Ok(TransportBenchReport {
        machine: machine(),
        submit,
        paged,
        scatter,
        targets,
    })
}

impl fmt::Display for TransportBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let us = |ns: f64| ns / 1e3;
        writeln!(f, "transfer engine on the mem domain; {}", self.machine)?;
        let (e, b) = (&self.submit.engine, &self.submit.baseline_handoff);
        writeln!(f, "\nsubmit -> first posted write ({} samples)", e.samples)?;
        writeln!(
            f,
            "  engine            p50 {:7.3} us   p99 {:7.3} us",
            us(e.p50_ns),
            us(e.p99_ns)
        )?;
        writeln!(
            f,
            "  channel hand-off  p50 {:7.3} us   p99 {:7.3} us   (engine / baseline: {:.2}x)",
            us(b.p50_ns),
            us(b.p99_ns),
            e.p50_ns / b.p50_ns
        )?;
        writeln!(
            f,
            "\npaged writes, end to end (receiver counts every page's immediate)"
        )?;
        writeln!(
            f,
            "  {:>8} {:>7} {:>16} {:>16} {:>8}",
            "page", "pages", "engine pages/s", "memcpy pages/s", "ratio"
        )?;
        for (i, p) in self.paged.iter().enumerate() {
            let note = if i == 0 { "  cache-resident" } else { "" };
            writeln!(
                f,
                "  {:>8} {:>7} {:>16.0} {:>16.0} {:>8.2}{note}",
                p.page_len,
                p.pages,
                p.engine_pages_per_s,
                p.memcpy_pages_per_s,
                p.engine_pages_per_s / p.memcpy_pages_per_s
            )?;
        }
        writeln!(
            f,
            "\nscatter posting, first to last posted write (256 B per peer, passive peers)"
        )?;
        writeln!(
            f,
            "  {:>5} {:>12} {:>12} {:>18} {:>8}",
            "peers", "p50 us", "p99 us", "enqueue floor p50", "ratio"
        )?;
        for s in &self.scatter {
            writeln!(
                f,
                "  {:>5} {:>12.3} {:>12.3} {:>15.3} us {:>8.2}",
                s.peers,
                us(s.engine.p50_ns),
                us(s.engine.p99_ns),
                us(s.baseline_enqueue.p50_ns),
                s.engine.p50_ns / s.baseline_enqueue.p50_ns
            )?;
        }
        write_targets(f, &self.targets, 0)
    }
}
