//! The fused wire epilogue ([`partial_dense_wire`], [`partial_sparse_wire`]) writes exactly
//! the bytes [`Partial::to_wire`] gives for the same call, on every backend here, wherever the
//! rows are split into runs; bad destinations are typed errors that write nothing.

// Tests panic on failure: that is how a test reports it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Rng, SCALE};
use kvroute_kernels::layout::PARTIAL_ROW_BYTES;
use kvroute_kernels::{
    Backend, Cache, KernelError, Queries, Selection, WireOut, partial_dense, partial_dense_wire,
    partial_sparse, partial_sparse_wire,
};

fn backends() -> Vec<Backend> {
    let mut b: Vec<Backend> = common::isas().into_iter().map(Backend::CpuWith).collect();
    b.push(Backend::Reference);
    b
}

/// `mq` rows' bytes split into runs at random row boundaries (some runs empty), as a holder
/// that batches several requests' segments into one call splits them.
fn runs<'a>(rng: &mut Rng, bytes: &'a mut [u8]) -> Vec<&'a mut [u8]> {
    let mut out = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        let rows = rest.len() / PARTIAL_ROW_BYTES;
        let take = rng.range(0, rows.min(40));
        let (run, tail) = rest.split_at_mut(take * PARTIAL_ROW_BYTES);
        out.push(run);
        rest = tail;
    }
    out
}

#[test]
fn the_dense_epilogue_writes_the_bytes_of_the_f32_partial_encoded() {
    let mut rng = Rng::new(31);
    for (mq, ct) in [(1, 1), (1, 2048), (7, 100), (33, 700), (256, 2048), (70, 0)] {
        let (q, c) = (rng.rows(mq), rng.rows(ct.max(1)));
        let q = Queries::new(&q).unwrap();
        let cache = Cache::contiguous(&c[..ct * 576]).unwrap();
        for b in backends() {
            let want = partial_dense(b, &q, &cache, SCALE).unwrap().to_wire();
            let mut got = vec![0xa5u8; mq * PARTIAL_ROW_BYTES];
            let mut out = WireOut::new(runs(&mut rng, &mut got)).unwrap();
            partial_dense_wire(b, &q, &cache, SCALE, &mut out).unwrap();
            assert!(
                got == want,
                "dense mq={mq} ct={ct} {b:?}: wire bytes differ"
            );
        }
    }
}

#[test]
fn the_sparse_epilogue_writes_the_bytes_of_the_f32_partial_encoded() {
    let mut rng = Rng::new(37);
    for (tokens, h, k, ct) in [(1, 16, 1, 10), (3, 16, 512, 4096), (2, 128, 64, 300)] {
        let mq = tokens * h;
        let (q, c) = (rng.rows(mq), rng.rows(ct));
        let idx = rng.selection(tokens, k, ct);
        let q = Queries::new(&q).unwrap();
        let cache = Cache::contiguous(&c).unwrap();
        let sel = Selection::new(&idx, k, h, mq, ct).unwrap();
        for b in backends() {
            let want = partial_sparse(b, &q, &cache, &sel, SCALE)
                .unwrap()
                .to_wire();
            let mut got = vec![0x5au8; mq * PARTIAL_ROW_BYTES];
            let mut out = WireOut::new(runs(&mut rng, &mut got)).unwrap();
            partial_sparse_wire(b, &q, &cache, &sel, SCALE, &mut out).unwrap();
            assert!(
                got == want,
                "sparse tokens={tokens} h={h} k={k} {b:?}: wire bytes differ"
            );
        }
    }
}

#[test]
fn bad_destinations_are_refused_and_nothing_is_written() {
    let mut rng = Rng::new(41);
    let (q, c) = (rng.rows(4), rng.rows(64));
    let q = Queries::new(&q).unwrap();
    let cache = Cache::contiguous(&c).unwrap();
    // A run that is not whole rows.
    let mut odd = vec![0u8; PARTIAL_ROW_BYTES + 1];
    assert!(matches!(
        WireOut::new([&mut odd[..]]),
        Err(KernelError::Shape { .. })
    ));
    // One row too few, one too many.
    for rows in [3, 5] {
        let mut bytes = vec![7u8; rows * PARTIAL_ROW_BYTES];
        let mut out = WireOut::new([&mut bytes[..]]).unwrap();
        for b in backends() {
            let err = partial_dense_wire(b, &q, &cache, SCALE, &mut out).unwrap_err();
            assert!(matches!(err, KernelError::Shape { .. }), "{b:?}: {err}");
        }
        drop(out);
        assert!(bytes.iter().all(|&x| x == 7), "a refused call wrote");
    }
    // A non-finite scale, an index out of range.
    let mut bytes = vec![7u8; 4 * PARTIAL_ROW_BYTES];
    let mut out = WireOut::new([&mut bytes[..]]).unwrap();
    for b in backends() {
        assert!(partial_dense_wire(b, &q, &cache, f32::NAN, &mut out).is_err());
    }
    let big = Cache::contiguous(&c).unwrap();
    let idx = vec![0i32, 1, 2, 3];
    let sel = Selection::new(&idx, 4, 4, 4, 64).unwrap();
    let small = Cache::contiguous(&c[..2 * 576]).unwrap();
    for b in backends() {
        let err = partial_sparse_wire(b, &q, &small, &sel, SCALE, &mut out).unwrap_err();
        assert!(
            matches!(err, KernelError::IndexOutOfRange { .. }),
            "{b:?}: {err}"
        );
        assert!(partial_sparse_wire(b, &q, &big, &sel, SCALE, &mut out).is_ok());
    }
    drop(out);
    assert!(
        bytes.iter().any(|&x| x != 7),
        "the valid call wrote nothing"
    );
}

/// `merge_wire` reads the parts' wire rows where they are: one part is exactly its decode,
/// several match `merge` of the decoded parts to f32 round-off of the bf16 values, an empty
/// part is the identity.
#[test]
fn merging_wire_rows_matches_merging_decoded_partials() {
    use kvroute_kernels::{Partial, WirePartial, merge, merge_wire};
    let parts = kvroute_kernels::workload::merge_parts().unwrap();
    let wires: Vec<Vec<u8>> = parts.iter().map(Partial::to_wire).collect();
    let views: Vec<WirePartial<'_>> = wires.iter().map(|w| WirePartial::new(w).unwrap()).collect();
    let decoded: Vec<Partial> = wires
        .iter()
        .map(|w| Partial::from_wire(w).unwrap())
        .collect();
    let mut out = Partial::empty(0);
    merge_wire(&views[..1], &mut out).unwrap();
    assert_eq!(out, decoded[0], "one part: an exact decode");
    merge_wire(&views, &mut out).unwrap();
    let want = merge(&decoded.iter().collect::<Vec<_>>()).unwrap();
    assert_eq!(out.m, want.m);
    let worst = common::max_abs(&out.o, &want.o);
    assert!(worst <= 2e-6, "o differs by {worst}");
    for (a, b) in out.l.iter().zip(&want.l) {
        assert!((a - b).abs() <= 1e-6 * b, "l {a} vs {b}");
    }
    // An empty part anywhere changes nothing.
    let empty = Partial::empty(parts[0].rows()).to_wire();
    let mut with_empty = views.clone();
    with_empty.insert(3, WirePartial::new(&empty).unwrap());
    let mut again = Partial::empty(0);
    merge_wire(&with_empty, &mut again).unwrap();
    assert_eq!(again, out);
}

#[test]
fn bad_wire_rows_are_refused_and_the_merge_leaves_the_identity() {
    use kvroute_kernels::layout::D_LATENT;
    use kvroute_kernels::{Partial, WirePartial, merge_wire};
    let parts = kvroute_kernels::workload::merge_parts().unwrap();
    let good = parts[0].to_wire();
    let rows = parts[0].rows();
    // Not whole rows; l negative; m = -inf with l > 0; m finite with l = 0.
    assert!(WirePartial::new(&good[..good.len() - 1]).is_err());
    let l_at = 2 * D_LATENT + 4;
    for (at, value) in [
        (l_at, -1.0f32),
        (2 * D_LATENT, f32::NEG_INFINITY),
        (l_at, f32::NAN),
    ] {
        let mut bad = good.clone();
        bad[PARTIAL_ROW_BYTES + at..PARTIAL_ROW_BYTES + at + 4]
            .copy_from_slice(&value.to_le_bytes());
        assert!(
            matches!(
                WirePartial::new(&bad),
                Err(KernelError::InvalidPartial { row: 1, .. })
            ),
            "byte {at} = {value}"
        );
    }
    let mut bad = good.clone();
    bad[l_at..l_at + 4].copy_from_slice(&0f32.to_le_bytes());
    assert!(WirePartial::new(&bad).is_err(), "l = 0 with a finite m");
    // A NaN in o of a live row: refused by the merge, which leaves empty rows.
    let mut nan = good.clone();
    nan[5 * PARTIAL_ROW_BYTES + 10..5 * PARTIAL_ROW_BYTES + 12]
        .copy_from_slice(&0x7fc0u16.to_le_bytes());
    let view = WirePartial::new(&nan).unwrap();
    let mut out = parts[1].clone();
    let err = merge_wire(&[WirePartial::new(&good).unwrap(), view], &mut out).unwrap_err();
    assert!(
        matches!(err, KernelError::InvalidPartial { row: 5, .. }),
        "{err}"
    );
    assert_eq!(out, Partial::empty(rows));
    // Rows that differ in number; nothing to merge.
    let short = &good[..PARTIAL_ROW_BYTES];
    let err = merge_wire(
        &[
            WirePartial::new(&good).unwrap(),
            WirePartial::new(short).unwrap(),
        ],
        &mut out,
    );
    assert!(matches!(
        err,
        Err(KernelError::RowMismatch { index: 1, .. })
    ));
    assert!(matches!(
        merge_wire(&[], &mut out),
        Err(KernelError::Empty(_))
    ));
}
