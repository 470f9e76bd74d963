//! A [`Stepper`] on a thread of its own, for async engines: [`BackgroundStepper::step`]
//! returns a [`Reply`], a plain future that any executor awaits (or [`Reply::wait`] blocks on)
//! without a runtime being required or started. The requests are owned, since they cross to
//! the stepper's thread.

use kvroute_kernels::Cache;
use kvroute_kvstore::ChunkId;

use super::{ChunkRef, LocalKv, Picks, StepError, StepOutput, StepRequest, Stepper};
use crate::background::{Reply, Worker};
use crate::error::RemoteError;

/// A [`ChunkRef`] that owns its picks.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnedChunkRef {
    /// The chunk.
    pub chunk: ChunkId,
    /// Position of its first token in the request's context.
    pub start: i64,
    /// Sparse: chunk-local indices per query token (-1 = padding), and `k`.
    pub picks: Option<(Vec<i32>, usize)>,
}

/// A [`LocalKv`] that owns its rows: `tokens` rows, contiguous (`block_tokens` = 0) or in
/// blocks of `block_tokens` addressed by `table`.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnedLocalKv {
    /// The rows (or the pool of blocks), `[n, 576]` bf16.
    pub rows: Vec<u16>,
    /// Tokens per block; 0 for contiguous rows.
    pub block_tokens: usize,
    /// The block table (paged rows).
    pub table: Vec<u32>,
    /// Tokens attended.
    pub tokens: usize,
    /// Sparse: the indices selected per query token, and `k`.
    pub picks: Option<(Vec<i32>, usize)>,
}

/// A [`StepRequest`] that owns its rows.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnedStepRequest {
    /// Query rows, `[heads x new tokens, 576]` bf16.
    pub queries: Vec<u16>,
    /// Query rows per query token.
    pub heads: usize,
    /// The remote chunks attended.
    pub chunks: Vec<OwnedChunkRef>,
    /// The request's own KV.
    pub local: Option<OwnedLocalKv>,
}

/// A stepper served by a thread of its own; dropping it finishes the queued steps, then stops
/// the thread and drops the stepper.
#[derive(Debug)]
pub struct BackgroundStepper {
    worker: Worker<Stepper>,
}

impl BackgroundStepper {
    /// Moves `stepper` onto a new thread.
    pub fn spawn(stepper: Stepper) -> Result<Self, RemoteError> {
        Ok(Self {
            worker: Worker::spawn(stepper, "kvroute-stepper")?,
        })
    }

    /// [`Stepper::step`] of owned requests, on the stepper's thread.
    pub fn step(
        &self,
        layer: u16,
        requests: Vec<OwnedStepRequest>,
    ) -> Reply<Result<StepOutput, StepError>> {
        self.worker
            .with(move |stepper| stepper.step_owned(layer, &requests))
    }

    /// Runs `f` on the stepper's thread, in call order (its stats, its requester).
    pub fn with<T, F>(&self, f: F) -> Reply<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut Stepper) -> T + Send + 'static,
    {
        self.worker.with(f)
    }
}

impl Stepper {
    /// [`Stepper::step`] of owned requests.
    pub fn step_owned(
        &mut self,
        layer: u16,
        requests: &[OwnedStepRequest],
    ) -> Result<StepOutput, StepError> {
        fn picks(p: &Option<(Vec<i32>, usize)>) -> Option<Picks<'_>> {
            p.as_ref().map(|(indices, k)| Picks { indices, k: *k })
        }
        let chunks: Vec<Vec<ChunkRef<'_>>> = requests
            .iter()
            .map(|r| {
                r.chunks
                    .iter()
                    .map(|c| ChunkRef {
                        chunk: c.chunk,
                        start: c.start,
                        picks: picks(&c.picks),
                    })
                    .collect()
            })
            .collect();
        let mut borrowed = Vec::with_capacity(requests.len());
        for (i, (r, chunks)) in requests.iter().zip(&chunks).enumerate() {
            let local = r
                .local
                .as_ref()
                .map(|l| {
                    let cache = if l.block_tokens == 0 {
                        let n = l.tokens.saturating_mul(kvroute_kernels::layout::D_QK);
                        l.rows.get(..n).map_or_else(
                            || {
                                Err(kvroute_kernels::KernelError::Shape {
                                    what: "own KV rows (tokens x 576)",
                                    expected: n,
                                    got: l.rows.len(),
                                })
                            },
                            Cache::contiguous,
                        )
                    } else {
                        Cache::paged_blocks(&l.rows, l.block_tokens, &l.table, l.tokens)
                    };
                    cache.map(|cache| LocalKv {
                        cache,
                        picks: picks(&l.picks),
                    })
                })
                .transpose()
                .map_err(|e| StepError::Request {
                    request: i,
                    why: format!("its own KV: {e}"),
                })?;
            borrowed.push(StepRequest {
                queries: &r.queries,
                heads: r.heads,
                chunks,
                local,
            });
        }
        self.step(layer, &borrowed)
    }
}
