//! The CPU fast path against the f64 reference over random shapes, on every instruction set
//! this CPU has.
//!
//! Tolerances (FlashMLA's tests allow out abs 8e-4 / rel 2/128 and lse abs 1e-6 / rel
//! 8/65536 for bf16 kernels). Here inputs are identical bf16 on both sides and only the
//! accumulation differs (f32 vs f64), so the bounds are tighter and derived from f32 round-off:
//! - `o`: an f32 dot of 576 terms of magnitude ~1 carries ~sqrt(576) * 6e-8 ~ 1.4e-6 relative
//!   error per logit, times |logit| ~ 10 gives ~1.5e-5 relative in a softmax weight; `o` is a
//!   weighted mean of |v| <~ 4 whose errors mostly cancel: observed at most 5.0e-6 over these
//!   shapes, so 5e-5 abs (10x margin) is the bound.
//! - `lse = m + ln l`: abs 1e-4 + rel 8/65536 (the logit error above, plus f32 `exp` sums).

// Tests panic on failure: that is how a test reports it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Rng, SCALE, assert_close};
use kvroute_kernels::{Backend, Cache, Partial, Queries, Selection, partial_dense, partial_sparse};

fn backends() -> Vec<Backend> {
    common::isas().into_iter().map(Backend::CpuWith).collect()
}

#[test]
fn dense_partials_match_the_reference_over_random_shapes() {
    let mut rng = Rng::new(7);
    let shapes = common::dense_shapes(&mut rng);
    for (mq, ct) in shapes {
        let (q, c) = (rng.rows(mq), rng.rows(ct));
        let (q, cache) = (Queries::new(&q).unwrap(), Cache::contiguous(&c).unwrap());
        let want = partial_dense(Backend::Reference, &q, &cache, SCALE).unwrap();
        for b in backends() {
            let got = partial_dense(b, &q, &cache, SCALE).unwrap();
            assert_close(&got, &want, &format!("dense mq={mq} ct={ct} {b:?}"));
        }
    }
}

#[test]
fn a_paged_cache_gives_the_same_partial_as_the_contiguous_one() {
    let mut rng = Rng::new(11);
    let ct = 1000;
    let c = rng.rows(ct);
    let queries = [rng.rows(16), rng.rows(1)];
    // Scatter the 16 pages of the chunk over a 40-page pool in a shuffled order.
    let pages = ct.div_ceil(64);
    let mut table: Vec<u32> = (0..40).collect();
    for i in (1..table.len()).rev() {
        table.swap(i, rng.range(0, i));
    }
    table.truncate(pages);
    let mut pool = vec![0u16; 40 * 64 * 576];
    for t in 0..ct {
        let dst = (table[t / 64] as usize * 64 + t % 64) * 576;
        pool[dst..dst + 576].copy_from_slice(&c[t * 576..(t + 1) * 576]);
    }
    let contiguous = Cache::contiguous(&c).unwrap();
    let paged = Cache::paged(&pool, &table, ct).unwrap();
    // 16 rows take the tiled path, one row the few-rows path.
    for rows in &queries {
        let q = Queries::new(rows).unwrap();
        for b in backends().into_iter().chain([Backend::Reference]) {
            let a = partial_dense(b, &q, &contiguous, SCALE).unwrap();
            let p = partial_dense(b, &q, &paged, SCALE).unwrap();
            assert_eq!(
                a,
                p,
                "{b:?}, {} rows: same tokens, same order, same arithmetic",
                rows.len() / 576
            );
        }
    }
}

#[test]
fn sparse_partials_match_the_reference_with_padding_and_duplicates() {
    let mut rng = Rng::new(23);
    // (query tokens, heads per token, k, cache tokens)
    let mut shapes = vec![
        (1, 16, 2048, 8192),
        (2, 128, 512, 4096),
        (4, 16, 1, 10),
        (1, 128, 2048, 2048),
    ];
    for _ in 0..4 {
        let h = if rng.uniform() < 0.5 { 16 } else { 128 };
        let tokens = rng.range(1, 512 / h);
        shapes.push((tokens, h, rng.range(1, 2048), rng.range(1, 8192)));
    }
    for (tokens, h, k, ct) in shapes {
        let (q, c) = (rng.rows(tokens * h), rng.rows(ct));
        let idx = rng.selection(tokens, k, ct);
        let q = Queries::new(&q).unwrap();
        let cache = Cache::contiguous(&c).unwrap();
        let sel = Selection::new(&idx, k, h, q.len(), ct).unwrap();
        let want = partial_sparse(Backend::Reference, &q, &cache, &sel, SCALE).unwrap();
        for b in backends() {
            let got = partial_sparse(b, &q, &cache, &sel, SCALE).unwrap();
            assert_close(
                &got,
                &want,
                &format!("sparse t={tokens} h={h} k={k} ct={ct} {b:?}"),
            );
        }
    }
}

#[test]
fn all_padding_and_an_empty_cache_give_the_empty_partial() {
    let mut rng = Rng::new(5);
    let (q, c) = (rng.rows(32), rng.rows(10));
    let q = Queries::new(&q).unwrap();
    let cache = Cache::contiguous(&c).unwrap();
    let idx = vec![-1i32; 2 * 8];
    let sel = Selection::new(&idx, 8, 16, 32, 10).unwrap();
    let none = Cache::contiguous(&[]).unwrap();
    for b in backends().into_iter().chain([Backend::Reference]) {
        assert_eq!(
            partial_sparse(b, &q, &cache, &sel, SCALE).unwrap(),
            Partial::empty(32)
        );
        assert_eq!(
            partial_dense(b, &q, &none, SCALE).unwrap(),
            Partial::empty(32)
        );
    }
}

#[test]
fn duplicated_indices_count_once_per_occurrence() {
    let mut rng = Rng::new(9);
    let (q, c) = (rng.rows(1), rng.rows(3));
    let q = Queries::new(&q).unwrap();
    let cache = Cache::contiguous(&c).unwrap();
    // [0, 0, 1] weighs token 0 twice: its l is l([0]) * 2 + l([1]) relative to the same m.
    let twice = [0i32, 0, 1];
    let sel = Selection::new(&twice, 3, 1, 1, 3).unwrap();
    let dup = partial_sparse(Backend::Reference, &q, &cache, &sel, SCALE).unwrap();
    let once = [0i32, 1, -1];
    let sel = Selection::new(&once, 3, 1, 1, 3).unwrap();
    let single = partial_sparse(Backend::Reference, &q, &cache, &sel, SCALE).unwrap();
    assert!(dup.l[0] > single.l[0], "the duplicate adds weight");
    for b in backends() {
        let sel = Selection::new(&twice, 3, 1, 1, 3).unwrap();
        assert_close(
            &partial_sparse(b, &q, &cache, &sel, SCALE).unwrap(),
            &dup,
            "duplicates",
        );
    }
}
