//! The kernels on this CPU, each beside a baseline measured in the same run:
//!
//! - `read/*`: the machine's read bandwidth (a parallel sum over 256 MiB, DRAM-bound) and the
//!   same sum over one ct = 2048 chunk (2.36 MB, cache-resident between iterations, as the
//!   partial's repeated calls are). The dense partial's GB/s compare to these.
//! - `dense/{cpu,reference}/<mq>` at ct = 2048: throughput in cache bytes read per call;
//!   `dense/cpu_<isa>/16` runs the same call on each instruction set this CPU has.
//! - `sparse/{cpu,reference}/<k>`: one query token of 16 heads, top-k of 8192.
//! - `merge/8x<rows>` against `merge/sum_floor`: adding the eight `o` arrays, no softmax.
//! - `splice/cpu/<layers>x<tokens>` (27 x 2048, copying) against `splice/memcpy`: copying the
//!   same rows; `splice/in_place/<layers>x<tokens>` (fetch's case: the rows already in the
//!   pool) against `splice/touch_bands`: reading and writing the same RoPE bands.

// A bench whose setup fails should stop loudly.
#![allow(clippy::expect_used)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_kernels::layout::D_QK;
use kvroute_kernels::workload::{self as w, SCALE, rows};
use kvroute_kernels::{
    Backend, Cache, Isa, Queries, Selection, merge, partial_dense, partial_sparse, splice,
};

fn read(c: &mut Criterion) {
    let mut g = c.benchmark_group("read");
    g.measurement_time(Duration::from_secs(2)).sample_size(20);
    for (name, bytes) in [
        ("dram_256MiB", 256usize << 20),
        ("chunk_2048", w::DENSE_CT * D_QK * 2),
    ] {
        let buf: Vec<u64> = (0..bytes / 8).map(|i| i as u64).collect();
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function(name, |b| b.iter(|| w::read_sum(&buf)));
    }
}

fn dense(c: &mut Criterion) {
    let ct = w::DENSE_CT;
    let cache_rows = rows(ct, 1);
    let cache = Cache::contiguous(&cache_rows).expect("cache");
    let mut g = c.benchmark_group("dense");
    g.measurement_time(Duration::from_secs(2)).sample_size(20);
    g.throughput(Throughput::Bytes((ct * D_QK * 2) as u64));
    for mq in w::DENSE_MQ {
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
    let (ct, h) = (w::SPARSE_CT, w::SPARSE_HEADS);
    let cache_rows = rows(ct, 3);
    let cache = Cache::contiguous(&cache_rows).expect("cache");
    let q_rows = rows(h, 4);
    let q = Queries::new(&q_rows).expect("queries");
    let mut g = c.benchmark_group("sparse");
    g.measurement_time(Duration::from_secs(2)).sample_size(20);
    for k in w::SPARSE_K {
        let idx = w::sparse_indices(k, ct);
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
    let parts = w::merge_parts().expect("partials");
    let refs: Vec<_> = parts.iter().collect();
    let mut g = c.benchmark_group("merge");
    g.measurement_time(Duration::from_secs(2)).sample_size(20);
    g.bench_function(format!("{}x{}", w::MERGE_PARTS, w::MERGE_ROWS), |b| {
        b.iter(|| black_box(merge(&refs).expect("merge")))
    });
    g.bench_function("sum_floor", |b| b.iter(|| black_box(w::sum_floor(&parts))));
}

fn splicing(c: &mut Criterion) {
    let mut work = w::SpliceWorkload::new().expect("workload");
    let mut g = c.benchmark_group("splice");
    g.measurement_time(Duration::from_secs(3)).sample_size(10);
    g.throughput(Throughput::Bytes(work.bytes() as u64));
    g.bench_function(
        format!("cpu/{}x{}", w::SPLICE_LAYERS, w::SPLICE_TOKENS),
        |b| {
            b.iter(|| splice(Backend::Cpu, work.job().expect("job")).expect("splice"));
        },
    );
    g.bench_function("memcpy", |b| b.iter(|| work.copy_rows()));
    g.bench_function(
        format!("in_place/{}x{}", w::SPLICE_LAYERS, w::SPLICE_TOKENS),
        |b| {
            b.iter(|| splice(Backend::Cpu, work.in_place_job().expect("job")).expect("splice"));
        },
    );
    g.bench_function("touch_bands", |b| b.iter(|| work.touch_bands()));
}

criterion_group!(benches, read, dense, sparse, merging, splicing);
criterion_main!(benches);
