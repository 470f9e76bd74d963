//! The cluster simulators from Python (`kvroute-sched`): DualPath placement and read paths
//! (paper 003) and the PrfaaS router (paper 001) in the discrete-event simulator, beside
//! their baselines, on a trace or a synthetic load. Each returns a `kvroute.Record` with the
//! fields of `kvroute simulate dualpath --json` / `simulate prfaas --json` (no plots).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::time::Instant;

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
use pyo3::prelude::*;
use serde::Serialize;

use crate::errors::{Kind, error, invalid, py_err};
use crate::record::to_record;
use crate::wait::interruptible;

/// `value` within `lo..=hi`, else `InvalidInputError` naming `what`.
pub(crate) fn in_range(what: &str, value: u64, lo: u64, hi: u64) -> PyResult<()> {
    if (lo..=hi).contains(&value) {
        Ok(())
    } else {
        Err(invalid(format!("{what} = {value}: expected {lo} to {hi}")))
    }
}

#[derive(Serialize)]
struct TimedRun {
    #[serde(flatten)]
    run: DualPathRun,
    sim_wall_s: f64,
    events_per_s: f64,
}

/// `kvroute simulate dualpath --json`.
#[derive(Serialize)]
struct SimulateDualPathReport {
    workload: String,
    requests: u64,
    engines: u32,
    config: ClusterConfig,
    runs: Vec<TimedRun>,
    throughput_ratio: BTreeMap<String, f64>,
    plots: Vec<String>,
}

fn read_trace(path: &Path) -> PyResult<Vec<TraceRecord>> {
    let file = File::open(path).map_err(|e| {
        error(
            Kind::NotFound,
            format!("opening the trace {}: {e}", path.display()),
        )
    })?;
    TraceReader::new(BufReader::new(file), 512)
        .collect::<Result<_, _>>()
        .map_err(|e| error(Kind::Corrupt, format!("reading {}: {e}", path.display())))
}

/// DualPath against its baselines (paper 003 section 6; `kvroute simulate dualpath
/// --json`): on `trace` (online arrivals, `scale` copies, time divided by `time_scale`) or,
/// without one, an offline rollout of `agents` agentic trajectories. `policy`: `"all"`,
/// `"dualpath"`, `"round-robin"` or `"prefill-read"`. Interruptible with Ctrl-C.
#[pyfunction]
#[pyo3(signature = (trace = None, scale = 1, time_scale = 1.0, agents = 1024, seed = 1,
                    model = "deepseek-v3.2", prefill_nodes = 2, decode_nodes = 4, policy = "all",
                    gpu_tflops = 400.0, snic_gbps = 400.0, cnic_gbps = 400.0, de_hbm_gb = None,
                    beta_s = 2.0, alpha_s = 0.5))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn simulate_dualpath(
    py: Python<'_>,
    trace: Option<PathBuf>,
    scale: u32,
    time_scale: f64,
    agents: u32,
    seed: u64,
    model: &str,
    prefill_nodes: u32,
    decode_nodes: u32,
    policy: &str,
    gpu_tflops: f64,
    snic_gbps: f64,
    cnic_gbps: f64,
    de_hbm_gb: Option<f64>,
    beta_s: f64,
    alpha_s: f64,
) -> PyResult<Py<PyAny>> {
    // The command line's ranges for what sizes allocations (past them a machine runs out of
    // memory, which aborts the process instead of raising).
    in_range("scale", scale.into(), 1, 100)?;
    in_range("agents", agents.into(), 1, 16_384)?;
    in_range("prefill_nodes", prefill_nodes.into(), 1, 256)?;
    in_range("decode_nodes", decode_nodes.into(), 1, 256)?;
    let mut config = ClusterConfig::paper_003(prefill_nodes, decode_nodes).map_err(py_err)?;
    config.model = match model {
        "deepseek-v3.2" | "v3.2" => ModelProfile::deepseek_v32().map_err(py_err)?,
        "ds-27b" => {
            config.de_hbm_bytes = 64e9;
            ModelProfile::ds_27b()
        }
        other => {
            return Err(invalid(format!(
                "unknown model {other:?}: deepseek-v3.2 or ds-27b"
            )));
        }
    };
    if let Some(gb) = de_hbm_gb {
        config.de_hbm_bytes = gb * 1e9;
    }
    config.gpu_flops = gpu_tflops * 1e12;
    config.snic_gbps = snic_gbps;
    config.cnic_gbps = cnic_gbps;
    config.max_unfinished_s = beta_s;
    config.short_read_queue_s = alpha_s;
    config.validate().map_err(py_err)?;
    let policies: Vec<Policy> = if policy == "all" {
        Policy::ALL.to_vec()
    } else {
        match Policy::ALL.iter().find(|p| p.name() == policy) {
            Some(&p) => vec![p],
            None => {
                return Err(invalid(format!(
                    "unknown policy {policy:?}: all, dualpath, round-robin or prefill-read"
                )));
            }
        }
    };
    let report = interruptible(py, move || -> PyResult<SimulateDualPathReport> {
        let (workload, arrivals) = match &trace {
            Some(path) => {
                let records = read_trace(path)?;
                let arrivals = dualpath_sim::trace_arrivals(&records, 512, scale, time_scale)
                    .map_err(py_err)?;
                (
                    format!(
                        "{} x {scale} (online arrivals, time / {time_scale})",
                        path.display()
                    ),
                    arrivals,
                )
            }
            None => (
                format!(
                    "{agents} agents, offline rollout, trajectories shaped like paper 003's 64K \
                     dataset (seed {seed})"
                ),
                Arrivals::Agents(
                    AgenticSpec::paper_003_64k(agents, seed)
                        .generate()
                        .map_err(py_err)?,
                ),
            ),
        };
        let mut runs = Vec::new();
        for p in policies {
            let started = Instant::now();
            let run = dualpath_sim::simulate(&config, p, &arrivals, &[]).map_err(py_err)?;
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
        Ok(SimulateDualPathReport {
            workload,
            requests: arrivals.requests() as u64,
            engines: config.topology.engines(),
            config,
            runs,
            throughput_ratio,
            plots: Vec::new(),
        })
    })??;
    to_record(py, &report)
}

/// `kvroute simulate prfaas --json`.
#[derive(Serialize)]
struct SimulatePrfaasReport {
    case_study: Vec<CaseStudyReading>,
    trace: Option<TraceComparison>,
}

#[derive(Serialize)]
struct CaseStudyReading {
    #[serde(flatten)]
    report: CaseStudyReport,
    throughput_ratio: BTreeMap<String, f64>,
    reproduces: String,
}

#[derive(Serialize)]
struct TraceComparison {
    trace: String,
    h20_slowdown: f64,
    fitted_lengths: LogNormalSpec,
    threshold_tokens: f64,
    splits: [(u32, u32); 2],
    sustainable: Vec<PrfaasRun>,
    time_scale: f64,
    at_trace_rate: Vec<PrfaasRun>,
    throughput_ratio: BTreeMap<String, f64>,
}

/// PrfaaS-PD against homogeneous PD and naive heterogeneous deployment (paper 001 section
/// 3.4.3, table 6; `kvroute simulate prfaas --json`): the case study on `requests`
/// synthetic requests (once per reading of the H20 profile unless `h20_slowdown` is given),
/// or the three deployments on `trace`. `adapt` turns on the router's threshold
/// adaptation. Interruptible with Ctrl-C.
#[pyfunction]
#[pyo3(signature = (trace = None, time_scale = 1.0, cache_blocks = 0, h20_slowdown = None,
                    requests = 40000, seed = 1, adapt = false))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn simulate_prfaas(
    py: Python<'_>,
    trace: Option<PathBuf>,
    time_scale: f64,
    cache_blocks: usize,
    h20_slowdown: Option<f64>,
    requests: u64,
    seed: u64,
    adapt: bool,
) -> PyResult<Py<PyAny>> {
    in_range("requests", requests, 1, 250_000)?;
    in_range(
        "cache_blocks",
        cache_blocks as u64,
        0,
        crate::kvstore::MAX_CACHE_BLOCKS as u64,
    )?;
    let report = interruptible(py, move || -> PyResult<SimulatePrfaasReport> {
        let slowdowns = match h20_slowdown {
            Some(s) => vec![s],
            None => vec![PD_P_READING_SLOWDOWN, homogeneous_reading_slowdown()],
        };
        let adapted = |mut d: Deployment| {
            if adapt && d.router.prfaas && d.router.pd_prefill {
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
        if let Some(path) = &trace {
            let records = read_trace(path)?;
            let slowdown = slowdowns[0];
            let lengths = prfaas_sim::fit_lengths(&records, 512).map_err(py_err)?;
            let (mut sustainable, mut at_trace_rate, mut deployments) =
                (Vec::new(), Vec::new(), Vec::new());
            for which in [
                CaseStudy::PrfaasPd,
                CaseStudy::HomogeneousPd,
                CaseStudy::NaiveHeterogeneous,
            ] {
                let d =
                    adapted(Deployment::paper_001_for(which, slowdown, lengths).map_err(py_err)?);
                sustainable.push(
                    prfaas_sim::sustainable_trace_rate(&d, &records, 512, cache_blocks)
                        .map_err(py_err)?,
                );
                at_trace_rate.push(
                    prfaas_sim::simulate(
                        &d,
                        &Workload::Trace {
                            records: records.clone(),
                            block_tokens: 512,
                            cache_blocks,
                            time_scale,
                        },
                    )
                    .map_err(py_err)?,
                );
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
                    time_scale,
                    at_trace_rate,
                    throughput_ratio,
                }),
            });
        }
        let mut case_study = Vec::new();
        for s in slowdowns {
            let report = prfaas_sim::case_study(s, requests, seed).map_err(py_err)?;
            let reproduces = if (s - PD_P_READING_SLOWDOWN).abs() < 1e-9 {
                "table 6's PD-P column: PrfaaS-PD Lambda_max 3.24 req/s, naive heterogeneous \
                 2.45, PrfaaS-PD over naive 1.32x, egress about 13 Gbps"
            } else if (s - homogeneous_reading_slowdown()).abs() < 1e-9 {
                "table 6's homogeneous column: homogeneous PD 2.11 req/s, and PrfaaS-PD over it \
                 1.54x"
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
    })??;
    to_record(py, &report)
}
