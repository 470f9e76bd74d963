//! What the remote crate's integration tests share: holders and requesters, each on an engine
//! of its own (requesters over the in-process `mem` fabric).

use std::net::{SocketAddr, TcpListener};

use anyhow::Result;
use kvroute_kvstore::{ChunkId, CorpusSpec};
use kvroute_remote::{HeldChunks, Holder, HolderConfig, Requester, RequesterConfig};
use kvroute_transport::{MemFabric, TransferEngine};

/// A holder on `engine` of `chunks` of the synthetic corpus `spec`, serving with `config` on
/// a loopback port.
pub(crate) fn start_holder(
    engine: TransferEngine,
    spec: &CorpusSpec,
    chunks: &[u32],
    config: HolderConfig,
) -> Result<Holder> {
    let ids: Vec<ChunkId> = chunks.iter().map(|&c| ChunkId(c)).collect();
    let held = HeldChunks::generate(&engine, spec, &ids)?;
    Ok(Holder::start(
        engine,
        TcpListener::bind("127.0.0.1:0")?,
        held,
        config,
    )?)
}

/// A requester connected to the holders at `holders`.
pub(crate) fn connect(
    fabric: &MemFabric,
    holders: &[SocketAddr],
    config: RequesterConfig,
) -> Result<Requester> {
    Ok(Requester::connect(
        TransferEngine::mem(fabric, 1)?,
        holders,
        config,
    )?)
}
