//! Errors. [`TransportError`] is what an API call returns when a request is refused before
//! anything is posted; [`TransferError`] is what a posted transfer completes with (through its
//! `OnDone`). Every variant names what went wrong in terms a caller can act on.

use std::fmt;

/// Which side of a transfer a range or page refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The local source region.
    Source,
    /// The remote destination region.
    Destination,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Source => "source",
            Self::Destination => "destination",
        })
    }
}

/// A request refused before anything was posted. Nothing was transferred and no memory was
/// touched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// A byte range does not fit in its region.
    #[error("{side} range [{offset}, {offset}+{len}) exceeds the {region_len}-byte region")]
    OutOfBounds {
        /// Which region.
        side: Side,
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Length of the region.
        region_len: u64,
    },
    /// A page index addresses bytes past the end of its region.
    #[error(
        "{side} page index {index} (stride {stride}, offset {offset}, {page_len}-byte pages) exceeds the {region_len}-byte region"
    )]
    PageOutOfBounds {
        /// Which region.
        side: Side,
        /// The offending page index.
        index: u32,
        /// Bytes between consecutive pages.
        stride: u64,
        /// Offset of page 0.
        offset: u64,
        /// Bytes per page.
        page_len: u64,
        /// Length of the region.
        region_len: u64,
    },
    /// Pages would overlap: the stride is smaller than the page.
    #[error("{side} stride {stride} is smaller than the {page_len}-byte page")]
    StrideTooSmall {
        /// Which side.
        side: Side,
        /// The stride given.
        stride: u64,
        /// The page length.
        page_len: u64,
    },
    /// Source and destination page lists differ in length.
    #[error("{src} source pages but {dst} destination pages")]
    PageCountMismatch {
        /// Source pages.
        src: usize,
        /// Destination pages.
        dst: usize,
    },
    /// A transfer that would move nothing and notify nobody.
    #[error("the transfer is empty: no bytes and no immediate")]
    EmptyTransfer,
    /// The local handle is not registered with this engine (another engine's, or deregistered).
    #[error("the memory region handle is not registered with this engine")]
    UnknownRegion,
    /// The descriptor or address names a different number of NICs than this engine has;
    /// peers must use the same number of NICs per device (paper 002 section 3.2).
    #[error("the peer has {remote} NICs per device, this engine {local}")]
    NicCountMismatch {
        /// NICs of the local domain group.
        local: usize,
        /// NICs named by the peer.
        remote: usize,
    },
    /// The peer's address belongs to a different provider (mem, libfabric, verbs).
    #[error("the peer uses provider `{remote}`, this engine `{local}`")]
    ProviderMismatch {
        /// Local provider.
        local: String,
        /// Peer's provider.
        remote: String,
    },
    /// An address or descriptor that cannot be parsed.
    #[error("malformed peer address: {0}")]
    MalformedAddress(String),
    /// The peer group handle is not known to this engine.
    #[error("unknown peer group")]
    UnknownPeerGroup,
    /// A scatter or barrier names a different number of targets than its peer group has.
    #[error("{given} targets for a peer group of {group}")]
    PeerGroupSizeMismatch {
        /// Targets given.
        given: usize,
        /// Peers in the group.
        group: usize,
    },
    /// A scatter or barrier target is not a member of the named peer group.
    #[error("target {index} is not the peer group's member {index}")]
    NotInPeerGroup {
        /// Position of the target.
        index: usize,
    },
    /// A message larger than the receive buffers it would land in.
    #[error("{len}-byte message exceeds the {max}-byte limit")]
    MessageTooLarge {
        /// Message length.
        len: usize,
        /// Largest message accepted.
        max: usize,
    },
    /// A receive pool is already installed.
    #[error("a receive pool is already installed on this engine")]
    AlreadyReceiving,
    /// An invalid configuration or argument.
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// The immediate value is already watched (one watch per value).
    #[error("immediate {0} is already watched")]
    ImmWatched(u32),
    /// Expectations of the immediate value are waiting: a watch would take their arrivals.
    #[error("expectations of immediate {0} are waiting")]
    ImmAwaited(u32),
    /// Every immediate watch the engine has is in use.
    #[error("all {0} immediate watches are in use")]
    ImmWatchesFull(usize),
    /// The submission queue is full and the engine is configured not to wait.
    #[error("the submission queue is full")]
    QueueFull,

    /// Staging bytes asked for while lent out ([`crate::Staging`]).
    #[error("staging bytes [{offset}, {offset}+{len}) are {why}")]
    StagingBusy {
        /// First byte asked for.
        offset: usize,
        /// Bytes asked for.
        len: usize,
        /// Why they are not free: a write still reads them, or another view holds them.
        why: &'static str,
    },
    /// The engine has shut down.
    #[error("the engine has shut down")]
    Shutdown,
    /// The device of a registration is not served by this engine or its domains.
    #[error("device {0} is not supported by this engine's domains")]
    UnsupportedDevice(String),
    /// A domain (NIC backend) refused an operation.
    #[error("domain error: {0}")]
    Domain(String),
    /// The NIC backend asked for cannot be used here: its library is missing or too old, the
    /// provider is absent, or it lacks a capability the engine needs (remote CQ data, ...).
    #[error("provider unavailable: {0}")]
    ProviderUnavailable(String),
}

/// How a posted transfer failed. Delivered through its `OnDone`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// The target refused the access: unknown or stale rkey, or an address outside the
    /// registered region (a forged descriptor). The target memory is untouched.
    #[error("remote access error: {0}")]
    RemoteAccess(String),
    /// The peer is gone (process exit, link down, or told to disappear).
    #[error("peer unreachable")]
    PeerUnreachable,
    /// The receiver's buffers are smaller than the message.
    #[error("the receiver's buffer is too small for the message")]
    RemoteBufferTooSmall,
    /// The request was cancelled; everything already posted has completed.
    #[error("cancelled")]
    Cancelled,
    /// The engine shut down before the transfer completed.
    #[error("the engine shut down")]
    Shutdown,
    /// A failure injected by the `mem` domain's fault plan.
    #[error("injected failure")]
    Injected,
    /// A provider-specific error, with the provider's message.
    #[error("provider error: {0}")]
    Provider(String),
    /// An expectation of an immediate value that is watched: its arrivals go to the watch.
    #[error("immediate {0} is watched: its arrivals go to the watch, not to expectations")]
    ImmWatched(u32),
    /// The NIC reported no completion within the deadline: the peer is gone or silently
    /// refused the access (libfabric's shm provider does not answer a refused write).
    #[error("no completion within {0:?}: the peer is gone or refused the access")]
    TimedOut(std::time::Duration),
}

impl TransferError {
    /// Every kind [`TransferError::kind`] names, in a fixed order.
    pub const KINDS: [&'static str; 9] = [
        "remote_access",
        "peer_unreachable",
        "remote_buffer_too_small",
        "cancelled",
        "shutdown",
        "injected",
        "provider",
        "imm_watched",
        "timed_out",
    ];

    /// The error's kind, without its details: a metrics label.
    pub fn kind(&self) -> &'static str {
        Self::KINDS[self.kind_index()]
    }

    /// The index of [`TransferError::kind`] in [`TransferError::KINDS`].
    pub(crate) fn kind_index(&self) -> usize {
        match self {
            Self::RemoteAccess(_) => 0,
            Self::PeerUnreachable => 1,
            Self::RemoteBufferTooSmall => 2,
            Self::Cancelled => 3,
            Self::Shutdown => 4,
            Self::Injected => 5,
            Self::Provider(_) => 6,
            Self::ImmWatched(_) => 7,
            Self::TimedOut(_) => 8,
        }
    }
}
