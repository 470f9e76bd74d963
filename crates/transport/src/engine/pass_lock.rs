//! The lock of a manual-progress group's pass ([`crate::Progress::Manual`]). Whoever runs a
//! pass or submits takes it with [`PassLock::try_lock`] and goes its way when another thread
//! holds it; only shutdown waits for it. It is taken twice per small write (the submit, then
//! the pass that sees the peer's answer), so it is one compare-and-swap to take and a plain
//! store to release, where a `Mutex` releases with a second atomic swap (it must look for
//! sleeping waiters, and here nobody sleeps).

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

/// A lock taken without waiting, or by spinning with yields ([`PassLock::lock`]).
#[derive(Debug, Default)]
pub(crate) struct PassLock<T> {
    held: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the value is reached only through a guard, and `held` admits one guard at a time
// (acquire on taking, release on dropping order the accesses), so sharing the lock shares the
// value between threads one at a time: `T: Send` is what that needs.
unsafe impl<T: Send> Sync for PassLock<T> {}

impl<T> PassLock<T> {
    pub(crate) fn new(value: T) -> Self {
        Self {
            held: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// The guard, unless another thread holds the lock.
    pub(crate) fn try_lock(&self) -> Option<PassGuard<'_, T>> {
        self.held
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| PassGuard { lock: self })
    }

    /// The guard, yielding the core while another thread holds the lock.
    pub(crate) fn lock(&self) -> PassGuard<'_, T> {
        loop {
            if let Some(guard) = self.try_lock() {
                return guard;
            }
            std::thread::yield_now();
        }
    }
}

/// Access to a [`PassLock`]'s value; dropping it releases the lock (also on unwinding).
pub(crate) struct PassGuard<'a, T> {
    lock: &'a PassLock<T>,
}

impl<T> Deref for PassGuard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        // SAFETY: this guard is the only one (see `PassLock`'s Sync).
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for PassGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference through it.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for PassGuard<'_, T> {
    fn drop(&mut self) {
        self.lock.held.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_guard_at_a_time_and_every_update_is_seen() {
        let lock = PassLock::new((0u64, false));
        let (threads, rounds) = (4, 50_000);
        std::thread::scope(|s| {
            for t in 0..threads {
                let lock = &lock;
                s.spawn(move || {
                    let mut done = 0;
                    while done < rounds {
                        // Half take it by trying, half by waiting.
                        let guard = if t % 2 == 0 {
                            lock.try_lock()
                        } else {
                            Some(lock.lock())
                        };
                        let Some(mut g) = guard else { continue };
                        assert!(!g.1, "two guards at once");
                        g.1 = true;
                        // A non-atomic read-modify-write: lost updates show a broken lock.
                        let seen = g.0;
                        std::hint::black_box(&seen);
                        g.0 = seen + 1;
                        g.1 = false;
                        done += 1;
                    }
                });
            }
        });
        assert_eq!(lock.try_lock().map(|g| g.0), Some(threads * rounds));
    }

    #[test]
    fn a_held_lock_refuses_try_lock_until_its_guard_drops() {
        let lock = PassLock::new(7);
        let g = lock.try_lock();
        assert!(g.is_some());
        assert!(lock.try_lock().is_none());
        drop(g);
        assert_eq!(lock.try_lock().map(|g| *g), Some(7));
    }
}
