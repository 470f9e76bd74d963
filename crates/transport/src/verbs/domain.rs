//! [`VerbsDomain`]: the engine's [`Domain`] over any [`Verbs`] device.
//!
//! - **Address**: the port's GID and LID, the UD queue pair the handshake uses, its queue key,
//!   and a random nonce (a restarted process is a new address).
//! - **Connect** (paper 002 section 3.5): two RC queue pairs per peer, one for SEND/RECV and
//!   one for WRITE / WRITE_WITH_IMM, brought RESET -> INIT; a handshake request carrying their
//!   numbers and the first PSN goes to the peer's UD queue pair and is sent again every
//!   `handshake_retry` until answered. The peer creates its pair (or uses the one it is itself
//!   connecting with, so simultaneous connects meet), moves both to RTR and RTS with the
//!   numbers it got, and answers; the answer does the same here. Work posted meanwhile waits
//!   in the peer's queue and is posted, in order, once the pair is ready; after
//!   `connect_timeout` unanswered it fails with [`TransferError::PeerUnreachable`].
//! - **Writes**: consecutive writes to one peer are chained `max_chain` (4) at a time and
//!   rung with one doorbell; every one is signaled (the engine counts each).
//! - **Receives**: the engine's buffers go to one shared receive queue that every send queue
//!   pair receives through; a second shared receive queue keeps `imm_recvs` empty receives
//!   posted for the write queue pairs, which each write with immediate consumes, and is
//!   refilled as they complete.
//! - **Completions** map to the engine's: a write or send by its work request id; a receive
//!   with immediate to an arrival; a receive to a message with the peer its queue pair
//!   belongs to. Errors: remote access -> [`TransferError::RemoteAccess`], retry exceeded or
//!   flushed -> [`TransferError::PeerUnreachable`], too long for the buffer ->
//!   [`TransferError::RemoteBufferTooSmall`], others -> [`TransferError::Provider`].

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

mod connect;
mod handshake;
mod poll;
mod post;

use handshake::{HS_RECVS, HS_REQUEST, HS_SENDS, HS_SLOT};
pub use handshake::{Handshake, VerbsAddr};

use super::{MrAccess, PROVIDER, QpKind, QpState, RecvWr as VRecvWr, Sge, Verbs, VerbsConfig};
use crate::addr::DomainAddr;
use crate::domain::{Completion, Domain, Notify, PeerId, RecvWr, Registration, SendWr, WriteWr};
use crate::error::{TransferError, TransportError};
use crate::mr::{Access, Device};

/// Work request ids of the domain's own receives are tagged so they never meet the engine's.
const IMM_TAG: u64 = 1 << 63;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PeerState {
    Connecting { since: Instant, last_sent: Instant },
    Ready,
}

#[derive(Debug, Clone, Copy)]
enum Queued {
    Write(WriteWr),
    Send(SendWr),
}

#[derive(Debug)]
struct Peer {
    addr: VerbsAddr,
    state: PeerState,
    send_qpn: u32,
    write_qpn: u32,
    psn: u32,
    /// The remote pair this one is connected to (send, write), once ready.
    remote: Option<(u32, u32)>,
    queued: VecDeque<Queued>,
    /// Requests posted and not yet completed, per queue pair (send, write).
    outstanding: [u32; 2],
}

/// A registered buffer a message is copied into before it is sent.
#[derive(Debug)]
struct Staging {
    buf: Box<[u8]>,
    lkey: u32,
    busy: bool,
}

/// The engine's domain over a verbs device `V`.
pub struct VerbsDomain<V: Verbs> {
    verbs: V,
    /// Device memory this domain registers through dma-bufs, if any.
    dmabuf: Option<Box<dyn super::DmaBufExporter>>,
    config: VerbsConfig,
    me: VerbsAddr,
    ud_qpn: u32,
    /// Handshake buffers: `HS_RECVS` receive slots, then `HS_SENDS` send slots.
    hs: Box<[u8]>,
    hs_lkey: u32,
    next_hs_send: usize,
    send_srq: u32,
    imm_srq: u32,
    imm_lkey: u32,
    imm_buf: Box<[u8; 8]>,
    peers: Vec<Option<Peer>>,
    by_addr: HashMap<VerbsAddr, PeerId>,
    by_qpn: crate::FastMap<u32, PeerId>,
    /// Completions the domain made itself (work that failed before reaching the NIC).
    failed: VecDeque<Completion>,
    /// Registered copies of messages in flight (sends' payloads are engine memory the
    /// engine does not register).
    staging: Vec<Staging>,
    /// Which staging slot a send in flight holds.
    staged: crate::FastMap<u64, usize>,
    wcs: Vec<super::Wc>,
}

impl<V: Verbs> std::fmt::Debug for VerbsDomain<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsDomain")
            .field("addr", &self.me)
            .field("peers", &self.by_addr.len())
            .finish_non_exhaustive()
    }
}

fn verbs_err(e: super::VerbsError) -> TransportError {
    e.into()
}

impl<V: Verbs> VerbsDomain<V> {
    /// Opens the domain on `verbs`: the UD queue pair and its receives, the two shared
    /// receive queues and the immediates' receives.
    pub fn new(mut verbs: V, config: VerbsConfig) -> Result<Self, TransportError> {
        config.validate()?;
        let port = verbs.port_addr();
        let mut hs = vec![0u8; (HS_RECVS + HS_SENDS) * HS_SLOT].into_boxed_slice();
        let no_remote = MrAccess {
            remote_write: false,
            relaxed_ordering: false,
        };
        // SAFETY: the buffers are owned by the domain, boxed (they never move) and
        // deregistered in `Drop` before they are freed.
        let (hs_lkey, _) =
            unsafe { verbs.reg_mr(hs.as_mut_ptr() as u64, hs.len() as u64, no_remote) }
                .map_err(verbs_err)?;
        let mut imm_buf = Box::new([0u8; 8]);
        // SAFETY: as above.
        let (imm_lkey, _) = unsafe { verbs.reg_mr(imm_buf.as_mut_ptr() as u64, 8, no_remote) }
            .map_err(verbs_err)?;
        let send_srq = verbs
            .create_srq(config.imm_recvs.max(1024))
            .map_err(verbs_err)?;
        let imm_srq = verbs.create_srq(config.imm_recvs).map_err(verbs_err)?;
        let ud_qpn = verbs
            .create_qp(QpKind::Ud, None, HS_SENDS as u32)
            .map_err(verbs_err)?;
        let mut attr = Self::base_attr(&config, QpState::Init);
        attr.qkey = config.qkey;
        verbs.modify_qp(ud_qpn, &attr).map_err(verbs_err)?;
        let recvs: Vec<VRecvWr> = (0..HS_RECVS)
            .map(|i| VRecvWr {
                wr_id: i as u64,
                sge: Sge {
                    addr: hs.as_ptr() as u64 + (i * HS_SLOT) as u64,
                    len: HS_SLOT as u32,
                    lkey: hs_lkey,
                },
            })
            .collect();
        // SAFETY: the slots are registered and owned by the domain until it drops.
        unsafe { verbs.post_recv(ud_qpn, &recvs) }.map_err(verbs_err)?;
        for state in [QpState::Rtr, QpState::Rts] {
            verbs
                .modify_qp(ud_qpn, &Self::base_attr(&config, state))
                .map_err(verbs_err)?;
        }
        let imm_recvs: Vec<VRecvWr> = (0..config.imm_recvs)
            .map(|i| VRecvWr {
                wr_id: IMM_TAG | u64::from(i),
                sge: Sge {
                    addr: imm_buf.as_ptr() as u64,
                    len: 0,
                    lkey: imm_lkey,
                },
            })
            .collect();
        // SAFETY: zero-length receives (immediates carry no bytes into them).
        unsafe { verbs.post_srq_recv(imm_srq, &imm_recvs) }.map_err(verbs_err)?;
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ (u64::from(std::process::id()) << 40)
            ^ u64::from(ud_qpn);
        Ok(Self {
            dmabuf: None,
            me: VerbsAddr {
                port,
                ud_qpn,
                qkey: config.qkey,
                nonce,
            },
            verbs,
            config,
            ud_qpn,
            hs,
            hs_lkey,
            next_hs_send: 0,
            send_srq,
            imm_srq,
            imm_lkey,
            imm_buf,
            peers: Vec::new(),
            by_addr: HashMap::new(),
            by_qpn: crate::FastMap::default(),
            failed: VecDeque::new(),
            staging: Vec::new(),
            staged: crate::FastMap::default(),
            wcs: Vec::new(),
        })
    }

    /// The same, registering the memory of `exporter`'s device through dma-bufs (a NIC
    /// serving a GPU's domain group).
    pub fn with_dmabuf(
        verbs: V,
        config: VerbsConfig,
        exporter: Box<dyn super::DmaBufExporter>,
    ) -> Result<Self, TransportError> {
        let mut domain = Self::new(verbs, config)?;
        domain.dmabuf = Some(exporter);
        Ok(domain)
    }

    /// The device underneath (tests inspect its queue pairs and doorbells).
    pub fn verbs(&self) -> &V {
        &self.verbs
    }

    /// The send and write queue pairs of `peer`, once connected.
    pub fn queue_pairs(&self, peer: PeerId) -> Option<(u32, u32)> {
        let p = self.peers.get(peer as usize)?.as_ref()?;
        Some((p.send_qpn, p.write_qpn))
    }

    fn peer_mut(&mut self, peer: PeerId) -> Result<&mut Peer, TransportError> {
        self.peers
            .get_mut(peer as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| TransportError::Domain(format!("verbs: unknown peer {peer}")))
    }
}

impl<V: Verbs> Drop for VerbsDomain<V> {
    fn drop(&mut self) {
        let qps: Vec<u32> = self.by_qpn.keys().copied().chain([self.ud_qpn]).collect();
        for qpn in qps {
            let _ = self.verbs.destroy_qp(qpn);
        }
        for s in &self.staging {
            let _ = self.verbs.dereg_mr(s.lkey);
        }
        let _ = self.verbs.dereg_mr(self.hs_lkey);
        let _ = self.verbs.dereg_mr(self.imm_lkey);
    }
}

impl<V: Verbs> Domain for VerbsDomain<V> {
    fn provider(&self) -> &str {
        PROVIDER
    }

    fn address(&self) -> DomainAddr {
        DomainAddr {
            provider: PROVIDER.to_owned(),
            bytes: self.me.encode(),
        }
    }

    fn supports(&self, device: Device) -> bool {
        device == Device::Host || self.dmabuf.as_ref().is_some_and(|e| e.device() == device)
    }

    unsafe fn register(
        &mut self,
        addr: u64,
        len: u64,
        device: Device,
        access: Access,
    ) -> Result<Registration, TransportError> {
        let access = MrAccess {
            remote_write: access == Access::RemoteWrite,
            relaxed_ordering: self.config.relaxed_ordering,
        };
        if device != Device::Host {
            let exporter = self
                .dmabuf
                .as_ref()
                .filter(|e| e.device() == device)
                .ok_or_else(|| TransportError::UnsupportedDevice(device.to_string()))?;
            let (fd, offset) = exporter.export(addr, len)?;
            // SAFETY: the caller's contract (the memory stays allocated until deregistered),
            // which the dma-buf's pages inherit.
            let keys = unsafe { self.verbs.reg_dmabuf_mr(fd, offset, len, addr, access) };
            // The registration holds its own reference to the buffer.
            exporter.release(fd);
            let (lkey, rkey) = keys.map_err(verbs_err)?;
            return Ok(Registration {
                lkey: u64::from(lkey),
                rkey: u64::from(rkey),
                remote_addr: addr,
            });
        }
        // SAFETY: the caller's contract (valid until deregistered), forwarded.
        let (lkey, rkey) = unsafe { self.verbs.reg_mr(addr, len, access) }.map_err(verbs_err)?;
        Ok(Registration {
            lkey: u64::from(lkey),
            rkey: u64::from(rkey),
            remote_addr: addr,
        })
    }

    fn deregister(&mut self, lkey: u64) -> Result<(), TransportError> {
        let lkey = u32::try_from(lkey)
            .map_err(|_| TransportError::Domain(format!("verbs: no region with key {lkey}")))?;
        self.verbs.dereg_mr(lkey).map_err(verbs_err)
    }

    fn connect(&mut self, peer: &DomainAddr) -> Result<PeerId, TransportError> {
        if peer.provider != PROVIDER {
            return Err(TransportError::ProviderMismatch {
                local: PROVIDER.to_owned(),
                remote: peer.provider.clone(),
            });
        }
        let addr = VerbsAddr::decode(&peer.bytes)?;
        if let Some(&id) = self.by_addr.get(&addr) {
            return Ok(id);
        }
        let id = self.create_pair(addr)?;
        self.send_handshake(id, HS_REQUEST)?;
        Ok(id)
    }

    fn disconnect(&mut self, peer: PeerId) -> Result<(), TransportError> {
        self.peer_mut(peer)?;
        self.fail_queued(peer, &TransferError::PeerUnreachable);
        let Some(p) = self.peers[peer as usize].take() else {
            return Ok(());
        };
        self.by_addr.remove(&p.addr);
        self.destroy_pair([p.send_qpn, p.write_qpn])
    }

    fn post_writes(&mut self, wrs: &[WriteWr]) -> Result<usize, TransportError> {
        let mut done = 0;
        while done < wrs.len() {
            let peer = wrs[done].peer;
            let run = wrs[done..]
                .iter()
                .take_while(|w| w.peer == peer)
                .take(self.config.max_chain)
                .count();
            let depth = self.config.sq_depth as usize;
            let p = self.peer_mut(peer)?;
            if p.state != PeerState::Ready || !p.queued.is_empty() {
                if p.queued.len() + run > depth {
                    return Ok(done);
                }
                p.queued
                    .extend(wrs[done..done + run].iter().map(|w| Queued::Write(*w)));
                done += run;
                continue;
            }
            let posted = self.post_chain(peer, &wrs[done..done + run])?;
            done += posted;
            if posted < run {
                return Ok(done);
            }
        }
        Ok(done)
    }

    unsafe fn post_send(&mut self, wr: &SendWr) -> Result<bool, TransportError> {
        let depth = self.config.sq_depth as usize;
        let p = self.peer_mut(wr.peer)?;
        if p.state != PeerState::Ready || !p.queued.is_empty() {
            if p.queued.len() >= depth {
                return Ok(false);
            }
            p.queued.push_back(Queued::Send(*wr));
            return Ok(true);
        }
        self.post_one_send(wr.peer, wr)
    }

    unsafe fn post_recv(&mut self, wr: &RecvWr) -> Result<bool, TransportError> {
        let (Ok(len), Ok(lkey)) = (u32::try_from(wr.len), u32::try_from(wr.lkey)) else {
            return Err(TransportError::InvalidArgument(
                "a verbs receive's length and key fit in 32 bits",
            ));
        };
        let v = VRecvWr {
            wr_id: wr.wr_id,
            sge: Sge {
                addr: wr.addr,
                len,
                lkey,
            },
        };
        // SAFETY: the caller's contract (the buffer stays valid and untouched until its
        // completion is polled), forwarded.
        match unsafe { self.verbs.post_srq_recv(self.send_srq, &[v]) } {
            Ok(()) => Ok(true),
            Err(super::VerbsError::Full(_)) => Ok(false),
            Err(e) => Err(verbs_err(e)),
        }
    }

    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        self.poll_completions(out, max)
    }

    fn set_notify(&mut self, notify: Arc<dyn Notify>) {
        self.verbs.set_notify(notify);
    }

    fn next_deadline(&self) -> Option<Instant> {
        let handshake = self
            .peers
            .iter()
            .flatten()
            .filter_map(|p| match p.state {
                PeerState::Connecting { last_sent, .. } => {
                    Some(last_sent + self.config.handshake_retry)
                }
                PeerState::Ready => None,
            })
            .min();
        [handshake, self.verbs.next_deadline()]
            .into_iter()
            .flatten()
            .min()
    }

    fn may_park(&self) -> bool {
        self.verbs.may_park()
    }
}
