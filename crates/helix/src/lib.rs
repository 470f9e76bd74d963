//! # kvroute-helix
//!
//! Helix parallelism (paper 004, "Helix Parallelism") for one decode layer, over the kvroute
//! transfer engine: `N` ranks shard the KV cache along the sequence (`KVP`) and the KV heads
//! (`TPA <= K`) during attention, exchange their partial outputs and log-sum-exp statistics in
//! one all-to-all of one-sided writes with immediates, merge them exactly, and are then
//! re-provisioned as `TPF x EP` for the FFN. New tokens are placed by staged round-robin
//! ([`Placement`]); HOP-B overlaps each request's all-to-all with the next one's attention.
//!
//! - [`Layout`]: the two grids and which rank does what;
//! - [`HelixRank`]: one rank (threads over the `mem` domain, or processes over libfabric);
//!   [`Reference`]: the same layer on one rank, for the checks;
//! - [`Exchange`]: the rounds the collectives are made of; [`tracker`]: their completion
//!   bookkeeping, free of I/O;
//! - [`Rendezvous`]: how ranks swap addresses before the first step.
//!
//! CPU kernels stand in for the GPU ones (MLA through kvroute-kernels); what the step's phases
//! cost here against the paper's roofline is in docs/helix.md.

#![forbid(unsafe_code)]

pub mod attention;
mod error;
pub mod exchange;
pub mod layout;
pub mod model;
pub mod placement;
pub mod pool;
mod rank;
pub mod rendezvous;
pub mod tracker;

pub use error::{HelixError, Result};
pub use exchange::{Exchange, PeerInfo, StepPlan};
pub use layout::Layout;
pub use model::{Attention, Ffn, Shape};
pub use placement::Placement;
pub use pool::run_threads;
pub use rank::{Check, HelixConfig, HelixRank, Phases, Reference, StepReport};
pub use rendezvous::{DirRendezvous, LocalRendezvous, Rendezvous};
