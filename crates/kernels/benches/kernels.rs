//! The kernels on this CPU, each beside a baseline measured in the same run:
//!
//! - `read/*`: the machine's read bandwidth (a parallel sum over 256 MiB, DRAM-bound) and the
//!   same sum over one ct = 2048 chunk (2.36 MB, cache-resident between iterations, as the
//!   partial's repeated calls are). The dense partial's GB/s compare to these.
//! - `dense/{cpu,reference}/<mq>` at ct = 2048: throughput in cache bytes read per call;
//!   `dense/cpu_<isa>/16` runs the same call on each instruction set this CPU has.
//! - `sparse/{cpu,reference}/<k>`: one query token of 16 heads, top-k of 8192.
//! - `merge/8x<rows>` against `merge/sum_floor`: adding the eight `o` arrays, no softmax.
//! - `splice/<layers>x<tokens>` (27 x 2048) against `splice/memcpy`: copying the same rows.

// A bench whose setup fails should stop loudly.
#![allow(clippy::expect_used)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_kernels::layout::{D_QK, PAGE_TOKENS};
use kvroute_kernels::{
    Backend, Cache, Isa, Partial, Queries, Rope, RopeLayout, Selection, SpliceJob, Yarn, bf16,
    merge, partial_dense, partial_sparse, splice,
};
use rayon::prelude::*;

const SCALE: f32 = 0.1147;

/// Deterministic bf16 rows ~ U(-2, 2).
fn rows(n: usize, seed: u64) -> Vec<u16> {
    let mut s = seed;
    (0..n * D_QK)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0)
        })
        .collect()
}

fn read(c: &mut Criterion) {
    let mut g = c.benchmark_group("read");
    g.measurement_time(Duration::from_secs(2)).sample_size(20);
    for (name, bytes) in [
        ("dram_256MiB", 256usize << 20),
        ("chunk_2048", 2048 * D_QK * 2),
    ] {
        let buf: Vec<u64> = (0..bytes / 8).map(|i| i as u64).collect();
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function(name, |b| {
            b.iter(|| {
                buf.par_chunks(1 << 14)
                    .map(|c| c.iter().fold(0u64, |a, &x| a.wrapping_add(x)))
                    .reduce(|| 0, u64::wrapping_add)
            });
        });
    }
}

fn dense(c: &mut Criterion) {
    let ct = 2048;
    let cache_rows = rows(ct, 1);
    let cache = Cache::contiguous(&cache_rows).expect("cache");
    let mut g = c.benchmark_group("dense");
    g.measurement_time(Duration::from_secs(2)).sample_size(20);
    g.throughput(Throughput::Bytes((ct * D_QK * 2) as u64));
    for mq in [1usize, 16, 64, 256] {
        let q_rows = rows(mq, 2);
        let q = Queries::new(&q_rows).expect("queries");
        g.bench_function(BenchmarkId::new("cpu", mq), |b| {
            b.iter(|| black_box(partial_dense(Backend::Cpu, &q, &cache, SCALE).expect("partial")));
        });
        if mq == 16 {
            // The same call on each instruction set: what the SIMD buys.
            for isa in Isa::available() {
                g.bench_function(BenchmarkId::new(format!("cpu_{isa}"), mq), |b| {
                    b.iter(|| {
                        black_box(
                            partial_dense(Backend::CpuWith(isa), &q, &cache, SCALE)
                                .expect("partial"),
                        )
                    });
                });
            }
        }
        if mq <= 16 {
            g.bench_function(BenchmarkId::new("reference", mq), |b| {
                b.iter(|| {
                    black_box(
                        partial_dense(Backend::Reference, &q, &cache, SCALE).expect("partial"),
                    )
                });
            });
        }
    }
}

fn sparse(c: &mut Criterion) {
    let (ct, h) = (8192, 16);
    let cache_rows = rows(ct, 3);
    let cache = Cache::contiguous(&cache_rows).expect("cache");
    let q_rows = rows(h, 4);
    let q = Queries::new(&q_rows).expect("queries");
    let mut g = c.benchmark_group("sparse");
    g.measurement_time(Duration::from_secs(2)).sample_size(20);
    for k in [512usize, 2048] {
        let idx: Vec<i32> = (0..k).map(|i| ((i * 7919) % ct) as i32).collect();
        let sel = Selection::new(&idx, k, h, h, ct).expect("selection");
        g.throughput(Throughput::Bytes((k * D_QK * 2) as u64));
        for (name, backend) in [("cpu", Backend::Cpu), ("reference", Backend::Reference)] {
            g.bench_function(BenchmarkId::new(name, k), |b| {
                b.iter(|| {
                    black_box(partial_sparse(backend, &q, &cache, &sel, SCALE).expect("partial"))
                });
            });
        }
    }
}

fn merging(c: &mut Criterion) {
    let (mq, ct) = (256, 256);
    let cache_rows = rows(ct * 8, 5);
    let q_rows = rows(mq, 6);
    let q = Queries::new(&q_rows).expect("queries");
    let parts: Vec<Partial> = (0..8)
        .map(|i| {
            let cache =
                Cache::contiguous(&cache_rows[i * ct * D_QK..(i + 1) * ct * D_QK]).expect("cache");
            partial_dense(Backend::Cpu, &q, &cache, SCALE).expect("partial")
        })
        .collect();
    let refs: Vec<&Partial> = parts.iter().collect();
    let mut g = c.benchmark_group("merge");
    g.measurement_time(Duration::from_secs(2)).sample_size(20);
    g.bench_function(format!("8x{mq}"), |b| {
        b.iter(|| black_box(merge(&refs).expect("merge")))
    });
    g.bench_function("sum_floor", |b| {
        b.iter(|| {
            let mut out = vec![0f32; parts[0].o.len()];
            for p in &parts {
                for (o, x) in out.iter_mut().zip(&p.o) {
                    *o += x;
                }
            }
            black_box(out)
        });
    });
}

fn splicing(c: &mut Criterion) {
    let (layers, n) = (27, 2048);
    let src = rows(layers * n, 7);
    let from: Vec<i64> = (0..n as i64).map(|i| i * 3).collect();
    let to: Vec<i64> = (0..n as i64).map(|i| 100_000 + i).collect();
    let rope = Rope::yarn(10_000.0, Yarn::DEEPSEEK, RopeLayout::Interleaved).expect("rope");
    let pages = layers * n.div_ceil(PAGE_TOKENS);
    let table: Vec<u32> = (0..pages as u32).rev().collect();
    let mut pool = vec![0u16; pages * PAGE_TOKENS * D_QK];
    let mut g = c.benchmark_group("splice");
    g.measurement_time(Duration::from_secs(3)).sample_size(10);
    g.throughput(Throughput::Bytes((src.len() * 2) as u64));
    g.bench_function(format!("cpu/{layers}x{n}"), |b| {
        b.iter(|| {
            let job =
                SpliceJob::new(&src, layers, &from, &to, rope, &mut pool, &table).expect("job");
            splice(Backend::Cpu, job).expect("splice");
        });
    });
    g.bench_function("memcpy", |b| {
        b.iter(|| {
            pool.par_chunks_mut(PAGE_TOKENS * D_QK)
                .zip(src.par_chunks(PAGE_TOKENS * D_QK))
                .for_each(|(d, s)| d[..s.len()].copy_from_slice(s));
        });
    });
}

criterion_group!(benches, read, dense, sparse, merging, splicing);
criterion_main!(benches);
