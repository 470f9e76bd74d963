//! `kvroute tour`: the papers' operating points, what the models decide there and why. It is
//! what `cargo xtask demo` runs until the end-to-end demo exists, and every number in it comes
//! from the same code paths as `predict` and `plan`.

use std::fmt;

use anyhow::Result;
use kvroute_costmodel::crossover::{
    byte_crossover_rows, fetch_local_crossover_tokens, route_bytes_saved,
    route_fetch_breakeven_bw_gbps,
};
use kvroute_costmodel::helix::{HelixLayout, HopB};
use kvroute_costmodel::prfaas::PrfaasPlanner;
use kvroute_costmodel::{
    Allowed, Congestion, CostModel, CostParams, FABRIC_PRESETS, Fabric, Request, SpliceCost,
    fabric_preset, model_preset,
};
use serde::Serialize;

use crate::plan::{HelixReport, PrfaasReport};
use crate::predict::{self, PredictReport};

/// A number the tour computes, next to what the paper printed.
#[derive(Debug, Clone, Serialize)]
pub struct Figure {
    /// What it is.
    pub name: String,
    /// The model's value (`None`: no crossover exists).
    pub value: Option<f64>,
    /// Its unit.
    pub unit: &'static str,
    /// What the paper printed, as text.
    pub published: &'static str,
}

/// What one stop computed.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum StopResult {
    /// A route / fetch / local decision.
    Predict(Box<PredictReport>),
    /// A PrfaaS plan.
    Prfaas(Box<PrfaasReport>),
    /// A Helix roofline and HOP-B timeline.
    Helix(HelixReport),
    /// Closed-form figures.
    Figures {
        /// The figures.
        figures: Vec<Figure>,
    },
}

/// One operating point of the tour.
#[derive(Debug, Clone, Serialize)]
pub struct TourStop {
    /// What is being looked at.
    pub title: &'static str,
    /// What the paper says about it, with its section.
    pub paper: &'static str,
    /// What the models say.
    pub result: StopResult,
}

/// The whole tour.
#[derive(Debug, Clone, Serialize)]
pub struct TourReport {
    /// The stops, in order.
    pub stops: Vec<TourStop>,
}

fn decide(
    model: &str,
    fabric: &str,
    request: Request,
    tweak: impl Fn(&mut CostParams),
) -> Result<StopResult> {
    let preset = model_preset(model)?;
    let mut params = CostParams::paper_defaults(preset.dims, fabric_preset(fabric)?.fabric);
    tweak(&mut params);
    Ok(StopResult::Predict(Box::new(predict::evaluate(
        preset.id, fabric, params, request,
    )?)))
}

fn figure(
    name: impl Into<String>,
    value: impl Into<Option<f64>>,
    unit: &'static str,
    published: &'static str,
) -> Figure {
    Figure {
        name: name.into(),
        value: value.into(),
        unit,
        published,
    }
}

fn crossovers() -> Result<StopResult> {
    let v2 = model_preset("deepseek-v2-lite")?.dims;
    let fig1b = Fabric::measured(16.0, 70.0)?;
    let band = |c| fetch_local_crossover_tokens(&v2, &fig1b, &SpliceCost::FLAT_3_MS, c);
    let ibgda = CostModel::new(CostParams::paper_defaults(
        v2,
        fabric_preset("h100-ibgda")?.fabric,
    ))?;
    Ok(StopResult::Figures {
        figures: vec![
            figure(
                "byte crossover Mq* at ct = 2048",
                byte_crossover_rows(&v2, 2048)?,
                "rows",
                "~1080 (5.2)",
            ),
            figure(
                "byte crossover Mq* at top-512",
                byte_crossover_rows(&v2, 512)?,
                "rows",
                "~270 (5.4)",
            ),
            figure(
                "bytes routing saves at Mq = 256, ct = 2048",
                100.0 * route_bytes_saved(&v2, 256, 2048)?,
                "%",
                "76% (5.2)",
            ),
            figure(
                "fetch beats local above (c = 1.5)",
                band(1.5)?,
                "tokens",
                "~75 (5.1, fig. 1b)",
            ),
            figure(
                "fetch beats local above (c = 0.5)",
                band(0.5)?,
                "tokens",
                "~220 (5.1, fig. 1b)",
            ),
            figure(
                "route loses to the splice below",
                route_fetch_breakeven_bw_gbps(&v2, 256, 3000.0)?,
                "GB/s",
                "~0.2 (8)",
            ),
            figure(
                "fetch beats route on time above",
                ibgda.route_fetch_crossover_rows(&Request::contiguous(1, 2048))?,
                "rows",
                "~1e5 (5.5)",
            ),
        ],
    })
}

fn fabrics_at_decode() -> Result<StopResult> {
    let v2 = model_preset("deepseek-v2-lite")?.dims;
    let mut figures = Vec::new();
    for preset in FABRIC_PRESETS {
        let costs = CostModel::new(CostParams::paper_defaults(v2, preset.fabric))?;
        let route = costs.route(&Request::contiguous(256, 2048))?;
        figures.push(figure(
            format!("route round trip on {}", preset.id),
            route.transport_us(),
            "us",
            "31-48 us (8)",
        ));
    }
    Ok(StopResult::Figures { figures })
}

/// Builds the tour.
pub(crate) fn run() -> Result<TourReport> {
    let v2 = "deepseek-v2-lite";
    let ib = "h100-ibgda";
    let no_route = Allowed {
        route: false,
        ..Allowed::ALL
    };
    let stops = vec![
        TourStop {
            title: "A decode step against a 2K-token chunk on another node",
            paper: "5.5: default to route at decode; tens of us, 60-100x below the ~3 ms splice",
            result: decide(v2, ib, Request::contiguous(256, 2048), |_| {})?,
        },
        TourStop {
            title: "A batched dispatch of 1024 query rows",
            paper: "4.3: the route round trip is ~116 us at Mq = 1024 on IBGDA",
            result: decide(v2, ib, Request::contiguous(1024, 2048), |_| {})?,
        },
        TourStop {
            title: "DeepSeek-V3.2 top-2048 selection scattered over 4 holders (one token, 128 heads)",
            paper: "5.4: route is the selection made distributed; fetch must gather from every holder",
            result: decide(
                "deepseek-v3.2",
                ib,
                Request::sparse(128, 65_536, 2048, 4),
                |_| {},
            )?,
        },
        TourStop {
            title: "DeepSeek-V4-Flash top-512 over 2 holders (one token, 64 heads)",
            paper: "5.4: even the tightest budget (top-512) keeps route winning at decode",
            result: decide(
                "deepseek-v4-flash",
                ib,
                Request::sparse(64, 32_768, 512, 2),
                |_| {},
            )?,
        },
        TourStop {
            title: "A holder that is a plain byte store (no route)",
            paper: "6.3: a model-agnostic byte store cannot run the partial and must fetch",
            result: decide(
                v2,
                ib,
                Request {
                    allowed: no_route,
                    ..Request::contiguous(256, 2048)
                },
                |_| {},
            )?,
        },
        TourStop {
            title: "A tiny chunk under a large batch",
            paper: "5.1: route cedes only where it would ship more than the chunk (Mq >> ct)",
            result: decide(v2, ib, Request::contiguous(4096, 8), |_| {})?,
        },
        TourStop {
            title: "A congested fabric: 125x less bandwidth, 10x the probe",
            paper: "8: contention does not reprice the decision; route stays cheapest",
            result: decide(v2, ib, Request::contiguous(256, 2048), |p| {
                p.congestion = Congestion {
                    bw_degradation: 125.0,
                    probe_inflation: 10.0,
                    concurrent_flows: 1,
                };
            })?,
        },
        TourStop {
            title: "Closed-form crossovers (DeepSeek-V2-Lite)",
            paper: "5.1, 5.2, 5.4, 5.5, 8",
            result: crossovers()?,
        },
        TourStop {
            title: "The same decode step on every fabric of table 2",
            paper: "8: at decode the five fabrics cluster at ~31-48 us; pick the fabric by probe, not peak",
            result: fabrics_at_decode()?,
        },
        TourStop {
            title: "PrfaaS-PD case study: threshold and prefill/decode split",
            paper: "paper 001, 4.2 and table 6: t = 19.4K, Np/Nd = 3/5, Lambda_max = 3.24 req/s, ~13 Gbps",
            result: StopResult::Prfaas(Box::new(PrfaasReport {
                point: PrfaasPlanner::paper_001_case_study().search(1024)?,
                planner: PrfaasPlanner::paper_001_case_study(),
                grid: Some(1024),
            })),
        },
        TourStop {
            title: "Helix at 1M tokens (figure 1's model), with figure 3's HOP-B batch",
            paper: "paper 004, appendix A and figure 3: HOP-B cuts 25.6 time units to ~17",
            result: StopResult::Helix({
                let layout = HelixLayout::figure_1(1 << 20, 8, 64, 8);
                let roofline = layout.roofline()?;
                HelixReport {
                    layout,
                    roofline,
                    total_us: roofline.total_us(),
                    hopb: Some(HopB::FIGURE_3.timeline()?),
                }
            }),
        },
    ];
    Ok(TourReport { stops })
}

impl fmt::Display for TourReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, stop) in self.stops.iter().enumerate() {
            writeln!(f, "[{}] {}", i + 1, stop.title)?;
            writeln!(f, "    paper: {}", stop.paper)?;
            match &stop.result {
                StopResult::Predict(r) => write!(f, "{r}")?,
                StopResult::Prfaas(r) => write!(f, "{r}")?,
                StopResult::Helix(r) => write!(f, "{r}")?,
                StopResult::Figures { figures } => {
                    for fig in figures {
                        let value = fig
                            .value
                            .map_or_else(|| "none".to_owned(), |v| format!("{v:.3}"));
                        writeln!(
                            f,
                            "  {:<48} {value:>10} {:<6} (paper: {})",
                            fig.name, fig.unit, fig.published
                        )?;
                    }
                }
            }
            writeln!(f)?;
        }
        Ok(())
    }
}
