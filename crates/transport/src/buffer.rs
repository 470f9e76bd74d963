//! [`RegisteredBuffer`]: host memory the engine allocates, registers, and frees, so a caller
//! needs no `unsafe` to have a region to write from or into; and [`Grant`]: a window onto part
//! of one that a peer may write through for as long as the grant lives.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::engine::TransferEngine;
use crate::error::Side;
use crate::error::TransportError;
use crate::mr::{Access, Device, MrDesc, MrHandle, check_range};

/// Alignment of engine-allocated buffers: a page (a NIC registers whole pages, and the
/// kernel copies file data into a page-aligned destination faster: the storage tier's reads
/// land in these).
const ALIGN: usize = 4096;

/// Zeroed, page-aligned host memory, freed when the last of its owners goes: the buffer and
/// every [`Grant`] onto it, each of which deregisters before it lets go.
struct Allocation {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: plain memory owned by this value; who reads and writes it when is the owners'
// protocol (see `RegisteredBuffer`).
unsafe impl Send for Allocation {}
// SAFETY: as above.
unsafe impl Sync for Allocation {}

impl Allocation {
    fn new(len: usize) -> Result<Self, TransportError> {
        let layout = Layout::from_size_align(len, ALIGN)
            .map_err(|_| TransportError::InvalidArgument("buffer length too large"))?;
        if len == 0 {
            return Err(TransportError::InvalidArgument("a buffer needs a length"));
        }
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })
            .ok_or(TransportError::Domain("out of memory".to_owned()))?;
        Ok(Self { ptr, len })
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout (which was valid then), freed once.
        unsafe {
            dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len, ALIGN),
            )
        };
    }
}

/// Registered host memory owned by the engine. Peers write into it through [`Self::desc`];
/// it is the source of local writes through [`Self::handle`].
///
/// Reading bytes that a peer is writing at the same moment returns unspecified values, as it
/// would with a NIC: a protocol reads a range after the immediates of the writes into it have
/// been counted.
pub struct RegisteredBuffer {
    engine: TransferEngine,
    mem: Arc<Allocation>,
    handle: MrHandle,
    desc: MrDesc,
    access: Access,
}

// SAFETY: the buffer owns its allocation; shared access goes through raw-pointer copies whose
// ordering against peers' writes is the protocol's (see the type's docs), as with memory a NIC
// writes.
unsafe impl Send for RegisteredBuffer {}
// SAFETY: as above.
unsafe impl Sync for RegisteredBuffer {}

impl std::fmt::Debug for RegisteredBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredBuffer")
            .field("len", &self.mem.len)
            .field("desc", &self.desc)
            .finish_non_exhaustive()
    }
}

impl RegisteredBuffer {
    pub(crate) fn new(
        engine: TransferEngine,
        len: usize,
        access: Access,
    ) -> Result<Self, TransportError> {
        let mem = Arc::new(Allocation::new(len)?);
        // SAFETY: the allocation lives until the last of the buffer and its grants is
        // dropped, each of which deregisters first.
        let (handle, desc) =
            unsafe { engine.reg_mr_with(mem.ptr.as_ptr(), len, Device::Host, access)? };
        Ok(Self {
            engine,
            mem,
            handle,
            desc,
            access,
        })
    }

    /// A window onto bytes `offset..offset + len` that peers may write through, whatever the
    /// buffer's own [`Access`]: registered apart, with a key of its own (drawn at random
    /// where the provider lets the domain choose it), and deregistered when the grant is
    /// dropped, after which no write through it lands. A requester hands one to each peer
    /// for just the bytes it is to write, so that no peer can write where another's data
    /// lands, nor anywhere once its transfer is over. The memory stays allocated until every
    /// grant onto it is dropped, even if the buffer goes first.
    pub fn grant(&self, offset: usize, len: usize) -> Result<Grant, TransportError> {
        check_range(
            Side::Destination,
            self.mem.len as u64,
            offset as u64,
            len as u64,
        )?;
        if len == 0 {
            return Err(TransportError::InvalidArgument("a grant needs a length"));
        }
        // SAFETY: the range is inside the allocation (checked), which the grant keeps alive
        // until its registration is gone (its drop deregisters before releasing it).
        let (handle, desc) = unsafe {
            self.engine.reg_mr_with(
                self.mem.ptr.as_ptr().add(offset),
                len,
                Device::Host,
                Access::RemoteWrite,
            )?
        };
        Ok(Grant {
            engine: self.engine.clone(),
            _mem: Arc::clone(&self.mem),
            handle,
            desc,
            offset,
        })
    }

    /// The local handle (source of writes).
    pub fn handle(&self) -> &MrHandle {
        &self.handle
    }

    /// The descriptor peers write through.
    pub fn desc(&self) -> &MrDesc {
        &self.desc
    }

    /// Whether peers may write into the region ([`Access`]).
    pub fn access(&self) -> Access {
        self.access
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mem.len
    }

    /// Whether the buffer is empty (never: buffers have a length).
    pub fn is_empty(&self) -> bool {
        self.mem.len == 0
    }

    /// Copies `bytes` into the buffer at `offset`.
    pub fn write_at(&self, offset: usize, bytes: &[u8]) -> Result<(), TransportError> {
        check_range(
            Side::Source,
            self.mem.len as u64,
            offset as u64,
            bytes.len() as u64,
        )?;
        // SAFETY: the range is inside the allocation (checked); see the type's docs on
        // concurrent peer writes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.mem.ptr.as_ptr().add(offset),
                bytes.len(),
            )
        };
        Ok(())
    }

    /// Copies `out.len()` bytes from `offset` into `out`.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<(), TransportError> {
        check_range(
            Side::Source,
            self.mem.len as u64,
            offset as u64,
            out.len() as u64,
        )?;
        // SAFETY: as in write_at.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.mem.ptr.as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0; self.mem.len];
        // Cannot fail: the range is the whole buffer.
        let _ = self.read_at(0, &mut out);
        out
    }

    /// Sets every byte to `byte`.
    pub fn fill(&self, byte: u8) {
        // SAFETY: the whole allocation; see the type's docs on concurrent peer writes.
        unsafe { std::ptr::write_bytes(self.mem.ptr.as_ptr(), byte, self.mem.len) };
    }

    /// Bytes `offset..offset + 2 * words` as `u16` words (bf16 rows), borrowed without a copy:
    /// what attention over a registered chunk or pool reads. `offset` must be even.
    ///
    /// # Safety
    /// While the slice lives, no peer write into the range may be in flight or start (the
    /// protocol has counted the immediates of every write into it and hands the range out
    /// no further), and nothing writes the range locally ([`Self::write_at`], [`Self::fill`],
    /// [`Self::u16s_mut`]).
    pub unsafe fn u16s(&self, offset: usize, words: usize) -> Result<&[u16], TransportError> {
        self.check_words(offset, words)?;
        // SAFETY: in bounds and aligned (checked; the allocation is page-aligned); no
        // writer while the borrow lives (the caller's contract).
        Ok(unsafe { std::slice::from_raw_parts(self.mem.ptr.as_ptr().add(offset).cast(), words) })
    }

    /// [`Self::u16s`], mutable: what a splice or a local fill writes in place.
    ///
    /// # Safety
    /// As [`Self::u16s`], and no other view (shared or mutable) of the range exists while this
    /// one lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn u16s_mut(
        &self,
        offset: usize,
        words: usize,
    ) -> Result<&mut [u16], TransportError> {
        self.check_words(offset, words)?;
        // SAFETY: as in `u16s`, and exclusive (the caller's contract).
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.mem.ptr.as_ptr().add(offset).cast(), words)
        })
    }

    /// Bytes `offset..offset + len`, borrowed without a copy: what a server parses a request
    /// from in place.
    ///
    /// # Safety
    /// As [`Self::u16s`]: while the slice lives, no peer write into the range may be in flight
    /// or start, and nothing writes it locally. (A peer that breaks its protocol and writes
    /// anyway changes the values read, never the slice's bounds; a parser must still read
    /// each field it checks once.)
    pub unsafe fn bytes(&self, offset: usize, len: usize) -> Result<&[u8], TransportError> {
        check_range(Side::Source, self.mem.len as u64, offset as u64, len as u64)?;
        // SAFETY: in bounds (checked); no writer while the borrow lives (the caller's contract).
        Ok(unsafe { std::slice::from_raw_parts(self.mem.ptr.as_ptr().add(offset), len) })
    }

    /// [`Self::bytes`], mutable: what a server encodes a reply into before writing it out.
    ///
    /// # Safety
    /// As [`Self::u16s_mut`]: no other view of the range exists, no peer writes into it, and
    /// no local write reading from it is in flight while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, offset: usize, len: usize) -> Result<&mut [u8], TransportError> {
        check_range(Side::Source, self.mem.len as u64, offset as u64, len as u64)?;
        // SAFETY: as in `bytes`, and exclusive (the caller's contract).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.mem.ptr.as_ptr().add(offset), len) })
    }

    fn check_words(&self, offset: usize, words: usize) -> Result<(), TransportError> {
        if !offset.is_multiple_of(2) {
            return Err(TransportError::InvalidArgument(
                "a u16 view starts at an even offset",
            ));
        }
        let bytes = words
            .checked_mul(2)
            .ok_or(TransportError::InvalidArgument("view length overflows"))?;
        check_range(
            Side::Source,
            self.mem.len as u64,
            offset as u64,
            bytes as u64,
        )
    }

    /// The buffer's address, for code that hands it to a device.
    pub fn as_ptr(&self) -> *mut u8 {
        self.mem.ptr.as_ptr()
    }
}

impl Drop for RegisteredBuffer {
    fn drop(&mut self) {
        // After this returns no peer write can land through the buffer's own registration;
        // after an engine shutdown the NICs are gone already, which is as safe. The memory
        // goes with the last grant onto it.
        if let Err(e) = self.engine.dereg_mr(&self.handle)
            && e != TransportError::Shutdown
        {
            tracing::warn!(%e, "deregistering a buffer failed; freeing it anyway");
        }
    }
}

/// A window onto part of a [`RegisteredBuffer`] that peers may write through
/// ([`RegisteredBuffer::grant`]); dropping it deregisters the window.
pub struct Grant {
    engine: TransferEngine,
    _mem: Arc<Allocation>,
    handle: MrHandle,
    desc: MrDesc,
    offset: usize,
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grant")
            .field("offset", &self.offset)
            .field("desc", &self.desc)
            .finish_non_exhaustive()
    }
}

impl Grant {
    /// The descriptor a peer writes through: the window's bytes only.
    pub fn desc(&self) -> &MrDesc {
        &self.desc
    }

    /// Where the window starts in its buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Bytes in the window.
    pub fn len(&self) -> usize {
        self.desc.len as usize
    }

    /// Whether the window is empty (never: grants have a length).
    pub fn is_empty(&self) -> bool {
        self.desc.len == 0
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        // Once this returns no write through the window lands (see `RegisteredBuffer`'s drop).
        if let Err(e) = self.engine.dereg_mr(&self.handle)
            && e != TransportError::Shutdown
        {
            tracing::warn!(%e, "deregistering a grant failed");
        }
    }
}
