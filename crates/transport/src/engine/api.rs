//! The request side of [`TransferEngine`]: every call checks its request against the local
//! region (from the group's directory) and the remote descriptor, resolves the peer (a
//! directory lookup; a connect round trip to the worker only on first contact), and queues
//! the result (under manual progress, a free pass takes it on the calling thread instead). A
//! request that fails a check returns its error and posts nothing.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crossbeam_channel::{Sender, TrySendError, bounded};

use super::callbacks::Job;
use super::message::{
    Command, LocalSrc, Message, RemoteTarget, ScatterTarget, Submission, Work, Writes,
};
use super::pass_lock::PassGuard;
use super::shared::{GroupShared, PeerEntry, PeerGroupEntry, RegionEntry};
use super::{Backpressure, ManualGroup, TransferEngine};
use crate::addr::{MAX_NICS, NetAddr};
use crate::buffer::RegisteredBuffer;
use crate::error::{Side, TransferError, TransportError};
use crate::imm_counter::Expectation;
use crate::mr::{Access, Device, MrDesc, MrHandle, check_range};
use crate::on_done::{OnDone, TransferFuture};
use crate::plan::{TransferShape, arrivals};
use crate::request::{Pages, ScatterDst, validate_scatter};
use crate::watcher::WatchedWord;

/// A registered group of peers, targeted by scatter and barrier without per-call lookups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerGroupHandle(u32);

/// A destination of immediate-only writes, resolved once ([`TransferEngine::imm_target`]):
/// [`TransferEngine::submit_imm_to`] skips the descriptor's checks and the peer lookup that
/// [`TransferEngine::submit_imm`] makes on every write. It belongs to the engine that made it.
/// Once any peer of that engine has been released it is resolved again from its descriptor on
/// every write, as `submit_imm` does (the peer released may have been its own); make it again
/// to skip that.
#[derive(Debug, Clone)]
pub struct ImmTarget {
    desc: MrDesc,
    /// The directory it was resolved in, and that directory's removals then.
    directory: u64,
    removals: u64,
    target: RemoteTarget,
}

impl ImmTarget {
    /// The descriptor it was resolved from.
    pub fn desc(&self) -> &MrDesc {
        &self.desc
    }
}

impl TransferEngine {
    fn main_group(&self) -> &Arc<GroupShared> {
        &self.inner.groups[0]
    }

    /// The address peers use to reach this engine's main group (NIC 0 first).
    pub fn main_address(&self) -> NetAddr {
        self.main_group().addr.clone()
    }

    /// The address of group `index`, if it exists.
    pub fn group_address(&self, index: usize) -> Option<NetAddr> {
        self.inner.groups.get(index).map(|g| g.addr.clone())
    }

    /// NICs of the main group.
    pub fn nics(&self) -> usize {
        self.main_group().nics()
    }

    /// How many immediates a transfer of `shape` delivers to its receiver (peers have as many
    /// NICs as this engine): what to pass to [`TransferEngine::expect_imm_count`].
    pub fn expected_arrivals(&self, shape: TransferShape) -> u64 {
        arrivals(shape, self.nics())
    }

    fn group_for(&self, device: Device) -> Result<&Arc<GroupShared>, TransportError> {
        self.inner
            .groups
            .iter()
            .find(|g| g.device == device)
            .or_else(|| (device == Device::Host).then(|| self.main_group()))
            .ok_or_else(|| TransportError::UnsupportedDevice(device.to_string()))
    }

    fn command<T>(
        &self,
        group: &GroupShared,
        make: impl FnOnce(Sender<T>) -> Command,
    ) -> Result<T, TransportError> {
        // Not `stopped`: until the worker is done, a deregistration must still reach the NICs.
        if group.worker_done.load(Ordering::Acquire) {
            return Err(TransportError::Shutdown);
        }
        let (reply, answer) = bounded(1);
        self.send_waiting(group, Message::Command(make(reply)))?;
        group.after_send(&self.inner.engine.callbacks);
        // Answered by the worker, by its last drain, or by `after_send` above; with manual
        // progress, by the passes this thread runs while it waits.
        if !self.inner.manual_progress {
            return answer.recv().map_err(|_| TransportError::Shutdown);
        }
        loop {
            match answer.try_recv() {
                Ok(v) => return Ok(v),
                Err(crossbeam_channel::TryRecvError::Disconnected) => {
                    return Err(TransportError::Shutdown);
                }
                Err(crossbeam_channel::TryRecvError::Empty) => {
                    if !self.progress() {
                        std::thread::yield_now();
                    }
                }
            }
        }
    }

    /// Queues `message`, waiting for room if the queue is full (running passes meanwhile with
    /// manual progress, since nobody else will).
    fn send_waiting(&self, group: &GroupShared, message: Message) -> Result<(), TransportError> {
        if !self.inner.manual_progress {
            return group.tx.send(message).map_err(|_| TransportError::Shutdown);
        }
        let mut message = message;
        loop {
            match group.tx.try_send(message) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Disconnected(_)) => return Err(TransportError::Shutdown),
                Err(TrySendError::Full(m)) => {
                    message = m;
                    if !self.progress() {
                        std::thread::yield_now();
                    }
                }
            }
        }
    }

    fn submit(
        &self,
        group: &GroupShared,
        work: Work,
        on_done: OnDone,
    ) -> Result<(), TransportError> {
        if self.inner.stopped.load(Ordering::Acquire) {
            return Err(TransportError::Shutdown);
        }
        let timed = self.inner.engine.record_latency || super::observe::timing();
        let submitted_at = timed.then(Instant::now);
        let mut sub = Submission {
            work,
            on_done,
            submitted_at,
        };
        if self.inner.manual_progress {
            match self.take_here(group, sub) {
                None => return Ok(()),
                Some(back) => sub = back,
            }
        }
        let message = Message::Transfer(sub);
        match self.inner.backpressure {
            Backpressure::Wait => self.send_waiting(group, message)?,
            Backpressure::Fail => group.tx.try_send(message).map_err(|e| match e {
                TrySendError::Full(_) => TransportError::QueueFull,
                TrySendError::Disconnected(_) => TransportError::Shutdown,
            })?,
        }
        // Past a racing shutdown this fails the transfer through `on_done`.
        group.after_send(&self.inner.engine.callbacks);
        Ok(())
    }

    /// With manual progress, hands `sub` to its group on this thread, as a pass would take
    /// it, when no other thread is running the group's pass and nothing is queued ahead of
    /// it; hands it back otherwise (it is then queued). A shutdown that stops the group
    /// after this fails it with the rest of the group's transfers.
    fn take_here(&self, group: &GroupShared, sub: Submission) -> Option<Submission> {
        let Some(mut pass) = self.free_pass(group) else {
            return Some(sub);
        };
        match pass.as_mut() {
            Some(driver) => driver.take(sub),
            None => Some(sub),
        }
    }

    /// With manual progress, posts an immediate-only write nobody waits on on this thread
    /// without a completion, as [`TransferEngine::take_here`] would take it, where the NIC can;
    /// whether it did. Not while latency is recorded (the transfer path records it).
    fn post_unreported_here(&self, group: &GroupShared, dst: &RemoteTarget, imm: u32) -> bool {
        if !group.posts_unreported
            || self.inner.engine.record_latency
            || self.inner.stopped.load(Ordering::Acquire)
        {
            return false;
        }
        self.free_pass(group).is_some_and(|mut pass| {
            pass.as_mut()
                .is_some_and(|driver| driver.post_unreported_imm(dst, imm))
        })
    }

    /// `group`'s pass, held, when the engine progresses manually and no other thread is in it.
    fn free_pass(&self, group: &GroupShared) -> Option<PassGuard<'_, ManualGroup>> {
        self.inner.manual.get(usize::from(group.index))?.try_lock()
    }

    // ----- memory -----

    /// Registers `[ptr, ptr + len)` with every NIC of the group serving `device`, writable by
    /// peers ([`Access::RemoteWrite`]; see [`TransferEngine::reg_mr_with`]).
    ///
    /// # Safety
    /// The memory must stay allocated and must not move until [`TransferEngine::dereg_mr`]
    /// returns for the handle, and local accesses to bytes a peer may be writing are the
    /// caller's protocol to order (wait for the writes' immediates).
    pub unsafe fn reg_mr(
        &self,
        ptr: *const u8,
        len: usize,
        device: Device,
    ) -> Result<(MrHandle, MrDesc), TransportError> {
        // SAFETY: the caller's guarantee, forwarded.
        unsafe { self.reg_mr_with(ptr, len, device, Access::RemoteWrite) }
    }

    /// [`TransferEngine::reg_mr`] with the access peers get: [`Access::Local`] for memory
    /// that is only ever a source (a store served by writing from it, a staging buffer), so
    /// that no descriptor, leaked or forged, lets a peer write into it.
    ///
    /// # Safety
    /// As [`TransferEngine::reg_mr`].
    pub unsafe fn reg_mr_with(
        &self,
        ptr: *const u8,
        len: usize,
        device: Device,
        access: Access,
    ) -> Result<(MrHandle, MrDesc), TransportError> {
        if ptr.is_null() || len == 0 {
            return Err(TransportError::InvalidArgument(
                "a region needs a non-null pointer and a length",
            ));
        }
        let group = self.group_for(device)?;
        self.command(group, |reply| Command::Register {
            addr: ptr as u64,
            len: len as u64,
            device,
            access,
            reply,
        })?
    }

    /// Deregisters a region: once this returns, no peer write reaches it.
    pub fn dereg_mr(&self, handle: &MrHandle) -> Result<(), TransportError> {
        self.command(self.group_of(handle)?, |reply| Command::Deregister {
            key: handle.key,
            reply,
        })?
    }

    /// The group that registered `handle`, if it is this engine's.
    fn group_of(&self, handle: &MrHandle) -> Result<&Arc<GroupShared>, TransportError> {
        self.inner
            .groups
            .get(handle.group as usize)
            .filter(|_| handle.engine == self.inner.engine.id)
            .ok_or(TransportError::UnknownRegion)
    }

    /// Allocates `len` bytes of zeroed host memory (page-aligned) owned by the engine and
    /// registers it, writable by peers; dropping the buffer deregisters and frees it.
    pub fn alloc_mr(&self, len: usize) -> Result<RegisteredBuffer, TransportError> {
        RegisteredBuffer::new(self.clone(), len, Access::RemoteWrite)
    }

    /// [`TransferEngine::alloc_mr`] with the access peers get (see [`Access`]).
    pub fn alloc_mr_with(
        &self,
        len: usize,
        access: Access,
    ) -> Result<RegisteredBuffer, TransportError> {
        RegisteredBuffer::new(self.clone(), len, access)
    }

    fn local(&self, handle: &MrHandle) -> Result<(&Arc<GroupShared>, RegionEntry), TransportError> {
        let group = self.group_of(handle)?;
        let entry = group
            .directory
            .region(handle.key)
            .ok_or(TransportError::UnknownRegion)?;
        Ok((group, entry))
    }

    // ----- peers -----

    /// Releases the peer engine at `addr`: every NIC forgets it (address-vector entries, a
    /// transmit endpoint of its own, a provider's mapping of its memory), so a long-running
    /// engine that many peers came and went to holds only what its current peers need. What
    /// this engine still had queued or in flight to it fails
    /// ([`crate::TransferError::PeerUnreachable`]). A later transfer to the address connects
    /// it afresh. Returns whether such a peer was connected.
    pub fn disconnect(&self, addr: &NetAddr) -> Result<bool, TransportError> {
        let mut released = false;
        for group in &self.inner.groups {
            released |= self.command(group, |reply| Command::Disconnect {
                addr: addr.clone(),
                reply,
            })??;
        }
        Ok(released)
    }

    /// Connects the peer at `addr` now (transfers connect the peers they name lazily): what a
    /// server does before it can know a message's sender
    /// ([`TransferEngine::submit_recvs_from`]). Idempotent.
    pub fn connect(&self, addr: &NetAddr) -> Result<(), TransportError> {
        self.peer(self.main_group(), addr).map(|_| ())
    }

    /// The address this engine's operations to the peer at `addr` leave from, when that is
    /// not [`TransferEngine::main_address`]: over `shm` each peer gets a transmit endpoint of
    /// its own, and the peer maps it when it first receives from it. Connects the peer (main
    /// group) if it is not yet. A receiver that keeps its senders mapped (`shm`) needs this
    /// name to forget them: tell it to the peer, which passes it to
    /// [`TransferEngine::adopt_sender`]. `None` when operations leave from the main address.
    pub fn sender_address(&self, addr: &NetAddr) -> Result<Option<NetAddr>, TransportError> {
        self.command(self.main_group(), |reply| Command::SenderAddress {
            addr: addr.clone(),
            reply,
        })?
    }

    /// Records that the peer at `addr` sends to this engine's main group from `sender` (its
    /// [`TransferEngine::sender_address`] for this engine), so that
    /// [`TransferEngine::disconnect`] releases what the provider holds for that sender too,
    /// once the sender can no longer send (`shm` keeps every endpoint that ever sent to it
    /// mapped, in a table of 256). Connects the peer if it is not yet. A `sender` of another
    /// process than the peer's, or more than 4 of them, is refused; providers that keep
    /// nothing per sender accept it and do nothing.
    pub fn adopt_sender(&self, addr: &NetAddr, sender: &NetAddr) -> Result<(), TransportError> {
        self.command(self.main_group(), |reply| Command::AdoptSender {
            addr: addr.clone(),
            sender: sender.clone(),
            reply,
        })?
    }

    fn peer(&self, group: &GroupShared, addr: &NetAddr) -> Result<Arc<PeerEntry>, TransportError> {
        let nic0 = addr
            .nics
            .first()
            .ok_or_else(|| TransportError::MalformedAddress("no NICs".to_owned()))?;
        match group.directory.peer(nic0) {
            Some(entry) if entry.addr == *addr => Ok(entry),
            Some(_) => Err(TransportError::MalformedAddress(
                "NIC 0 is known as part of another peer".to_owned(),
            )),
            None => self.command(group, |reply| Command::Connect {
                addr: addr.clone(),
                reply,
            })?,
        }
    }

    /// Checks a descriptor's NICs against `entry` (if given) or resolves them, and returns
    /// the target with one rkey per NIC.
    fn target(
        &self,
        group: &GroupShared,
        desc: &MrDesc,
        entry: Option<&PeerEntry>,
    ) -> Result<RemoteTarget, TransportError> {
        if desc.rkeys.len() != group.nics() {
            return Err(TransportError::NicCountMismatch {
                local: group.nics(),
                remote: desc.rkeys.len(),
            });
        }
        if let Some(entry) = entry {
            return remote_target(desc, entry);
        }
        // Most writes go to the peer of the one before: one comparison per NIC settles it.
        if let Some(target) = group.directory.last_peer(|e| remote_target(desc, e).ok()) {
            return Ok(target);
        }
        let provider = &desc.rkeys[0].nic.provider;
        if *provider != group.provider {
            return Err(TransportError::ProviderMismatch {
                local: group.provider.clone(),
                remote: provider.clone(),
            });
        }
        let entry = match group.directory.find_peer(&desc.rkeys[0].nic) {
            Some(e) => e,
            None => self.peer(group, &desc.net_addr())?,
        };
        remote_target(desc, &entry)
    }

    /// Connects to every peer of `addrs` (all through the main group) and registers them as a
    /// group for low-latency scatter and barrier.
    pub fn add_peer_group(&self, addrs: &[NetAddr]) -> Result<PeerGroupHandle, TransportError> {
        if addrs.is_empty() {
            return Err(TransportError::InvalidArgument(
                "a peer group needs members",
            ));
        }
        let group = self.main_group();
        let members = addrs
            .iter()
            .map(|a| self.peer(group, a))
            .collect::<Result<Vec<_>, _>>()?;
        let mut groups = self
            .inner
            .peer_groups
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        groups.push(PeerGroupEntry {
            group: group.index,
            members,
        });
        tracing::debug!(peers = addrs.len(), "added a peer group");
        Ok(PeerGroupHandle(groups.len() as u32 - 1))
    }

    /// Resolves scatter/barrier destinations, through the peer group if one is given.
    /// Resolves scatter/barrier destinations (through the peer group if one is given) and
    /// builds one `T` per destination with `build(index, target)`, in one allocation.
    fn targets<'a, T>(
        &self,
        group: &GroupShared,
        peers: Option<PeerGroupHandle>,
        descs: impl ExactSizeIterator<Item = &'a MrDesc>,
        build: impl Fn(usize, RemoteTarget) -> T,
    ) -> Result<Vec<T>, TransportError> {
        let Some(PeerGroupHandle(h)) = peers else {
            return descs
                .enumerate()
                .map(|(i, d)| Ok(build(i, self.target(group, d, None)?)))
                .collect();
        };
        let groups = self
            .inner
            .peer_groups
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let entry = groups
            .get(h as usize)
            .filter(|e| e.group == group.index)
            .ok_or(TransportError::UnknownPeerGroup)?;
        if descs.len() != entry.members.len() {
            return Err(TransportError::PeerGroupSizeMismatch {
                given: descs.len(),
                group: entry.members.len(),
            });
        }
        descs
            .zip(&entry.members)
            .enumerate()
            .map(
                |(index, (d, member))| match self.target(group, d, Some(member)) {
                    Ok(target) => Ok(build(index, target)),
                    Err(TransportError::MalformedAddress(_)) => {
                        Err(TransportError::NotInPeerGroup { index })
                    }
                    Err(other) => Err(other),
                },
            )
            .collect()
    }

    // ----- two-sided -----

    /// Sends `msg` to the receive buffers of the peer at `to`. The bytes are copied, so `msg`
    /// may be reused at once. With no buffer posted at the peer the send waits (RNR).
    pub fn submit_send(
        &self,
        to: &NetAddr,
        msg: &[u8],
        on_done: OnDone,
    ) -> Result<(), TransportError> {
        if msg.len() > self.inner.max_send_bytes {
            return Err(TransportError::MessageTooLarge {
                len: msg.len(),
                max: self.inner.max_send_bytes,
            });
        }
        let group = self.main_group();
        let peer = self.peer(group, to)?;
        self.submit(
            group,
            Work::Send {
                peer: peer.index,
                payload: msg.into(),
            },
            on_done,
        )
    }

    /// Posts `count` engine-owned buffers of `buf_len` bytes and calls `handler` with each
    /// message that lands in one, on the callback thread; a buffer is reposted when `handler`
    /// returns. One pool per engine.
    pub fn submit_recvs(
        &self,
        buf_len: usize,
        count: u32,
        mut handler: impl FnMut(&[u8]) + Send + 'static,
    ) -> Result<(), TransportError> {
        self.submit_recvs_from(buf_len, count, move |message, _| handler(message))
    }

    /// [`TransferEngine::submit_recvs`], with each message's sender: the address of the
    /// connected peer the NIC attributes it to (libfabric's `FI_SOURCE`: over `shm`, a peer or
    /// an endpoint adopted as its sender; over `tcp;ofi_rxm`, the peer of the connection it
    /// came on; in the `mem` domain, the sending engine), or `None` when it is from no peer
    /// this engine has connected. A server that must know who sent a message connects the
    /// claimed sender first, then checks the address against the claim.
    pub fn submit_recvs_from(
        &self,
        buf_len: usize,
        count: u32,
        handler: impl FnMut(&[u8], Option<&NetAddr>) + Send + 'static,
    ) -> Result<(), TransportError> {
        if buf_len == 0 || count == 0 {
            return Err(TransportError::InvalidArgument(
                "a receive pool needs buffers",
            ));
        }
        if self
            .inner
            .receiving
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            return Err(TransportError::AlreadyReceiving);
        }
        // The handler is in place before any buffer is posted, so no message finds none.
        self.inner
            .engine
            .callbacks
            .push(Job::SetRecvHandler(Box::new(handler)));
        self.command(self.main_group(), |reply| Command::InstallRecvPool {
            buf_len,
            count,
            reply,
        })?
    }

    // ----- one-sided -----

    /// Fires `on_done` once `count` writes with immediate `imm` have landed here, counting
    /// those that landed before this call (paper 002's IMM counter). Arrivals beyond `count`
    /// are kept for the next expectation of `imm`. While `imm` is watched
    /// ([`TransferEngine::watch_imm`]) it fails at once with [`TransferError::ImmWatched`].
    pub fn expect_imm_count(&self, imm: u32, count: u64, on_done: OnDone) {
        let (done, result) = match self.inner.engine.imm.expect(imm, count, on_done) {
            Expectation::Waiting => return,
            Expectation::Met(done) => (done, Ok(())),
            Expectation::Refused(done) => (done, Err(TransferError::ImmWatched(imm))),
        };
        let callbacks = &self.inner.engine.callbacks;
        done.finish(result, |f, o| callbacks.run_done(f, o));
    }

    /// [`TransferEngine::expect_imm_count`] as a future.
    pub fn imm_count(&self, imm: u32, count: u64) -> TransferFuture {
        let (done, future) = OnDone::future();
        self.expect_imm_count(imm, count, done);
        future
    }

    /// Arrivals of `imm` counted and not claimed by an expectation.
    pub fn pending_imm(&self, imm: u32) -> u64 {
        self.inner.engine.imm.pending(imm)
    }

    /// Claims and returns the arrivals of `imm` nobody expects.
    pub fn take_imm(&self, imm: u32) -> u64 {
        self.inner.engine.imm.take(imm)
    }

    /// Reserves an immediate value for the caller's own use and returns it: drawn at random
    /// among the values not reserved yet, so a peer told one value cannot derive another,
    /// and counted whatever a flood of other values does (each shard of the counter stores at
    /// most 256 values (`imm_counter::MAX_SHARD_SLOTS`); arrivals of a value with no slot
    /// beyond that are dropped and counted in [`TransferEngine::dropped_imms`]). Values whose
    /// arrivals may come before their expectation (a notification, pages fetched ahead of the
    /// reply that names them) must be reserved. [`TransferEngine::release_imm`] ends it.
    pub fn reserve_imm(&self) -> u32 {
        use std::hash::BuildHasher;
        let state = std::collections::hash_map::RandomState::new();
        (0u64..)
            .map(|draw| state.hash_one(draw) as u32)
            .find(|&imm| self.inner.engine.imm.reserve(imm))
            .unwrap_or_default()
    }

    /// Ends the reservation of `imm` ([`TransferEngine::reserve_imm`]).
    pub fn release_imm(&self, imm: u32) {
        self.inner.engine.imm.release(imm);
    }

    /// Arrivals dropped because their value had no slot in the IMM counter and its shard was
    /// full: a peer sending values nobody uses.
    pub fn dropped_imms(&self) -> u64 {
        self.inner.engine.imm.dropped()
    }

    /// Calls `handler(imm, count)` on the callback thread for arrivals that find no
    /// expectation waiting (they also stay counted, for a later expectation or `take_imm`).
    pub fn on_unexpected_imm(&self, handler: impl FnMut(u32, u64) + Send + 'static) {
        self.inner
            .engine
            .callbacks
            .push(Job::SetUnexpectedHandler(Box::new(handler)));
        self.inner
            .engine
            .unexpected_imm_handler
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// A queue of the arrivals that find no expectation waiting, as `(imm, count)`, pushed by
    /// the progress pass itself (a worker thread, or [`TransferEngine::progress`]) with no
    /// callback-thread hop: for servers that wait for requests in a loop of their own and
    /// want the lowest wake-up latency. The arrivals also stay counted, so `take_imm` claims
    /// them as with [`TransferEngine::on_unexpected_imm`], which keeps working beside it.
    /// Every call returns a receiver of the same queue; arrivals before the first call are
    /// not queued (they stay counted). The queue is unbounded: drain it.
    pub fn unexpected_imms(&self) -> UnexpectedImms {
        UnexpectedImms {
            rx: self
                .inner
                .engine
                .unexpected_imm_queue
                .get_or_init(crossbeam_channel::unbounded)
                .1
                .clone(),
        }
    }

    /// Writes `len` bytes from `src` (handle, offset) to `dst` (descriptor, offset), sharded
    /// over the NICs; each shard carries `imm`.
    pub fn submit_single_write(
        &self,
        len: u64,
        imm: Option<u32>,
        src: (&MrHandle, u64),
        dst: (&MrDesc, u64),
        on_done: OnDone,
    ) -> Result<(), TransportError> {
        if len == 0 && imm.is_none() {
            return Err(TransportError::EmptyTransfer);
        }
        let (group, region) = self.local(src.0)?;
        check_range(Side::Source, region.len, src.1, len)?;
        check_range(Side::Destination, dst.0.len, dst.1, len)?;
        let target = self.target(group, dst.0, None)?;
        let src_ref = LocalSrc {
            addr: region.addr,
            lkeys: region.lkeys,
        };
        let work = Writes::Single {
            src: src_ref,
            dst: target,
            src_offset: src.1,
            dst_offset: dst.1,
            len,
            imm,
        };
        self.submit(group, Work::Writes(work), on_done)
    }

    /// Writes `page_len`-byte pages: source page `i` of `src` to destination page `i` of
    /// `dst`, one write per page rotated over the NICs; each page carries `imm`.
    pub fn submit_paged_writes(
        &self,
        page_len: u64,
        imm: Option<u32>,
        src: (&MrHandle, &Pages),
        dst: (&MrDesc, &Pages),
        on_done: OnDone,
    ) -> Result<(), TransportError> {
        let (src_pages, dst_pages) = (src.1, dst.1);
        if src_pages.indices.len() != dst_pages.indices.len() {
            return Err(TransportError::PageCountMismatch {
                src: src_pages.indices.len(),
                dst: dst_pages.indices.len(),
            });
        }
        if src_pages.indices.is_empty() {
            return Err(TransportError::EmptyTransfer);
        }
        if page_len == 0 {
            return Err(TransportError::InvalidArgument("page_len must be positive"));
        }
        if u32::try_from(src_pages.indices.len()).is_err() {
            return Err(TransportError::InvalidArgument(
                "at most 2^32 - 1 pages per transfer",
            ));
        }
        let (group, region) = self.local(src.0)?;
        src_pages.validate(Side::Source, page_len, region.len)?;
        dst_pages.validate(Side::Destination, page_len, dst.0.len)?;
        let target = self.target(group, dst.0, None)?;
        let work = Writes::Paged {
            src: LocalSrc {
                addr: region.addr,
                lkeys: region.lkeys,
            },
            dst: target,
            page_len,
            src_pages: src_pages.clone(),
            dst_pages: dst_pages.clone(),
            imm,
        };
        self.submit(group, Work::Writes(work), on_done)
    }

    /// An immediate-only write to the region of `dst` (no bytes; the peer counts `imm`).
    ///
    /// With [`OnDone::nothing`] (not made cancellable) nobody would see its completion, so
    /// where the NIC can post it without one it does (libfabric's shm, the `mem` domain): it
    /// is then done with once posted, counted as posted and
    /// [`unreported`](crate::DomainStats::unreported), and a failure the NIC finds later goes
    /// unseen. Elsewhere, and when the NIC refuses it at the post, it completes as usual.
    pub fn submit_imm(
        &self,
        imm: u32,
        dst: &MrDesc,
        on_done: OnDone,
    ) -> Result<(), TransportError> {
        let group = self.main_group();
        let target = self.target(group, dst, None)?;
        self.submit_imm_resolved(group, target, imm, on_done)
    }

    /// Resolves `dst` for [`TransferEngine::submit_imm_to`]: connects to its peer if needed
    /// and checks the descriptor, once.
    pub fn imm_target(&self, dst: &MrDesc) -> Result<ImmTarget, TransportError> {
        let group = self.main_group();
        let removals = group.directory.removals();
        let target = self.target(group, dst, None)?;
        Ok(ImmTarget {
            desc: dst.clone(),
            directory: group.directory.id(),
            removals,
            target,
        })
    }

    /// [`TransferEngine::submit_imm`] to a destination resolved beforehand: the same write,
    /// without the per-write lookup while no peer has been released since `dst` was made.
    pub fn submit_imm_to(
        &self,
        imm: u32,
        dst: &ImmTarget,
        on_done: OnDone,
    ) -> Result<(), TransportError> {
        let group = self.main_group();
        if dst.directory != group.directory.id() {
            return Err(TransportError::InvalidArgument(
                "the immediate target was resolved by another engine",
            ));
        }
        let target = if dst.removals == group.directory.removals() {
            dst.target
        } else {
            self.target(group, &dst.desc, None)?
        };
        self.submit_imm_resolved(group, target, imm, on_done)
    }

    fn submit_imm_resolved(
        &self,
        group: &GroupShared,
        target: RemoteTarget,
        imm: u32,
        on_done: OnDone,
    ) -> Result<(), TransportError> {
        // Under manual progress, one nobody waits on goes out here without becoming a transfer.
        if on_done.reports_nothing() && self.post_unreported_here(group, &target, imm) {
            return Ok(());
        }
        self.submit(
            group,
            Work::Writes(Writes::Imm { dst: target, imm }),
            on_done,
        )
    }

    /// Writes a slice of `src` to each target (paper 002 `submit_scatter`), targets spread
    /// over the NICs. With `peers`, target `i` must be the group's member `i` and no lookups
    /// are made.
    pub fn submit_scatter(
        &self,
        peers: Option<PeerGroupHandle>,
        imm: Option<u32>,
        src: &MrHandle,
        dsts: &[ScatterDst],
        on_done: OnDone,
    ) -> Result<(), TransportError> {
        if dsts.is_empty() {
            return Err(TransportError::EmptyTransfer);
        }
        let (group, region) = self.local(src)?;
        validate_scatter(region.len, dsts)?;
        let targets = self.targets(group, peers, dsts.iter().map(|d| &d.dst), |i, dst| {
            ScatterTarget {
                dst,
                len: dsts[i].len,
                src_offset: dsts[i].src_offset,
                dst_offset: dsts[i].dst_offset,
            }
        })?;
        let work = Writes::Scatter {
            src: LocalSrc {
                addr: region.addr,
                lkeys: region.lkeys,
            },
            targets,
            imm,
        };
        self.submit(group, Work::Writes(work), on_done)
    }

    /// An immediate-only write to each target (paper 002 `submit_barrier`).
    pub fn submit_barrier(
        &self,
        peers: Option<PeerGroupHandle>,
        imm: u32,
        dsts: &[MrDesc],
        on_done: OnDone,
    ) -> Result<(), TransportError> {
        if dsts.is_empty() {
            return Err(TransportError::EmptyTransfer);
        }
        let group = self.main_group();
        let targets = self.targets(group, peers, dsts.iter(), |_, target| target)?;
        self.submit(
            group,
            Work::Writes(Writes::Barrier { targets, imm }),
            on_done,
        )
    }

    // ----- watcher -----

    /// Allocates a 64-bit word and calls `handler(old, new)` on the callback thread whenever
    /// it changes (paper 002's UVM watcher; host memory here). Changes in quick succession
    /// may be seen as one, which is why the old value is passed.
    pub fn alloc_watcher(
        &self,
        handler: impl FnMut(u64, u64) + Send + 'static,
    ) -> Result<WatchedWord, TransportError> {
        if self.inner.stopped.load(Ordering::Acquire) {
            return Err(TransportError::Shutdown);
        }
        self.inner.watcher.watch(Box::new(handler))
    }
}

/// `desc`'s target at `entry`, one rkey per NIC, once each of its NICs is the peer's NIC of
/// the same index.
fn remote_target(desc: &MrDesc, entry: &PeerEntry) -> Result<RemoteTarget, TransportError> {
    let mut rkeys = [0; MAX_NICS];
    for (i, key) in desc.rkeys.iter().enumerate() {
        if key.nic != entry.addr.nics[i] {
            return Err(TransportError::MalformedAddress(format!(
                "descriptor NIC {i} is not the peer's NIC {i}"
            )));
        }
        rkeys[i] = key.rkey;
    }
    Ok(RemoteTarget {
        peer: entry.index,
        addr: desc.addr,
        rkeys,
    })
}

/// The queue of arrivals no expectation was waiting for, as `(imm, count)`
/// ([`TransferEngine::unexpected_imms`]).
#[derive(Debug, Clone)]
pub struct UnexpectedImms {
    rx: crossbeam_channel::Receiver<(u32, u64)>,
}

impl UnexpectedImms {
    /// The arrivals queued now, without waiting.
    pub fn try_iter(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.rx.try_iter()
    }

    /// The next arrival, waiting up to `timeout`: `Ok(None)` if none came, and
    /// [`TransportError::Shutdown`] once the engine has stopped (nothing more will).
    pub fn recv_timeout(
        &self,
        timeout: std::time::Duration,
    ) -> Result<Option<(u32, u64)>, TransportError> {
        match self.rx.recv_timeout(timeout) {
            Ok(arrival) => Ok(Some(arrival)),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Ok(None),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Err(TransportError::Shutdown),
        }
    }
}
