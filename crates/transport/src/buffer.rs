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
pub(crate) struct Allocation {
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

impl Allocation {
    /// The first byte.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
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

    /// The memory, shared: what keeps it allocated past the buffer's drop for as long as
    /// a view or a write in flight still uses it.
    pub(crate) fn memory(&self) -> Arc<Allocation> {
        Arc::clone(&self.mem)
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

    /// Appends a copy of bytes `offset..offset + len` to `out`: what a reader of bytes a
    /// peer writes takes, so that what it checks cannot change under it. No zeroing pass:
    /// the bytes go straight into `out`'s spare capacity.
    pub fn append_to(
        &self,
        offset: usize,
        len: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), TransportError> {
        check_range(Side::Source, self.mem.len as u64, offset as u64, len as u64)?;
        out.reserve(len);
        let spare = &mut out.spare_capacity_mut()[..len];
        // SAFETY: the source range is inside the allocation (checked), the destination is
        // `len` bytes of `out`'s spare capacity (reserved), and they cannot overlap (`out` is
        // a `Vec` the caller owns); see the type's docs on concurrent peer writes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.mem.ptr.as_ptr().add(offset),
                spare.as_mut_ptr().cast::<u8>(),
                len,
            );
            out.set_len(out.len() + len);
        }
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

impl RegisteredBuffer {
    /// Gives up writing the buffer: what is in it now is what it holds until it is dropped,
    /// so it can be read in place without `unsafe` ([`SealedBuffer`]). Refused where peers
    /// may write it (its access is not [`Access::Local`]) or a grant onto it lives.
    pub fn seal(mut self) -> Result<SealedBuffer, TransportError> {
        if self.access != Access::Local {
            return Err(TransportError::InvalidArgument(
                "a buffer peers may write cannot be sealed",
            ));
        }
        // Unique: no grant shares the memory (`get_mut` synchronizes with their drops).
        if Arc::get_mut(&mut self.mem).is_none() {
            return Err(TransportError::InvalidArgument(
                "a buffer with a live grant cannot be sealed",
            ));
        }
        Ok(SealedBuffer { buf: self })
    }
}

/// A registered buffer nothing writes any more ([`RegisteredBuffer::seal`]): local only, no
/// grant onto it, no method that writes it. It is still the source of writes (its handle),
/// which read it; and it is read in place, as a held KV store is by attention.
#[derive(Debug)]
pub struct SealedBuffer {
    buf: RegisteredBuffer,
}

impl SealedBuffer {
    /// The local handle (source of writes).
    pub fn handle(&self) -> &MrHandle {
        self.buf.handle()
    }

    /// The buffer's descriptor (local only: no peer can write through it).
    pub fn desc(&self) -> &MrDesc {
        self.buf.desc()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether the buffer is empty (never: buffers have a length).
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Bytes `offset..offset + len`, borrowed in place.
    pub fn bytes(&self, offset: usize, len: usize) -> Result<&[u8], TransportError> {
        // SAFETY: nothing writes a sealed buffer: no local method does, no peer can (local
        // only, no grant lives and none can be made).
        unsafe { self.buf.bytes(offset, len) }
    }

    /// Bytes `offset..offset + 2 * words` as `u16` words, borrowed in place; `offset` must be
    /// even.
    pub fn u16s(&self, offset: usize, words: usize) -> Result<&[u16], TransportError> {
        // SAFETY: as in `bytes`.
        unsafe { self.buf.u16s(offset, words) }
    }
}

/// Registered memory that peers write only through [`Grant`]s, each of just the bytes one
/// transfer lands ([`TransferEngine::alloc_granted`]): local only, and its handle is never
/// handed out, so it is the source of no write. It is read and written here only while no
/// grant onto it lives (checked), and a grant needs `&mut self`, so no grant can be made
/// while such a view lives: no peer write can land under one.
#[derive(Debug)]
pub struct GrantedBuffer {
    buf: RegisteredBuffer,
}

impl GrantedBuffer {
    pub(crate) fn new(buf: RegisteredBuffer) -> Self {
        debug_assert_eq!(buf.access, Access::Local);
        Self { buf }
    }

    /// The buffer's own descriptor: local only, so no peer can write through it.
    pub fn desc(&self) -> &MrDesc {
        self.buf.desc()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether the buffer is empty (never: buffers have a length).
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// A window peers may write through ([`RegisteredBuffer::grant`]).
    pub fn grant(&mut self, offset: usize, len: usize) -> Result<Grant, TransportError> {
        self.buf.grant(offset, len)
    }

    /// Whether a grant onto the buffer lives (a peer may be writing it).
    fn granted(&self) -> bool {
        Arc::strong_count(&self.buf.mem) > 1
    }

    fn quiet(&self) -> Result<(), TransportError> {
        if self.granted() {
            return Err(TransportError::InvalidArgument(
                "the buffer is read only while no grant onto it lives",
            ));
        }
        // Pairs with the release of the last grant's drop (after its deregistration), as
        // `Arc`'s own drop does: whatever peers wrote through it is visible from here.
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        Ok(())
    }

    /// Bytes `offset..offset + 2 * words` as `u16` words, borrowed in place; refused while a
    /// grant lives. `offset` must be even.
    pub fn u16s(&self, offset: usize, words: usize) -> Result<&[u16], TransportError> {
        self.quiet()?;
        // SAFETY: no peer can write: the registration is local only, no grant lives (checked)
        // and none can be made while `&self` is borrowed (`grant` takes `&mut self`); no
        // local write can: the only mutable view needs `&mut self`, and the handle is never
        // handed out, so no write reads from it either.
        unsafe { self.buf.u16s(offset, words) }
    }

    /// [`GrantedBuffer::u16s`], mutable.
    pub fn u16s_mut(&mut self, offset: usize, words: usize) -> Result<&mut [u16], TransportError> {
        self.quiet()?;
        // SAFETY: as in `u16s`, and exclusive: `&mut self`.
        unsafe { self.buf.u16s_mut(offset, words) }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::MemFabric;

    #[test]
    fn only_a_local_buffer_without_grants_seals() {
        let fabric = MemFabric::new();
        let engine = TransferEngine::mem(&fabric, 1).unwrap();
        assert!(
            engine.alloc_mr(4096).unwrap().seal().is_err(),
            "peers may write it"
        );
        let local = engine.alloc_mr_with(4096, Access::Local).unwrap();
        let grant = local.grant(0, 64).unwrap();
        let local = match local.seal() {
            Err(_) => engine.alloc_mr_with(4096, Access::Local).unwrap(),
            Ok(_) => panic!("sealed with a live grant"),
        };
        drop(grant);
        local.write_at(8, &[1, 2, 3, 4]).unwrap();
        let sealed = local.seal().unwrap();
        assert_eq!(sealed.bytes(8, 4).unwrap(), &[1, 2, 3, 4]);
        assert_eq!(
            sealed.u16s(8, 2).unwrap(),
            &[u16::from_ne_bytes([1, 2]), u16::from_ne_bytes([3, 4])]
        );
    }

    #[test]
    fn a_granted_buffer_is_read_only_while_no_grant_lives() {
        let fabric = MemFabric::new();
        let engine = TransferEngine::mem(&fabric, 1).unwrap();
        let mut pool = engine.alloc_granted(8192).unwrap();
        let grant = pool.grant(4096, 4096).unwrap();
        assert!(pool.granted());
        assert!(pool.u16s(0, 16).is_err(), "read under a live grant");
        drop(grant);
        pool.u16s_mut(0, 16).unwrap().fill(7);
        assert_eq!(pool.u16s(0, 16).unwrap(), &[7; 16]);
    }
}
