//! The redistribution cost model of paper 000 ("Move the Query, Not the Cache"), section 4:
//! every primitive is a sum of probe / transfer / compute / return / merge terms.
//!
//! - route: `T_probe + turnaround + Mq q / BW + T_compute + Mq p / BW + T_merge` (section 4.2);
//!   under sparse selection the query goes to every holder of the selected set and the M
//!   partials are merged (section 5.4).
//! - fetch: `ct b_KV L / BW + T_splice` for contiguous reuse (sections 2.2, 4.2); under sparse
//!   selection a multi-holder gather of the selected entries over all layers, no splice.
//! - local: `ct L c`, a re-prefill priced from the per-token-layer cost `c` (section 5.1).
//!
//! [`CostModel::new`] validates every parameter once; the per-request methods then do a few
//! integer checks and plain arithmetic, allocating nothing.

use serde::{Deserialize, Serialize};

use crate::congestion::Congestion;
use crate::error::{Result, non_negative, positive};
use crate::fabric::Fabric;
use crate::model::ModelDims;
use crate::request::{Request, Selection};
use crate::step_costs::{GatherCost, HolderCompute, SpliceCost};

/// Everything the model needs besides the request.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CostParams {
    /// Model geometry.
    pub model: ModelDims,
    /// Fabric constants between requester and holders.
    pub fabric: Fabric,
    /// The contiguous-fetch splice.
    pub splice: SpliceCost,
    /// The sparse-fetch gather overhead.
    pub gather: GatherCost,
    /// The holder's partial attention.
    pub holder: HolderCompute,
    /// `T_merge`: the requester's online-softmax merge, microseconds.
    pub merge_us: f64,
    /// `c`: re-prefill cost per token per layer, microseconds.
    pub local_us_per_token_layer: f64,
    /// Contention on the fabric.
    pub congestion: Congestion,
}

impl CostParams {
    /// The operating point of paper 000 for `model` on `fabric`: the measured splice (section
    /// 7), the prototype gather (5.4), FlashMLA holder compute (6.3), a merge of at most 25 us
    /// (4.2), and c = 1.0 us per token-layer, the middle of the 0.5-1.5 band of section 5.1.
    pub const fn paper_defaults(model: ModelDims, fabric: Fabric) -> Self {
        Self {
            model,
            fabric,
            splice: SpliceCost::MEASURED_H100_V2_LITE,
            gather: GatherCost::PROTOTYPE_H100_IBGDA,
            holder: HolderCompute::FLASHMLA_H100,
            merge_us: 25.0,
            local_us_per_token_layer: 1.0,
            congestion: Congestion::NONE,
        }
    }
}

/// Which additive term a cost is spent in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Term {
    /// Signal round trip.
    Probe,
    /// Fixed kernel turnaround.
    Turnaround,
    /// Outbound bytes (query rows, or the pulled cache).
    Transfer,
    /// Holder partial attention, or local re-prefill.
    Compute,
    /// Partial rows coming back.
    Return,
    /// Online-softmax merge.
    Merge,
    /// Position-adaptation splice.
    Splice,
    /// Per-holder gather overhead.
    Gather,
}

impl Term {
    /// The lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Probe => "probe",
            Self::Turnaround => "turnaround",
            Self::Transfer => "transfer",
            Self::Compute => "compute",
            Self::Return => "return",
            Self::Merge => "merge",
            Self::Splice => "splice",
            Self::Gather => "gather",
        }
    }
}

impl std::fmt::Display for Term {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One primitive's cost, term by term (microseconds), and the bytes it puts on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct CostBreakdown {
    /// Signal round trip.
    pub probe_us: f64,
    /// Fixed kernel turnaround.
    pub turnaround_us: f64,
    /// Outbound bytes.
    pub transfer_us: f64,
    /// Holder partial attention (route) or re-prefill (local).
    pub compute_us: f64,
    /// Partial rows back (route).
    pub return_us: f64,
    /// Online-softmax merge (route).
    pub merge_us: f64,
    /// Splice (contiguous fetch).
    pub splice_us: f64,
    /// Gather overhead (sparse fetch).
    pub gather_us: f64,
    /// Bytes over the fabric, all ranks together.
    pub wire_bytes: f64,
    /// Bytes over one rank pair's path.
    pub wire_bytes_per_rank: f64,
}

impl CostBreakdown {
    /// The terms with their names, in the order of the decomposition.
    #[inline]
    pub const fn terms(&self) -> [(Term, f64); 8] {
        [
            (Term::Probe, self.probe_us),
            (Term::Turnaround, self.turnaround_us),
            (Term::Transfer, self.transfer_us),
            (Term::Compute, self.compute_us),
            (Term::Return, self.return_us),
            (Term::Merge, self.merge_us),
            (Term::Splice, self.splice_us),
            (Term::Gather, self.gather_us),
        ]
    }

    /// The whole cost.
    #[inline]
    pub fn total_us(&self) -> f64 {
        self.terms().iter().map(|(_, us)| us).sum()
    }

    /// The transport round trip alone (probe, turnaround, transfer, return): what paper 000
    /// reports as "T_route" in section 4.3.
    pub fn transport_us(&self) -> f64 {
        self.probe_us + self.turnaround_us + self.transfer_us + self.return_us
    }

    /// The largest term (the first one on a tie).
    #[inline]
    pub fn dominant(&self) -> Term {
        let terms = self.terms();
        let mut best = terms[0];
        for term in &terms[1..] {
            if term.1 > best.1 {
                best = *term;
            }
        }
        best.0
    }
}

/// A validated cost model: parameters checked once, congestion applied once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    params: CostParams,
    fabric: Fabric,
}

impl CostModel {
    /// Validates `params` and precomputes the fabric as congestion leaves it.
    pub fn new(params: CostParams) -> Result<Self> {
        params.model.validate()?;
        params.splice.validate()?;
        params.gather.validate()?;
        params.holder.validate()?;
        non_negative("merge_us", params.merge_us)?;
        positive("local_us_per_token_layer", params.local_us_per_token_layer)?;
        let fabric = params.congestion.apply(&params.fabric)?;
        Ok(Self { params, fabric })
    }

    /// The parameters this model was built from.
    pub const fn params(&self) -> &CostParams {
        &self.params
    }

    /// The fabric one flow sees after congestion.
    pub const fn effective_fabric(&self) -> &Fabric {
        &self.fabric
    }

    /// Route's cost for `request`.
    pub fn route(&self, request: &Request) -> Result<CostBreakdown> {
        request.validate()?;
        Ok(self.route_unchecked(request))
    }

    /// Fetch's cost for `request`.
    pub fn fetch(&self, request: &Request) -> Result<CostBreakdown> {
        request.validate()?;
        Ok(self.fetch_unchecked(request))
    }

    /// Local's cost for `request`. No model weights run here: this is the cost model's
    /// `ct L c` term, not a measurement.
    pub fn local(&self, request: &Request) -> Result<CostBreakdown> {
        request.validate()?;
        Ok(self.local_unchecked(request))
    }

    #[inline]
    pub(crate) fn route_unchecked(&self, request: &Request) -> CostBreakdown {
        let model = &self.params.model;
        let holders = match request.selection {
            Selection::Contiguous => 1,
            Selection::Sparse { holders, .. } => holders,
        };
        // The requester ships its rows to every holder of the set and gets a partial from each.
        let rows = f64::from(request.mq_rows) * f64::from(holders);
        let ranks = f64::from(request.tp_degree);
        let query_bytes = rows * model.query_row_bytes() as f64;
        let partial_bytes = rows * model.partial_row_bytes() as f64;
        CostBreakdown {
            probe_us: self.fabric.probe_us,
            turnaround_us: self.fabric.turnaround_us,
            transfer_us: self.fabric.transfer_us(query_bytes / ranks),
            compute_us: self.params.holder.at(request.holder_requesters),
            return_us: self.fabric.transfer_us(partial_bytes / ranks),
            merge_us: self.params.merge_us,
            wire_bytes: query_bytes + partial_bytes,
            wire_bytes_per_rank: (query_bytes + partial_bytes) / ranks,
            ..CostBreakdown::default()
        }
    }

    #[inline]
    pub(crate) fn fetch_unchecked(&self, request: &Request) -> CostBreakdown {
        let model = &self.params.model;
        let layers = model.layers;
        let ranks = f64::from(request.tp_degree);
        match request.selection {
            Selection::Contiguous => {
                let bytes = model.chunk_bytes(request.chunk_tokens, layers);
                CostBreakdown {
                    transfer_us: self.fabric.transfer_us(bytes / ranks),
                    splice_us: self.params.splice.at(f64::from(request.chunk_tokens)),
                    wire_bytes: bytes,
                    wire_bytes_per_rank: bytes / ranks,
                    ..CostBreakdown::default()
                }
            }
            Selection::Sparse { topk, holders } => {
                let bytes = model.chunk_bytes(topk, layers);
                CostBreakdown {
                    transfer_us: self.fabric.transfer_us(bytes / ranks),
                    gather_us: f64::from(layers)
                        * self.params.gather.per_layer_us(f64::from(holders)),
                    wire_bytes: bytes,
                    wire_bytes_per_rank: bytes / ranks,
                    ..CostBreakdown::default()
                }
            }
        }
    }

    #[inline]
    pub(crate) fn local_unchecked(&self, request: &Request) -> CostBreakdown {
        let token_layers = f64::from(request.chunk_tokens) * f64::from(self.params.model.layers);
        CostBreakdown {
            compute_us: token_layers * self.params.local_us_per_token_layer,
            ..CostBreakdown::default()
        }
    }
}
