//! PrfaaS throughput planning (paper 001, "Prefill-as-a-Service", section 3.4): how many
//! requests per second a PrfaaS-PD deployment sustains, and the routing threshold `t` and
//! prefill/decode split `Np / Nd` that maximise it.
//!
//! Long requests (`L > t`) are prefilled in a remote PrfaaS cluster and their KVCache shipped
//! over an egress link of `B_out`; short ones are prefilled by the PD cluster's own prefill
//! nodes; all are decoded by its decode nodes. [`TruncatedLogNormal`] gives the split `p` and
//! the representative lengths in closed form, [`LengthProfile`] the measured size and time per
//! length, and [`PrfaasPlanner`] evaluates eqs. 3-6 and searches `(t, Np)`.

mod lognormal;
mod profile;
mod throughput;

pub use lognormal::{LogNormalSpec, TruncatedLogNormal};
pub use profile::{LengthProfile, ProfilePoint};
pub use throughput::{
    H20_OVER_H200_PREFILL, OperatingPoint, PrfaasCluster, PrfaasPlanner, Stage,
    cluster_egress_gbps, lambda_max, phi_kv_gbps,
};
