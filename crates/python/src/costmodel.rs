//! The cost model from Python (`kvroute-costmodel`): the presets, `predict` / `decide` for
//! one (chunk, request), PrfaaS throughput planning and the Helix roofline. Each returns a
//! `kvroute.Record` with the fields of the matching command's `--json` (`kvroute presets`,
//! `predict`, `plan prfaas`, `plan helix`); defaults are the command line's.

use kvroute_costmodel::crossover::{byte_crossover_rows, route_bytes_saved};
use kvroute_costmodel::helix::{HelixLayout, HelixRoofline, HopB, HopBTimeline};
use kvroute_costmodel::prfaas::{
    H20_OVER_H200_PREFILL, LengthProfile, OperatingPoint, PrfaasCluster, PrfaasPlanner,
    TruncatedLogNormal,
};
use kvroute_costmodel::{
    Allowed, Congestion, CostModel, CostParams, Decision, FABRIC_PRESETS, Fabric, FabricPreset,
    MODEL_PRESETS, MergeCost, ModelDims, ModelPreset, Request, Selection, Source, Sources,
    SpliceCost, fabric_preset, model_preset,
};
use pyo3::prelude::*;
use serde::Serialize;

use crate::errors::{invalid, py_err};
use crate::record::to_record;

/// Said wherever local's cost is reported (as the command line says it).
const LOCAL_IS_MODELLED: &str = "local is the cost model's ct x L x c re-prefill term, not a measurement: no model weights run here";

/// `kvroute presets --json`.
#[derive(Serialize)]
struct PresetsReport {
    models: &'static [ModelPreset],
    fabrics: &'static [FabricPreset],
}

/// `kvroute predict --json`.
#[derive(Serialize)]
struct PredictReport {
    model: String,
    fabric: String,
    dims: ModelDims,
    query_row_bytes: u64,
    partial_row_bytes: u64,
    kv_bytes_per_token_layer: u64,
    effective_fabric: Fabric,
    request: Request,
    decision: Decision,
    sources: Sources,
    byte_crossover_rows: f64,
    route_bytes_saved: f64,
    route_fetch_crossover_rows: Option<f64>,
    notes: Vec<&'static str>,
}

/// `kvroute plan prfaas --json`.
#[derive(Serialize)]
struct PrfaasReport {
    planner: PrfaasPlanner,
    grid: Option<u32>,
    point: OperatingPoint,
}

/// `kvroute plan helix --json`.
#[derive(Serialize)]
struct HelixReport {
    layout: HelixLayout,
    roofline: HelixRoofline,
    total_us: f64,
    hopb: Option<HopBTimeline>,
}

/// The model and fabric presets the other calls know by name (`kvroute presets --json`).
#[pyfunction]
pub(crate) fn presets(py: Python<'_>) -> PyResult<Py<PyAny>> {
    to_record(
        py,
        &PresetsReport {
            models: MODEL_PRESETS,
            fabrics: FABRIC_PRESETS,
        },
    )
}

/// The route, fetch and local costs of one (chunk, request), the choice and its reason
/// (`kvroute predict --json`): `mq` query rows against a chunk of `ct` tokens, dense or
/// (`topk`) sparse over `holders` holders, on a preset `fabric` or a measured one
/// (`probe_us` and `bw_gbps`). `only` limits the choice (`["route", "fetch"]`).
#[pyfunction]
#[pyo3(signature = (mq, ct, model = "deepseek-v2-lite", fabric = None, topk = None, holders = 1,
                    tp = 1, holder_requesters = 1, probe_us = None, bw_gbps = None,
                    turnaround_us = None, link_gbps = None, splice_us = None, merge_us = None,
                    local_us_per_token_layer = 1.0, bw_degradation = 1.0, probe_inflation = 1.0,
                    flows = 1, only = None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn predict(
    py: Python<'_>,
    mq: u32,
    ct: u32,
    model: &str,
    fabric: Option<&str>,
    topk: Option<u32>,
    holders: u32,
    tp: u32,
    holder_requesters: u32,
    probe_us: Option<f64>,
    bw_gbps: Option<f64>,
    turnaround_us: Option<f64>,
    link_gbps: Option<f64>,
    splice_us: Option<f64>,
    merge_us: Option<f64>,
    local_us_per_token_layer: f64,
    bw_degradation: f64,
    probe_inflation: f64,
    flows: u32,
    only: Option<Vec<String>>,
) -> PyResult<Py<PyAny>> {
    let preset = model_preset(model).map_err(py_err)?;
    let (fabric_label, mut fab) = match (probe_us, bw_gbps, fabric) {
        (Some(_), Some(_), Some(_)) => {
            return Err(invalid(
                "give either fabric or probe_us and bw_gbps, not both",
            ));
        }
        (Some(p), Some(b), None) => (
            "measured".to_owned(),
            Fabric::measured(p, b).map_err(py_err)?,
        ),
        (None, None, f) => {
            let p = fabric_preset(f.unwrap_or("h100-ibgda")).map_err(py_err)?;
            (p.id.to_owned(), p.fabric)
        }
        _ => return Err(invalid("probe_us and bw_gbps go together")),
    };
    if let Some(us) = turnaround_us {
        fab = fab.with_turnaround_us(us).map_err(py_err)?;
    }
    if let Some(g) = link_gbps {
        fab = fab.with_link_gbps(g).map_err(py_err)?;
    }
    let mut params = CostParams::paper_defaults(preset.dims, fab);
    if fabric_label == "measured" {
        params.sources.fabric = Source::Given;
    }
    if let Some(us) = splice_us {
        params.splice = SpliceCost {
            fixed_us: us,
            per_token_us: 0.0,
        };
        params.sources.splice = Source::Given;
    }
    if local_us_per_token_layer != 1.0 {
        params.sources.local = Source::Given;
    }
    params.local_us_per_token_layer = local_us_per_token_layer;
    if let Some(us) = merge_us {
        params.merge = MergeCost {
            fixed_us: us,
            us_per_row_part: 0.0,
        };
        params.sources.merge = Source::Given;
    }
    params.congestion = Congestion {
        bw_degradation,
        probe_inflation,
        concurrent_flows: flows,
    };
    let allowed = match only {
        None => Allowed::ALL,
        Some(only) => {
            for p in &only {
                if !["route", "fetch", "local"].contains(&p.as_str()) {
                    return Err(invalid(format!(
                        "only: {p:?} is not one of \"route\", \"fetch\", \"local\""
                    )));
                }
            }
            let has = |p: &str| only.iter().any(|o| o == p);
            Allowed {
                route: has("route"),
                fetch: has("fetch"),
                local: has("local"),
            }
        }
    };
    let request = Request {
        mq_rows: mq,
        chunk_tokens: ct,
        selection: match topk {
            Some(topk) => Selection::Sparse { topk, holders },
            None => Selection::Contiguous,
        },
        tp_degree: tp,
        holder_requesters,
        allowed,
    };
    let costs = CostModel::new(params).map_err(py_err)?;
    let decision = costs.decide(&request).map_err(py_err)?;
    let attended = match request.selection {
        Selection::Contiguous => request.chunk_tokens,
        Selection::Sparse { topk, .. } => topk,
    };
    let dims = params.model;
    let report = PredictReport {
        model: preset.id.to_owned(),
        fabric: fabric_label,
        dims,
        query_row_bytes: dims.query_row_bytes(),
        partial_row_bytes: dims.partial_row_bytes(),
        kv_bytes_per_token_layer: dims.kv_bytes_per_token_layer(),
        effective_fabric: *costs.effective_fabric(),
        request,
        decision,
        sources: params.sources,
        byte_crossover_rows: byte_crossover_rows(&dims, attended).map_err(py_err)?,
        route_bytes_saved: route_bytes_saved(&dims, request.mq_rows, attended).map_err(py_err)?,
        route_fetch_crossover_rows: costs.route_fetch_crossover_rows(&request).map_err(py_err)?,
        notes: vec![LOCAL_IS_MODELLED],
    };
    to_record(py, &report)
}

/// The decision alone (`predict(...).decision`): the choice, the three costs and why.
#[pyfunction]
#[pyo3(signature = (mq, ct, model = "deepseek-v2-lite", fabric = None, topk = None,
                    holders = 1, probe_us = None, bw_gbps = None, only = None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn decide(
    py: Python<'_>,
    mq: u32,
    ct: u32,
    model: &str,
    fabric: Option<&str>,
    topk: Option<u32>,
    holders: u32,
    probe_us: Option<f64>,
    bw_gbps: Option<f64>,
    only: Option<Vec<String>>,
) -> PyResult<Py<PyAny>> {
    predict(
        py, mq, ct, model, fabric, topk, holders, 1, 1, probe_us, bw_gbps, None, None, None, None,
        1.0, 1.0, 1.0, 1, only,
    )?
    .getattr(py, "decision")
}

/// PrfaaS-PD throughput planning (paper 001 section 3.4; `kvroute plan prfaas --json`): the
/// best threshold and split over a `grid`, or one (`threshold`, `np`) evaluated. `profile`:
/// a length profile as JSON text (default: paper 001 table 5).
#[pyfunction]
#[pyo3(signature = (n_prfaas = 4, n_pd = 8, egress_gbps = 100.0, bs_max = 20, decode_tps = 40.0,
                    output_tokens = 1024.0, mu = 9.90, sigma = 1.00, min_tokens = 128.0,
                    max_tokens = 131072.0, profile = None, pd_prefill_slowdown = None,
                    grid = 1024, threshold = None, np = None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn plan_prfaas(
    py: Python<'_>,
    n_prfaas: u32,
    n_pd: u32,
    egress_gbps: f64,
    bs_max: u32,
    decode_tps: f64,
    output_tokens: f64,
    mu: f64,
    sigma: f64,
    min_tokens: f64,
    max_tokens: f64,
    profile: Option<&str>,
    pd_prefill_slowdown: Option<f64>,
    grid: u32,
    threshold: Option<f64>,
    np: Option<u32>,
) -> PyResult<Py<PyAny>> {
    let prfaas_profile = match profile {
        Some(text) => serde_json::from_str::<LengthProfile>(text)
            .map_err(|e| invalid(format!("profile is not a valid length profile: {e}")))?,
        None => LengthProfile::paper_001_table_5(),
    };
    let pd_profile = prfaas_profile
        .with_prefill_scaled(pd_prefill_slowdown.unwrap_or(H20_OVER_H200_PREFILL))
        .map_err(py_err)?;
    if !(decode_tps.is_finite() && decode_tps > 0.0) {
        return Err(invalid(format!(
            "decode_tps = {decode_tps} is invalid: it must be finite and > 0"
        )));
    }
    let planner = PrfaasPlanner {
        prfaas_profile,
        pd_profile,
        cluster: PrfaasCluster {
            prfaas_instances: n_prfaas,
            pd_instances: n_pd,
            egress_gbps,
            max_decode_batch: bs_max,
            decode_step_s: 1.0 / decode_tps,
            output_tokens,
        },
        lengths: TruncatedLogNormal::new(mu, sigma, min_tokens, max_tokens).map_err(py_err)?,
    };
    crate::sched::in_range("grid", grid.into(), 2, 65_536)?;
    let (grid, point) = match (threshold, np) {
        (Some(t), Some(n)) => (None, py.detach(|| planner.evaluate(t, n)).map_err(py_err)?),
        (None, None) => (
            Some(grid),
            py.detach(|| planner.search(grid)).map_err(py_err)?,
        ),
        _ => return Err(invalid("threshold and np go together")),
    };
    to_record(
        py,
        &PrfaasReport {
            planner,
            grid,
            point,
        },
    )
}

/// Helix parallelism's roofline for one decode layer (paper 004; `kvroute plan helix
/// --json`), with the HOP-B timeline when `hopb_requests`, `hopb_attention` and
/// `hopb_comm` are given.
#[pyfunction]
#[pyo3(signature = (batch = 8, q_heads = 128, kv_heads = 8, head_size = 128, seq_len = 1 << 20,
                    ffn_dim = 65536, tpa = 8, tpf = 64, kvp = 8, bytes_per_param = 0.5,
                    mem_bw_gbps = 8000.0, hopb_requests = None, hopb_attention = None,
                    hopb_comm = None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn plan_helix(
    py: Python<'_>,
    batch: u32,
    q_heads: u32,
    kv_heads: u32,
    head_size: u32,
    seq_len: u64,
    ffn_dim: u32,
    tpa: u32,
    tpf: u32,
    kvp: u32,
    bytes_per_param: f64,
    mem_bw_gbps: f64,
    hopb_requests: Option<u32>,
    hopb_attention: Option<f64>,
    hopb_comm: Option<f64>,
) -> PyResult<Py<PyAny>> {
    let layout = HelixLayout {
        batch,
        q_heads,
        kv_heads,
        head_size,
        seq_len,
        ffn_dim,
        tpa,
        tpf,
        kvp,
        bytes_per_param,
        mem_bw_gbps,
    };
    let roofline = layout.roofline().map_err(py_err)?;
    let hopb = match (hopb_requests, hopb_attention, hopb_comm) {
        (Some(requests), Some(attention_per_request), Some(comm_per_request)) => Some(
            HopB {
                requests,
                attention_per_request,
                comm_per_request,
            }
            .timeline()
            .map_err(py_err)?,
        ),
        (None, None, None) => None,
        _ => {
            return Err(invalid(
                "hopb_requests, hopb_attention and hopb_comm go together",
            ));
        }
    };
    to_record(
        py,
        &HelixReport {
            layout,
            roofline,
            total_us: roofline.total_us(),
            hopb,
        },
    )
}
