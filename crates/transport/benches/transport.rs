//! The transfer engine on the `mem` domain, each operation next to a baseline measured in the
//! same run (see `kvroute_transport::bench` for what each baseline stands for):
//!
//! - `write_round_trip/engine` (submit a 64-byte write, wait for its completion) against
//!   `write_round_trip/channel_ping_pong` (a message to a spinning thread and back);
//! - `paged_writes/engine/<page>` against `paged_writes/memcpy/<page>` (pages per second);
//! - `scatter/engine/<peers>` (submit to completion, passive peers) against
//!   `scatter/enqueue_floor/<peers>` (building and queueing the same descriptors).
//!
//! `kvroute bench transport` reports the submit-to-post and posting-span percentiles the
//! engine records internally; these benches time whole operations from the outside.

// A bench whose setup fails should stop loudly, so `expect` is right here.
#![allow(clippy::expect_used)]

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_transport::{DoneFlag, MemFabric, OnDone, Pages, ScatterDst, TransferEngine};

fn spin(flag: &DoneFlag) {
    while !flag.is_done() {
        std::hint::spin_loop();
    }
}

fn write_round_trip(c: &mut Criterion) {
    let fabric = MemFabric::new();
    let (a, b) = (
        TransferEngine::mem(&fabric, 1).expect("engine"),
        TransferEngine::mem(&fabric, 1).expect("engine"),
    );
    let (src, dst) = (
        a.alloc_mr(64).expect("buffer"),
        b.alloc_mr(64).expect("buffer"),
    );
    let mut group = c.benchmark_group("write_round_trip");
    group.bench_function("engine", |bench| {
        bench.iter(|| {
            let flag = DoneFlag::new();
            a.submit_single_write(
                64,
                None,
                (src.handle(), 0),
                (dst.desc(), 0),
                OnDone::flag(&flag),
            )
            .expect("submit");
            spin(&flag);
        });
    });
    let (to, from) = (
        crossbeam_channel::bounded::<u64>(1),
        crossbeam_channel::bounded::<u64>(1),
    );
    // The echo thread spins, as the engine's worker does when busy: the baseline is the two
    // hand-offs, not futex wake-ups.
    let (rx, tx) = (to.1.clone(), from.0.clone());
    let echo = std::thread::spawn(move || {
        loop {
            match rx.try_recv() {
                Ok(v) => {
                    if tx.send(v).is_err() {
                        return;
                    }
                }
                Err(crossbeam_channel::TryRecvError::Empty) => std::hint::spin_loop(),
                Err(crossbeam_channel::TryRecvError::Disconnected) => return,
            }
        }
    });
    group.bench_function("channel_ping_pong", |bench| {
        bench.iter(|| {
            to.0.send(black_box(1)).expect("echo thread alive");
            loop {
                if let Ok(v) = from.1.try_recv() {
                    break v;
                }
                std::hint::spin_loop();
            }
        });
    });
    group.finish();
    drop(to);
    let _ = echo.join();
}

fn paged_writes(c: &mut Criterion) {
    let fabric = MemFabric::new();
    let (a, b) = (
        TransferEngine::mem(&fabric, 1).expect("engine"),
        TransferEngine::mem(&fabric, 1).expect("engine"),
    );
    let imm = AtomicU64::new(1 << 20);
    let mut group = c.benchmark_group("paged_writes");
    group.measurement_time(Duration::from_secs(3));
    for page in [1024usize, 4096, 16384, 65536] {
        let pages = ((16usize << 20) / page) as u32;
        let bytes = page * pages as usize;
        let (src, dst) = (
            a.alloc_mr(bytes).expect("buffer"),
            b.alloc_mr(bytes).expect("buffer"),
        );
        src.fill(3);
        let src_pages = Pages::new((0..pages).collect::<Vec<u32>>(), page as u64, 0);
        let dst_pages = Pages::new((0..pages).rev().collect::<Vec<u32>>(), page as u64, 0);
        group.throughput(Throughput::Elements(u64::from(pages)));
        group.bench_with_input(BenchmarkId::new("engine", page), &page, |bench, &page| {
            bench.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    let value = imm.fetch_add(1, Ordering::Relaxed) as u32;
                    let landed = DoneFlag::new();
                    b.expect_imm_count(value, u64::from(pages), OnDone::flag(&landed));
                    a.submit_paged_writes(
                        page as u64,
                        Some(value),
                        (src.handle(), &src_pages),
                        (dst.desc(), &dst_pages),
                        OnDone::nothing(),
                    )
                    .expect("submit");
                    while !landed.is_done() {
                        std::thread::yield_now();
                    }
                }
                start.elapsed()
            });
        });
        let from = vec![3u8; bytes];
        let mut to = vec![0u8; bytes];
        group.bench_with_input(BenchmarkId::new("memcpy", page), &page, |bench, &page| {
            bench.iter(|| {
                for (s, d) in src_pages.indices.iter().zip(dst_pages.indices.iter()) {
                    let (s, d) = (*s as usize * page, *d as usize * page);
                    to[d..d + page].copy_from_slice(&from[s..s + page]);
                }
                black_box(&mut to);
            });
        });
    }
    group.finish();
}

fn scatter(c: &mut Criterion) {
    let fabric = MemFabric::new();
    let sender = TransferEngine::mem(&fabric, 1).expect("engine");
    let mut group = c.benchmark_group("scatter");
    for peers in [8usize, 16, 32, 64] {
        let receivers: Vec<TransferEngine> = (0..peers)
            .map(|_| TransferEngine::mem(&fabric, 1).expect("engine"))
            .collect();
        let bufs: Vec<_> = receivers
            .iter()
            .map(|r| r.alloc_mr(256).expect("buffer"))
            .collect();
        let handle = sender
            .add_peer_group(
                &receivers
                    .iter()
                    .map(TransferEngine::main_address)
                    .collect::<Vec<_>>(),
            )
            .expect("group");
        let src = sender.alloc_mr(256 * peers).expect("buffer");
        let dsts: Vec<ScatterDst> = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| ScatterDst {
                len: 256,
                src_offset: i as u64 * 256,
                dst: b.desc().clone(),
                dst_offset: 0,
            })
            .collect();
        group.bench_with_input(BenchmarkId::new("engine", peers), &peers, |bench, _| {
            bench.iter(|| {
                let flag = DoneFlag::new();
                sender
                    .submit_scatter(Some(handle), None, src.handle(), &dsts, OnDone::flag(&flag))
                    .expect("submit");
                spin(&flag);
            });
        });
        let queue = Arc::new(std::sync::Mutex::new(
            std::collections::VecDeque::with_capacity(peers),
        ));
        group.bench_with_input(
            BenchmarkId::new("enqueue_floor", peers),
            &peers,
            |bench, _| {
                bench.iter(|| {
                    let mut q = queue.lock().expect("uncontended");
                    for d in &dsts {
                        q.push_back((
                            d.dst.addr + d.dst_offset,
                            d.dst.rkeys[0].rkey,
                            d.len,
                            d.src_offset,
                        ));
                    }
                    black_box(&mut *q);
                    q.clear();
                });
            },
        );
    }
    group.finish();
}

criterion_group!(benches, write_round_trip, paged_writes, scatter);
criterion_main!(benches);
