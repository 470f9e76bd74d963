//! Counters readable from the API: work requests posted, completed and failed per NIC, and
//! (when enabled) the latency samples the benches read. Written only by whoever runs the
//! group's pass (its worker thread, or the holder of its manual-progress lock, which orders
//! successive holders), so an update is a relaxed load and store, not a read-modify-write.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use super::shared::WorkerWritten;

/// One NIC's counters.
#[derive(Debug, Default)]
pub(crate) struct DomainCounters {
    pub(crate) posted: AtomicU64,
    pub(crate) completed: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) unreported: AtomicU64,
    pub(crate) bytes: AtomicU64,
    pub(crate) arrivals: AtomicU64,
}

/// Adds `n` to a counter only the group's pass writes (see the module's note).
pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Ordering::Relaxed) + n, Ordering::Relaxed);
}

/// Takes `n` from a counter only the group's pass writes.
pub(crate) fn sub(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Ordering::Relaxed) - n, Ordering::Relaxed);
}

impl DomainCounters {
    fn snapshot(&self) -> DomainStats {
        DomainStats {
            posted: self.posted.load(Ordering::Relaxed),
            completed: self.completed.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            unreported: self.unreported.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            arrivals: self.arrivals.load(Ordering::Relaxed),
        }
    }
}

/// Work-request counts of one NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct DomainStats {
    /// Work requests posted.
    pub posted: u64,
    /// Work requests completed successfully.
    pub completed: u64,
    /// Work requests completed with an error.
    pub failed: u64,
    /// Work requests posted without a completion (immediate-only writes nobody waits on):
    /// counted in `posted`, never in `completed` or `failed`.
    pub unreported: u64,
    /// Bytes of the writes and sends posted.
    pub bytes: u64,
    /// Peers' writes with an immediate that landed here.
    pub arrivals: u64,
}

/// Counters of one domain group.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct GroupStats {
    /// Per NIC, NIC 0 first.
    pub domains: Vec<DomainStats>,
    /// Transfers accepted and not yet finished.
    pub in_flight: u64,
    /// Bytes of memory registered with the group's NICs now.
    pub registered_bytes: u64,
    /// Peers connected now.
    pub peers: u64,
}

/// Everything [`crate::TransferEngine::stats`] reports.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct EngineStats {
    /// Per domain group.
    pub groups: Vec<GroupStats>,
    /// Immediate values with counts or expectations held by the IMM counter.
    pub imm_values_tracked: usize,
    /// Arrivals dropped because their value found no room in the IMM counter
    /// ([`crate::TransferEngine::dropped_imms`]).
    pub imm_dropped: u64,
}

/// Latency samples, recorded only when the engine is configured to.
#[derive(Debug, Default)]
pub(crate) struct LatencyLog {
    /// Application submit call to the transfer's first posted work request.
    pub(crate) submit_to_post: Mutex<Vec<Duration>>,
    /// First to last posted work request of one transfer.
    pub(crate) post_span: Mutex<Vec<Duration>>,
}

impl LatencyLog {
    pub(crate) fn push(log: &Mutex<Vec<Duration>>, sample: Duration) {
        log.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(sample);
    }

    pub(crate) fn take(log: &Mutex<Vec<Duration>>) -> Vec<Duration> {
        std::mem::take(&mut *log.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

pub(crate) fn snapshot(domains: &[DomainCounters], written: &WorkerWritten) -> GroupStats {
    GroupStats {
        domains: domains.iter().map(DomainCounters::snapshot).collect(),
        in_flight: written.in_flight.load(Ordering::Relaxed),
        registered_bytes: written.registered_bytes.load(Ordering::Relaxed),
        peers: written.peers.load(Ordering::Relaxed),
    }
}
