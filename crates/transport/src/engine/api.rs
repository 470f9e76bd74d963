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
use super::message::{Command, Message, RemoteTarget, Submission, Work};
use super::pass_lock::PassGuard;
use super::shared::{GroupShared, PeerEntry};
use super::{Backpressure, ManualGroup, TransferEngine};
use crate::addr::{MAX_NICS, NetAddr};
use crate::error::TransportError;
use crate::mr::{Device, MrDesc};
use crate::on_done::OnDone;
use crate::plan::{TransferShape, arrivals};

mod memory;
mod one_sided;
mod peers;

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
}

/// `desc`'s target at `entry`, one rkey per NIC, once each of its NICs is the peer's NIC of
/// the same index.
pub(super) fn remote_target(
    desc: &MrDesc,
    entry: &PeerEntry,
) -> Result<RemoteTarget, TransportError> {
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
