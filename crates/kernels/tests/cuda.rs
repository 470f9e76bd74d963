//! The CUDA backend: every kernel compiled for sm_90 by NVRTC (no GPU needed), and on a machine
//! with a GPU, every kernel against the f64 reference and the CPU path.
//!
//! This binary has its own runner (`harness = false`) so that what could not run here says so
//! on the console instead of passing silently:
//! - the sm_90 compile needs `libnvrtc.so.13` on `LD_LIBRARY_PATH` (`cargo xtask test` puts the
//!   wheel `cargo xtask deps` unpacked there and sets `KVROUTE_REQUIRE_NVRTC=1`, which turns a
//!   missing NVRTC into a failure);
//! - the GPU tests need a usable device (`cargo xtask gpu-test` sets `KVROUTE_REQUIRE_GPU=1`,
//!   which turns a missing GPU into a failure); otherwise each prints `SKIPPED` and why.
//!
//! `cargo test -p kvroute-kernels --test cuda -- FILTER` runs the tests whose names contain
//! FILTER.
//!
//! Tolerances: the GPU partials run on the tensor cores (decode.cu): scores and the weighted
//! sum accumulate in f32, and the softmax weights are rounded to bf16 for the second product,
//! which moves o by at most 2^-9 of the largest |v| (`assert_close_tc`: 8e-3 over N(0, 1)
//! rows, whose largest |v| is under 4.5; measured up to 5.04e-3 on an H200, 2e-3 in the CPU
//! emulation of the same kernel); m and l are f32, so lse
//! keeps the CPU's bounds (tests/against_reference.rs). The merge runs the same f64 combine as
//! the CPU (1e-6 abs); the splice rotates in f64 from the same host-computed angles with one
//! rounding, so it must be bit-identical to the CPU.

// Tests panic on failure: that is how a test reports it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::process::ExitCode;
use std::time::Instant;

use common::{BatchData, Rng, SCALE, batch_cases, max_abs};
use kvroute_kernels::cuda::{Gpu, nvrtc};
use kvroute_kernels::layout::{D_QK, PAGE_TOKENS};
use kvroute_kernels::{
    Backend, Cache, DecodeRequest, KernelError, KvPool, Partial, Queries, Rope, RopeLayout,
    Selection, SpliceJob, WireOut, Yarn, merge, merge_with, partial_batched, partial_dense,
    partial_dense_wire, partial_resident, partial_resident_wire, partial_sparse,
    partial_sparse_wire, splice,
};

/// What a test needs before it can run.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Needs {
    Nvrtc,
    Gpu,
}

const TESTS: &[(&str, Needs, fn())] = &[
    (
        "nvrtc_compiles_every_kernel_for_sm_90",
        Needs::Nvrtc,
        compiles_for_sm_90,
    ),
    (
        "gpu_dense_matches_the_reference",
        Needs::Gpu,
        dense_matches_the_reference,
    ),
    (
        "gpu_paged_equals_contiguous",
        Needs::Gpu,
        paged_equals_contiguous,
    ),
    (
        "gpu_sparse_matches_the_reference",
        Needs::Gpu,
        sparse_matches_the_reference,
    ),
    (
        "gpu_empty_inputs_give_the_empty_partial",
        Needs::Gpu,
        empty_partials,
    ),
    (
        "gpu_merge_matches_the_cpu_merge",
        Needs::Gpu,
        merge_matches_the_cpu,
    ),
    (
        "gpu_splice_is_bit_identical_to_the_cpu",
        Needs::Gpu,
        splice_is_bit_identical,
    ),
    (
        "gpu_bad_input_is_a_typed_error",
        Needs::Gpu,
        bad_input_is_typed,
    ),
    (
        "gpu_non_finite_input_is_refused_naming_the_row",
        Needs::Gpu,
        non_finite_is_refused,
    ),
    (
        "gpu_resident_rows_answer_as_the_same_cache_uploaded_per_call",
        Needs::Gpu,
        resident_rows_answer_as_uploaded,
    ),
    (
        "gpu_resident_ranges_and_selections_are_checked",
        Needs::Gpu,
        resident_ranges_are_checked,
    ),
    (
        "gpu_batches_match_the_reference_bf16_and_fp8",
        Needs::Gpu,
        batches_match_the_reference,
    ),
    (
        "gpu_a_batch_is_one_launch",
        Needs::Gpu,
        a_batch_is_one_launch,
    ),
    (
        "gpu_sanitizer_every_decode_variant_small",
        Needs::Gpu,
        every_decode_variant_small,
    ),
];

/// o within 8e-3 (bf16 softmax weights; see the module's doc), lse as on the CPU.
fn assert_close_tc(got: &Partial, want: &Partial, what: &str) {
    common::assert_close_within(got, want, 8e-3, what);
}

fn flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0")
}

fn main() -> ExitCode {
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let (require_nvrtc, require_gpu) = (flag("KVROUTE_REQUIRE_NVRTC"), flag("KVROUTE_REQUIRE_GPU"));
    let nvrtc_missing = (!nvrtc::nvrtc_present()).then(|| {
        "libnvrtc.so.13 is not on LD_LIBRARY_PATH (`cargo xtask test` puts target/nvrtc there)"
            .to_owned()
    });
    let gpu_missing = Gpu::global().err().map(|e| e.to_string());
    let (mut passed, mut failed, mut skipped) = (0, 0, 0);
    for &(name, needs, test) in TESTS {
        if filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
            continue;
        }
        let (missing, required) = match needs {
            Needs::Nvrtc => (&nvrtc_missing, require_nvrtc),
            Needs::Gpu => (&gpu_missing, require_gpu),
        };
        if let Some(why) = missing {
            if required {
                println!("test {name} ... FAILED (required and unavailable: {why})");
                failed += 1;
            } else {
                println!("test {name} ... SKIPPED: {why}");
                kvroute_testkit::record(&format!("kvroute-kernels: cuda::{name}"), why);
                skipped += 1;
            }
            continue;
        }
        let started = Instant::now();
        match catch_unwind(AssertUnwindSafe(test)) {
            Ok(()) => {
                println!(
                    "test {name} ... ok ({:.1} s)",
                    started.elapsed().as_secs_f64()
                );
                passed += 1;
            }
            Err(_) => {
                println!("test {name} ... FAILED");
                failed += 1;
            }
        }
    }
    println!("\ncuda tests: {passed} passed; {failed} failed; {skipped} SKIPPED");
    if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn compiles_for_sm_90() {
    let compiled = nvrtc::compile("sm_90").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(&compiled.cubin[..4], b"\x7fELF", "a cubin is an ELF image");
    println!(
        "  NVRTC {:?}, {} B cubin for sm_90",
        nvrtc::nvrtc_version().unwrap(),
        compiled.cubin.len()
    );
    println!(
        "  {:<12} {:>9} {:>11} {:>7} {:>13}",
        "kernel", "registers", "smem bytes", "stack", "spill st/ld"
    );
    for r in &compiled.resources {
        println!(
            "  {:<12} {:>9} {:>11} {:>7} {:>7}/{:<5}",
            r.name, r.registers, r.shared_bytes, r.stack_bytes, r.spill_stores, r.spill_loads
        );
    }
    // Static shared memory is capped at 48 KiB per block without an opt-in.
    let fits = |registers: u32, shared: u32| (1..=255).contains(&registers) && shared <= 48 * 1024;
    if compiled.log.trim().is_empty() {
        // NVRTC gave no report at all (a toolkit's NVRTC on an H200 machine did so for every
        // compile after the machine's first): the driver's figures for the loaded kernels
        // stand in, where there is a GPU.
        let gpu = Gpu::global().unwrap_or_else(|e| {
            panic!("NVRTC gave an empty log and there is no GPU to ask instead: {e}")
        });
        println!("  (NVRTC's log is empty; the driver's figures for the loaded kernels:)");
        for name in nvrtc::KERNELS {
            let k = gpu.info().loaded.iter().find(|k| k.name == name).unwrap();
            println!(
                "  {:<12} {:>9} {:>11} {:>7} local",
                k.name, k.registers, k.shared_bytes, k.local_bytes
            );
            assert!(fits(k.registers, k.shared_bytes), "{name}: {k:?}");
        }
        return;
    }
    for name in nvrtc::KERNELS {
        let r = compiled
            .resources
            .iter()
            .find(|r| r.name == name)
            .unwrap_or_else(|| panic!("no ptxas report for {name}:\n{}", compiled.log));
        assert!(fits(r.registers, r.shared_bytes), "{name}: {r:?}");
    }
}

fn dense_matches_the_reference() {
    let mut rng = Rng::new(7);
    let mut shapes = common::dense_shapes(&mut rng);
    shapes.push((256, 2048)); // the decode point
    for (mq, ct) in shapes {
        let (q, c) = (rng.rows(mq), rng.rows(ct));
        let (q, cache) = (Queries::new(&q).unwrap(), Cache::contiguous(&c).unwrap());
        let want = partial_dense(Backend::Reference, &q, &cache, SCALE).unwrap();
        let got = partial_dense(Backend::Cuda, &q, &cache, SCALE).unwrap();
        assert_close_tc(&got, &want, &format!("cuda dense mq={mq} ct={ct}"));
    }
}

fn paged_equals_contiguous() {
    let mut rng = Rng::new(3);
    let (mq, ct) = (24, 5 * PAGE_TOKENS + 17);
    let (q, c) = (rng.rows(mq), rng.rows(ct));
    let pages = ct.div_ceil(PAGE_TOKENS);
    // Pages in reverse order in a pool with two spare pages.
    let table: Vec<u32> = (0..pages as u32).map(|p| pages as u32 + 1 - p).collect();
    let mut pool = vec![0u16; (pages + 2) * PAGE_TOKENS * D_QK];
    for t in 0..ct {
        let at = (table[t / PAGE_TOKENS] as usize * PAGE_TOKENS + t % PAGE_TOKENS) * D_QK;
        pool[at..at + D_QK].copy_from_slice(&c[t * D_QK..(t + 1) * D_QK]);
    }
    let q = Queries::new(&q).unwrap();
    let want = partial_dense(Backend::Cuda, &q, &Cache::contiguous(&c).unwrap(), SCALE).unwrap();
    let got = partial_dense(
        Backend::Cuda,
        &q,
        &Cache::paged(&pool, &table, ct).unwrap(),
        SCALE,
    )
    .unwrap();
    assert!(
        max_abs(&got.o, &want.o) <= 1e-6,
        "the same rows in another order of pages"
    );
}

fn sparse_matches_the_reference() {
    let mut rng = Rng::new(11);
    for (tokens, h, k, ct) in [
        (1, 16, 2048, 8192),
        (2, 128, 512, 4096),
        (3, 16, 1, 10),
        (4, 16, 700, 1000),
    ] {
        let (q, c) = (rng.rows(tokens * h), rng.rows(ct));
        let idx = rng.selection(tokens, k, ct);
        let q = Queries::new(&q).unwrap();
        let cache = Cache::contiguous(&c).unwrap();
        let sel = Selection::new(&idx, k, h, q.len(), ct).unwrap();
        let want = partial_sparse(Backend::Reference, &q, &cache, &sel, SCALE).unwrap();
        let got = partial_sparse(Backend::Cuda, &q, &cache, &sel, SCALE).unwrap();
        assert_close_tc(
            &got,
            &want,
            &format!("cuda sparse t={tokens} h={h} k={k} ct={ct}"),
        );
    }
}

fn empty_partials() {
    let mut rng = Rng::new(5);
    let (q, c) = (rng.rows(32), rng.rows(10));
    let q = Queries::new(&q).unwrap();
    let idx = vec![-1i32; 2 * 8];
    let sel = Selection::new(&idx, 8, 16, 32, 10).unwrap();
    let cache = Cache::contiguous(&c).unwrap();
    assert_eq!(
        partial_sparse(Backend::Cuda, &q, &cache, &sel, SCALE).unwrap(),
        Partial::empty(32)
    );
    let none = Cache::contiguous(&[]).unwrap();
    assert_eq!(
        partial_dense(Backend::Cuda, &q, &none, SCALE).unwrap(),
        Partial::empty(32)
    );
}

fn merge_matches_the_cpu() {
    let mut rng = Rng::new(13);
    let (mq, ct) = (64, 8 * 300);
    let (q, c) = (rng.rows(mq), rng.rows(ct));
    let q = Queries::new(&q).unwrap();
    let mut parts: Vec<Partial> = (0..8)
        .map(|i| {
            let chunk = Cache::contiguous(&c[i * 300 * D_QK..(i + 1) * 300 * D_QK]).unwrap();
            partial_dense(Backend::Cpu, &q, &chunk, SCALE).unwrap()
        })
        .collect();
    parts.push(Partial::empty(mq)); // an empty holder is the identity
    merges_as_the_cpu_does(&parts, "8 + 1 empty");
    // More parts than the combine weighs at once (512): two full chunks and a tail shorter
    // than one group's eight loads, with empty parts scattered through them.
    let (mq, ct) = (8, 4);
    let q = rng.rows(mq);
    let q = Queries::new(&q).unwrap();
    let parts: Vec<Partial> = (0..1031)
        .map(|i| {
            if i % 7 == 3 {
                return Partial::empty(mq);
            }
            let c = rng.rows(ct);
            partial_dense(Backend::Cpu, &q, &Cache::contiguous(&c).unwrap(), SCALE).unwrap()
        })
        .collect();
    merges_as_the_cpu_does(&parts, "1031 parts, 147 empty");
}

/// The GPU merge of `parts` against the CPU's: o within 1e-6, the same m, l within 1e-6
/// relative.
fn merges_as_the_cpu_does(parts: &[Partial], what: &str) {
    let refs: Vec<&Partial> = parts.iter().collect();
    let want = merge(&refs).unwrap();
    let got = merge_with(Backend::Cuda, &refs).unwrap();
    let err = max_abs(&got.o, &want.o);
    println!("  merge of {what}: o max abs difference {err:.2e}");
    assert!(err <= 1e-6);
    for r in 0..want.m.len() {
        assert_eq!(got.m[r], want.m[r]);
        assert!((got.l[r] - want.l[r]).abs() <= 1e-6 * want.l[r]);
    }
}

fn splice_is_bit_identical() {
    let mut rng = Rng::new(17);
    let (layers, n) = (3, 2 * PAGE_TOKENS + 5);
    let src = rng.rows(layers * n);
    let from: Vec<i64> = (0..n).map(|_| rng.range(0, 160_000) as i64).collect();
    let to: Vec<i64> = (0..n).map(|_| rng.range(0, 160_000) as i64).collect();
    let pages = layers * n.div_ceil(PAGE_TOKENS);
    let table: Vec<u32> = (0..pages as u32).rev().collect();
    for layout in [RopeLayout::Interleaved, RopeLayout::Half] {
        for rope in [
            Rope::plain(10_000.0, layout).unwrap(),
            Rope::yarn(10_000.0, Yarn::DEEPSEEK, layout).unwrap(),
        ] {
            let run = |backend| {
                let mut pool = vec![0xdeadu16; (pages + 1) * PAGE_TOKENS * D_QK];
                let job =
                    SpliceJob::new(&src, layers, &from, &to, rope, &mut pool, &table).unwrap();
                splice(backend, job).unwrap();
                pool
            };
            assert!(
                run(Backend::Cuda) == run(Backend::Cpu),
                "{layout:?} {rope:?}"
            );
            // In place: the rows already in the pool (src == null in the kernel).
            let in_place = |backend| {
                let mut pool = run(Backend::Reference);
                let job = SpliceJob::in_place(layers, &to, &from, rope, &mut pool, &table).unwrap();
                splice(backend, job).unwrap();
                pool
            };
            assert!(
                in_place(Backend::Cuda) == in_place(Backend::Cpu),
                "in place {layout:?} {rope:?}"
            );
        }
    }
}

fn bad_input_is_typed() {
    let mut rng = Rng::new(19);
    let (q, c) = (rng.rows(4), rng.rows(8));
    let q = Queries::new(&q).unwrap();
    let cache = Cache::contiguous(&c).unwrap();
    assert!(matches!(
        partial_dense(Backend::Cuda, &q, &cache, f32::NAN),
        Err(KernelError::Parameter { .. })
    ));
    let idx = vec![0i32; 4];
    let other = Selection::new(&idx, 4, 1, 1, 8).unwrap(); // built for 1 query row, not 4
    assert!(matches!(
        partial_sparse(Backend::Cuda, &q, &cache, &other, SCALE),
        Err(KernelError::Shape { .. })
    ));
    assert!(matches!(
        merge_with(Backend::Cuda, &[]),
        Err(KernelError::Empty(_))
    ));
}

/// A NaN or infinity in a cache or query row poisons the splits that see it, and the combine
/// turns them into a non-finite row, which is refused naming the first such row, as on the
/// CPU (tests/non_finite.rs): never dropped as an empty split.
fn non_finite_is_refused() {
    const NAN: u16 = 0x7fc0;
    const INF: u16 = 0x7f80;
    let mut rng = Rng::new(23);
    let (mq, ct) = (6, 1500); // several splits of the keys
    let q = rng.rows(mq);
    let idx: Vec<i32> = (0..mq).flat_map(|_| 0..ct as i32).collect();
    let refused = |q: &[u16], c: &[u16], row: usize, case: &str| {
        let (q, cache) = (Queries::new(q).unwrap(), Cache::contiguous(c).unwrap());
        let sel = Selection::new(&idx, ct, 1, mq, ct).unwrap();
        for (entry, got) in [
            (
                "dense",
                partial_dense(Backend::Cuda, &q, &cache, SCALE).map(drop),
            ),
            (
                "sparse",
                partial_sparse(Backend::Cuda, &q, &cache, &sel, SCALE).map(drop),
            ),
        ] {
            assert!(
                matches!(got, Err(KernelError::NonFinite { row: r, .. }) if r == row),
                "{case}: {entry} gave {got:?}, not NonFinite at row {row}"
            );
        }
    };
    for (value, at) in [(NAN, 700usize), (INF, 3), (INF | 0x8000, 1499)] {
        let mut c = rng.rows(ct);
        c[at * D_QK + 17] = value;
        refused(&q, &c, 0, &format!("cache row {at} = {value:#06x}"));
    }
    let c = rng.rows(ct);
    for (value, row) in [(NAN, 3usize), (INF, 5)] {
        let mut bad = q.clone();
        bad[row * D_QK + 100] = value;
        refused(&bad, &c, row, &format!("query row {row} = {value:#06x}"));
    }
    println!("  NaN and infinities in cache and query rows: refused at the first bad row");
}

/// Three layers of 1000 tokens, each padded to 1024 rows as a full block lays them out,
/// uploaded once: every layer's range attended on the GPU gives what the same rows uploaded
/// with each call give (the same kernels and plan, so bit for bit), dense and sparse, and
/// within the f32 bounds of the reference; the wire rows encoded on the GPU are the bytes the
/// CPU encodes from the f32 partial.
fn resident_rows_answer_as_uploaded() {
    let gpu = Gpu::global().unwrap();
    let mut rng = Rng::new(29);
    let (layers, tokens, padded) = (3, 1000, 1024);
    let rows = rng.rows(layers * padded);
    let resident = gpu.upload_rows(&rows).unwrap();
    assert_eq!(resident.tokens(), layers * padded);
    assert_eq!(resident.bytes(), rows.len() * 2);
    for (layer, mq) in [(0, 1), (1, 16), (2, 256)] {
        let start = layer * padded;
        let range = start..start + tokens;
        let layer_rows = &rows[start * D_QK..(start + tokens) * D_QK];
        let cache = Cache::contiguous(layer_rows).unwrap();
        let qr = rng.rows(mq);
        let q = Queries::new(&qr).unwrap();
        let got = partial_resident(gpu, &resident, range.clone(), &q, None, SCALE).unwrap();
        let host = partial_dense(Backend::Cuda, &q, &cache, SCALE).unwrap();
        assert_eq!(got, host, "dense, layer {layer}, mq {mq}");
        let want = partial_dense(Backend::Reference, &q, &cache, SCALE).unwrap();
        assert_close_tc(
            &got,
            &want,
            &format!("resident dense layer {layer} mq {mq}"),
        );

        let wire = wire_rows(mq, |out| {
            partial_resident_wire(gpu, &resident, range.clone(), &q, None, SCALE, out)
        });
        let host_wire = wire_rows(mq, |out| {
            partial_dense_wire(Backend::Cuda, &q, &cache, SCALE, out)
        });
        assert!(wire == host_wire, "wire rows, layer {layer}, mq {mq}");

        let (per_token, k) = (16, 300);
        let sq = rng.rows(2 * per_token);
        let sq = Queries::new(&sq).unwrap();
        let idx = rng.selection(2, k, tokens);
        let sel = Selection::new(&idx, k, per_token, sq.len(), tokens).unwrap();
        let got = partial_resident(gpu, &resident, range.clone(), &sq, Some(&sel), SCALE).unwrap();
        let host = partial_sparse(Backend::Cuda, &sq, &cache, &sel, SCALE).unwrap();
        assert_eq!(got, host, "sparse, layer {layer}");
        let wire = wire_rows(sq.len(), |out| {
            partial_resident_wire(gpu, &resident, range.clone(), &sq, Some(&sel), SCALE, out)
        });
        let host_wire = wire_rows(sq.len(), |out| {
            partial_sparse_wire(Backend::Cuda, &sq, &cache, &sel, SCALE, out)
        });
        assert!(wire == host_wire, "sparse wire rows, layer {layer}");
        let want = partial_sparse(Backend::Reference, &sq, &cache, &sel, SCALE).unwrap();
        assert_close_tc(&got, &want, &format!("resident sparse layer {layer}"));
    }
    println!("  3 layers x 1000 tokens resident: equal to per-call uploads, dense and sparse");
}

/// The wire rows of `rows` query rows that `write` puts into a [`WireOut`] over them.
fn wire_rows(
    rows: usize,
    write: impl FnOnce(&mut WireOut<'_>) -> Result<(), KernelError>,
) -> Vec<u8> {
    let mut bytes = vec![0u8; rows * kvroute_kernels::layout::PARTIAL_ROW_BYTES];
    write(&mut WireOut::new([&mut bytes[..]]).unwrap()).unwrap();
    bytes
}

/// A range past the uploaded rows, a reversed range and a selection indexing past the range
/// are typed errors; an empty range gives the empty partial; a NaN in the resident rows is
/// refused naming the first row it reaches.
fn resident_ranges_are_checked() {
    let gpu = Gpu::global().unwrap();
    let mut rng = Rng::new(31);
    let mut rows = rng.rows(300);
    let resident = gpu.upload_rows(&rows).unwrap();
    let qr = rng.rows(4);
    let q = Queries::new(&qr).unwrap();
    #[allow(clippy::reversed_empty_ranges)]
    for range in [0..301, 299..301, 200..100] {
        let got = partial_resident(gpu, &resident, range.clone(), &q, None, SCALE);
        assert!(
            matches!(got, Err(KernelError::Parameter { .. })),
            "{range:?} gave {got:?}"
        );
    }
    assert_eq!(
        partial_resident(gpu, &resident, 100..100, &q, None, SCALE).unwrap(),
        Partial::empty(4)
    );
    // Index 150 is inside the upload but past a 100-token range (one query token of 4 rows,
    // k = 1).
    let idx = vec![150i32];
    assert!(Selection::new(&idx, 1, 4, 4, 100).is_err());
    let sel = Selection::new(&idx, 1, 4, 4, 300).unwrap();
    let got = partial_resident(gpu, &resident, 0..100, &q, Some(&sel), SCALE);
    assert!(
        matches!(got, Err(KernelError::IndexOutOfRange { .. })),
        "{got:?}"
    );
    assert!(matches!(
        gpu.upload_rows(&rows[..D_QK + 1]),
        Err(KernelError::Shape { .. })
    ));
    let mut wire = vec![0xffu8; 4 * kvroute_kernels::layout::PARTIAL_ROW_BYTES];
    let mut want = wire.clone();
    let wire_of = |range: std::ops::Range<usize>, rows, out: &mut [u8]| {
        let mut out = WireOut::new([out]).unwrap();
        partial_resident_wire(gpu, rows, range, &q, None, SCALE, &mut out)
    };
    wire_of(100..100, &resident, &mut wire).unwrap();
    let none = Cache::contiguous(&[]).unwrap();
    let mut empty = WireOut::new([&mut want[..]]).unwrap();
    partial_dense_wire(Backend::Cpu, &q, &none, SCALE, &mut empty).unwrap();
    assert!(
        wire == want,
        "an empty range's wire rows are the empty partial's"
    );
    rows[120 * D_QK + 5] = 0x7fc0;
    let poisoned = gpu.upload_rows(&rows).unwrap();
    let got = partial_resident(gpu, &poisoned, 100..200, &q, None, SCALE);
    assert!(
        matches!(got, Err(KernelError::NonFinite { row: 0, .. })),
        "{got:?}"
    );
    let got = wire_of(100..200, &poisoned, &mut wire);
    assert!(
        matches!(got, Err(KernelError::NonFinite { row: 0, .. })),
        "wire rows: {got:?}"
    );
    assert!(partial_resident(gpu, &poisoned, 0..100, &q, None, SCALE).is_ok());
    assert!(wire_of(0..100, &poisoned, &mut wire).is_ok());
}

/// Every batch case (tests/common: varlen, empty, one token, lengths off the block, blocks of
/// 1 to 100, every row-group size), bf16 and FP8, host to host against the f64 reference; over
/// a pool kept on the GPU, the same bits; its wire rows, the bytes the CPU encodes from them.
fn batches_match_the_reference() {
    let gpu = Gpu::global().unwrap();
    let mut rng = Rng::new(61);
    let (mut cases, mut worst) = (0, 0f32);
    for case in batch_cases() {
        let data = BatchData::new(&mut rng, &case);
        let requests = data.requests();
        for fp8 in [false, true] {
            let pool = data.pool(fp8);
            let what = format!("{} fp8={fp8}", case.name);
            let want = partial_batched(Backend::Reference, &pool, &requests, SCALE).unwrap();
            let got = partial_batched(Backend::Cuda, &pool, &requests, SCALE).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_close_tc(g, w, &format!("{what} request {i}"));
                worst = worst.max(max_abs(&g.o, &w.o));
            }
            let dev = gpu.upload_pool(&pool).unwrap();
            let resident = gpu
                .partial_batched_resident(&dev, &requests, SCALE)
                .unwrap();
            assert_eq!(resident, got, "{what}: resident");
            let rows: usize = requests.iter().map(|r| r.queries().len()).sum();
            let mut wire = vec![0u8; rows * kvroute_kernels::layout::PARTIAL_ROW_BYTES];
            let mut out = WireOut::new([&mut wire[..]]).unwrap();
            gpu.partial_batched_resident_wire(&dev, &requests, SCALE, &mut out)
                .unwrap();
            let encoded: Vec<u8> = got.iter().flat_map(Partial::to_wire).collect();
            assert!(wire == encoded, "{what}: wire rows");
            cases += 1;
        }
    }
    println!("  {cases} batches (bf16 and FP8): o within {worst:.2e} of the f64 reference");
}

/// One batch is one launch of the decode kernel, split or not (the last block of a work item
/// combines its splits), however many requests it holds.
fn a_batch_is_one_launch() {
    let gpu = Gpu::global().unwrap();
    let mut rng = Rng::new(67);
    let pool = rng.rows(200 * 64);
    let kv = KvPool::bf16(&pool, 64).unwrap();
    let dev = gpu.upload_pool(&kv).unwrap();
    let q = rng.rows(16);
    let tables: Vec<Vec<u32>> = (0..200u32).map(|i| vec![i, (i + 1) % 200]).collect();
    let mut split = false;
    for n in [1usize, 8, 199] {
        // 1 and 8 requests split their keys (few work items for 132 SMs); 199 do not.
        let requests: Vec<DecodeRequest<'_>> = (0..n)
            .map(|i| DecodeRequest::dense(Queries::new(&q).unwrap(), &tables[i], 100))
            .collect();
        let prepared = gpu.prepare_batched(&dev, &requests, SCALE).unwrap();
        let (items, splits) = prepared.grid();
        let before = gpu.decode_launches();
        let got = gpu
            .partial_batched_resident(&dev, &requests, SCALE)
            .unwrap();
        let launches = gpu.decode_launches() - before;
        println!("  {n} requests: {items} work items x {splits} splits, {launches} launches");
        assert_eq!(got.len(), n);
        assert_eq!(launches, 1, "{n} requests");
        split |= splits > 1;
    }
    assert!(
        split,
        "no batch split its keys: the fused combine was not counted"
    );
}

/// Each decode kernel (1, 2 and 4 row tiles; bf16 and FP8), split and not, on a batch small
/// enough to run under compute-sanitizer's memcheck and racecheck in seconds
/// (`scripts/gpu-test.sh` runs this test under both), against the f64 reference.
fn every_decode_variant_small() {
    let gpu = Gpu::global().unwrap();
    let mut rng = Rng::new(71);
    for heads in [16, 32, 64] {
        let case = common::BatchCase {
            name: "small",
            block: 16,
            reqs: vec![
                common::dense(heads, 150),
                common::sparse(heads, 1, 90, 70),
                common::dense(heads, 0),
            ],
        };
        let data = BatchData::new(&mut rng, &case);
        let requests = data.requests();
        for fp8 in [false, true] {
            let pool = data.pool(fp8);
            let want = partial_batched(Backend::Reference, &pool, &requests, SCALE).unwrap();
            let dev = gpu.upload_pool(&pool).unwrap();
            // Unsplit: the resident call's planner on 132 SMs splits these; a prepared batch
            // plans the same, so both the split and (one request) unsplit paths run.
            let got = gpu
                .partial_batched_resident(&dev, &requests, SCALE)
                .unwrap();
            for (g, w) in got.iter().zip(&want) {
                assert_close_tc(g, w, &format!("{heads} heads fp8={fp8}"));
            }
            let one = gpu
                .partial_batched_resident(&dev, &requests[2..], SCALE)
                .unwrap();
            assert_eq!(one[0], Partial::empty(heads));
        }
    }
}
