//! `kvroute simulate dualpath | prfaas`: the schedulers of `kvroute-sched` in its discrete-event
//! simulator, every policy beside its baselines on the same requests in the same run.

use std::collections::BTreeMap;
use std::fmt;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use kvroute_costmodel::prfaas::LogNormalSpec;
use kvroute_kvstore::{TraceReader, TraceRecord};
use kvroute_sched::dualpath::Policy;
use kvroute_sched::dualpath_sim::{
    self, AgenticSpec, Arrivals, ClusterConfig, DualPathRun, ModelProfile,
};
use kvroute_sched::prfaas::Adaptation;
use kvroute_sched::prfaas_sim::{
    self, CaseStudy, CaseStudyReport, Deployment, PD_P_READING_SLOWDOWN, PrfaasRun, Workload,
    homogeneous_reading_slowdown,
};
use kvroute_transport::file::{Links, open_regular};
use plotters::prelude::*;
use serde::Serialize;

use crate::args::{SimulateDualPathArgs, SimulatePrfaasArgs};
use crate::sweep::plots::{err, font, legend};

/// One policy's run and what it cost to simulate.
#[derive(Debug, Clone, Serialize)]
pub struct TimedRun {
    /// The run.
    #[serde(flatten)]
    pub run: DualPathRun,
    /// Wall-clock seconds the simulation took on this machine.
    pub sim_wall_s: f64,
    /// Events simulated per wall-clock second.
    pub events_per_s: f64,
}

/// `kvroute simulate dualpath`.
#[derive(Debug, Clone, Serialize)]
pub struct SimulateDualPathReport {
    /// What was replayed.
    pub workload: String,
    /// Requests.
    pub requests: u64,
    /// Engines (GPUs).
    pub engines: u32,
    /// Every constant of the run.
    pub config: ClusterConfig,
    /// One run per policy.
    pub runs: Vec<TimedRun>,
    /// DualPath's throughput (makespan ratio) over each baseline that ran.
    pub throughput_ratio: BTreeMap<String, f64>,
    /// PNGs written.
    pub plots: Vec<String>,
}

fn read_trace(path: &Path) -> Result<Vec<TraceRecord>> {
    // A regular file: a FIFO or a device would be read without end.
    let file = open_regular(path, Links::Follow)
        .with_context(|| format!("opening the trace {}", path.display()))?;
    TraceReader::new(BufReader::new(file), 512)
        .collect::<Result<_, _>>()
        .with_context(|| format!("reading {}", path.display()))
}

fn policies(name: &str) -> Result<Vec<Policy>> {
    if name == "all" {
        return Ok(Policy::ALL.to_vec());
    }
    match Policy::ALL.iter().find(|p| p.name() == name) {
        Some(&p) => Ok(vec![p]),
        None => bail!("unknown policy {name:?}: all, dualpath, round-robin or prefill-read"),
    }
}

pub(crate) fn dualpath(args: &SimulateDualPathArgs) -> Result<SimulateDualPathReport> {
    let mut config = ClusterConfig::paper_003(args.prefill_nodes, args.decode_nodes)?;
    config.model = match args.model.as_str() {
        "deepseek-v3.2" | "v3.2" => ModelProfile::deepseek_v32()?,
        "ds-27b" => {
            config.de_hbm_bytes = 64e9;
            ModelProfile::ds_27b()
        }
        other => bail!("unknown model {other:?}: deepseek-v3.2 or ds-27b"),
    };
    if let Some(gb) = args.de_hbm_gb {
        config.de_hbm_bytes = gb * 1e9;
    }
    config.gpu_flops = args.gpu_tflops * 1e12;
    config.snic_gbps = args.snic_gbps;
    config.cnic_gbps = args.cnic_gbps;
    config.max_unfinished_s = args.beta_s;
    config.short_read_queue_s = args.alpha_s;
    config.validate()?;
    let (workload, arrivals) = match &args.trace {
        Some(path) => {
            let records = read_trace(path)?;
            let arrivals =
                dualpath_sim::trace_arrivals(&records, 512, args.scale, args.time_scale)?;
            (
                format!(
                    "{} x {} (online arrivals, time / {})",
                    path.display(),
                    args.scale,
                    args.time_scale
                ),
                arrivals,
            )
        }
        None => (
            format!(
                "{} agents, offline rollout, trajectories shaped like paper 003's 64K dataset \
                 (seed {})",
                args.agents, args.seed
            ),
            Arrivals::Agents(AgenticSpec::paper_003_64k(args.agents, args.seed).generate()?),
        ),
    };
    let mut runs = Vec::new();
    for policy in policies(&args.policy)? {
        let started = Instant::now();
        let run = dualpath_sim::simulate(&config, policy, &arrivals, &[])?;
        let wall = started.elapsed().as_secs_f64();
        runs.push(TimedRun {
            events_per_s: run.events as f64 / wall.max(1e-9),
            sim_wall_s: wall,
            run,
        });
    }
    let mut throughput_ratio = BTreeMap::new();
    if let Some(ours) = runs
        .iter()
        .find(|r| r.run.policy == Policy::DualPath.name())
    {
        for base in runs
            .iter()
            .filter(|r| r.run.policy != Policy::DualPath.name())
        {
            throughput_ratio.insert(
                format!("vs_{}", base.run.policy.replace('-', "_")),
                base.run.makespan_s / ours.run.makespan_s,
            );
        }
    }
    let mut report = SimulateDualPathReport {
        workload,
        requests: arrivals.requests() as u64,
        engines: config.topology.engines(),
        config,
        runs,
        throughput_ratio,
        plots: Vec::new(),
    };
    if let Some(dir) = &args.plots {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        report.plots = plot_dualpath(&report, dir)?
            .iter()
            .map(|p| p.display().to_string())
            .collect();
    }
    Ok(report)
}

const COLORS: [RGBColor; 3] = [
    RGBColor(200, 40, 40),
    RGBColor(0, 90, 200),
    RGBColor(110, 110, 110),
];

/// Figures 13 and 14 of paper 003, and throughput over time: one line per policy.
fn plot_dualpath(r: &SimulateDualPathReport, dir: &Path) -> Result<Vec<PathBuf>> {
    font()?;
    type Pick = fn(&dualpath_sim::SeriesPoint) -> Option<f64>;
    let charts: [(&str, &str, &str, Pick); 3] = [
        (
            "throughput.png",
            "finished tokens per second (prompt and generated)",
            "million tokens / s",
            |p| Some(p.tokens_per_s / 1e6),
        ),
        (
            "snic_balance.png",
            "storage NIC read max/avg across nodes (paper 003 figure 13)",
            "max / avg",
            |p| p.snic_max_over_avg,
        ),
        (
            "attention_balance.png",
            "PE attention time max/avg per pass (paper 003 figure 14)",
            "max / avg",
            |p| p.attention_max_over_avg,
        ),
    ];
    let mut out = Vec::new();
    for (file, caption, y_desc, pick) in charts {
        let path = dir.join(file);
        let x1 = r.runs.iter().map(|t| t.run.makespan_s).fold(1.0, f64::max);
        let y1 = r
            .runs
            .iter()
            .flat_map(|t| t.run.series.iter().filter_map(pick))
            .filter(|v| v.is_finite())
            .fold(0.0, f64::max)
            .max(1.0)
            * 1.1;
        let y0 = if file == "throughput.png" { 0.0 } else { 1.0 };
        let root = BitMapBackend::new(&path, (1100, 620)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 22))
            .margin(18)
            .x_label_area_size(45)
            .y_label_area_size(90)
            .build_cartesian_2d(0.0..x1, y0..y1)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("simulated seconds")
            .y_desc(y_desc)
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.1}"))
            .draw()
            .map_err(err)?;
        for (t, color) in r.runs.iter().zip(COLORS) {
            let points: Vec<(f64, f64)> = t
                .run
                .series
                .iter()
                .filter_map(|p| pick(p).map(|v| (p.t_s, v)))
                .collect();
            chart
                .draw_series(LineSeries::new(points, color.stroke_width(2)))
                .map_err(err)?
                .label(t.run.policy)
                .legend(legend(color));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 15))
            .draw()
            .map_err(err)?;
        root.present().map_err(err)?;
        drop(chart);
        drop(root);
        out.push(path);
    }
    Ok(out)
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.2}"))
}

impl fmt::Display for SimulateDualPathReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        let t = c.topology;
        writeln!(
            f,
            "DualPath: {}P{}D x {} engines ({} in all), {}, {} requests: {}",
            t.prefill_nodes,
            t.decode_nodes,
            t.engines_per_node,
            self.engines,
            c.model.name,
            self.requests,
            self.workload
        )?;
        writeln!(
            f,
            "constants: {:.0} TFLOP/s per GPU (assumed), storage NIC {:.0} Gbps per node and compute NIC {:.0} Gbps per GPU \
             (paper 003 7.2), TPOT {:.0} ms (table 3), compute quota {:.0} ms (A.4), alpha {} s, beta {} s, DE HBM {:.0} GB, \
             {:.1} KB KV per token",
            c.gpu_flops / 1e12,
            c.snic_gbps,
            c.cnic_gbps,
            c.tpot_s * 1e3,
            c.compute_quota_s * 1e3,
            c.short_read_queue_s,
            c.max_unfinished_s,
            c.de_hbm_bytes / 1e9,
            c.model.kv_bytes_per_token / 1e3
        )?;
        writeln!(
            f,
            "{:<13} {:>10} {:>8} {:>10} {:>22} {:>9} {:>9} {:>8} {:>8} {:>9} {:>10}",
            "policy",
            "makespan s",
            "req/s",
            "Mtok/s",
            "TTFT s p50/p90/p99",
            "SNIC m/a",
            "attn m/a",
            "DE reads",
            "PE busy",
            "sim s",
            "events/s"
        )?;
        for r in &self.runs {
            let x = &r.run;
            writeln!(
                f,
                "{:<13} {:>10.0} {:>8.1} {:>10.3} {:>22} {:>9} {:>9} {:>7.0}% {:>7.0}% {:>9.2} {:>10.2e}",
                x.policy,
                x.makespan_s,
                x.throughput_rps,
                x.throughput_tokens_per_s / 1e6,
                format!(
                    "{:.2}/{:.2}/{:.2}",
                    x.ttft_s.p50, x.ttft_s.p90, x.ttft_s.p99
                ),
                opt(x.snic_balance),
                opt(x.attention_balance),
                x.decode_side_read_fraction * 100.0,
                x.prefill_busy * 100.0,
                r.sim_wall_s,
                r.events_per_s
            )?;
        }
        for (k, v) in &self.throughput_ratio {
            writeln!(
                f,
                "throughput ratio dualpath {}: {v:.3}x",
                k.replace('_', " ")
            )?;
        }
        writeln!(
            f,
            "balance: max/avg over the loaded phase (until half of the requests finished); storage NICs per {} s window",
            c.balance_window_s
        )?;
        for p in &self.plots {
            writeln!(f, "plot: {p}")?;
        }
        Ok(())
    }
}

/// `kvroute simulate prfaas`.
#[derive(Debug, Clone, Serialize)]
pub struct SimulatePrfaasReport {
    /// The case study, once per reading of the H20 profile (no trace given).
    pub case_study: Vec<CaseStudyReading>,
    /// The three deployments on a trace (when one was given).
    pub trace: Option<TraceComparison>,
}

/// One reading of the case study, and which published figures it reproduces.
#[derive(Debug, Clone, Serialize)]
pub struct CaseStudyReading {
    /// The runs.
    #[serde(flatten)]
    pub report: CaseStudyReport,
    /// PrfaaS-PD's throughput over each baseline.
    pub throughput_ratio: BTreeMap<String, f64>,
    /// What this reading reproduces, in words.
    pub reproduces: String,
}

/// The three deployments on one trace.
#[derive(Debug, Clone, Serialize)]
pub struct TraceComparison {
    /// The trace.
    pub trace: String,
    /// The PD cluster's prefill slowdown.
    pub h20_slowdown: f64,
    /// The log-normal fitted to the trace's incremental lengths, which `t` and the splits
    /// were searched on.
    pub fitted_lengths: LogNormalSpec,
    /// PrfaaS-PD's threshold.
    pub threshold_tokens: f64,
    /// `Np / Nd` of PrfaaS-PD and of homogeneous PD.
    pub splits: [(u32, u32); 2],
    /// PrfaaS-PD, homogeneous PD, naive heterogeneous, each at the highest multiple of the
    /// trace's rate it keeps up with.
    pub sustainable: Vec<PrfaasRun>,
    /// The time scale of the runs below.
    pub time_scale: f64,
    /// The same three at the trace's own rate divided by the time scale.
    pub at_trace_rate: Vec<PrfaasRun>,
    /// PrfaaS-PD's sustainable rate over each baseline's.
    pub throughput_ratio: BTreeMap<String, f64>,
}

pub(crate) fn prfaas(args: &SimulatePrfaasArgs) -> Result<SimulatePrfaasReport> {
    let slowdowns = match args.h20_slowdown {
        Some(s) => vec![s],
        None => vec![PD_P_READING_SLOWDOWN, homogeneous_reading_slowdown()],
    };
    let adapt = |mut d: Deployment| {
        if args.adapt && d.router.prfaas && d.router.pd_prefill {
            d.router.adapt = Some(Adaptation {
                step: 0.05,
                min_tokens: 128.0,
                max_tokens: 131_072.0,
                high_utilization: 0.9,
                wait_margin_s: 1.0,
            });
        }
        d
    };
    if let Some(path) = &args.trace {
        let records = read_trace(path)?;
        let slowdown = slowdowns[0];
        let lengths = prfaas_sim::fit_lengths(&records, 512)?;
        let mut sustainable = Vec::new();
        let mut at_trace_rate = Vec::new();
        let mut deployments = Vec::new();
        for which in [
            CaseStudy::PrfaasPd,
            CaseStudy::HomogeneousPd,
            CaseStudy::NaiveHeterogeneous,
        ] {
            let d = adapt(Deployment::paper_001_for(which, slowdown, lengths)?);
            sustainable.push(prfaas_sim::sustainable_trace_rate(
                &d,
                &records,
                512,
                args.cache_blocks,
            )?);
            at_trace_rate.push(prfaas_sim::simulate(
                &d,
                &Workload::Trace {
                    records: records.clone(),
                    block_tokens: 512,
                    cache_blocks: args.cache_blocks,
                    time_scale: args.time_scale,
                },
            )?);
            deployments.push(d);
        }
        let throughput_ratio = BTreeMap::from([
            (
                "vs_homogeneous".to_owned(),
                sustainable[0].offered_rps / sustainable[1].offered_rps,
            ),
            (
                "vs_naive".to_owned(),
                sustainable[0].offered_rps / sustainable[2].offered_rps,
            ),
        ]);
        return Ok(SimulatePrfaasReport {
            case_study: Vec::new(),
            trace: Some(TraceComparison {
                trace: path.display().to_string(),
                h20_slowdown: slowdown,
                fitted_lengths: *lengths.spec(),
                threshold_tokens: deployments[0].router.threshold_tokens,
                splits: [
                    (
                        deployments[0].pd_prefill_instances,
                        deployments[0].pd_decode_instances,
                    ),
                    (
                        deployments[1].pd_prefill_instances,
                        deployments[1].pd_decode_instances,
                    ),
                ],
                sustainable,
                time_scale: args.time_scale,
                at_trace_rate,
                throughput_ratio,
            }),
        });
    }
    let mut case_study = Vec::new();
    for s in slowdowns {
        let report = prfaas_sim::case_study(s, args.requests, args.seed)?;
        let reproduces = if (s - PD_P_READING_SLOWDOWN).abs() < 1e-9 {
            "table 6's PD-P column: PrfaaS-PD Lambda_max 3.24 req/s, naive heterogeneous 2.45, \
             PrfaaS-PD over naive 1.32x, egress about 13 Gbps"
        } else if (s - homogeneous_reading_slowdown()).abs() < 1e-9 {
            "table 6's homogeneous column: homogeneous PD 2.11 req/s, and PrfaaS-PD over it 1.54x"
        } else {
            "neither published reading"
        };
        case_study.push(CaseStudyReading {
            throughput_ratio: BTreeMap::from([
                (
                    "vs_homogeneous".to_owned(),
                    report.throughput_ratio_vs_homogeneous,
                ),
                ("vs_naive".to_owned(), report.throughput_ratio_vs_naive),
            ]),
            reproduces: reproduces.to_owned(),
            report,
        });
    }
    Ok(SimulatePrfaasReport {
        case_study,
        trace: None,
    })
}

fn prfaas_row(
    f: &mut fmt::Formatter<'_>,
    r: &PrfaasRun,
    ttft: Option<&kvroute_sched::stats::Percentiles>,
) -> fmt::Result {
    let t = ttft.unwrap_or(&r.ttft_s);
    writeln!(
        f,
        "  {:<20} {:>8.3} {:>9.1}% {:>8.2} {:>16} {:>9}",
        r.deployment,
        if ttft.is_some() {
            r.offered_rps
        } else {
            r.throughput_rps
        },
        r.p_prfaas * 100.0,
        r.egress_gbps,
        format!("{:.2}/{:.2}", t.mean, t.p90),
        r.events
    )
}

impl fmt::Display for SimulatePrfaasReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in &self.case_study {
            let r = &c.report;
            writeln!(
                f,
                "PrfaaS case study (paper 001 section 4), PD prefill {:.2}x slower than table 5's H200: t = {:.0} tokens, \
                 PrfaaS-PD Np/Nd {}/{}, homogeneous {}/{}",
                r.h20_slowdown,
                r.threshold_tokens,
                r.splits[0].0,
                r.splits[0].1,
                r.splits[1].0,
                r.splits[1].1
            )?;
            writeln!(
                f,
                "  {:<20} {:>8} {:>10} {:>8} {:>16} {:>9}",
                "deployment", "req/s", "to PrfaaS", "Gbps", "TTFT mean/p90 s", "events"
            )?;
            for (run, ttft) in [&r.prfaas_pd, &r.homogeneous, &r.naive]
                .into_iter()
                .zip(&r.ttft_at_common_load_s)
            {
                prfaas_row(f, run, Some(ttft))?;
            }
            writeln!(
                f,
                "  req/s: highest Poisson rate kept up with (backlog <= 1%); TTFT at {:.2} req/s for all three",
                r.common_load_rps
            )?;
            writeln!(
                f,
                "  PrfaaS-PD over homogeneous {:.3}x, over naive {:.3}x; this reading reproduces {}",
                r.throughput_ratio_vs_homogeneous, r.throughput_ratio_vs_naive, c.reproduces
            )?;
        }
        if let Some(t) = &self.trace {
            let l = &t.fitted_lengths;
            writeln!(
                f,
                "PrfaaS on {}: uncached lengths fitted as LogNormal(mu {:.2}, sigma {:.2}) on [{:.0}, {:.0}]; \
                 t = {:.0} tokens, PrfaaS-PD Np/Nd {}/{}, homogeneous {}/{}, PD prefill {:.2}x slower than H200",
                t.trace,
                l.mu,
                l.sigma,
                l.min_tokens,
                l.max_tokens,
                t.threshold_tokens,
                t.splits[0].0,
                t.splits[0].1,
                t.splits[1].0,
                t.splits[1].1,
                t.h20_slowdown
            )?;
            writeln!(
                f,
                "  {:<20} {:>8} {:>10} {:>8} {:>16} {:>9}",
                "deployment", "req/s", "to PrfaaS", "Gbps", "TTFT mean/p90 s", "events"
            )?;
            writeln!(
                f,
                "  at the highest multiple of the trace's rate each keeps up with:"
            )?;
            for run in &t.sustainable {
                prfaas_row(f, run, None)?;
            }
            writeln!(f, "  at the trace's rate / {}:", t.time_scale)?;
            for run in &t.at_trace_rate {
                prfaas_row(f, run, None)?;
            }
            for (k, v) in &t.throughput_ratio {
                writeln!(
                    f,
                    "  throughput ratio PrfaaS-PD {}: {v:.3}x",
                    k.replace('_', " ")
                )?;
            }
        }
        Ok(())
    }
}
