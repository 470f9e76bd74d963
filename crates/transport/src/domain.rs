//! The [`Domain`] trait: one NIC, as the engine drives it.
//!
//! A domain registers memory, connects to peer NICs, posts writes (with or without an
//! immediate), sends and receives, and reports completions in a backend-neutral form. The
//! shape fits the two production backends without changes:
//!
//! - ConnectX over verbs (RC): `connect` creates the two queue pairs a peer needs (one for
//!   send/recv, one for writes, paper 002 section 3.5) and `post_writes` takes a batch so the
//!   domain can chain up to four work requests per doorbell; receives with immediate consume
//!   work requests the domain keeps posted on the write queue pair and surface as
//!   [`CompletionKind::Arrival`].
//! - EFA over libfabric (RDM/SRD): `connect` inserts the peer into the address vector, the
//!   immediate travels as remote CQ data, and `post_writes` returning fewer than asked is how
//!   `-FI_EAGAIN` back-pressure reaches the engine.
//!
//! Everything is called from the one worker thread that owns the domain.

use std::sync::Arc;
use std::time::Instant;

use crate::addr::DomainAddr;
use crate::error::{TransferError, TransportError};
use crate::mr::{Access, Device};

/// A peer NIC as one domain knows it (an index into its peer table or address vector).
pub type PeerId = u32;

/// What registering a region with one domain produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registration {
    /// Local key: names the region as a source in this domain's work requests.
    pub lkey: u64,
    /// Remote key: what peers present to write into the region through this NIC.
    pub rkey: u64,
    /// The region's base address as peers must address it: its virtual address, or 0 for
    /// providers that address registered memory by offset.
    pub remote_addr: u64,
}

/// One one-sided write. `len` may be 0 for an immediate-only write (the descriptors must still
/// be valid: EFA requires it, paper 002 section 3.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Target NIC.
    pub peer: PeerId,
    /// Source address, inside a region registered with this domain.
    pub src_addr: u64,
    /// The source region's local key.
    pub lkey: u64,
    /// Bytes to write.
    pub len: u64,
    /// Target address (as the target domain addresses it).
    pub dst_addr: u64,
    /// The target region's remote key for this NIC.
    pub rkey: u64,
    /// The immediate delivered to the target with the data.
    pub imm: Option<u32>,
}

/// What became of [`Domain::post_unreported`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreported {
    /// Posted; no completion will follow.
    Posted,
    /// The NIC is full for now.
    Full,
    /// The NIC does not post this write without a completion.
    Unsupported,
}

/// One message to a peer's posted receive buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Target NIC.
    pub peer: PeerId,
    /// Payload address (engine-owned memory).
    pub addr: u64,
    /// Payload length.
    pub len: u64,
}

/// One receive buffer to post.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWr {
    /// Returned in the completion.
    pub wr_id: u64,
    /// Buffer address, inside a region registered with this domain.
    pub addr: u64,
    /// Buffer length.
    pub len: u64,
    /// The buffer region's local key.
    pub lkey: u64,
}

/// What completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionKind {
    /// Posted writes finished (delivered and acknowledged).
    Write,
    /// A posted send finished.
    Send,
    /// A posted receive buffer holds a message of `len` bytes.
    Recv {
        /// Message length.
        len: u64,
        /// The connected peer it came from, as the NIC attests it (`FI_SOURCE`; the `mem`
        /// domain knows its sender), or `None` when the sender is not a peer of this NIC.
        from: Option<PeerId>,
    },
    /// A peer's write with an immediate has fully landed in local memory.
    Arrival {
        /// The immediate.
        imm: u32,
    },
}

/// One completion, or several of the same work request coalesced (`count`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The work request's id (unused for arrivals).
    pub wr_id: u64,
    /// How many work requests (or arrivals) this reports, all with the same result.
    pub count: u32,
    /// What completed.
    pub kind: CompletionKind,
    /// How it ended.
    pub result: Result<(), TransferError>,
}

/// Wakes the worker that owns a domain when something arrives for it from outside (a peer's
/// write in the `mem` domain, a completion-channel event on hardware).
pub trait Notify: Send + Sync {
    /// Wakes the worker if it is parked; cheap if it is not.
    fn notify(&self);
}

/// One NIC.
pub trait Domain: Send + 'static {
    /// The provider name carried in addresses (`mem`, `fabric:efa`, `verbs`, ...).
    fn provider(&self) -> &str;

    /// This NIC's address.
    fn address(&self) -> DomainAddr;

    /// Whether memory on `device` can be registered.
    fn supports(&self, device: Device) -> bool;

    /// Registers `[addr, addr + len)` on `device` for local access and, with
    /// [`Access::RemoteWrite`], for peers' writes; a peer's write into a region registered
    /// [`Access::Local`] must fail at this NIC and change nothing.
    ///
    /// # Safety
    /// The range must stay valid, allocated and unmoved until [`Domain::deregister`] returns.
    unsafe fn register(
        &mut self,
        addr: u64,
        len: u64,
        device: Device,
        access: Access,
    ) -> Result<Registration, TransportError>;

    /// Deregisters the region of `lkey`. After it returns no peer write can reach the region.
    fn deregister(&mut self, lkey: u64) -> Result<(), TransportError>;

    /// Makes `peer` reachable and returns its id. Idempotent per address.
    fn connect(&mut self, peer: &DomainAddr) -> Result<PeerId, TransportError>;

    /// Releases `peer` and everything this NIC holds for it (its address-vector entry, a
    /// transmit endpoint of its own, a provider's mapping of its memory). Its writes and sends
    /// still queued or in flight fail ([`TransferError::PeerUnreachable`], reported by
    /// [`Domain::poll`]); posts to `peer` fail from now on, until a later [`Domain::connect`]
    /// reuses the id for some address. An unknown or released id is an error.
    fn disconnect(&mut self, peer: PeerId) -> Result<(), TransportError>;

    /// The address this NIC's operations to `peer` leave from, when that is not
    /// [`Domain::address`]: a provider with a transmit endpoint per peer (`shm`) sends from
    /// it, and a receiver that maps its senders (`shm` again) needs that name to forget it
    /// ([`Domain::adopt_sender`]). `None` when operations leave from this NIC's own address.
    fn sender_name(&mut self, _peer: PeerId) -> Result<Option<DomainAddr>, TransportError> {
        Ok(None)
    }

    /// Records that `peer` sends to this NIC from `sender` (what its [`Domain::sender_name`]
    /// returned), so that releasing `peer` also releases what this NIC holds for that sender
    /// once the sender can no longer send. A NIC that keeps nothing per sender accepts and
    /// ignores it. A `sender` that is not `peer`'s (another process's) is an error.
    fn adopt_sender(&mut self, _peer: PeerId, _sender: &DomainAddr) -> Result<(), TransportError> {
        Ok(())
    }

    /// Posts writes in order; returns how many were accepted. Fewer than `wrs.len()` means the
    /// NIC is full for now (retry the rest later); an error means the request was malformed.
    fn post_writes(&mut self, wrs: &[WriteWr]) -> Result<usize, TransportError>;

    /// Posts one write whose success this NIC will never report: no completion, no work
    /// request id. Only a write small enough for the NIC to copy at the post qualifies (the
    /// engine offers immediate-only writes nobody waits on). [`Unreported::Unsupported`] when
    /// the NIC cannot post this write that way (post it with [`Domain::post_writes`]).
    fn post_unreported(&mut self, _wr: &WriteWr) -> Result<Unreported, TransportError> {
        Ok(Unreported::Unsupported)
    }

    /// Whether [`Domain::post_unreported`] may ever post: asked once, so that the writes of
    /// a NIC that never does are not offered to it one by one.
    fn posts_unreported(&self) -> bool {
        false
    }

    /// Posts a send; `false` means the NIC is full for now.
    ///
    /// # Safety
    /// The payload must stay valid and unchanged until the send's completion is polled.
    unsafe fn post_send(&mut self, wr: &SendWr) -> Result<bool, TransportError>;

    /// Posts a receive buffer; `false` means the NIC is full for now.
    ///
    /// # Safety
    /// The buffer must stay valid and must not be read or written until its completion is
    /// polled.
    unsafe fn post_recv(&mut self, wr: &RecvWr) -> Result<bool, TransportError>;

    /// Appends up to `max` completions to `out`; returns how many.
    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize;

    /// Installs the waker of the worker that owns this domain.
    fn set_notify(&mut self, notify: Arc<dyn Notify>);

    /// When the domain next has timed work to do (delayed deliveries, retries), if ever.
    fn next_deadline(&self) -> Option<Instant> {
        None
    }

    /// Whether the worker may park when idle and rely on [`Notify`] (and `next_deadline`) to
    /// be woken; a domain that must be polled continuously returns false.
    fn may_park(&self) -> bool {
        false
    }
}
