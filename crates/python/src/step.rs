//! The step API from Python: a [`Stepper`] (a requester, a selector calibrated on its
//! holders, a cache of fetched chunks) and one [`Stepper::step`] call per layer for a batch
//! of [`StepRequest`]s, each its query rows, the remote chunks it attends and its own KV.
//! Arrays are borrowed for the call, the GIL released while the step runs.

use std::time::Instant;

use kvroute_costmodel::{Primitive, model_preset};
use kvroute_kernels::{Cache, Rope, Yarn};
use kvroute_kvstore::ChunkId;
use kvroute_remote::probe::ProbeConfig;
use kvroute_remote::step::{
    CalibrationInputs, ChunkRef as RustChunkRef, LocalKv, Picks, StepConfig, StepReport,
    StepRequest as RustStepRequest,
};
use numpy::{PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::arrays::{i32_indices, owned_u16, slice, u16_rows};
use crate::errors::{invalid, py_err};
use crate::record::to_record;
use crate::remote::{D_QK, Owner, PartialAttention, Requester, owner_pymethods, rope_layout_of};
use crate::wait::interruptible;
use kvroute_transport::TransferEngine;

/// The most query rows a probe point or a synthetic query batch may have (the largest the
/// command line's probe sweeps use is 2048); past memory, an allocation aborts the process.
const MAX_ROWS: usize = 1 << 16;

/// A remote chunk a request attends: its id, the position its first token has in the
/// request's context, and for sparse attention the chunk-local tokens selected.
#[pyclass(module = "kvroute", frozen, get_all)]
#[derive(Debug)]
pub(crate) struct ChunkRef {
    /// The chunk's id.
    chunk: u32,
    /// Position of its first token in the request's context.
    start: i64,
    /// Sparse: int32 `[query tokens, k]` chunk-local indices (-1 padding), else None.
    picks: Option<Py<PyAny>>,
}

#[pymethods]
impl ChunkRef {
    /// `ChunkRef(chunk, start, picks=None)`.
    #[new]
    #[pyo3(signature = (chunk, start, picks = None))]
    fn new(chunk: u32, start: i64, picks: Option<Py<PyAny>>) -> Self {
        Self {
            chunk,
            start,
            picks,
        }
    }

    fn __repr__(&self) -> String {
        let how = if self.picks.is_some() {
            "sparse"
        } else {
            "dense"
        };
        format!(
            "ChunkRef(chunk={}, start={}, {how})",
            self.chunk, self.start
        )
    }
}

/// One request of a step: its query rows, the remote chunks it attends, its own KV.
#[pyclass(module = "kvroute", frozen, get_all)]
#[derive(Debug)]
pub(crate) struct StepRequest {
    /// `[heads x new tokens, 576]` bf16 bits (uint16), rotated at their positions.
    queries: Py<PyAny>,
    /// Query rows per query token.
    heads: usize,
    /// The remote chunks attended (`ChunkRef`s).
    chunks: Vec<Py<ChunkRef>>,
    /// The request's own KV rows `[tokens, 576]` (or a pool of `local_block_tokens`-row
    /// blocks with `local_table`), or None.
    local: Option<Py<PyAny>>,
    /// Sparse: int32 `[query tokens, k]` indices selected in the own KV.
    local_picks: Option<Py<PyAny>>,
    /// Paged own KV: rows per block.
    local_block_tokens: Option<usize>,
    /// Paged own KV: the block table (uint32 list).
    local_table: Option<Vec<u32>>,
    /// Paged own KV: its tokens.
    local_tokens: Option<usize>,
}

#[pymethods]
impl StepRequest {
    /// `StepRequest(queries, heads, chunks, local=None, local_picks=None,
    /// local_block_tokens=None, local_table=None, local_tokens=None)`.
    #[new]
    #[pyo3(signature = (queries, heads, chunks, local = None, local_picks = None,
                        local_block_tokens = None, local_table = None, local_tokens = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        queries: Py<PyAny>,
        heads: usize,
        chunks: Vec<Py<ChunkRef>>,
        local: Option<Py<PyAny>>,
        local_picks: Option<Py<PyAny>>,
        local_block_tokens: Option<usize>,
        local_table: Option<Vec<u32>>,
        local_tokens: Option<usize>,
    ) -> PyResult<Self> {
        let paged = [
            local_block_tokens.is_some(),
            local_table.is_some(),
            local_tokens.is_some(),
        ];
        if paged.iter().any(|&p| p) && !paged.iter().all(|&p| p) {
            return Err(invalid(
                "paged own KV needs local_block_tokens, local_table and local_tokens",
            ));
        }
        Ok(Self {
            queries,
            heads,
            chunks,
            local,
            local_picks,
            local_block_tokens,
            local_table,
            local_tokens,
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "StepRequest(heads={}, chunks={}, local={})",
            self.heads,
            self.chunks.len(),
            self.local.is_some()
        )
    }
}

/// What one step gave back: one merged partial per request (`outputs`) and what it did
/// (`report`: every (request, chunk) decision and the step's times).
#[pyclass(module = "kvroute", frozen)]
#[derive(Debug)]
pub(crate) struct StepOutput {
    outputs: Py<PyList>,
    report: StepReport,
}

#[pymethods]
impl StepOutput {
    /// Request r's merged partial attention (`PartialAttention`) at this layer.
    #[getter]
    fn outputs(&self, py: Python<'_>) -> Py<PyList> {
        self.outputs.clone_ref(py)
    }

    /// The step's decisions and times as a Record (the fields of the Rust `StepReport`).
    #[getter]
    fn report(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        to_record(py, &self.report)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "StepOutput({} outputs, {:.1} us)",
            self.outputs.bind(py).len(),
            self.report.step_us
        )
    }
}

/// The engine-facing object: a requester, its calibrated selector and the fetch cache.
#[pyclass(module = "kvroute")]
#[derive(Debug)]
pub(crate) struct Stepper {
    inner: Option<kvroute_remote::step::Stepper>,
    engine: Option<TransferEngine>,
}

/// The arrays of one request, borrowed for a step.
struct Borrowed<'py> {
    queries: PyReadonlyArrayDyn<'py, u16>,
    picks: Vec<Option<(PyReadonlyArrayDyn<'py, i32>, usize)>>,
    local: Option<PyReadonlyArrayDyn<'py, u16>>,
    local_picks: Option<(PyReadonlyArrayDyn<'py, i32>, usize)>,
}

fn picks_of<'py>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<(PyReadonlyArrayDyn<'py, i32>, usize)> {
    let a = i32_indices(obj, what)?;
    if a.ndim() != 2 {
        return Err(invalid(format!(
            "{what}: expected [query tokens, k] indices"
        )));
    }
    let k = a.shape()[1];
    Ok((a, k))
}

owner_pymethods! {
    /// Releases the fetch cache and closes the requester's sessions.
    fn close;

    impl Stepper {
        /// `Stepper(requester, layers, chunk_tokens, model="deepseek-v2-lite", rope_theta=1e4,
        /// yarn=False, rope_layout="interleaved", force=None, fetch_budget_bytes=1 << 30,
        /// probe_mq=(1, 16, 64), probe_reps=10)`.
        ///
        /// Takes the requester over (it is unusable afterwards) and calibrates the selector on
        /// its holders: a probe sweep of routes of `probe_mq` query rows to the lowest chunk id,
        /// the holders' kernels and load, the merge and splice measured here. `layers` and
        /// `chunk_tokens` describe the held chunks, `rope_*` the rotation they were stored with.
        /// `force`: `"route"` or `"fetch"` for every pair (`None`: the selector decides).
        /// Interruptible with Ctrl-C.
        #[new]
        #[pyo3(signature = (requester, layers, chunk_tokens, model = "deepseek-v2-lite",
                            rope_theta = 10000.0, yarn = false, rope_layout = "interleaved",
                            force = None, fetch_budget_bytes = 1 << 30, probe_mq = vec![1, 16, 64],
                            probe_reps = 10))]
        #[allow(clippy::too_many_arguments)]
        fn new(
            py: Python<'_>,
            requester: &mut Requester,
            layers: u32,
            chunk_tokens: u32,
            model: &str,
            rope_theta: f64,
            yarn: bool,
            rope_layout: &str,
            force: Option<&str>,
            fetch_budget_bytes: usize,
            probe_mq: Vec<u32>,
            probe_reps: usize,
        ) -> PyResult<Self> {
            let layout = rope_layout_of(rope_layout)?;
            let rope = if yarn {
                Rope::yarn(rope_theta, Yarn::DEEPSEEK, layout)
            } else {
                Rope::plain(rope_theta, layout)
            }
            .map_err(py_err)?;
            let mut dims = model_preset(model).map_err(py_err)?.dims;
            dims.layers = layers;
            let force = match force {
                None => None,
                Some("route") => Some(Primitive::Route),
                Some("fetch") => Some(Primitive::Fetch),
                Some(other) => {
                    return Err(invalid(format!(
                        "force {other:?}: expected \"route\", \"fetch\" or None"
                    )));
                }
            };
            for &mq in &probe_mq {
                crate::sched::in_range("probe_mq", mq.into(), 1, MAX_ROWS as u64)?;
            }
            let largest = probe_mq.iter().copied().max().unwrap_or(0) as usize;
            if largest == 0 || probe_reps == 0 {
                return Err(invalid(
                    "probe_mq needs a positive row count and probe_reps > 0",
                ));
            }
            let req = requester
                .inner
                .take()
                .ok_or_else(|| invalid("the requester is closed (or already in a Stepper)"))?;
            let Some(first) = req.registry().ids().min() else {
                requester.inner = Some(req);
                return Err(invalid("the requester's holders serve no chunk"));
            };
            let engine = req.engine().clone();
            let mut config = StepConfig::new(dims, rope);
            config.force = force;
            config.fetch_budget = fetch_budget_bytes;
            let probe = ProbeConfig {
                chunk: first,
                layer: 0,
                mq: probe_mq,
                reps: probe_reps,
                ..ProbeConfig::default()
            };
            let stepper = interruptible(py, move || {
                // Probe rows: any finite bf16 rows do (their values do not change the timing).
                let probe_rows = kvroute_kvstore::corpus::queries(largest, 0, &rope, 1);
                let inputs = CalibrationInputs {
                    model: dims,
                    rope,
                    chunk_tokens,
                    probe_rows: &probe_rows,
                    pull: None,
                    probe: &probe,
                };
                kvroute_remote::step::Stepper::calibrated(req, inputs, config)
            })?
            .map_err(py_err)?;
            Ok(Self {
                inner: Some(stepper),
                engine: Some(engine),
            })
        }

        /// The attention of `requests` (`StepRequest`s) at `layer`: each (request, chunk)
        /// routed, fetched into the cache or gathered as the selector decides, merged exactly
        /// with the request's own KV. Returns a `StepOutput`. The GIL is released while the
        /// step runs; the arrays are borrowed, not copied.
        fn step(
            &mut self,
            py: Python<'_>,
            layer: u16,
            requests: Vec<PyRef<'_, StepRequest>>,
        ) -> PyResult<StepOutput> {
            self.run(py, layer, &requests).map(|(out, _)| out)
        }

        /// The same step, also returning the time `Stepper::step` took as a Rust caller sees it
        /// (microseconds): the baseline a Python caller's overhead is measured against.
        fn step_timed(
            &mut self,
            py: Python<'_>,
            layer: u16,
            requests: Vec<PyRef<'_, StepRequest>>,
        ) -> PyResult<(StepOutput, f64)> {
            self.run(py, layer, &requests)
        }

        /// Counters over the stepper's lifetime (steps, routes, fetches, cached, gathers, ...).
        fn stats(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
            to_record(py, &self.get()?.stats())
        }
    }
}

impl Owner for Stepper {
    type Owned = kvroute_remote::step::Stepper;

    fn take_owned(&mut self) -> (Option<Self::Owned>, Option<TransferEngine>) {
        (self.inner.take(), self.engine.take())
    }
}

impl Stepper {
    fn get(&self) -> PyResult<&kvroute_remote::step::Stepper> {
        self.inner
            .as_ref()
            .ok_or_else(|| invalid("the stepper is closed"))
    }

    /// Borrows every array, runs the step with the GIL released, and wraps the outputs;
    /// also the step's own time in microseconds.
    fn run(
        &mut self,
        py: Python<'_>,
        layer: u16,
        requests: &[PyRef<'_, StepRequest>],
    ) -> PyResult<(StepOutput, f64)> {
        let stepper = self
            .inner
            .as_mut()
            .ok_or_else(|| invalid("the stepper is closed"))?;
        let mut borrowed = Vec::with_capacity(requests.len());
        for (r, q) in requests.iter().enumerate() {
            let picks = q
                .chunks
                .iter()
                .map(|c| {
                    c.get()
                        .picks
                        .as_ref()
                        .map(|p| picks_of(p.bind(py), &format!("request {r}: picks")))
                        .transpose()
                })
                .collect::<PyResult<Vec<_>>>()?;
            borrowed.push(Borrowed {
                queries: u16_rows(q.queries.bind(py), &format!("request {r}: queries"))?,
                picks,
                local: q
                    .local
                    .as_ref()
                    .map(|l| u16_rows(l.bind(py), &format!("request {r}: local")))
                    .transpose()?,
                local_picks: q
                    .local_picks
                    .as_ref()
                    .map(|p| picks_of(p.bind(py), &format!("request {r}: local_picks")))
                    .transpose()?,
            });
        }
        let mut refs: Vec<Vec<RustChunkRef<'_>>> = Vec::with_capacity(requests.len());
        for (q, b) in requests.iter().zip(&borrowed) {
            let chunk_refs = q
                .chunks
                .iter()
                .zip(&b.picks)
                .map(|(c, p)| {
                    let c = c.get();
                    Ok(RustChunkRef {
                        chunk: ChunkId(c.chunk),
                        start: c.start,
                        picks: match p {
                            None => None,
                            Some((a, k)) => Some(Picks {
                                indices: slice(a, "picks")?,
                                k: *k,
                            }),
                        },
                    })
                })
                .collect::<PyResult<Vec<_>>>()?;
            refs.push(chunk_refs);
        }
        let mut batch = Vec::with_capacity(requests.len());
        for (r, ((q, b), chunk_refs)) in requests.iter().zip(&borrowed).zip(&refs).enumerate() {
            let queries = slice(&b.queries, "queries")?;
            if queries.len() % D_QK != 0 {
                return Err(invalid(format!(
                    "request {r}: queries of {} elements are not whole 576-wide rows",
                    queries.len()
                )));
            }
            let local = match &b.local {
                None => None,
                Some(a) => {
                    let rows = slice(a, "local")?;
                    let cache = match (&q.local_block_tokens, &q.local_table, q.local_tokens) {
                        (Some(bt), Some(table), Some(tokens)) => {
                            Cache::paged_blocks(rows, *bt, table, tokens)
                        }
                        _ => Cache::contiguous(rows),
                    }
                    .map_err(|e| invalid(format!("request {r}: local: {e}")))?;
                    let picks = match &b.local_picks {
                        None => None,
                        Some((a, k)) => Some(Picks {
                            indices: slice(a, "local_picks")?,
                            k: *k,
                        }),
                    };
                    Some(LocalKv { cache, picks })
                }
            };
            batch.push(RustStepRequest {
                queries,
                heads: q.heads,
                chunks: chunk_refs,
                local,
            });
        }
        let (result, us) = py.detach(|| {
            let started = Instant::now();
            let out = stepper.step(layer, &batch);
            (out, started.elapsed().as_secs_f64() * 1e6)
        });
        let out = result.map_err(py_err)?;
        let outputs = PyList::empty(py);
        for p in out.outputs {
            outputs.append(Py::new(py, PartialAttention::from_rust(py, p)?)?)?;
        }
        Ok((
            StepOutput {
                outputs: outputs.unbind(),
                report: out.report,
            },
            us,
        ))
    }
}

/// A synthetic MLA corpus (the project's test and benchmark KV): `chunks` chunks of
/// `chunk_tokens` tokens and `layers` layers, seeded, RoPE-rotated at canonical positions.
#[pyclass(module = "kvroute", frozen, get_all)]
#[derive(Debug)]
pub(crate) struct Corpus {
    /// Layers.
    layers: u32,
    /// Tokens per chunk.
    chunk_tokens: u32,
    /// Chunks.
    chunks: u32,
    /// Seed.
    seed: u64,
    /// RoPE theta.
    rope_theta: f64,
    /// Whether DeepSeek's YaRN scaling is applied.
    yarn: bool,
}

impl Corpus {
    fn spec(&self) -> kvroute_kvstore::CorpusSpec {
        kvroute_kvstore::CorpusSpec {
            layers: self.layers,
            chunk_tokens: self.chunk_tokens,
            chunks: self.chunks,
            seed: self.seed,
            rope_theta: self.rope_theta,
            yarn: self.yarn.then_some(Yarn::DEEPSEEK),
            rope_layout: kvroute_kernels::RopeLayout::Interleaved,
        }
    }
}

#[pymethods]
impl Corpus {
    /// `Corpus(layers, chunk_tokens, chunks, seed=1, rope_theta=1e4, yarn=False)`.
    #[new]
    #[pyo3(signature = (layers, chunk_tokens, chunks, seed = 1, rope_theta = 10000.0, yarn = false))]
    fn new(
        layers: u32,
        chunk_tokens: u32,
        chunks: u32,
        seed: u64,
        rope_theta: f64,
        yarn: bool,
    ) -> PyResult<Self> {
        let c = Self {
            layers,
            chunk_tokens,
            chunks,
            seed,
            rope_theta,
            yarn,
        };
        c.spec().validate().map_err(py_err)?;
        c.spec().rope().map_err(py_err)?;
        Ok(c)
    }

    /// Chunk `chunk` as one full block: uint16 `[layers * padded_tokens * 576]`, layer-major,
    /// each layer's tokens padded (with zeros) to whole 64-token pages.
    fn chunk<'py>(&self, py: Python<'py>, chunk: u32) -> PyResult<Py<numpy::PyArray1<u16>>> {
        let spec = self.spec();
        let block = py.detach(|| spec.chunk(ChunkId(chunk))).map_err(py_err)?;
        Ok(owned_u16(py, block))
    }

    /// Tokens of a layer in a full block, padded to whole 64-token pages.
    fn padded_tokens(&self) -> usize {
        self.spec().layout().padded_tokens()
    }

    /// The positions chunk `chunk`'s tokens were rotated to.
    fn positions(&self, chunk: u32) -> Vec<i64> {
        self.spec().positions(ChunkId(chunk))
    }

    /// `rows` query rows (bf16 bits, `[rows * 576]` uint16) rotated at `position`, seeded.
    fn queries(
        &self,
        py: Python<'_>,
        rows: usize,
        position: i64,
        seed: u64,
    ) -> PyResult<Py<numpy::PyArray1<u16>>> {
        crate::sched::in_range("rows", rows as u64, 1, MAX_ROWS as u64)?;
        let rope = self.spec().rope().map_err(py_err)?;
        Ok(owned_u16(
            py,
            kvroute_kvstore::corpus::queries(rows, position, &rope, seed),
        ))
    }
}
