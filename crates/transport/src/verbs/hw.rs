//! [`HwVerbs`]: the [`Verbs`] calls on a real RDMA device, through `libibverbs.so.1` loaded at
//! run time. **Not run on hardware**: the struct layouts below are checked against rdma-core's
//! `verbs.h` by `layout.c` (sizes and offsets, recorded in the tests of this module), and on a
//! machine without a device it fails at [`HwVerbs::open`] with what is missing.
//!
//! `ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv` and `ibv_poll_cq` are inline in
//! `verbs.h`: they call through the context's `ops` table, read here at the offsets `layout.c`
//! prints. Everything else is an exported function. There is no completion channel: the
//! engine's worker polls the completion queue ([`Verbs::may_park`] is false).

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::ptr::{NonNull, null_mut};
use std::sync::Arc;

use super::{
    MrAccess, PortAddr, QpAttr, QpKind, QpState, RecvWr, SendOp, SendWr, Verbs, VerbsConfig,
    VerbsError, Wc, WcOpcode,
};
use crate::error::TransportError;

mod abi;
mod loader;

use abi::*;
pub(super) use loader::device_names;
use loader::{Lib, unavailable, with_devices};

fn os_err(what: &str) -> VerbsError {
    VerbsError::Invalid(format!("{what}: {}", std::io::Error::last_os_error()))
}

/// Reads the `T` at `offset` bytes into the object at `base`.
///
/// # Safety
/// `base` must point to a live object with a `T` at `offset` (the layout `layout.c` checks).
unsafe fn field<T: Copy>(base: NonNull<c_void>, offset: usize) -> T {
    // SAFETY: the caller's contract.
    unsafe {
        base.as_ptr()
            .cast::<u8>()
            .add(offset)
            .cast::<T>()
            .read_unaligned()
    }
}

/// One opened port of an RDMA device, with one protection domain and one completion queue.
pub struct HwVerbs {
    lib: Arc<Lib>,
    ctx: NonNull<c_void>,
    pd: NonNull<c_void>,
    cq: NonNull<c_void>,
    port: PortAddr,
    gid_index: u8,
    mrs: HashMap<u32, NonNull<c_void>>,
    qps: HashMap<u32, NonNull<c_void>>,
    srqs: HashMap<u32, NonNull<c_void>>,
    next_srq: u32,
    ahs: HashMap<([u8; 16], u16), NonNull<c_void>>,
    doorbells: u64,
    wcs: Vec<IbvWc>,
    sges: Vec<IbvSge>,
    send_wrs: Vec<IbvSendWr>,
    recv_wrs: Vec<IbvRecvWr>,
}

impl std::fmt::Debug for HwVerbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HwVerbs")
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

// SAFETY: the verbs objects are used by the one worker thread that owns the domain; rdma-core
// allows a context, PD, CQ and QPs to be used from any thread.
unsafe impl Send for HwVerbs {}

impl HwVerbs {
    /// Opens `config`'s device (the first one if unnamed) and port: context, protection
    /// domain, completion queue, port attributes and GID.
    pub fn open(config: &VerbsConfig) -> Result<Self, TransportError> {
        let lib = Arc::new(Lib::load()?);
        let (ctx, found) = with_devices(&lib, |devices| {
            let chosen = devices
                .iter()
                .find(|(_, name)| config.device.as_deref().is_none_or(|want| want == name));
            // SAFETY: a device of the live list, opened before the list is freed; opened
            // contexts stay valid after.
            let ctx = chosen.map(|&(dev, _)| unsafe { (lib.open_device)(dev) });
            (
                ctx,
                devices.iter().map(|(_, n)| n.clone()).collect::<Vec<_>>(),
            )
        })?;
        let ctx = match ctx {
            None if found.is_empty() => return Err(unavailable("no RDMA device".to_owned())),
            None => {
                return Err(unavailable(format!(
                    "no RDMA device named {:?} (found: {found:?})",
                    config.device
                )));
            }
            Some(ctx) => NonNull::new(ctx).ok_or_else(|| {
                unavailable(format!(
                    "ibv_open_device failed: {}",
                    std::io::Error::last_os_error()
                ))
            })?,
        };
        // From here on, `Drop` releases what was made.
        let mut this = Self {
            lib: lib.clone(),
            ctx,
            pd: NonNull::dangling(),
            cq: NonNull::dangling(),
            port: PortAddr {
                gid: [0; 16],
                lid: 0,
                port: config.port,
            },
            gid_index: config.gid_index,
            mrs: HashMap::new(),
            qps: HashMap::new(),
            srqs: HashMap::new(),
            next_srq: 0,
            ahs: HashMap::new(),
            doorbells: 0,
            wcs: Vec::new(),
            sges: Vec::new(),
            send_wrs: Vec::new(),
            recv_wrs: Vec::new(),
        };
        // SAFETY: an open context.
        this.pd = NonNull::new(unsafe { (lib.alloc_pd)(ctx.as_ptr()) })
            .ok_or_else(|| unavailable("ibv_alloc_pd failed".to_owned()))?;
        let depth = (config.sq_depth.saturating_mul(64)).max(4096) as c_int;
        // SAFETY: an open context; no completion channel.
        this.cq = NonNull::new(unsafe {
            (lib.create_cq)(ctx.as_ptr(), depth, null_mut(), null_mut(), 0)
        })
        .ok_or_else(|| unavailable("ibv_create_cq failed".to_owned()))?;
        let mut attr = IbvPortAttr::default();
        // SAFETY: an open context and a port attribute struct of verbs.h's size.
        if unsafe { (lib.query_port)(ctx.as_ptr(), config.port, &mut attr) } != 0 {
            return Err(unavailable(format!(
                "ibv_query_port of port {} failed",
                config.port
            )));
        }
        let mut gid = IbvGid::default();
        // SAFETY: an open context and a `union ibv_gid`.
        if unsafe {
            (lib.query_gid)(
                ctx.as_ptr(),
                config.port,
                c_int::from(config.gid_index),
                &mut gid,
            )
        } != 0
        {
            return Err(unavailable(format!(
                "ibv_query_gid of index {} failed",
                config.gid_index
            )));
        }
        this.port = PortAddr {
            gid: gid.0,
            lid: attr.lid,
            port: config.port,
        };
        Ok(this)
    }

    fn keep_mr(&mut self, mr: *mut c_void) -> Result<(u32, u32), VerbsError> {
        let mr = NonNull::new(mr).ok_or_else(|| os_err("registering memory"))?;
        // SAFETY: a live `ibv_mr` (offsets from `layout.c`).
        let (lkey, rkey) = unsafe {
            (
                field::<u32>(mr, off::MR_LKEY),
                field::<u32>(mr, off::MR_RKEY),
            )
        };
        self.mrs.insert(lkey, mr);
        Ok((lkey, rkey))
    }

    fn op<T: Copy>(&self, offset: usize) -> T {
        // SAFETY: an open context; the ops table's entry at `offset` (layout.c).
        unsafe { field::<T>(self.ctx, offset) }
    }

    fn ah(&mut self, dest: PortAddr) -> Result<*mut c_void, VerbsError> {
        if let Some(ah) = self.ahs.get(&(dest.gid, dest.lid)) {
            return Ok(ah.as_ptr());
        }
        let mut attr = IbvAhAttr {
            dlid: dest.lid,
            port_num: self.port.port,
            is_global: u8::from(dest.gid != [0; 16]),
            ..IbvAhAttr::default()
        };
        attr.grh.dgid = IbvGid(dest.gid);
        attr.grh.sgid_index = self.gid_index;
        attr.grh.hop_limit = 64;
        // SAFETY: an allocated PD and a filled attribute.
        let ah = NonNull::new(unsafe { (self.lib.create_ah)(self.pd.as_ptr(), &mut attr) })
            .ok_or_else(|| os_err("ibv_create_ah"))?;
        self.ahs.insert((dest.gid, dest.lid), ah);
        Ok(ah.as_ptr())
    }
}

impl From<super::Sge> for IbvSge {
    fn from(s: super::Sge) -> Self {
        Self {
            addr: s.addr,
            length: s.len,
            lkey: s.lkey,
        }
    }
}

impl Verbs for HwVerbs {
    fn port_addr(&self) -> PortAddr {
        self.port
    }

    unsafe fn reg_mr(
        &mut self,
        addr: u64,
        len: u64,
        access: MrAccess,
    ) -> Result<(u32, u32), VerbsError> {
        let len = usize::try_from(len).map_err(|_| VerbsError::Invalid("length".to_owned()))?;
        // SAFETY: the caller's contract on the range; an allocated PD.
        let mr = unsafe {
            (self.lib.reg_mr_iova2)(
                self.pd.as_ptr(),
                addr as *mut c_void,
                len,
                addr,
                access_flags(access),
            )
        };
        self.keep_mr(mr)
    }

    unsafe fn reg_dmabuf_mr(
        &mut self,
        fd: i32,
        offset: u64,
        len: u64,
        iova: u64,
        access: MrAccess,
    ) -> Result<(u32, u32), VerbsError> {
        let reg = self.lib.reg_dmabuf_mr.ok_or_else(|| {
            VerbsError::Invalid(
                "this libibverbs has no ibv_reg_dmabuf_mr (rdma-core 34 or later)".to_owned(),
            )
        })?;
        let len = usize::try_from(len).map_err(|_| VerbsError::Invalid("length".to_owned()))?;
        // SAFETY: the caller's contract on the dma-buf; an allocated PD.
        let mr = unsafe {
            reg(
                self.pd.as_ptr(),
                offset,
                len,
                iova,
                fd,
                access_flags(access) as c_int,
            )
        };
        self.keep_mr(mr)
    }

    fn dereg_mr(&mut self, lkey: u32) -> Result<(), VerbsError> {
        let mr = self
            .mrs
            .remove(&lkey)
            .ok_or_else(|| VerbsError::Invalid(format!("no region with key {lkey}")))?;
        // SAFETY: a region registered here, deregistered once.
        match unsafe { (self.lib.dereg_mr)(mr.as_ptr()) } {
            0 => Ok(()),
            rc => Err(post_err(rc, "ibv_dereg_mr")),
        }
    }

    fn create_srq(&mut self, depth: u32) -> Result<u32, VerbsError> {
        let mut attr = IbvSrqInitAttr {
            srq_context: null_mut(),
            max_wr: depth,
            max_sge: 1,
            srq_limit: 0,
        };
        // SAFETY: an allocated PD and a filled attribute.
        let srq = NonNull::new(unsafe { (self.lib.create_srq)(self.pd.as_ptr(), &mut attr) })
            .ok_or_else(|| os_err("ibv_create_srq"))?;
        self.next_srq += 1;
        self.srqs.insert(self.next_srq, srq);
        Ok(self.next_srq)
    }

    fn create_qp(
        &mut self,
        kind: QpKind,
        srq: Option<u32>,
        sq_depth: u32,
    ) -> Result<u32, VerbsError> {
        let srq = match srq {
            Some(id) => self
                .srqs
                .get(&id)
                .ok_or_else(|| VerbsError::Invalid(format!("no shared receive queue {id}")))?
                .as_ptr(),
            None => null_mut(),
        };
        let mut attr = IbvQpInitAttr {
            qp_context: null_mut(),
            send_cq: self.cq.as_ptr(),
            recv_cq: self.cq.as_ptr(),
            srq,
            cap: IbvQpCap {
                max_send_wr: sq_depth,
                max_recv_wr: if srq.is_null() { 128 } else { 0 },
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: match kind {
                QpKind::Rc => val::QPT_RC,
                QpKind::Ud => val::QPT_UD,
            },
            sq_sig_all: 0,
        };
        // SAFETY: an allocated PD, the CQ and SRQ made here, a filled attribute.
        let qp = NonNull::new(unsafe { (self.lib.create_qp)(self.pd.as_ptr(), &mut attr) })
            .ok_or_else(|| os_err("ibv_create_qp"))?;
        // SAFETY: a live `ibv_qp`.
        let qpn = unsafe { field::<u32>(qp, off::QP_NUM) };
        self.qps.insert(qpn, qp);
        Ok(qpn)
    }

    fn modify_qp(&mut self, qpn: u32, attr: &QpAttr) -> Result<(), VerbsError> {
        let qp = *self
            .qps
            .get(&qpn)
            .ok_or_else(|| VerbsError::Invalid(format!("no queue pair {qpn}")))?;
        let mut a = IbvQpAttr {
            qp_state: state_code(attr.state),
            ..IbvQpAttr::default()
        };
        let mut mask = val::QP_STATE;
        let ud = attr.dest.is_none() && attr.dest_qp_num == 0;
        match attr.state {
            QpState::Init => {
                a.port_num = attr.port;
                a.pkey_index = 0;
                mask |= val::QP_PORT | val::QP_PKEY_INDEX;
                if ud {
                    a.qkey = attr.qkey;
                    mask |= val::QP_QKEY;
                } else {
                    a.qp_access_flags = if attr.remote_write {
                        val::ACCESS_REMOTE_WRITE
                    } else {
                        0
                    };
                    mask |= val::QP_ACCESS_FLAGS;
                }
            }
            QpState::Rtr if !ud => {
                let dest = attr
                    .dest
                    .ok_or_else(|| VerbsError::Invalid("RTR needs the remote port".to_owned()))?;
                a.path_mtu = mtu_code(attr.mtu);
                a.dest_qp_num = attr.dest_qp_num;
                a.rq_psn = attr.rq_psn;
                a.max_dest_rd_atomic = 16;
                a.min_rnr_timer = attr.min_rnr_timer;
                a.ah_attr.dlid = dest.lid;
                a.ah_attr.port_num = self.port.port;
                if dest.gid != [0; 16] {
                    a.ah_attr.is_global = 1;
                    a.ah_attr.grh.dgid = IbvGid(dest.gid);
                    a.ah_attr.grh.sgid_index = attr.sgid_index;
                    a.ah_attr.grh.hop_limit = 64;
                    a.ah_attr.grh.traffic_class = attr.traffic_class;
                }
                mask |= val::QP_AV
                    | val::QP_PATH_MTU
                    | val::QP_DEST_QPN
                    | val::QP_RQ_PSN
                    | val::QP_MAX_DEST_RD_ATOMIC
                    | val::QP_MIN_RNR_TIMER;
            }
            QpState::Rts => {
                a.sq_psn = attr.sq_psn;
                mask |= val::QP_SQ_PSN;
                if !ud {
                    a.timeout = attr.timeout;
                    a.retry_cnt = attr.retry_cnt;
                    a.rnr_retry = attr.rnr_retry;
                    a.max_rd_atomic = 16;
                    mask |= val::QP_TIMEOUT
                        | val::QP_RETRY_CNT
                        | val::QP_RNR_RETRY
                        | val::QP_MAX_QP_RD_ATOMIC;
                }
            }
            QpState::Rtr | QpState::Reset | QpState::Error => {}
        }
        // SAFETY: a live QP and a filled attribute with its mask.
        match unsafe { (self.lib.modify_qp)(qp.as_ptr(), &mut a, mask) } {
            0 => Ok(()),
            rc => Err(post_err(rc, "ibv_modify_qp")),
        }
    }

    fn destroy_qp(&mut self, qpn: u32) -> Result<(), VerbsError> {
        let qp = self
            .qps
            .remove(&qpn)
            .ok_or_else(|| VerbsError::Invalid(format!("no queue pair {qpn}")))?;
        // SAFETY: a QP created here, destroyed once.
        match unsafe { (self.lib.destroy_qp)(qp.as_ptr()) } {
            0 => Ok(()),
            rc => Err(post_err(rc, "ibv_destroy_qp")),
        }
    }

    unsafe fn post_send(&mut self, qpn: u32, wrs: &[SendWr]) -> Result<(), VerbsError> {
        let qp = *self
            .qps
            .get(&qpn)
            .ok_or_else(|| VerbsError::Invalid(format!("no queue pair {qpn}")))?;
        if wrs.is_empty() {
            return Ok(());
        }
        self.sges.clear();
        self.sges.extend(wrs.iter().map(|w| IbvSge::from(w.sge)));
        let mut chain = Vec::with_capacity(wrs.len());
        for w in wrs {
            let (opcode, imm, union) = match w.op {
                SendOp::Write {
                    remote_addr,
                    rkey,
                    imm,
                } => (
                    if imm.is_some() {
                        val::WR_RDMA_WRITE_WITH_IMM
                    } else {
                        val::WR_RDMA_WRITE
                    },
                    imm.unwrap_or(0).to_be(),
                    WrUnion {
                        rdma: Rdma { remote_addr, rkey },
                    },
                ),
                SendOp::Send => (val::WR_SEND, 0, WrUnion { atomic: [0; 4] }),
                SendOp::UdSend {
                    dest,
                    remote_qpn,
                    qkey,
                } => (
                    val::WR_SEND,
                    0,
                    WrUnion {
                        ud: Ud {
                            ah: self.ah(dest)?,
                            remote_qpn,
                            remote_qkey: qkey,
                        },
                    },
                ),
            };
            chain.push(IbvSendWr {
                wr_id: w.wr_id,
                next: null_mut(),
                sg_list: null_mut(),
                num_sge: 1,
                opcode,
                send_flags: if w.signaled { val::SEND_SIGNALED } else { 0 },
                imm_data: imm,
                wr: union,
                qp_type: 0,
                tail: [0; 6],
            });
        }
        self.send_wrs = chain;
        let base = link(&mut self.send_wrs, &mut self.sges, |wr, next, sge| {
            wr.next = next;
            wr.sg_list = sge;
        });
        let post: PostSend = self.op(off::CTX_POST_SEND);
        let mut bad = null_mut();
        self.doorbells += 1;
        // SAFETY: a live QP and a well-formed chain; the SGEs' bytes are the caller's contract.
        match unsafe { post(qp.as_ptr(), base, &mut bad) } {
            0 => Ok(()),
            rc => Err(post_err(rc, "the send queue")),
        }
    }

    unsafe fn post_srq_recv(&mut self, srq: u32, wrs: &[RecvWr]) -> Result<(), VerbsError> {
        let srq = *self
            .srqs
            .get(&srq)
            .ok_or_else(|| VerbsError::Invalid(format!("no shared receive queue {srq}")))?;
        let post: PostRecv = self.op(off::CTX_POST_SRQ_RECV);
        // SAFETY: forwarded to `post_recv_chain`, whose contract the caller meets.
        unsafe { self.post_recv_chain(srq, wrs, post) }
    }

    unsafe fn post_recv(&mut self, qpn: u32, wrs: &[RecvWr]) -> Result<(), VerbsError> {
        let qp = *self
            .qps
            .get(&qpn)
            .ok_or_else(|| VerbsError::Invalid(format!("no queue pair {qpn}")))?;
        let post: PostRecv = self.op(off::CTX_POST_RECV);
        // SAFETY: as above.
        unsafe { self.post_recv_chain(qp, wrs, post) }
    }

    fn poll_cq(&mut self, out: &mut Vec<Wc>, max: usize) -> usize {
        let n = max.min(256);
        if n == 0 {
            return 0;
        }
        self.wcs.resize(n, IbvWc::default());
        let poll: PollCq = self.op(off::CTX_POLL_CQ);
        // SAFETY: the CQ made here and room for `n` completions.
        let got = unsafe { poll(self.cq.as_ptr(), n as c_int, self.wcs.as_mut_ptr()) };
        let got = usize::try_from(got).unwrap_or(0);
        out.extend(self.wcs[..got].iter().map(|w| Wc {
            wr_id: w.wr_id,
            status: status_of(w.status),
            opcode: match w.opcode {
                0 => WcOpcode::Send,
                1 => WcOpcode::RdmaWrite,
                129 => WcOpcode::RecvRdmaWithImm,
                _ => WcOpcode::Recv,
            },
            byte_len: w.byte_len,
            imm: (w.wc_flags & val::WC_WITH_IMM != 0).then(|| u32::from_be(w.imm_data)),
            qp_num: w.qp_num,
            src_qp: w.src_qp,
        }));
        got
    }

    fn doorbells(&self) -> u64 {
        self.doorbells
    }

    fn set_notify(&mut self, _notify: Arc<dyn crate::domain::Notify>) {}

    fn may_park(&self) -> bool {
        false
    }
}

impl HwVerbs {
    /// Posts `wrs` as one chain through `post` on `target` (a QP or an SRQ).
    ///
    /// # Safety
    /// As [`Verbs::post_recv`].
    unsafe fn post_recv_chain(
        &mut self,
        target: NonNull<c_void>,
        wrs: &[RecvWr],
        post: PostRecv,
    ) -> Result<(), VerbsError> {
        if wrs.is_empty() {
            return Ok(());
        }
        self.sges.clear();
        self.sges.extend(wrs.iter().map(|w| IbvSge::from(w.sge)));
        self.recv_wrs.clear();
        self.recv_wrs.extend(wrs.iter().map(|w| IbvRecvWr {
            wr_id: w.wr_id,
            next: null_mut(),
            sg_list: null_mut(),
            num_sge: c_int::from(w.sge.len > 0),
        }));
        let base = link(&mut self.recv_wrs, &mut self.sges, |wr, next, sge| {
            wr.next = next;
            wr.sg_list = sge;
        });
        let mut bad = null_mut();
        self.doorbells += 1;
        // SAFETY: a live QP or SRQ and a well-formed chain; buffers are the caller's contract.
        match unsafe { post(target.as_ptr(), base, &mut bad) } {
            0 => Ok(()),
            rc => Err(post_err(rc, "the receive queue")),
        }
    }
}

impl Drop for HwVerbs {
    fn drop(&mut self) {
        let lib = self.lib.clone();
        // SAFETY: every object was created here and is destroyed once, children first.
        unsafe {
            for (_, qp) in self.qps.drain() {
                (lib.destroy_qp)(qp.as_ptr());
            }
            for (_, ah) in self.ahs.drain() {
                (lib.destroy_ah)(ah.as_ptr());
            }
            for (_, srq) in self.srqs.drain() {
                (lib.destroy_srq)(srq.as_ptr());
            }
            for (_, mr) in self.mrs.drain() {
                (lib.dereg_mr)(mr.as_ptr());
            }
            if self.cq != NonNull::dangling() {
                (lib.destroy_cq)(self.cq.as_ptr());
            }
            if self.pd != NonNull::dangling() {
                (lib.dealloc_pd)(self.pd.as_ptr());
            }
            (lib.close_device)(self.ctx.as_ptr());
        }
    }
}

#[cfg(test)]
mod tests;
