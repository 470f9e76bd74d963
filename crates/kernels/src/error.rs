//! What can be wrong with a kernel's inputs. Every check runs before any work, so a refused
//! call has written nothing.

use thiserror::Error;

/// A kernel call refused.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum KernelError {
    /// A buffer's length does not match the shape it is said to have.
    #[error("{what}: expected {expected} elements, got {got}")]
    Shape {
        /// Which input.
        what: &'static str,
        /// Elements the shape implies.
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// An index (a selected token, a page of a block table) points outside its range.
    #[error("{what}: index {index} at position {at} is outside 0..{bound}")]
    IndexOutOfRange {
        /// Which input.
        what: &'static str,
        /// The offending value.
        index: i64,
        /// Where it was found.
        at: usize,
        /// The exclusive upper bound.
        bound: usize,
    },
    /// A scalar parameter is NaN, infinite or outside its domain.
    #[error("{what} = {value} is not allowed: {why}")]
    Parameter {
        /// Which parameter.
        what: &'static str,
        /// Its value.
        value: f64,
        /// What it must be.
        why: &'static str,
    },
    /// An input that must not be empty is.
    #[error("{0} is empty")]
    Empty(&'static str),
    /// Partials to merge cover different numbers of query rows.
    #[error("partial {index} has {got} rows, the first has {expected}")]
    RowMismatch {
        /// The partial's position in the list.
        index: usize,
        /// Rows of the first partial.
        expected: usize,
        /// Rows of this one.
        got: usize,
    },
    /// A partial's statistics are not a valid (o, m, l) triple (from a peer, a file).
    #[error("partial row {row}: {why}")]
    InvalidPartial {
        /// The row.
        row: usize,
        /// What is wrong.
        why: &'static str,
    },
    /// A query row's partial is not finite although the row attends at least one token: a NaN
    /// or infinity in its query row or in a cache row it attends, or a score beyond f32's
    /// range. Every backend refuses it (never NaN in the output, never a finite or empty row
    /// that would merge into a silently wrong answer).
    #[error(
        "query row {row}: the partial is not finite ({why}): a NaN or infinity in the inputs, or a score beyond f32's range"
    )]
    NonFinite {
        /// The first such row.
        row: usize,
        /// Which part of the result is not finite.
        why: &'static str,
    },
    /// Two destinations of a scatter are the same page.
    #[error("block table: page {page} appears twice (positions {first} and {second})")]
    DuplicatePage {
        /// The page.
        page: u32,
        /// First position.
        first: usize,
        /// Second position.
        second: usize,
    },
    /// One request of a batched call ([`crate::partial_batched`]) is refused: which one, and why.
    #[error("request {request}: {source}")]
    Request {
        /// The request's position in the batch.
        request: usize,
        /// What is wrong with it.
        source: Box<KernelError>,
    },
    /// The CUDA backend was asked for and cannot run here.
    #[error("CUDA backend unavailable: {0}")]
    CudaUnavailable(String),
    /// A CUDA call failed on a machine where CUDA is present (compile, allocation, launch).
    #[error("CUDA: {0}")]
    Cuda(String),
}

/// Checks a buffer's length against its shape.
pub(crate) fn check_len(
    what: &'static str,
    expected: usize,
    got: usize,
) -> Result<(), KernelError> {
    if expected == got {
        Ok(())
    } else {
        Err(KernelError::Shape {
            what,
            expected,
            got,
        })
    }
}
