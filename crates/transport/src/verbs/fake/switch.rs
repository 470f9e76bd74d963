//! The fake switch at work: work requests delivered between devices (UD datagrams, RC writes
//! and sends) with their delays, receiver-not-ready retries, faults and completions.

use std::collections::VecDeque;
use std::time::Instant;

use crate::verbs::{QpKind, QpState, SendOp, VerbsError, Wc, WcOpcode, WcStatus};

use super::{Delivery, Device, GRH_BYTES, INJECTED_STATUS, Qp, RNR_DELAY, Switch};

impl Switch {
    pub(super) fn device(&mut self, lid: u16) -> Result<&mut Device, VerbsError> {
        self.devices.get_mut(&lid).ok_or(VerbsError::DeviceGone)
    }

    pub(super) fn qp(&mut self, lid: u16, qpn: u32) -> Result<&mut Qp, VerbsError> {
        self.device(lid)?
            .qps
            .get_mut(&qpn)
            .ok_or_else(|| VerbsError::Invalid(format!("no queue pair {qpn}")))
    }

    /// Executes every delivery due by `now`, earliest first.
    pub(super) fn progress(&mut self, now: Instant) {
        if self.pending.is_empty() {
            return;
        }
        let mut due: Vec<Delivery> = Vec::new();
        self.pending.retain(|d| {
            if d.due <= now {
                due.push(*d);
                false
            } else {
                true
            }
        });
        due.sort_by_key(|d| (d.due, d.seq));
        for d in due {
            self.execute(d, now);
        }
    }

    /// Completes `d` at its sender with `status` (every error, and successes when signaled).
    pub(super) fn complete(&mut self, d: &Delivery, status: WcStatus) {
        let Some(dev) = self.devices.get_mut(&d.lid) else {
            return;
        };
        if let Some(qp) = dev.qps.get_mut(&d.qpn) {
            qp.outstanding = qp.outstanding.saturating_sub(1);
            if !matches!(status, WcStatus::Success | WcStatus::Other(INJECTED_STATUS))
                && qp.kind == QpKind::Rc
            {
                qp.state = QpState::Error;
            }
        }
        if status != WcStatus::Success || d.wr.signaled {
            let opcode = match d.wr.op {
                SendOp::Write { .. } => WcOpcode::RdmaWrite,
                SendOp::Send | SendOp::UdSend { .. } => WcOpcode::Send,
            };
            dev.push(Wc {
                wr_id: d.wr.wr_id,
                status,
                opcode,
                byte_len: 0,
                imm: None,
                qp_num: d.qpn,
                src_qp: 0,
            });
        }
    }

    fn execute(&mut self, d: Delivery, now: Instant) {
        let state = match self.devices.get(&d.lid).and_then(|dev| dev.qps.get(&d.qpn)) {
            Some(qp) => qp.state,
            None => return,
        };
        if state == QpState::Error {
            return self.complete(&d, WcStatus::Flushed);
        }
        if d.inject {
            return self.complete(&d, WcStatus::Other(INJECTED_STATUS));
        }
        let sge = d.wr.sge;
        let local_ok = self.devices.get(&d.lid).is_some_and(|dev| {
            sge.len == 0 || dev.covers(sge.lkey, sge.addr, u64::from(sge.len)).is_some()
        });
        if !local_ok {
            return self.complete(&d, WcStatus::LocalProtection);
        }
        match d.wr.op {
            SendOp::UdSend {
                dest,
                remote_qpn,
                qkey,
            } => {
                self.deliver_ud(&d, dest.lid, remote_qpn, qkey);
                self.complete(&d, WcStatus::Success);
            }
            SendOp::Write { .. } | SendOp::Send => self.deliver_rc(d, now),
        }
    }

    fn deliver_ud(&mut self, d: &Delivery, lid: u16, qpn: u32, qkey: u32) {
        let sge = d.wr.sge;
        let src_qp = d.qpn;
        let Some(target) = self.devices.get_mut(&lid).filter(|t| t.alive) else {
            return;
        };
        let Some(qp) = target.qps.get_mut(&qpn) else {
            return;
        };
        if qp.kind != QpKind::Ud
            || qp.qkey != qkey
            || !matches!(qp.state, QpState::Rtr | QpState::Rts)
        {
            return;
        }
        let Some(recv) = qp.rq.pop_front() else {
            return; // UD drops what finds no buffer.
        };
        let need = u64::from(sge.len) + u64::from(GRH_BYTES);
        let status = if u64::from(recv.sge.len) < need
            || target.covers(recv.sge.lkey, recv.sge.addr, need).is_none()
        {
            WcStatus::LocalLength
        } else {
            // SAFETY: both ranges are inside live registrations (checked above and in
            // `execute`), whose owners keep them valid until deregistered; the receive buffer
            // is the device's until its completion is polled.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    sge.addr as *const u8,
                    (recv.sge.addr + u64::from(GRH_BYTES)) as *mut u8,
                    sge.len as usize,
                );
            }
            WcStatus::Success
        };
        target.push(Wc {
            wr_id: recv.wr_id,
            status,
            opcode: WcOpcode::Recv,
            byte_len: need as u32,
            imm: None,
            qp_num: qpn,
            src_qp,
        });
    }

    fn deliver_rc(&mut self, d: Delivery, now: Instant) {
        let Some(&Qp {
            remote: Some((lid, qpn)),
            ..
        }) = self.devices.get(&d.lid).and_then(|dev| dev.qps.get(&d.qpn))
        else {
            return self.complete(&d, WcStatus::RetryExceeded);
        };
        let sender = (d.lid, d.qpn);
        let reachable = self
            .devices
            .get(&lid)
            .filter(|t| t.alive)
            .and_then(|t| t.qps.get(&qpn))
            .is_some_and(|q| {
                q.kind == QpKind::Rc
                    && matches!(q.state, QpState::Rtr | QpState::Rts)
                    && q.remote == Some(sender)
            });
        if !reachable {
            return self.complete(&d, WcStatus::RetryExceeded);
        }
        let sge = d.wr.sge;
        let Some(target) = self.devices.get_mut(&lid) else {
            return self.complete(&d, WcStatus::RetryExceeded);
        };
        let (srq, remote_write) = match target.qps.get(&qpn) {
            Some(q) => (q.srq, q.remote_write),
            None => return self.complete(&d, WcStatus::RetryExceeded),
        };
        let (imm, write_to) = match d.wr.op {
            SendOp::Write {
                remote_addr,
                rkey,
                imm,
            } => {
                let ok = remote_write
                    && target
                        .covers(rkey, remote_addr, u64::from(sge.len))
                        .is_some_and(|mr| mr.remote_write);
                if !ok {
                    return self.complete(&d, WcStatus::RemoteAccess);
                }
                (imm, Some(remote_addr))
            }
            _ => (None, None),
        };
        // A send, or a write with immediate, needs a receive at the target.
        let needs_recv = write_to.is_none() || imm.is_some();
        let recv = if needs_recv {
            let queue = match srq {
                Some(id) => target.srqs.get_mut(&id).map(|s| &mut s.1),
                None => target.qps.get_mut(&qpn).map(|q| &mut q.rq),
            };
            match queue.and_then(VecDeque::pop_front) {
                Some(r) => Some(r),
                None => {
                    // Receiver not ready: retried (rnr_retry 7 retries forever).
                    let seq = self.next_seq;
                    self.next_seq += 1;
                    self.pending.push(Delivery {
                        due: now + RNR_DELAY,
                        seq,
                        ..d
                    });
                    return;
                }
            }
        } else {
            None
        };
        let (dst, status, opcode) = match (write_to, recv) {
            (Some(addr), _) => (Some(addr), WcStatus::Success, WcOpcode::RecvRdmaWithImm),
            (None, Some(r)) => {
                let fits = r.sge.len >= sge.len
                    && target
                        .covers(r.sge.lkey, r.sge.addr, u64::from(sge.len))
                        .is_some();
                if fits {
                    (Some(r.sge.addr), WcStatus::Success, WcOpcode::Recv)
                } else {
                    (None, WcStatus::LocalLength, WcOpcode::Recv)
                }
            }
            (None, None) => (None, WcStatus::Success, WcOpcode::Recv),
        };
        if let Some(dst) = dst
            && sge.len > 0
        {
            // SAFETY: the source range is inside a live local registration (checked in
            // `execute`), the destination inside a live registration of the target that
            // grants the access (checked above); owners keep both valid until deregistered.
            unsafe {
                std::ptr::copy(sge.addr as *const u8, dst as *mut u8, sge.len as usize);
            }
        }
        if let Some(r) = recv {
            target.push(Wc {
                wr_id: r.wr_id,
                status,
                opcode,
                byte_len: sge.len,
                imm,
                qp_num: qpn,
                src_qp: d.qpn,
            });
        }
        let result = if status == WcStatus::Success {
            WcStatus::Success
        } else {
            WcStatus::RemoteInvalidRequest
        };
        self.complete(&d, result);
    }
}
