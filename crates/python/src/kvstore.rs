//! The KV store from Python (`kvroute-kvstore`): the [`PrefixCache`] over chained block
//! hashes (LRU or tail-first eviction, pins), a trace replay through it (`kvroute trace
//! replay --json`), and the crash-safe checksummed storage tier ([`BlockStore`]: write,
//! read, verify).

use std::collections::HashSet;
use std::fs::File;
use std::io::BufReader;
use std::path::PathBuf;
use std::time::Instant;

use kvroute_kvstore::storage::Verify;
use kvroute_kvstore::trace::ReplayError;
use kvroute_kvstore::{
    BlockKey, BlockLayout, Eviction, ReplayConfig, ReplayReport, TraceReader, replay,
};
use numpy::PyArray1;
use pyo3::prelude::*;
use serde::Serialize;

use crate::arrays::{slice, u16_rows};
use crate::errors::{Kind, ToPyErr, error, invalid, py_err};
use crate::record::to_record;
use crate::wait::interruptible;

impl ToPyErr for ReplayError {
    fn kind(&self) -> Kind {
        match self {
            ReplayError::Trace(_) => Kind::Corrupt,
            ReplayError::Cache(e) => e.kind(),
            ReplayError::Storage(e) => e.kind(),
            ReplayError::Config(_) => Kind::InvalidInput,
        }
    }
}

/// The largest cache a `PrefixCache` or a replay may have, in blocks: a bounded cache
/// reserves its nodes up front, and a reservation the machine cannot back aborts the process.
pub(crate) const MAX_CACHE_BLOCKS: usize = 1 << 24;

fn policy_of(name: &str) -> PyResult<Eviction> {
    name.parse::<Eviction>().map_err(py_err)
}

/// An evicted block: `(hash, parent, value)`.
type Evicted = (u64, Option<u64>, u64);

/// A prefix cache of KV blocks named by chained hashes: block `i` of a prompt is
/// `(parent=hashes[i-1], hash=hashes[i])`; a value (an int: a slot, a page, an id) per
/// block. `capacity` blocks (0: unbounded; at most 2**24, reserved up front); `policy`
/// `"lru"` or `"tail-first"`.
#[pyclass(module = "kvroute")]
#[derive(Debug)]
pub(crate) struct PrefixCache {
    inner: kvroute_kvstore::PrefixCache<u64>,
}

#[pymethods]
impl PrefixCache {
    /// `PrefixCache(capacity, policy="lru")`.
    #[new]
    #[pyo3(signature = (capacity, policy = "lru"))]
    fn new(capacity: usize, policy: &str) -> PyResult<Self> {
        crate::sched::in_range("capacity", capacity as u64, 0, MAX_CACHE_BLOCKS as u64)?;
        Ok(Self {
            inner: kvroute_kvstore::PrefixCache::new(capacity, policy_of(policy)?),
        })
    }

    /// Blocks of the longest cached prefix of `hashes` (no recency change).
    fn lookup(&self, hashes: Vec<u64>) -> usize {
        self.inner.longest_prefix(&hashes)
    }

    /// One request as trace studies replay it: the hit is the longest cached prefix at
    /// arrival; every block is then touched in order, a missing one inserted with
    /// `values[i]` (default `i`). Returns `(hit_blocks, inserted, evicted)`, `evicted` the
    /// `(hash, parent, value)` of each block evicted to make room.
    #[pyo3(signature = (hashes, values = None))]
    fn access(
        &mut self,
        hashes: Vec<u64>,
        values: Option<Vec<u64>>,
    ) -> PyResult<(usize, usize, Vec<Evicted>)> {
        if values.as_ref().is_some_and(|v| v.len() != hashes.len()) {
            return Err(invalid("values needs one value per hash"));
        }
        let mut evicted = Vec::new();
        let a = self
            .inner
            .access(
                &hashes,
                |i| values.as_ref().map_or(i as u64, |v| v[i]),
                &mut |k: BlockKey, v| evicted.push((k.hash, k.parent, v)),
            )
            .map_err(py_err)?;
        Ok((a.hit_blocks, a.inserted, evicted))
    }

    /// Caches block `(parent, hash)` with `value` as the most recent, evicting the coldest
    /// unpinned block first when full; returns the evicted `(hash, parent, value)`s.
    #[pyo3(signature = (hash, value, parent = None))]
    fn insert(&mut self, hash: u64, value: u64, parent: Option<u64>) -> PyResult<Vec<Evicted>> {
        let mut evicted = Vec::new();
        self.inner
            .insert(BlockKey { parent, hash }, value, &mut |k: BlockKey, v| {
                evicted.push((k.hash, k.parent, v))
            })
            .map_err(py_err)?;
        Ok(evicted)
    }

    /// The value of block `(parent, hash)`, or None.
    #[pyo3(signature = (hash, parent = None))]
    fn get(&self, hash: u64, parent: Option<u64>) -> Option<u64> {
        self.inner.get(BlockKey { parent, hash }).copied()
    }

    /// Makes block `(parent, hash)` the most recent; whether it is cached.
    #[pyo3(signature = (hash, parent = None))]
    fn touch(&mut self, hash: u64, parent: Option<u64>) -> bool {
        self.inner.touch(BlockKey { parent, hash })
    }

    /// Pins the cached prefix of `hashes` (pinned blocks are never evicted); returns how
    /// many blocks were pinned.
    fn pin(&mut self, hashes: Vec<u64>) -> usize {
        self.inner.pin(&hashes)
    }

    /// Unpins the first `blocks` blocks of `hashes` (as `pin` returned).
    fn unpin(&mut self, hashes: Vec<u64>, blocks: usize) -> PyResult<()> {
        self.inner.unpin(&hashes, blocks).map_err(py_err)
    }

    /// Evicts the coldest unpinned block; its `(hash, parent, value)`, or None.
    fn evict(&mut self) -> Option<Evicted> {
        self.inner.evict_one().map(|(k, v)| (k.hash, k.parent, v))
    }

    /// Removes block `(parent, hash)` and returns its value (PinnedError if pinned,
    /// NotFoundError if absent).
    #[pyo3(signature = (hash, parent = None))]
    fn remove(&mut self, hash: u64, parent: Option<u64>) -> PyResult<u64> {
        self.inner.remove(BlockKey { parent, hash }).map_err(py_err)
    }

    /// Blocks pinned now.
    #[getter]
    fn pinned(&self) -> usize {
        self.inner.pinned()
    }

    /// The capacity in blocks (0: unbounded).
    #[getter]
    fn capacity(&self) -> usize {
        self.inner.capacity()
    }

    /// The eviction policy (`"lru"` or `"tail-first"`).
    #[getter]
    fn policy(&self) -> &'static str {
        match self.inner.policy() {
            Eviction::Lru => "lru",
            Eviction::TailFirst => "tail-first",
        }
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "PrefixCache({} of {} blocks, {})",
            self.inner.len(),
            self.inner.capacity(),
            self.policy()
        )
    }
}

/// `kvroute trace replay --json`.
#[derive(Serialize)]
struct TraceReplayReport {
    trace: String,
    #[serde(flatten)]
    replay: ReplayReport,
    cache_ns_per_block: f64,
    lookups_per_second: f64,
    baseline_ns_per_block: f64,
}

/// Replays a Mooncake-format request trace (JSON lines with `hash_ids`) through a prefix
/// cache of `capacity_blocks` (0: unbounded) under `policy`, and a storage tier in
/// `store_dir` below it if given (`kvroute trace replay --json`, the same fields: hit
/// ratios, evictions, the cache's cost per block beside a `HashSet` baseline in the same
/// run). Interruptible with Ctrl-C.
#[pyfunction]
#[pyo3(signature = (trace, block_tokens = 512, capacity_blocks = 0, policy = "lru", limit = 0,
                    store_dir = None, store_layers = 1))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn replay_trace(
    py: Python<'_>,
    trace: PathBuf,
    block_tokens: u32,
    capacity_blocks: usize,
    policy: &str,
    limit: usize,
    store_dir: Option<PathBuf>,
    store_layers: u32,
) -> PyResult<Py<PyAny>> {
    crate::sched::in_range(
        "capacity_blocks",
        capacity_blocks as u64,
        0,
        MAX_CACHE_BLOCKS as u64,
    )?;
    let config = ReplayConfig {
        block_tokens,
        capacity_blocks,
        policy: policy_of(policy)?,
        limit,
    };
    let report = interruptible(py, move || -> PyResult<TraceReplayReport> {
        let file = File::open(&trace).map_err(|e| {
            error(
                Kind::NotFound,
                format!("opening the trace {}: {e}", trace.display()),
            )
        })?;
        let records: Vec<_> = TraceReader::new(BufReader::new(file), block_tokens)
            .take(if limit == 0 { usize::MAX } else { limit })
            .collect::<Result<_, _>>()
            .map_err(|e| error(Kind::Corrupt, format!("reading {}: {e}", trace.display())))?;
        let mut store = match &store_dir {
            Some(dir) => {
                let layout = BlockLayout::new(store_layers, block_tokens).map_err(py_err)?;
                Some(
                    kvroute_kvstore::BlockStore::open(dir, layout)
                        .map_err(py_err)?
                        .0,
                )
            }
            None => None,
        };
        // The same lookups and inserts into a plain hash set, as the command line's baseline.
        let started = Instant::now();
        let mut set: HashSet<BlockKey> = HashSet::new();
        let mut hits = 0usize;
        for r in &records {
            let h = &r.hash_ids;
            let key = |i: usize| BlockKey::in_prompt(h, i);
            hits += (0..h.len()).take_while(|&i| set.contains(&key(i))).count();
            set.extend((0..h.len()).map(key));
        }
        let baseline = started.elapsed().as_secs_f64();
        std::hint::black_box(hits);
        let report = replay(records.into_iter().map(Ok), config, store.as_mut()).map_err(py_err)?;
        let blocks = report.blocks.max(1) as f64;
        Ok(TraceReplayReport {
            trace: trace.display().to_string(),
            cache_ns_per_block: report.cache_seconds * 1e9 / blocks,
            lookups_per_second: blocks / report.cache_seconds.max(1e-12),
            baseline_ns_per_block: baseline * 1e9 / blocks,
            replay: report,
        })
    })??;
    to_record(py, &report)
}

/// `kvroute store verify --json`.
#[derive(Serialize)]
struct StoreVerifyReport {
    dir: String,
    ok: usize,
    corrupt: usize,
    missing: usize,
    bad: Vec<(String, String)>,
}

/// The storage tier: full KV blocks of one layout (`layers` x `tokens`) in a directory,
/// one file each, written atomically with a checksum that every read checks.
#[pyclass(module = "kvroute")]
#[derive(Debug)]
pub(crate) struct BlockStore {
    inner: kvroute_kvstore::BlockStore,
}

#[pymethods]
impl BlockStore {
    /// `BlockStore(dir, layers=None, tokens=None)`: opens (creating) the store in `dir` for
    /// blocks of `layers` x `tokens`, or, without them, the existing store there with its
    /// layout. Partial writes of a crash are removed, bad files refused (`recovery()`).
    #[new]
    #[pyo3(signature = (dir, layers = None, tokens = None))]
    fn new(
        py: Python<'_>,
        dir: PathBuf,
        layers: Option<u32>,
        tokens: Option<u32>,
    ) -> PyResult<Self> {
        let opened = match (layers, tokens) {
            (Some(l), Some(t)) => {
                let layout = BlockLayout::new(l, t).map_err(py_err)?;
                py.detach(|| kvroute_kvstore::BlockStore::open(&dir, layout))
            }
            (None, None) => py.detach(|| kvroute_kvstore::BlockStore::open_existing(&dir)),
            _ => return Err(invalid("layers and tokens go together")),
        }
        .map_err(py_err)?;
        Ok(Self { inner: opened.0 })
    }

    /// Elements (uint16) of one full block: layers x tokens padded to 64-token pages x 576.
    #[getter]
    fn block_elems(&self) -> usize {
        self.inner.layout().full_elems()
    }

    /// Writes block `key` (`block_elems` bf16 values as uint16) atomically, fsync'd.
    fn put(&mut self, py: Python<'_>, key: u64, block: &Bound<'_, PyAny>) -> PyResult<()> {
        let a = u16_rows(block, "block")?;
        let words = slice(&a, "block")?;
        // The file format is little-endian bf16; this copies only on a big-endian host.
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let inner = &mut self.inner;
        py.detach(|| inner.put(key, &bytes)).map_err(py_err)
    }

    /// Reads block `key` (its checksum checked: CorruptError if it fails, NotFoundError if
    /// absent) into a new uint16 array.
    fn get<'py>(&mut self, py: Python<'py>, key: u64) -> PyResult<Bound<'py, PyArray1<u16>>> {
        let mut bytes = vec![0u8; self.inner.layout().full_bytes()];
        let inner = &mut self.inner;
        py.detach(|| inner.get_into(key, &mut bytes))
            .map_err(py_err)?;
        let words: Vec<u16> = bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        Ok(PyArray1::from_vec(py, words))
    }

    /// Removes block `key` (NotFoundError if absent).
    fn remove(&mut self, key: u64) -> PyResult<()> {
        self.inner.remove(key).map_err(py_err)
    }

    /// Reads every block and checks it (`kvroute store verify --json`: `ok`, `corrupt`,
    /// `missing` and each bad block with why). Interrupting is not offered: it reads each
    /// block once.
    fn verify(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let inner = &mut self.inner;
        let Verify {
            ok,
            corrupt,
            missing,
        } = py.detach(|| inner.verify()).map_err(py_err)?;
        let mut bad = corrupt.clone();
        bad.extend(missing.iter().map(|k| (k.clone(), "missing".to_owned())));
        to_record(
            py,
            &StoreVerifyReport {
                dir: self.inner.dir().display().to_string(),
                ok,
                corrupt: corrupt.len(),
                missing: missing.len(),
                bad,
            },
        )
    }

    /// The keys stored, ascending.
    fn keys(&self) -> Vec<u64> {
        let mut k: Vec<u64> = self.inner.keys().collect();
        k.sort_unstable();
        k
    }

    /// The path of block `key`'s file.
    fn path(&self, key: u64) -> PathBuf {
        self.inner.path(key)
    }

    /// Bytes read and written so far, and the counts behind them.
    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_record(py, &self.inner.stats())
    }

    fn __contains__(&self, key: u64) -> bool {
        self.inner.contains(key)
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
}
