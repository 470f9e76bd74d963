//! # kvroute-costmodel
//!
//! The arithmetic that decides, per (chunk, request), whether to move the query to the
//! instance holding the KV (**route**), move the KV to the query (**fetch**), or recompute it
//! (**local**), together with the other closed-form models kvroute plans with:
//!
//! | module | what | source |
//! |---|---|---|
//! | [`model`], [`fabric`] | published model dimensions, fabric constants | paper 000 tables 1-2 |
//! | [`request`], [`cost`], [`predicate`] | probe / transfer / compute / return / merge terms, argmin | paper 000 sections 4-5 |
//! | [`crossover`], [`congestion`] | closed-form crossovers, contention | paper 000 sections 5, 8 |
//! | [`fit`] | fabric constants from measured sweeps, MAPE | paper 000 section 4.3 |
//! | [`prfaas`] | PrfaaS-PD throughput model and threshold search | paper 001 section 3.4 |
//! | [`helix`] | Helix DRAM roofline and HOP-B overlap | paper 004 appendix A, figure 3 |
//!
//! Paper 000 is "Move the Query, Not the Cache" (cross-instance MLA redistribution), paper 001
//! "Prefill-as-a-Service", paper 004 "Helix Parallelism"; every formula cites its section.
//!
//! The crate is pure: no I/O, no clocks, no threads. Every input and output type is `serde`.
//! Invalid input (zero, negative, NaN or infinite values, inconsistent counts, unknown preset
//! names) is a [`CostModelError`], never a panic. [`CostModel::new`] validates parameters once
//! so [`CostModel::decide`] is a few dozen floating-point operations with no allocation.
//!
//! ```
//! use kvroute_costmodel::{CostModel, CostParams, Primitive, Request, fabric_preset, model_preset};
//!
//! let model = model_preset("deepseek-v2-lite")?.dims;
//! let fabric = fabric_preset("h100-ibgda")?.fabric;
//! let costs = CostModel::new(CostParams::paper_defaults(model, fabric))?;
//! // A decode step of 256 query rows against a 2048-token chunk on another node.
//! let decision = costs.decide(&Request::contiguous(256, 2048))?;
//! assert_eq!(decision.choice, Primitive::Route);
//! println!("{decision}");
//! # Ok::<(), kvroute_costmodel::CostModelError>(())
//! ```

#![forbid(unsafe_code)]

pub mod congestion;
pub mod cost;
pub mod crossover;
pub mod error;
pub mod fabric;
pub mod fit;
pub mod helix;
pub mod model;
pub mod predicate;
pub mod prfaas;
pub mod request;
pub mod step_costs;

/// The README's Rust example, compiled and run as a doctest so it cannot go stale.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeExample;

pub use congestion::Congestion;
pub use cost::{CostBreakdown, CostModel, CostParams, Source, Sources, Term};
pub use error::{CostModelError, Requirement, Result};
pub use fabric::{FABRIC_PRESETS, Fabric, FabricPreset, fabric_preset};
pub use model::{MODEL_PRESETS, ModelDims, ModelPreset, model_preset};
pub use predicate::{Decision, Micros, PrimitiveCost, Reason};
pub use request::{Allowed, Primitive, Request, Selection};
pub use step_costs::{
    GatherCost, HolderCompute, KernelTable, MergeCost, SparsePremium, SpliceCost,
};
