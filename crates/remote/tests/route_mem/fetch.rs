//! Fetch and gather: chunks pulled into the requester's pool and spliced to its positions,
//! selected rows of several holders packed into pool pages, replicas preferred.

use super::*;

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
