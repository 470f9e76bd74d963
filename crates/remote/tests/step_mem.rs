//! The step API end to end over the `mem` fabric (and libfabric's `shm` provider where it
//! loads): a batch of requests with shared and private
//! chunks placed at their own positions, and their own KV paged at several block sizes,
//! attended per layer through `Stepper::step` (routes, fetches, the fetch cache, gathers) and
//! checked against single-instance attention over each request's whole context at its
//! positions.

mod common;

use std::net::TcpListener;
use std::time::Duration;

use anyhow::Result;
use kvroute_costmodel::{Primitive, model_preset};
use kvroute_kernels::layout::D_QK;
use kvroute_kernels::rope::rotate_row_f64;
use kvroute_kernels::{
    Backend, Cache, Partial, Queries, RopeLayout, Selection, partial_dense, partial_sparse,
};
use kvroute_kvstore::{ChunkId, CorpusSpec, FullBlock};
use kvroute_remote::probe::ProbeConfig;
use kvroute_remote::step::{
    BackgroundStepper, CalibrationInputs, ChunkRef, How, LocalKv, OwnedChunkRef, OwnedLocalKv,
    OwnedStepRequest, Picks, StepConfig, StepError, StepRequest, Stepper, calibrate,
};
use kvroute_remote::{HeldChunks, Holder, HolderConfig, RequesterConfig};
use kvroute_transport::{FabricConfig, MemFabric, ProviderChoice, TransferEngine};

const SCALE: f32 = 0.1147;
const HEADS: usize = 16;

fn spec() -> CorpusSpec {
    CorpusSpec {
        layers: 3,
        chunk_tokens: 200,
        chunks: 4,
        seed: 21,
        rope_theta: 10_000.0,
        yarn: Some(kvroute_kernels::Yarn::DEEPSEEK),
        rope_layout: RopeLayout::Interleaved,
    }
}

/// Where the test's engines run: the in-process `mem` fabric, or libfabric's `shm` provider.
#[derive(Clone, Copy)]
enum Net<'a> {
    Mem(&'a MemFabric),
    Shm,
}

impl Net<'_> {
    fn engine(self) -> Result<TransferEngine> {
        Ok(match self {
            Net::Mem(fabric) => TransferEngine::mem(fabric, 1)?,
            Net::Shm => {
                let config = FabricConfig {
                    provider: ProviderChoice::Shm,
                    required: true,
                    ..FabricConfig::default()
                };
                TransferEngine::fabric(&config, Default::default())?.0
            }
        })
    }
}

fn holder(fabric: &MemFabric, chunks: &[u32]) -> Result<Holder> {
    holder_on(Net::Mem(fabric), chunks)
}

fn holder_on(net: Net<'_>, chunks: &[u32]) -> Result<Holder> {
    holder_with(net, chunks, Backend::Cpu)
}

fn holder_with(net: Net<'_>, chunks: &[u32], backend: Backend) -> Result<Holder> {
    let config = HolderConfig {
        backend,
        max_requesters: 4,
        slot_bytes: 1 << 20,
        reply_bytes: 1 << 20,
        ..HolderConfig::default()
    };
    common::start_holder(net.engine()?, &spec(), chunks, config)
}

/// A stepper over `holders`, calibrated with a short probe sweep, `force` as given, a fetch
/// budget of `budget_chunks` chunks.
fn stepper(
    fabric: &MemFabric,
    holders: &[&Holder],
    force: Option<Primitive>,
    budget_chunks: usize,
) -> Result<Stepper> {
    stepper_on(Net::Mem(fabric), holders, force, budget_chunks)
}

fn stepper_on(
    net: Net<'_>,
    holders: &[&Holder],
    force: Option<Primitive>,
    budget_chunks: usize,
) -> Result<Stepper> {
    stepper_polling(net, holders, force, budget_chunks, None)
}

/// [`stepper_on`], polling the holders' load and kernel every `poll_every` (`None`: the
/// configuration's default).
fn stepper_polling(
    net: Net<'_>,
    holders: &[&Holder],
    force: Option<Primitive>,
    budget_chunks: usize,
    poll_every: Option<Duration>,
) -> Result<Stepper> {
    let s = spec();
    let config = RequesterConfig {
        timeout: Duration::from_millis(1500),
        link_bytes: 2 << 20,
        pool_pages: 128,
        scale: SCALE,
        spin: Duration::from_millis(1),
        max_holders: 4,
    };
    let addrs: Vec<_> = holders.iter().map(|h| h.addr()).collect();
    let mut req = match net {
        Net::Mem(fabric) => common::connect(fabric, &addrs, config)?,
        Net::Shm => kvroute_remote::Requester::connect(net.engine()?, &addrs, config)?,
    };
    let mut model = model_preset("deepseek-v2-lite")?.dims;
    model.layers = s.layers;
    let probe = ProbeConfig {
        mq: vec![1, 16, 64],
        reps: 6,
        ..ProbeConfig::default()
    };
    let rows = rows(64, 99);
    let cal = calibrate(
        &mut req,
        CalibrationInputs {
            model,
            rope: s.rope()?,
            chunk_tokens: s.chunk_tokens,
            probe_rows: &rows,
            pull: None,
            probe: &probe,
        },
    )?;
    let mut config = StepConfig::new(model, s.rope()?);
    config.force = force;
    config.fetch_budget = budget_chunks * s.layout().full_bytes();
    if let Some(every) = poll_every {
        config.poll_every = every;
    }
    Ok(Stepper::new(req, cal, config)?)
}

/// Deterministic bf16 rows in (-2, 2).
fn rows(n: usize, seed: u64) -> Vec<u16> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n * D_QK)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            kvroute_kernels::bf16::from_f32(((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0)
        })
        .collect()
}

/// A request's own KV: `tokens` rows in blocks of `block` (0: contiguous), blocks in reverse
/// order in a pool with one spare block.
struct Own {
    pool: Vec<u16>,
    table: Vec<u32>,
    block: usize,
    tokens: usize,
    /// The same rows, contiguous.
    rows: Vec<u16>,
}

impl Own {
    fn new(tokens: usize, block: usize, seed: u64) -> Self {
        let data = rows(tokens, seed);
        if block == 0 {
            return Self {
                pool: data.clone(),
                table: Vec::new(),
                block,
                tokens,
                rows: data,
            };
        }
        let blocks = tokens.div_ceil(block);
        let table: Vec<u32> = (0..blocks as u32).rev().collect();
        let mut pool = vec![0u16; (blocks + 1) * block * D_QK];
        for t in 0..tokens {
            let at = (table[t / block] as usize * block + t % block) * D_QK;
            pool[at..at + D_QK].copy_from_slice(&data[t * D_QK..(t + 1) * D_QK]);
        }
        Self {
            pool,
            table,
            block,
            tokens,
            rows: data,
        }
    }

    fn cache(&self) -> Cache<'_> {
        if self.block == 0 {
            Cache::contiguous(&self.pool).unwrap_or_else(|e| panic!("{e}"))
        } else {
            Cache::paged_blocks(&self.pool, self.block, &self.table, self.tokens)
                .unwrap_or_else(|e| panic!("{e}"))
        }
    }
}

/// One request's shape: its chunks (id, start), its own KV (tokens, block size), query tokens.
struct Shape {
    chunks: Vec<(u32, i64)>,
    own: (usize, usize),
    new: usize,
}

/// Four requests: 0 and 1 share chunk 0 at the same place, 1 and 3 share chunk 1 at
/// different places, 2 has chunk 3 alone far from its stored place; own KV at blocks of 16,
/// 64, 256 (lengths not a multiple of them) and contiguous.
fn shapes() -> Vec<Shape> {
    vec![
        Shape {
            chunks: vec![(0, 0), (1, 200)],
            own: (37, 16),
            new: 1,
        },
        Shape {
            chunks: vec![(0, 0), (2, 200)],
            own: (100, 64),
            new: 2,
        },
        Shape {
            chunks: vec![(3, 5000)],
            own: (300, 256),
            new: 1,
        },
        Shape {
            chunks: vec![(1, 1000), (0, 1200)],
            own: (20, 0),
            new: 1,
        },
    ]
}

/// The batch's data: queries, own KV, and (sparse) picks per chunk and for the own KV.
struct Batch {
    q: Vec<Vec<u16>>,
    own: Vec<Own>,
    refs: Vec<Vec<ChunkRef<'static>>>,
    chunk_picks: Vec<Vec<Vec<i32>>>,
    own_picks: Vec<Vec<i32>>,
    k: usize,
}

impl Batch {
    fn new(sparse: bool, seed: u64) -> Self {
        let (s, k) = (spec(), 24);
        let mut b = Self {
            q: Vec::new(),
            own: Vec::new(),
            refs: Vec::new(),
            chunk_picks: Vec::new(),
            own_picks: Vec::new(),
            k,
        };
        let mut x = seed | 1;
        let mut pick = |n: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // About one pick in eleven is padding.
            match x % 11 {
                0 => -1,
                _ => ((x >> 8) % n as u64) as i32,
            }
        };
        for (r, shape) in shapes().iter().enumerate() {
            b.q.push(rows(HEADS * shape.new, seed + r as u64));
            b.own
                .push(Own::new(shape.own.0, shape.own.1, seed + 100 + r as u64));
            let refs = shape
                .chunks
                .iter()
                .map(|&(c, start)| ChunkRef::dense(ChunkId(c), start))
                .collect();
            b.refs.push(refs);
            if sparse {
                let ct = s.chunk_tokens as usize;
                b.chunk_picks.push(
                    shape
                        .chunks
                        .iter()
                        .map(|_| (0..shape.new * k).map(|_| pick(ct)).collect())
                        .collect(),
                );
                b.own_picks
                    .push((0..shape.new * k).map(|_| pick(shape.own.0)).collect());
            }
        }
        b
    }

    fn sparse(&self) -> bool {
        !self.chunk_picks.is_empty()
    }

    /// Chunk refs with their picks (sparse), per request.
    fn chunk_refs(&self) -> Vec<Vec<ChunkRef<'_>>> {
        self.refs
            .iter()
            .enumerate()
            .map(|(r, refs)| {
                refs.iter()
                    .enumerate()
                    .map(|(i, c)| ChunkRef {
                        picks: self.sparse().then(|| Picks {
                            indices: &self.chunk_picks[r][i],
                            k: self.k,
                        }),
                        ..*c
                    })
                    .collect()
            })
            .collect()
    }

    fn requests<'a>(&'a self, refs: &'a [Vec<ChunkRef<'a>>]) -> Vec<StepRequest<'a>> {
        (0..self.q.len())
            .map(|r| StepRequest {
                queries: &self.q[r],
                heads: HEADS,
                chunks: &refs[r],
                local: Some(LocalKv {
                    cache: self.own[r].cache(),
                    picks: self.sparse().then(|| Picks {
                        indices: &self.own_picks[r],
                        k: self.k,
                    }),
                }),
            })
            .collect()
    }

    /// Single-instance attention over request `r`'s whole context at `layer`: its chunks'
    /// rows rotated to their places, then its own rows; sparse over the same picks.
    fn reference(&self, r: usize, layer: u32, blocks: &[Vec<u16>]) -> Result<Partial> {
        let s = spec();
        let rope = s.rope()?;
        let mut whole = Vec::new();
        let mut offsets = Vec::new();
        for &(c, start) in &shapes()[r].chunks {
            let full = FullBlock::new(&blocks[c as usize], s.layout())?;
            let stored = s.positions(ChunkId(c))[0];
            let angles = rope.angles(start - stored);
            offsets.push((whole.len() / D_QK) as i32);
            for row in full.layer(layer)?.rows().chunks_exact(D_QK) {
                let mut row = row.to_vec();
                rotate_row_f64(&mut row, &angles, rope.layout());
                whole.extend_from_slice(&row);
            }
        }
        let own_at = (whole.len() / D_QK) as i32;
        whole.extend_from_slice(&self.own[r].rows);
        let q = Queries::new(&self.q[r])?;
        let cache = Cache::contiguous(&whole)?;
        if !self.sparse() {
            return Ok(partial_dense(Backend::Reference, &q, &cache, SCALE)?);
        }
        let tokens = q.len() / HEADS;
        let parts = offsets.len() + 1;
        let mut idx = Vec::with_capacity(tokens * self.k * parts);
        for t in 0..tokens {
            for (i, &off) in offsets.iter().enumerate() {
                idx.extend(
                    self.chunk_picks[r][i][t * self.k..(t + 1) * self.k]
                        .iter()
                        .map(|&p| if p < 0 { -1 } else { p + off }),
                );
            }
            idx.extend(
                self.own_picks[r][t * self.k..(t + 1) * self.k]
                    .iter()
                    .map(|&p| if p < 0 { -1 } else { p + own_at }),
            );
        }
        let sel = Selection::new(&idx, self.k * parts, HEADS, q.len(), cache.tokens())?;
        Ok(partial_sparse(Backend::Reference, &q, &cache, &sel, SCALE)?)
    }
}

/// The merged output against the reference: o within two bf16 steps of the largest values
/// (routed partials come back as bf16, rotated queries are rounded to bf16), lse close.
fn check(got: &Partial, want: &Partial, what: &str) {
    assert_eq!(got.rows(), want.rows(), "{what}");
    let worst = got
        .o
        .iter()
        .zip(&want.o)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, |m, d| if d.is_nan() { f32::NAN } else { m.max(d) });
    assert!(worst <= 1e-2, "{what}: o off by {worst}");
    for r in 0..want.rows() {
        let (g, w) = (got.lse(r), want.lse(r));
        assert!(
            (g - w).abs() <= 5e-3 * w.abs().max(1.0),
            "{what}: row {r} lse {g} against {w}"
        );
    }
}

fn blocks() -> Result<Vec<Vec<u16>>> {
    let s = spec();
    Ok((0..s.chunks)
        .map(|c| s.chunk(ChunkId(c)))
        .collect::<Result<_, _>>()?)
}

/// Runs every layer of one step of `batch` and checks each request's output.
fn run_and_check(stepper: &mut Stepper, batch: &Batch, what: &str) -> Result<Vec<How>> {
    let blocks = blocks()?;
    let refs = batch.chunk_refs();
    let requests = batch.requests(&refs);
    let mut hows = Vec::new();
    for layer in 0..spec().layers as u16 {
        let out = stepper.step(layer, &requests)?;
        assert_eq!(out.outputs.len(), requests.len());
        for (r, got) in out.outputs.iter().enumerate() {
            let want = batch.reference(r, u32::from(layer), &blocks)?;
            check(got, &want, &format!("{what}, layer {layer}, request {r}"));
        }
        hows.extend(out.report.decisions.iter().map(|d| d.how));
    }
    Ok(hows)
}

/// Every primitive forced, then the selector's choice, dense and sparse: each request's
/// output is its whole context's attention.
#[test]
fn a_batch_of_requests_matches_one_instance_per_request() -> Result<()> {
    let fabric = MemFabric::new();
    let (a, b) = (holder(&fabric, &[0, 1])?, holder(&fabric, &[2, 3])?);
    for sparse in [false, true] {
        for force in [Some(Primitive::Route), Some(Primitive::Fetch), None] {
            let mut st = stepper(&fabric, &[&a, &b], force, 8)?;
            let batch = Batch::new(sparse, 7);
            let what = format!("sparse {sparse}, forced {force:?}");
            let hows = run_and_check(&mut st, &batch, &what)?;
            let want = match (force, sparse) {
                (Some(Primitive::Route), _) => vec![How::Route],
                (Some(Primitive::Fetch), false) => vec![How::Fetch, How::Cached],
                (Some(Primitive::Fetch), true) => vec![How::Gather],
                _ => vec![How::Route, How::Fetch, How::Cached, How::Gather],
            };
            assert!(hows.iter().all(|h| want.contains(h)), "{what}: {hows:?}");
            drop(st.into_requester());
        }
    }
    Ok(())
}

/// Holders serving straight out of a paged KV cache (blocks of 16, 64 and 256 tokens, the
/// chunks' 200 tokens a multiple of none, blocks scattered over the pool): every primitive
/// forced, dense and sparse, and each request's output is still its whole context's
/// attention (a block table misread would attend other rows).
#[test]
fn holders_serving_from_paged_kv_match_one_instance_at_every_block_size() -> Result<()> {
    let fabric = MemFabric::new();
    for block in [16usize, 64, 256] {
        let paged = |chunks: &[u32], seed: u64| -> Result<Holder> {
            let engine = Net::Mem(&fabric).engine()?;
            let ids: Vec<ChunkId> = chunks.iter().map(|&c| ChunkId(c)).collect();
            let held = HeldChunks::generate_paged(&engine, &spec(), &ids, block, seed)?;
            assert!(
                held.chunks()
                    .iter()
                    .all(|c| c.block_tokens() == block as u32)
            );
            let config = HolderConfig {
                max_requesters: 4,
                slot_bytes: 1 << 20,
                reply_bytes: 1 << 20,
                ..HolderConfig::default()
            };
            Ok(Holder::start(
                engine,
                TcpListener::bind("127.0.0.1:0")?,
                held,
                config,
            )?)
        };
        let (a, b) = (paged(&[0, 1], 1)?, paged(&[2, 3], 2)?);
        for sparse in [false, true] {
            for force in [Primitive::Route, Primitive::Fetch] {
                let mut st = stepper(&fabric, &[&a, &b], Some(force), 8)?;
                let what = format!("blocks of {block}, sparse {sparse}, forced {force:?}");
                let hows = run_and_check(&mut st, &Batch::new(sparse, 11), &what)?;
                let want = match (force, sparse) {
                    (Primitive::Route, _) => vec![How::Route],
                    (_, false) => vec![How::Fetch, How::Cached],
                    (_, true) => vec![How::Gather],
                };
                assert!(hows.iter().all(|h| want.contains(h)), "{what}: {hows:?}");
                drop(st.into_requester());
            }
        }
    }
    Ok(())
}

/// Fetched chunks are kept across layers and steps: with room for all, each (chunk, place)
/// is fetched once over three layers and two steps; with room for three, steps that use
/// other chunks evict the least recently used and fetch again, and every answer stays right.
#[test]
fn the_fetch_cache_fetches_a_chunk_once_while_the_budget_holds() -> Result<()> {
    let fabric = MemFabric::new();
    let (a, b) = (holder(&fabric, &[0, 1])?, holder(&fabric, &[2, 3])?);
    let batch = Batch::new(false, 11);
    // (chunk, start) pairs of the batch: (0,0) (1,200) (2,200) (3,5000) (1,1000) (0,1200).
    let distinct = 6;
    let pairs_per_layer = 7;
    let mut st = stepper(&fabric, &[&a, &b], Some(Primitive::Fetch), 8)?;
    for _step in 0..2 {
        run_and_check(&mut st, &batch, "roomy cache")?;
    }
    let stats = st.stats();
    assert_eq!(stats.chunk_fetches, distinct, "{stats:?}");
    assert_eq!(
        stats.fetches + stats.cached,
        2 * 3 * pairs_per_layer,
        "{stats:?}"
    );
    assert_eq!(stats.evicted, 0);
    drop(st.into_requester());

    // Room for three chunks, and two halves of the batch that use three each, in turns: each
    // turn evicts the other half's chunks and fetches its own once for all its layers.
    let mut small = stepper(&fabric, &[&a, &b], Some(Primitive::Fetch), 3)?;
    let blocks = blocks()?;
    let refs = batch.chunk_refs();
    let requests = batch.requests(&refs);
    for turn in 0..3 {
        let half: &[usize] = if turn % 2 == 0 { &[0, 1] } else { &[2, 3] };
        let these: Vec<StepRequest<'_>> = half.iter().map(|&r| requests[r]).collect();
        for layer in 0..spec().layers as u16 {
            let out = small.step(layer, &these)?;
            for (got, &r) in out.outputs.iter().zip(half) {
                let want = batch.reference(r, u32::from(layer), &blocks)?;
                check(
                    got,
                    &want,
                    &format!("turn {turn}, layer {layer}, request {r}"),
                );
            }
        }
    }
    let stats = small.stats();
    assert_eq!((stats.chunk_fetches, stats.evicted), (9, 6), "{stats:?}");
    assert!(stats.cache_bytes <= 3 * spec().layout().full_bytes());
    Ok(())
}

/// A holder lost between steps: its chunks' routes go to their replica (as fallbacks where a
/// call to it failed mid-step) and the answers stay right; without a replica the step fails
/// naming the chunk.
#[test]
fn a_lost_holder_costs_a_fallback_to_a_replica_or_a_typed_error() -> Result<()> {
    let fabric = MemFabric::new();
    let a = holder(&fabric, &[0, 1, 2, 3])?;
    // `b` runs the f64 reference kernel: it reports a slower kernel than `a`, so the
    // selector routes every chunk to `a` while it believes `a` alive.
    let b = holder_with(Net::Mem(&fabric), &[0, 1, 2], Backend::Reference)?;
    let batch = Batch::new(false, 13);
    // No poll after the first step's: `a`'s death is found by the routes to it, not by a poll
    // before them.
    let mut st = stepper_polling(
        Net::Mem(&fabric),
        &[&a, &b],
        Some(Primitive::Route),
        8,
        Some(Duration::from_secs(3600)),
    )?;
    run_and_check(&mut st, &batch, "both holders")?;
    drop(a);
    let refs = batch.chunk_refs();
    let requests = batch.requests(&refs);
    // Without request 2 (chunk 3 lives on `a` alone): every routed call to `a` times out
    // mid-step and goes to `b`, and the answers are right.
    let without: Vec<StepRequest<'_>> = requests
        .iter()
        .enumerate()
        .filter(|(r, _)| *r != 2)
        .map(|(_, q)| *q)
        .collect();
    let blocks = blocks()?;
    let out = st.step(1, &without)?;
    for (got, r) in out.outputs.iter().zip([0, 1, 3]) {
        check(
            got,
            &batch.reference(r, 1, &blocks)?,
            &format!("after the loss, request {r}"),
        );
    }
    // Either the calls to `a` failed mid-step and fell back to `b`, or `a`'s closed control
    // connection was seen first and every call went to `b` at once; which one depends on
    // when the close arrives. (On a loaded machine the selector may also have chosen `b` for
    // every chunk on its own, its measured rates then favouring it: `a` was not asked, and
    // is found dead by the next step's calls to it.)
    let to_b = out.report.decisions.iter().all(|d| d.holder == Some(1));
    assert!(!out.report.fallbacks.is_empty() || to_b, "{:?}", out.report);
    assert!(to_b || !st.requester().is_alive(0), "{:?}", out.report);
    let fallbacks = st.stats().fallbacks;
    assert!(fallbacks > 0 || to_b);
    // Chunk 3 has no copy left: the step fails naming it.
    match st.step(0, &requests) {
        Err(e @ StepError::NoCopy { .. }) => {
            assert!(matches!(e, StepError::NoCopy { chunk, .. } if chunk == ChunkId(3)));
            assert!(
                e.to_string().starts_with("chunk 3: no reachable copy"),
                "{e}"
            );
        }
        other => panic!("expected no copy of chunk 3, got {other:?}"),
    }
    Ok(())
}

/// The step on a thread of its own, awaited: the same outputs as the blocking call.
#[test]
fn the_async_step_answers_as_the_blocking_one() -> Result<()> {
    let fabric = MemFabric::new();
    let (a, b) = (holder(&fabric, &[0, 1])?, holder(&fabric, &[2, 3])?);
    let batch = Batch::new(true, 17);
    let mut blocking = stepper(&fabric, &[&a, &b], Some(Primitive::Route), 8)?;
    let refs = batch.chunk_refs();
    let want = blocking.step(2, &batch.requests(&refs))?.outputs;
    drop(blocking.into_requester());
    let owned: Vec<OwnedStepRequest> = (0..batch.q.len())
        .map(|r| OwnedStepRequest {
            queries: batch.q[r].clone(),
            heads: HEADS,
            chunks: shapes()[r]
                .chunks
                .iter()
                .enumerate()
                .map(|(i, &(c, start))| OwnedChunkRef {
                    chunk: ChunkId(c),
                    start,
                    picks: Some((batch.chunk_picks[r][i].clone(), batch.k)),
                })
                .collect(),
            local: Some(OwnedLocalKv {
                rows: batch.own[r].pool.clone(),
                block_tokens: batch.own[r].block,
                table: batch.own[r].table.clone(),
                tokens: batch.own[r].tokens,
                picks: Some((batch.own_picks[r].clone(), batch.k)),
            }),
        })
        .collect();
    let background =
        BackgroundStepper::spawn(stepper(&fabric, &[&a, &b], Some(Primitive::Route), 8)?)?;
    let rt = tokio::runtime::Builder::new_current_thread().build()?;
    let got = rt.block_on(background.step(2, owned))??.outputs;
    assert_eq!(got.len(), want.len());
    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
        check(g, w, &format!("async request {r}"));
    }
    Ok(())
}

/// Malformed requests are typed errors naming the request; a chunk nobody holds names the
/// chunk.
#[test]
fn bad_requests_are_refused_naming_what_is_wrong() -> Result<()> {
    let fabric = MemFabric::new();
    let a = holder(&fabric, &[0])?;
    let mut st = stepper(&fabric, &[&a], None, 2)?;
    let q = rows(HEADS, 5);
    let chunk0 = [ChunkRef::dense(ChunkId(0), 0)];
    let ok = StepRequest {
        queries: &q,
        heads: HEADS,
        chunks: &chunk0,
        local: None,
    };
    let ragged = StepRequest {
        queries: &q[..q.len() - 1],
        ..ok
    };
    let heads = StepRequest { heads: 5, ..ok };
    let picks = [0i32; 3];
    let short = [ChunkRef {
        picks: Some(Picks {
            indices: &picks,
            k: 4,
        }),
        ..chunk0[0]
    }];
    let bad_picks = StepRequest {
        chunks: &short,
        ..ok
    };
    for (bad, what) in [(ragged, "ragged"), (heads, "heads"), (bad_picks, "picks")] {
        match st.step(0, &[ok, bad]) {
            Err(StepError::Request { request: 1, .. }) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
    let nobody = [ChunkRef::dense(ChunkId(9), 0)];
    match st.step(
        0,
        &[StepRequest {
            chunks: &nobody,
            ..ok
        }],
    ) {
        Err(StepError::NoCopy { chunk, .. }) => assert_eq!(chunk, ChunkId(9)),
        other => panic!("{other:?}"),
    }
    assert!(st.step(0, &[ok])?.outputs[0].l.iter().all(|&l| l > 0.0));
    Ok(())
}

/// Over libfabric's `shm` provider, between engines of their own: the selector's choice and
/// every primitive forced, dense and sparse, each request's output its whole context's
/// attention.
#[test]
fn over_shm_a_batch_matches_one_instance_per_request() -> Result<()> {
    if let Err(why) = Net::Shm.engine() {
        kvroute_testkit::skip!("libfabric's shm provider is not usable here: {why}");
        return Ok(());
    }
    // `a` serves from 16-token blocks scattered over its pool (its fetches are one write
    // per piece of a block), `b` from full blocks.
    let engine = Net::Shm.engine()?;
    let ids = [ChunkId(0), ChunkId(1)];
    let held = HeldChunks::generate_paged(&engine, &spec(), &ids, 16, 3)?;
    let config = HolderConfig {
        max_requesters: 4,
        slot_bytes: 1 << 20,
        reply_bytes: 1 << 20,
        ..HolderConfig::default()
    };
    let a = Holder::start(engine, TcpListener::bind("127.0.0.1:0")?, held, config)?;
    let b = holder_on(Net::Shm, &[2, 3])?;
    for sparse in [false, true] {
        for force in [None, Some(Primitive::Route), Some(Primitive::Fetch)] {
            let mut st = stepper_on(Net::Shm, &[&a, &b], force, 8)?;
            let batch = Batch::new(sparse, 23);
            run_and_check(
                &mut st,
                &batch,
                &format!("shm, sparse {sparse}, forced {force:?}"),
            )?;
            drop(st.into_requester());
        }
    }
    Ok(())
}

/// The checked run (`kvroute_remote::checked`, what `kvroute demo` drives) over holders of
/// the corpus passes, with each chunk fetched once; over a holder whose rows are another
/// corpus's, its routed checks fail.
#[test]
fn the_checked_run_passes_and_catches_a_holder_serving_other_rows() -> Result<()> {
    use kvroute_remote::checked::{CheckedConfig, CheckedRun};
    let config = CheckedConfig {
        requests: 4,
        heads: 16,
        prefix: 300,
        own_tokens: 20,
        topk: 150,
        layers: vec![0, 2],
        seed: 5,
    };
    let s = spec();
    for force in [Primitive::Route, Primitive::Fetch] {
        let fabric = MemFabric::new();
        let (a, b) = (holder(&fabric, &[0, 1])?, holder(&fabric, &[2, 3])?);
        let mut st = stepper(&fabric, &[&a, &b], Some(force), 8)?;
        let mut run = CheckedRun::new(&s, config.clone())?;
        for step in 0..2 {
            run.dense_step(&mut st, step)?;
        }
        run.sparse_step(&mut st, 2)?;
        let report = run.finish();
        assert!(report.passed(), "{force:?}: {:?}", report.checks);
        // 4 requests x 2 layers x 2 steps, and the sparse step's 2 layers.
        assert_eq!(report.checks.len(), 18);
        if force == Primitive::Fetch {
            assert_eq!(st.stats().chunk_fetches, 4, "{:?}", st.stats());
        } else {
            assert!(!report.timings.is_empty() && !report.route_us.is_empty());
        }
    }
    // Holder `b` serves chunks 2 and 3 of another seed: every check with a part routed to
    // it fails; the others pass.
    let fabric = MemFabric::new();
    let a = holder(&fabric, &[0, 1])?;
    let other = CorpusSpec { seed: 99, ..s };
    let config_b = HolderConfig {
        backend: Backend::Cpu,
        max_requesters: 4,
        slot_bytes: 1 << 20,
        reply_bytes: 1 << 20,
        ..HolderConfig::default()
    };
    let b = common::start_holder(Net::Mem(&fabric).engine()?, &other, &[2, 3], config_b)?;
    let mut st = stepper(&fabric, &[&a, &b], Some(Primitive::Route), 8)?;
    let mut run = CheckedRun::new(&s, config)?;
    run.dense_step(&mut st, 0)?;
    let report = run.finish();
    assert!(!report.passed());
    for c in &report.checks {
        // Even requests attend every chunk; request 1 chunk 0, request 3 chunk 1 (on `a`).
        let wrong = c.name.contains("request 0") || c.name.contains("request 2");
        assert_eq!(!c.passed, wrong, "{c:?}");
    }
    Ok(())
}
