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
use crate::error::{Result, positive};
use crate::fabric::Fabric;
use crate::model::ModelDims;
use crate::request::{Request, Selection};
use crate::step_costs::{GatherCost, HolderCompute, MergeCost, SpliceCost};

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
    /// `T_merge`: the requester's online-softmax merge.
    pub merge: MergeCost,
    /// `c`: re-prefill cost per token per layer, microseconds.
    pub local_us_per_token_layer: f64,
    /// Contention on the fabric.
    pub congestion: Congestion,
    /// The fabric whole-chunk pulls see, where it was measured apart from the routed round
    /// trip (a bulk paged transfer is not a one-write dispatch); `None`: `fabric` prices both,
    /// as paper 000 section 4.2 does.
    #[serde(default)]
    pub pull: Option<Fabric>,
    /// Where each group of constants came from.
    #[serde(default)]
    pub sources: Sources,
}

/// Where a group of constants came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Source {
    /// A paper's published figure, or a fit to its statements (the presets say which).
    #[default]
    Paper,
    /// Measured on the running system.
    Measured,
    /// Given by the user (a command-line value).
    Given,
}

impl Source {
    /// The lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Paper => "paper",
            Self::Measured => "measured",
            Self::Given => "given",
        }
    }
}

/// The source of each group of [`CostParams`] constants, so a printed prediction can say which
/// of its terms are a paper's and which were measured here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Sources {
    /// Probe, turnaround and BW of the routed round trip.
    pub fabric: Source,
    /// The pull fabric, where there is one.
    pub pull: Source,
    /// The holder's partial attention.
    pub holder: Source,
    /// The merge.
    pub merge: Source,
    /// The splice.
    pub splice: Source,
    /// The sparse gather.
    pub gather: Source,
    /// The re-prefill cost `c`.
    pub local: Source,
}

impl Sources {
    /// Every group from the papers.
    pub const PAPER: Self = Self {
        fabric: Source::Paper,
        pull: Source::Paper,
        holder: Source::Paper,
        merge: Source::Paper,
        splice: Source::Paper,
        gather: Source::Paper,
        local: Source::Paper,
    };

    /// `name: source` for each group, for a printed line.
    pub fn describe(&self) -> String {
        [
            ("fabric", self.fabric),
            ("pull", self.pull),
            ("holder compute", self.holder),
            ("merge", self.merge),
            ("splice", self.splice),
            ("gather", self.gather),
            ("local c", self.local),
        ]
        .iter()
        .map(|(what, s)| format!("{what} {}", s.name()))
        .collect::<Vec<_>>()
        .join(", ")
    }
}

impl CostParams {
    /// The operating point of paper 000 for `model` on `fabric`: the measured splice (section
    /// 7), the prototype gather (5.4), FlashMLA holder compute (6.3), the merge's 25 us bound
    /// (4.2) at Mq = 1024, and c = 1.0 us per token-layer, the middle of the 0.5-1.5 band of
    /// section 5.1. Every source is the paper's except the fabric, whose caller says.
    pub const fn paper_defaults(model: ModelDims, fabric: Fabric) -> Self {
        Self {
            model,
            fabric,
            splice: SpliceCost::MEASURED_H100_V2_LITE,
            gather: GatherCost::PROTOTYPE_H100_IBGDA,
            holder: HolderCompute::FLASHMLA_H100,
            merge: MergeCost::PAPER_BOUND,
            local_us_per_token_layer: 1.0,
            congestion: Congestion::NONE,
            pull: None,
            sources: Sources::PAPER,
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
    /// The transport subtotal: probe, turnaround, transfer, return and gather, everything
    /// but compute, merge and splice ([`CostBreakdown::transport_us`], kept here so a JSON
    /// reader sees it).
    #[serde(default)]
    pub transport_total_us: f64,
    /// Bytes over the fabric, all ranks together.
    pub wire_bytes: f64,
    /// Bytes over one rank pair's path.
    pub wire_bytes_per_rank: f64,
}

/// Term by term, the cost of doing both (one after the other).
impl std::ops::Add for CostBreakdown {
    type Output = Self;

    fn add(self, b: Self) -> Self {
        Self {
            probe_us: self.probe_us + b.probe_us,
            turnaround_us: self.turnaround_us + b.turnaround_us,
            transfer_us: self.transfer_us + b.transfer_us,
            compute_us: self.compute_us + b.compute_us,
            return_us: self.return_us + b.return_us,
            merge_us: self.merge_us + b.merge_us,
            splice_us: self.splice_us + b.splice_us,
            gather_us: self.gather_us + b.gather_us,
            transport_total_us: self.transport_total_us + b.transport_total_us,
            wire_bytes: self.wire_bytes + b.wire_bytes,
            wire_bytes_per_rank: self.wire_bytes_per_rank + b.wire_bytes_per_rank,
        }
    }
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

    /// The transport alone (probe, turnaround, transfer, return, gather): for route, what
    /// paper 000 reports as "T_route" in section 4.3 (~116 us at Mq = 1024 on IBGDA).
    #[inline]
    pub fn transport_us(&self) -> f64 {
        self.probe_us + self.turnaround_us + self.transfer_us + self.return_us + self.gather_us
    }

    /// The same breakdown with [`CostBreakdown::transport_total_us`] filled in.
    #[inline]
    fn with_transport_total(self) -> Self {
        Self {
            transport_total_us: self.transport_us(),
            ..self
        }
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
    pull: Fabric,
}

impl CostModel {
    /// Validates `params` and precomputes the fabric as congestion leaves it.
    pub fn new(params: CostParams) -> Result<Self> {
        params.model.validate()?;
        params.splice.validate()?;
        params.gather.validate()?;
        params.holder.validate()?;
        params.merge.validate()?;
        positive("local_us_per_token_layer", params.local_us_per_token_layer)?;
        let fabric = params.congestion.apply(&params.fabric)?;
        let pull = match &params.pull {
            Some(pull) => params.congestion.apply(pull)?,
            None => fabric,
        };
        Ok(Self {
            params,
            fabric,
            pull,
        })
    }

    /// The parameters this model was built from.
    pub const fn params(&self) -> &CostParams {
        &self.params
    }

    /// The fabric one flow sees after congestion.
    pub const fn effective_fabric(&self) -> &Fabric {
        &self.fabric
    }

    /// The fabric a whole-chunk pull sees after congestion (the routed one unless
    /// [`CostParams::pull`] is set).
    pub const fn effective_pull_fabric(&self) -> &Fabric {
        &self.pull
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
        let mq = f64::from(request.mq_rows);
        let ranks = f64::from(request.tp_degree);
        // The holder's kernel serves this requester's rows beside its co-batched requesters'
        // (taken to be of the same size); each rank runs its 1/N of the heads.
        let batch_rows = mq * f64::from(request.holder_requesters) / ranks;
        let (holders, compute_us) = match request.selection {
            Selection::Contiguous => (
                1,
                self.params
                    .holder
                    .dense_us(batch_rows, f64::from(request.chunk_tokens)),
            ),
            // Each holder attends its share of the selection; they run in parallel.
            Selection::Sparse { topk, holders } => (
                holders,
                self.params.holder.sparse_us(
                    batch_rows,
                    (f64::from(topk) / f64::from(holders)).ceil(),
                    f64::from(topk),
                ),
            ),
        };
        // The requester ships its rows to every holder of the set and gets a partial from each.
        let rows = mq * f64::from(holders);
        let query_bytes = rows * model.query_row_bytes() as f64;
        let partial_bytes = rows * model.partial_row_bytes() as f64;
        CostBreakdown {
            probe_us: self.fabric.probe_us,
            turnaround_us: self.fabric.turnaround_us,
            transfer_us: self.fabric.transfer_us(query_bytes / ranks),
            compute_us,
            return_us: self.fabric.transfer_us(partial_bytes / ranks),
            merge_us: self.params.merge.at(mq / ranks, f64::from(holders)),
            wire_bytes: query_bytes + partial_bytes,
            wire_bytes_per_rank: (query_bytes + partial_bytes) / ranks,
            ..CostBreakdown::default()
        }
        .with_transport_total()
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
                    probe_us: self.pulled_probe_us(),
                    transfer_us: self.pull.transfer_us(bytes / ranks),
                    splice_us: self.params.splice.at(f64::from(request.chunk_tokens)),
                    wire_bytes: bytes,
                    wire_bytes_per_rank: bytes / ranks,
                    ..CostBreakdown::default()
                }
                .with_transport_total()
            }
            Selection::Sparse { topk, holders } => {
                let bytes = model.chunk_bytes(topk, layers);
                CostBreakdown {
                    probe_us: self.pulled_probe_us(),
                    transfer_us: self.pull.transfer_us(bytes / ranks),
                    gather_us: f64::from(layers)
                        * self.params.gather.per_layer_us(f64::from(holders)),
                    wire_bytes: bytes,
                    wire_bytes_per_rank: bytes / ranks,
                    ..CostBreakdown::default()
                }
                .with_transport_total()
            }
        }
    }

    /// A pull's fixed cost: the measured pull fabric's intercept where there is one; none in
    /// paper 000's `T_pull = ct b_KV / BW` (section 4.2).
    #[inline]
    fn pulled_probe_us(&self) -> f64 {
        match self.params.pull {
            Some(_) => self.pull.probe_us + self.pull.turnaround_us,
            None => 0.0,
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
