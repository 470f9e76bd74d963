//! Bad input is a typed error before anything runs: mismatched shapes, indices out of range,
//! non-finite parameters, empty inputs, malformed wire bytes, overlapping scatter targets.

// Tests panic on failure: that is how a test reports it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Rng, SCALE};
use kvroute_kernels::layout::{D_LATENT, D_QK, PAGE_TOKENS, PARTIAL_ROW_BYTES};
use kvroute_kernels::{
    Backend, Cache, KernelError, Partial, Queries, Rope, RopeLayout, Selection, SpliceJob, merge,
    partial_dense, partial_sparse, queries_from_wire,
};

#[test]
fn shapes_indices_and_parameters_are_checked() {
    let mut rng = Rng::new(4);
    let (q, c) = (rng.rows(4), rng.rows(100));
    assert!(matches!(
        Queries::new(&q[..575]),
        Err(KernelError::Shape { .. })
    ));
    assert!(matches!(
        Cache::contiguous(&c[..577]),
        Err(KernelError::Shape { .. })
    ));
    let (qs, cache) = (Queries::new(&q).unwrap(), Cache::contiguous(&c).unwrap());
    for scale in [f32::NAN, f32::INFINITY, 0.0, -1.0] {
        for b in [Backend::Cpu, Backend::Reference] {
            assert!(matches!(
                partial_dense(b, &qs, &cache, scale),
                Err(KernelError::Parameter { .. })
            ));
        }
    }
    let none = Queries::new(&[]).unwrap();
    assert_eq!(
        partial_dense(Backend::Cpu, &none, &cache, SCALE),
        Err(KernelError::Empty("query rows"))
    );
    // Selection: out of range, below -1, wrong length, k = 0, heads not dividing rows.
    for bad in [[0, 100], [-2, 0]] {
        let idx: Vec<i32> = bad.iter().copied().cycle().take(8).collect();
        assert!(matches!(
            Selection::new(&idx, 2, 1, 4, 100),
            Err(KernelError::IndexOutOfRange { .. })
        ));
    }
    assert!(matches!(
        Selection::new(&[0; 7], 2, 1, 4, 100),
        Err(KernelError::Shape { .. })
    ));
    assert!(matches!(
        Selection::new(&[], 0, 1, 4, 100),
        Err(KernelError::Empty(_))
    ));
    assert!(matches!(
        Selection::new(&[0; 8], 2, 3, 4, 100),
        Err(KernelError::Parameter { .. })
    ));
    // A selection checked against a bigger cache is re-checked against the one it is used on.
    let idx = [99i32; 8];
    let sel = Selection::new(&idx, 2, 1, 4, 1000).unwrap();
    let small = Cache::contiguous(&c[..50 * D_QK]).unwrap();
    assert!(matches!(
        partial_sparse(Backend::Cpu, &qs, &small, &sel, SCALE),
        Err(KernelError::IndexOutOfRange { .. })
    ));
    // Paged: a block-table entry past the pool, a table too short for the tokens.
    let pool = vec![0u16; 2 * PAGE_TOKENS * D_QK];
    assert!(matches!(
        Cache::paged(&pool, &[0, 2], 100),
        Err(KernelError::IndexOutOfRange { .. })
    ));
    assert!(matches!(
        Cache::paged(&pool, &[0], 100),
        Err(KernelError::Shape { .. })
    ));
    assert!(matches!(
        Cache::paged(&pool[..100], &[0], 10),
        Err(KernelError::Shape { .. })
    ));
}

#[test]
fn read_wire_reuses_a_partial_and_leaves_empty_rows_on_a_bad_reply() {
    let mut good = Partial::empty(3);
    for (i, x) in good.o.iter_mut().enumerate() {
        *x = (i % 11) as f32 * 0.25 - 1.0;
    }
    good.m.copy_from_slice(&[0.5, -2.0, 7.0]);
    good.l.copy_from_slice(&[1.0, 3.5, 2.0]);
    // A buffer of another shape holding other values: resized, every value overwritten.
    let mut into = Partial::empty(5);
    into.o.fill(9.0);
    into.read_wire(&good.to_wire()).unwrap();
    assert_eq!(into, good);
    let mut bytes = good.to_wire();
    bytes[2 * PARTIAL_ROW_BYTES + 6..][..2].copy_from_slice(&0x7fc0u16.to_le_bytes()); // NaN o
    assert!(matches!(
        into.read_wire(&bytes),
        Err(KernelError::InvalidPartial { row: 2, .. })
    ));
    assert_eq!(into, Partial::empty(3), "a refused reply leaves empty rows");
    assert!(matches!(
        into.read_wire(&bytes[..PARTIAL_ROW_BYTES - 1]),
        Err(KernelError::Shape { .. })
    ));
}

#[test]
fn malformed_partials_and_wire_bytes_are_refused() {
    assert!(matches!(
        queries_from_wire(&[0; 1151]),
        Err(KernelError::Shape { .. })
    ));
    assert!(matches!(
        Partial::from_wire(&[0; PARTIAL_ROW_BYTES + 1]),
        Err(KernelError::Shape { .. })
    ));
    let good = Partial::empty(2);
    let mut bytes = good.to_wire();
    assert_eq!(Partial::from_wire(&bytes).unwrap(), good);
    // l = NaN, then l > 0 with m = -inf, then l = 0 with a finite m.
    let l_at = PARTIAL_ROW_BYTES - 4;
    bytes[l_at..l_at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    assert!(matches!(
        Partial::from_wire(&bytes),
        Err(KernelError::InvalidPartial { row: 0, .. })
    ));
    bytes[l_at..l_at + 4].copy_from_slice(&1f32.to_le_bytes());
    assert!(matches!(
        Partial::from_wire(&bytes),
        Err(KernelError::InvalidPartial { row: 0, .. })
    ));
    let mut p = Partial::empty(1);
    p.m[0] = 3.0;
    assert!(matches!(
        merge(&[&p]),
        Err(KernelError::InvalidPartial { .. })
    ));
    p.m[0] = f32::NEG_INFINITY;
    p.o[7] = f32::INFINITY;
    assert!(matches!(
        merge(&[&p]),
        Err(KernelError::InvalidPartial { .. })
    ));
    assert!(matches!(merge(&[]), Err(KernelError::Empty(_))));
    // A non-finite value in a contributing part is refused naming its row, even where the
    // part's weight underflows to 0 next to a much larger maximum.
    let mut big = Partial::empty(3);
    big.m.fill(0.0);
    big.l.fill(1.0);
    let mut tiny = big.clone();
    tiny.m.fill(-1e30);
    tiny.o[D_LATENT + 5] = f32::NAN;
    assert!(matches!(
        merge(&[&big, &tiny]),
        Err(KernelError::InvalidPartial { row: 1, .. })
    ));
    tiny.o[D_LATENT + 5] = 0.0;
    tiny.o[2 * D_LATENT] = f32::INFINITY;
    assert!(matches!(
        merge(&[&tiny, &big]),
        Err(KernelError::InvalidPartial { row: 2, .. })
    ));
    tiny.o[2 * D_LATENT] = 0.0;
    assert!(merge(&[&big, &tiny]).is_ok());
    let (a, b) = (Partial::empty(1), Partial::empty(2));
    assert!(matches!(
        merge(&[&a, &b]),
        Err(KernelError::RowMismatch { index: 1, .. })
    ));
}

#[test]
fn a_bad_splice_is_refused_and_writes_nothing() {
    let mut rng = Rng::new(8);
    let rope = Rope::plain(10_000.0, RopeLayout::Interleaved).unwrap();
    let src = rng.rows(2 * 10);
    let pos = vec![5i64; 10];
    let mut pool = vec![7u16; 3 * PAGE_TOKENS * D_QK];
    let cases: [(&[i64], &[u32], usize); 5] = [
        (&[-1, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[0, 1], 2), // negative position
        (&pos, &[0, 3], 2),                             // page past the pool
        (&pos, &[1, 1], 2),                             // a page twice
        (&pos, &[0], 2),                                // table too short
        (&pos, &[0, 1], 3),                             // source too short for 3 layers
    ];
    for (from, table, layers) in cases {
        assert!(SpliceJob::new(&src, layers, from, &pos, rope, &mut pool, table).is_err());
        if layers == 2 {
            // The same checks in place (no source to be short).
            assert!(SpliceJob::in_place(layers, from, &pos, rope, &mut pool, table).is_err());
        }
    }
    assert!(SpliceJob::in_place(1, &[], &[], rope, &mut pool, &[]).is_err());
    assert!(SpliceJob::in_place(1, &pos, &pos, rope, &mut pool[..100], &[0]).is_err());
    assert!(SpliceJob::new(&src, 0, &pos, &pos, rope, &mut pool, &[0, 1]).is_err());
    assert!(pool.iter().all(|&x| x == 7), "nothing written");
}
