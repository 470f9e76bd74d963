//! The step API end to end over the `mem` fabric (and libfabric's `shm` provider where it
//! loads): a batch of requests with shared and private
//! chunks placed at their own positions, and their own KV paged at several block sizes,
//! attended per layer through `Stepper::step` (routes, fetches, the fetch cache, gathers) and
//! checked against single-instance attention over each request's whole context at its
//! positions.

mod batch;
#[path = "../common/mod.rs"]
mod common;
mod faults;

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

use batch::{Batch, rows, shapes};

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
