//! `kvroute predict`: the three costs of one (chunk, request), the choice and its reason.

use std::fmt;

use anyhow::{Context, Result};
use kvroute_costmodel::crossover::{byte_crossover_rows, route_bytes_saved};
use kvroute_costmodel::{
    Allowed, Congestion, CostModel, CostParams, Decision, Fabric, MergeCost, ModelDims, Primitive,
    Request, Selection, Source, Sources, SpliceCost, fabric_preset, model_preset,
};
use serde::Serialize;

use crate::args::{PredictArgs, PrimitiveArg};
use crate::units::{Bytes, Micros};

/// Said wherever local's cost is reported: nothing is recomputed here.
pub(crate) const LOCAL_IS_MODELLED: &str = "local is the cost model's ct x L x c re-prefill term, not a measurement: no model weights run here";

/// Everything `predict` prints.
#[derive(Debug, Clone, Serialize)]
pub struct PredictReport {
    /// Model preset id.
    pub model: String,
    /// Fabric preset id, or `measured`.
    pub fabric: String,
    /// The model's dimensions.
    pub dims: ModelDims,
    /// Bytes of one routed query row (q).
    pub query_row_bytes: u64,
    /// Bytes of one partial row (p).
    pub partial_row_bytes: u64,
    /// Cache bytes per token per layer (b_KV).
    pub kv_bytes_per_token_layer: u64,
    /// The fabric one flow sees after congestion.
    pub effective_fabric: Fabric,
    /// The request priced.
    pub request: Request,
    /// The three costs, the choice and the reason.
    pub decision: Decision,
    /// Where each group of constants came from (paper, measured, given).
    pub sources: Sources,
    /// Mq* over the attended tokens (one layer, paper 000 section 5.2).
    pub byte_crossover_rows: f64,
    /// Fraction of one layer's pull that routing saves (negative: routing ships more).
    pub route_bytes_saved: f64,
    /// Query batch above which fetch beats route on time, if any.
    pub route_fetch_crossover_rows: Option<f64>,
    /// Caveats a reader needs.
    pub notes: Vec<&'static str>,
}

fn fabric_from(args: &PredictArgs) -> Result<(String, Fabric)> {
    let (label, mut fabric) = match (args.probe_us, args.bw_gbps) {
        (Some(probe_us), Some(bw_gbps)) => {
            ("measured".to_owned(), Fabric::measured(probe_us, bw_gbps)?)
        }
        _ => {
            let preset = fabric_preset(args.fabric.as_deref().unwrap_or("h100-ibgda"))?;
            (preset.id.to_owned(), preset.fabric)
        }
    };
    if let Some(us) = args.turnaround_us {
        fabric = fabric.with_turnaround_us(us)?;
    }
    if let Some(gbps) = args.link_gbps {
        fabric = fabric.with_link_gbps(gbps)?;
    }
    Ok((label, fabric))
}

fn allowed_from(only: &[PrimitiveArg]) -> Allowed {
    if only.is_empty() {
        return Allowed::ALL;
    }
    Allowed {
        route: only.contains(&PrimitiveArg::Route),
        fetch: only.contains(&PrimitiveArg::Fetch),
        local: only.contains(&PrimitiveArg::Local),
    }
}

/// Builds the parameters and request from the command line and prices them.
pub(crate) fn run(args: &PredictArgs) -> Result<PredictReport> {
    let preset = model_preset(&args.model)?;
    let (fabric_label, fabric) = fabric_from(args)?;
    let mut params = CostParams::paper_defaults(preset.dims, fabric);
    if fabric_label == "measured" {
        params.sources.fabric = Source::Given;
    }
    if let Some(us) = args.splice_us {
        params.splice = SpliceCost {
            fixed_us: us,
            per_token_us: 0.0,
        };
        params.sources.splice = Source::Given;
    }
    if args.local_us_per_token_layer != 1.0 {
        params.sources.local = Source::Given;
    }
    params.local_us_per_token_layer = args.local_us_per_token_layer;
    if let Some(us) = args.merge_us {
        params.merge = MergeCost {
            fixed_us: us,
            us_per_row_part: 0.0,
        };
        params.sources.merge = Source::Given;
    }
    params.congestion = Congestion {
        bw_degradation: args.bw_degradation,
        probe_inflation: args.probe_inflation,
        concurrent_flows: args.flows,
    };
    let selection = match args.topk {
        Some(topk) => Selection::Sparse {
            topk,
            holders: args.holders,
        },
        None => Selection::Contiguous,
    };
    let request = Request {
        mq_rows: args.mq,
        chunk_tokens: args.ct,
        selection,
        tp_degree: args.tp,
        holder_requesters: args.holder_requesters,
        allowed: allowed_from(&args.only),
    };
    evaluate(preset.id, &fabric_label, params, request)
}

/// Prices `request` under `params`; shared by `predict` and the tour.
pub(crate) fn evaluate(
    model: &str,
    fabric: &str,
    params: CostParams,
    request: Request,
) -> Result<PredictReport> {
    let costs = CostModel::new(params)?;
    let decision = costs.decide(&request)?;
    let attended = match request.selection {
        Selection::Contiguous => request.chunk_tokens,
        Selection::Sparse { topk, .. } => topk,
    };
    let dims = params.model;
    Ok(PredictReport {
        model: model.to_owned(),
        fabric: fabric.to_owned(),
        dims,
        query_row_bytes: dims.query_row_bytes(),
        partial_row_bytes: dims.partial_row_bytes(),
        kv_bytes_per_token_layer: dims.kv_bytes_per_token_layer(),
        effective_fabric: *costs.effective_fabric(),
        request,
        decision,
        sources: params.sources,
        byte_crossover_rows: byte_crossover_rows(&dims, attended)?,
        route_bytes_saved: route_bytes_saved(&dims, request.mq_rows, attended)?,
        route_fetch_crossover_rows: costs
            .route_fetch_crossover_rows(&request)
            .context("route/fetch crossover")?,
        notes: vec![LOCAL_IS_MODELLED],
    })
}

impl fmt::Display for PredictReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = &self.request;
        let shape = match r.selection {
            Selection::Contiguous => "contiguous".to_owned(),
            Selection::Sparse { topk, holders } => format!("top-{topk} over {holders} holder(s)"),
        };
        let fab = &self.effective_fabric;
        writeln!(
            f,
            "{} on {}: Mq = {} rows, ct = {} tokens, {shape}, TP = {}",
            self.model, self.fabric, r.mq_rows, r.chunk_tokens, r.tp_degree
        )?;
        writeln!(
            f,
            "  q = {} B, p = {} B, b_KV = {} B/token/layer, L = {}; probe {} + turnaround {}, BW {:.3} GB/s",
            self.query_row_bytes,
            self.partial_row_bytes,
            self.kv_bytes_per_token_layer,
            self.dims.layers,
            Micros(fab.probe_us),
            Micros(fab.turnaround_us),
            fab.bw_gbps
        )?;
        for p in Primitive::ALL {
            let c = self.decision.cost(p);
            let mark = if p == self.decision.choice {
                '*'
            } else if c.allowed {
                ' '
            } else {
                'x'
            };
            write!(
                f,
                "{mark} {:<6}{:>12}  {:>10} on the wire  ",
                p.name(),
                Micros(c.total_us).to_string(),
                Bytes(c.breakdown.wire_bytes).to_string()
            )?;
            let terms: Vec<String> = c
                .breakdown
                .terms()
                .iter()
                .filter(|(_, us)| *us > 0.0)
                .map(|(t, us)| format!("{t} {}", Micros(*us)))
                .collect();
            writeln!(
                f,
                "{}{}",
                terms.join(", "),
                if c.breakdown.transport_total_us > 0.0 {
                    format!(
                        "; transport subtotal {}",
                        Micros(c.breakdown.transport_total_us)
                    )
                } else {
                    String::new()
                }
            )?;
        }
        writeln!(f, "constants: {}", self.sources.describe())?;
        writeln!(f, "choice: {}", self.decision)?;
        write!(f, "bytes: Mq* = {:.0} rows; ", self.byte_crossover_rows)?;
        if self.route_bytes_saved >= 0.0 {
            write!(
                f,
                "routing saves {:.1}% of one layer's pull",
                100.0 * self.route_bytes_saved
            )?;
        } else {
            write!(
                f,
                "routing ships {:.1}x the bytes of one layer's pull",
                1.0 - self.route_bytes_saved
            )?;
        }
        match self.route_fetch_crossover_rows {
            Some(rows) => writeln!(f, "; fetch beats route on time above Mq = {rows:.0}")?,
            None => writeln!(f, "; route's fixed terms already exceed fetch")?,
        }
        for note in &self.notes {
            writeln!(f, "note: {note}")?;
        }
        Ok(())
    }
}
