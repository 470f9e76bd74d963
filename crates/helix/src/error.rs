//! The crate's one error type.

use std::time::Duration;

/// What can go wrong building or running a Helix layer.
#[derive(Debug, thiserror::Error)]
pub enum HelixError {
    /// A layout, shape or configuration that cannot run.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The transfer engine refused or failed an operation.
    #[error("transport: {0}")]
    Transport(#[from] kvroute_transport::TransportError),
    /// A write to a peer rank completed with an error.
    #[error("rank {rank}: write of round {round} ({what}) to rank {peer} failed: {why}")]
    WriteFailed {
        /// The rank reporting.
        rank: usize,
        /// The exchange round.
        round: u32,
        /// What the round carried.
        what: String,
        /// The destination rank.
        peer: usize,
        /// The transfer's error.
        why: String,
    },
    /// Peers did not deliver their part of a round in time (dead, hung or partitioned).
    #[error(
        "rank {rank}: round {round} ({what}) incomplete after {waited:?}: nothing from ranks {missing:?}, writes to ranks {unacknowledged:?} not completed"
    )]
    Timeout {
        /// The rank reporting.
        rank: usize,
        /// The exchange round.
        round: u32,
        /// What the round carried.
        what: String,
        /// How long it waited.
        waited: Duration,
        /// Ranks whose contribution never arrived.
        missing: Vec<usize>,
        /// Ranks this rank's writes to never completed (a dead peer's NIC may not answer).
        unacknowledged: Vec<usize>,
    },
    /// The exchange's bookkeeping saw an event it cannot account for.
    #[error("exchange bookkeeping: {0}")]
    Tracking(#[from] crate::tracker::TrackError),
    /// A kernel refused its input (a partial from a peer that is not finite, ...).
    #[error("kernel: {0}")]
    Kernel(#[from] kvroute_kernels::KernelError),
    /// The rendezvous that exchanges ranks' addresses failed.
    #[error("rendezvous: {0}")]
    Rendezvous(String),
}

/// The crate's result.
pub type Result<T, E = HelixError> = std::result::Result<T, E>;
