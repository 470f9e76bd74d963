//! The holder's side: the context's chunks prefilled through the model, each as an
//! independent sequence at its canonical positions, and served out of a paged KV cache.

use kvroute_kernels::RopeLayout;
use kvroute_kvstore::ChunkId;
use kvroute_model::Model;
use kvroute_remote::HeldChunks;
use kvroute_transport::TransferEngine;

use crate::context::ContextSpec;
use crate::error::DecodeError;

/// One prefilled chunk: its id, every layer's cache rows (`[tokens, 576]` bf16) and the
/// positions they were rotated at.
pub type PrefilledChunk = kvroute_remote::ChunkRows;

/// Prefills chunk `chunk` of `context` through `model` at its canonical positions.
pub fn prefill_chunk(
    model: &Model,
    context: &ContextSpec,
    chunk: ChunkId,
) -> Result<PrefilledChunk, DecodeError> {
    if chunk.0 >= context.chunks {
        return Err(DecodeError::Config(format!(
            "{chunk} is not in a context of {} chunks",
            context.chunks
        )));
    }
    let tokens = context.chunk_ids(chunk, model.config().vocab_size);
    let positions = context.canonical_positions(chunk);
    let rows = model.prefill(&tokens, &positions)?;
    Ok(PrefilledChunk {
        id: chunk,
        layers: rows,
        positions,
    })
}

/// Chunks `ids` of `context` prefilled through `model` and laid out in a fresh local-only
/// paged cache of `block_tokens`-token blocks on `engine`: what a holder serves.
pub fn held_chunks(
    model: &Model,
    engine: &TransferEngine,
    context: &ContextSpec,
    ids: &[ChunkId],
    block_tokens: usize,
) -> Result<HeldChunks, DecodeError> {
    context.validate()?;
    let chunks = ids
        .iter()
        .map(|&id| prefill_chunk(model, context, id))
        .collect::<Result<Vec<_>, _>>()?;
    // DeepSeek's checkpoints pair adjacent RoPE dims (the model's rotation says which).
    let layout: RopeLayout = model.rope().layout();
    Ok(HeldChunks::paged_from_layers(
        engine,
        chunks,
        layout,
        block_tokens,
        context.seed,
    )?)
}
