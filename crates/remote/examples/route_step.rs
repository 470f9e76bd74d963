//! One holder and one requester, over the in-process `mem` fabric and over libfabric's `shm`
//! provider: a dense and a sparse decode step routed to the holder, each merged output checked
//! against attention computed locally over the same chunks.
//!
//!     cargo run -p kvroute-remote --example route_step            # mem, then shm
//!     cargo run -p kvroute-remote --example route_step -- mem     # one of them

use std::net::TcpListener;
use std::time::Duration;

use kvroute_kernels::{
    Backend, Cache, Queries, RopeLayout, Selection, merge, partial_dense, partial_sparse,
};
use kvroute_kvstore::corpus::queries;
use kvroute_kvstore::{ChunkId, CorpusSpec};
use kvroute_remote::{Call, HeldChunks, Holder, HolderConfig, Requester, RequesterConfig, Sparse};
use kvroute_transport::{FabricConfig, MemFabric, ProviderChoice, TransferEngine};

/// The softmax scale of a 192-wide query-key head (DeepSeek's MLA).
const SCALE: f32 = 0.0722;
/// Largest difference from local attention allowed: the partials cross the wire as bf16.
const TOLERANCE: f32 = 4e-3;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let which = std::env::args().nth(1);
    for fabric in ["mem", "shm"] {
        if which.as_deref().is_some_and(|w| w != fabric) {
            continue;
        }
        let (holder_engine, requester_engine) = engines(fabric)?;
        let err = route_two_steps(holder_engine, requester_engine)?;
        println!("{fabric}: dense and sparse steps match local attention (max abs {err:.1e})");
    }
    Ok(())
}

/// A holder's engine and a requester's, on `fabric`.
fn engines(fabric: &str) -> Result<(TransferEngine, TransferEngine), Box<dyn std::error::Error>> {
    if fabric == "mem" {
        let mem = MemFabric::new();
        return Ok((TransferEngine::mem(&mem, 1)?, TransferEngine::mem(&mem, 1)?));
    }
    let config = FabricConfig {
        provider: ProviderChoice::Shm,
        required: true,
        ..FabricConfig::default()
    };
    let holder = TransferEngine::fabric(&config, Default::default())?.0;
    let requester = TransferEngine::fabric(&config, Default::default())?.0;
    Ok((holder, requester))
}

/// Starts a holder of two chunks, connects a requester, routes one dense and one sparse step
/// over both chunks and returns the largest difference from local attention.
fn route_two_steps(
    holder_engine: TransferEngine,
    requester_engine: TransferEngine,
) -> Result<f32, Box<dyn std::error::Error>> {
    // Two 128-token chunks of a 4-layer synthetic corpus. A serving engine hands over its own
    // registered KV instead, with `HeldChunks::new`.
    let corpus = CorpusSpec {
        layers: 4,
        chunk_tokens: 128,
        chunks: 2,
        seed: 1,
        rope_theta: 10_000.0,
        yarn: None,
        rope_layout: RopeLayout::Interleaved,
    };
    let ids = [ChunkId(0), ChunkId(1)];
    let held = HeldChunks::generate(&holder_engine, &corpus, &ids)?;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let holder = Holder::start(holder_engine, listener, held, HolderConfig::default())?;

    let config = RequesterConfig {
        timeout: Duration::from_secs(5),
        ..RequesterConfig::new(SCALE)
    };
    let mut requester = Requester::connect(requester_engine, &[holder.addr()], config)?;

    // 16 query rows (one token's heads) at the position after the document.
    let rows = 16;
    let q = queries(rows, 256, &corpus.rope()?, 7);
    let layer = 2;
    let blocks = ids
        .iter()
        .map(|&id| corpus.chunk(id))
        .collect::<Result<Vec<_>, _>>()?;
    let doc = corpus.document_layer(&blocks, layer)?;
    let cache = Cache::contiguous(&doc)?;

    // Dense: every token of both chunks.
    let dense: Vec<Call<'_>> = ids
        .iter()
        .map(|&chunk| Call {
            chunk,
            layer: layer as u16,
            queries: &q,
            sparse: None,
        })
        .collect();
    let parts = requester
        .route(&dense)
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let routed = merge(&parts.iter().collect::<Vec<_>>())?;
    let local = partial_dense(Backend::Cpu, &Queries::new(&q)?, &cache, SCALE)?;
    let dense_err = max_abs(&routed.o, &local.o);

    // Sparse: 40 tokens selected across both chunks (document positions), sent to each chunk
    // as its own chunk-local indices.
    let selected: Vec<i32> = (0..40).map(|i| (i * 37 + 5) % 256).collect();
    let local_of = |c: i32| -> Vec<i32> {
        let tokens = corpus.chunk_tokens as i32;
        selected
            .iter()
            .filter(|&&t| t / tokens == c)
            .map(|&t| t - c * tokens)
            .collect()
    };
    let per_chunk = [local_of(0), local_of(1)];
    let sparse: Vec<Call<'_>> = ids
        .iter()
        .zip(&per_chunk)
        .map(|(&chunk, indices)| Call {
            chunk,
            layer: layer as u16,
            queries: &q,
            sparse: Some(Sparse {
                indices,
                k: indices.len() as u32,
                rows_per_token: rows as u32,
            }),
        })
        .collect();
    let parts = requester
        .route(&sparse)
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let routed = merge(&parts.iter().collect::<Vec<_>>())?;
    let selection = Selection::new(&selected, selected.len(), rows, rows, cache.tokens())?;
    let local = partial_sparse(Backend::Cpu, &Queries::new(&q)?, &cache, &selection, SCALE)?;
    let sparse_err = max_abs(&routed.o, &local.o);

    let err = dense_err.max(sparse_err);
    if err.is_nan() || err > TOLERANCE {
        return Err(format!("routed attention differs from local by {err}").into());
    }
    Ok(err)
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
