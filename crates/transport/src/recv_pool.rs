//! The rotating pool of engine-owned receive buffers behind `submit_recvs` (paper 002 section
//! 3.3): every buffer is posted to the NIC; a message lands in one, which leaves the pool while
//! the user's callback reads it in place, and is posted again once the callback returns.
//!
//! Two threads share it: the domain worker delivers messages and reposts buffers, the callback
//! thread releases them. Each buffer's state is an atomic with three values, and a buffer moves
//! between them only by compare-and-swap, in one direction:
//! posted -> in callback (worker) -> returned (callback thread) -> posted (worker).
//! A buffer is therefore never reposted while its callback may still read it, never posted
//! twice, and never lost; the loom models below check exactly that.

use std::ptr::NonNull;

use crate::sync::{AtomicU8, Mutex, Ordering, lock};

const POSTED: u8 = 0;
const IN_CALLBACK: u8 = 1;
const RETURNED: u8 = 2;

/// A buffer was used out of its state order: a bug in a domain or in the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("receive buffer {index} was not in the expected state")]
pub(crate) struct PoolViolation {
    /// The buffer.
    pub(crate) index: u32,
}

/// `count` buffers of `buf_len` bytes in one allocation.
#[derive(Debug)]
pub(crate) struct RecvPool {
    memory: NonNull<u8>,
    buf_len: usize,
    states: Box<[AtomicU8]>,
    returned: Mutex<Vec<u32>>,
}

// SAFETY: the pool owns its allocation; bytes of a buffer are only written by the NIC while
// the buffer is posted and only read (through `message`) while it is in a callback, and the
// state machine makes those two phases exclusive.
unsafe impl Send for RecvPool {}
// SAFETY: as above; every shared access goes through the atomic states or the mutex.
unsafe impl Sync for RecvPool {}

impl RecvPool {
    /// `count` buffers of `buf_len` bytes, all considered posted (the caller posts them).
    pub(crate) fn new(count: u32, buf_len: usize) -> Self {
        let bytes = (count as usize).saturating_mul(buf_len).max(1);
        let memory = Box::into_raw(vec![0u8; bytes].into_boxed_slice()).cast::<u8>();
        Self {
            // SAFETY: Box::into_raw never returns null.
            memory: unsafe { NonNull::new_unchecked(memory) },
            buf_len,
            states: (0..count).map(|_| AtomicU8::new(POSTED)).collect(),
            returned: Mutex::new(Vec::with_capacity(count as usize)),
        }
    }

    /// Bytes per buffer.
    pub(crate) fn buf_len(&self) -> usize {
        self.buf_len
    }

    /// Address of buffer `index`, for posting it.
    pub(crate) fn buffer_addr(&self, index: u32) -> u64 {
        self.memory.as_ptr() as u64 + u64::from(index) * self.buf_len as u64
    }

    fn state(&self, index: u32) -> Result<&AtomicU8, PoolViolation> {
        self.states
            .get(index as usize)
            .ok_or(PoolViolation { index })
    }

    fn transition(&self, index: u32, from: u8, to: u8) -> Result<(), PoolViolation> {
        self.state(index)?
            .compare_exchange(from, to, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
            .map_err(|_| PoolViolation { index })
    }

    /// A message landed in posted buffer `index` (worker).
    pub(crate) fn deliver(&self, index: u32) -> Result<(), PoolViolation> {
        self.transition(index, POSTED, IN_CALLBACK)
    }

    /// The first `len` bytes of buffer `index`.
    ///
    /// # Safety
    /// Buffer `index` must be in a callback (delivered and not yet released), which keeps the
    /// NIC from writing it while the slice lives.
    pub(crate) unsafe fn message(&self, index: u32, len: usize) -> &[u8] {
        debug_assert_eq!(
            self.states[index as usize].load(Ordering::Acquire),
            IN_CALLBACK
        );
        let len = len.min(self.buf_len);
        let offset = index as usize * self.buf_len;
        // SAFETY: offset + len lies inside the allocation (index < count, len <= buf_len), and
        // the caller guarantees nothing writes the buffer while the slice lives.
        unsafe { std::slice::from_raw_parts(self.memory.as_ptr().add(offset), len) }
    }

    /// The callback on buffer `index` has returned (callback thread).
    pub(crate) fn release(&self, index: u32) -> Result<(), PoolViolation> {
        // The state changes before the index is published, so `reclaim` always finds it
        // returned.
        self.transition(index, IN_CALLBACK, RETURNED)?;
        lock(&self.returned).push(index);
        Ok(())
    }

    /// Takes every returned buffer back to posted and appends it to `to_post` (worker).
    pub(crate) fn reclaim(&self, to_post: &mut Vec<u32>) -> Result<(), PoolViolation> {
        let returned = std::mem::take(&mut *lock(&self.returned));
        for index in returned {
            self.transition(index, RETURNED, POSTED)?;
            to_post.push(index);
        }
        Ok(())
    }

    /// Buffers currently lent to callbacks.
    #[cfg(test)]
    pub(crate) fn in_callback(&self) -> usize {
        self.states
            .iter()
            .filter(|s| s.load(Ordering::Acquire) == IN_CALLBACK)
            .count()
    }
}

impl Drop for RecvPool {
    fn drop(&mut self) {
        let bytes = self.states.len().saturating_mul(self.buf_len).max(1);
        // SAFETY: `memory` came from Box::into_raw of a boxed slice of exactly `bytes` bytes
        // and is freed once, here.
        drop(unsafe {
            Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.memory.as_ptr(),
                bytes,
            ))
        });
    }
}

#[cfg(all(test, not(kvroute_loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_cycles_posted_callback_returned_posted() {
        let pool = RecvPool::new(2, 64);
        pool.deliver(1).unwrap();
        assert_eq!(pool.in_callback(), 1);
        // SAFETY: buffer 1 is in a callback.
        assert_eq!(unsafe { pool.message(1, 8) }, &[0; 8]);
        let mut to_post = Vec::new();
        pool.reclaim(&mut to_post).unwrap();
        assert!(to_post.is_empty(), "still in its callback");
        pool.release(1).unwrap();
        pool.reclaim(&mut to_post).unwrap();
        assert_eq!(to_post, [1]);
        assert_eq!(pool.in_callback(), 0);
    }

    #[test]
    fn out_of_order_use_is_refused() {
        let pool = RecvPool::new(1, 8);
        assert_eq!(
            pool.release(0),
            Err(PoolViolation { index: 0 }),
            "not in a callback"
        );
        pool.deliver(0).unwrap();
        assert_eq!(
            pool.deliver(0),
            Err(PoolViolation { index: 0 }),
            "not posted"
        );
        assert_eq!(
            pool.deliver(5),
            Err(PoolViolation { index: 5 }),
            "no such buffer"
        );
        assert_eq!(pool.buffer_addr(0), pool.memory.as_ptr() as u64);
    }
}

/// loom models: `cargo xtask loom`, against the real pool and a broken one that publishes a
/// released buffer before marking it returned.
#[cfg(all(test, kvroute_loom))]
mod loom_models {
    use super::*;
    use crate::sync::Arc;
    use loom::sync::atomic::AtomicBool;
    use loom::thread;

    trait Pool: Send + Sync + 'static {
        fn make() -> Self;
        fn deliver(&self, i: u32);
        fn release(&self, i: u32);
        fn reclaim(&self) -> Vec<u32>;
        fn is_posted(&self, i: u32) -> bool;
    }

    impl Pool for RecvPool {
        fn make() -> Self {
            RecvPool::new(1, 8)
        }
        fn deliver(&self, i: u32) {
            RecvPool::deliver(self, i).unwrap();
        }
        fn release(&self, i: u32) {
            RecvPool::release(self, i).unwrap();
        }
        fn reclaim(&self) -> Vec<u32> {
            let mut out = Vec::new();
            RecvPool::reclaim(self, &mut out).unwrap();
            out
        }
        fn is_posted(&self, i: u32) -> bool {
            self.states[i as usize].load(Ordering::SeqCst) == POSTED
        }
    }

    struct BrokenPool {
        state: AtomicU8,
        returned: Mutex<Vec<u32>>,
    }

    impl Pool for BrokenPool {
        fn make() -> Self {
            Self {
                state: AtomicU8::new(POSTED),
                returned: Mutex::new(Vec::new()),
            }
        }
        fn deliver(&self, _: u32) {
            self.state.store(IN_CALLBACK, Ordering::SeqCst);
        }
        fn release(&self, i: u32) {
            lock(&self.returned).push(i);
            self.state.store(RETURNED, Ordering::SeqCst);
        }
        fn reclaim(&self) -> Vec<u32> {
            let out = std::mem::take(&mut *lock(&self.returned));
            if !out.is_empty() {
                self.state.store(POSTED, Ordering::SeqCst);
            }
            out
        }
        fn is_posted(&self, _: u32) -> bool {
            self.state.load(Ordering::SeqCst) == POSTED
        }
    }

    /// The worker delivers buffer 0 and then reposts whatever comes back while the callback
    /// thread releases it: the buffer comes back once, only after its callback ended, and ends
    /// up posted.
    fn repost_races_release<P: Pool>() {
        loom::model(|| {
            let pool = Arc::new(P::make());
            let callback_done = Arc::new(AtomicBool::new(false));
            pool.deliver(0);
            let callback = {
                let (pool, done) = (pool.clone(), callback_done.clone());
                thread::spawn(move || {
                    done.store(true, Ordering::SeqCst);
                    pool.release(0);
                })
            };
            let mut reposted = Vec::new();
            for _ in 0..3 {
                let back = pool.reclaim();
                if !back.is_empty() {
                    assert!(
                        callback_done.load(Ordering::SeqCst),
                        "reposted during its callback"
                    );
                }
                reposted.extend(back);
                thread::yield_now();
            }
            callback.join().unwrap();
            reposted.extend(pool.reclaim());
            assert_eq!(reposted, [0], "returned exactly once");
            assert!(pool.is_posted(0), "the buffer must end up posted");
        });
    }

    #[test]
    fn recv_pool_reposts_each_buffer_once_after_its_callback() {
        repost_races_release::<RecvPool>();
    }

    #[test]
    fn broken_recv_pool_is_caught_by_the_model() {
        let caught = std::panic::catch_unwind(repost_races_release::<BrokenPool>);
        assert!(
            caught.is_err(),
            "the model must catch the lost buffer of BrokenPool"
        );
    }
}
