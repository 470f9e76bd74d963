//! Polling the completion queue: each work completion mapped to the engine's, and what a
//! batch of them leaves to do (receives to post again, pairs to replace, queued work to
//! flush, handshakes to answer).

use std::time::Instant;

use crate::domain::{Completion, CompletionKind, PeerId};
use crate::error::TransferError;
use crate::verbs::{RecvWr as VRecvWr, Sge, Verbs, Wc, WcOpcode, WcStatus};

use super::handshake::{HS_RECVS, HS_REQUEST, HS_SLOT, Handshake};
use super::{PeerState, VerbsDomain};

/// What one poll's completions leave to do once all are mapped.
#[derive(Default)]
struct AfterPoll {
    /// Receives that immediates consumed (their work request ids), to post again.
    imm_reposts: Vec<u64>,
    /// Handshake slots received into, to post again.
    hs_reposts: Vec<usize>,
    /// Peers whose pair went into the error state, to replace.
    broken: Vec<PeerId>,
    /// Peers with work queued whose send queues got room.
    freed: Vec<PeerId>,
    /// Handshakes received, to answer.
    handshakes: Vec<Handshake>,
}

impl<V: Verbs> VerbsDomain<V> {
    /// [`Domain::poll`](crate::domain::Domain::poll): the completions the domain made itself first, then the completion
    /// queue's, each mapped to the engine's; then what they left to do.
    pub(super) fn poll_completions(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
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
        let mut after = AfterPoll::default();
        for wc in &wcs {
            if wc.qp_num == self.ud_qpn {
                self.on_handshake_wc(wc, &mut after);
                continue;
            }
            if let Some(c) = self.map_wc(wc, &mut after) {
                out.push(c);
                n += 1;
            }
        }
        self.wcs = wcs;
        self.repost_imm_recvs(after.imm_reposts);
        self.repost_handshake_recvs(after.hs_reposts);
        self.finish_poll(after.freed, after.broken, after.handshakes);
        n
    }

    /// A completion on the UD queue pair: a handshake received (kept to answer once the
    /// batch is mapped) and its slot to post again.
    fn on_handshake_wc(&self, wc: &Wc, after: &mut AfterPoll) {
        if matches!(wc.opcode, WcOpcode::Recv) {
            let slot = wc.wr_id as usize;
            if wc.status == WcStatus::Success && slot < HS_RECVS {
                let start = slot * HS_SLOT + crate::verbs::GRH_BYTES as usize;
                let end = (slot * HS_SLOT + wc.byte_len as usize).min((slot + 1) * HS_SLOT);
                if let Some(msg) = self.hs.get(start..end).and_then(Handshake::decode) {
                    after.handshakes.push(msg);
                }
            }
            if slot < HS_RECVS {
                after.hs_reposts.push(slot);
            }
        }
    }

    /// The engine's completion for a work completion on a peer's pair, if it makes one (a
    /// failed receive of an immediate makes none).
    fn map_wc(&mut self, wc: &Wc, after: &mut AfterPoll) -> Option<Completion> {
        let peer = self.by_qpn.get(&wc.qp_num).copied();
        match wc.opcode {
            WcOpcode::RecvRdmaWithImm => {
                after.imm_reposts.push(wc.wr_id);
                wc.imm
                    .filter(|_| wc.status == WcStatus::Success)
                    .map(|imm| Completion {
                        wr_id: 0,
                        count: 1,
                        kind: CompletionKind::Arrival { imm },
                        result: Ok(()),
                    })
            }
            WcOpcode::Recv => Some(Completion {
                wr_id: wc.wr_id,
                count: 1,
                kind: CompletionKind::Recv {
                    len: u64::from(wc.byte_len),
                    from: peer,
                },
                result: Self::map_status(wc.status),
            }),
            WcOpcode::RdmaWrite | WcOpcode::Send => {
                Some(self.complete_write_or_send(wc, peer, after))
            }
        }
    }

    /// A write or send done: its staging slot and its queue's room given back (a peer with
    /// work queued is flushed after the batch), a pair in error marked for replacement.
    fn complete_write_or_send(
        &mut self,
        wc: &Wc,
        peer: Option<PeerId>,
        after: &mut AfterPoll,
    ) -> Completion {
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
                && !after.freed.contains(&id)
            {
                after.freed.push(id);
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
            WcStatus::Success | WcStatus::Flushed | WcStatus::Other(crate::verbs::INJECTED_STATUS)
        );
        if let Some(id) = peer.filter(|_| fatal)
            && !after.broken.contains(&id)
        {
            after.broken.push(id);
        }
        Completion {
            wr_id: wc.wr_id,
            count: 1,
            kind,
            result,
        }
    }

    /// Posts again the zero-length receives that immediates consumed.
    fn repost_imm_recvs(&mut self, wr_ids: Vec<u64>) {
        if wr_ids.is_empty() {
            return;
        }
        let wrs: Vec<VRecvWr> = wr_ids
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

    /// Posts again the handshake slots received into.
    fn repost_handshake_recvs(&mut self, slots: Vec<usize>) {
        if slots.is_empty() {
            return;
        }
        let wrs: Vec<VRecvWr> = slots
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

    /// After a batch: flushes the work that waited for the room it freed, replaces the pairs
    /// that failed and reconnects them, answers the handshakes received.
    fn finish_poll(&mut self, freed: Vec<PeerId>, broken: Vec<PeerId>, handshakes: Vec<Handshake>) {
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
            WcStatus::Other(crate::verbs::INJECTED_STATUS) => Err(TransferError::Injected),
            other => Err(TransferError::Provider(format!(
                "verbs completion {other:?}"
            ))),
        }
    }
}
