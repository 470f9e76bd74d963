//! Memory through the engine: regions registered and deregistered on every NIC of a group,
//! registered buffers allocated, and watched words.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::buffer::{GrantedBuffer, RegisteredBuffer};
use crate::engine::TransferEngine;
use crate::engine::message::Command;
use crate::engine::shared::{GroupShared, RegionEntry};
use crate::error::TransportError;
use crate::mr::{Access, Device, MrDesc, MrHandle};
use crate::staging::Staging;
use crate::watcher::WatchedWord;

impl TransferEngine {
    /// Registers `[ptr, ptr + len)` with every NIC of the group serving `device`, writable by
    /// peers ([`Access::RemoteWrite`]; see [`TransferEngine::reg_mr_with`]).
    ///
    /// # Safety
    /// The memory must stay allocated and must not move until [`TransferEngine::dereg_mr`]
    /// returns for the handle, and local accesses to bytes a peer may be writing are the
    /// caller's protocol to order (wait for the writes' immediates).
    pub unsafe fn reg_mr(
        &self,
        ptr: *const u8,
        len: usize,
        device: Device,
    ) -> Result<(MrHandle, MrDesc), TransportError> {
        // SAFETY: the caller's guarantee, forwarded.
        unsafe { self.reg_mr_with(ptr, len, device, Access::RemoteWrite) }
    }

    /// [`TransferEngine::reg_mr`] with the access peers get: [`Access::Local`] for memory
    /// that is only ever a source (a store served by writing from it, a staging buffer), so
    /// that no descriptor, leaked or forged, lets a peer write into it.
    ///
    /// # Safety
    /// As [`TransferEngine::reg_mr`].
    pub unsafe fn reg_mr_with(
        &self,
        ptr: *const u8,
        len: usize,
        device: Device,
        access: Access,
    ) -> Result<(MrHandle, MrDesc), TransportError> {
        if ptr.is_null() || len == 0 {
            return Err(TransportError::InvalidArgument(
                "a region needs a non-null pointer and a length",
            ));
        }
        let group = self.group_for(device)?;
        self.command(group, |reply| Command::Register {
            addr: ptr as u64,
            len: len as u64,
            device,
            access,
            reply,
        })?
    }

    /// Deregisters a region: once this returns, no peer write reaches it.
    pub fn dereg_mr(&self, handle: &MrHandle) -> Result<(), TransportError> {
        self.command(self.group_of(handle)?, |reply| Command::Deregister {
            key: handle.key,
            reply,
        })?
    }

    /// The group that registered `handle`, if it is this engine's.
    fn group_of(&self, handle: &MrHandle) -> Result<&Arc<GroupShared>, TransportError> {
        self.inner
            .groups
            .get(handle.group as usize)
            .filter(|_| handle.engine == self.inner.engine.id)
            .ok_or(TransportError::UnknownRegion)
    }

    /// Allocates `len` bytes of zeroed host memory (page-aligned) owned by the engine and
    /// registers it, writable by peers; dropping the buffer deregisters and frees it.
    pub fn alloc_mr(&self, len: usize) -> Result<RegisteredBuffer, TransportError> {
        RegisteredBuffer::new(self.clone(), len, Access::RemoteWrite)
    }

    /// [`TransferEngine::alloc_mr`] with the access peers get (see [`Access`]).
    pub fn alloc_mr_with(
        &self,
        len: usize,
        access: Access,
    ) -> Result<RegisteredBuffer, TransportError> {
        RegisteredBuffer::new(self.clone(), len, access)
    }

    /// Allocates `len` bytes of registered, local-only staging to fill and write out of
    /// ([`Staging`]): the engine tracks which bytes writes still read, so none is refilled
    /// under a write in flight.
    pub fn alloc_staging(&self, len: usize) -> Result<Staging, TransportError> {
        Staging::new(self, len)
    }

    /// Allocates `len` bytes of registered memory that peers write only through grants
    /// ([`GrantedBuffer`]), read and written here only while no grant lives.
    pub fn alloc_granted(&self, len: usize) -> Result<GrantedBuffer, TransportError> {
        Ok(GrantedBuffer::new(RegisteredBuffer::new(
            self.clone(),
            len,
            Access::Local,
        )?))
    }

    pub(super) fn local(
        &self,
        handle: &MrHandle,
    ) -> Result<(&Arc<GroupShared>, RegionEntry), TransportError> {
        let group = self.group_of(handle)?;
        let entry = group
            .directory
            .region(handle.key)
            .ok_or(TransportError::UnknownRegion)?;
        Ok((group, entry))
    }

    /// Allocates a 64-bit word and calls `handler(old, new)` on the callback thread whenever
    /// it changes (paper 002's UVM watcher; host memory here). Changes in quick succession
    /// may be seen as one, which is why the old value is passed.
    pub fn alloc_watcher(
        &self,
        handler: impl FnMut(u64, u64) + Send + 'static,
    ) -> Result<WatchedWord, TransportError> {
        if self.inner.stopped.load(Ordering::Acquire) {
            return Err(TransportError::Shutdown);
        }
        self.inner.watcher.watch(Box::new(handler))
    }
}
