//! The route example's dense step from async code under tokio: the requester runs on a thread
//! of its own (`BackgroundRequester`) and each call is a future the runtime awaits. Two steps
//! are in flight at once; both are checked against local attention.
//!
//!     cargo run -p kvroute-remote --example route_async

use std::net::TcpListener;

use kvroute_kernels::{Backend, Cache, Queries, RopeLayout, merge, partial_dense};
use kvroute_kvstore::corpus::queries;
use kvroute_kvstore::{ChunkId, CorpusSpec};
use kvroute_remote::{
    BackgroundRequester, HeldChunks, Holder, HolderConfig, OwnedCall, Requester, RequesterConfig,
};
use kvroute_transport::{MemFabric, TransferEngine};

const SCALE: f32 = 0.0722;
const TOLERANCE: f32 = 4e-3;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let fabric = MemFabric::new();
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
    let engine = TransferEngine::mem(&fabric, 1)?;
    let held = HeldChunks::generate(&engine, &corpus, &ids)?;
    let holder = Holder::start(
        engine,
        TcpListener::bind("127.0.0.1:0")?,
        held,
        HolderConfig::default(),
    )?;
    let requester = Requester::connect(
        TransferEngine::mem(&fabric, 1)?,
        &[holder.addr()],
        RequesterConfig::new(SCALE),
    )?;
    let requester = BackgroundRequester::spawn(requester)?;

    let blocks = ids
        .iter()
        .map(|&id| corpus.chunk(id))
        .collect::<Result<Vec<_>, _>>()?;
    // Two decode steps (layers 1 and 3) submitted before either is awaited.
    let steps = [1u32, 3];
    let mut pending = Vec::new();
    for (n, &layer) in steps.iter().enumerate() {
        let q = queries(16, 256, &corpus.rope()?, 11 + n as u64);
        let calls = ids
            .iter()
            .map(|&chunk| OwnedCall {
                chunk,
                layer: layer as u16,
                queries: q.clone(),
                sparse: None,
            })
            .collect();
        pending.push((layer, q, requester.route_merged(calls)));
    }
    for (layer, q, reply) in pending {
        let step = reply.await??;
        let routed = merge(&step.parts.iter().collect::<Vec<_>>())?;
        let doc = corpus.document_layer(&blocks, layer)?;
        let local = partial_dense(
            Backend::Cpu,
            &Queries::new(&q)?,
            &Cache::contiguous(&doc)?,
            SCALE,
        )?;
        let err = routed
            .o
            .iter()
            .zip(&local.o)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        if routed.o.len() != local.o.len() || err.is_nan() || err > TOLERANCE {
            return Err(format!("layer {layer}: routed differs from local by {err}").into());
        }
        println!("layer {layer}: awaited step matches local attention (max abs {err:.1e})");
    }
    Ok(())
}
