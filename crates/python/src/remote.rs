//! The main job from Python: a [`Fabric`] to make transfer engines on, a [`Holder`] serving
//! the caller's KV chunks, a [`Requester`] routing query rows to holders, and the step API
//! ([`Stepper`]: one call per layer for a batch of decode requests). Query rows and KV are
//! borrowed from NumPy arrays and partials handed back as arrays that own the Rust vectors;
//! the GIL is released during every wait and transfer.

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use kvroute_kernels::{Partial, RopeLayout};
use kvroute_kvstore::{BlockLayout, ChunkId};
use kvroute_remote::{Call, HeldChunk as RustHeldChunk, HeldChunks, Placement, Sparse};
use kvroute_transport::{Access, FabricConfig, MemFabric, ProviderChoice, TransferEngine};
use numpy::{PyArray1, PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::arrays::{i32_indices, owned_1d, owned_2d, slice, u16_rows};
use crate::errors::{Kind, error, invalid, py_err};
use crate::record::to_record;
use crate::wait::interruptible;

/// Columns of a query or KV row (bf16): the 512 latent and the 64 RoPE dimensions.
pub(crate) const D_QK: usize = kvroute_kernels::layout::D_QK;
/// Columns of an attention output row.
pub(crate) const D_LATENT: usize = kvroute_kernels::layout::D_LATENT;

/// Where engines come from: the in-process `mem` fabric (one per `Fabric` object, shared by
/// every engine made on it) or a libfabric provider (`shm`, `tcp`, `efa`, `auto` or a
/// provider's name).
#[pyclass(module = "kvroute", frozen)]
#[derive(Debug)]
pub(crate) struct Fabric {
    mem: Option<MemFabric>,
    provider: String,
}

#[pymethods]
impl Fabric {
    /// `Fabric(provider="mem")`: `"mem"` (in this process), `"shm"` (processes of one
    /// host), `"tcp"`, `"efa"`, `"auto"`, or any libfabric provider name.
    #[new]
    #[pyo3(signature = (provider = "mem"))]
    fn new(provider: &str) -> Self {
        Self {
            mem: (provider == "mem").then(MemFabric::new),
            provider: provider.to_owned(),
        }
    }

    /// The provider this fabric was made with.
    #[getter]
    fn provider(&self) -> &str {
        &self.provider
    }

    fn __repr__(&self) -> String {
        format!("Fabric({:?})", self.provider)
    }
}

impl Fabric {
    /// A new transfer engine on this fabric.
    pub(crate) fn engine(&self) -> PyResult<TransferEngine> {
        if let Some(mem) = &self.mem {
            return TransferEngine::mem(mem, 1).map_err(py_err);
        }
        let provider = match self.provider.as_str() {
            "auto" => ProviderChoice::Auto,
            "shm" => ProviderChoice::Shm,
            "tcp" => ProviderChoice::Tcp,
            "efa" => ProviderChoice::Efa,
            other => ProviderChoice::Named(other.to_owned()),
        };
        let config = FabricConfig {
            required: !matches!(provider, ProviderChoice::Auto),
            provider,
            ..FabricConfig::default()
        };
        let engine = TransferEngine::fabric(&config, Default::default())
            .map(|(engine, _)| engine)
            .map_err(py_err)?;
        Python::attach(restore_python_sigint)?;
        Ok(engine)
    }
}

/// libfabric's `shm` provider, when it first opens, installs a SIGINT handler that unlinks
/// its regions and re-raises, after which the process exits with status 1 and Python never
/// sees the signal. Python's handler is put back (from the main thread, the only one that
/// may set it) so that Ctrl-C raises `KeyboardInterrupt` and `with` blocks close the
/// engines, which removes their regions.
fn restore_python_sigint(py: Python<'_>) -> PyResult<()> {
    let threading = py.import("threading")?;
    let main = threading.call_method0("main_thread")?;
    if !threading.call_method0("current_thread")?.is(&main) {
        return Ok(());
    }
    let signal = py.import("signal")?;
    let sigint = signal.getattr("SIGINT")?;
    let handler = signal.call_method1("getsignal", (&sigint,))?;
    if handler.is_none() {
        // Installed from C, not Python: nothing of Python's to put back.
        return Ok(());
    }
    signal.call_method1("signal", (sigint, handler))?;
    Ok(())
}

/// One chunk a [`Holder`] serves out of its KV array.
#[pyclass(module = "kvroute", frozen, get_all)]
#[derive(Debug, Clone)]
pub(crate) struct HeldChunk {
    /// The chunk's id.
    chunk: u32,
    /// Its layers.
    layers: u32,
    /// Its tokens.
    tokens: u32,
    /// Full block: element offset (uint16 elements) of its first row in the KV array.
    offset: usize,
    /// Paged: tokens per block (the KV array a pool of such blocks), else None.
    block_tokens: Option<usize>,
    /// Paged: the block table, layer-major.
    table: Option<Vec<u32>>,
    /// The position each token was rotated to (default: `chunk * tokens + i`).
    positions: Vec<i64>,
    /// `"interleaved"` (DeepSeek) or `"half"` (rotate_half).
    rope_layout: String,
}

#[pymethods]
impl HeldChunk {
    /// `HeldChunk(chunk, layers, tokens, offset=0, positions=None, block_tokens=None,
    /// table=None, rope_layout="interleaved")`.
    ///
    /// Without `block_tokens` the chunk is one full block at element `offset` of the KV
    /// array: layer-major, each layer `[padded_tokens, 576]` with the tokens padded to whole
    /// 64-token pages (`kvroute.full_block_elems`). With `block_tokens` and `table` it lies
    /// in a paged cache: the KV array is a pool of blocks of `block_tokens` rows, token `t` of
    /// layer `l` is row `t % block_tokens` of block `table[l * per_layer + t // block_tokens]`.
    #[new]
    #[pyo3(signature = (chunk, layers, tokens, offset = 0, positions = None, block_tokens = None,
                        table = None, rope_layout = "interleaved"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        chunk: u32,
        layers: u32,
        tokens: u32,
        offset: usize,
        positions: Option<Vec<i64>>,
        block_tokens: Option<usize>,
        table: Option<Vec<u32>>,
        rope_layout: &str,
    ) -> PyResult<Self> {
        rope_layout_of(rope_layout)?;
        if block_tokens.is_some() != table.is_some() {
            return Err(invalid("a paged chunk needs both block_tokens and table"));
        }
        let start = i64::from(chunk) * i64::from(tokens);
        Ok(Self {
            chunk,
            layers,
            tokens,
            offset,
            block_tokens,
            table,
            positions: positions.unwrap_or_else(|| (start..start + i64::from(tokens)).collect()),
            rope_layout: rope_layout.to_owned(),
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "HeldChunk(chunk={}, layers={}, tokens={}, {})",
            self.chunk,
            self.layers,
            self.tokens,
            match self.block_tokens {
                Some(b) => format!("paged in blocks of {b}"),
                None => format!("offset={}", self.offset),
            }
        )
    }
}

pub(crate) fn rope_layout_of(name: &str) -> PyResult<RopeLayout> {
    match name {
        "interleaved" => Ok(RopeLayout::Interleaved),
        "half" => Ok(RopeLayout::Half),
        other => Err(invalid(format!(
            "rope_layout {other:?}: expected \"interleaved\" or \"half\""
        ))),
    }
}

impl HeldChunk {
    fn to_rust(&self) -> PyResult<RustHeldChunk> {
        let placement = match (&self.block_tokens, &self.table) {
            (Some(block_tokens), Some(table)) => Placement::Paged {
                block_tokens: *block_tokens,
                table: table.clone(),
            },
            _ => Placement::Full {
                offset: self
                    .offset
                    .checked_mul(2)
                    .ok_or_else(|| invalid("offset too large"))?,
            },
        };
        Ok(RustHeldChunk {
            id: ChunkId(self.chunk),
            placement,
            layout: BlockLayout::new(self.layers, self.tokens).map_err(py_err)?,
            rope_layout: rope_layout_of(&self.rope_layout)?,
            positions: self.positions.clone(),
        })
    }
}

fn parse_addr(addr: &str) -> PyResult<SocketAddr> {
    addr.parse()
        .map_err(|e| invalid(format!("address {addr:?}: {e}")))
}

/// Drops `owner` (a holder, a requester, a stepper), then stops its engine: a handle the
/// engine's own callbacks keep would otherwise keep it, and over `shm` its regions in
/// `/dev/shm`, alive until the process exits and past it.
pub(crate) fn shut_down<T>(owner: Option<T>, engine: Option<TransferEngine>) {
    drop(owner);
    if let Some(e) = engine {
        e.shutdown();
    }
}

/// A class that owns a holder, a requester or a stepper and its engine until `close()`,
/// the end of a `with` block or being dropped releases them.
pub(crate) trait Owner {
    /// What the class owns.
    type Owned: Send;

    /// Takes what the class owns and the engine to stop after it, leaving it closed.
    fn take_owned(&mut self) -> (Option<Self::Owned>, Option<TransferEngine>);
}

/// `#[pymethods]` for an [`Owner`] class: its own `impl` block's methods, `close()` (with
/// the doc comment given before `fn close;`), which releases what it owns with the GIL
/// released, and the context manager protocol (`with` closes it on exit, letting any
/// exception through); and its `Drop`, which releases what it still owns.
macro_rules! owner_pymethods {
    ($(#[$close_doc:meta])* fn close; impl $class:ident { $($items:tt)* }) => {
        #[pymethods]
        impl $class {
            $($items)*

            $(#[$close_doc])*
            fn close(&mut self, py: Python<'_>) {
                let (owned, engine) = $crate::remote::Owner::take_owned(self);
                py.detach(|| $crate::remote::shut_down(owned, engine));
            }

            fn __enter__(slf: Py<Self>) -> Py<Self> {
                slf
            }

            fn __exit__(
                &mut self,
                py: Python<'_>,
                _ty: Option<&Bound<'_, PyAny>>,
                _value: Option<&Bound<'_, PyAny>>,
                _tb: Option<&Bound<'_, PyAny>>,
            ) -> bool {
                self.close(py);
                false
            }
        }

        impl Drop for $class {
            fn drop(&mut self) {
                let (owned, engine) = $crate::remote::Owner::take_owned(self);
                $crate::remote::shut_down(owned, engine);
            }
        }
    };
}
pub(crate) use owner_pymethods;

/// A holder: serves partial attention over the chunks of a KV array to requesters, on its
/// own threads, until closed.
#[pyclass(module = "kvroute")]
#[derive(Debug)]
pub(crate) struct Holder {
    inner: Option<kvroute_remote::Holder>,
    engine: Option<TransferEngine>,
    addr: String,
}

owner_pymethods! {
    /// Stops serving and releases the registered memory and the fabric's resources.
    fn close;

    impl Holder {
        /// `Holder(fabric, kv, chunks, listen="127.0.0.1:0", max_requesters=8)`.
        ///
        /// `kv` holds the chunks' bf16 rows (uint16; any shape, C-contiguous) as `chunks`
        /// describe them. It is copied once into memory registered with the fabric (local only:
        /// no peer may write it); every request is then served from there with no copy.
        /// `listen` is the rendezvous address requesters connect to (`addr` once bound).
        #[new]
        #[pyo3(signature = (fabric, kv, chunks, listen = "127.0.0.1:0", max_requesters = 8))]
        fn new(
            py: Python<'_>,
            fabric: &Fabric,
            kv: &Bound<'_, PyAny>,
            chunks: Vec<PyRef<'_, HeldChunk>>,
            listen: &str,
            max_requesters: usize,
        ) -> PyResult<Self> {
            let kv = u16_rows(kv, "kv")?;
            let rows = slice(&kv, "kv")?;
            if rows.is_empty() {
                return Err(invalid("kv: the array is empty"));
            }
            let described: Vec<RustHeldChunk> = chunks
                .iter()
                .map(|c| c.to_rust())
                .collect::<PyResult<_>>()?;
            let listen = parse_addr(listen)?;
            let engine = fabric.engine()?;
            let store = engine
                .alloc_mr_with(rows.len() * 2, Access::Local)
                .map_err(py_err)?;
            // SAFETY: the region was allocated just now and its descriptor is not yet published
            // (no holder has started on it), so nothing else reads or writes it.
            let dst = unsafe { store.u16s_mut(0, rows.len()) }.map_err(py_err)?;
            py.detach(|| dst.copy_from_slice(rows));
            let held = HeldChunks::new(store, described).map_err(py_err)?;
            let listener = TcpListener::bind(listen)
                .map_err(|e| error(Kind::Unreachable, format!("binding {listen}: {e}")))?;
            let config = kvroute_remote::HolderConfig {
                max_requesters,
                max_connections: 32.max(max_requesters),
                ..Default::default()
            };
            let handle = engine.clone();
            let holder = py
                .detach(|| kvroute_remote::Holder::start(engine, listener, held, config))
                .map_err(py_err)?;
            Ok(Self {
                addr: holder.addr().to_string(),
                inner: Some(holder),
                engine: Some(handle),
            })
        }

        /// The rendezvous address requesters connect to (`"ip:port"`).
        #[getter]
        fn addr(&self) -> &str {
            &self.addr
        }

        /// The holder's counters now (requests served, kernel time, sessions, ...).
        fn stats(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
            to_record(py, &self.get()?.stats())
        }

        /// Serves until Ctrl-C (KeyboardInterrupt) or `seconds` have passed, with the GIL
        /// released; the holder serves on its own threads whether or not this is called.
        #[pyo3(signature = (seconds = None))]
        fn serve(&self, py: Python<'_>, seconds: Option<f64>) -> PyResult<()> {
            self.get()?;
            let until = seconds
                .map(|s| {
                    Duration::try_from_secs_f64(s).map_err(|e| invalid(format!("seconds = {s}: {e}")))
                })
                .transpose()?
                .map(|d| std::time::Instant::now() + d);
            loop {
                py.detach(|| std::thread::sleep(Duration::from_millis(50)));
                py.check_signals()?;
                if until.is_some_and(|u| std::time::Instant::now() >= u) {
                    return Ok(());
                }
            }
        }

        fn __repr__(&self) -> String {
            let state = if self.inner.is_some() {
                "serving"
            } else {
                "closed"
            };
            format!("Holder({}, {state})", self.addr)
        }
    }
}

impl Owner for Holder {
    type Owned = kvroute_remote::Holder;

    fn take_owned(&mut self) -> (Option<Self::Owned>, Option<TransferEngine>) {
        (self.inner.take(), self.engine.take())
    }
}

impl Holder {
    fn get(&self) -> PyResult<&kvroute_remote::Holder> {
        self.inner
            .as_ref()
            .ok_or_else(|| invalid("the holder is closed"))
    }
}

/// A partial attention: per query row, the normalised output `o` `[rows, 512]` and the
/// running max `m` and denominator `l` (`lse = m + ln l`), float32.
#[pyclass(module = "kvroute", frozen, get_all)]
#[derive(Debug)]
pub(crate) struct PartialAttention {
    /// `[rows, 512]` float32.
    o: Py<PyArray2<f32>>,
    /// `[rows]` float32 (`-inf` for a row that attended nothing).
    m: Py<PyArray1<f32>>,
    /// `[rows]` float32 (0 for a row that attended nothing).
    l: Py<PyArray1<f32>>,
}

#[pymethods]
impl PartialAttention {
    /// Per row, the log-sum-exp of its scaled logits: `m + ln l` (`-inf` where nothing was
    /// attended).
    fn lse<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let m = self.m.bind(py).readonly();
        let l = self.l.bind(py).readonly();
        let lse: Vec<f32> = m
            .as_slice()
            .map_err(|e| invalid(e.to_string()))?
            .iter()
            .zip(l.as_slice().map_err(|e| invalid(e.to_string()))?)
            .map(|(&m, &l)| {
                if l > 0.0 {
                    m + l.ln()
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        Ok(PyArray1::from_vec(py, lse))
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!("PartialAttention(rows={})", self.m.bind(py).len())
    }
}

impl PartialAttention {
    pub(crate) fn from_rust(py: Python<'_>, p: Partial) -> PyResult<Self> {
        let rows = p.m.len();
        Ok(Self {
            o: owned_2d(py, p.o, rows, D_LATENT)?,
            m: owned_1d(py, p.m),
            l: owned_1d(py, p.l),
        })
    }
}

/// A requester: sessions with holders, a pool fetched chunks land in, and the route call.
#[pyclass(module = "kvroute")]
#[derive(Debug)]
pub(crate) struct Requester {
    pub(crate) inner: Option<kvroute_remote::Requester>,
}

owner_pymethods! {
    /// Closes every session and releases the fabric's resources.
    fn close;

    impl Requester {
        /// `Requester(fabric, holders, scale, timeout_s=5.0, pool_pages=512)`: connects to
        /// every holder (rendezvous addresses `"ip:port"`) and learns the chunks they serve.
        /// `scale` is the softmax scale sent with every request. Interruptible with Ctrl-C.
        #[new]
        #[pyo3(signature = (fabric, holders, scale, timeout_s = 5.0, pool_pages = 512))]
        fn new(
            py: Python<'_>,
            fabric: &Fabric,
            holders: Vec<String>,
            scale: f32,
            timeout_s: f64,
            pool_pages: u32,
        ) -> PyResult<Self> {
            let addrs: Vec<SocketAddr> = holders
                .iter()
                .map(|a| parse_addr(a))
                .collect::<PyResult<_>>()?;
            let timeout = Duration::try_from_secs_f64(timeout_s)
                .map_err(|e| invalid(format!("timeout_s = {timeout_s}: {e}")))?;
            let config = kvroute_remote::RequesterConfig {
                timeout,
                pool_pages,
                ..kvroute_remote::RequesterConfig::new(scale)
            };
            // 2**20 pages of 64 rows are 75 GB of pool, reserved at connect.
            crate::sched::in_range("pool_pages", pool_pages.into(), 1, 1 << 20)?;
            let engine = fabric.engine()?;
            let req = interruptible(py, move || {
                kvroute_remote::Requester::connect(engine, &addrs, config)
            })?
            .map_err(py_err)?;
            Ok(Self { inner: Some(req) })
        }

        /// The ids of the chunks the holders serve, ascending.
        fn chunks(&self) -> PyResult<Vec<u32>> {
            let mut ids: Vec<u32> = self.get()?.registry().ids().map(|c| c.0).collect();
            ids.sort_unstable();
            ids.dedup();
            Ok(ids)
        }

        /// The number of holders this requester has a session with (live or not).
        fn holders(&self) -> PyResult<usize> {
            Ok(self.get()?.holders())
        }

        /// Holder `holder`'s counters, asked over its control connection.
        fn holder_stats(&mut self, py: Python<'_>, holder: usize) -> PyResult<Py<PyAny>> {
            let req = self.get_mut()?;
            let stats = py.detach(|| req.holder_stats(holder)).map_err(py_err)?;
            to_record(py, &stats)
        }

        /// Routes `queries` (`[rows, 576]` bf16 bits as uint16, rotated at their positions) to
        /// the holder of `chunk` at `layer` and returns its partial attention over the chunk.
        /// Sparse: `indices` (int32 `[tokens, k]`, chunk-local, -1 padding) selects `k` tokens
        /// per query token of `rows_per_token` rows.
        #[pyo3(signature = (chunk, layer, queries, indices = None, rows_per_token = None))]
        fn route(
            &mut self,
            py: Python<'_>,
            chunk: u32,
            layer: u16,
            queries: &Bound<'_, PyAny>,
            indices: Option<&Bound<'_, PyAny>>,
            rows_per_token: Option<u32>,
        ) -> PyResult<PartialAttention> {
            let q = u16_rows(queries, "queries")?;
            let q = slice(&q, "queries")?;
            let picks = indices.map(|i| i32_indices(i, "indices")).transpose()?;
            let sparse = match &picks {
                None => None,
                Some(p) => {
                    let shape = p.shape();
                    let k = *shape.last().unwrap_or(&0);
                    let Some(rows_per_token) = rows_per_token else {
                        return Err(invalid("sparse routes need rows_per_token"));
                    };
                    Some(Sparse {
                        indices: slice(p, "indices")?,
                        k: u32::try_from(k).map_err(|_| invalid("k too large"))?,
                        rows_per_token,
                    })
                }
            };
            let call = [Call {
                chunk: ChunkId(chunk),
                layer,
                queries: q,
                sparse,
            }];
            let req = self.get_mut()?;
            let mut out = py.detach(|| req.route(&call));
            let part = out
                .pop()
                .ok_or_else(|| error(Kind::Other, "no answer for the call"))?
                .map_err(py_err)?;
            PartialAttention::from_rust(py, part)
        }
    }
}

impl Owner for Requester {
    type Owned = kvroute_remote::Requester;

    fn take_owned(&mut self) -> (Option<Self::Owned>, Option<TransferEngine>) {
        let req = self.inner.take();
        let engine = req.as_ref().map(|r| r.engine().clone());
        (req, engine)
    }
}

impl Requester {
    fn get(&self) -> PyResult<&kvroute_remote::Requester> {
        self.inner
            .as_ref()
            .ok_or_else(|| invalid("the requester is closed (or was moved into a Stepper)"))
    }

    fn get_mut(&mut self) -> PyResult<&mut kvroute_remote::Requester> {
        self.inner
            .as_mut()
            .ok_or_else(|| invalid("the requester is closed (or was moved into a Stepper)"))
    }
}

/// Merges partials of the same query rows over disjoint KV into one, exactly (the
/// log-sum-exp merge): what a caller does with partials routed to several holders.
#[pyfunction]
pub(crate) fn merge(
    py: Python<'_>,
    parts: Vec<PyRef<'_, PartialAttention>>,
) -> PyResult<PartialAttention> {
    let owned: Vec<Partial> = parts
        .iter()
        .map(|p| {
            Ok(Partial {
                o: p.o.bind(py).to_vec().map_err(|e| invalid(e.to_string()))?,
                m: p.m.bind(py).to_vec().map_err(|e| invalid(e.to_string()))?,
                l: p.l.bind(py).to_vec().map_err(|e| invalid(e.to_string()))?,
            })
        })
        .collect::<PyResult<_>>()?;
    let refs: Vec<&Partial> = owned.iter().collect();
    let merged = kvroute_kernels::merge(&refs).map_err(py_err)?;
    PartialAttention::from_rust(py, merged)
}
