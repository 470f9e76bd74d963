//! [`Staging`]: registered memory a process fills and writes out of, with the rule that makes
//! that safe kept by the type instead of by the caller's protocol: bytes being written out
//! are not handed out to fill, and bytes handed out to fill are not written out, until the
//! write completes or the view is dropped.
//!
//! A NIC reads a write's source after the submission returns, until the write completes. A
//! process that fills the same bytes again before then races the NIC (the peer receives a
//! mix of the two); one that reuses them because a peer said it was done (a reply, say)
//! lets that peer decide when local memory is overwritten. Here the transfer itself says it:
//! the write's completion releases its bytes ([`crate::OnDone`] carries the release), and a
//! view over bytes still being written out is refused, or waited for with a deadline.

use std::ops::{Deref, DerefMut, Range};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::buffer::{Allocation, RegisteredBuffer};
use crate::engine::TransferEngine;
use crate::error::{Side, TransportError};
use crate::mr::{Access, MrDesc, check_range};
use crate::on_done::OnDone;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Registered, local-only memory that is the source of writes: filled through
/// [`Staging::bytes_mut`] views, written out through [`Staging::submit_write`]. No peer
/// writes it (it is registered local only) and its handle is never handed out, so every
/// write out of it goes through `submit_write` and is tracked until it completes.
pub struct Staging {
    engine: TransferEngine,
    buf: RegisteredBuffer,
    spans: Arc<Mutex<Spans>>,
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staging")
            .field("len", &self.buf.len())
            .finish_non_exhaustive()
    }
}

/// The byte ranges of a staging buffer that are lent out: borrowed to be filled, or being
/// written out. A handful at a time (one per segment of a batch, one per write in flight),
/// so a vector scan is the right structure.
#[derive(Debug, Default)]
struct Spans {
    next: u64,
    borrowed: Vec<(u64, Range<usize>)>,
    sending: Vec<(u64, Range<usize>)>,
}

impl Spans {
    fn id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    fn overlaps(list: &[(u64, Range<usize>)], r: &Range<usize>) -> bool {
        list.iter().any(|(_, s)| s.start < r.end && r.start < s.end)
    }

    fn remove(list: &mut Vec<(u64, Range<usize>)>, id: u64) {
        if let Some(i) = list.iter().position(|(k, _)| *k == id) {
            list.swap_remove(i);
        }
    }
}

/// Holds a write's source bytes as being written out; dropping it (when the write finishes,
/// or when a submission that failed drops its [`OnDone`]) releases them. It keeps the memory
/// allocated until then, and holds no engine: a write that never finishes keeps no engine
/// alive.
pub(crate) struct SendLease {
    spans: Arc<Mutex<Spans>>,
    _mem: Arc<Allocation>,
    id: u64,
}

impl Drop for SendLease {
    fn drop(&mut self) {
        Spans::remove(&mut lock(&self.spans).sending, self.id);
    }
}

/// Locks the spans, ignoring poisoning: no user code runs under the lock, and every unlock
/// leaves the lists consistent. (Std's mutex, not the loom-switched one of `crate::sync`:
/// staging is not part of the model-checked completion logic.)
fn lock(spans: &Mutex<Spans>) -> MutexGuard<'_, Spans> {
    spans.lock().unwrap_or_else(PoisonError::into_inner)
}

fn busy(range: &Range<usize>, why: &'static str) -> TransportError {
    TransportError::StagingBusy {
        offset: range.start,
        len: range.end - range.start,
        why,
    }
}

/// What [`TransportError::StagingBusy`] says of bytes a write out of them still reads.
const SENDING: &str = "still being written out";
/// What it says of bytes another view holds.
const BORROWED: &str = "borrowed by another view";

impl Staging {
    pub(crate) fn new(engine: &TransferEngine, len: usize) -> Result<Self, TransportError> {
        Ok(Self {
            engine: engine.clone(),
            buf: RegisteredBuffer::new(engine.clone(), len, Access::Local)?,
            spans: Arc::default(),
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether the buffer is empty (never: buffers have a length).
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The buffer's descriptor (local only: no peer can write through it).
    pub fn desc(&self) -> &MrDesc {
        self.buf.desc()
    }

    /// Bytes `offset..offset + len` to fill. Refused with [`TransportError::StagingBusy`]
    /// while any of them is held by another view or read by a write not yet complete.
    pub fn bytes_mut(&self, offset: usize, len: usize) -> Result<StagedBytes, TransportError> {
        check_range(Side::Source, self.len() as u64, offset as u64, len as u64)?;
        let range = offset..offset + len;
        let mut spans = lock(&self.spans);
        if Spans::overlaps(&spans.sending, &range) {
            return Err(busy(&range, SENDING));
        }
        if Spans::overlaps(&spans.borrowed, &range) {
            return Err(busy(&range, BORROWED));
        }
        let id = spans.id();
        spans.borrowed.push((id, range));
        Ok(StagedBytes {
            spans: Arc::clone(&self.spans),
            mem: self.buf.memory(),
            id,
            offset,
            len,
        })
    }

    /// [`Staging::bytes_mut`], waiting up to `within` for writes out of the bytes to complete
    /// (running the engine's passes meanwhile where it progresses manually). Bytes another
    /// view holds are refused at once: only their owner can give them back.
    pub fn bytes_mut_within(
        &self,
        offset: usize,
        len: usize,
        within: Duration,
    ) -> Result<StagedBytes, TransportError> {
        let deadline = Instant::now() + within;
        loop {
            match self.bytes_mut(offset, len) {
                Err(TransportError::StagingBusy { why: SENDING, .. })
                    if Instant::now() < deadline =>
                {
                    if !self.engine.progress() {
                        std::thread::yield_now();
                    }
                }
                other => return other,
            }
        }
    }

    /// Whether a write out of any of bytes `offset..offset + len` has not completed yet.
    pub fn is_sending(&self, offset: usize, len: usize) -> bool {
        Spans::overlaps(&lock(&self.spans).sending, &(offset..offset + len))
    }

    /// Writes bytes `offset..offset + len` to `dst` (a descriptor and an offset in it),
    /// with `imm` if given, as [`TransferEngine::submit_single_write`]. The bytes are held as
    /// being written out until the write finishes (or fails), so no view can fill them
    /// meanwhile; bytes a view holds now are refused ([`TransportError::StagingBusy`]).
    /// Several writes may read the same bytes at once.
    pub fn submit_write(
        &self,
        (offset, len): (usize, usize),
        imm: Option<u32>,
        dst: (&MrDesc, u64),
        mut on_done: OnDone,
    ) -> Result<(), TransportError> {
        check_range(Side::Source, self.len() as u64, offset as u64, len as u64)?;
        let range = offset..offset + len;
        let id = {
            let mut spans = lock(&self.spans);
            if Spans::overlaps(&spans.borrowed, &range) {
                return Err(busy(&range, BORROWED));
            }
            let id = spans.id();
            spans.sending.push((id, range));
            id
        };
        on_done.lease = Some(SendLease {
            spans: Arc::clone(&self.spans),
            _mem: self.buf.memory(),
            id,
        });
        // A submission that fails drops `on_done`, and its lease with it.
        self.engine.submit_single_write(
            len as u64,
            imm,
            (self.buf.handle(), offset as u64),
            dst,
            on_done,
        )
    }
}

/// Bytes of a [`Staging`] lent out to be filled ([`Staging::bytes_mut`]): no other view of
/// them exists and no write reads them while this lives. It keeps the memory allocated, so
/// it may outlive its staging (its bytes then go nowhere).
pub struct StagedBytes {
    spans: Arc<Mutex<Spans>>,
    mem: Arc<Allocation>,
    id: u64,
    offset: usize,
    len: usize,
}

impl std::fmt::Debug for StagedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedBytes")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl StagedBytes {
    /// The bytes as `u16` words (bf16 rows), native-endian. Refused where the view starts at
    /// an odd offset or has an odd length.
    pub fn u16s_mut(&mut self) -> Result<&mut [u16], TransportError> {
        if !self.offset.is_multiple_of(2) || !self.len.is_multiple_of(2) {
            return Err(TransportError::InvalidArgument(
                "a u16 view needs an even offset and length",
            ));
        }
        // SAFETY: the range is inside the allocation (checked when the view was made) and
        // 2-byte aligned (the allocation is page-aligned, the offset even); it is exclusive:
        // no other view overlaps it and no write reads it while this view lives (the spans,
        // checked and recorded under one lock), no peer writes it (local-only registration)
        // and `&mut self` makes this borrow the view's only one.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(
                self.mem.ptr().add(self.offset).cast::<u16>(),
                self.len / 2,
            )
        })
    }
}

impl Deref for StagedBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: as in `u16s_mut`; shared for as long as `&self` lives.
        unsafe { std::slice::from_raw_parts(self.mem.ptr().add(self.offset), self.len) }
    }
}

impl DerefMut for StagedBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `u16s_mut`.
        unsafe { std::slice::from_raw_parts_mut(self.mem.ptr().add(self.offset), self.len) }
    }
}

impl Drop for StagedBytes {
    fn drop(&mut self) {
        Spans::remove(&mut lock(&self.spans).borrowed, self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::MemFabric;
    use crate::on_done::DoneFlag;

    fn pair() -> (TransferEngine, TransferEngine, MemFabric) {
        let fabric = MemFabric::new();
        let a = TransferEngine::mem(&fabric, 1).unwrap();
        let b = TransferEngine::mem(&fabric, 1).unwrap();
        (a, b, fabric)
    }

    #[test]
    fn overlapping_views_are_refused_and_disjoint_ones_lent() {
        let (a, _b, _f) = pair();
        let staging = a.alloc_staging(4096).unwrap();
        let mut first = staging.bytes_mut(0, 100).unwrap();
        let second = staging.bytes_mut(100, 100).unwrap();
        assert!(matches!(
            staging.bytes_mut(50, 100),
            Err(TransportError::StagingBusy { why: BORROWED, .. })
        ));
        first.fill(3);
        drop(first);
        assert_eq!(staging.bytes_mut(50, 50).unwrap()[0], 3);
        assert_eq!(second.len(), 100);
        assert!(staging.bytes_mut(4000, 100).is_err(), "out of bounds");
    }

    #[test]
    fn bytes_being_written_out_are_not_lent_until_the_write_completes() {
        let (a, b, _f) = pair();
        let staging = a.alloc_staging(4096).unwrap();
        let dst = b.alloc_mr(4096).unwrap();
        staging.bytes_mut(0, 64).unwrap().fill(9);
        let view = staging.bytes_mut(0, 64).unwrap();
        assert!(
            matches!(
                staging.submit_write((0, 64), None, (dst.desc(), 0), OnDone::nothing()),
                Err(TransportError::StagingBusy { why: BORROWED, .. })
            ),
            "a write out of bytes a view holds is refused"
        );
        drop(view);
        let flag = DoneFlag::new();
        staging
            .submit_write((0, 64), None, (dst.desc(), 0), OnDone::flag(&flag))
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !flag.is_done() {
            assert!(Instant::now() < deadline, "the write never completed");
            std::thread::yield_now();
        }
        // The lease is released before the flag is set.
        assert!(!staging.is_sending(0, 64));
        assert!(dst.to_vec()[..64].iter().all(|&x| x == 9));
        staging.bytes_mut(0, 64).unwrap();
    }

    #[test]
    fn a_view_waits_for_the_write_out_of_its_bytes() {
        let (a, b, _f) = pair();
        let staging = a.alloc_staging(1 << 20).unwrap();
        let dst = b.alloc_mr(1 << 20).unwrap();
        for _ in 0..50 {
            staging
                .submit_write((0, 1 << 20), None, (dst.desc(), 0), OnDone::nothing())
                .unwrap();
            let view = staging
                .bytes_mut_within(0, 1 << 20, Duration::from_secs(5))
                .unwrap();
            assert!(
                !staging.is_sending(0, 1 << 20),
                "lent while being written out"
            );
            drop(view);
        }
    }

    #[test]
    fn a_failed_submission_releases_its_bytes() {
        let (a, _b, _f) = pair();
        let staging = a.alloc_staging(4096).unwrap();
        let foreign = MrDesc {
            len: 0,
            ..staging.desc().clone()
        };
        assert!(
            staging
                .submit_write((0, 64), None, (&foreign, 0), OnDone::nothing())
                .is_err()
        );
        assert!(!staging.is_sending(0, 64));
        staging.bytes_mut(0, 64).unwrap();
    }

    #[test]
    fn u16_views_need_even_bounds() {
        let (a, _b, _f) = pair();
        let staging = a.alloc_staging(4096).unwrap();
        assert!(staging.bytes_mut(1, 8).unwrap().u16s_mut().is_err());
        let mut view = staging.bytes_mut(2, 8).unwrap();
        view.u16s_mut().unwrap().fill(0xbeef);
        drop(view);
        assert_eq!(
            &staging.bytes_mut(2, 2).unwrap()[..],
            &0xbeefu16.to_ne_bytes()
        );
    }
}
