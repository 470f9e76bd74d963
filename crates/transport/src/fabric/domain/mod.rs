//! [`FabricDomain`]: one NIC as a libfabric `FI_EP_RDM` endpoint with its completion queue,
//! address vector and registered regions.

use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::Arc;
use std::time::{Duration, Instant};

use libfabric_sys as fi;

use super::FabricConfig;
use super::ctx::{ContextPool, OpKind, Released};
use super::info::{Chosen, MrMode, c_str};
use crate::addr::DomainAddr;
use crate::domain::{
    Completion, CompletionKind, Domain, Notify, PeerId, RecvWr, Registration, SendWr, Unreported,
    WriteWr,
};
use crate::error::{TransferError, TransportError};
use crate::mr::{Access, Device};

/// Access every region is registered with: source of writes, sends and receives.
const LOCAL_ACCESS: u64 = fi::FI_SEND | fi::FI_RECV | fi::FI_WRITE | fi::FI_READ;

/// Added for [`Access::RemoteWrite`]: target of peers' writes. The providers check it at the
/// target (libfabric's `ofi_mr_map_verify` answers `FI_EACCES` to an access the region was
/// not registered for).
const REMOTE_ACCESS: u64 = fi::FI_REMOTE_WRITE | fi::FI_REMOTE_READ;

/// Idle polls between looks at the clock for overdue operations.
const SWEEP_EVERY: u32 = 128;

/// Longest address accepted from a peer (EFA's are 32 bytes, tcp's 16-28, shm's names ~64).
const MAX_ADDR_LEN: usize = 256;

/// A registered region.
#[derive(Debug)]
struct Region {
    mr: *mut fi::fid_mr,
    addr: u64,
    len: u64,
    desc: *mut c_void,
}

/// A peer NIC in the address vector.
#[derive(Debug)]
struct Peer {
    /// Its address as given to `connect` (the key of `peer_ids`).
    bytes: Vec<u8>,
    /// Released by `disconnect`: nothing may be posted to it; its id waits in `free_peers`.
    released: bool,
    fi_addr: fi::fi_addr_t,
    /// Since when the provider has refused new operations to it (`-FI_EAGAIN`).
    refusing_since: Option<Instant>,
    /// The endpoint its writes and sends are posted on: its own (see
    /// [`super::FabricConfig::tx_endpoint_per_peer`]) or null for the published one.
    ep: *mut fi::fid_ep,
    /// The process behind an `shm` address, checked before posting (see [`shm_peer_pid`]).
    pid: Option<libc::pid_t>,
    /// What is known of that process.
    process: Process,
    /// The endpoints it sends to this NIC from that this NIC holds an entry for
    /// ([`Domain::adopt_sender`]), released after the peer.
    senders: Vec<Sender>,
    /// Whether anything was ever posted to it, accepted or not (on its own endpoint, the first
    /// post announced that endpoint to the peer).
    posted: bool,
}

/// An endpoint a peer sends from, in this NIC's address vector: `shm` maps every endpoint
/// that sends to it under the sender's name and keeps the mapping until that name is removed.
#[derive(Debug)]
struct Sender {
    bytes: Vec<u8>,
    fi_addr: fi::fi_addr_t,
    /// Since when it has been found unable to send (retired senders only).
    silent_since: Option<Instant>,
}

/// How long a retired sender must have been unable to send before its entry is removed: the
/// receiver may still be working through commands it posted before it went (their answers
/// go to its region, which removing the entry unmaps).
const SENDER_GRACE: Duration = Duration::from_secs(1);

/// A released peer's transmit endpoint kept open ([`FabricDomain`]'s `lingering`).
#[derive(Debug)]
struct Lingering {
    ep: *mut fi::fid_ep,
    bytes: Vec<u8>,
    pid: libc::pid_t,
    /// The peer's address entry, kept with it: the endpoint's queued operations name the
    /// peer by it, and removing it unmaps the peer's region under them.
    fi_addr: fi::fi_addr_t,
    /// Since when the peer's region has been found gone while its process lives on (an
    /// engine dropped by a process that keeps running).
    gone_since: Option<Instant>,
    /// When its peer was released.
    released: Instant,
}

/// Most released peers' endpoints kept open for one process: past it, the one released
/// longest ago is closed (its operations were abandoned at least as many releases ago), so
/// a process whose engines come and go faster than [`SENDER_GRACE`] holds at most this many
/// `shm` regions of the holder's.
const MAX_LINGERING_PER_PROCESS: usize = 8;

/// Most sending endpoints one peer may name (one per NIC group it sends from).
const MAX_SENDERS: usize = 4;

/// What a [`Peer`]'s `shm` process was last found to be.
#[derive(Debug, Clone, Copy)]
enum Process {
    /// Alive when last checked (never, for `None`).
    Alive(Option<ticks::Ticks>),
    /// Gone: posts to it fail; its outstanding operations are still to be failed.
    Exited,
    /// Gone, and its outstanding operations have been failed.
    Settled,
}

/// How long a liveness check of an `shm` peer's process holds.
const ALIVE_FOR: Duration = Duration::from_micros(200);

/// Registered buffers that sends are copied into, for providers that need registered sources.
#[derive(Debug)]
struct Bounce {
    memory: Box<[u8]>,
    slot_len: usize,
    lkey: u64,
    free: Vec<u32>,
}

/// One NIC: a libfabric endpoint and everything bound to it. Owned and called by one worker
/// thread (the objects are opened with `FI_THREAD_DOMAIN`, which is that promise).
#[derive(Debug)]
pub struct FabricDomain {
    lib: &'static fi::Library,
    info: *mut fi::fi_info,
    fabric: *mut fi::fid_fabric,
    domain: *mut fi::fid_domain,
    cq: *mut fi::fid_cq,
    av: *mut fi::fid_av,
    ep: *mut fi::fid_ep,
    provider: String,
    domain_name: String,
    addr: DomainAddr,
    addr_is_string: bool,
    mr_mode: MrMode,
    max_msg_size: usize,
    /// [`ALIVE_FOR`] in the liveness clock's units.
    alive_for: ticks::Span,
    /// Whether immediate-only writes nobody waits on go out with `fi_inject_writedata`
    /// (cleared at the provider's first `-FI_ENOSYS`).
    inject_imm: bool,
    regions: Vec<Option<Region>>,
    generations: Vec<u32>,
    free_regions: Vec<u32>,
    /// Draws the keys of regions where the provider lets us choose them (not
    /// `FI_MR_PROV_KEY`): random within the provider's key size, so that a peer handed one
    /// region's key cannot derive another's.
    keys: KeyDraw,
    peers: Vec<Peer>,
    peer_ids: HashMap<Vec<u8>, PeerId>,
    /// Ids of released peers, reused by the next connections.
    free_peers: Vec<PeerId>,
    /// Failures of a released peer's operations, reported by the next poll.
    released_ops: Vec<Completion>,
    /// Senders of released peers, removed from the address vector once they can no longer
    /// send (their region is gone or their process has exited): `shm` reads a sender's
    /// region for each of its commands, so an entry removed while the sender may still post
    /// would leave it naming a slot that is empty or another peer's.
    retired_senders: Vec<Sender>,
    /// Transmit endpoints of released `shm` peers that posted to them, with the peer's address,
    /// its address-vector entry and its process: closed (and the entry removed) once that
    /// process has exited, and taken up again if the same
    /// address connects first (so there is at most one per live peer engine). 1.17's `shm`
    /// announces a new sender with the first command it posts, and a receiver that reads
    /// that announcement after the sender's region is gone dereferences a null region and
    /// crashes (`smr_progress_connreq`). Nothing tells the sender when the peer has read it
    /// (a small write completes at once, read or not), and a stopped or slow peer may read
    /// it any time later, so the endpoint is kept until the peer cannot.
    lingering: Vec<Lingering>,
    contexts: ContextPool,
    cq_buf: Vec<fi::fi_cq_data_entry>,
    /// The source address of each entry of `cq_buf` (`FI_SOURCE`).
    cq_src: Vec<fi::fi_addr_t>,
    /// The peer each address-vector entry stands for: a peer's own, and the endpoints it was
    /// adopted to send from. What a receive completion's source is looked up in.
    by_fi_addr: HashMap<fi::fi_addr_t, PeerId>,
    bounce: Option<Bounce>,
    idle_poll: Option<Duration>,
    /// When an operation was last posted or completed: how long the domain has been idle,
    /// which its idle poll period grows with.
    last_active: Instant,
    op_timeout: Duration,
    next_sweep: Instant,
    /// Polls since the clock was last read for the sweep (reading it every poll costs more
    /// than the poll itself on the fast providers).
    polls_since_sweep: u32,
    /// Whether each peer gets a transmit endpoint of its own.
    tx_per_peer: bool,
}

// SAFETY: the raw pointers are libfabric objects this value alone owns; libfabric objects
// opened with FI_THREAD_DOMAIN may be used from any thread as long as one thread at a time
// does, which `&mut self` on every call that touches them guarantees.
unsafe impl Send for FabricDomain {}

/// Turns a libfabric return code into an error naming the call.
fn check(lib: &fi::Library, what: &str, rc: i32) -> Result<(), TransportError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(TransportError::Domain(format!(
            "{what}: {}",
            lib.strerror(rc)
        )))
    }
}

impl FabricDomain {
    /// The domain (NIC) name the provider reported.
    pub fn domain_name(&self) -> &str {
        &self.domain_name
    }

    /// The memory-registration mode in force.
    pub fn mr_mode(&self) -> MrMode {
        self.mr_mode
    }

    fn region(&self, lkey: u64) -> Option<&Region> {
        let (slot, generation) = ((lkey & 0xffff_ffff) as usize, (lkey >> 32) as u32);
        self.regions
            .get(slot)?
            .as_ref()
            .filter(|_| self.generations[slot] == generation)
    }

    /// The descriptor for `[addr, addr + len)` inside the region of `lkey`.
    fn local_desc(&self, lkey: u64, addr: u64, len: u64) -> Result<*mut c_void, TransportError> {
        let r = self
            .region(lkey)
            .ok_or_else(|| TransportError::Domain(format!("unknown local key {lkey:#x}")))?;
        let inside = addr >= r.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= r.addr + r.len);
        if !inside {
            return Err(TransportError::Domain(format!(
                "[{addr:#x}, +{len}) is outside the region of local key {lkey:#x}"
            )));
        }
        Ok(r.desc)
    }

    /// The AV address of `peer` (not released).
    fn peer_addr(&self, peer: PeerId) -> Result<fi::fi_addr_t, TransportError> {
        self.peers
            .get(peer as usize)
            .filter(|p| !p.released)
            .map(|p| p.fi_addr)
            .ok_or_else(|| TransportError::Domain(format!("unknown or released peer id {peer}")))
    }

    /// Records a post's outcome for its peer; a provider refusing (`-FI_EAGAIN`) operations to
    /// a peer for longer than the deadline is an error (the peer is gone or stuck).
    /// `now` reads the clock (only a refusal needs it).
    fn note_post(
        &mut self,
        peer: PeerId,
        accepted: bool,
        now: impl FnOnce() -> Instant,
    ) -> Result<(), TransportError> {
        let timeout = self.op_timeout;
        let Some(p) = self.peers.get_mut(peer as usize) else {
            return Ok(());
        };
        // Refused or not, the first post announced the endpoint: 1.17's shm sends the
        // announcement and answers `-FI_EAGAIN` until the peer has read it.
        p.posted = true;
        if accepted {
            p.refusing_since = None;
            return Ok(());
        }
        // Kept while the refusals last: once past the deadline, every further refusal fails
        // its transfer at once instead of each waiting the deadline again.
        let now = now();
        let since = *p.refusing_since.get_or_insert(now);
        if now.saturating_duration_since(since) > timeout {
            return Err(TransportError::Domain(format!(
                "the provider has refused new operations to peer {peer} for {timeout:?} \
                 (-FI_EAGAIN): it is gone or stuck"
            )));
        }
        Ok(())
    }

    /// Fails when `peer` is an `shm` process that no longer exists (see [`shm_peer_pid`]).
    fn check_alive(&mut self, peer: PeerId) -> Result<(), TransportError> {
        let Some(p) = self.peers.get_mut(peer as usize) else {
            return Ok(());
        };
        let Some(pid) = p.pid else {
            return Ok(());
        };
        if let Process::Alive(checked) = p.process {
            let now = ticks::Ticks::now();
            if checked.is_some_and(|at| now.within(at, self.alive_for)) {
                return Ok(());
            }
            if process_exists(pid) {
                p.process = Process::Alive(Some(now));
                return Ok(());
            }
            p.process = Process::Exited;
        }
        Err(TransportError::Domain(format!(
            "peer {peer}'s process {pid} has exited"
        )))
    }

    /// Posts an immediate-only write with `fi_inject_writedata`: copied at the post, no
    /// completion.
    fn inject_imm(&mut self, wr: &WriteWr) -> Result<Unreported, TransportError> {
        let (Some(imm), 0) = (wr.imm, wr.len) else {
            return Ok(Unreported::Unsupported);
        };
        if !self.inject_imm {
            return Ok(Unreported::Unsupported);
        }
        let dest = self.peer_addr(wr.peer)?;
        self.check_alive(wr.peer)?;
        // SAFETY: the endpoint is live; a zero-length write reads no source bytes.
        let rc = unsafe {
            fi::fi_inject_writedata(
                self.tx_ep(wr.peer),
                wr.src_addr as *const c_void,
                0,
                u64::from(imm),
                dest,
                wr.dst_addr,
                wr.rkey,
            )
        };
        let outcome = match rc {
            0 => Unreported::Posted,
            rc if rc == -(fi::FI_EAGAIN as isize) => Unreported::Full,
            rc if rc == -(fi::FI_ENOSYS as isize) => {
                self.inject_imm = false;
                return Ok(Unreported::Unsupported);
            }
            rc => {
                return Err(TransportError::Domain(format!(
                    "fi_inject_writedata: {}",
                    self.lib.strerror(rc as i32)
                )));
            }
        };
        self.note_post(wr.peer, outcome == Unreported::Posted, Instant::now)?;
        Ok(outcome)
    }

    /// Posts one write; `Ok(false)` is `-FI_EAGAIN`.
    fn post_write(&mut self, wr: &WriteWr) -> Result<bool, TransportError> {
        let desc = self.local_desc(wr.lkey, wr.src_addr, wr.len)?;
        let dest = self.peer_addr(wr.peer)?;
        let now = Instant::now();
        self.check_alive(wr.peer)?;
        let len = usize::try_from(wr.len)
            .ok()
            .filter(|&l| l <= self.max_msg_size)
            .ok_or_else(|| {
                TransportError::Domain(format!(
                    "a {}-byte write exceeds the provider's {}-byte limit",
                    wr.len, self.max_msg_size
                ))
            })?;
        let context = self
            .contexts
            .acquire(wr.wr_id, OpKind::Write, wr.peer, None, now);
        let iov = fi::iovec {
            iov_base: wr.src_addr as *mut c_void,
            iov_len: len,
        };
        let mut descs = [desc];
        let rma = fi::fi_rma_iov {
            addr: wr.dst_addr,
            len,
            key: wr.rkey,
        };
        let msg = fi::fi_msg_rma {
            msg_iov: &raw const iov,
            desc: descs.as_mut_ptr(),
            iov_count: 1,
            addr: dest,
            rma_iov: &raw const rma,
            rma_iov_count: 1,
            context,
            data: u64::from(wr.imm.unwrap_or(0)),
        };
        // Delivery-complete: the write completes once placed at the target, so a target's
        // refusal reaches the sender (transmit-complete would report the write done as soon
        // as it left). Not for immediate-only writes: there is nothing to place, and shm
        // (1.17) never answers a zero-length delivery-complete write.
        let delivery = if len > 0 { fi::FI_DELIVERY_COMPLETE } else { 0 };
        let flags = fi::FI_COMPLETION
            | delivery
            | if wr.imm.is_some() {
                fi::FI_REMOTE_CQ_DATA
            } else {
                0
            };
        // SAFETY: the endpoint is live; `msg` and what it points to live across the call (the
        // provider copies the iovecs); the source stays registered until the completion, which
        // the engine's transfer tracking guarantees; `context` is a pool slot.
        let rc = unsafe { fi::fi_writemsg(self.tx_ep(wr.peer), &raw const msg, flags) };
        let accepted = self.posted(rc, context, "fi_writemsg")?;
        self.note_post(wr.peer, accepted, || now)?;
        Ok(accepted)
    }

    /// Settles a post's return code: accepted, EAGAIN (slot returned), or an error.
    fn posted(
        &mut self,
        rc: isize,
        context: *mut c_void,
        what: &str,
    ) -> Result<bool, TransportError> {
        match rc {
            0 => Ok(true),
            rc if rc == -(fi::FI_EAGAIN as isize) => {
                self.contexts.cancel(context);
                Ok(false)
            }
            rc => {
                self.contexts.cancel(context);
                Err(TransportError::Domain(format!(
                    "{what}: {}",
                    self.lib.strerror(rc as i32)
                )))
            }
        }
    }

    fn give_back_bounce(&mut self, slot: u32) {
        if let Some(b) = self.bounce.as_mut() {
            b.free.push(slot);
        }
    }

    fn close_region(&mut self, region: &Region) -> Result<(), TransportError> {
        // SAFETY: a live registration, closed once (removed from the table by the caller).
        let rc = unsafe { fi::fi_close(&raw mut (*region.mr).fid) };
        check(self.lib, "fi_close (mr)", rc)
    }
}

mod completions;
mod open;
mod ops;
mod peers;
mod shm;
mod ticks;

use completions::completion_kind;

pub use shm::remove_shm_regions_of_dead_process;
use shm::{
    check_shm_peer, clear_stale_shm_regions, process_exists, same_shm_process, shm_peer_pid,
    shm_sender_may_send,
};

/// Random region keys of `size` bytes (at most 8; 0 taken as 8), never 0.
#[derive(Debug)]
pub(super) struct KeyDraw {
    state: std::collections::hash_map::RandomState,
    drawn: u64,
    mask: u64,
}

impl KeyDraw {
    fn new(size: usize) -> Self {
        let bits = if size == 0 || size >= 8 { 64 } else { size * 8 };
        Self {
            state: Default::default(),
            drawn: 0,
            mask: if bits == 64 {
                u64::MAX
            } else {
                (1u64 << bits) - 1
            },
        }
    }

    /// The next key.
    pub(super) fn next(&mut self) -> u64 {
        use std::hash::BuildHasher;
        loop {
            self.drawn += 1;
            let key = self.state.hash_one(self.drawn) & self.mask;
            if key != 0 {
                return key;
            }
        }
    }
}
