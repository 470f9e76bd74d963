//! The store's typed errors.

use thiserror::Error;

/// What can go wrong in the store. Inputs from peers (a registry entry, a page list) are
/// checked and refused with one of these; nothing panics on them.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum StoreError {
    /// A dimension was zero or too large to address.
    #[error("bad layout: {0}")]
    Layout(&'static str),
    /// A layer, token or page index past its bound.
    #[error("{what} {index} out of range (bound {bound})")]
    OutOfRange {
        /// What was indexed.
        what: &'static str,
        /// The index given.
        index: u64,
        /// The exclusive bound.
        bound: u64,
    },
    /// A view's memory does not match its layout.
    #[error("{what}: expected {expected} elements, got {got}")]
    Shape {
        /// What was checked.
        what: &'static str,
        /// Elements the layout needs.
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// The pool has fewer free pages than asked for.
    #[error("pool exhausted: {wanted} pages wanted, {free} free")]
    PoolExhausted {
        /// Pages asked for.
        wanted: usize,
        /// Pages free.
        free: usize,
    },
    /// A page returned to the pool that it does not hold as allocated.
    #[error("page {0} freed but not allocated (double free or foreign page)")]
    NotAllocated(u32),
    /// A registry entry that contradicts itself.
    #[error("invalid chunk entry for chunk {chunk}: {why}")]
    InvalidEntry {
        /// The chunk id.
        chunk: u32,
        /// What is wrong.
        why: &'static str,
    },
    /// No holder is registered for the chunk.
    #[error("chunk {0} is not registered")]
    UnknownChunk(u32),
    /// A kernel refused its input (the RoPE parameters of a corpus, for instance).
    #[error(transparent)]
    Kernel(#[from] kvroute_kernels::KernelError),
}
