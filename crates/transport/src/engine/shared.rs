//! State shared between application threads and the workers: the per-group directories of
//! registered regions and connected peers (written by the worker, read by submitters so they
//! can validate and resolve a request without a round trip), the IMM counter, and the worker's
//! wake-up handle.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};
use std::sync::{Arc, OnceLock, PoisonError, RwLock};
use std::thread::Thread;

use crossbeam_channel::Sender;

use super::callbacks::CallbackQueue;
use super::message::Message;
use super::stats::{DomainCounters, LatencyLog};
use crate::addr::{DomainAddr, MAX_NICS, NetAddr};
use crate::domain::Notify;
use crate::imm_counter::ImmCounter;
use crate::mr::{Device, RegionKey};
use crate::on_done::OnDone;

/// A registered region as submitters see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RegionEntry {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) lkeys: [u64; MAX_NICS],
    pub(crate) generation: u32,
    pub(crate) device: Device,
}

/// A connected peer (domain group): its index in the worker's peer table and its address.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct PeerEntry {
    pub(crate) index: u32,
    pub(crate) addr: NetAddr,
}

/// Regions and peers of one domain group.
#[derive(Debug, Default)]
pub(crate) struct Directory {
    regions: RwLock<Vec<Option<RegionEntry>>>,
    /// Keyed by every NIC address of every peer: a NIC belongs to one peer only.
    peers: RwLock<HashMap<DomainAddr, Arc<PeerEntry>>>,
}

impl Directory {
    pub(crate) fn region(&self, key: RegionKey) -> Option<RegionEntry> {
        let regions = self.regions.read().unwrap_or_else(PoisonError::into_inner);
        regions
            .get(key.slot as usize)
            .copied()
            .flatten()
            .filter(|r| r.generation == key.generation)
    }

    pub(crate) fn set_region(&self, slot: u32, entry: Option<RegionEntry>) {
        let mut regions = self.regions.write().unwrap_or_else(PoisonError::into_inner);
        if regions.len() <= slot as usize {
            regions.resize(slot as usize + 1, None);
        }
        regions[slot as usize] = entry;
    }

    /// The peer that owns NIC `nic`.
    pub(crate) fn peer(&self, nic: &DomainAddr) -> Option<Arc<PeerEntry>> {
        self.peers
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(nic)
            .cloned()
    }

    pub(crate) fn insert_peer(&self, entry: &Arc<PeerEntry>) {
        let mut peers = self.peers.write().unwrap_or_else(PoisonError::into_inner);
        for nic in &entry.addr.nics {
            peers.insert(nic.clone(), entry.clone());
        }
    }
}

/// Wakes a parked worker. The worker announces it is about to park, looks for work once more,
/// and parks; a producer publishes its work, then checks the announcement. With a sequentially
/// consistent fence on both sides, at least one of them sees the other, so no wake-up is lost
/// (and the park has a timeout as a second line of defence).
#[derive(Debug, Default)]
pub(crate) struct WorkerWake {
    thread: OnceLock<Thread>,
    sleeping: AtomicBool,
}

impl WorkerWake {
    pub(crate) fn bind(&self, thread: Thread) {
        // Bound once, by the worker itself, before it can park.
        let _ = self.thread.set(thread);
    }

    pub(crate) fn announce_sleep(&self) {
        self.sleeping.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    pub(crate) fn awake(&self) {
        self.sleeping.store(false, Ordering::SeqCst);
    }
}

impl Notify for WorkerWake {
    fn notify(&self) {
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst)
            && let Some(t) = self.thread.get()
        {
            t.unpark();
        }
    }
}

/// What submitters need of one domain group.
#[derive(Debug)]
pub(crate) struct GroupShared {
    pub(crate) index: u16,
    pub(crate) device: Device,
    pub(crate) provider: String,
    pub(crate) addr: NetAddr,
    pub(crate) directory: Directory,
    pub(crate) tx: Sender<Message>,
    pub(crate) wake: Arc<WorkerWake>,
    pub(crate) counters: Vec<DomainCounters>,
    pub(crate) in_flight: AtomicU64,
    pub(crate) latency: LatencyLog,
}

impl GroupShared {
    pub(crate) fn nics(&self) -> usize {
        self.addr.nics.len()
    }
}

/// A peer group: its members' peer entries, in order (paper 002 `add_peer_group`).
#[derive(Debug)]
pub(crate) struct PeerGroupEntry {
    pub(crate) group: u16,
    pub(crate) members: Vec<Arc<PeerEntry>>,
}

/// What everything in one engine shares.
#[derive(Debug)]
pub(crate) struct EngineShared {
    pub(crate) id: u64,
    pub(crate) imm: ImmCounter<OnDone>,
    pub(crate) callbacks: CallbackQueue,
    pub(crate) unexpected_imm_handler: AtomicBool,
    pub(crate) record_latency: bool,
}
