//! Operation contexts: the `void *context` every libfabric data call takes and every
//! completion hands back. Providers that ask for `FI_CONTEXT` / `FI_CONTEXT2` own the first
//! 64 bytes of it until the operation completes, so each posted operation gets a slot here at a
//! stable address, holding the engine's work-request id after the provider's scratch space.
//!
//! A slot also records when its operation was posted, so operations a provider never completes
//! (shm does not answer a write its target refused; a dead peer's writes may wait forever)
//! can be failed after a deadline. Such a slot is *abandoned*: reported failed, but kept until
//! the provider hands it back, since the provider may still hold the pointer.

use std::time::{Duration, Instant};

use libfabric_sys::fi_context2;

/// What a posted operation was, so its completion can be reported as such.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    Write,
    Send,
    Recv,
}

/// One operation's context. `provider` must stay first: the context pointer is the slot's.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct OpContext {
    provider: fi_context2,
    pub(crate) wr_id: u64,
    pub(crate) kind: OpKind,
    /// For sends through a bounce buffer: which one to give back.
    pub(crate) bounce: Option<u32>,
    /// The peer a write or send went to (`u32::MAX` for receives), for diagnostics.
    pub(crate) peer: u32,
    posted_at: Instant,
    index: u32,
    live: bool,
    abandoned: bool,
}

/// What a completion's context turned out to be.
#[derive(Debug)]
pub(crate) enum Released {
    /// A live operation: report it.
    Live(OpContext),
    /// An operation already failed by its deadline: the provider let go of it; say nothing
    /// (but give its bounce buffer back).
    Abandoned { bounce: Option<u32> },
    /// Not a slot of this pool.
    Unknown,
}

const CHUNK: usize = 1024;

/// Slots in chunks that never move, with a free list.
#[derive(Debug, Default)]
pub(crate) struct ContextPool {
    chunks: Vec<Box<[OpContext]>>,
    free: Vec<u32>,
}

impl ContextPool {
    /// Takes a slot for an operation; the pointer is the operation's context until
    /// [`ContextPool::release`].
    pub(crate) fn acquire(
        &mut self,
        wr_id: u64,
        kind: OpKind,
        peer: u32,
        bounce: Option<u32>,
        now: Instant,
    ) -> *mut std::ffi::c_void {
        let index = self.free.pop().unwrap_or_else(|| self.grow());
        let slot = self.slot_mut(index);
        slot.provider = fi_context2::default();
        slot.wr_id = wr_id;
        slot.kind = kind;
        slot.bounce = bounce;
        slot.peer = peer;
        slot.posted_at = now;
        slot.live = true;
        slot.abandoned = false;
        std::ptr::from_mut(slot).cast()
    }

    /// Gives a slot back when its operation was not posted after all.
    pub(crate) fn cancel(&mut self, context: *mut std::ffi::c_void) {
        let _ = self.release(context);
    }

    /// The slot a completion's context points to, freed for reuse.
    pub(crate) fn release(&mut self, context: *mut std::ffi::c_void) -> Released {
        let Some(index) = self.index_of(context) else {
            return Released::Unknown;
        };
        let slot = self.slot_mut(index);
        if !slot.live {
            return Released::Unknown;
        }
        slot.live = false;
        let abandoned = slot.abandoned;
        let taken = OpContext {
            provider: fi_context2::default(),
            wr_id: slot.wr_id,
            kind: slot.kind,
            bounce: slot.bounce,
            peer: slot.peer,
            posted_at: slot.posted_at,
            index,
            live: false,
            abandoned,
        };
        self.free.push(index);
        if abandoned {
            Released::Abandoned {
                bounce: taken.bounce,
            }
        } else {
            Released::Live(taken)
        }
    }

    /// Abandons every live operation posted more than `timeout` before `now`, returning them
    /// for failure reports. Their slots stay taken until the provider hands them back.
    pub(crate) fn expire(&mut self, now: Instant, timeout: Duration) -> Vec<OpContext> {
        self.abandon_where(|slot| now.saturating_duration_since(slot.posted_at) > timeout)
    }

    /// Abandons every live operation to `peer` (its process is gone), as [`ContextPool::expire`].
    pub(crate) fn abandon_peer(&mut self, peer: u32) -> Vec<OpContext> {
        self.abandon_where(|slot| slot.peer == peer)
    }

    /// Abandons the live writes and sends `pick` selects (posted receive buffers wait for
    /// messages as long as it takes), returning copies for failure reports.
    fn abandon_where(&mut self, pick: impl Fn(&OpContext) -> bool) -> Vec<OpContext> {
        let mut abandoned = Vec::new();
        for chunk in &mut self.chunks {
            for slot in chunk.iter_mut() {
                if slot.live && !slot.abandoned && slot.kind != OpKind::Recv && pick(slot) {
                    slot.abandoned = true;
                    abandoned.push(OpContext {
                        provider: fi_context2::default(),
                        wr_id: slot.wr_id,
                        kind: slot.kind,
                        bounce: slot.bounce,
                        peer: slot.peer,
                        posted_at: slot.posted_at,
                        index: slot.index,
                        live: false,
                        abandoned: true,
                    });
                }
            }
        }
        abandoned
    }

    /// Operations posted and not yet completed.
    pub(crate) fn live(&self) -> usize {
        self.chunks.len() * CHUNK - self.free.len()
    }

    fn grow(&mut self) -> u32 {
        let base = (self.chunks.len() * CHUNK) as u32;
        let now = Instant::now();
        let chunk: Box<[OpContext]> = (0..CHUNK as u32)
            .map(|i| OpContext {
                provider: fi_context2::default(),
                wr_id: 0,
                kind: OpKind::Write,
                bounce: None,
                peer: u32::MAX,
                posted_at: now,
                index: base + i,
                live: false,
                abandoned: false,
            })
            .collect();
        self.chunks.push(chunk);
        // Hand out the lowest index first; push the rest in reverse so pops ascend.
        self.free.extend((base + 1..base + CHUNK as u32).rev());
        base
    }

    fn slot_mut(&mut self, index: u32) -> &mut OpContext {
        &mut self.chunks[index as usize / CHUNK][index as usize % CHUNK]
    }

    /// Maps a pointer back to its slot by address, so a stray pointer is refused rather than
    /// dereferenced.
    fn index_of(&self, context: *mut std::ffi::c_void) -> Option<u32> {
        let p = context as usize;
        let size = std::mem::size_of::<OpContext>();
        self.chunks.iter().enumerate().find_map(|(c, chunk)| {
            let start = chunk.as_ptr() as usize;
            let end = start + chunk.len() * size;
            (p >= start && p < end && (p - start).is_multiple_of(size))
                .then(|| (c * CHUNK + (p - start) / size) as u32)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(r: Released) -> Option<OpContext> {
        match r {
            Released::Live(c) => Some(c),
            _ => None,
        }
    }

    #[test]
    fn slots_round_trip_their_ids_and_are_reused() {
        let now = Instant::now();
        let mut pool = ContextPool::default();
        let a = pool.acquire(7, OpKind::Write, 0, None, now);
        let b = pool.acquire(8, OpKind::Send, 0, Some(3), now);
        assert_ne!(a, b);
        assert_eq!(pool.live(), 2);
        let got = live(pool.release(b)).unwrap();
        assert_eq!(
            (got.wr_id, got.kind, got.bounce),
            (8, OpKind::Send, Some(3))
        );
        assert!(
            matches!(pool.release(b), Released::Unknown),
            "released twice"
        );
        let c = pool.acquire(9, OpKind::Recv, 0, None, now);
        assert_eq!(c, b, "a freed slot is reused");
        assert_eq!(live(pool.release(a)).unwrap().wr_id, 7);
        assert_eq!(pool.live(), 1);
    }

    #[test]
    fn slots_never_move_as_the_pool_grows() {
        let now = Instant::now();
        let mut pool = ContextPool::default();
        let first = pool.acquire(0, OpKind::Write, 0, None, now);
        let many: Vec<_> = (1..3 * CHUNK as u64)
            .map(|i| pool.acquire(i, OpKind::Write, 0, None, now))
            .collect();
        assert_eq!(live(pool.release(first)).unwrap().wr_id, 0);
        for (i, p) in many.into_iter().enumerate() {
            assert_eq!(live(pool.release(p)).unwrap().wr_id, i as u64 + 1);
        }
        assert_eq!(pool.live(), 0);
    }

    #[test]
    fn stray_pointers_are_refused() {
        let mut pool = ContextPool::default();
        let a = pool.acquire(1, OpKind::Write, 0, None, Instant::now());
        assert!(matches!(
            pool.release(std::ptr::null_mut()),
            Released::Unknown
        ));
        assert!(matches!(
            pool.release(a.cast::<u8>().wrapping_add(1).cast()),
            Released::Unknown
        ));
        let mut other = 0u64;
        assert!(matches!(
            pool.release(std::ptr::from_mut(&mut other).cast()),
            Released::Unknown
        ));
    }

    #[test]
    fn overdue_operations_are_failed_once_and_their_late_completion_is_swallowed() {
        let start = Instant::now();
        let mut pool = ContextPool::default();
        let old = pool.acquire(1, OpKind::Write, 0, None, start);
        let young = pool.acquire(2, OpKind::Write, 0, None, start + Duration::from_secs(5));
        let recv = pool.acquire(3, OpKind::Recv, 0, None, start);
        let later = start + Duration::from_secs(6);
        let expired = pool.expire(later, Duration::from_secs(3));
        assert_eq!(expired.iter().map(|c| c.wr_id).collect::<Vec<_>>(), [1]);
        assert!(
            pool.expire(later, Duration::from_secs(3)).is_empty(),
            "only once"
        );
        assert_eq!(pool.live(), 3, "the abandoned slot stays taken");
        assert!(matches!(
            pool.release(old),
            Released::Abandoned { bounce: None }
        ));
        assert_eq!(pool.live(), 2);
        assert_eq!(
            live(pool.release(recv)).unwrap().wr_id,
            3,
            "receives never expire"
        );
        assert_eq!(live(pool.release(young)).unwrap().wr_id, 2);
    }
}
