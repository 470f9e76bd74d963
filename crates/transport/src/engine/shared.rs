//! State shared between application threads and the workers: the per-group directories of
//! registered regions and connected peers (written by the worker, read by submitters so they
//! can validate and resolve a request without a round trip), the IMM counter, and the worker's
//! wake-up handle.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};
use std::sync::{Arc, OnceLock, PoisonError, RwLock};
use std::thread::Thread;

use crossbeam_channel::{Receiver, Sender};
use crossbeam_utils::CachePadded;

use super::callbacks::CallbackQueue;
use super::message::{Command, Message};
use super::stats::{DomainCounters, LatencyLog};
use crate::addr::{DomainAddr, MAX_NICS, NetAddr};
use crate::domain::Notify;
use crate::error::{TransferError, TransportError};
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
#[derive(Debug)]
pub(crate) struct Directory {
    /// Unique in the process (never the id of a directory dropped before): what a thread's
    /// cached peer ([`LAST_PEER`]) names its directory by.
    id: u64,
    regions: RwLock<Vec<Option<RegionEntry>>>,
    /// Keyed by every NIC address of every peer: a NIC belongs to one peer only.
    peers: RwLock<crate::FastMap<DomainAddr, Arc<PeerEntry>>>,
    /// Peers removed so far: a cached peer stands while this has not moved.
    removals: AtomicU64,
}

impl Default for Directory {
    fn default() -> Self {
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            regions: RwLock::default(),
            peers: RwLock::default(),
            removals: AtomicU64::new(0),
        }
    }
}

/// The peer a thread last found in a directory.
struct LastPeer {
    directory: u64,
    removals: u64,
    entry: Arc<PeerEntry>,
}

thread_local! {
    /// Per thread, the peer of its last lookup: most submits go to the peer of the one before,
    /// and finding it here takes no lock and no hash. A peer's index is never reused (a
    /// released peer's index stays released), so a cached entry can only be outdated by a
    /// removal, which [`Directory::removals`] counts. A dropped engine's peer stays here (its
    /// address, a few hundred bytes) until the thread's next lookup.
    static LAST_PEER: std::cell::RefCell<Option<LastPeer>> = const { std::cell::RefCell::new(None) };
}

impl Directory {
    /// Unique in the process, never reused.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Peers removed so far: a peer resolved when this read the same is still in place.
    pub(crate) fn removals(&self) -> u64 {
        self.removals.load(Ordering::Acquire)
    }

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

    /// `f` of this thread's last peer in this directory ([`LAST_PEER`]), while no peer has
    /// been removed since it was found.
    pub(crate) fn last_peer<R>(&self, f: impl FnOnce(&PeerEntry) -> Option<R>) -> Option<R> {
        let removals = self.removals.load(Ordering::Acquire);
        // `try_with`: a thread whose locals are being destroyed looks its peers up as any.
        LAST_PEER
            .try_with(|last| {
                let last = last.borrow();
                let last = last
                    .as_ref()
                    .filter(|l| l.directory == self.id && l.removals == removals)?;
                f(&last.entry)
            })
            .ok()
            .flatten()
    }

    /// The peer that owns NIC `nic`, which becomes this thread's last peer.
    pub(crate) fn find_peer(&self, nic: &DomainAddr) -> Option<Arc<PeerEntry>> {
        let removals = self.removals.load(Ordering::Acquire);
        let entry = self.peer(nic)?;
        let _ = LAST_PEER.try_with(|last| {
            *last.borrow_mut() = Some(LastPeer {
                directory: self.id,
                removals,
                entry: entry.clone(),
            });
        });
        Some(entry)
    }

    /// The peer that owns NIC `nic`.
    pub(crate) fn peer(&self, nic: &DomainAddr) -> Option<Arc<PeerEntry>> {
        self.peers
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(nic)
            .cloned()
    }

    /// Forgets `entry`'s NICs (the peer was released).
    pub(crate) fn remove_peer(&self, entry: &PeerEntry) {
        let mut peers = self.peers.write().unwrap_or_else(PoisonError::into_inner);
        for nic in &entry.addr.nics {
            if peers.get(nic).is_some_and(|e| e.index == entry.index) {
                peers.remove(nic);
            }
        }
        self.removals.fetch_add(1, Ordering::Release);
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
        // `GroupShared::after_send` relies on this fence too.
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
    /// The worker's queue, for whoever must empty it once the worker is gone.
    pub(crate) rx: Receiver<Message>,
    /// Set once the worker has stopped and its NICs are closed; see [`GroupShared::after_send`].
    pub(crate) worker_done: AtomicBool,
    pub(crate) wake: Arc<WorkerWake>,
    pub(crate) counters: Vec<DomainCounters>,
    /// Every NIC may post immediate-only writes without a completion
    /// ([`crate::domain::Domain::posts_unreported`]); else none is offered one.
    pub(crate) posts_unreported: bool,
    pub(crate) worker_written: CachePadded<WorkerWritten>,
}

/// What the worker writes on every transfer, on cache lines of its own: submitters read the
/// rest of [`GroupShared`] on every call, and sharing a line with a counter the worker bumps
/// would cost each of them a cache miss (about 0.1 us a submit, measured).
#[derive(Debug, Default)]
pub(crate) struct WorkerWritten {
    pub(crate) in_flight: AtomicU64,
    /// Bytes registered with the group's NICs (written by the pass, rarely).
    pub(crate) registered_bytes: AtomicU64,
    /// Peers connected (written by the pass, rarely).
    pub(crate) peers: AtomicU64,
    /// Transfers finished, by outcome: succeeded, then failed per [`TransferError::KINDS`].
    pub(crate) finished: [AtomicU64; 1 + TransferError::KINDS.len()],
    /// Submit-to-finish times of transfers timed ([`super::observe::time_transfers`]), per
    /// bucket of [`super::observe::TRANSFER_BUCKETS`], the last one for longer.
    pub(crate) transfer_time: [AtomicU64; super::observe::TRANSFER_BUCKETS.len() + 1],
    pub(crate) latency: LatencyLog,
}

impl GroupShared {
    pub(crate) fn nics(&self) -> usize {
        self.addr.nics.len()
    }

    /// Called (by [`RetireOnExit`]) once the worker has stopped and its NICs are closed: from
    /// here on, nothing it has not taken will be.
    pub(crate) fn retire_worker(&self, callbacks: &CallbackQueue) {
        self.worker_done.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        self.fail_queued(callbacks);
    }

    /// Called by a submitter right after it queued a message: wakes the worker, and if the
    /// worker has retired, fails what is queued. (A message queued after the worker's last
    /// look would wait forever: the queue outlives the worker.) The wake-up begins with a
    /// sequentially consistent fence, as `retire_worker` ends with one, so the worker's last
    /// drain sees the message or this sees `worker_done`: the same argument as [`WorkerWake`].
    pub(crate) fn after_send(&self, callbacks: &CallbackQueue) {
        self.wake.notify();
        if self.worker_done.load(Ordering::SeqCst) {
            self.fail_queued(callbacks);
        }
    }

    /// Fails every queued message with `Shutdown`: transfers through their completion,
    /// commands through their reply.
    fn fail_queued(&self, callbacks: &CallbackQueue) {
        while let Ok(message) = self.rx.try_recv() {
            match message {
                Message::Transfer(sub) => {
                    sub.on_done.finish(Err(TransferError::Shutdown), |f, o| {
                        callbacks.run_done(f, o)
                    })
                }
                // A requester that went away has nobody to tell.
                Message::Command(Command::Register { reply, .. }) => {
                    let _ = reply.send(Err(TransportError::Shutdown));
                }
                Message::Command(
                    Command::Deregister { reply, .. }
                    | Command::InstallRecvPool { reply, .. }
                    | Command::AdoptSender { reply, .. },
                ) => {
                    let _ = reply.send(Err(TransportError::Shutdown));
                }
                Message::Command(Command::Connect { reply, .. }) => {
                    let _ = reply.send(Err(TransportError::Shutdown));
                }
                Message::Command(Command::Disconnect { reply, .. }) => {
                    let _ = reply.send(Err(TransportError::Shutdown));
                }
                Message::Command(Command::SenderAddress { reply, .. }) => {
                    let _ = reply.send(Err(TransportError::Shutdown));
                }
                Message::Command(Command::Stop) => {}
            }
        }
    }
}

/// Retires a group's worker when dropped at the end of the worker thread, after the group and
/// with it every NIC is gone (also when the worker panicked): a deregistration answered
/// `Shutdown` from then on may free its memory.
pub(crate) struct RetireOnExit(pub(crate) Arc<GroupShared>, pub(crate) CallbackQueue);

impl Drop for RetireOnExit {
    fn drop(&mut self) {
        self.0.retire_worker(&self.1);
    }
}

/// A peer group: its members' peer entries, in order (paper 002 `add_peer_group`).
#[derive(Debug)]
pub(crate) struct PeerGroupEntry {
    pub(crate) group: u16,
    pub(crate) members: Vec<Arc<PeerEntry>>,
}

/// Both ends of the queue of unexpected arrivals, `(imm, count)`.
pub(crate) type ImmQueue = (Sender<(u32, u64)>, Receiver<(u32, u64)>);

/// What everything in one engine shares.
#[derive(Debug)]
pub(crate) struct EngineShared {
    pub(crate) id: u64,
    pub(crate) imm: ImmCounter<OnDone>,
    pub(crate) callbacks: CallbackQueue,
    pub(crate) unexpected_imm_handler: AtomicBool,
    /// Arrivals nobody expected, handed straight from the progress pass to the application
    /// (no callback-thread hop); created by the first `unexpected_imms` call.
    pub(crate) unexpected_imm_queue: OnceLock<ImmQueue>,
    pub(crate) record_latency: bool,
}
