//! # kvroute-transport
//!
//! A reliable-unordered RDMA transfer engine (paper 002, "fabric-lib / TransferEngine"): the
//! common ground of ConnectX RC and EFA SRD. Nothing is ordered, not even two writes to the
//! same peer; completion is by counting. A write may carry a 32-bit immediate, which the
//! receiver's IMM counter counts per value, and [`TransferEngine::expect_imm_count`] fires
//! once a given number have landed, whether they landed before or after the call. For a
//! doorbell, one value waited on again and again, [`TransferEngine::watch_imm`] counts a
//! value's arrivals in a word read without a lock, and [`TransferEngine::submit_imm_to`]
//! writes immediates to a destination resolved once.
//!
//! Layers, bottom up:
//! - [`Domain`] (one NIC): `mem` here ([`mem::MemDomain`], in-process, for tests and benches);
//!   libfabric (EFA, tcp, shm) and verbs (ConnectX) plug into the same trait.
//! - domain groups (one device, 1-4 NICs) shard writes over their NICs, each shard with its
//!   NIC's own rkey, and aggregate per-transfer completion (`transfer_state`).
//! - [`TransferEngine`]: the API of paper 002 figure 2, a worker thread per group, a callback
//!   thread for user code, a memory-word watcher.
//!
//! The completion logic is plain state machines (`imm_counter`, `transfer_state`,
//! `recv_pool`, crate-private) model-checked with loom (`cargo xtask loom`), each model run against a
//! broken variant that it must catch.
//!
//! ```
//! use kvroute_transport::{MemFabric, OnDone, Pages, TransferEngine, TransferShape};
//!
//! let fabric = MemFabric::new();
//! let (prefiller, decoder) = (TransferEngine::mem(&fabric, 2)?, TransferEngine::mem(&fabric, 2)?);
//! let kv = prefiller.alloc_mr(16 * 1024)?;
//! let pool = decoder.alloc_mr(64 * 1024)?;
//! kv.fill(7);
//!
//! // The decoder expects one immediate per page, then the prefiller writes 16 pages into it.
//! let pages = decoder.expected_arrivals(TransferShape::PagedWrites { pages: 16 });
//! let landed = decoder.imm_count(42, pages);
//! let src = Pages::new((0..16).collect::<Vec<u32>>(), 1024, 0);
//! let dst = Pages::new((0..16).map(|i| 63 - i).collect::<Vec<u32>>(), 1024, 0);
//! prefiller.submit_paged_writes(1024, Some(42), (kv.handle(), &src), (pool.desc(), &dst), OnDone::nothing())?;
//! # fn block_on<F: std::future::Future>(f: F) -> F::Output {
//! #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
//! # }
//! block_on(landed)?;
//! assert!(pool.to_vec()[48 * 1024..].iter().all(|&b| b == 7));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod addr;
#[cfg(feature = "bench")]
pub mod bench;
mod buffer;
pub mod cancel;
pub mod domain;
mod engine;
pub mod error;
pub mod fabric;
pub mod file;
pub(crate) mod imm_counter;
pub mod mem;
pub mod mr;
pub mod on_done;
pub mod plan;
pub(crate) mod recv_pool;
pub mod request;
mod staging;
mod sync;
pub(crate) mod transfer_state;
pub mod verbs;
mod watcher;

/// A hash map for the data path's lookups (a peer by its address, an immediate's slot, a
/// completion's queue pair): foldhash, seeded per process, at a few nanoseconds per key where
/// std's SipHash takes tens.
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

pub use addr::{DomainAddr, MAX_NICS, NetAddr};
pub use buffer::{Grant, GrantedBuffer, RegisteredBuffer, SealedBuffer};
pub use cancel::CancellationToken;
pub use domain::Domain;
pub use engine::{
    Backpressure, DomainStats, EngineBuilder, EngineConfig, EngineStats, GroupStats, ImmTarget,
    ImmWatch, PeerGroupHandle, Progress, TRANSFER_BUCKETS, TransferEngine, UnexpectedImms,
    describe_metrics, export_metrics, time_transfers,
};
pub use error::{Side, TransferError, TransportError};
pub use fabric::{FabricConfig, FabricDomain, FabricReport, ProviderChoice};
pub use mem::{FaultPlan, MemFabric};
pub use mr::{Access, Device, MrDesc, MrHandle, RemoteKey};
pub use on_done::{DoneCounter, DoneFlag, OnDone, Outcome, TransferFuture, block_on};
pub use plan::TransferShape;
pub use request::{Pages, ScatterDst};
pub use staging::{StagedBytes, Staging};
pub use verbs::{VerbsConfig, VerbsDomain};
pub use watcher::WatchedWord;
