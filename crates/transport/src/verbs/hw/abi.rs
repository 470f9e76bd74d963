//! `verbs.h`, the parts used: the structs as rdma-core lays them out (checked by `layout.c`),
//! the offsets of the inline calls in the context's `ops` table, the constants, and the
//! conversions of the domain's types to and from their codes.

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;

use crate::verbs::{MrAccess, QpState, VerbsError, WcStatus};

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct IbvSge {
    pub(super) addr: u64,
    pub(super) length: u32,
    pub(super) lkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Rdma {
    pub(super) remote_addr: u64,
    pub(super) rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Ud {
    pub(super) ah: *mut c_void,
    pub(super) remote_qpn: u32,
    pub(super) remote_qkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(super) union WrUnion {
    pub(super) rdma: Rdma,
    pub(super) ud: Ud,
    pub(super) atomic: [u64; 4],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct IbvSendWr {
    pub(super) wr_id: u64,
    pub(super) next: *mut IbvSendWr,
    pub(super) sg_list: *mut IbvSge,
    pub(super) num_sge: c_int,
    pub(super) opcode: u32,
    pub(super) send_flags: u32,
    pub(super) imm_data: u32,
    pub(super) wr: WrUnion,
    pub(super) qp_type: u32,
    pub(super) tail: [u64; 6],
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct IbvRecvWr {
    pub(super) wr_id: u64,
    pub(super) next: *mut IbvRecvWr,
    pub(super) sg_list: *mut IbvSge,
    pub(super) num_sge: c_int,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct IbvWc {
    pub(super) wr_id: u64,
    pub(super) status: u32,
    pub(super) opcode: u32,
    pub(super) vendor_err: u32,
    pub(super) byte_len: u32,
    pub(super) imm_data: u32,
    pub(super) qp_num: u32,
    pub(super) src_qp: u32,
    pub(super) wc_flags: u32,
    pub(super) pkey_index: u16,
    pub(super) slid: u16,
    pub(super) sl: u8,
    pub(super) dlid_path_bits: u8,
}

/// `union ibv_gid`: 16 bytes, 8-aligned (its other member is two `__be64`).
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct IbvGid(pub(super) [u8; 16]);

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct IbvGlobalRoute {
    pub(super) dgid: IbvGid,
    pub(super) flow_label: u32,
    pub(super) sgid_index: u8,
    pub(super) hop_limit: u8,
    pub(super) traffic_class: u8,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct IbvAhAttr {
    pub(super) grh: IbvGlobalRoute,
    pub(super) dlid: u16,
    pub(super) sl: u8,
    pub(super) src_path_bits: u8,
    pub(super) static_rate: u8,
    pub(super) is_global: u8,
    pub(super) port_num: u8,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct IbvQpCap {
    pub(super) max_send_wr: u32,
    pub(super) max_recv_wr: u32,
    pub(super) max_send_sge: u32,
    pub(super) max_recv_sge: u32,
    pub(super) max_inline_data: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct IbvQpInitAttr {
    pub(super) qp_context: *mut c_void,
    pub(super) send_cq: *mut c_void,
    pub(super) recv_cq: *mut c_void,
    pub(super) srq: *mut c_void,
    pub(super) cap: IbvQpCap,
    pub(super) qp_type: u32,
    pub(super) sq_sig_all: c_int,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct IbvSrqInitAttr {
    pub(super) srq_context: *mut c_void,
    pub(super) max_wr: u32,
    pub(super) max_sge: u32,
    pub(super) srq_limit: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct IbvPortAttr {
    pub(super) state: u32,
    pub(super) max_mtu: u32,
    pub(super) active_mtu: u32,
    pub(super) gid_tbl_len: c_int,
    pub(super) port_cap_flags: u32,
    pub(super) max_msg_sz: u32,
    pub(super) bad_pkey_cntr: u32,
    pub(super) qkey_viol_cntr: u32,
    pub(super) pkey_tbl_len: u16,
    pub(super) lid: u16,
    pub(super) sm_lid: u16,
    pub(super) lmc: u8,
    pub(super) max_vl_num: u8,
    pub(super) sm_sl: u8,
    pub(super) subnet_timeout: u8,
    pub(super) init_type_reply: u8,
    pub(super) active_width: u8,
    pub(super) active_speed: u8,
    pub(super) phys_state: u8,
    pub(super) link_layer: u8,
    pub(super) flags: u8,
    pub(super) port_cap_flags2: u16,
    pub(super) active_speed_ex: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct IbvQpAttr {
    pub(super) qp_state: u32,
    pub(super) cur_qp_state: u32,
    pub(super) path_mtu: u32,
    pub(super) path_mig_state: u32,
    pub(super) qkey: u32,
    pub(super) rq_psn: u32,
    pub(super) sq_psn: u32,
    pub(super) dest_qp_num: u32,
    pub(super) qp_access_flags: u32,
    pub(super) cap: IbvQpCap,
    pub(super) ah_attr: IbvAhAttr,
    pub(super) alt_ah_attr: IbvAhAttr,
    pub(super) pkey_index: u16,
    pub(super) alt_pkey_index: u16,
    pub(super) en_sqd_async_notify: u8,
    pub(super) sq_draining: u8,
    pub(super) max_rd_atomic: u8,
    pub(super) max_dest_rd_atomic: u8,
    pub(super) min_rnr_timer: u8,
    pub(super) port_num: u8,
    pub(super) timeout: u8,
    pub(super) retry_cnt: u8,
    pub(super) rnr_retry: u8,
    pub(super) alt_port_num: u8,
    pub(super) alt_timeout: u8,
    pub(super) rate_limit: u32,
}

/// Offsets `layout.c` prints for the context's inline-call table and the objects' fields.
pub(super) mod off {
    pub(crate) const CTX_POLL_CQ: usize = 96;
    pub(crate) const CTX_POST_SRQ_RECV: usize = 168;
    pub(crate) const CTX_POST_SEND: usize = 208;
    pub(crate) const CTX_POST_RECV: usize = 216;
    pub(crate) const QP_NUM: usize = 52;
    pub(crate) const MR_LKEY: usize = 36;
    pub(crate) const MR_RKEY: usize = 40;
}

/// Enum values from `verbs.h` (printed by `layout.c`).
pub(super) mod val {
    pub(crate) const QPT_RC: u32 = 2;
    pub(crate) const QPT_UD: u32 = 4;
    pub(crate) const WR_RDMA_WRITE: u32 = 0;
    pub(crate) const WR_RDMA_WRITE_WITH_IMM: u32 = 1;
    pub(crate) const WR_SEND: u32 = 2;
    pub(crate) const SEND_SIGNALED: u32 = 2;
    pub(crate) const ACCESS_LOCAL_WRITE: u32 = 1;
    pub(crate) const ACCESS_REMOTE_WRITE: u32 = 2;
    pub(crate) const ACCESS_RELAXED_ORDERING: u32 = 1 << 20;
    pub(crate) const WC_WITH_IMM: u32 = 2;
    pub(crate) const QP_STATE: c_int = 1;
    pub(crate) const QP_ACCESS_FLAGS: c_int = 8;
    pub(crate) const QP_PKEY_INDEX: c_int = 16;
    pub(crate) const QP_PORT: c_int = 32;
    pub(crate) const QP_QKEY: c_int = 64;
    pub(crate) const QP_AV: c_int = 128;
    pub(crate) const QP_PATH_MTU: c_int = 256;
    pub(crate) const QP_TIMEOUT: c_int = 512;
    pub(crate) const QP_RETRY_CNT: c_int = 1024;
    pub(crate) const QP_RNR_RETRY: c_int = 2048;
    pub(crate) const QP_RQ_PSN: c_int = 4096;
    pub(crate) const QP_MAX_QP_RD_ATOMIC: c_int = 8192;
    pub(crate) const QP_MIN_RNR_TIMER: c_int = 32768;
    pub(crate) const QP_SQ_PSN: c_int = 65536;
    pub(crate) const QP_MAX_DEST_RD_ATOMIC: c_int = 131_072;
    pub(crate) const QP_DEST_QPN: c_int = 1_048_576;
    use std::ffi::c_int;
}

pub(super) type PostSend =
    unsafe extern "C" fn(*mut c_void, *mut IbvSendWr, *mut *mut IbvSendWr) -> c_int;
pub(super) type PostRecv =
    unsafe extern "C" fn(*mut c_void, *mut IbvRecvWr, *mut *mut IbvRecvWr) -> c_int;
pub(super) type PollCq = unsafe extern "C" fn(*mut c_void, c_int, *mut IbvWc) -> c_int;

/// Chains `wrs` (each to the next, the last to null) with one SGE each from `sges`, through
/// `set(wr, next, sge)`; returns the chain's head. Neither vector may be resized while the
/// chain is posted.
pub(super) fn link<T>(
    wrs: &mut [T],
    sges: &mut [IbvSge],
    set: impl Fn(&mut T, *mut T, *mut IbvSge),
) -> *mut T {
    let n = wrs.len().min(sges.len());
    let (base, sge_base) = (wrs.as_mut_ptr(), sges.as_mut_ptr());
    for i in 0..n {
        let next = if i + 1 < n {
            base.wrapping_add(i + 1)
        } else {
            null_mut()
        };
        // SAFETY: `i < n`, in bounds of both slices; every pointer comes from `base` and
        // `sge_base`, so none is invalidated by another borrow.
        unsafe { set(&mut *base.add(i), next, sge_base.add(i)) };
    }
    base
}

pub(super) fn access_flags(access: MrAccess) -> u32 {
    let mut flags = val::ACCESS_LOCAL_WRITE;
    if access.remote_write {
        flags |= val::ACCESS_REMOTE_WRITE;
    }
    if access.relaxed_ordering {
        flags |= val::ACCESS_RELAXED_ORDERING;
    }
    flags
}

pub(super) fn mtu_code(mtu: u32) -> u32 {
    match mtu {
        256 => 1,
        512 => 2,
        1024 => 3,
        2048 => 4,
        _ => 5,
    }
}

pub(super) fn state_code(state: QpState) -> u32 {
    match state {
        QpState::Reset => 0,
        QpState::Init => 1,
        QpState::Rtr => 2,
        QpState::Rts => 3,
        QpState::Error => 6,
    }
}

pub(super) fn status_of(code: u32) -> WcStatus {
    match code {
        0 => WcStatus::Success,
        1 => WcStatus::LocalLength,
        4 => WcStatus::LocalProtection,
        5 => WcStatus::Flushed,
        9 => WcStatus::RemoteInvalidRequest,
        10 => WcStatus::RemoteAccess,
        12 => WcStatus::RetryExceeded,
        13 => WcStatus::RnrRetryExceeded,
        other => WcStatus::Other(other),
    }
}

pub(super) fn post_err(rc: c_int, what: &'static str) -> VerbsError {
    if rc == libc::ENOMEM {
        VerbsError::Full(what)
    } else {
        VerbsError::Invalid(format!("{what}: {}", std::io::Error::from_raw_os_error(rc)))
    }
}
