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
    /// Opens NIC `nic` of the chosen provider: fabric, domain, CQ, AV and an enabled endpoint.
    pub(crate) fn open(
        lib: &'static fi::Library,
        chosen: &Chosen,
        nic: usize,
        config: &FabricConfig,
    ) -> Result<Self, TransportError> {
        // SAFETY: an entry of the chosen list; the copy is ours and freed in Drop.
        let info = unsafe { lib.dupinfo(chosen.info(nic)) };
        if info.is_null() {
            return Err(TransportError::Domain("fi_dupinfo failed".to_owned()));
        }
        let candidate = &chosen.candidate;
        if candidate.provider == "shm" {
            clear_stale_shm_regions();
        }
        let mr_mode = if config.force_mr_local {
            MrMode(candidate.mr_mode.0 | fi::FI_MR_LOCAL)
        } else {
            candidate.mr_mode
        };
        // A registration bound to one endpoint (FI_MR_ENDPOINT) would have to be bound to
        // every peer's too; no provider that needs per-peer endpoints asks for that.
        let tx_per_peer = match config.tx_endpoint_per_peer {
            Some(true) if mr_mode.has(fi::FI_MR_ENDPOINT) => {
                // SAFETY: our own copy, not used after.
                unsafe { lib.freeinfo(info) };
                return Err(TransportError::InvalidArgument(
                    "per-peer transmit endpoints need a provider without FI_MR_ENDPOINT",
                ));
            }
            Some(on) => on,
            None => candidate.provider == "shm" && !mr_mode.has(fi::FI_MR_ENDPOINT),
        };
        let mut d = Self {
            lib,
            info,
            fabric: null_mut(),
            domain: null_mut(),
            cq: null_mut(),
            av: null_mut(),
            ep: null_mut(),
            provider: format!("fabric:{}", candidate.provider),
            // SAFETY: a complete fi_info.
            domain_name: unsafe { c_str((*(*info).domain_attr).name) },
            addr: DomainAddr {
                provider: String::new(),
                bytes: Vec::new(),
            },
            // SAFETY: as above.
            addr_is_string: unsafe { (*info).addr_format } == fi::FI_ADDR_STR,
            mr_mode,
            max_msg_size: candidate.max_msg_size,
            // `fi_inject_writedata` where it was measured to work: libfabric 1.17's tcp;ofi_rxm
            // answers it `-FI_EAGAIN` on every post (its emulated write is taken instead each
            // time), and efa has not been tried.
            inject_imm: candidate.provider == "shm",
            alive_for: ticks::Span::of(ALIVE_FOR),
            regions: Vec::new(),
            generations: Vec::new(),
            free_regions: Vec::new(),
            // SAFETY: a complete fi_info.
            keys: KeyDraw::new(unsafe { (*(*info).domain_attr).mr_key_size }),
            peers: Vec::new(),
            peer_ids: HashMap::new(),
            free_peers: Vec::new(),
            released_ops: Vec::new(),
            retired_senders: Vec::new(),
            lingering: Vec::new(),
            contexts: ContextPool::default(),
            cq_buf: vec![fi::fi_cq_data_entry::default(); config.cq_batch],
            cq_src: vec![fi::FI_ADDR_NOTAVAIL; config.cq_batch],
            by_fi_addr: HashMap::new(),
            bounce: None,
            idle_poll: config.idle_poll,
            op_timeout: config.op_timeout,
            next_sweep: Instant::now(),
            polls_since_sweep: 0,
            tx_per_peer,
        };
        // Everything opened so far is closed by Drop if a later step fails.
        d.open_objects(config.cq_size)?;
        d.addr = DomainAddr {
            provider: d.provider.clone(),
            bytes: d.endpoint_name(d.ep)?,
        };
        if d.provider == "fabric:shm" {
            // 1.17's shm names the sender of a message by the `fiaddr` of its entry in the
            // peer table, and an entry it made for an endpoint that sent unasked (never
            // inserted here) keeps the value a fresh table holds: 0, the first address ever
            // inserted. This NIC's own address takes that index, and no peer gets it, so
            // such a message is from no peer (not the first one connected).
            let own = d.addr.bytes.clone();
            let reserved = d.insert(&own)?;
            d.by_fi_addr.remove(&reserved);
        }
        if d.mr_mode.has(fi::FI_MR_LOCAL) {
            d.bounce = Some(d.bounce_buffers(config.send_buffers, config.send_buffer_len)?);
        }
        tracing::debug!(provider = %d.provider, domain = %d.domain_name, nic, "opened fabric NIC");
        Ok(d)
    }

    fn open_objects(&mut self, cq_size: usize) -> Result<(), TransportError> {
        let lib = self.lib;
        // SAFETY: each call gets live objects opened just before and a fresh out-pointer;
        // attribute structs live across the call.
        unsafe {
            check(
                lib,
                "fi_fabric",
                lib.fabric((*self.info).fabric_attr, &raw mut self.fabric, null_mut()),
            )?;
            check(
                lib,
                "fi_domain",
                fi::fi_domain(self.fabric, self.info, &raw mut self.domain, null_mut()),
            )?;
            let mut cq_attr = fi::fi_cq_attr {
                size: cq_size,
                format: fi::FI_CQ_FORMAT_DATA,
                wait_obj: fi::FI_WAIT_NONE,
                ..Default::default()
            };
            check(
                lib,
                "fi_cq_open",
                fi::fi_cq_open(self.domain, &raw mut cq_attr, &raw mut self.cq, null_mut()),
            )?;
            let av_type = match (*(*self.info).domain_attr).av_type {
                fi::FI_AV_UNSPEC => fi::FI_AV_TABLE,
                t => t,
            };
            let mut av_attr = fi::fi_av_attr {
                type_: av_type,
                count: 64,
                ..Default::default()
            };
            check(
                lib,
                "fi_av_open",
                fi::fi_av_open(self.domain, &raw mut av_attr, &raw mut self.av, null_mut()),
            )?;
        }
        self.ep = self.open_endpoint()?;
        Ok(())
    }

    /// Opens and enables an endpoint bound to this NIC's CQ (both directions) and AV.
    fn open_endpoint(&mut self) -> Result<*mut fi::fid_ep, TransportError> {
        let lib = self.lib;
        let mut ep: *mut fi::fid_ep = null_mut();
        // SAFETY: domain, CQ and AV are live; `ep` is a fresh out-pointer; a failure after it
        // was opened closes it before returning.
        unsafe {
            check(
                lib,
                "fi_endpoint",
                fi::fi_endpoint(self.domain, self.info, &raw mut ep, null_mut()),
            )?;
            let bound = check(
                lib,
                "fi_ep_bind (cq)",
                fi::fi_ep_bind(ep, &raw mut (*self.cq).fid, fi::FI_TRANSMIT | fi::FI_RECV),
            )
            .and_then(|()| {
                check(
                    lib,
                    "fi_ep_bind (av)",
                    fi::fi_ep_bind(ep, &raw mut (*self.av).fid, 0),
                )
            })
            .and_then(|()| check(lib, "fi_enable", fi::fi_enable(ep)));
            if let Err(e) = bound {
                fi::fi_close(ep.cast());
                return Err(e);
            }
        }
        Ok(ep)
    }

    /// The endpoint `peer`'s operations are posted on.
    fn tx_ep(&self, peer: PeerId) -> *mut fi::fid_ep {
        self.peers
            .get(peer as usize)
            .map(|p| p.ep)
            .filter(|ep| !ep.is_null())
            .unwrap_or(self.ep)
    }

    /// The name of `ep`, one of this NIC's enabled endpoints.
    fn endpoint_name(&self, ep: *mut fi::fid_ep) -> Result<Vec<u8>, TransportError> {
        let mut buf = vec![0u8; MAX_ADDR_LEN];
        let mut len = buf.len();
        // SAFETY: the endpoint is enabled; `buf` has `len` bytes.
        let rc = unsafe { fi::fi_getname(ep.cast(), buf.as_mut_ptr().cast(), &raw mut len) };
        check(self.lib, "fi_getname", rc)?;
        buf.truncate(len);
        Ok(buf)
    }

    fn bounce_buffers(&mut self, count: usize, slot_len: usize) -> Result<Bounce, TransportError> {
        let memory = vec![0u8; count * slot_len].into_boxed_slice();
        // SAFETY: the memory is owned by the Bounce, which is dropped only after Drop closed
        // its registration.
        // Sources of sends only.
        let reg = unsafe {
            self.register(
                memory.as_ptr() as u64,
                memory.len() as u64,
                Device::Host,
                Access::Local,
            )
        }?;
        Ok(Bounce {
            memory,
            slot_len,
            lkey: reg.lkey,
            free: (0..count as u32).rev().collect(),
        })
    }

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

    /// [`Domain::disconnect`]: fails what `peer` holds, closes its transmit endpoint, removes
    /// it from the address vector (which unmaps an `shm` peer's region) and frees its id.
    pub(super) fn release_peer(&mut self, peer: PeerId) -> Result<(), TransportError> {
        self.peer_addr(peer)?;
        for ctx in self.contexts.abandon_peer(peer) {
            self.released_ops.push(Completion {
                wr_id: ctx.wr_id,
                count: 1,
                kind: completion_kind(ctx.kind, 0, None),
                result: Err(TransferError::PeerUnreachable),
            });
        }
        let p = &mut self.peers[peer as usize];
        p.released = true;
        let posted = p.posted;
        let pid = p.pid.take();
        let bytes = p.bytes.clone();
        self.by_fi_addr.remove(&p.fi_addr);
        for s in &p.senders {
            self.by_fi_addr.remove(&s.fi_addr);
        }
        self.retired_senders.append(&mut p.senders);
        self.peer_ids.remove(&p.bytes);
        let (ep, mut fi_addr) = (std::mem::replace(&mut p.ep, null_mut()), p.fi_addr);
        self.free_peers.push(peer);
        if let Some(pid) = pid.filter(|&pid| posted && !ep.is_null() && process_exists(pid)) {
            let of_pid = |l: &&Lingering| l.pid == pid;
            if self.lingering.iter().filter(of_pid).count() >= MAX_LINGERING_PER_PROCESS
                && let Some(oldest) = (0..self.lingering.len())
                    .filter(|&i| self.lingering[i].pid == pid)
                    .min_by_key(|&i| self.lingering[i].released)
            {
                self.close_lingering_at(oldest);
            }
            self.lingering.push(Lingering {
                ep,
                bytes,
                pid,
                fi_addr,
                gone_since: None,
                released: Instant::now(),
            });
            return self.reap_senders();
        }
        if !ep.is_null() {
            // SAFETY: the peer's own endpoint, live, closed once (the field is now null); its
            // operations were abandoned above, so no context of it is waited on.
            let rc = unsafe { fi::fi_close(ep.cast()) };
            check(self.lib, "fi_close (peer endpoint)", rc)?;
        }
        // SAFETY: the AV is live and `fi_addr` is one of its entries, removed once.
        let rc = unsafe { fi::fi_av_remove(self.av, &raw mut fi_addr, 1, 0) };
        check(self.lib, "fi_av_remove", rc)?;
        self.reap_senders()
    }

    /// [`Domain::adopt_sender`]: over `shm`, inserts `sender` (an endpoint of `peer`'s own
    /// process, checked like any peer address) into the address vector, which finds the entry
    /// `shm` made when that endpoint first sent here, so that it can be removed later.
    pub(super) fn adopt(
        &mut self,
        peer: PeerId,
        sender: &DomainAddr,
    ) -> Result<(), TransportError> {
        let p = self
            .peers
            .get(peer as usize)
            .filter(|p| !p.released)
            .ok_or_else(|| TransportError::Domain(format!("unknown or released peer id {peer}")))?;
        if self.provider != "fabric:shm" || p.bytes == sender.bytes {
            return Ok(());
        }
        if sender.provider != self.provider {
            return Err(TransportError::ProviderMismatch {
                local: self.provider.clone(),
                remote: sender.provider.clone(),
            });
        }
        if p.senders.iter().any(|s| s.bytes == sender.bytes) {
            return Ok(());
        }
        if p.senders.len() >= MAX_SENDERS {
            return Err(TransportError::MalformedAddress(format!(
                "a peer names at most {MAX_SENDERS} sending endpoints"
            )));
        }
        if !same_shm_process(&p.bytes, &sender.bytes) {
            return Err(TransportError::MalformedAddress(
                "a sending endpoint of another process than the peer's".to_owned(),
            ));
        }
        if self.peer_ids.contains_key(&sender.bytes) {
            return Err(TransportError::MalformedAddress(
                "a sending endpoint that is a peer of its own".to_owned(),
            ));
        }
        // A sender retired with an earlier session of the same process, still open: its entry
        // is still in the address vector (inserting it again would count it twice).
        let adopted = match self
            .retired_senders
            .iter()
            .position(|s| s.bytes == sender.bytes)
        {
            Some(i) => Sender {
                silent_since: None,
                ..self.retired_senders.swap_remove(i)
            },
            None => {
                check_shm_peer(&sender.bytes).map_err(TransportError::MalformedAddress)?;
                Sender {
                    bytes: sender.bytes.clone(),
                    fi_addr: self.insert(&sender.bytes)?,
                    silent_since: None,
                }
            }
        };
        self.by_fi_addr.insert(adopted.fi_addr, peer);
        self.peers[peer as usize].senders.push(adopted);
        Ok(())
    }

    /// A lingering endpoint of the peer at `bytes`, taken out of the list for it to use again.
    pub(super) fn take_lingering(
        &mut self,
        bytes: &[u8],
    ) -> Option<(fi::fi_addr_t, *mut fi::fid_ep)> {
        let at = self.lingering.iter().position(|l| l.bytes == bytes)?;
        let l = self.lingering.swap_remove(at);
        Some((l.fi_addr, l.ep))
    }

    /// Closes the lingering endpoints whose peer's process has exited, and those whose peer's
    /// region has been gone for [`SENDER_GRACE`] (its engine was dropped, its process lives
    /// on: one process's engines coming and going must not each keep an endpoint, 16 MiB of
    /// `shm` region, until the process exits).
    fn close_lingering(&mut self) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.lingering.len() {
            let l = &mut self.lingering[i];
            if process_exists(l.pid) {
                if shm_sender_may_send(&l.bytes) {
                    l.gone_since = None;
                    i += 1;
                    continue;
                }
                if now.duration_since(*l.gone_since.get_or_insert(now)) < SENDER_GRACE {
                    i += 1;
                    continue;
                }
            }
            self.close_lingering_at(i);
        }
    }

    /// Closes lingering endpoint `i` and removes its peer's address entry.
    fn close_lingering_at(&mut self, i: usize) {
        let Lingering {
            ep, mut fi_addr, ..
        } = self.lingering.swap_remove(i);
        // SAFETY: an endpoint `release_peer` kept open, closed once (removed from the list),
        // its operations abandoned then; then the peer's entry, which it kept too.
        let closed = check(self.lib, "fi_close (lingering endpoint)", unsafe {
            fi::fi_close(ep.cast())
        })
        .and_then(|()| {
            check(self.lib, "fi_av_remove (lingering peer)", unsafe {
                fi::fi_av_remove(self.av, &raw mut fi_addr, 1, 0)
            })
        });
        if let Err(e) = closed {
            tracing::warn!(%e, "closing a released peer's endpoint");
        }
    }

    /// Removes the retired senders that can no longer send: their region is gone (the
    /// endpoint closed) or their process has exited.
    fn reap_senders(&mut self) -> Result<(), TransportError> {
        let mut first_error = Ok(());
        let mut i = 0;
        let now = Instant::now();
        while i < self.retired_senders.len() {
            let s = &mut self.retired_senders[i];
            if shm_sender_may_send(&s.bytes) {
                s.silent_since = None;
                i += 1;
                continue;
            }
            if now.duration_since(*s.silent_since.get_or_insert(now)) < SENDER_GRACE {
                i += 1;
                continue;
            }
            let mut gone = self.retired_senders.swap_remove(i);
            // SAFETY: the AV is live and the entry is one `adopt` inserted, removed once.
            let rc = unsafe { fi::fi_av_remove(self.av, &raw mut gone.fi_addr, 1, 0) };
            if let Err(e) = check(self.lib, "fi_av_remove (sender)", rc) {
                first_error = first_error.and(Err(e));
            }
        }
        first_error
    }

    /// Inserts an address (already checked for length) into the AV.
    fn insert(&mut self, bytes: &[u8]) -> Result<fi::fi_addr_t, TransportError> {
        let mut fi_addr: fi::fi_addr_t = fi::FI_ADDR_NOTAVAIL;
        // SAFETY: the AV is live; the address has the length of this provider's addresses;
        // one output slot for one address.
        let rc = unsafe {
            fi::fi_av_insert(
                self.av,
                bytes.as_ptr().cast(),
                1,
                &raw mut fi_addr,
                0,
                null_mut(),
            )
        };
        if rc != 1 || fi_addr == fi::FI_ADDR_NOTAVAIL {
            return Err(TransportError::MalformedAddress(format!(
                "{} refused the address ({})",
                self.provider,
                if rc < 0 {
                    self.lib.strerror(rc)
                } else {
                    "not inserted".to_owned()
                }
            )));
        }
        Ok(fi_addr)
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

    /// Turns one CQ error entry into a completion of its operation.
    fn error_completion(&mut self, out: &mut Vec<Completion>) -> bool {
        let mut err = fi::fi_cq_err_entry::default();
        // SAFETY: the CQ is live; `err` asks for no provider-specific error data buffer.
        let rc = unsafe { fi::fi_cq_readerr(self.cq, &raw mut err, 0) };
        if rc < 0 {
            return false;
        }
        // SAFETY: the entry's err_data is the provider's, valid until the next CQ read.
        let detail = unsafe { fi::fi_cq_strerror(self.cq, err.prov_errno, err.err_data) }
            .unwrap_or_default();
        let error = transfer_error(err.err, &self.lib.strerror(err.err), &detail);
        match self.contexts.release(err.op_context) {
            Released::Live(ctx) => {
                if let Some(b) = ctx.bounce {
                    self.give_back_bounce(b);
                }
                tracing::debug!(%error, wr_id = ctx.wr_id, peer = ctx.peer, "operation failed");
                out.push(Completion {
                    wr_id: ctx.wr_id,
                    count: 1,
                    kind: completion_kind(ctx.kind, err.len, None),
                    result: Err(error),
                });
            }
            Released::Abandoned { bounce } => {
                if let Some(b) = bounce {
                    self.give_back_bounce(b);
                }
            }
            Released::Unknown => {
                tracing::warn!(%error, flags = err.flags, "a completion error for no posted operation (target side)");
            }
        }
        true
    }

    /// Fails the writes and sends the provider has not completed within the deadline.
    fn sweep(&mut self, out: &mut Vec<Completion>) {
        self.polls_since_sweep += 1;
        if self.polls_since_sweep < SWEEP_EVERY {
            return;
        }
        self.polls_since_sweep = 0;
        let now = Instant::now();
        if now < self.next_sweep {
            return;
        }
        self.next_sweep = now + (self.op_timeout / 4).min(Duration::from_millis(100));
        // An shm peer whose process has exited will never answer: fail what it holds now
        // rather than at the deadline.
        for id in 0..self.peers.len() {
            let p = &mut self.peers[id];
            let Some(pid) = p.pid.filter(|_| !p.released) else {
                continue;
            };
            match p.process {
                Process::Settled => continue,
                Process::Alive(_) if process_exists(pid) => continue,
                Process::Alive(_) | Process::Exited => p.process = Process::Settled,
            }
            for ctx in self.contexts.abandon_peer(id as PeerId) {
                out.push(Completion {
                    wr_id: ctx.wr_id,
                    count: 1,
                    kind: completion_kind(ctx.kind, 0, None),
                    result: Err(TransferError::PeerUnreachable),
                });
            }
            tracing::warn!(
                peer = id,
                pid,
                "an shm peer's process has exited; failed its operations"
            );
        }
        if !self.retired_senders.is_empty()
            && let Err(e) = self.reap_senders()
        {
            tracing::warn!(%e, "releasing a departed peer's sending endpoint");
        }
        self.close_lingering();
        for ctx in self.contexts.expire(now, self.op_timeout) {
            tracing::warn!(wr_id = ctx.wr_id, peer = ctx.peer, timeout = ?self.op_timeout, "an operation was not completed in time; failing it");
            out.push(Completion {
                wr_id: ctx.wr_id,
                count: 1,
                kind: completion_kind(ctx.kind, 0, None),
                result: Err(TransferError::TimedOut(self.op_timeout)),
            });
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

/// The kind of completion an operation of `kind` reports (`from`: a receive's sender).
fn completion_kind(kind: OpKind, len: usize, from: Option<PeerId>) -> CompletionKind {
    match kind {
        OpKind::Write => CompletionKind::Write,
        OpKind::Send => CompletionKind::Send,
        OpKind::Recv => CompletionKind::Recv {
            len: len as u64,
            from,
        },
    }
}

/// Maps a CQ error (positive errno) to what the transfer reports.
fn transfer_error(errno: i32, text: &str, provider_detail: &str) -> TransferError {
    let message = if provider_detail.is_empty() || provider_detail == text {
        text.to_owned()
    } else {
        format!("{text} ({provider_detail})")
    };
    match errno {
        e if e == fi::FI_ECONNREFUSED
            || e == fi::FI_ECONNRESET
            || e == fi::FI_ECONNABORTED
            || e == fi::FI_EHOSTUNREACH
            || e == fi::FI_ENETUNREACH
            || e == fi::FI_EHOSTDOWN
            || e == fi::FI_ENOTCONN
            || e == fi::FI_ESHUTDOWN
            || e == fi::FI_ETIMEDOUT
            || e == fi::FI_ENETDOWN =>
        {
            tracing::debug!(%message, "peer unreachable");
            TransferError::PeerUnreachable
        }
        e if e == fi::FI_EACCES || e == fi::FI_EKEYREJECTED || e == fi::FI_EFAULT => {
            TransferError::RemoteAccess(message)
        }
        _ => TransferError::Provider(message),
    }
}

mod ops;
mod shm;
mod ticks;

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
