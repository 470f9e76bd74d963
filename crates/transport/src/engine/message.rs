//! What application threads send a domain-group worker: validated, resolved transfers (no
//! allocation beyond what the request itself carries) and control commands with a reply.

use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Sender;

use super::shared::PeerEntry;
use crate::addr::{MAX_NICS, NetAddr};
use crate::error::TransportError;
use crate::mr::{Access, Device, MrDesc, MrHandle, RegionKey};
use crate::on_done::OnDone;
use crate::request::Pages;

/// A local source: its address and one local key per NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LocalSrc {
    pub(crate) addr: u64,
    pub(crate) lkeys: [u64; MAX_NICS],
}

/// A resolved remote region: peer index in the group's table, base address, one rkey per NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RemoteTarget {
    pub(crate) peer: u32,
    pub(crate) addr: u64,
    pub(crate) rkeys: [u64; MAX_NICS],
}

/// One resolved scatter target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ScatterTarget {
    pub(crate) dst: RemoteTarget,
    pub(crate) len: u64,
    pub(crate) src_offset: u64,
    pub(crate) dst_offset: u64,
}

/// One-sided writes, checked and resolved on the submitting thread.
#[derive(Debug)]
pub(crate) enum Writes {
    Single {
        src: LocalSrc,
        dst: RemoteTarget,
        src_offset: u64,
        dst_offset: u64,
        len: u64,
        imm: Option<u32>,
    },
    Paged {
        src: LocalSrc,
        dst: RemoteTarget,
        page_len: u64,
        src_pages: Pages,
        dst_pages: Pages,
        imm: Option<u32>,
    },
    Imm {
        dst: RemoteTarget,
        imm: u32,
    },
    Scatter {
        src: LocalSrc,
        targets: Vec<ScatterTarget>,
        imm: Option<u32>,
    },
    Barrier {
        targets: Vec<RemoteTarget>,
        imm: u32,
    },
}

/// A transfer: writes, or one message to a peer's receive buffers.
#[derive(Debug)]
pub(crate) enum Work {
    Writes(Writes),
    Send { peer: u32, payload: Box<[u8]> },
}

/// A transfer as submitted. Its completion state is made by the worker that takes it, so the
/// state's cache line starts out where it is used.
#[derive(Debug)]
pub(crate) struct Submission {
    pub(crate) work: Work,
    pub(crate) on_done: OnDone,
    /// When the application called submit (only when latency recording is on).
    pub(crate) submitted_at: Option<Instant>,
}

/// Control-plane requests; each answers on its own channel.
#[derive(Debug)]
pub(crate) enum Command {
    Register {
        addr: u64,
        len: u64,
        device: Device,
        access: Access,
        reply: Sender<Result<(MrHandle, MrDesc), TransportError>>,
    },
    Deregister {
        key: RegionKey,
        reply: Sender<Result<(), TransportError>>,
    },
    Connect {
        addr: NetAddr,
        reply: Sender<Result<Arc<PeerEntry>, TransportError>>,
    },
    Disconnect {
        addr: NetAddr,
        reply: Sender<Result<bool, TransportError>>,
    },
    SenderAddress {
        addr: NetAddr,
        reply: Sender<Result<Option<NetAddr>, TransportError>>,
    },
    AdoptSender {
        addr: NetAddr,
        sender: NetAddr,
        reply: Sender<Result<(), TransportError>>,
    },
    InstallRecvPool {
        buf_len: usize,
        count: u32,
        reply: Sender<Result<(), TransportError>>,
    },
    Stop,
}

/// One entry of a worker's queue. Transfers and commands share the queue so that a thread's
/// requests are handled in the order it made them.
#[derive(Debug)]
pub(crate) enum Message {
    Transfer(Submission),
    Command(Command),
}
