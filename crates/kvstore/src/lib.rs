//! # kvroute-kvstore
//!
//! Where KV lives between the transport and the kernels (docs/kvstore.md):
//!
//! - [`layout`]: layer blocks `[tokens, 576]` bf16 and full blocks (the `L` layer blocks of the
//!   same tokens back to back, so concatenating layer blocks is a full block with no copy), in
//!   whole 64-token pages, as typed views over registered memory or vectors;
//! - [`pool`]: the paged pool, blocks handed out by index (what paged writes target);
//! - [`registry`]: canonical chunk id -> holder address, region descriptor, layout, stored
//!   positions, with replicas;
//! - [`directory`]: the cluster directory holders register in and requesters watch, in
//!   process or on etcd (the `etcd` feature), under leases;
//! - [`corpus`]: a deterministic synthetic corpus with a model preset's dimensions (random
//!   latents, RoPE applied at the stored positions, so splices are real).
//!
//! - [`prefix`]: the prefix cache, a trie over chained block hashes with reference counts and
//!   LRU or tail-first eviction;
//! - [`hybrid`]: the hybrid prefix-cache pool (paper 001 section 3.2): block-level KV and
//!   request-level state, prefix-cache and transfer-cache blocks, under one budget;
//! - [`storage`]: the storage tier, full blocks in checksummed files that a crash never tears;
//! - [`trace`]: Mooncake-format traces, parsed as untrusted input and replayed through the
//!   prefix cache (and the storage tier).
//!
//! ```
//! use kvroute_kvstore::{BlockLayout, ChunkId, CorpusSpec, FullBlock, PagedPool, PAGE_BYTES};
//!
//! let spec = CorpusSpec {
//!     layers: 2, chunk_tokens: 100, chunks: 3, seed: 1, rope_theta: 10_000.0,
//!     yarn: None, rope_layout: Default::default(),
//! };
//! let block = spec.chunk(ChunkId(2))?;
//! let full = FullBlock::new(&block, spec.layout())?;
//! assert_eq!(full.layer(1)?.tokens(), 100);
//! // A requester's pool takes the chunk's 2 layers x 2 pages.
//! let pool = PagedPool::new(16, PAGE_BYTES)?;
//! let pages = pool.alloc(spec.layout().pages())?;
//! assert_eq!(pages.len(), 4);
//! # Ok::<(), kvroute_kvstore::StoreError>(())
//! ```

pub mod corpus;
pub mod directory;
mod error;
pub mod hybrid;
pub mod layout;
pub mod observe;
pub mod pool;
pub mod prefix;
pub mod registry;
pub mod staging;
pub mod storage;
pub mod trace;

pub use corpus::CorpusSpec;
pub use directory::{Directory, DirectoryError, DirectoryView};
pub use error::StoreError;
pub use layout::{BlockLayout, FullBlock, LayerBlock, PAGE_BYTES, ROW_BYTES, concat_layers};
pub use pool::PagedPool;
pub use prefix::{BlockKey, CacheError, Eviction, PrefixCache};
pub use registry::{ChunkEntry, ChunkId, ChunkRegistry, MAX_BLOCK_TOKENS};
pub use staging::{StagingError, StagingRegion};
pub use storage::{BlockStore, StorageError};
pub use trace::{ReplayConfig, ReplayReport, TraceReader, TraceRecord, replay};
