//! [`ImmWatch`]: arrivals of one immediate value, counted without a lock.

use std::cell::Cell;
use std::fmt;
use std::sync::Arc;

use super::TransferEngine;
use super::shared::EngineShared;
use crate::error::TransportError;

/// Counts every arrival of one immediate value, where [`ImmWatch::arrived`] reads it without a
/// lock, a callback or an allocation: the receiving side of a doorbell (a ping-pong, a
/// notification per step). The progress pass adds an arrival of a watched value to the watch's
/// own word with one compare-and-swap, where an expectation costs the counter's lock, a queue
/// and its `OnDone`.
///
/// While the watch lives, expectations of its value are refused (they fail with
/// [`crate::TransferError::ImmWatched`]) and `pending_imm` / `take_imm` of it read 0. Dropping
/// it hands the value back to the IMM counter; arrivals racing with the drop may be lost with
/// it. At most 16 values (`imm_counter::MAX_WATCHES`) are watched at once per engine. A
/// watch is read by one thread at a time (`Send`, not `Sync`): it keeps its running total.
///
/// ```
/// use std::time::{Duration, Instant};
/// use kvroute_transport::{MemFabric, OnDone, TransferEngine};
///
/// let fabric = MemFabric::new();
/// let (a, b) = (TransferEngine::mem(&fabric, 1)?, TransferEngine::mem(&fabric, 1)?);
/// let inbox = b.alloc_mr(64)?;
/// let doorbell = b.watch_imm(7)?;
/// let to_b = a.imm_target(inbox.desc())?;
/// for _ in 0..3 {
///     a.submit_imm_to(7, &to_b, OnDone::nothing())?;
/// }
/// let start = Instant::now();
/// while doorbell.arrived() < 3 {
///     assert!(start.elapsed() < Duration::from_secs(10), "the rings did not arrive");
///     std::thread::yield_now();
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ImmWatch {
    engine: Arc<EngineShared>,
    imm: u32,
    index: usize,
    /// Arrivals counted up to the word's last read, the word's wraps included.
    total: Cell<u64>,
    /// The word's count at its last read.
    last: Cell<u32>,
}

impl ImmWatch {
    /// The watched value.
    pub fn imm(&self) -> u32 {
        self.imm
    }

    /// Arrivals of the value since the watch began, those counted before it and unclaimed
    /// included. The watch's word counts modulo 2^32: read it at least once per 2^32
    /// arrivals. Seeing a count also makes the bytes of the writes it counts visible.
    #[inline]
    pub fn arrived(&self) -> u64 {
        let now = self.engine.imm.watched(self.index);
        let total = self.total.get() + u64::from(now.wrapping_sub(self.last.get()));
        self.total.set(total);
        self.last.set(now);
        total
    }
}

impl fmt::Debug for ImmWatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImmWatch")
            .field("imm", &self.imm)
            .field("total", &self.total.get())
            .finish_non_exhaustive()
    }
}

impl Drop for ImmWatch {
    fn drop(&mut self) {
        self.engine.imm.unwatch(self.index);
    }
}

impl TransferEngine {
    /// Watches `imm`: its arrivals are counted where [`ImmWatch::arrived`] reads them without
    /// a lock (see [`ImmWatch`]). Refused while `imm` is watched or expected, and when every
    /// watch is in use.
    pub fn watch_imm(&self, imm: u32) -> Result<ImmWatch, TransportError> {
        let engine = self.inner.engine.clone();
        let slot = engine.imm.watch(imm)?;
        Ok(ImmWatch {
            engine,
            imm,
            index: slot.index,
            total: Cell::new(slot.earlier),
            last: Cell::new(0),
        })
    }
}
