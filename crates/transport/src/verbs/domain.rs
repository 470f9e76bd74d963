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

use super::{
    MrAccess, PROVIDER, PortAddr, QpAttr, QpKind, QpState, RecvWr as VRecvWr, SendOp,
    SendWr as VSendWr, Sge, Verbs, VerbsConfig, WcOpcode, WcStatus,
};
use crate::addr::DomainAddr;
use crate::domain::{
    Completion, CompletionKind, Domain, Notify, PeerId, RecvWr, Registration, SendWr, WriteWr,
};
use crate::error::{TransferError, TransportError};
use crate::mr::{Access, Device};

/// Bytes of an encoded verbs address.
const ADDR_BYTES: usize = 35;
/// Handshake message: magic, kind, the sender's address, its two queue pairs, its PSN.
const HS_BYTES: usize = 4 + 1 + ADDR_BYTES + 12;
const HS_MAGIC: u32 = 0x4b56_5256; // "KVRV"
const HS_REQUEST: u8 = 1;
const HS_ACCEPT: u8 = 2;
/// Handshake receive buffers kept posted on the UD queue pair, and their size (GRH first).
const HS_RECVS: usize = 64;
const HS_SLOT: usize = 128;
/// Handshake send slots (reused round-robin; a UD send completes at once).
const HS_SENDS: usize = 64;
/// Work request ids of the domain's own receives are tagged so they never meet the engine's.
const IMM_TAG: u64 = 1 << 63;

/// A verbs address, decoded: what peers need to reach this domain's handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct VerbsAddr {
    /// The port (GID, LID, number).
    pub port: PortAddr,
    /// The UD queue pair handshakes go to.
    pub ud_qpn: u32,
    /// Its queue key.
    pub qkey: u32,
    /// Random per domain: a restarted process is a new address.
    pub nonce: u64,
}

impl VerbsAddr {
    /// The bytes carried in a [`DomainAddr`].
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(ADDR_BYTES);
        b.extend_from_slice(&self.port.gid);
        b.extend_from_slice(&self.port.lid.to_le_bytes());
        b.push(self.port.port);
        b.extend_from_slice(&self.ud_qpn.to_le_bytes());
        b.extend_from_slice(&self.qkey.to_le_bytes());
        b.extend_from_slice(&self.nonce.to_le_bytes());
        b
    }

    /// Parses a peer's address bytes (untrusted).
    pub fn decode(b: &[u8]) -> Result<Self, TransportError> {
        if b.len() != ADDR_BYTES {
            return Err(TransportError::MalformedAddress(format!(
                "a verbs address is {ADDR_BYTES} bytes, not {}",
                b.len()
            )));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[..16]);
        let mut nonce = [0u8; 8];
        nonce.copy_from_slice(&b[27..35]);
        Ok(Self {
            port: PortAddr {
                gid,
                lid: u16::from_le_bytes([b[16], b[17]]),
                port: b[18],
            },
            ud_qpn: u32_at(19),
            qkey: u32_at(23),
            nonce: u64::from_le_bytes(nonce),
        })
    }
}

/// A handshake message, as it travels between UD queue pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handshake {
    /// Request (1) or accept (2).
    pub kind: u8,
    /// The sender.
    pub from: VerbsAddr,
    /// The sender's SEND/RECV queue pair for this peer.
    pub send_qpn: u32,
    /// The sender's WRITE queue pair for this peer.
    pub write_qpn: u32,
    /// The first PSN the sender sends with.
    pub psn: u32,
}

impl Handshake {
    /// Bytes of an encoded message.
    pub const BYTES: usize = HS_BYTES;

    /// Writes the message into `out` (at least [`Handshake::BYTES`] long).
    pub fn encode(&self, out: &mut [u8]) {
        out[..4].copy_from_slice(&HS_MAGIC.to_le_bytes());
        out[4] = self.kind;
        out[5..5 + ADDR_BYTES].copy_from_slice(&self.from.encode());
        let rest = 5 + ADDR_BYTES;
        out[rest..rest + 4].copy_from_slice(&self.send_qpn.to_le_bytes());
        out[rest + 4..rest + 8].copy_from_slice(&self.write_qpn.to_le_bytes());
        out[rest + 8..rest + 12].copy_from_slice(&self.psn.to_le_bytes());
    }

    /// Parses what a UD receive delivered (anyone can send to a UD queue pair: untrusted).
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < HS_BYTES || b[..4] != HS_MAGIC.to_le_bytes() {
            return None;
        }
        let kind = b[4];
        if kind != HS_REQUEST && kind != HS_ACCEPT {
            return None;
        }
        let from = VerbsAddr::decode(&b[5..5 + ADDR_BYTES]).ok()?;
        let rest = 5 + ADDR_BYTES;
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Some(Self {
            kind,
            from,
            send_qpn: u32_at(rest),
            write_qpn: u32_at(rest + 4),
            psn: u32_at(rest + 8),
        })
    }
}

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

    fn base_attr(config: &VerbsConfig, state: QpState) -> QpAttr {
        QpAttr {
            state,
            port: config.port,
            remote_write: false,
            qkey: config.qkey,
            dest: None,
            dest_qp_num: 0,
            rq_psn: 0,
            sq_psn: 0,
            mtu: config.mtu,
            sgid_index: config.gid_index,
            traffic_class: config.traffic_class,
            timeout: config.timeout,
            retry_cnt: config.retry_cnt,
            rnr_retry: config.rnr_retry,
            min_rnr_timer: config.min_rnr_timer,
        }
    }

    /// A send and a write queue pair in INIT.
    fn new_qps(&mut self) -> Result<(u32, u32), TransportError> {
        let send_qpn = self
            .verbs
            .create_qp(QpKind::Rc, Some(self.send_srq), self.config.sq_depth)
            .map_err(verbs_err)?;
        let write_qpn = self
            .verbs
            .create_qp(QpKind::Rc, Some(self.imm_srq), self.config.sq_depth)
            .map_err(verbs_err)?;
        for (qpn, remote_write) in [(send_qpn, false), (write_qpn, true)] {
            let mut attr = Self::base_attr(&self.config, QpState::Init);
            attr.remote_write = remote_write;
            self.verbs.modify_qp(qpn, &attr).map_err(verbs_err)?;
        }
        Ok((send_qpn, write_qpn))
    }

    /// Replaces a peer's pair (after an error on it, or when the peer made a new one): the
    /// old pair is flushed (what was in flight on it completes as unreachable) and
    /// destroyed, a new one is made and the handshake starts again; queued work waits.
    fn repair(&mut self, peer: PeerId) -> Result<(u32, u32), TransportError> {
        let Some(p) = self.peers.get(peer as usize).and_then(Option::as_ref) else {
            return Err(TransportError::Domain(format!("verbs: no peer {peer}")));
        };
        let old = [p.send_qpn, p.write_qpn];
        // A pair that failed may refuse to be destroyed; it is forgotten either way.
        let _ = self.destroy_pair(old);
        let (send_qpn, write_qpn) = self.new_qps()?;
        self.by_qpn.insert(send_qpn, peer);
        self.by_qpn.insert(write_qpn, peer);
        let now = Instant::now();
        if let Some(p) = self.peers.get_mut(peer as usize).and_then(Option::as_mut) {
            p.send_qpn = send_qpn;
            p.write_qpn = write_qpn;
            p.psn = (p.psn + 0x1000) & 0x00ff_ffff;
            p.remote = None;
            p.outstanding = [0; 2];
            p.state = PeerState::Connecting {
                since: now,
                last_sent: now,
            };
        }
        Ok((send_qpn, write_qpn))
    }

    /// Forgets and destroys a pair. What was in flight on it is flushed by the error state
    /// first and reported by `poll` as unreachable (its queue pairs are no longer a peer's).
    fn destroy_pair(&mut self, qpns: [u32; 2]) -> Result<(), TransportError> {
        let mut result = Ok(());
        for qpn in qpns {
            self.by_qpn.remove(&qpn);
            let _ = self
                .verbs
                .modify_qp(qpn, &Self::base_attr(&self.config, QpState::Error));
            if let Err(e) = self.verbs.destroy_qp(qpn) {
                result = Err(verbs_err(e));
            }
        }
        result
    }

    /// Creates a peer's two queue pairs in INIT.
    fn create_pair(&mut self, addr: VerbsAddr) -> Result<PeerId, TransportError> {
        let (send_qpn, write_qpn) = self.new_qps()?;
        let now = Instant::now();
        let psn = (addr.nonce ^ self.me.nonce) as u32 & 0x00ff_ffff;
        let peer = Peer {
            addr,
            state: PeerState::Connecting {
                since: now,
                last_sent: now,
            },
            send_qpn,
            write_qpn,
            psn,
            remote: None,
            queued: VecDeque::new(),
            outstanding: [0; 2],
        };
        let id = match self.peers.iter().position(Option::is_none) {
            Some(free) => {
                self.peers[free] = Some(peer);
                free as PeerId
            }
            None => {
                self.peers.push(Some(peer));
                (self.peers.len() - 1) as PeerId
            }
        };
        self.by_addr.insert(addr, id);
        self.by_qpn.insert(send_qpn, id);
        self.by_qpn.insert(write_qpn, id);
        Ok(id)
    }

    fn send_handshake(&mut self, peer: PeerId, kind: u8) -> Result<(), TransportError> {
        let Some(p) = self.peers.get(peer as usize).and_then(Option::as_ref) else {
            return Ok(());
        };
        let msg = Handshake {
            kind,
            from: self.me,
            send_qpn: p.send_qpn,
            write_qpn: p.write_qpn,
            psn: p.psn,
        };
        let dest = p.addr;
        let slot = HS_RECVS + self.next_hs_send;
        self.next_hs_send = (self.next_hs_send + 1) % HS_SENDS;
        let range = slot * HS_SLOT..slot * HS_SLOT + HS_BYTES;
        msg.encode(&mut self.hs[range.clone()]);
        let wr = VSendWr {
            wr_id: IMM_TAG | slot as u64,
            sge: Sge {
                addr: self.hs.as_ptr() as u64 + range.start as u64,
                len: HS_BYTES as u32,
                lkey: self.hs_lkey,
            },
            op: SendOp::UdSend {
                dest: dest.port,
                remote_qpn: dest.ud_qpn,
                qkey: dest.qkey,
            },
            signaled: false,
        };
        // SAFETY: the slot is registered and owned by the domain; it is reused only after
        // `HS_SENDS` more handshakes, long after a datagram completes.
        match unsafe { self.verbs.post_send(self.ud_qpn, &[wr]) } {
            // A full UD queue drops this one; the retry timer sends it again.
            Ok(()) | Err(super::VerbsError::Full(_)) => Ok(()),
            Err(e) => Err(verbs_err(e)),
        }
    }

    /// Moves a peer's pair to RTR and RTS against the remote numbers, then posts its queue.
    fn make_ready(&mut self, peer: PeerId, remote: &Handshake) -> Result<(), TransportError> {
        let Some(p) = self.peers.get(peer as usize).and_then(Option::as_ref) else {
            return Ok(());
        };
        if p.state == PeerState::Ready {
            return Ok(());
        }
        let (send_qpn, write_qpn, psn) = (p.send_qpn, p.write_qpn, p.psn);
        for (qpn, dest_qpn) in [(send_qpn, remote.send_qpn), (write_qpn, remote.write_qpn)] {
            let mut rtr = Self::base_attr(&self.config, QpState::Rtr);
            rtr.dest = Some(remote.from.port);
            rtr.dest_qp_num = dest_qpn;
            rtr.rq_psn = remote.psn;
            self.verbs.modify_qp(qpn, &rtr).map_err(verbs_err)?;
            let mut rts = Self::base_attr(&self.config, QpState::Rts);
            rts.sq_psn = psn;
            self.verbs.modify_qp(qpn, &rts).map_err(verbs_err)?;
        }
        if let Some(p) = self.peers.get_mut(peer as usize).and_then(Option::as_mut) {
            p.state = PeerState::Ready;
            p.remote = Some((remote.send_qpn, remote.write_qpn));
        }
        self.flush_queued(peer);
        Ok(())
    }

    fn on_handshake(&mut self, msg: Handshake) -> Result<(), TransportError> {
        let numbers = (msg.send_qpn, msg.write_qpn);
        let peer = match self.by_addr.get(&msg.from) {
            Some(&id) => id,
            None if msg.kind == HS_REQUEST => self.create_pair(msg.from)?,
            None => return Ok(()), // an answer for a pair released since
        };
        let Some(p) = self.peers.get(peer as usize).and_then(Option::as_ref) else {
            return Ok(());
        };
        match (p.state, p.remote) {
            // Paired with exactly these: the answer may have been lost; say it again.
            (PeerState::Ready, Some(r)) if r == numbers => {}
            // An answer from a pair this one no longer uses.
            (PeerState::Ready, _) if msg.kind == HS_ACCEPT => return Ok(()),
            // The peer made a new pair (it reconnected, or its pair failed): so does this side.
            (PeerState::Ready, _) => {
                self.repair(peer)?;
                self.make_ready(peer, &msg)?;
            }
            (PeerState::Connecting { .. }, _) => self.make_ready(peer, &msg)?,
        }
        if msg.kind == HS_REQUEST {
            self.send_handshake(peer, HS_ACCEPT)?;
        }
        Ok(())
    }

    /// Posts what waited for the pair, in order, as far as the queues take it.
    fn flush_queued(&mut self, peer: PeerId) {
        loop {
            let Some(p) = self.peers.get_mut(peer as usize).and_then(Option::as_mut) else {
                return;
            };
            let Some(first) = p.queued.front().copied() else {
                return;
            };
            let posted = match first {
                Queued::Write(_) => {
                    let mut run = Vec::new();
                    for q in p.queued.iter().take(self.config.max_chain) {
                        match q {
                            Queued::Write(w) => run.push(*w),
                            Queued::Send(_) => break,
                        }
                    }
                    self.post_chain(peer, &run)
                }
                Queued::Send(s) => self.post_one_send(peer, &s).map(usize::from),
            };
            match posted {
                Ok(0) => return,
                Ok(n) => {
                    if let Some(p) = self.peers.get_mut(peer as usize).and_then(Option::as_mut) {
                        p.queued.drain(..n);
                    }
                }
                Err(e) => {
                    tracing::warn!(peer, "verbs: posting queued work failed: {e}");
                    self.fail_queued(peer, &TransferError::Provider(e.to_string()));
                    return;
                }
            }
        }
    }

    fn fail_queued(&mut self, peer: PeerId, why: &TransferError) {
        let Some(p) = self.peers.get_mut(peer as usize).and_then(Option::as_mut) else {
            return;
        };
        for q in p.queued.drain(..) {
            let (wr_id, kind) = match q {
                Queued::Write(w) => (w.wr_id, CompletionKind::Write),
                Queued::Send(s) => (s.wr_id, CompletionKind::Send),
            };
            self.failed.push_back(Completion {
                wr_id,
                count: 1,
                kind,
                result: Err(why.clone()),
            });
        }
    }

    /// Posts up to `wrs.len()` writes to a ready peer as one chain (one doorbell); returns
    /// how many the send queue took.
    fn post_chain(&mut self, peer: PeerId, wrs: &[WriteWr]) -> Result<usize, TransportError> {
        let Some(p) = self.peers.get_mut(peer as usize).and_then(Option::as_mut) else {
            return Err(TransportError::Domain(format!("verbs: no peer {peer}")));
        };
        let room = (self.config.sq_depth - p.outstanding[1].min(self.config.sq_depth)) as usize;
        let n = wrs.len().min(room);
        if n == 0 {
            return Ok(0);
        }
        let mut chain = Vec::with_capacity(n);
        for w in &wrs[..n] {
            let (len, lkey, rkey) = (
                u32::try_from(w.len),
                u32::try_from(w.lkey),
                u32::try_from(w.rkey),
            );
            let (Ok(len), Ok(lkey), Ok(rkey)) = (len, lkey, rkey) else {
                return Err(TransportError::InvalidArgument(
                    "a verbs write's length and keys fit in 32 bits",
                ));
            };
            chain.push(VSendWr {
                wr_id: w.wr_id,
                sge: Sge {
                    addr: w.src_addr,
                    len,
                    lkey,
                },
                op: SendOp::Write {
                    remote_addr: w.dst_addr,
                    rkey,
                    imm: w.imm,
                },
                signaled: true,
            });
        }
        // SAFETY: the engine keeps every source registered and unchanged until its
        // completion is polled (the `Domain::post_writes` contract).
        match unsafe { self.verbs.post_send(p.write_qpn, &chain) } {
            Ok(()) => {
                p.outstanding[1] += n as u32;
                Ok(n)
            }
            Err(super::VerbsError::Full(_)) => Ok(0),
            Err(e) => Err(verbs_err(e)),
        }
    }

    fn post_one_send(&mut self, peer: PeerId, wr: &SendWr) -> Result<bool, TransportError> {
        let Some(p) = self.peers.get_mut(peer as usize).and_then(Option::as_mut) else {
            return Err(TransportError::Domain(format!("verbs: no peer {peer}")));
        };
        if p.outstanding[0] >= self.config.sq_depth {
            return Ok(false);
        }
        let Ok(len) = u32::try_from(wr.len) else {
            return Err(TransportError::InvalidArgument(
                "a verbs message fits in 32 bits",
            ));
        };
        let len_usize = len as usize;
        let slot = match self
            .staging
            .iter()
            .position(|s| !s.busy && s.buf.len() >= len_usize)
        {
            Some(slot) => slot,
            None => {
                let mut buf = vec![0u8; len_usize.max(4096).next_power_of_two()].into_boxed_slice();
                let access = MrAccess {
                    remote_write: false,
                    relaxed_ordering: false,
                };
                // SAFETY: the staging buffer is boxed (never moves) and deregistered in
                // `Drop` before it is freed.
                let (lkey, _) = unsafe {
                    self.verbs
                        .reg_mr(buf.as_mut_ptr() as u64, buf.len() as u64, access)
                }
                .map_err(verbs_err)?;
                self.staging.push(Staging {
                    buf,
                    lkey,
                    busy: false,
                });
                self.staging.len() - 1
            }
        };
        let staging = &mut self.staging[slot];
        // SAFETY: the engine keeps the payload valid until the send completes (the
        // `Domain::post_send` contract); it is copied now, so it need not stay.
        let payload = unsafe { std::slice::from_raw_parts(wr.addr as *const u8, len_usize) };
        staging.buf[..len_usize].copy_from_slice(payload);
        let v = VSendWr {
            wr_id: wr.wr_id,
            sge: Sge {
                addr: staging.buf.as_ptr() as u64,
                len,
                lkey: staging.lkey,
            },
            op: SendOp::Send,
            signaled: true,
        };
        let Some(p) = self.peers.get_mut(peer as usize).and_then(Option::as_mut) else {
            return Err(TransportError::Domain(format!("verbs: no peer {peer}")));
        };
        // SAFETY: the staging slot is registered and stays reserved until the send's
        // completion is polled.
        match unsafe { self.verbs.post_send(p.send_qpn, &[v]) } {
            Ok(()) => {
                p.outstanding[0] += 1;
                self.staging[slot].busy = true;
                self.staged.insert(wr.wr_id, slot);
                Ok(true)
            }
            Err(super::VerbsError::Full(_)) => Ok(false),
            Err(e) => Err(verbs_err(e)),
        }
    }

    fn peer_mut(&mut self, peer: PeerId) -> Result<&mut Peer, TransportError> {
        self.peers
            .get_mut(peer as usize)
            .and_then(Option::as_mut)
            .ok_or_else(|| TransportError::Domain(format!("verbs: unknown peer {peer}")))
    }

    fn map_status(status: WcStatus) -> Result<(), TransferError> {
        match status {
            WcStatus::Success => Ok(()),
            WcStatus::RemoteAccess => Err(TransferError::RemoteAccess(
                "the target refused the rkey, the range or the access".to_owned(),
            )),
            WcStatus::RetryExceeded | WcStatus::RnrRetryExceeded | WcStatus::Flushed => {
                Err(TransferError::PeerUnreachable)
            }
            WcStatus::RemoteInvalidRequest | WcStatus::LocalLength => {
                Err(TransferError::RemoteBufferTooSmall)
            }
            WcStatus::Other(super::fake::INJECTED_STATUS) => Err(TransferError::Injected),
            other => Err(TransferError::Provider(format!(
                "verbs completion {other:?}"
            ))),
        }
    }

    /// Resends unanswered handshakes and fails peers past the connect timeout.
    fn tick(&mut self, now: Instant) {
        let mut resend = Vec::new();
        let mut expired = Vec::new();
        for (id, p) in self.peers.iter_mut().enumerate() {
            let Some(p) = p else { continue };
            if let PeerState::Connecting { since, last_sent } = p.state {
                if now.duration_since(since) > self.config.connect_timeout {
                    expired.push(id as PeerId);
                } else if now.duration_since(last_sent) >= self.config.handshake_retry {
                    p.state = PeerState::Connecting {
                        since,
                        last_sent: now,
                    };
                    resend.push(id as PeerId);
                }
            }
        }
        for id in resend {
            if let Err(e) = self.send_handshake(id, HS_REQUEST) {
                tracing::warn!(peer = id, "verbs: handshake resend failed: {e}");
            }
        }
        for id in expired {
            self.fail_queued(id, &TransferError::PeerUnreachable);
        }
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
        let now = Instant::now();
        self.tick(now);
        let mut n = 0;
        while n < max
            && let Some(c) = self.failed.pop_front()
        {
            out.push(c);
            n += 1;
        }
        let mut wcs = std::mem::take(&mut self.wcs);
        wcs.clear();
        self.verbs.poll_cq(&mut wcs, max - n);
        let mut imm_reposts = Vec::new();
        let mut broken = Vec::new();
        let mut freed: Vec<PeerId> = Vec::new();
        let mut handshakes = Vec::new();
        let mut hs_reposts = Vec::new();
        for wc in &wcs {
            if wc.qp_num == self.ud_qpn {
                if matches!(wc.opcode, WcOpcode::Recv) {
                    let slot = wc.wr_id as usize;
                    if wc.status == WcStatus::Success && slot < HS_RECVS {
                        let start = slot * HS_SLOT + super::fake::GRH_BYTES as usize;
                        let end = (slot * HS_SLOT + wc.byte_len as usize).min((slot + 1) * HS_SLOT);
                        if let Some(msg) = self.hs.get(start..end).and_then(Handshake::decode) {
                            handshakes.push(msg);
                        }
                    }
                    if slot < HS_RECVS {
                        hs_reposts.push(slot);
                    }
                }
                continue;
            }
            let peer = self.by_qpn.get(&wc.qp_num).copied();
            match wc.opcode {
                WcOpcode::RecvRdmaWithImm => {
                    imm_reposts.push(wc.wr_id);
                    if let Some(imm) = wc.imm.filter(|_| wc.status == WcStatus::Success) {
                        out.push(Completion {
                            wr_id: 0,
                            count: 1,
                            kind: CompletionKind::Arrival { imm },
                            result: Ok(()),
                        });
                        n += 1;
                    }
                }
                WcOpcode::Recv => {
                    out.push(Completion {
                        wr_id: wc.wr_id,
                        count: 1,
                        kind: CompletionKind::Recv {
                            len: u64::from(wc.byte_len),
                            from: peer,
                        },
                        result: Self::map_status(wc.status),
                    });
                    n += 1;
                }
                WcOpcode::RdmaWrite | WcOpcode::Send => {
                    let (kind, which) = if wc.opcode == WcOpcode::RdmaWrite {
                        (CompletionKind::Write, 1)
                    } else {
                        (CompletionKind::Send, 0)
                    };
                    if which == 0
                        && let Some(slot) = self.staged.remove(&wc.wr_id)
                    {
                        self.staging[slot].busy = false;
                    }
                    if let Some(p) = peer
                        .and_then(|id| self.peers.get_mut(id as usize))
                        .and_then(Option::as_mut)
                    {
                        p.outstanding[which] = p.outstanding[which].saturating_sub(1);
                        if !p.queued.is_empty()
                            && let Some(id) = peer
                            && !freed.contains(&id)
                        {
                            freed.push(id);
                        }
                    }
                    let result = match peer {
                        Some(_) => Self::map_status(wc.status),
                        None => Err(TransferError::PeerUnreachable),
                    };
                    // An RC error puts the pair in the error state: replace it, so one bad
                    // request (a forged rkey) does not cut the peer off.
                    let fatal = !matches!(
                        wc.status,
                        WcStatus::Success
                            | WcStatus::Flushed
                            | WcStatus::Other(super::fake::INJECTED_STATUS)
                    );
                    if let Some(id) = peer.filter(|_| fatal)
                        && !broken.contains(&id)
                    {
                        broken.push(id);
                    }
                    out.push(Completion {
                        wr_id: wc.wr_id,
                        count: 1,
                        kind,
                        result,
                    });
                    n += 1;
                }
            }
        }
        self.wcs = wcs;
        if !imm_reposts.is_empty() {
            let wrs: Vec<VRecvWr> = imm_reposts
                .into_iter()
                .map(|wr_id| VRecvWr {
                    wr_id,
                    sge: Sge {
                        addr: self.imm_buf.as_ptr() as u64,
                        len: 0,
                        lkey: self.imm_lkey,
                    },
                })
                .collect();
            // SAFETY: zero-length receives into the domain's own registered word.
            if let Err(e) = unsafe { self.verbs.post_srq_recv(self.imm_srq, &wrs) } {
                tracing::error!("verbs: reposting immediates' receives failed: {e}");
            }
        }
        if !hs_reposts.is_empty() {
            let wrs: Vec<VRecvWr> = hs_reposts
                .into_iter()
                .map(|slot| VRecvWr {
                    wr_id: slot as u64,
                    sge: Sge {
                        addr: self.hs.as_ptr() as u64 + (slot * HS_SLOT) as u64,
                        len: HS_SLOT as u32,
                        lkey: self.hs_lkey,
                    },
                })
                .collect();
            // SAFETY: the domain's own registered handshake slots.
            if let Err(e) = unsafe { self.verbs.post_recv(self.ud_qpn, &wrs) } {
                tracing::error!("verbs: reposting handshake receives failed: {e}");
            }
        }
        // Work that waited for room in a send queue these completions freed (a pair still
        // connecting is flushed when it is ready).
        for peer in freed {
            if self
                .peers
                .get(peer as usize)
                .and_then(Option::as_ref)
                .is_some_and(|p| p.state == PeerState::Ready)
            {
                self.flush_queued(peer);
            }
        }
        for peer in broken {
            match self.repair(peer) {
                Ok(_) => {
                    if let Err(e) = self.send_handshake(peer, HS_REQUEST) {
                        tracing::warn!(peer, "verbs: reconnecting failed: {e}");
                    }
                }
                Err(e) => tracing::warn!(peer, "verbs: replacing a failed pair failed: {e}"),
            }
        }
        for msg in handshakes {
            if let Err(e) = self.on_handshake(msg) {
                tracing::warn!("verbs: handshake from {:?} failed: {e}", msg.from.port);
            }
        }
        n
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
