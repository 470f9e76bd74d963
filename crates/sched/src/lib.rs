//! # kvroute-sched
//!
//! Cluster-level scheduling for disaggregated serving, as state machines free of I/O, and a
//! discrete-event simulator that drives them at the papers' scales:
//!
//! - [`prfaas`]: the PrfaaS router of paper 001 section 3.4.3 (length threshold, bandwidth-
//!   and cache-aware placement, short-timescale threshold feedback);
//! - [`prfaas_sim`]: PrfaaS-PD, homogeneous PD and naive heterogeneous deployments simulated
//!   side by side (paper 001 section 4's case study);
//! - [`selector`]: the per-request route / fetch / local selector of paper 000, its constants
//!   calibrated on the live system (fabric fit, holders' kernel reports, load and liveness);
//! - [`des`]: the event queue and FIFO link the simulators share; [`stats`]: percentiles and
//!   max/avg balance; [`rng`]: the seeded generator every workload draws from.

pub mod des;
pub mod dualpath;
pub mod dualpath_sim;
mod error;
pub mod prfaas;
pub mod prfaas_sim;
pub mod rng;
pub mod selector;
pub mod stats;
mod window_totals;

pub use error::{Result, SchedError};
