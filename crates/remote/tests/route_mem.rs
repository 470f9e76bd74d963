//! Route and fetch end to end in one process over the `mem` fabric: holders and a requester
//! with their own engines, the TCP rendezvous on loopback. Checks every output against
//! single-instance attention over the whole document.

mod common;

use std::net::TcpListener;
use std::time::Duration;

use anyhow::Result;
use kvroute_kernels::layout::D_QK;
use kvroute_kernels::{
    Backend, Cache, Queries, RopeLayout, Selection, merge, partial_dense, partial_sparse,
};
use kvroute_kvstore::corpus::queries;
use kvroute_kvstore::{ChunkId, CorpusSpec};
use kvroute_remote::{
    Call, GatherPart, HeldChunks, Holder, HolderConfig, Requester, RequesterConfig, RouteError,
    Sparse, wire,
};

use kvroute_remote::session;
use kvroute_transport::{MemFabric, OnDone, TransferEngine};

const SCALE: f32 = 0.1147;

/// The GPU tests one at a time: they count the process's launches of the decode kernel.
static ON_THE_GPU: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn spec() -> CorpusSpec {
    CorpusSpec {
        layers: 3,
        chunk_tokens: 200,
        chunks: 4,
        seed: 11,
        rope_theta: 10_000.0,
        yarn: Some(kvroute_kernels::Yarn::DEEPSEEK),
        rope_layout: RopeLayout::Interleaved,
    }
}

fn holder(fabric: &MemFabric, chunks: &[u32], cap: usize) -> Result<Holder> {
    holder_on(fabric, chunks, cap, Backend::Cpu)
}

fn holder_on(fabric: &MemFabric, chunks: &[u32], cap: usize, backend: Backend) -> Result<Holder> {
    let config = HolderConfig {
        backend,
        max_requesters: cap,
        slot_bytes: 1 << 20,
        reply_bytes: 1 << 20,
        ..HolderConfig::default()
    };
    common::start_holder(TransferEngine::mem(fabric, 1)?, &spec(), chunks, config)
}

fn requester(fabric: &MemFabric, holders: &[&Holder]) -> Result<Requester> {
    let config = RequesterConfig {
        timeout: Duration::from_secs(2),
        link_bytes: 1 << 20,
        pool_pages: 64,
        scale: SCALE,
        spin: Duration::from_millis(1),
        max_holders: 3,
    };
    let addrs: Vec<_> = holders.iter().map(|h| h.addr()).collect();
    common::connect(fabric, &addrs, config)
}

/// One dense call per chunk in `chunks`, all with the query rows `q`, at `layer`.
fn dense_calls(q: &[u16], layer: u16, chunks: std::ops::Range<u32>) -> Vec<Call<'_>> {
    chunks
        .map(|c| Call {
            chunk: ChunkId(c),
            layer,
            queries: q,
            sparse: None,
        })
        .collect()
}

/// Rows `q` attended over layer `layer` of the whole document (`blocks`, every chunk of
/// `spec()`), by the f64 reference: what a routed and merged step must match.
fn dense_whole(blocks: &[Vec<u16>], layer: u16, q: &[u16]) -> Result<kvroute_kernels::Partial> {
    let doc = spec().document_layer(blocks, u32::from(layer))?;
    Ok(partial_dense(
        Backend::Reference,
        &Queries::new(q)?,
        &Cache::contiguous(&doc)?,
        SCALE,
    )?)
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The zero-copy path: the producer writes query rows straight into registered staging
/// (`Requester::stage`), the partials stay in the reply region in their wire encoding
/// (`route_wire`), and `merge_wire` reads them there. Same merged output as `route` + `merge`
/// of the decoded partials, to f32 round-off; a call that cannot be sent gets no staging and
/// its error, and the others are served.
#[test]
fn staged_queries_and_wire_partials_merge_like_the_copying_path() -> Result<()> {
    use kvroute_kernels::{Partial, merge_wire};
    use kvroute_remote::StagedCall;
    let fabric = MemFabric::new();
    let (a, b) = (holder(&fabric, &[0, 1], 8)?, holder(&fabric, &[2, 3], 8)?);
    let mut req = requester(&fabric, &[&a, &b])?;
    let s = spec();
    let q = queries(16, 900, &s.rope()?, 5);
    let layer = 2;
    let copied = dense_calls(&q, layer, 0..4);
    let parts: Vec<_> = req.route(&copied).into_iter().collect::<Result<_, _>>()?;
    let want = merge(&parts.iter().collect::<Vec<_>>())?;
    // Chunk 7 is held by nobody: its call is refused before anything is staged.
    let plan: Vec<StagedCall<'_>> = [0, 1, 7, 2, 3]
        .into_iter()
        .map(|c| StagedCall {
            chunk: ChunkId(c),
            layer,
            rows: 16,
            sparse: None,
        })
        .collect();
    let mut staged = req.stage(&plan);
    for c in 0..plan.len() {
        match staged.queries_mut(c) {
            Some(rows) => rows.copy_from_slice(&q),
            None => assert_eq!(c, 2, "only the unheld chunk has no staging"),
        }
    }
    let routed = staged.route_wire();
    assert!(matches!(
        routed.partial(2),
        Err(RouteError::NoHolder(ChunkId(7)))
    ));
    let views = [0, 1, 3, 4]
        .into_iter()
        .map(|c| routed.partial(c))
        .collect::<Result<Vec<_>, _>>()?;
    let mut got = Partial::empty(0);
    merge_wire(&views, &mut got)?;
    assert_eq!(got.m, want.m);
    let err = max_abs(&got.o, &want.o);
    assert!(err <= 2e-6, "wire merge against decoded merge: {err}");
    drop(routed);
    // One request per holder for the staged step, as for the copying one.
    assert_eq!(req.holder_stats(0)?.requests, 2);
    assert_eq!(req.holder_stats(1)?.requests, 2);
    Ok(())
}

#[test]
fn dense_route_over_two_holders_matches_one_instance() -> Result<()> {
    let fabric = MemFabric::new();
    let (a, b) = (holder(&fabric, &[0, 1], 8)?, holder(&fabric, &[2, 3], 8)?);
    let mut req = requester(&fabric, &[&a, &b])?;
    let s = spec();
    let blocks: Vec<_> = (0..s.chunks)
        .map(|c| s.chunk(ChunkId(c)))
        .collect::<Result<_, _>>()?;
    let q = queries(16, 900, &s.rope()?, 5);
    for layer in 0..3u16 {
        let calls = dense_calls(&q, layer, 0..4);
        let parts: Vec<_> = req.route(&calls).into_iter().collect::<Result<_, _>>()?;
        let merged = merge(&parts.iter().collect::<Vec<_>>())?;
        let whole = dense_whole(&blocks, layer, &q)?;
        let err = max_abs(&merged.o, &whole.o);
        assert!(
            err < 4e-3,
            "layer {layer}: routed through the bf16 wire, max abs {err}"
        );
    }
    let stats = req.holder_stats(0)?;
    assert_eq!(
        stats.requests, 3,
        "one write per holder per step: {stats:?}"
    );
    assert_eq!(stats.kernel_calls, 6);
    Ok(())
}

/// One query token selecting `k` scattered tokens of the 800-token document
/// of `spec()`: the global selection and, per chunk, its calls' local indices.
fn scattered_selection(k: usize) -> (Vec<i32>, Vec<Vec<i32>>) {
    let global: Vec<i32> = (0..k).map(|i| ((i * 7919 + 13) % 800) as i32).collect();
    let local = (0..4i32)
        .map(|c| {
            global
                .iter()
                .filter(|&&g| g / 200 == c)
                .map(|&g| g - c * 200)
                .collect()
        })
        .collect();
    (global, local)
}

/// One sparse call per chunk at `layer`: chunk c's rows `q` (`heads` per query token) over
/// its selection `local[c]`.
fn sparse_calls<'a>(
    q: &'a [u16],
    layer: u16,
    local: &'a [Vec<i32>],
    heads: usize,
) -> Vec<Call<'a>> {
    local
        .iter()
        .enumerate()
        .map(|(c, idx)| Call {
            chunk: ChunkId(c as u32),
            layer,
            queries: q,
            sparse: Some(Sparse {
                indices: idx,
                k: idx.len() as u32,
                rows_per_token: heads as u32,
            }),
        })
        .collect()
}

/// A holder whose chunks are resident on a GPU (`Backend::Cuda`) answers dense routes of 1, 16
/// and 64 rows at every layer and a sparse route as a CPU holder of the same chunks does, to
/// the bf16 wire's rounding, with every row attended on the GPU. Where no GPU is usable (and
/// `KVROUTE_REQUIRE_GPU` is not set), a CUDA holder refuses to start, naming why, and an auto
/// holder serves from host memory with nothing on a GPU.
#[test]
fn a_gpu_holder_serves_what_a_cpu_holder_serves() -> Result<()> {
    use kvroute_kernels::KernelError;
    let _gpu = ON_THE_GPU
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    use kvroute_remote::RemoteError;
    let fabric = MemFabric::new();
    let s = spec();
    let blocks: Vec<_> = (0..s.chunks)
        .map(|c| s.chunk(ChunkId(c)))
        .collect::<Result<_, _>>()?;
    if let Err(why) = kvroute_kernels::cuda::Gpu::global() {
        let required =
            std::env::var("KVROUTE_REQUIRE_GPU").is_ok_and(|v| !v.is_empty() && v != "0");
        assert!(
            !required,
            "KVROUTE_REQUIRE_GPU is set and no GPU is usable: {why}"
        );
        let refused = holder_on(&fabric, &[0, 1], 8, Backend::Cuda).map(drop);
        let refused = refused.expect_err("a CUDA holder without a GPU");
        assert!(
            matches!(
                refused.downcast_ref::<RemoteError>(),
                Some(RemoteError::Kernel(KernelError::CudaUnavailable(_)))
            ),
            "{refused:#}"
        );
        let auto = holder_on(&fabric, &[0, 1], 8, Backend::Auto)?;
        let mut req = requester(&fabric, &[&auto])?;
        let q = queries(16, 900, &s.rope()?, 5);
        for part in req.route(&dense_calls(&q, 1, 0..2)) {
            part?;
        }
        let stats = req.holder_stats(0)?;
        assert_eq!(
            (stats.rows, stats.gpu_rows, stats.gpu_resident_bytes),
            (32, 0, 0)
        );
        kvroute_testkit::skip!("the GPU half (a CUDA holder against a CPU holder): {why}");
        return Ok(());
    }
    let cpu = holder_on(&fabric, &[0, 1, 2, 3], 8, Backend::Cpu)?;
    let gpu = holder_on(&fabric, &[0, 1, 2, 3], 8, Backend::Cuda)?;
    let (mut on_cpu, mut on_gpu) = (requester(&fabric, &[&cpu])?, requester(&fabric, &[&gpu])?);
    let merged = |req: &mut Requester, calls: &[Call<'_>]| -> Result<kvroute_kernels::Partial> {
        let parts: Vec<_> = req.route(calls).into_iter().collect::<Result<_, _>>()?;
        Ok(merge(&parts.iter().collect::<Vec<_>>())?)
    };
    let compare = |got: &kvroute_kernels::Partial,
                   cpu: &kvroute_kernels::Partial,
                   whole: &kvroute_kernels::Partial,
                   what: &str| {
        let (to_whole, to_cpu) = (max_abs(&got.o, &whole.o), max_abs(&got.o, &cpu.o));
        // Each side within the reference's bound of the existing CPU tests; the two sides
        // apart by at most two bf16 steps of the largest values.
        assert!(
            to_whole < 4e-3,
            "{what}: GPU holder against one instance {to_whole}"
        );
        assert!(
            to_cpu < 8e-3,
            "{what}: GPU holder against the CPU holder {to_cpu}"
        );
        for r in 0..got.rows() {
            let d = (got.lse(r) - cpu.lse(r)).abs();
            assert!(
                d < 1e-4,
                "{what}: row {r} lse {} against {}",
                got.lse(r),
                cpu.lse(r)
            );
        }
    };
    let mut rows = 0u64;
    for (layer, mq) in [(0u16, 1usize), (1, 16), (2, 64)] {
        let q = queries(mq, 900, &s.rope()?, 5);
        let calls = dense_calls(&q, layer, 0..4);
        let (got, want) = (merged(&mut on_gpu, &calls)?, merged(&mut on_cpu, &calls)?);
        let whole = dense_whole(&blocks, layer, &q)?;
        compare(
            &got,
            &want,
            &whole,
            &format!("dense layer {layer}, {mq} rows"),
        );
        rows += 4 * mq as u64;
    }
    let (heads, k) = (16usize, 300usize);
    let q = queries(heads, 900, &s.rope()?, 6);
    let (global, local) = scattered_selection(k);
    let layer = 1u16;
    let calls = sparse_calls(&q, layer, &local, heads);
    let (got, want) = (merged(&mut on_gpu, &calls)?, merged(&mut on_cpu, &calls)?);
    let doc = s.document_layer(&blocks, u32::from(layer))?;
    let cache = Cache::contiguous(&doc)?;
    let sel = Selection::new(&global, k, heads, heads, cache.tokens())?;
    let whole = partial_sparse(Backend::Reference, &Queries::new(&q)?, &cache, &sel, SCALE)?;
    compare(&got, &want, &whole, "sparse");
    rows += 4 * heads as u64;
    let (g, c) = (on_gpu.holder_stats(0)?, on_cpu.holder_stats(0)?);
    assert_eq!(
        (g.rows, g.gpu_rows, c.rows, c.gpu_rows),
        (rows, rows, rows, 0)
    );
    let block_bytes = s.layout().full_bytes() as u64;
    assert_eq!(
        (g.gpu_resident_bytes, c.gpu_resident_bytes),
        (4 * block_bytes, 0)
    );
    Ok(())
}

/// A holder on a GPU serves every (chunk, layer) group of a batch in one launch of the batched
/// kernel: one request over four chunks, two layers, dense and sparse, is one launch (one
/// kernel call in the holder's counters) and the same answer as a CPU holder's; requests from
/// three requesters at once are one launch per batch the holder served, however many requests
/// a batch held.
#[test]
fn a_gpu_holder_serves_a_batch_in_one_launch() -> Result<()> {
    let _gpu = ON_THE_GPU
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let gpu_dev = match kvroute_kernels::cuda::Gpu::global() {
        Ok(g) => g,
        Err(why) => {
            let required =
                std::env::var("KVROUTE_REQUIRE_GPU").is_ok_and(|v| !v.is_empty() && v != "0");
            assert!(
                !required,
                "KVROUTE_REQUIRE_GPU is set and no GPU is usable: {why}"
            );
            kvroute_testkit::skip!("one launch per batch on a GPU holder: {why}");
            return Ok(());
        }
    };
    let fabric = MemFabric::new();
    let s = spec();
    let cpu = holder_on(&fabric, &[0, 1, 2, 3], 8, Backend::Cpu)?;
    let gpu = holder_on(&fabric, &[0, 1, 2, 3], 8, Backend::Cuda)?;
    let (mut on_cpu, mut on_gpu) = (requester(&fabric, &[&cpu])?, requester(&fabric, &[&gpu])?);
    let q = queries(16, 900, &s.rope()?, 7);
    let (_, local) = scattered_selection(120);
    let mut calls = dense_calls(&q, 0, 0..4);
    calls.extend(dense_calls(&q, 2, 1..3));
    calls.extend(sparse_calls(&q, 1, &local, 16));
    let (before, stats_before) = (gpu_dev.decode_launches(), on_gpu.holder_stats(0)?);
    let got: Vec<_> = on_gpu.route(&calls).into_iter().collect::<Result<_, _>>()?;
    let launches = gpu_dev.decode_launches() - before;
    let stats = on_gpu.holder_stats(0)?;
    assert_eq!(launches, 1, "ten groups of one request");
    assert_eq!(stats.kernel_calls - stats_before.kernel_calls, 1);
    let want: Vec<_> = on_cpu.route(&calls).into_iter().collect::<Result<_, _>>()?;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let d = max_abs(&g.o, &w.o);
        assert!(d < 8e-3, "call {i}: o {d} from the CPU holder's");
        for r in 0..g.rows() {
            assert!((g.lse(r) - w.lse(r)).abs() < 1e-4, "call {i} row {r}");
        }
    }
    // Three requesters at once, 20 steps each.
    let before = (gpu_dev.decode_launches(), gpu.stats());
    std::thread::scope(|scope| -> Result<()> {
        let workers: Vec<_> = (0..3)
            .map(|_| {
                let mut req = requester(&fabric, &[&gpu])?;
                let (q, calls_q) = (q.clone(), local.clone());
                Ok(scope.spawn(move || -> Result<()> {
                    for _ in 0..20 {
                        let mut calls = dense_calls(&q, 0, 0..4);
                        calls.extend(sparse_calls(&q, 1, &calls_q, 16));
                        for part in req.route(&calls) {
                            part?;
                        }
                    }
                    Ok(())
                }))
            })
            .collect::<Result<_>>()?;
        for w in workers {
            w.join().expect("requester thread")?;
        }
        Ok(())
    })?;
    let (launches, after) = (gpu_dev.decode_launches() - before.0, gpu.stats());
    let (batches, requests) = (
        after.batches - before.1.batches,
        after.requests - before.1.requests,
    );
    println!(
        "  60 requests from 3 requesters: {requests} requests in {batches} batches, {launches} launches"
    );
    assert_eq!(requests, 60);
    assert_eq!(launches, batches, "one launch per batch");
    assert_eq!(after.kernel_calls - before.1.kernel_calls, batches);
    Ok(())
}

#[test]
fn holders_added_after_connect_serve_their_chunks_and_replicas() -> Result<()> {
    let fabric = MemFabric::new();
    let a = holder(&fabric, &[0, 1], 8)?;
    let mut req = requester(&fabric, &[&a])?;
    assert!(matches!(
        req.holder_for(ChunkId(2)),
        Err(RouteError::NoHolder(_))
    ));
    // b brings chunk 2 and 3, c a replica of chunk 0; a fourth does not fit (room for 3).
    let (b, c, d) = (
        holder(&fabric, &[2, 3], 8)?,
        holder(&fabric, &[0], 8)?,
        holder(&fabric, &[1], 8)?,
    );
    assert_eq!(req.add_holder(b.addr())?, 1);
    assert_eq!(req.add_holder(c.addr())?, 2);
    assert!(req.add_holder(d.addr()).is_err());
    assert_eq!(req.holders(), 3);
    assert_eq!(req.live_replicas(ChunkId(0)), [0, 2]);
    let s = spec();
    let blocks: Vec<_> = (0..s.chunks)
        .map(|c| s.chunk(ChunkId(c)))
        .collect::<Result<_, _>>()?;
    let q = queries(16, 900, &s.rope()?, 5);
    let whole = |layer: u16| -> Result<Vec<f32>> {
        let doc = s.document_layer(&blocks, u32::from(layer))?;
        Ok(partial_dense(
            Backend::Reference,
            &Queries::new(&q)?,
            &Cache::contiguous(&doc)?,
            SCALE,
        )?
        .o)
    };
    let parts: Vec<_> = req
        .route(&dense_calls(&q, 1, 0..4))
        .into_iter()
        .collect::<Result<_, _>>()?;
    let merged = merge(&parts.iter().collect::<Vec<_>>())?;
    assert!(max_abs(&merged.o, &whole(1)?) < 4e-3);
    // Holder a leaves: chunk 0 goes to its replica on c; chunk 1 has none.
    req.mark_dead(0)?;
    assert_eq!(req.holder_for(ChunkId(0))?, 2);
    assert!(matches!(
        req.holder_for(ChunkId(1)),
        Err(RouteError::NoHolder(_))
    ));
    let parts: Vec<_> = req
        .route(&dense_calls(&q, 2, 0..1))
        .into_iter()
        .collect::<Result<_, _>>()?;
    assert_eq!(req.holder_stats(2)?.kernel_calls, 1);
    assert_eq!(parts.len(), 1);
    Ok(())
}

/// The newest view a watch holds.
fn latest(
    watch: &kvroute_kvstore::directory::Watch,
) -> Result<std::sync::Arc<kvroute_kvstore::DirectoryView>> {
    watch
        .current()
        .map(|s| s.view)
        .ok_or_else(|| anyhow::anyhow!("no view"))
}

#[test]
fn a_requester_follows_the_directory_holders_register_in() -> Result<()> {
    use kvroute_kvstore::directory::{Directory, InProcessDirectory};
    let fabric = MemFabric::new();
    let dir = InProcessDirectory::new();
    let watch = dir.watch()?;
    let (a, b) = (holder(&fabric, &[0, 1], 8)?, holder(&fabric, &[2, 3], 8)?);
    let (ra, ca) = a.directory_records(0);
    let reg_a = dir.register(ra, ca)?;
    let mut req = Requester::connect(
        TransferEngine::mem(&fabric, 1)?,
        &[],
        RequesterConfig {
            max_holders: 4,
            link_bytes: 1 << 20,
            ..RequesterConfig::new(SCALE)
        },
    )?;
    let view = latest(&watch)?;
    let sync = req.sync_with(&view);
    assert_eq!(sync.added, [(0, a.addr())]);
    assert_eq!(req.holder_for(ChunkId(1))?, 0);
    let (rb, cb) = b.directory_records(0);
    let reg_b = dir.register(rb, cb)?;
    let view = latest(&watch)?;
    assert_eq!(req.sync_with(&view).added, [(1, b.addr())]);
    // Syncing again changes nothing.
    assert_eq!(
        req.sync_with(&view),
        kvroute_remote::DirectorySync::default()
    );
    let q = queries(16, 900, &spec().rope()?, 5);
    assert!(
        req.route(&dense_calls(&q, 0, 0..4))
            .iter()
            .all(Result::is_ok)
    );
    // a leaves the directory: the requester stops using it.
    reg_a.revoke()?;
    let view = latest(&watch)?;
    assert_eq!(req.sync_with(&view).dropped, [(0, a.addr())]);
    assert!(!req.is_alive(0) && req.is_alive(1));
    assert!(matches!(
        req.holder_for(ChunkId(0)),
        Err(RouteError::NoHolder(_))
    ));
    // a registers again (the directory lost its data): its session still works, it is used
    // again on the same link.
    let (ra, ca) = a.directory_records(0);
    let _reg_a = dir.register(ra, ca)?;
    let view = latest(&watch)?;
    let sync = req.sync_with(&view);
    assert_eq!(
        (sync.relisted, sync.added),
        (vec![(0, a.addr())], Vec::new())
    );
    assert_eq!(req.holder_for(ChunkId(0))?, 0);
    assert!(
        req.route(&dense_calls(&q, 0, 0..4))
            .iter()
            .all(Result::is_ok)
    );
    // c joins as the first copy of chunk 2, b becomes the second: c is preferred at once.
    let c = holder(&fabric, &[2], 8)?;
    drop(reg_b);
    let (rb, cb) = b.directory_records(1);
    let _reg_b = dir.register(rb, cb)?;
    let (rc, cc) = c.directory_records(0);
    let _reg_c = dir.register(rc, cc)?;
    let view = latest(&watch)?;
    assert_eq!(req.sync_with(&view).added, [(2, c.addr())]);
    assert_eq!(req.live_replicas(ChunkId(2)), [2, 1]);
    assert_eq!(req.holder_for(ChunkId(3))?, 1);
    Ok(())
}

#[test]
fn sparse_scattered_selection_matches_one_instance() -> Result<()> {
    let fabric = MemFabric::new();
    let (a, b) = (holder(&fabric, &[0, 2], 8)?, holder(&fabric, &[1, 3], 8)?);
    let mut req = requester(&fabric, &[&a, &b])?;
    let s = spec();
    let blocks: Vec<_> = (0..s.chunks)
        .map(|c| s.chunk(ChunkId(c)))
        .collect::<Result<_, _>>()?;
    let (heads, k) = (16usize, 300usize);
    let q = queries(heads, 900, &s.rope()?, 6);
    let (global, calls_idx) = scattered_selection(k);
    let layer = 1u16;
    let calls = sparse_calls(&q, layer, &calls_idx, heads);
    let parts: Vec<_> = req.route(&calls).into_iter().collect::<Result<_, _>>()?;
    let merged = merge(&parts.iter().collect::<Vec<_>>())?;
    let doc = s.document_layer(&blocks, u32::from(layer))?;
    let cache = Cache::contiguous(&doc)?;
    let sel = Selection::new(&global, k, heads, heads, cache.tokens())?;
    let whole = partial_sparse(Backend::Reference, &Queries::new(&q)?, &cache, &sel, SCALE)?;
    let err = max_abs(&merged.o, &whole.o);
    assert!(err < 4e-3, "max abs {err}");
    Ok(())
}

/// `Requester::prefer` sends a chunk's routes and fetches to the replica a selector chose,
/// while that holder is live and holds the chunk (a holder without it, or an unknown one, is
/// passed over for the first live replica, as is a dead one); a fetch from either replica
/// gives the same rows.
#[test]
fn a_preferred_replica_serves_the_chunks_routes_and_fetches() -> Result<()> {
    let fabric = MemFabric::new();
    let s = spec();
    let rope = s.rope()?;
    let a = holder(&fabric, &[1], 8)?;
    let b = holder(&fabric, &[1], 8)?;
    let c = holder(&fabric, &[2], 8)?;
    let mut req = requester(&fabric, &[&a, &b, &c])?;
    let one = ChunkId(1);
    assert_eq!(req.holder_for(one)?, 0, "the first replica by default");
    for (preferred, used) in [
        (Some(1), 1),
        (Some(2), 0),
        (Some(7), 0),
        (None, 0),
        (Some(1), 1),
    ] {
        req.prefer(one, preferred);
        assert_eq!(req.holder_for(one)?, used, "preferring {preferred:?}");
    }
    let q = queries(16, 5300, &rope, 9);
    for part in req.route(&dense_calls(&q, 0, 1..2)) {
        part?;
    }
    assert_eq!(
        (req.holder_stats(0)?.requests, req.holder_stats(1)?.requests),
        (0, 1),
        "the route went to the preferred replica"
    );
    // Fetched from each replica to the same positions: the same chunk there.
    let to: Vec<i64> = (5000..5200).collect();
    let fetched_cache_partials = |req: &mut Requester| -> Result<Vec<kvroute_kernels::Partial>> {
        let fetched = req.fetch(one, &to, rope, Backend::Cpu)?;
        let parts = (0..3)
            .map(|layer| {
                Ok(partial_dense(
                    Backend::Reference,
                    &Queries::new(&q)?,
                    &req.fetched_cache(&fetched, layer)?,
                    SCALE,
                )?)
            })
            .collect::<Result<Vec<_>>>();
        req.release(fetched)?;
        parts
    };
    let from_b = fetched_cache_partials(&mut req)?;
    assert_eq!(req.holder_stats(1)?.fetches, 1);
    req.prefer(one, None);
    let from_a = fetched_cache_partials(&mut req)?;
    assert_eq!(req.holder_stats(0)?.fetches, 1);
    assert_eq!(from_b, from_a, "the same rows from either replica");
    // A dead preferred replica is passed over.
    req.prefer(one, Some(1));
    req.mark_dead(1)?;
    assert_eq!(req.holder_for(one)?, 0);
    Ok(())
}

#[test]
fn fetch_splices_to_the_requesters_positions() -> Result<()> {
    let fabric = MemFabric::new();
    let a = holder(&fabric, &[1], 8)?;
    let mut req = requester(&fabric, &[&a])?;
    let s = spec();
    let rope = s.rope()?;
    let to: Vec<i64> = (5000..5200).collect();
    let free = req.free_pool_pages();
    let fetched = req.fetch(ChunkId(1), &to, rope, Backend::Cpu)?;
    // The reference: the holder's rows re-rotated by the f64 reference splice.
    let block = s.chunk(ChunkId(1))?;
    let layout = s.layout();
    let mut pool = vec![0u16; layout.full_elems()];
    let table: Vec<u32> = (0..layout.pages() as u32).collect();
    let from = s.positions(ChunkId(1));
    let full = kvroute_kvstore::FullBlock::new(&block, layout)?;
    let mut src = Vec::new();
    for l in 0..layout.layers {
        src.extend_from_slice(full.layer(l)?.rows());
    }
    let job = kvroute_kernels::SpliceJob::new(
        &src,
        layout.layers as usize,
        &from,
        &to,
        rope,
        &mut pool,
        &table,
    )?;
    kvroute_kernels::splice(Backend::Reference, job)?;
    let q = queries(16, 5300, &rope, 9);
    let check = |req: &Requester, fetched: &kvroute_remote::Fetched| -> Result<()> {
        for layer in 0..3usize {
            let got = partial_dense(
                Backend::Cpu,
                &Queries::new(&q)?,
                &req.fetched_cache(fetched, layer)?,
                SCALE,
            )?;
            let want_cache = Cache::paged(&pool, &table[layer * 4..layer * 4 + 4], 200)?;
            let want = partial_dense(Backend::Reference, &Queries::new(&q)?, &want_cache, SCALE)?;
            let err = max_abs(&got.o, &want.o);
            assert!(err < 1e-3, "layer {layer}: {err}");
        }
        Ok(())
    };
    check(&req, &fetched)?;
    req.release(fetched)?;
    assert_eq!(req.free_pool_pages(), free, "no pages leak");
    // A fragmented pool: one-page gathers hold pages 0-7, every other one is released, so the
    // fetch's 12 pages are 0, 2, 4, 6, 8-15: five runs of consecutive pages, five writes
    // (`wire::fetch_runs`) instead of one, landing where the page table says.
    let one = [0i32];
    let part = [GatherPart {
        chunk: ChunkId(1),
        tokens: &one,
    }];
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(req.gather(&part, &[0])?);
    }
    let mut kept = Vec::new();
    for (i, g) in held.into_iter().enumerate() {
        if i % 2 == 0 {
            req.release_gathered(g)?;
        } else {
            kept.push(g);
        }
    }
    let fetched = req.fetch(ChunkId(1), &to, rope, Backend::Cpu)?;
    assert_eq!(
        kvroute_remote::wire::fetch_runs(&fetched.pages).count(),
        5,
        "pages {:?}",
        fetched.pages
    );
    check(&req, &fetched)?;
    req.release(fetched)?;
    for g in kept {
        req.release_gathered(g)?;
    }
    assert_eq!(req.free_pool_pages(), free, "no pages leak");
    Ok(())
}

/// Sparse fetch: the selected rows of two chunks on two holders land back to back (across a
/// page boundary shared by both holders' writes), bit-exact, for each layer asked; a gather
/// naming a token outside its chunk is refused; nothing leaks from the pool.
#[test]
fn gather_lands_the_selected_rows_of_every_holder_bit_exact() -> Result<()> {
    let fabric = MemFabric::new();
    let (a, b) = (holder(&fabric, &[0], 8)?, holder(&fabric, &[1], 8)?);
    let mut req = requester(&fabric, &[&a, &b])?;
    let s = spec();
    let free = req.free_pool_pages();
    // 70 tokens of chunk 0 (so chunk 1's rows start mid-page), 5 of chunk 1 with a repeat.
    let t0: Vec<i32> = (0..70).map(|i| (i * 37) % 200).collect();
    let t1 = [199i32, 0, 5, 5, 17];
    let parts = [
        GatherPart {
            chunk: ChunkId(0),
            tokens: &t0,
        },
        GatherPart {
            chunk: ChunkId(1),
            tokens: &t1,
        },
    ];
    let layers = [2u16, 0];
    let gathered = req.gather(&parts, &layers)?;
    assert_eq!(gathered.rows, 75);
    let blocks = [s.chunk(ChunkId(0))?, s.chunk(ChunkId(1))?];
    for (i, &layer) in layers.iter().enumerate() {
        let cache = req.gathered_cache(&gathered, i)?;
        let mut j = 0;
        for (c, tokens) in [(0usize, &t0[..]), (1, &t1[..])] {
            let full = kvroute_kvstore::FullBlock::new(&blocks[c], s.layout())?;
            let rows = full.layer(u32::from(layer))?.rows();
            for &t in tokens {
                let want = &rows[t as usize * D_QK..(t as usize + 1) * D_QK];
                assert_eq!(cache.row(j), want, "layer {layer}, gathered row {j}");
                j += 1;
            }
        }
    }
    req.release_gathered(gathered)?;
    assert_eq!(req.free_pool_pages(), free, "no pages leak");
    // Refusals cost nothing else. A token outside the chunk (200 tokens) is refused before
    // anything is written; a layer past the chunk's 3 is refused while the same request's
    // layer 0 is served. The requester expects rows only from the segments the holder served
    // (its reply says which), so it learns of the refusal from the reply, not by waiting out
    // its 2 s deadline, keeps the link, and gets every page back.
    let bad = [3i32, 200];
    let started = std::time::Instant::now();
    let refused = req.gather(
        &[GatherPart {
            chunk: ChunkId(0),
            tokens: &bad,
        }],
        &[0],
    );
    assert!(
        matches!(
            refused,
            Err(RouteError::Refused {
                status: wire::Status::BadIndex,
                ..
            })
        ),
        "{refused:?}"
    );
    let some_served = req.gather(&parts[..1], &[0, 7]);
    assert!(
        matches!(
            some_served,
            Err(RouteError::Refused {
                status: wire::Status::BadLayer,
                ..
            })
        ),
        "{some_served:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "a refusal waited {:?}",
        started.elapsed()
    );
    assert_eq!(req.live_holders(), 2, "a refusal gave a link up");
    assert_eq!(req.free_pool_pages(), free, "a refused gather's pages leak");
    // The same link then gathers the right rows: no arrival of the refused requests was left
    // over to count toward this one.
    for _ in 0..3 {
        let again = req.gather(&parts, &[1])?;
        let full = kvroute_kvstore::FullBlock::new(&blocks[0], s.layout())?;
        let rows = full.layer(1)?.rows();
        let cache = req.gathered_cache(&again, 0)?;
        for (j, &t) in t0.iter().enumerate() {
            assert_eq!(
                cache.row(j),
                &rows[t as usize * D_QK..(t as usize + 1) * D_QK],
                "row {j} after a refusal"
            );
        }
        req.release_gathered(again)?;
    }
    assert_eq!(req.free_pool_pages(), free);
    Ok(())
}

#[test]
fn malformed_requests_are_refused_and_the_holder_keeps_serving() -> Result<()> {
    let fabric = MemFabric::new();
    let a = holder(&fabric, &[0], 8)?;
    let mut req = requester(&fabric, &[&a])?;
    let q = vec![0x3f80u16; 4 * D_QK];
    // Unknown chunk, layer out of range, index out of range: typed refusals per call.
    let bad_idx = [0i32, 250];
    let calls = [
        Call {
            chunk: ChunkId(0),
            layer: 9,
            queries: &q,
            sparse: None,
        },
        Call {
            chunk: ChunkId(0),
            layer: 0,
            queries: &q,
            sparse: Some(Sparse {
                indices: &bad_idx,
                k: 2,
                rows_per_token: 4,
            }),
        },
        Call {
            chunk: ChunkId(0),
            layer: 0,
            queries: &q,
            sparse: None,
        },
    ];
    let out = req.route(&calls);
    assert!(
        matches!(
            out[0],
            Err(RouteError::Refused {
                status: wire::Status::BadLayer,
                ..
            })
        ),
        "{:?}",
        out[0]
    );
    assert!(
        matches!(
            out[1],
            Err(RouteError::Refused {
                status: wire::Status::Kernel,
                ..
            })
        ),
        "{:?}",
        out[1]
    );
    assert!(out[2].is_ok(), "{:?}", out[2]);
    // The served call's rows sit after the refused calls' (zeroed) rows: the same partial as
    // the call routed alone.
    let alone = req.route(&calls[2..]).remove(0)?;
    assert!(
        out[2].as_ref().is_ok_and(|p| *p == alone),
        "rows read from the wrong place"
    );
    assert!(matches!(
        req.route(&[Call {
            chunk: ChunkId(3),
            layer: 0,
            queries: &q,
            sparse: None
        }])[0],
        Err(RouteError::NoHolder(_))
    ));
    // A rogue requester with a real session writes garbage into its slot, then a request
    // whose header is fine and whose segment lies, then a stray immediate.
    let rogue = TransferEngine::mem(&fabric, 1)?;
    let reply = rogue.alloc_mr(1 << 16)?;
    let mut control = std::net::TcpStream::connect(a.addr())?;
    let hello = session::Hello {
        addr: rogue.main_address(),
        reply: reply.desc().clone(),
        pool: None,
        reply_imm: 77,
        fetch_imm: 78,
    };
    let mut reader = std::io::BufReader::new(control.try_clone()?);
    let welcome = session::open(
        &rogue,
        (&mut control, &mut reader),
        &hello,
        Duration::from_secs(5),
    )?;
    let buf = rogue.alloc_mr(4096)?;
    buf.fill(0xab);
    let imm = wire::request_imm(welcome.session, 1);
    let inbox = (&welcome.inbox, welcome.slot_offset);
    rogue.submit_single_write(4096, Some(imm), (buf.handle(), 0), inbox, OnDone::nothing())?;
    std::thread::sleep(Duration::from_millis(50));
    let mut lying = Vec::new();
    let seg = wire::SegmentSpec {
        kind: wire::SegmentKind::Dense,
        chunk: 0,
        layer: 0,
        queries: wire::QueryRows::Copied(&q[..D_QK]),
        indices: &[],
        pages: &[],
        windows: &[],
    };
    wire::encode_request(&mut lying, 5, welcome.token, 0, SCALE, &[seg]);
    let rows_at = wire::REQUEST_HEADER + 8;
    lying[rows_at..rows_at + 4].copy_from_slice(&1000u32.to_le_bytes());
    buf.write_at(0, &lying)?;
    let answered = rogue.imm_count(77, 1);
    rogue.submit_single_write(
        lying.len() as u64,
        Some(imm),
        (buf.handle(), 0),
        inbox,
        OnDone::nothing(),
    )?;
    answered.wait()?;
    let header =
        wire::decode_reply_header(&reply.to_vec()).ok_or_else(|| anyhow::anyhow!("no reply"))?;
    assert_eq!(
        (header.seq, header.statuses.as_slice()),
        (5, &[wire::Status::BadSegment][..])
    );
    rogue.submit_imm(
        wire::request_imm(9999, 1),
        &welcome.inbox,
        OnDone::nothing(),
    )?;
    rogue.submit_imm(0x1234_5678, &welcome.inbox, OnDone::nothing())?;
    // Forged pings: a reply longer than the holder's staging, and a ping immediate over a
    // slot that holds no ping header. Both are refused without a write.
    let before = req.holder_stats(0)?;
    let mut ping = [0u8; wire::PING_HEADER];
    let forged = wire::Ping {
        reply_len: u32::MAX,
        reply_offset: 0,
        pong: wire::Pong::Staged,
        token: welcome.token,
        seq: 6,
    };
    wire::encode_ping(&mut ping, &forged);
    buf.write_at(0, &ping)?;
    let ping_imm = wire::ping_imm(welcome.session, 1);
    rogue.submit_single_write(
        wire::PING_HEADER as u64,
        Some(ping_imm),
        (buf.handle(), 0),
        inbox,
        OnDone::nothing(),
    )?;
    buf.fill(0xab);
    rogue.submit_single_write(
        64,
        Some(ping_imm),
        (buf.handle(), 0),
        inbox,
        OnDone::nothing(),
    )?;
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        req.route(&calls[2..])[0].is_ok(),
        "still serving after a stray immediate and forged pings"
    );
    let stats = req.holder_stats(0)?;
    assert_eq!(stats.pings, before.pings, "no forged ping answered");
    assert!(stats.refused >= before.refused + 2, "{stats:?}");
    assert!(stats.refused >= 6, "{stats:?}");
    assert!(stats.stray_imms >= 2, "{stats:?}");
    Ok(())
}

#[test]
fn a_gather_beyond_the_holders_staging_is_too_large_and_leaks_nothing() -> Result<()> {
    let fabric = MemFabric::new();
    let config = HolderConfig {
        gather_bytes: 10 * kvroute_kvstore::ROW_BYTES,
        ..HolderConfig::default()
    };
    let engine = TransferEngine::mem(&fabric, 1)?;
    let held = HeldChunks::generate(&engine, &spec(), &[ChunkId(0)])?;
    let a = Holder::start(engine, TcpListener::bind("127.0.0.1:0")?, held, config)?;
    let mut req = requester(&fabric, &[&a])?;
    let free = req.free_pool_pages();
    let tokens: Vec<i32> = (0..6).collect();
    let part = [GatherPart {
        chunk: ChunkId(0),
        tokens: &tokens,
    }];
    // 6 rows x 2 layers = 12 rows: more than the 10 the holder stages per request.
    let refused = req.gather(&part, &[0, 1]);
    assert!(
        matches!(refused, Err(RouteError::TooLarge(n)) if n == 12 * kvroute_kvstore::ROW_BYTES),
        "{refused:?}"
    );
    assert_eq!(req.free_pool_pages(), free, "no pages leak");
    // One layer fits, and the link still works.
    let gathered = req.gather(&part, &[1])?;
    assert_eq!(gathered.rows, 6);
    req.release_gathered(gathered)?;
    assert_eq!(req.free_pool_pages(), free);
    Ok(())
}

#[test]
fn the_store_refuses_writes_through_its_published_descriptor() -> Result<()> {
    let fabric = MemFabric::new();
    let a = holder(&fabric, &[0], 2)?;
    let mut req = requester(&fabric, &[&a])?;
    let s = spec();
    let q = queries(2, i64::from(s.chunk_tokens), &s.rope()?, 3);
    let call = Call {
        chunk: ChunkId(0),
        layer: 1,
        queries: &q,
        sparse: None,
    };
    let before = req.route(&[call]).remove(0)?;
    // Every requester learns the store's descriptor from the registry; a peer that writes
    // through it is refused by the holder's NIC.
    let entry = req.registry().holders(ChunkId(0))?[0].clone();
    let rogue = TransferEngine::mem(&fabric, 1)?;
    let garbage = rogue.alloc_mr(4096)?;
    garbage.fill(0x7f);
    let done = kvroute_transport::DoneFlag::new();
    rogue.submit_single_write(
        4096,
        Some(5),
        (garbage.handle(), 0),
        (&entry.desc, entry.offset),
        OnDone::flag(&done),
    )?;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !done.is_done() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    let outcome = done.result().expect("the write completes");
    assert!(
        matches!(&outcome, Err(kvroute_transport::TransferError::RemoteAccess(why)) if why.contains("not remotely writable")),
        "{outcome:?}"
    );
    let after = req.route(&[call]).remove(0)?;
    assert_eq!(before, after, "the corpus is unchanged");
    Ok(())
}

/// The pong kinds a holder answers: a written pong is a measurement, served only with the
/// `measure` feature.
const PONGS: &[wire::Pong] = if cfg!(feature = "measure") {
    &[wire::Pong::Staged, wire::Pong::Written]
} else {
    &[wire::Pong::Staged]
};

/// A holder's counters include a batch, its times too, by the time the batch's reply lands:
/// a read right after each route or ping finds it counted, with nothing to wait for.
#[test]
fn counters_count_a_batch_by_the_time_its_reply_lands() -> Result<()> {
    let fabric = MemFabric::new();
    let a = holder(&fabric, &[0], 2)?;
    let mut req = requester(&fabric, &[&a])?;
    let s = spec();
    let q = queries(4, 900, &s.rope()?, 5);
    let rows = (q.len() / D_QK) as u64;
    let mut last = req.holder_stats(0)?;
    for i in 1..=200u64 {
        for part in req.route(&dense_calls(&q, 0, 0..1)) {
            part?;
        }
        let now = req.holder_stats(0)?;
        assert_eq!(
            (now.requests, now.batches, now.rows, now.kernel_calls),
            (i, i, i * rows, i),
            "after route {i}: {now:?}"
        );
        assert!(
            now.serve_us > last.serve_us && now.kernel_us > last.kernel_us,
            "after route {i}, the batch's times are in: {now:?} after {last:?}"
        );
        assert!(now.row_tokens > last.row_tokens, "route {i}: {now:?}");
        req.ping(0, wire::PING_HEADER, 1, wire::Pong::Staged)?;
        let pinged = req.holder_stats(0)?;
        assert_eq!(pinged.pings, last.pings + 1, "after ping {i}: {pinged:?}");
        last = pinged;
    }
    Ok(())
}

#[test]
fn ping_is_a_raw_round_trip_of_the_asked_sizes() -> Result<()> {
    let fabric = MemFabric::new();
    let a = holder(&fabric, &[0], 2)?;
    let mut req = requester(&fabric, &[&a])?;
    let warm = req.holder_stats(0)?.pings;
    assert_eq!(warm, 1, "connect opens the data path with one ping");
    for (out, back) in [
        (wire::PING_HEADER, 1),
        (300_000, 264_000),
        (1 << 20, 1 << 20),
    ] {
        for &pong in PONGS {
            let rtt = req.ping(0, out, back, pong)?;
            assert!(rtt > Duration::ZERO);
        }
    }
    let stats = req.holder_stats(0)?;
    assert_eq!(stats.pings, warm + 3 * PONGS.len() as u64);
    if cfg!(feature = "measure") {
        assert!(stats.pong_write_us > 0.0, "written pongs are timed");
    }
    assert_eq!(stats.requests, 0, "a ping is not a request");
    // Sizes the link or the holder cannot take are refused before anything is sent.
    assert!(matches!(
        req.ping(0, 8, 1, wire::Pong::Staged),
        Err(RouteError::TooLarge(8))
    ));
    assert!(matches!(
        req.ping(0, 64, 0, wire::Pong::Written),
        Err(RouteError::TooLarge(0))
    ));
    assert!(matches!(
        req.ping(0, 64, (1 << 20) + 1, wire::Pong::Written),
        Err(RouteError::TooLarge(_))
    ));
    assert!(matches!(
        req.ping(7, 64, 64, wire::Pong::Staged),
        Err(RouteError::NoHolder(_))
    ));
    // And routing still works on the same link afterwards.
    let q = vec![0x3f80u16; D_QK];
    let call = Call {
        chunk: ChunkId(0),
        layer: 0,
        queries: &q,
        sparse: None,
    };
    assert!(req.route(&[call])[0].is_ok());
    Ok(())
}

#[test]
fn holder_pushes_back_beyond_its_cap() -> Result<()> {
    let fabric = MemFabric::new();
    let a = holder(&fabric, &[0], 1)?;
    let first = requester(&fabric, &[&a])?;
    let second = requester(&fabric, &[&a]);
    assert!(second.is_err_and(|e| e.to_string().contains("busy")));
    drop(first);
    // The slot is freed when the first requester's control connection closes.
    let mut ok = false;
    for _ in 0..100 {
        if requester(&fabric, &[&a]).is_ok() {
            ok = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(ok, "a freed session is granted again");
    assert!(a.stats().busy >= 1);
    Ok(())
}

/// A directory with hostile contents beside an honest holder's records: 16 records naming
/// its control address with another engine (ids that sort first), 3 whose control address
/// accepts connections and never answers, and one naming another holder's control address
/// (listed nowhere else) with an engine that is not that holder's. The requester routes to
/// the honest holder on one link (the poisoned records neither hide its record nor spend
/// links: before, the first poisoned record's session was killed and then taken to serve the
/// honest record, and the record of the unlisted holder cost a link of its own); the silent
/// ones cost the first view one wait together, not one each, and a second view none (each
/// is left alone for a while).
#[test]
fn poisoned_and_silent_directory_records_neither_hide_a_holder_nor_stall_the_requester()
-> Result<()> {
    use kvroute_kvstore::directory::{Directory, HolderRecord, InProcessDirectory, SCHEMA};
    let fabric = MemFabric::new();
    let dir = InProcessDirectory::new();
    let watch = dir.watch()?;
    let honest = holder(&fabric, &[0, 1], 8)?;
    let (record, chunks) = honest.directory_records(0);
    let _honest_reg = dir.register(record.clone(), chunks)?;
    let elsewhere = TransferEngine::mem(&fabric, 1)?;
    let mut regs = Vec::new();
    for i in 0..16 {
        let poisoned = HolderRecord {
            schema: SCHEMA,
            id: format!("0-poisoned-{i:02}"),
            engine: elsewhere.main_address(),
            ..record.clone()
        };
        regs.push(dir.register(poisoned, Vec::new())?);
    }
    let unlisted = holder(&fabric, &[0], 8)?;
    regs.push(dir.register(
        HolderRecord {
            schema: SCHEMA,
            id: "2-unlisted".to_owned(),
            control: unlisted.addr(),
            engine: elsewhere.main_address(),
            ..record.clone()
        },
        Vec::new(),
    )?);
    let silent: Vec<TcpListener> = (0..3)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<_, _>>()?;
    for (i, l) in silent.iter().enumerate() {
        let record = HolderRecord {
            schema: SCHEMA,
            id: format!("1-silent-{i}"),
            control: l.local_addr()?,
            engine: elsewhere.main_address(),
            ..record.clone()
        };
        regs.push(dir.register(record, Vec::new())?);
    }
    let mut req = Requester::connect(
        TransferEngine::mem(&fabric, 1)?,
        &[],
        RequesterConfig {
            max_holders: 4,
            link_bytes: 1 << 20,
            timeout: Duration::from_millis(300),
            ..RequesterConfig::new(SCALE)
        },
    )?;
    let view = latest(&watch)?;
    assert_eq!(view.holders.len(), 21);
    let started = std::time::Instant::now();
    let sync = req.sync_with(&view);
    // Each silent record costs a welcome's wait (at least 1 s): side by side, the three
    // cost one (in turn they took over 3 s).
    assert!(
        started.elapsed() < Duration::from_millis(2000),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(sync.added, [(0, honest.addr())], "{sync:?}");
    assert_eq!(sync.failed.len(), 20, "{sync:?}");
    assert!(
        sync.failed
            .iter()
            .any(|(at, why)| *at == unlisted.addr() && why.contains("no record")),
        "{sync:?}"
    );
    assert_eq!(req.holders(), 1, "one link");
    assert_eq!(req.holder_for(ChunkId(1))?, 0);
    let q = queries(16, 900, &spec().rope()?, 5);
    assert!(
        req.route(&dense_calls(&q, 0, 0..2))
            .iter()
            .all(Result::is_ok)
    );
    // The next view: the silent records are not tried again yet.
    let started = std::time::Instant::now();
    let sync = req.sync_with(&view);
    assert!(
        started.elapsed() < Duration::from_millis(250),
        "{:?}",
        started.elapsed()
    );
    assert!(sync.added.is_empty() && req.holders() == 1, "{sync:?}");
    drop((regs, silent));
    Ok(())
}

/// Followed in the background, a view whose records include three holders that accept
/// connections and never answer costs the caller no wait: applying it and each later poll
/// return at once while the sessions open on threads of their own, the honest holder joins
/// at a poll once its session is open, and the silent ones are reported failed at a later
/// poll, one wait after the view, together. (`sync_with` on the same view waits at least
/// that wait: the silent holders' welcome, 1 s.)
#[test]
fn a_view_followed_in_the_background_never_waits_on_a_silent_holder() -> Result<()> {
    use kvroute_kvstore::directory::{Directory, HolderRecord, InProcessDirectory, SCHEMA};
    use std::net::TcpListener;
    let fabric = MemFabric::new();
    let dir = InProcessDirectory::new();
    let watch = dir.watch()?;
    let honest = holder(&fabric, &[0, 1], 8)?;
    let (record, chunks) = honest.directory_records(0);
    let mut regs = vec![dir.register(record.clone(), chunks)?];
    let elsewhere = TransferEngine::mem(&fabric, 1)?;
    let silent: Vec<TcpListener> = (0..3)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<_, _>>()?;
    for (i, l) in silent.iter().enumerate() {
        regs.push(dir.register(
            HolderRecord {
                schema: SCHEMA,
                id: format!("0-silent-{i}"),
                control: l.local_addr()?,
                engine: elsewhere.main_address(),
                ..record.clone()
            },
            Vec::new(),
        )?);
    }
    let mut req = Requester::connect(
        TransferEngine::mem(&fabric, 1)?,
        &[],
        RequesterConfig {
            max_holders: 4,
            link_bytes: 1 << 20,
            timeout: Duration::from_millis(300),
            ..RequesterConfig::new(SCALE)
        },
    )?;
    let view = latest(&watch)?;
    assert_eq!(view.holders.len(), 4);
    let started = std::time::Instant::now();
    let sync = req.sync_in_background(&view);
    let mut slowest = started.elapsed();
    assert_eq!(sync.opening.len(), 4, "{sync:?}");
    let (mut added, mut failed) = (sync.added, sync.failed);
    while failed.len() < 3 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{added:?} {failed:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
        let polled = std::time::Instant::now();
        let sync = req.poll_directory();
        slowest = slowest.max(polled.elapsed());
        added.extend(sync.added);
        failed.extend(sync.failed);
        if !added.is_empty() {
            // The honest holder serves while the silent ones are still being waited on.
            let q = queries(16, 900, &spec().rope()?, 5);
            assert!(
                req.route(&dense_calls(&q, 0, 0..2))
                    .iter()
                    .all(Result::is_ok)
            );
        }
    }
    assert!(slowest < Duration::from_millis(200), "{slowest:?}");
    assert_eq!(added, [(0, honest.addr())]);
    let silent_addrs: Vec<_> = silent
        .iter()
        .map(TcpListener::local_addr)
        .collect::<Result<_, _>>()?;
    assert!(
        failed.iter().all(|(at, _)| silent_addrs.contains(at)),
        "{failed:?}"
    );
    // Together: one welcome's wait (1 s at least), not three.
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "{:?}",
        started.elapsed()
    );
    assert!(req.poll_directory().opening.is_empty());
    drop((regs, silent));
    Ok(())
}

/// Dropping a requester stops its engine when nothing else holds it: a write to one of its
/// regions then finds no peer at all, not a region gone from a live engine. (Each link kept
/// a clone of the engine that was never dropped, so every requester's engine, its threads
/// and, over shm, its regions outlived it.)
#[test]
fn a_dropped_requester_takes_its_engine_with_it() -> Result<()> {
    let fabric = MemFabric::new();
    let a = holder(&fabric, &[0, 1], 8)?;
    let req = requester(&fabric, &[&a])?;
    let region = req.reply_region(0).expect("a link").clone();
    drop(req);
    let other = TransferEngine::mem(&fabric, 1)?;
    let (done, fut) = kvroute_transport::OnDone::future();
    // Refused at submit (the fabric has no such endpoint) or in flight (no peer): either way
    // gone; a live engine would refuse the write for its deregistered region instead.
    let gone = match other.submit_imm(1, &region, done) {
        Err(e) => e.to_string().contains("no endpoint"),
        Ok(()) => matches!(
            kvroute_transport::block_on(fut),
            Err(kvroute_transport::TransferError::PeerUnreachable)
        ),
    };
    assert!(gone, "the requester's engine outlived it");
    Ok(())
}
