//! A domain group as its worker drives it (paper 002 section 3.4): 1 to 4 NICs, the transfers
//! in flight on them, and the peers they reach.
//!
//! A transfer is a number of *units* (single-write shards, pages, scatter or barrier targets),
//! unit `u` going to NIC `(first + u) % nics`, `first` rotating from transfer to transfer.
//! Each NIC keeps its own position in its share of the units, so a NIC that is full does not
//! hold back the others and nothing ever has to be un-posted. Each unit's work request carries
//! the rkey of the NIC it is posted on: sharding never pairs a NIC with another NIC's key.
//! Work requests are built on the fly from the request (no per-page allocation), posted in
//! batches, and at most a budget per transfer per pass, so a 10,000-page transfer does not
//! starve completions or other transfers. A NIC that refused part of a batch is offered one
//! work request at a time until it accepts again.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use super::callbacks::Job;
use super::message::{LocalSrc, RemoteTarget, Submission, Work, Writes};
use super::shared::{EngineShared, GroupShared, PeerEntry, RegionEntry};
use super::stats::{self, LatencyLog};
use crate::addr::MAX_NICS;
use crate::domain::{Completion, CompletionKind, Domain, PeerId, RecvWr, Unreported, WriteWr};

/// A released peer's ids on every NIC: no domain knows it, so a post to it fails.
const RELEASED: PeerId = PeerId::MAX;
use crate::error::{TransferError, TransportError};
use crate::imm_counter::Arrival;
use crate::mr::{Access, Device};
use crate::on_done::{OnDone, Outcome};
use crate::plan::single_write_shards;
use crate::recv_pool::RecvPool;
use crate::transfer_state::TransferState;

mod commands;
mod post;

use post::post_units;

/// Work requests built and posted per call into a domain.
const BATCH: u32 = 32;
/// Work requests one transfer may post per pass before the worker turns to others.
const BUDGET: u32 = 256;
/// Completions taken from one domain per poll.
const POLL_BATCH: usize = 64;

struct InFlight {
    state: Arc<TransferState>,
    on_done: Option<OnDone>,
    work: Work,
    units: u32,
    first: u32,
    posted: [u32; MAX_NICS],
    submitted_at: Option<Instant>,
    /// When its first posting pass began (latency recording only).
    posting_since: Option<Instant>,
}

impl InFlight {
    /// The units NIC `d` carries: those with `(first + u) % nics == d`.
    fn units_for(&self, d: u32, nics: u32) -> u32 {
        let r = (d + nics - self.first) % nics;
        if r >= self.units {
            0
        } else {
            (self.units - 1 - r) / nics + 1
        }
    }

    fn unit_at(&self, d: u32, k: u32, nics: u32) -> u32 {
        (d + nics - self.first) % nics + k * nics
    }
}

#[derive(Default)]
struct Slot {
    generation: u32,
    transfer: Option<InFlight>,
}

enum Posted {
    /// Every unit is posted.
    Exhausted,
    /// Units remain (budget spent or a NIC full).
    More,
    /// A cancellation refused further posts.
    Stopped,
    /// A NIC refused the request as malformed.
    Failed(TransportError),
}

/// The worker's posting scratch: the batch being built, and which NICs were last found full.
struct Posting {
    /// Work requests built for one `post_writes` call.
    batch: Vec<WriteWr>,
    /// Per NIC: its last post was refused in part (its queue was full). The next post to it
    /// builds one work request only, a probe, until one is accepted again: a full queue
    /// refuses every attempt until completions drain it, and each attempt would otherwise
    /// build a whole batch for nothing.
    full: [bool; MAX_NICS],
}

struct RecvState {
    pool: Arc<RecvPool>,
    lkey: u64,
    to_post: Vec<u32>,
}

/// What the worker of one domain group owns.
pub(crate) struct Group<D: Domain> {
    /// Declared first so the NICs (and their registrations) go before the memory below.
    domains: Vec<D>,
    shared: Arc<GroupShared>,
    engine: Arc<EngineShared>,
    peers: Vec<[PeerId; MAX_NICS]>,
    /// The connected peer behind each of NIC 0's peer ids: who a received message is from.
    by_nic0: HashMap<PeerId, Arc<PeerEntry>>,
    regions: Vec<Option<RegionEntry>>,
    region_generations: Vec<u32>,
    free_regions: Vec<u32>,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    pending: VecDeque<u32>,
    rr: u32,
    null_src: LocalSrc,
    posting: Posting,
    completions: Vec<Completion>,
    fired: Vec<OnDone>,
    recv: Option<RecvState>,
    /// Source of immediate-only writes (EFA wants a valid descriptor even for zero bytes).
    _null_buf: Box<[u8; 8]>,
}

impl<D: Domain> Group<D> {
    pub(crate) fn new(
        mut domains: Vec<D>,
        shared: Arc<GroupShared>,
        engine: Arc<EngineShared>,
    ) -> Result<Self, TransportError> {
        let null_buf = Box::new([0u8; 8]);
        let mut lkeys = [0; MAX_NICS];
        for (i, d) in domains.iter_mut().enumerate() {
            d.set_notify(shared.wake.clone());
            // SAFETY: the buffer is owned by the group and declared after `domains`, so it is
            // freed only after every domain (and its registration) is gone.
            lkeys[i] =
                unsafe { d.register(null_buf.as_ptr() as u64, 8, Device::Host, Access::Local) }?
                    .lkey;
        }
        Ok(Self {
            domains,
            shared,
            engine,
            peers: Vec::new(),
            by_nic0: HashMap::new(),
            regions: Vec::new(),
            region_generations: Vec::new(),
            free_regions: Vec::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            pending: VecDeque::new(),
            rr: 0,
            null_src: LocalSrc {
                addr: null_buf.as_ptr() as u64,
                lkeys,
            },
            posting: Posting {
                batch: Vec::with_capacity(BATCH as usize),
                full: [false; MAX_NICS],
            },
            completions: Vec::with_capacity(POLL_BATCH),
            fired: Vec::new(),
            recv: None,
            _null_buf: null_buf,
        })
    }

    fn nics(&self) -> u32 {
        self.domains.len() as u32
    }

    pub(crate) fn may_park(&self) -> bool {
        self.domains.iter().all(Domain::may_park)
    }

    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.domains.iter().filter_map(Domain::next_deadline).min()
    }

    // ----- transfers -----

    /// Takes a submitted transfer and posts its first work requests at once.
    pub(crate) fn accept(&mut self, sub: Submission) {
        let sub = match self.post_unreported(sub) {
            None => return,
            Some(sub) => sub,
        };
        let nics = self.nics();
        let units = match &sub.work {
            Work::Writes(Writes::Single { len, .. }) => {
                single_write_shards(*len, nics as usize) as u32
            }
            Work::Writes(Writes::Paged { src_pages, .. }) => src_pages.indices.len() as u32,
            Work::Writes(Writes::Imm { .. }) | Work::Send { .. } => 1,
            Work::Writes(Writes::Scatter { targets, .. }) => targets.len() as u32,
            Work::Writes(Writes::Barrier { targets, .. }) => targets.len() as u32,
        };
        // Sends use NIC 0 only (paper 002 section 3.3); everything else rotates.
        let first = if matches!(sub.work, Work::Send { .. }) {
            0
        } else {
            self.rr
        };
        self.rr = (self.rr + units) % nics;
        let state = Arc::new(TransferState::new());
        // A token cancelled since the submit cancels the transfer here, before any post.
        if let Some(token) = &sub.on_done.cancel {
            token.register(&state);
        }
        let slot = self.free_slots.pop().unwrap_or_else(|| {
            self.slots.push(Slot::default());
            (self.slots.len() - 1) as u32
        });
        self.slots[slot as usize].transfer = Some(InFlight {
            state,
            on_done: Some(sub.on_done),
            work: sub.work,
            units,
            first,
            posted: [0; MAX_NICS],
            submitted_at: sub.submitted_at,
            posting_since: None,
        });
        stats::add(&self.shared.worker_written.in_flight, 1);
        if self.post(slot) {
            self.pending.push_back(slot);
        }
    }

    /// Posts an immediate-only write that nobody waits on (its `on_done` does nothing and
    /// cannot be cancelled) without asking the NIC for a completion, where the NIC can: the
    /// completion would report only to nobody, and not asking for it spares the NIC's queue
    /// entry and the transfer's bookkeeping. Hands `sub` back for the usual path otherwise,
    /// and when the NIC is full or refuses the write (the usual path retries or fails it as
    /// it would any write).
    fn post_unreported(&mut self, sub: Submission) -> Option<Submission> {
        let Work::Writes(Writes::Imm { dst, imm }) = &sub.work else {
            return Some(sub);
        };
        if !self.shared.posts_unreported
            || !sub.on_done.reports_nothing()
            || !self.post_unreported_imm(dst, *imm)
        {
            return Some(sub);
        }
        if let Some(at) = sub.submitted_at.filter(|_| self.engine.record_latency) {
            LatencyLog::push(
                &self.shared.worker_written.latency.submit_to_post,
                at.elapsed(),
            );
        }
        None
    }

    /// Posts an immediate-only write to `dst` without a completion if the NIC can; whether it
    /// did.
    pub(crate) fn post_unreported_imm(&mut self, dst: &RemoteTarget, imm: u32) -> bool {
        let nics = self.nics();
        let d = self.rr as usize;
        let wr = WriteWr {
            wr_id: 0,
            peer: self.peers[dst.peer as usize][d],
            src_addr: self.null_src.addr,
            lkey: self.null_src.lkeys[d],
            len: 0,
            dst_addr: dst.addr,
            rkey: dst.rkeys[d],
            imm: Some(imm),
        };
        if self.domains[d].post_unreported(&wr) != Ok(Unreported::Posted) {
            return false;
        }
        self.rr = (self.rr + 1) % nics;
        let counters = &self.shared.counters[d];
        stats::add(&counters.posted, 1);
        stats::add(&counters.unreported, 1);
        true
    }

    /// Posts more of every pending transfer. Returns whether anything was posted.
    pub(crate) fn progress(&mut self) -> bool {
        let mut busy = false;
        for _ in 0..self.pending.len() {
            let Some(slot) = self.pending.pop_front() else {
                break;
            };
            let before = self.posted_total(slot);
            let more = self.post(slot);
            busy |= self.posted_total(slot) != before;
            if more {
                self.pending.push_back(slot);
            }
        }
        busy
    }

    fn posted_total(&self, slot: u32) -> u32 {
        self.slots[slot as usize]
            .transfer
            .as_ref()
            .map_or(u32::MAX, |t| t.posted.iter().sum())
    }

    /// Posts what the budget allows of one transfer and settles it if posting is over.
    /// Returns whether it still has units to post.
    fn post(&mut self, slot: u32) -> bool {
        let wr_id = u64::from(self.slots[slot as usize].generation) << 32 | u64::from(slot);
        let record = self.engine.record_latency;
        let Some(t) = self.slots[slot as usize].transfer.as_mut() else {
            return false;
        };
        // With recording on: the posting span starts before the first pass; submit-to-post
        // ends after it (one work request, in the latency bench).
        let pass_start = (record && t.posting_since.is_none()).then(Instant::now);
        let result = post_units(
            &mut self.domains,
            &self.peers,
            &self.null_src,
            &mut self.posting,
            &self.shared.counters,
            t,
            wr_id,
        );
        if let Some(start) = pass_start
            && t.posted.iter().any(|&p| p > 0)
        {
            t.posting_since = Some(start);
            if let Some(at) = t.submitted_at {
                LatencyLog::push(
                    &self.shared.worker_written.latency.submit_to_post,
                    at.elapsed(),
                );
            }
        }
        let outcome = match result {
            Posted::More => return true,
            Posted::Exhausted => {
                if record && let Some(since) = t.posting_since {
                    LatencyLog::push(
                        &self.shared.worker_written.latency.post_span,
                        since.elapsed(),
                    );
                }
                t.state.seal()
            }
            Posted::Stopped => t.state.seal_cancelled(),
            Posted::Failed(e) => {
                tracing::warn!(error = %e, "a NIC refused a work request; failing the transfer");
                t.state
                    .complete(0, Err(TransferError::Provider(e.to_string())));
                t.state.cancel();
                t.state.seal()
            }
        };
        if let Some(outcome) = outcome {
            self.finish(slot, outcome);
        }
        false
    }

    fn finish(&mut self, slot: u32, outcome: Outcome) {
        let entry = &mut self.slots[slot as usize];
        let Some(mut t) = entry.transfer.take() else {
            return;
        };
        entry.generation = entry.generation.wrapping_add(1);
        self.free_slots.push(slot);
        let written = &self.shared.worker_written;
        stats::sub(&written.in_flight, 1);
        if !cfg!(kvroute_no_metrics) {
            let outcome_index = outcome.as_ref().err().map_or(0, |e| 1 + e.kind_index());
            stats::add(&written.finished[outcome_index], 1);
            if let Some(at) = t.submitted_at {
                stats::add(
                    &written.transfer_time[super::observe::bucket(at.elapsed())],
                    1,
                );
            }
        }
        if let Some(done) = t.on_done.take() {
            let callbacks = &self.engine.callbacks;
            done.finish(outcome, |f, o| callbacks.run_done(f, o));
        }
    }

    // ----- completions -----

    /// Polls every NIC once. Returns whether anything completed.
    pub(crate) fn poll(&mut self) -> bool {
        let mut busy = false;
        for d in 0..self.domains.len() {
            let mut completions = std::mem::take(&mut self.completions);
            completions.clear();
            self.domains[d].poll(&mut completions, POLL_BATCH);
            busy |= !completions.is_empty();
            for c in completions.drain(..) {
                self.on_completion(d, c);
            }
            self.completions = completions;
        }
        busy
    }

    fn on_completion(&mut self, d: usize, c: Completion) {
        match c.kind {
            CompletionKind::Write | CompletionKind::Send => {
                let counters = &self.shared.counters[d];
                let counter = if c.result.is_ok() {
                    &counters.completed
                } else {
                    &counters.failed
                };
                stats::add(counter, u64::from(c.count));
                let slot = (c.wr_id & 0xFFFF_FFFF) as u32;
                let generation = (c.wr_id >> 32) as u32;
                let live = self
                    .slots
                    .get(slot as usize)
                    .filter(|s| s.generation == generation);
                let Some(t) = live.and_then(|s| s.transfer.as_ref()) else {
                    tracing::error!(wr_id = c.wr_id, "completion for no transfer in flight");
                    return;
                };
                if let Some(outcome) = t.state.complete(u64::from(c.count), c.result) {
                    self.finish(slot, outcome);
                }
            }
            CompletionKind::Arrival { imm } => {
                if !cfg!(kvroute_no_metrics) {
                    stats::add(&self.shared.counters[d].arrivals, u64::from(c.count));
                }
                let found = self
                    .engine
                    .imm
                    .arrive(imm, u64::from(c.count), &mut self.fired);
                let callbacks = &self.engine.callbacks;
                for done in self.fired.drain(..) {
                    done.finish(Ok(()), |f, o| callbacks.run_done(f, o));
                }
                if found == Arrival::Unexpected {
                    if let Some((tx, _)) = self.engine.unexpected_imm_queue.get() {
                        // Unbounded: the pass never waits for the application.
                        let _ = tx.send((imm, u64::from(c.count)));
                    }
                    if self
                        .engine
                        .unexpected_imm_handler
                        .load(std::sync::atomic::Ordering::Acquire)
                    {
                        callbacks.push(Job::Unexpected {
                            imm,
                            count: u64::from(c.count),
                        });
                    }
                }
            }
            CompletionKind::Recv { len, from } => {
                let Some(recv) = &self.recv else {
                    tracing::error!("a message arrived with no receive pool installed");
                    return;
                };
                let index = c.wr_id as u32;
                match recv.pool.deliver(index) {
                    Ok(()) => self.engine.callbacks.push(Job::Recv {
                        pool: recv.pool.clone(),
                        index,
                        len: len as usize,
                        from: from
                            .and_then(|id| self.by_nic0.get(&id))
                            .map(|e| e.addr.clone()),
                    }),
                    Err(e) => tracing::error!(%e, "receive completion out of order"),
                }
            }
        }
    }

    /// Posts the receive buffers whose callbacks have returned. Returns whether any were.
    pub(crate) fn repost_recvs(&mut self) -> bool {
        let Some(recv) = self.recv.as_mut() else {
            return false;
        };
        if let Err(e) = recv.pool.reclaim(&mut recv.to_post) {
            tracing::error!(%e, "receive pool out of order");
        }
        let busy = !recv.to_post.is_empty();
        for index in recv.to_post.drain(..) {
            let wr = RecvWr {
                wr_id: u64::from(index),
                addr: recv.pool.buffer_addr(index),
                len: recv.pool.buf_len() as u64,
                lkey: recv.lkey,
            };
            // SAFETY: the pool's memory lives as long as the Arc this group holds, which
            // outlives NIC 0; the buffer is posted, so nothing reads it until its completion.
            if let Err(e) = unsafe { self.domains[0].post_recv(&wr) } {
                tracing::error!(%e, "could not repost a receive buffer");
            }
        }
        busy
    }

    /// Fails every transfer in flight (engine shutdown).
    pub(crate) fn shutdown(&mut self) {
        self.pending.clear();
        for slot in 0..self.slots.len() as u32 {
            if self.slots[slot as usize].transfer.is_some() {
                self.finish(slot, Err(TransferError::Shutdown));
            }
        }
    }
}
