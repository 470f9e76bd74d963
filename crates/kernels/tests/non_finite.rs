//! The non-finite contract: a partial row is either finite (`m` finite, `l > 0`, `o` finite)
//! or, when it attends no token at all (a sparse row whose selection is all padding), empty
//! (`m = -inf`, `l = 0`, `o = 0`). Anything else (a NaN or infinity in a query or cache row, a
//! score that overflows f32) is refused with [`KernelError::NonFinite`] naming the first bad
//! query row, on every backend and in both output forms: never a NaN, and never a finite or
//! empty row that would merge into a silently wrong answer.

// Tests panic on failure: that is how a test reports it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Rng, SCALE};
use kvroute_kernels::layout::PARTIAL_ROW_BYTES;
use kvroute_kernels::layout::{D_LATENT, D_QK};
use kvroute_kernels::{
    Backend, Cache, KernelError, Queries, Selection, WireOut, bf16, partial_dense,
    partial_dense_wire, partial_sparse, partial_sparse_wire,
};

const NAN: u16 = 0x7fc0;
const INF: u16 = 0x7f80;

fn backends() -> Vec<Backend> {
    let mut b: Vec<Backend> = common::isas().into_iter().map(Backend::CpuWith).collect();
    b.push(Backend::Reference);
    b
}

/// The four entry points (dense, sparse over every token, each into a `Partial` and into wire
/// rows) on `backend`: each result, `Ok(())` or the error.
fn run_all(backend: Backend, q: &[u16], c: &[u16]) -> Vec<(&'static str, Result<(), KernelError>)> {
    let (qs, cache) = (Queries::new(q).unwrap(), Cache::contiguous(c).unwrap());
    let (mq, ct) = (q.len() / D_QK, c.len() / D_QK);
    let idx: Vec<i32> = (0..mq).flat_map(|_| 0..ct as i32).collect();
    let sel = Selection::new(&idx, ct, 1, mq, ct).unwrap();
    let mut wire = vec![0u8; mq * PARTIAL_ROW_BYTES];
    let mut wire_sparse = wire.clone();
    vec![
        (
            "dense",
            partial_dense(backend, &qs, &cache, SCALE).map(drop),
        ),
        (
            "sparse",
            partial_sparse(backend, &qs, &cache, &sel, SCALE).map(drop),
        ),
        ("dense wire", {
            let mut out = WireOut::new([&mut wire[..]]).unwrap();
            partial_dense_wire(backend, &qs, &cache, SCALE, &mut out)
        }),
        ("sparse wire", {
            let mut out = WireOut::new([&mut wire_sparse[..]]).unwrap();
            partial_sparse_wire(backend, &qs, &cache, &sel, SCALE, &mut out)
        }),
    ]
}

/// Every backend and entry point refuses the input, naming query row `row`.
fn refused(q: &[u16], c: &[u16], row: usize, case: &str) {
    for b in backends() {
        for (entry, got) in run_all(b, q, c) {
            assert!(
                matches!(got, Err(KernelError::NonFinite { row: r, .. }) if r == row),
                "{case}: {entry} on {b:?} gave {got:?}, not NonFinite at row {row}"
            );
        }
    }
}

#[test]
fn a_nan_or_infinity_in_one_cache_row_is_refused_not_dropped() {
    let mut rng = Rng::new(11);
    let q = rng.rows(6);
    // 1,500 tokens: several tiles and several key splits on the CPU path.
    for (value, at) in [
        (NAN, 700usize),
        (INF, 3),
        (NAN | 0x8000, 1499),
        (INF | 0x8000, 64),
    ] {
        let mut c = rng.rows(1500);
        c[at * D_QK + 17] = value;
        refused(&q, &c, 0, &format!("cache token {at} = {value:#06x}"));
    }
    // In the rotary band too (the last 64 dims: scores only).
    let mut c = rng.rows(1500);
    c[200 * D_QK + D_LATENT + 5] = NAN;
    refused(&q, &c, 0, "NaN in a cache row's rotary band");
}

#[test]
fn a_nan_query_row_is_refused_naming_that_row() {
    let mut rng = Rng::new(12);
    let c = rng.rows(700);
    for (value, row) in [(NAN, 3usize), (INF, 5), (INF | 0x8000, 0)] {
        let mut q = rng.rows(6);
        q[row * D_QK + 100] = value;
        refused(&q, &c, row, &format!("query row {row} = {value:#06x}"));
    }
}

#[test]
fn a_score_that_overflows_f32_is_refused() {
    let mut rng = Rng::new(13);
    let c = rng.rows(300);
    // Finite bf16 inputs whose dot products overflow f32 (|q . k| > 3.4e38), either sign: the
    // row's logits become +-inf, never a finite softmax.
    for sign in [0u16, 0x8000] {
        let mut q = rng.rows(4);
        let big = bf16::from_f32(3.0e38) | sign;
        let mut c = c.clone();
        for t in 0..300 {
            for d in 0..D_QK {
                c[t * D_QK + d] = bf16::from_f32(1.0e30);
            }
        }
        for d in 0..D_QK {
            q[2 * D_QK + d] = big;
        }
        refused(&q, &c, 2, &format!("overflowing scores, sign {sign:#x}"));
    }
}

#[test]
fn a_sparse_row_that_selects_nothing_is_empty_not_an_error() {
    let mut rng = Rng::new(14);
    let (q, c) = (rng.rows(2), rng.rows(100));
    let (qs, cache) = (Queries::new(&q).unwrap(), Cache::contiguous(&c).unwrap());
    let idx = [5, 9, -1, -1];
    let sel = Selection::new(&idx, 2, 1, 2, 100).unwrap();
    for b in backends() {
        let p = partial_sparse(b, &qs, &cache, &sel, SCALE).unwrap();
        assert!(p.m[0].is_finite() && p.l[0] > 0.0, "{b:?}");
        assert_eq!((p.m[1], p.l[1]), (f32::NEG_INFINITY, 0.0), "{b:?}");
        assert!(p.o_row(1).iter().all(|&x| x == 0.0), "{b:?}");
    }
}
