//! Connecting a peer: its two RC queue pairs created, replaced after an error, and brought
//! to RTR and RTS by the handshake over the UD queue pair, resent until answered or timed out.

use std::collections::VecDeque;
use std::time::Instant;

use crate::domain::PeerId;
use crate::error::{TransferError, TransportError};
use crate::verbs::{QpAttr, QpKind, QpState, SendOp, SendWr as VSendWr, Sge, Verbs, VerbsConfig};

use super::handshake::{
    HS_ACCEPT, HS_BYTES, HS_RECVS, HS_REQUEST, HS_SENDS, HS_SLOT, Handshake, VerbsAddr,
};
use super::{IMM_TAG, Peer, PeerState, VerbsDomain, verbs_err};

impl<V: Verbs> VerbsDomain<V> {
    pub(super) fn base_attr(config: &VerbsConfig, state: QpState) -> QpAttr {
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
    pub(super) fn repair(&mut self, peer: PeerId) -> Result<(u32, u32), TransportError> {
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
    pub(super) fn destroy_pair(&mut self, qpns: [u32; 2]) -> Result<(), TransportError> {
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
    pub(super) fn create_pair(&mut self, addr: VerbsAddr) -> Result<PeerId, TransportError> {
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

    pub(super) fn send_handshake(&mut self, peer: PeerId, kind: u8) -> Result<(), TransportError> {
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
            Ok(()) | Err(crate::verbs::VerbsError::Full(_)) => Ok(()),
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

    pub(super) fn on_handshake(&mut self, msg: Handshake) -> Result<(), TransportError> {
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

    /// Resends unanswered handshakes and fails peers past the connect timeout.
    pub(super) fn tick(&mut self, now: Instant) {
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
