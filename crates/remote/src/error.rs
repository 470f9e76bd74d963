//! The crate's errors: [`RemoteError`] for setting up and running holders and requesters,
//! [`RouteError`] for one call of a step (which fails alone while the others go on).

use std::net::SocketAddr;
use std::time::Duration;

use kvroute_kernels::KernelError;
use kvroute_kvstore::{ChunkId, StoreError};
use kvroute_transport::TransportError;

use crate::wire::Status;

/// Why setting up, or talking to, a holder failed.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// A configuration value is out of its range (the message names it).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The chunks handed to a holder do not describe what its store holds.
    #[error("invalid chunks: {0}")]
    Chunks(String),
    /// The holder's control listener could not be reached.
    #[error("connecting to holder {holder}: {source}")]
    Unreachable {
        /// The holder's control address.
        holder: SocketAddr,
        /// What the socket said.
        source: std::io::Error,
    },
    /// The holder serves its cap of requesters: try later or another replica.
    #[error("holder {holder} is busy ({active} of {cap} requesters)")]
    HolderBusy {
        /// The holder's control address.
        holder: SocketAddr,
        /// Requesters it serves.
        active: usize,
        /// Its cap.
        cap: usize,
    },
    /// The holder refused the session (its reason).
    #[error("holder {holder} refused the session: {why}")]
    SessionRefused {
        /// The holder's control address.
        holder: SocketAddr,
        /// Its reason.
        why: String,
    },
    /// The holder's welcome named an engine no directory record of its address lists: the
    /// session was closed unused.
    #[error("holder {holder} answers for an engine that no record of its address lists")]
    UnlistedEngine {
        /// The holder's control address.
        holder: SocketAddr,
    },
    /// The holder did not answer on its control connection in time.
    #[error("holder {holder} did not answer within {after:?}")]
    TimedOut {
        /// The holder's control address.
        holder: SocketAddr,
        /// How long the requester waited.
        after: Duration,
    },
    /// The control connection failed or closed.
    #[error("control connection to {peer}: {source}")]
    Control {
        /// The other end.
        peer: SocketAddr,
        /// What the socket said.
        source: std::io::Error,
    },
    /// A control line did not parse (it came from a peer: never trusted).
    #[error("malformed control line from {peer}: {why}")]
    MalformedControl {
        /// The other end.
        peer: SocketAddr,
        /// What was wrong.
        why: String,
    },
    /// There is no holder with that index.
    #[error("no holder {0}")]
    NoSuchHolder(usize),
    /// A chunk is not (or is no longer) where the call expects it.
    #[error("{chunk}: {why}")]
    Chunk {
        /// The chunk.
        chunk: ChunkId,
        /// What is wrong.
        why: String,
    },
    /// A route, fetch or gather call failed.
    #[error(transparent)]
    Route(#[from] RouteError),
    /// A call of a step failed where no replica could take it.
    #[error("{chunk}: {source}")]
    CallFailed {
        /// The call's chunk.
        chunk: ChunkId,
        /// What happened.
        source: RouteError,
    },
    /// A [`crate::BackgroundRequester`]'s thread ended before answering.
    #[error("the requester's thread stopped before answering")]
    Stopped,
    /// A measurement found nothing to fit (the message says what it saw).
    #[error("probe: {0}")]
    Probe(String),
    /// The cost model refused the measured constants.
    #[error(transparent)]
    CostModel(#[from] kvroute_costmodel::CostModelError),
    /// The transfer engine refused an operation.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A KV block or the registry refused an operation.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A kernel refused its inputs.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A socket or thread could not be set up.
    #[error("{what}: {source}")]
    Io {
        /// What was being set up.
        what: &'static str,
        /// What the system said.
        source: std::io::Error,
    },
}

impl RemoteError {
    /// Wraps a system error with what was being done.
    pub(crate) fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> Self {
        move |source| Self::Io { what, source }
    }
}

/// Why one call (one chunk of one step) failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouteError {
    /// No live holder has the chunk.
    #[error("no live holder has {0}")]
    NoHolder(ChunkId),
    /// The holder refused the segment or the request.
    #[error("holder {holder} refused: {status}")]
    Refused {
        /// The holder's control address.
        holder: SocketAddr,
        /// Its status.
        status: Status,
    },
    /// The holder did not answer within the requester's timeout; it is now dead here.
    #[error("holder {holder} did not answer within {after:?}")]
    TimedOut {
        /// The holder's control address.
        holder: SocketAddr,
        /// The timeout.
        after: Duration,
    },
    /// The transfer to or from the holder failed; it is now dead here.
    #[error("holder {holder} failed: {why}")]
    HolderFailed {
        /// The holder's control address.
        holder: SocketAddr,
        /// What happened.
        why: String,
    },
    /// The request does not fit the link's buffers.
    #[error("request too large: {0} bytes")]
    TooLarge(usize),
    /// The reply did not decode.
    #[error("malformed reply from {holder}: {why}")]
    BadReply {
        /// The holder's control address.
        holder: SocketAddr,
        /// What was wrong.
        why: String,
    },
}

impl RouteError {
    /// Whether the holder is gone for this requester (a replica should take its chunks), as
    /// opposed to a refusal of this one call.
    pub fn holder_lost(&self) -> bool {
        matches!(self, Self::TimedOut { .. } | Self::HolderFailed { .. })
    }
}
