//! The `verbs` domain: ConnectX (and any RC-capable RDMA NIC) through the verbs API, shaped as
//! paper 002 section 3.5 describes fabric-lib's: per peer, two RC queue pairs (one for
//! SEND/RECV, one for WRITE and WRITE_WITH_IMM), connected by a handshake over a UD queue pair;
//! writes posted as chains of up to four work requests per doorbell; every completion,
//! immediates included, counted through the engine's IMM counter as on EFA.
//!
//! The domain ([`VerbsDomain`]) speaks to the NIC through the [`Verbs`] trait, a typed mirror of
//! the ibverbs calls it makes. Two implementations:
//!
//! - `fake::FakeFabric` (with the `fake-verbs` feature, which this crate's own tests turn
//!   on): in-process devices whose queue pairs, completion queues, shared receive queues and
//!   memory regions enforce what hardware enforces (QP states and their transitions, rkeys,
//!   bounds and access, receive-not-ready, a dead peer's retry-exceeded), and can delay,
//!   reorder and fail work requests from a seed. The transport's shared domain suite runs
//!   over it.
//! - [`HwVerbs`]: a real device through `libibverbs.so.1` loaded at run time (nothing is
//!   linked, no RDMA headers are needed to build; [`sys`] says what is missing where it cannot
//!   open). Its struct layouts are checked against rdma-core's `verbs.h`; nothing of this
//!   module has run on an RDMA NIC (docs/fabric.md).

#[cfg(feature = "cuda")]
pub mod cuda;
mod domain;
#[cfg(feature = "fake-verbs")]
pub mod fake;
mod hw;
pub mod sys;

use std::time::Duration;

pub use domain::{Handshake, VerbsAddr, VerbsDomain};
pub use hw::HwVerbs;

use crate::error::TransportError;

/// The provider name of verbs addresses.
pub const PROVIDER: &str = "verbs";

/// The status number a fake device's injected failure completes with (no real device's).
pub(crate) const INJECTED_STATUS: u32 = 0xFA17;
/// Bytes of global routing header in front of every UD receive.
pub(crate) const GRH_BYTES: u32 = 40;

/// A queue pair's state (`enum ibv_qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Just created, or reset.
    Reset,
    /// Initialised: receives may be posted.
    Init,
    /// Ready to receive: connected to its remote queue pair.
    Rtr,
    /// Ready to send.
    Rts,
    /// Failed: every outstanding and later work request is flushed.
    Error,
}

/// Which transport a queue pair uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpKind {
    /// Reliable connected: one remote queue pair.
    Rc,
    /// Unreliable datagram: the handshake's.
    Ud,
}

/// How a work request ended (`enum ibv_wc_status`, the cases the domain tells apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcStatus {
    /// `IBV_WC_SUCCESS`.
    Success,
    /// `IBV_WC_LOC_LEN_ERR`: a message longer than the receive buffer.
    LocalLength,
    /// `IBV_WC_LOC_PROT_ERR`: a local key or range the NIC refused.
    LocalProtection,
    /// `IBV_WC_WR_FLUSH_ERR`: flushed because the queue pair went to the error state.
    Flushed,
    /// `IBV_WC_REM_ACCESS_ERR`: the target refused the rkey, the range or the access.
    RemoteAccess,
    /// `IBV_WC_REM_INV_REQ_ERR`: the target found the request invalid (message too long).
    RemoteInvalidRequest,
    /// `IBV_WC_RETRY_EXC_ERR`: no acknowledgement after every retry: the peer is gone.
    RetryExceeded,
    /// `IBV_WC_RNR_RETRY_EXC_ERR`: the receiver never posted a buffer.
    RnrRetryExceeded,
    /// Any other status, by number.
    Other(u32),
}

/// What a completion reports (`enum ibv_wc_opcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// A posted RDMA write (with or without immediate).
    RdmaWrite,
    /// A posted send.
    Send,
    /// A received message.
    Recv,
    /// A peer's write with immediate landed (consumed a receive).
    RecvRdmaWithImm,
}

/// One work completion (`struct ibv_wc`, the fields the domain reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wc {
    /// The work request's id.
    pub wr_id: u64,
    /// How it ended.
    pub status: WcStatus,
    /// What it was.
    pub opcode: WcOpcode,
    /// Bytes received (receives).
    pub byte_len: u32,
    /// The immediate (receives of a write or send with immediate).
    pub imm: Option<u32>,
    /// The local queue pair it completed on.
    pub qp_num: u32,
    /// The sender's queue pair (UD receives).
    pub src_qp: u32,
}

/// A scatter-gather element (`struct ibv_sge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Local address.
    pub addr: u64,
    /// Bytes.
    pub len: u32,
    /// The region's local key.
    pub lkey: u32,
}

/// What a send-queue work request does (`ibv_send_wr.opcode` and its union).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// `IBV_WR_RDMA_WRITE` / `IBV_WR_RDMA_WRITE_WITH_IMM` to `remote_addr` through `rkey`.
    Write {
        /// Target address.
        remote_addr: u64,
        /// Target region's remote key.
        rkey: u32,
        /// The immediate, if any.
        imm: Option<u32>,
    },
    /// `IBV_WR_SEND` on an RC queue pair.
    Send,
    /// `IBV_WR_SEND` on a UD queue pair to `(remote_qpn, qkey)` at `dest` (an address
    /// handle's contents).
    UdSend {
        /// The destination port.
        dest: PortAddr,
        /// The destination UD queue pair.
        remote_qpn: u32,
        /// Its queue key.
        qkey: u32,
    },
}

/// One send-queue work request (`struct ibv_send_wr` with one SGE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// The local bytes (`len` 0 for an immediate-only write).
    pub sge: Sge,
    /// What to do.
    pub op: SendOp,
    /// `IBV_SEND_SIGNALED`: produce a completion on success too.
    pub signaled: bool,
}

/// One receive work request (`struct ibv_recv_wr` with one SGE).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// The buffer.
    pub sge: Sge,
}

/// A port's address: what an address handle or an RC path is built from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PortAddr {
    /// The GID at the configured index (RoCE and routed InfiniBand).
    pub gid: [u8; 16],
    /// The LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The port number.
    pub port: u8,
}

/// Access a memory region grants (`IBV_ACCESS_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MrAccess {
    /// `IBV_ACCESS_REMOTE_WRITE`.
    pub remote_write: bool,
    /// `IBV_ACCESS_RELAXED_ORDERING` (paper 002 section 3.5).
    pub relaxed_ordering: bool,
}

/// The attributes of one `ibv_modify_qp` (the fields each transition needs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAttr {
    /// The state to move to.
    pub state: QpState,
    /// INIT: the port, and whether peers may write (RC write QPs).
    pub port: u8,
    /// INIT: remote writes allowed.
    pub remote_write: bool,
    /// INIT (UD): the queue key.
    pub qkey: u32,
    /// RTR (RC): the remote port.
    pub dest: Option<PortAddr>,
    /// RTR (RC): the remote queue pair.
    pub dest_qp_num: u32,
    /// RTR: the first PSN expected.
    pub rq_psn: u32,
    /// RTS: the first PSN sent.
    pub sq_psn: u32,
    /// RTR: path MTU, bytes.
    pub mtu: u32,
    /// RTR: the GID index of the source.
    pub sgid_index: u8,
    /// RTR: the traffic class.
    pub traffic_class: u8,
    /// RTS: local ACK timeout, `4.096 us x 2^timeout`.
    pub timeout: u8,
    /// RTS: transport retries.
    pub retry_cnt: u8,
    /// RTS: receiver-not-ready retries (7: forever).
    pub rnr_retry: u8,
    /// RTR: the receiver-not-ready delay code.
    pub min_rnr_timer: u8,
}

/// A refused verbs call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    /// The call is not valid in the queue pair's state (`EINVAL` from `ibv_post_send` on a QP
    /// not in RTS, or a transition the state machine does not have).
    #[error("queue pair {qpn} is in state {state:?}: {what} is not allowed")]
    QpState {
        /// The queue pair.
        qpn: u32,
        /// Its state.
        state: QpState,
        /// What was attempted.
        what: &'static str,
    },
    /// A queue is full (`ENOMEM`).
    #[error("{0} is full")]
    Full(&'static str),
    /// An argument the device refuses (`EINVAL`), with the reason.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// The device is gone.
    #[error("the device is gone")]
    DeviceGone,
}

impl From<VerbsError> for TransportError {
    fn from(e: VerbsError) -> Self {
        TransportError::Domain(format!("verbs: {e}"))
    }
}

/// The verbs calls the domain makes, on one opened device and port with one protection
/// domain and one completion queue: a typed mirror of ibverbs.
pub trait Verbs: Send + 'static {
    /// The port's address (`ibv_query_port`, `ibv_query_gid` at the configured index).
    fn port_addr(&self) -> PortAddr;
    /// `ibv_reg_mr`: returns `(lkey, rkey)`.
    ///
    /// # Safety
    /// The range must stay valid until [`Verbs::dereg_mr`] returns for its key.
    unsafe fn reg_mr(
        &mut self,
        addr: u64,
        len: u64,
        access: MrAccess,
    ) -> Result<(u32, u32), VerbsError>;
    /// `ibv_reg_dmabuf_mr`: `len` bytes at `offset` of the dma-buf `fd` (device memory an
    /// exporter such as CUDA handed out), addressed by peers as `iova`; returns
    /// `(lkey, rkey)`.
    ///
    /// # Safety
    /// The dma-buf's memory must stay allocated until [`Verbs::dereg_mr`] returns.
    unsafe fn reg_dmabuf_mr(
        &mut self,
        fd: i32,
        offset: u64,
        len: u64,
        iova: u64,
        access: MrAccess,
    ) -> Result<(u32, u32), VerbsError>;
    /// `ibv_dereg_mr`.
    fn dereg_mr(&mut self, lkey: u32) -> Result<(), VerbsError>;
    /// `ibv_create_srq`: a shared receive queue of `depth` work requests.
    fn create_srq(&mut self, depth: u32) -> Result<u32, VerbsError>;
    /// `ibv_create_qp` of `kind` on the one completion queue, receiving through `srq` if given;
    /// returns the queue pair number (state RESET).
    fn create_qp(
        &mut self,
        kind: QpKind,
        srq: Option<u32>,
        sq_depth: u32,
    ) -> Result<u32, VerbsError>;
    /// `ibv_modify_qp`.
    fn modify_qp(&mut self, qpn: u32, attr: &QpAttr) -> Result<(), VerbsError>;
    /// `ibv_destroy_qp`: its outstanding work is gone; peers' requests to it fail.
    fn destroy_qp(&mut self, qpn: u32) -> Result<(), VerbsError>;
    /// `ibv_post_send` of `wrs` chained (`next` pointers) and rung with one doorbell.
    ///
    /// # Safety
    /// Every SGE's bytes must stay valid and unchanged until their completion is polled (or,
    /// unsignaled, until a later signaled one on the same queue pair is).
    unsafe fn post_send(&mut self, qpn: u32, wrs: &[SendWr]) -> Result<(), VerbsError>;
    /// `ibv_post_srq_recv` of `wrs`.
    ///
    /// # Safety
    /// Every buffer must stay valid and untouched until its completion is polled.
    unsafe fn post_srq_recv(&mut self, srq: u32, wrs: &[RecvWr]) -> Result<(), VerbsError>;
    /// `ibv_post_recv` of `wrs` on a queue pair without a shared receive queue (UD).
    ///
    /// # Safety
    /// As [`Verbs::post_srq_recv`].
    unsafe fn post_recv(&mut self, qpn: u32, wrs: &[RecvWr]) -> Result<(), VerbsError>;
    /// `ibv_poll_cq`: appends up to `max` completions.
    fn poll_cq(&mut self, out: &mut Vec<Wc>, max: usize) -> usize;
    /// Doorbells rung so far (one per `post_send` / `post_*recv` call).
    fn doorbells(&self) -> u64;
    /// Installs the waker of the worker that owns the domain (the completion channel's event).
    fn set_notify(&mut self, notify: std::sync::Arc<dyn crate::domain::Notify>);
    /// When queued work is next due (a device that delays deliveries).
    fn next_deadline(&self) -> Option<std::time::Instant> {
        None
    }

    /// Whether the worker may park and rely on [`Verbs::set_notify`]'s waker; a device
    /// without a completion channel must be polled.
    fn may_park(&self) -> bool {
        true
    }
}

/// Hands out device memory as a dma-buf the NIC can register (GPUDirect RDMA without the
/// `nvidia-peermem` module): CUDA's `cuMemGetHandleForAddressRange`, or the fake's.
pub trait DmaBufExporter: Send + 'static {
    /// The device whose memory this exports.
    fn device(&self) -> crate::mr::Device;
    /// A dma-buf file descriptor covering `[addr, addr + len)` and the offset of `addr` in
    /// it, to be given back with [`DmaBufExporter::release`] once registered.
    fn export(&self, addr: u64, len: u64) -> Result<(i32, u64), TransportError>;
    /// Gives back a descriptor [`DmaBufExporter::export`] returned (closes it).
    fn release(&self, fd: i32);
}

/// Everything fabric-lib hard-codes, with its defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsConfig {
    /// The device (`mlx5_0`, ...); the first one found if `None`.
    pub device: Option<String>,
    /// The port.
    pub port: u8,
    /// The GID index (3 is RoCE v2 over IPv4 on a typical ConnectX setup; 0 on InfiniBand).
    pub gid_index: u8,
    /// Path MTU, bytes (256-4096).
    pub mtu: u32,
    /// Traffic class of RC traffic.
    pub traffic_class: u8,
    /// Local ACK timeout code (`4.096 us x 2^timeout`; 14 is 67 ms).
    pub timeout: u8,
    /// Transport retries before retry-exceeded (at most 7).
    pub retry_cnt: u8,
    /// Receiver-not-ready retries (7: forever).
    pub rnr_retry: u8,
    /// Receiver-not-ready delay code (12 is 0.64 ms).
    pub min_rnr_timer: u8,
    /// Send-queue depth of each RC queue pair.
    pub sq_depth: u32,
    /// Work requests chained per doorbell (paper 002: 4).
    pub max_chain: usize,
    /// Receives kept posted for peers' immediates (shared by the write queue pairs).
    pub imm_recvs: u32,
    /// The UD handshake's queue key.
    pub qkey: u32,
    /// How often an unanswered handshake is sent again.
    pub handshake_retry: Duration,
    /// How long a peer may stay unconnected before its queued work fails.
    pub connect_timeout: Duration,
    /// Register memory with relaxed ordering (paper 002 section 3.5).
    pub relaxed_ordering: bool,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        Self {
            device: None,
            port: 1,
            gid_index: 0,
            mtu: 4096,
            traffic_class: 0,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            sq_depth: 256,
            max_chain: 4,
            imm_recvs: 1024,
            qkey: 0x1111_1111,
            handshake_retry: Duration::from_millis(50),
            connect_timeout: Duration::from_secs(5),
            relaxed_ordering: true,
        }
    }
}

impl VerbsConfig {
    /// Checks every field against what verbs accepts.
    pub fn validate(&self) -> Result<(), TransportError> {
        if ![256, 512, 1024, 2048, 4096].contains(&self.mtu) {
            return Err(TransportError::InvalidArgument(
                "verbs MTU must be 256, 512, 1024, 2048 or 4096",
            ));
        }
        if self.retry_cnt > 7 || self.rnr_retry > 7 || self.timeout > 31 || self.min_rnr_timer > 31
        {
            return Err(TransportError::InvalidArgument(
                "verbs retry counts are at most 7, timer codes at most 31",
            ));
        }
        if self.sq_depth == 0 || self.imm_recvs == 0 || self.max_chain == 0 {
            return Err(TransportError::InvalidArgument(
                "verbs queue depths and the chain length must be positive",
            ));
        }
        if self.port == 0 {
            return Err(TransportError::InvalidArgument("verbs ports count from 1"));
        }
        Ok(())
    }
}
