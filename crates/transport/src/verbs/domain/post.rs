//! Posting to a peer's pair: writes chained under one doorbell, sends copied into registered
//! staging, and work that waited while the pair connected, flushed in order or failed.

use crate::domain::{Completion, CompletionKind, PeerId, SendWr, WriteWr};
use crate::error::{TransferError, TransportError};
use crate::verbs::{MrAccess, SendOp, SendWr as VSendWr, Sge, Verbs};

use super::{Queued, Staging, VerbsDomain, verbs_err};

impl<V: Verbs> VerbsDomain<V> {
    /// Posts what waited for the pair, in order, as far as the queues take it.
    pub(super) fn flush_queued(&mut self, peer: PeerId) {
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

    pub(super) fn fail_queued(&mut self, peer: PeerId, why: &TransferError) {
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
    pub(super) fn post_chain(
        &mut self,
        peer: PeerId,
        wrs: &[WriteWr],
    ) -> Result<usize, TransportError> {
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
            Err(crate::verbs::VerbsError::Full(_)) => Ok(0),
            Err(e) => Err(verbs_err(e)),
        }
    }

    pub(super) fn post_one_send(
        &mut self,
        peer: PeerId,
        wr: &SendWr,
    ) -> Result<bool, TransportError> {
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
            Err(crate::verbs::VerbsError::Full(_)) => Ok(false),
            Err(e) => Err(verbs_err(e)),
        }
    }
}
