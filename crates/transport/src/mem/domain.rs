//! [`MemDomain`]: the [`Domain`] of the in-process fabric.
//!
//! Like a NIC it has a bounded send queue: `post_writes` checks the sources and enqueues
//! (accepting fewer when the queue is full, which is how `-EAGAIN` back-pressure reaches the
//! engine), and the "DMA engine" executes queued writes when the domain is polled, on the
//! owning worker, in the same pass. Posting therefore costs what posting costs (descriptors
//! into a queue), and the copies show up in throughput, as on hardware.
//!
//! Executing a write checks the source again (it may have been deregistered meanwhile), then
//! the target's region table under its read lock (so a concurrent deregistration waits for the
//! copy, and nothing lands after it), copies, and queues the immediate in the target's inbox
//! after the copy, so a receiver that sees the arrival sees the data. A run of successful
//! writes of one work request (a paged transfer's pages) completes as one completion with a
//! count, and a run of one immediate as one arrival, as a NIC's coalesced completions would. A failed check completes
//! the write with an error and leaves the target untouched. With a [`FaultPlan`] writes wait in
//! a timed list instead and are delivered late, out of order, or failed.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::endpoint::{Endpoint, Event};
use super::faults::{FaultPlan, SplitMix64};
use super::{FabricInner, PROVIDER, decode_addr, encode_addr};
use crate::addr::DomainAddr;
use crate::domain::{
    Completion, CompletionKind, Domain, Notify, PeerId, RecvWr, Registration, SendWr, Unreported,
    WriteWr,
};
use crate::error::{TransferError, TransportError};
use crate::mr::{Access, Device};

/// Writes a `mem` NIC holds before `post_writes` accepts fewer than it is given.
pub const SEND_QUEUE_DEPTH: usize = 1024;
/// Writes executed per poll.
const EXECUTE_BATCH: usize = 1024;

/// A write held back by the fault plan. Its delay and fate are drawn when it is posted, in
/// posting order, so which writes fail depends only on the seed.
#[derive(Debug, Clone, Copy)]
struct Delayed {
    wr: WriteWr,
    due: Instant,
    fail: bool,
}

/// One NIC of a [`super::MemFabric`].
pub struct MemDomain {
    fabric: Arc<FabricInner>,
    me: Arc<Endpoint>,
    /// `None`: released ([`Domain::disconnect`]); its id waits in `free_peers`.
    peers: Vec<Option<Arc<Endpoint>>>,
    peer_ids: HashMap<u64, PeerId>,
    free_peers: Vec<PeerId>,
    send_queue: VecDeque<WriteWr>,
    completions: VecDeque<Completion>,
    events: Vec<Event>,
    faults: FaultPlan,
    rng: SplitMix64,
    delayed: Vec<Delayed>,
    sends: VecDeque<SendWr>,
    notify: Option<Arc<dyn Notify>>,
}

impl std::fmt::Debug for MemDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemDomain")
            .field("endpoint", &self.me.id)
            .field("peers", &self.peers.len())
            .field("queued", &self.send_queue.len())
            .field("faults", &self.faults)
            .finish_non_exhaustive()
    }
}

impl MemDomain {
    pub(super) fn new(fabric: Arc<FabricInner>, me: Arc<Endpoint>, faults: FaultPlan) -> Self {
        Self {
            fabric,
            me,
            peers: Vec::new(),
            peer_ids: HashMap::new(),
            free_peers: Vec::new(),
            send_queue: VecDeque::with_capacity(SEND_QUEUE_DEPTH),
            completions: VecDeque::new(),
            events: Vec::new(),
            faults,
            rng: SplitMix64::new(faults.seed),
            delayed: Vec::new(),
            sends: VecDeque::new(),
            notify: None,
        }
    }

    fn complete(&mut self, wr_id: u64, kind: CompletionKind, result: Result<(), TransferError>) {
        push_completion(&mut self.completions, (wr_id, 1), kind, result);
    }

    fn peer(&self, id: PeerId) -> Result<Arc<Endpoint>, TransportError> {
        self.peers
            .get(id as usize)
            .cloned()
            .flatten()
            .ok_or(TransportError::Domain(format!(
                "unknown or released peer id {id}"
            )))
    }

    /// Runs the DMA engine over up to a batch of queued writes, in runs per target.
    fn execute(&mut self) {
        let n = self.send_queue.len().min(EXECUTE_BATCH);
        if n == 0 {
            return;
        }
        let queued = &self.send_queue.make_contiguous()[..n];
        let mut start = 0;
        while start < n {
            let peer = queued[start].peer;
            let end = start
                + queued[start..]
                    .iter()
                    .take_while(|w| w.peer == peer)
                    .count();
            match &self.peers[peer as usize] {
                Some(target) => {
                    deliver(&self.me, target, &queued[start..end], &mut self.completions)
                }
                // Released with writes queued: `disconnect` failed them; none can be here.
                None => {
                    for wr in &queued[start..end] {
                        push_completion(
                            &mut self.completions,
                            (wr.wr_id, 1),
                            CompletionKind::Write,
                            Err(TransferError::PeerUnreachable),
                        );
                    }
                }
            }
            start = end;
        }
        self.send_queue.drain(..n);
    }

    /// Delivers the delayed writes that are due (fault plan only).
    fn deliver_due(&mut self) {
        if self.delayed.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut due = Vec::new();
        self.delayed.retain(|d| {
            let ready = d.due <= now;
            if ready {
                due.push(*d);
            }
            !ready
        });
        if self.faults.reorder {
            self.rng.shuffle(&mut due);
        } else {
            due.sort_by_key(|d| d.due);
        }
        for d in due {
            if d.fail {
                self.complete(
                    d.wr.wr_id,
                    CompletionKind::Write,
                    Err(TransferError::Injected),
                );
                continue;
            }
            match self.peer(d.wr.peer) {
                Ok(target) => deliver(&self.me, &target, &[d.wr], &mut self.completions),
                Err(_) => self.complete(
                    d.wr.wr_id,
                    CompletionKind::Write,
                    Err(TransferError::PeerUnreachable),
                ),
            }
        }
    }

    /// Moves pending sends into posted receive buffers; a send with no buffer at its target
    /// waits (receiver-not-ready back-pressure), in order per target.
    fn progress_sends(&mut self) {
        let mut blocked: Vec<PeerId> = Vec::new();
        let mut i = 0;
        while i < self.sends.len() {
            let wr = self.sends[i];
            if blocked.contains(&wr.peer) {
                i += 1;
                continue;
            }
            let target = match self.peer(wr.peer) {
                Ok(t) if t.is_alive() && self.me.is_alive() => t,
                _ => {
                    self.sends.remove(i);
                    self.complete(
                        wr.wr_id,
                        CompletionKind::Send,
                        Err(TransferError::PeerUnreachable),
                    );
                    continue;
                }
            };
            let mut recvs = target
                .recvs
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let Some(recv) = recvs.pop_front() else {
                drop(recvs);
                if let Some(n) = &self.notify {
                    target.wait_for_recv(n.clone());
                }
                blocked.push(wr.peer);
                i += 1;
                continue;
            };
            if recv.len < wr.len {
                recvs.push_front(recv);
                drop(recvs);
                self.sends.remove(i);
                self.complete(
                    wr.wr_id,
                    CompletionKind::Send,
                    Err(TransferError::RemoteBufferTooSmall),
                );
                continue;
            }
            drop(recvs);
            // SAFETY: the payload stays valid until this send completes (post_send's contract);
            // the receive buffer was posted with post_recv, whose contract keeps it valid and
            // untouched by its owner until its completion, which is queued only after the copy.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    wr.addr as *const u8,
                    recv.addr as *mut u8,
                    wr.len as usize,
                )
            };
            target.deliver_event(Event::Recv {
                wr_id: recv.wr_id,
                len: wr.len,
                from: self.me.id,
            });
            target.wake();
            self.sends.remove(i);
            self.complete(wr.wr_id, CompletionKind::Send, Ok(()));
        }
    }
}

/// Queues the completion of `count` work requests, merging it into the previous one when they
/// are alike.
#[inline]
fn push_completion(
    completions: &mut VecDeque<Completion>,
    (wr_id, count): (u64, u32),
    kind: CompletionKind,
    result: Result<(), TransferError>,
) {
    if let Some(last) = completions.back_mut()
        && last.wr_id == wr_id
        && last.kind == kind
        && last.result == result
        && let Some(sum) = last.count.checked_add(count)
    {
        last.count = sum;
        return;
    }
    completions.push_back(Completion {
        wr_id,
        count,
        kind,
        result,
    });
}

/// Completes every write in `wrs` with `error`.
fn fail_all(wrs: &[WriteWr], error: &TransferError, completions: &mut VecDeque<Completion>) {
    for wr in wrs {
        push_completion(
            completions,
            (wr.wr_id, 1),
            CompletionKind::Write,
            Err(error.clone()),
        );
    }
}

/// Queues the completion of a run of successful writes of one work request id.
#[inline]
fn flush_done(done: &mut Option<(u64, u32)>, completions: &mut VecDeque<Completion>) {
    if let Some(run) = done.take() {
        push_completion(completions, run, CompletionKind::Write, Ok(()));
    }
}

/// Executes writes from `me` that all target `target`: checks the destination, copies,
/// completes, and queues the immediates (merged per value) in the target's inbox. Holds only
/// the target's lock: sources were checked when posted, and a deregistration since then has
/// failed the writes it concerned (see `deregister`).
fn deliver(
    me: &Endpoint,
    target: &Endpoint,
    wrs: &[WriteWr],
    completions: &mut VecDeque<Completion>,
) {
    if !target.is_alive() || !me.is_alive() {
        fail_all(wrs, &TransferError::PeerUnreachable, completions);
        return;
    }
    let regions = target.regions();
    // `kill` marks the NIC dead before it takes this lock to clear the table: checked again
    // under the lock, a write that raced the kill reports the peer gone, not a stale key.
    if !target.is_alive() {
        drop(regions);
        fail_all(wrs, &TransferError::PeerUnreachable, completions);
        return;
    }
    let mut pending: Option<(u32, u32)> = None;
    // Successful writes of one work request id in a row (a paged transfer's pages) complete
    // as one coalesced completion, pushed when the run ends.
    let mut done: Option<(u64, u32)> = None;
    for wr in wrs {
        if let Err(reason) = regions.check_remote_write(wr.rkey, wr.dst_addr, wr.len) {
            flush_done(&mut done, completions);
            push_completion(
                completions,
                (wr.wr_id, 1),
                CompletionKind::Write,
                Err(TransferError::RemoteAccess(reason.to_owned())),
            );
            continue;
        }
        if wr.len > 0 {
            // SAFETY: the source was checked against this NIC's registrations when posted and
            // stays registered until executed (deregistration runs on this thread and fails the
            // queued writes it concerns; a kill from elsewhere frees no memory). The destination
            // was just checked under the target's read lock, which deregistration must take for
            // writing. So both ranges are registered memory for the whole copy. `copy` tolerates
            // overlap (loopback).
            unsafe {
                std::ptr::copy(
                    wr.src_addr as *const u8,
                    wr.dst_addr as *mut u8,
                    wr.len as usize,
                )
            };
        }
        match &mut done {
            Some((id, n)) if *id == wr.wr_id && *n < u32::MAX => *n += 1,
            _ => {
                flush_done(&mut done, completions);
                done = Some((wr.wr_id, 1));
            }
        }
        if let Some(imm) = wr.imm {
            match pending {
                Some((v, ref mut n)) if v == imm && *n < u32::MAX => *n += 1,
                _ => {
                    if let Some((imm, count)) = pending.replace((imm, 1)) {
                        target.deliver_event(Event::Arrival { imm, count });
                    }
                }
            }
        }
    }
    drop(regions);
    flush_done(&mut done, completions);
    // Only an event needs the target's worker: a write without an immediate reports nothing
    // there, and waking a parked worker costs the sender a syscall.
    if let Some((imm, count)) = pending {
        target.deliver_event(Event::Arrival { imm, count });
        target.wake();
    }
}

impl Domain for MemDomain {
    fn provider(&self) -> &str {
        PROVIDER
    }

    fn address(&self) -> DomainAddr {
        encode_addr(self.fabric.id, self.me.id)
    }

    fn supports(&self, device: Device) -> bool {
        device == Device::Host
    }

    unsafe fn register(
        &mut self,
        addr: u64,
        len: u64,
        device: Device,
        access: Access,
    ) -> Result<Registration, TransportError> {
        if device != Device::Host {
            return Err(TransportError::UnsupportedDevice(device.to_string()));
        }
        if addr.checked_add(len).is_none() {
            return Err(TransportError::InvalidArgument(
                "region wraps around the address space",
            ));
        }
        let key = self.me.regions_mut().insert(addr, len, access);
        Ok(Registration {
            lkey: key,
            rkey: key,
            remote_addr: addr,
        })
    }

    fn deregister(&mut self, lkey: u64) -> Result<(), TransportError> {
        if !self.me.regions_mut().remove(lkey) {
            return Err(TransportError::UnknownRegion);
        }
        // Writes still queued from the region would read memory that may now be freed: they
        // fail instead, as a NIC reports a local protection error.
        let mut failed = Vec::new();
        self.send_queue.retain(|wr| {
            let keep = wr.lkey != lkey;
            if !keep {
                failed.push(wr.wr_id);
            }
            keep
        });
        self.delayed.retain(|d| {
            let keep = d.wr.lkey != lkey;
            if !keep {
                failed.push(d.wr.wr_id);
            }
            keep
        });
        for wr_id in failed {
            let error =
                TransferError::Provider("local protection error: source deregistered".to_owned());
            self.complete(wr_id, CompletionKind::Write, Err(error));
        }
        Ok(())
    }

    fn connect(&mut self, peer: &DomainAddr) -> Result<PeerId, TransportError> {
        let (fabric, endpoint) = decode_addr(peer)?;
        if fabric != self.fabric.id {
            return Err(TransportError::MalformedAddress(
                "address of another mem fabric".to_owned(),
            ));
        }
        if let Some(&id) = self.peer_ids.get(&endpoint) {
            return Ok(id);
        }
        let target = self.fabric.endpoint(endpoint).ok_or_else(|| {
            TransportError::MalformedAddress(format!("no endpoint {endpoint} on this fabric"))
        })?;
        let id = match self.free_peers.pop() {
            Some(id) => {
                self.peers[id as usize] = Some(target);
                id
            }
            None => {
                self.peers.push(Some(target));
                (self.peers.len() - 1) as PeerId
            }
        };
        self.peer_ids.insert(endpoint, id);
        Ok(id)
    }

    fn disconnect(&mut self, peer: PeerId) -> Result<(), TransportError> {
        let target = self.peer(peer)?;
        // Whatever is still queued for it fails; the rest keeps its order.
        let completions = &mut self.completions;
        let mut kept = |to: PeerId, wr_id: u64, kind| {
            let keep = to != peer;
            if !keep {
                push_completion(
                    completions,
                    (wr_id, 1),
                    kind,
                    Err(TransferError::PeerUnreachable),
                );
            }
            keep
        };
        self.send_queue
            .retain(|w| kept(w.peer, w.wr_id, CompletionKind::Write));
        self.delayed
            .retain(|d| kept(d.wr.peer, d.wr.wr_id, CompletionKind::Write));
        self.sends
            .retain(|s| kept(s.peer, s.wr_id, CompletionKind::Send));
        self.peer_ids.remove(&target.id);
        self.peers[peer as usize] = None;
        self.free_peers.push(peer);
        Ok(())
    }

    fn post_writes(&mut self, wrs: &[WriteWr]) -> Result<usize, TransportError> {
        // A malformed batch posts nothing.
        {
            let own = self.me.regions();
            for wr in wrs {
                own.check(wr.lkey, wr.src_addr, wr.len).map_err(|reason| {
                    TransportError::Domain(format!("source of write {}: {reason}", wr.wr_id))
                })?;
                if self.peers.get(wr.peer as usize).is_none_or(Option::is_none) {
                    return Err(TransportError::Domain(format!(
                        "unknown or released peer id {}",
                        wr.peer
                    )));
                }
            }
        }
        let free = SEND_QUEUE_DEPTH.saturating_sub(self.send_queue.len() + self.delayed.len());
        let accepted = &wrs[..wrs.len().min(free)];
        if self.faults.is_active() {
            let now = Instant::now();
            for wr in accepted {
                let due = now
                    + self
                        .rng
                        .between(self.faults.min_delay, self.faults.max_delay);
                let fail = self.rng.chance(self.faults.fail_probability);
                self.delayed.push(Delayed { wr: *wr, due, fail });
            }
        } else {
            self.send_queue.extend(accepted);
        }
        Ok(accepted.len())
    }

    /// An immediate-only write lands at once (as a NIC that copies at the post): the target
    /// counts it with no completion here. Anything that would fail, and every write under a
    /// fault plan (whose delays and failures are for writes that report), takes the usual
    /// path instead.
    fn post_unreported(&mut self, wr: &WriteWr) -> Result<Unreported, TransportError> {
        let (Some(imm), 0) = (wr.imm, wr.len) else {
            return Ok(Unreported::Unsupported);
        };
        if self.faults.is_active() || !self.me.is_alive() {
            return Ok(Unreported::Unsupported);
        }
        let Some(Some(target)) = self.peers.get(wr.peer as usize) else {
            return Ok(Unreported::Unsupported);
        };
        {
            let regions = target.regions();
            // Checked under the lock `kill` takes after marking the NIC dead (see `deliver`).
            if !target.is_alive() || regions.check_remote_write(wr.rkey, wr.dst_addr, 0).is_err() {
                return Ok(Unreported::Unsupported);
            }
        }
        target.deliver_event(Event::Arrival { imm, count: 1 });
        target.wake();
        Ok(Unreported::Posted)
    }

    fn posts_unreported(&self) -> bool {
        !self.faults.is_active()
    }

    unsafe fn post_send(&mut self, wr: &SendWr) -> Result<bool, TransportError> {
        if self.peers.get(wr.peer as usize).is_none_or(Option::is_none) {
            return Err(TransportError::Domain(format!(
                "unknown or released peer id {}",
                wr.peer
            )));
        }
        self.sends.push_back(*wr);
        self.progress_sends();
        Ok(true)
    }

    unsafe fn post_recv(&mut self, wr: &RecvWr) -> Result<bool, TransportError> {
        self.me
            .regions()
            .check(wr.lkey, wr.addr, wr.len)
            .map_err(|reason| TransportError::Domain(format!("receive buffer: {reason}")))?;
        self.me.post_recv(*wr);
        Ok(true)
    }

    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        self.execute();
        self.deliver_due();
        if !self.sends.is_empty() {
            self.progress_sends();
        }
        let start = out.len();
        while out.len() - start < max {
            let Some(c) = self.completions.pop_front() else {
                break;
            };
            out.push(c);
        }
        if out.len() - start < max && self.events.is_empty() {
            self.me.take_events(&mut self.events);
        }
        let room = max - (out.len() - start);
        for event in self.events.drain(..room.min(self.events.len())) {
            out.push(match event {
                Event::Arrival { imm, count } => Completion {
                    wr_id: 0,
                    count,
                    kind: CompletionKind::Arrival { imm },
                    result: Ok(()),
                },
                Event::Recv { wr_id, len, from } => Completion {
                    wr_id,
                    count: 1,
                    kind: CompletionKind::Recv {
                        len,
                        from: self.peer_ids.get(&from).copied(),
                    },
                    result: Ok(()),
                },
            });
        }
        out.len() - start
    }

    fn set_notify(&mut self, notify: Arc<dyn Notify>) {
        self.me.set_notify(notify.clone());
        self.notify = Some(notify);
    }

    fn next_deadline(&self) -> Option<Instant> {
        let now = Instant::now();
        // Queued writes are work to do at once.
        let queued = (!self.send_queue.is_empty()).then_some(now);
        let delayed = self.delayed.iter().map(|d| d.due).min();
        // A send waiting for a receive buffer is woken by the receiver; retry now and then in
        // case that wake-up raced the wait registration.
        let retry = (!self.sends.is_empty()).then(|| now + Duration::from_micros(200));
        queued.into_iter().chain(delayed).chain(retry).min()
    }

    fn may_park(&self) -> bool {
        true
    }
}

impl Drop for MemDomain {
    fn drop(&mut self) {
        // A dropped NIC leaves the fabric: its peers see it as unreachable from now on.
        self.me.kill();
        self.fabric.remove(self.me.id);
    }
}
