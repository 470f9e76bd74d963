//! Staging slots: a registered region of this process alone, cut into full-block slots, that
//! storage reads land in and the transport writes on from (paper 003 section 4.1's PE and DE
//! buffers: blocks are read from storage into host memory, then written layer by layer to
//! where they are needed).
//!
//! The region is registered with [`Access::Local`], so no peer's write can land in it (the
//! NIC refuses it), and the slots are handed out only through `&mut self`: a read into a slot
//! first waits for that slot's last send, so a block is never overwritten while the transport
//! still reads it. That is [`BlockStore::get_into_region`]'s contract, kept by construction.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_transport::{
    Access, DoneFlag, MrDesc, MrHandle, OnDone, Pages, RegisteredBuffer, TransferEngine,
    TransportError,
};
use thiserror::Error;

use crate::layout::BlockLayout;
use crate::storage::{BlockStore, StorageError};

/// Why a staging operation failed.
#[derive(Debug, Error)]
pub enum StagingError {
    /// The store refused the read.
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// The transport refused or failed a write.
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
    /// A slot index past the region.
    #[error("slot {slot} of {slots}")]
    NoSlot {
        /// The slot asked for.
        slot: usize,
        /// Slots in the region.
        slots: usize,
    },
    /// A send did not finish in time.
    #[error("the send from slot {slot} did not finish within {secs} s")]
    Timeout {
        /// The slot.
        slot: usize,
        /// The wait.
        secs: u64,
    },
}

/// Block-sized slots of one registered region, read into from a [`BlockStore`] and written
/// on layer by layer.
#[derive(Debug)]
pub struct StagingRegion {
    buf: RegisteredBuffer,
    layout: BlockLayout,
    sending: Vec<Option<Arc<DoneFlag>>>,
    timeout: Duration,
}

impl StagingRegion {
    /// Registers `slots` slots of `layout`'s full blocks with `engine`.
    pub fn new(
        engine: &TransferEngine,
        layout: BlockLayout,
        slots: usize,
    ) -> Result<Self, StagingError> {
        let slots = slots.max(1);
        let len = layout
            .full_bytes()
            .checked_mul(slots)
            .ok_or(TransportError::InvalidArgument(
                "staging region size overflows",
            ))?;
        Ok(Self {
            buf: engine.alloc_mr_with(len, Access::Local)?,
            layout,
            sending: vec![None; slots],
            timeout: Duration::from_secs(60),
        })
    }

    /// Slots in the region.
    pub fn slots(&self) -> usize {
        self.sending.len()
    }

    /// The block layout of every slot.
    pub fn layout(&self) -> BlockLayout {
        self.layout
    }

    /// The region's local handle (the source of the writes).
    pub fn handle(&self) -> &MrHandle {
        self.buf.handle()
    }

    fn check(&self, slot: usize) -> Result<(), StagingError> {
        if slot < self.slots() {
            Ok(())
        } else {
            Err(StagingError::NoSlot {
                slot,
                slots: self.slots(),
            })
        }
    }

    /// Waits for the last send from `slot` to finish (driving `engine` if it progresses
    /// manually) and returns its result.
    pub fn wait(&mut self, engine: &TransferEngine, slot: usize) -> Result<(), StagingError> {
        self.check(slot)?;
        let Some(flag) = self.sending[slot].take() else {
            return Ok(());
        };
        let started = Instant::now();
        let mut spins = 0u32;
        while !flag.is_done() {
            if engine.progress() {
                continue;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) {
                if started.elapsed() > self.timeout {
                    return Err(StagingError::Timeout {
                        slot,
                        secs: self.timeout.as_secs(),
                    });
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        match flag.result() {
            Some(Err(e)) => {
                Err(TransportError::Domain(format!("a staged send failed: {e}")).into())
            }
            _ => Ok(()),
        }
    }

    /// Reads block `key` of `store` into `slot`, with every checksum checked, once the slot's
    /// last send has finished.
    pub fn read(
        &mut self,
        engine: &TransferEngine,
        store: &mut BlockStore,
        key: u64,
        slot: usize,
    ) -> Result<(), StagingError> {
        self.wait(engine, slot)?;
        if store.layout() != self.layout {
            return Err(StorageError::Shape {
                what: "store layout",
                expected: self.layout.full_bytes(),
                got: store.layout().full_bytes(),
            }
            .into());
        }
        // SAFETY: the region is registered `Access::Local`, so no peer write can land in it;
        // this slot's last send has finished (waited for above) and no other view of the
        // region exists outside `&mut self`. The range is bounds-checked by the call.
        unsafe { store.get_into_region(key, &self.buf, slot * self.layout.full_bytes()) }?;
        Ok(())
    }

    /// Writes the block in `slot` to `dst` as one page per layer (`layout.full_bytes() /
    /// layers` bytes each), into the destination's pages `dst_first_page ..` of that size,
    /// each page carrying `imm`. Returns at once; the slot is busy until the writes finish.
    pub fn send_layers(
        &mut self,
        engine: &TransferEngine,
        slot: usize,
        dst: &MrDesc,
        dst_first_page: u32,
        imm: Option<u32>,
    ) -> Result<(), StagingError> {
        self.wait(engine, slot)?;
        let layers = self.layout.layers;
        let page = (self.layout.full_bytes() / layers as usize) as u64;
        let first = u32::try_from(slot)
            .ok()
            .and_then(|s| s.checked_mul(layers))
            .ok_or(TransportError::InvalidArgument(
                "slot index overflows a page index",
            ))?;
        let src = Pages::new((first..first + layers).collect::<Vec<u32>>(), page, 0);
        let last = dst_first_page
            .checked_add(layers)
            .ok_or(TransportError::InvalidArgument(
                "destination page index overflows",
            ))?;
        let dst_pages = Pages::new((dst_first_page..last).collect::<Vec<u32>>(), page, 0);
        let flag = DoneFlag::new();
        engine.submit_paged_writes(
            page,
            imm,
            (self.buf.handle(), &src),
            (dst, &dst_pages),
            OnDone::from(&flag),
        )?;
        self.sending[slot] = Some(flag);
        Ok(())
    }

    /// CRC-32C of the block in `slot`, once its sends are done (a copy out of the region).
    pub fn crc(&mut self, engine: &TransferEngine, slot: usize) -> Result<u32, StagingError> {
        self.wait(engine, slot)?;
        let mut bytes = vec![0u8; self.layout.full_bytes()];
        self.buf
            .read_at(slot * self.layout.full_bytes(), &mut bytes)?;
        Ok(crc32c::crc32c(&bytes))
    }
}

#[cfg(test)]
mod tests {
    use kvroute_transport::MemFabric;

    use super::*;
    use crate::corpus::CorpusSpec;
    use crate::layout::FullBlock;
    use crate::registry::ChunkId;

    /// Blocks read from a store into staging slots and written layer by layer to a peer land
    /// whole; a read into a slot waits for its send; a peer cannot write into the region.
    #[test]
    fn staged_blocks_land_whole_at_the_peer() {
        let dir = std::env::temp_dir().join(format!("kvroute-staging-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let spec = CorpusSpec {
            layers: 3,
            chunk_tokens: 64,
            chunks: 4,
            seed: 9,
            rope_theta: 10_000.0,
            yarn: None,
            rope_layout: Default::default(),
        };
        let layout = spec.layout();
        let (mut store, _) = BlockStore::open(&dir, layout).unwrap();
        let mut expected = Vec::new();
        for k in 0..4u32 {
            let block = spec.chunk(ChunkId(k)).unwrap();
            let full = FullBlock::new(&block, layout).unwrap();
            let bytes: Vec<u8> = full.elems().iter().flat_map(|e| e.to_le_bytes()).collect();
            store.put(u64::from(k), &bytes).unwrap();
            expected.push(crc32c::crc32c(&bytes));
        }
        let fabric = MemFabric::new();
        let (a, b) = (
            TransferEngine::mem(&fabric, 1).unwrap(),
            TransferEngine::mem(&fabric, 1).unwrap(),
        );
        let mut staging = StagingRegion::new(&a, layout, 2).unwrap();
        let inbox = b.alloc_mr(4 * layout.full_bytes()).unwrap();
        let landed = b.imm_count(7, 4 * u64::from(layout.layers));
        for k in 0..4u64 {
            let slot = (k % 2) as usize;
            staging.read(&a, &mut store, k, slot).unwrap();
            staging
                .send_layers(&a, slot, inbox.desc(), k as u32 * layout.layers, Some(7))
                .unwrap();
        }
        landed.wait().unwrap();
        for (k, want) in expected.iter().enumerate() {
            let mut got = vec![0u8; layout.full_bytes()];
            inbox.read_at(k * layout.full_bytes(), &mut got).unwrap();
            assert_eq!(crc32c::crc32c(&got), *want, "block {k}");
        }
        assert_eq!(staging.crc(&a, 1).unwrap(), expected[3]);
        assert!(matches!(
            staging.read(&a, &mut store, 0, 2),
            Err(StagingError::NoSlot { .. })
        ));
        assert!(matches!(
            staging.read(&a, &mut store, 99, 0),
            Err(StagingError::Storage(StorageError::Missing { .. }))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
