//! Holders serving from a GPU (skipped, and counted as skipped, where there is none).

use super::*;

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
