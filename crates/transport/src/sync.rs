//! The synchronisation primitives of the model-checked modules ([`crate::imm_counter`],
//! [`crate::transfer_state`], [`crate::recv_pool`]): std's in normal builds, loom's when built
//! with `--cfg kvroute_loom` (`cargo xtask loom`), so the models check the production code itself.

#[cfg(kvroute_loom)]
pub(crate) use loom::sync::atomic::{AtomicU8, AtomicU64, Ordering};
#[cfg(kvroute_loom)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard};
#[cfg(not(kvroute_loom))]
pub(crate) use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
#[cfg(not(kvroute_loom))]
pub(crate) use std::sync::{Mutex, MutexGuard};

/// Locks `mutex`, ignoring poisoning: no user code runs while these locks are held, so a
/// poisoned lock can only mean a bug in this crate, and the data is still consistent at every
/// unlock point.
#[inline]
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
