//! Batched paged decode on the host: every batch case on every instruction set against the f64
//! reference, a batch against its requests one at a time, FP8 against bf16, and bad batches.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{BatchData, Rng, SCALE, assert_close, batch_cases};
use kvroute_kernels::layout::D_QK;
use kvroute_kernels::{
    Backend, Cache, DecodeRequest, KernelError, KvPool, Partial, Queries, Selection,
    partial_batched, partial_dense, partial_sparse,
};

#[test]
fn every_batch_matches_the_reference_on_every_instruction_set() {
    let mut rng = Rng::new(41);
    for case in batch_cases() {
        let data = BatchData::new(&mut rng, &case);
        let requests = data.requests();
        for fp8 in [false, true] {
            let pool = data.pool(fp8);
            let want = partial_batched(Backend::Reference, &pool, &requests, SCALE).unwrap();
            assert_eq!(want.len(), requests.len());
            for isa in common::isas() {
                let got = partial_batched(Backend::CpuWith(isa), &pool, &requests, SCALE).unwrap();
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_close(
                        g,
                        w,
                        &format!("{} fp8={fp8} {isa:?} request {i}", case.name),
                    );
                }
            }
        }
    }
}

/// A batch on the CPU is its requests one at a time, bit for bit: the same kernels over the
/// same rows through the block table.
#[test]
fn a_batch_is_its_requests_one_at_a_time() {
    let mut rng = Rng::new(43);
    for case in batch_cases()
        .iter()
        .filter(|c| c.name.contains("mixed") || c.name.contains("varlen"))
    {
        let data = BatchData::new(&mut rng, case);
        let requests = data.requests();
        let got = partial_batched(Backend::Cpu, &data.pool(false), &requests, SCALE).unwrap();
        for (r, g) in requests.iter().zip(&got) {
            let cache = Cache::paged_blocks(&data.pool, data.block, r.table(), r.tokens()).unwrap();
            let one = match r.selection() {
                None => partial_dense(Backend::Cpu, &r.queries(), &cache, SCALE),
                Some(sel) => partial_sparse(Backend::Cpu, &r.queries(), &cache, sel, SCALE),
            };
            let one = one.unwrap_or_else(|_| Partial::empty(r.queries().len()));
            assert_eq!(g, &one, "{}", case.name);
        }
    }
}

/// FP8 rows (e4m3, a power-of-two scale per 128 dims) against the bf16 rows they quantize:
/// e4m3 keeps 4 significant bits, so each latent value moves by up to 1/16 of itself (about
/// 1/28 of it on average). Over N(0, 1) rows a score (512 quantized products, times 0.1147)
/// moves by about 0.1147 x sqrt(512) / 28 = 0.09, which moves lse by about as much and o,
/// through its weights and its quantized V, by a few hundredths: measured here (o max 0.27,
/// mean 0.018; lse max 0.15), printed, and bounded with room (docs/kernels.md, "FP8 KV").
#[test]
fn fp8_stays_within_its_quantization_error_of_bf16() {
    let mut rng = Rng::new(47);
    let (mut worst_o, mut worst_lse, mut sum, mut n) = (0f32, 0f32, 0f64, 0usize);
    for case in batch_cases()
        .iter()
        .filter(|c| c.name.starts_with("sparse"))
    {
        let data = BatchData::new(&mut rng, case);
        let requests = data.requests();
        let bf = partial_batched(Backend::Reference, &data.pool(false), &requests, SCALE).unwrap();
        let f8 = partial_batched(Backend::Reference, &data.pool(true), &requests, SCALE).unwrap();
        for (a, b) in bf.iter().zip(&f8) {
            for r in 0..a.rows() {
                if a.l[r] == 0.0 {
                    assert_eq!(b.l[r], 0.0);
                    continue;
                }
                worst_lse = worst_lse.max((a.lse(r) - b.lse(r)).abs());
                for (x, y) in a.o_row(r).iter().zip(b.o_row(r)) {
                    worst_o = worst_o.max((x - y).abs());
                    sum += f64::from((x - y).abs());
                    n += 1;
                }
            }
        }
    }
    let mean = sum / n as f64;
    println!(
        "FP8 against bf16: o max abs {worst_o:.3e}, mean abs {mean:.3e}; lse max abs {worst_lse:.3e}"
    );
    assert!(
        worst_o <= 0.5 && mean <= 0.03 && worst_lse <= 0.3,
        "{worst_o} {mean} {worst_lse}"
    );
    // Not a vacuous bound: the error is there.
    assert!(mean > 1e-4);
}

#[test]
fn bad_batches_are_typed_errors_naming_the_request() {
    let mut rng = Rng::new(53);
    let pool = rng.rows(4 * 16);
    let kv = KvPool::bf16(&pool, 16).unwrap();
    let q = rng.rows(2);
    let q = Queries::new(&q).unwrap();
    let good = DecodeRequest::dense(q, &[3, 0], 20);
    let cases: Vec<(DecodeRequest<'_>, &str)> = vec![
        (DecodeRequest::dense(q, &[3], 20), "table too short"),
        (
            DecodeRequest::dense(q, &[3, 4], 20),
            "block outside the pool",
        ),
        (
            DecodeRequest::dense(Queries::new(&[]).unwrap(), &[0], 3),
            "no query rows",
        ),
    ];
    for (bad, what) in cases {
        for backend in [Backend::Cpu, Backend::Reference] {
            let err = partial_batched(backend, &kv, &[good, bad], SCALE).unwrap_err();
            assert!(
                matches!(err, KernelError::Request { request: 1, .. }),
                "{what}: {err}"
            );
            assert!(err.to_string().starts_with("request 1: "), "{err}");
        }
    }
    let idx = [5, 30];
    let sel = Selection::new(&idx, 1, 1, 2, 31).unwrap(); // built for 31 tokens, context of 20
    let past = DecodeRequest::sparse(q, &[3, 0], 20, sel);
    assert!(matches!(
        partial_batched(Backend::Cpu, &kv, &[past], SCALE),
        Err(KernelError::Request { request: 0, .. })
    ));
    assert!(partial_batched(Backend::Cpu, &kv, &[good], 0.0).is_err());
    assert!(
        partial_batched(Backend::Cpu, &kv, &[], SCALE)
            .unwrap()
            .is_empty()
    );
    // A NaN in a row a request attends is refused naming the request and the row.
    let mut poisoned = pool.clone();
    poisoned[(3 * 16 + 5) * D_QK + 7] = 0x7fc0;
    let kv = KvPool::bf16(&poisoned, 16).unwrap();
    let other = DecodeRequest::dense(q, &[1], 16);
    let err = partial_batched(Backend::Cpu, &kv, &[other, good], SCALE).unwrap_err();
    assert!(
        matches!(&err, KernelError::Request { request: 1, source } if matches!(**source, KernelError::NonFinite { row: 0, .. })),
        "{err}"
    );
}
