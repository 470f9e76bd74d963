//! The engine under a misbehaving fabric: reordered and delayed deliveries, a peer that
//! vanishes mid-transfer, and cancellation.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::throttle::{Controls, Throttled};
use common::{block_on, chaos_engine, engine, pattern, wait_for};
use kvroute_transport::{
    CancellationToken, Device, DoneCounter, DoneFlag, EngineConfig, FaultPlan, MemFabric, OnDone,
    Pages, TransferEngine, TransferError, TransferShape,
};

/// Paper 002 appendix A's decoder pattern at scale: 10,000 pages over two NICs, every
/// delivery delayed up to 300 us and reordered, plus a tail single write, all counted by one
/// expectation computed with `expected_arrivals`. Everything lands byte-exact; the expectation
/// fires exactly once; nothing is left counted or in flight.
#[test]
fn ten_thousand_reordered_and_delayed_paged_writes_land_byte_exact() {
    let fabric = MemFabric::new();
    let prefiller = chaos_engine(&fabric, 2, 0xC0FFEE);
    let decoder = engine(&fabric, 2);
    let (pages, page_len) = (10_000u32, 64usize);
    let kv = prefiller.alloc_mr(pages as usize * page_len).unwrap();
    let pool = decoder.alloc_mr(pages as usize * page_len * 2).unwrap();
    let tail_src = prefiller.alloc_mr(4096).unwrap();
    let tail_dst = decoder.alloc_mr(4096).unwrap();
    kv.write_at(0, &pattern(kv.len(), 11)).unwrap();
    tail_src.write_at(0, &pattern(4096, 12)).unwrap();

    // Destination pages: a permutation into twice the space, as a decoder's page pool would be.
    let slots: Vec<u32> = (0..pages).rev().map(|i| i * 2 + (i % 2)).collect();
    let expected = decoder.expected_arrivals(TransferShape::PagedWrites {
        pages: u64::from(pages),
    }) + decoder.expected_arrivals(TransferShape::SingleWrite { len: 4096 });
    let fired = DoneCounter::new();
    decoder.expect_imm_count(500, expected, OnDone::from(&fired));

    let src_pages = Pages::new((0..pages).collect::<Vec<u32>>(), page_len as u64, 0);
    let dst_pages = Pages::new(slots.clone(), page_len as u64, 0);
    let sent = DoneCounter::new();
    prefiller
        .submit_paged_writes(
            page_len as u64,
            Some(500),
            (kv.handle(), &src_pages),
            (pool.desc(), &dst_pages),
            OnDone::from(&sent),
        )
        .unwrap();
    prefiller
        .submit_single_write(
            4096,
            Some(500),
            (tail_src.handle(), 0),
            (tail_dst.desc(), 0),
            OnDone::from(&sent),
        )
        .unwrap();

    wait_for("the decoder's expectation", || fired.total() == 1);
    wait_for("both sender completions", || sent.total() == 2);
    assert_eq!((sent.ok(), fired.ok()), (2, 1));
    let (kv, pool) = (kv.to_vec(), pool.to_vec());
    for (i, &slot) in slots.iter().enumerate() {
        let (s, d) = (i * page_len, slot as usize * page_len);
        assert_eq!(pool[d..d + page_len], kv[s..s + page_len], "page {i}");
    }
    assert_eq!(tail_dst.to_vec(), pattern(4096, 12));
    std::thread::sleep(Duration::from_millis(10));
    assert_eq!(fired.total(), 1, "fired exactly once");
    assert_eq!(decoder.stats().imm_values_tracked, 0);
    assert_eq!(prefiller.stats().groups[0].in_flight, 0);
}

/// 64 transfers with an expectation each, on distinct immediates, all under chaos: each fires
/// once, and never early: its bytes are all there when it does.
#[test]
fn concurrent_transfers_under_chaos_each_fire_their_own_expectation_after_their_bytes() {
    let fabric = MemFabric::new();
    let a = chaos_engine(&fabric, 2, 7);
    let b = engine(&fabric, 2);
    let src = a.alloc_mr(64 * 1024).unwrap();
    let dst = Arc::new(b.alloc_mr(64 * 1024).unwrap());
    src.write_at(0, &pattern(64 * 1024, 2)).unwrap();
    let (fired, wrong) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    for t in 0..64u32 {
        let (dst2, fired2, wrong2) = (dst.clone(), fired.clone(), wrong.clone());
        let expect = pattern(64 * 1024, 2)[t as usize * 1024..(t as usize + 1) * 1024].to_vec();
        b.expect_imm_count(
            1000 + t,
            16,
            OnDone::callback(move |o| {
                let mut got = vec![0; 1024];
                dst2.read_at(t as usize * 1024, &mut got).unwrap();
                if o.is_err() || got != expect {
                    wrong2.fetch_add(1, Ordering::AcqRel);
                }
                fired2.fetch_add(1, Ordering::AcqRel);
            }),
        );
        let pages = Pages::new((t * 16..t * 16 + 16).collect::<Vec<u32>>(), 64, 0);
        a.submit_paged_writes(
            64,
            Some(1000 + t),
            (src.handle(), &pages),
            (dst.desc(), &pages),
            OnDone::nothing(),
        )
        .unwrap();
    }
    wait_for("64 expectations", || fired.load(Ordering::Acquire) == 64);
    assert_eq!(wrong.load(Ordering::Acquire), 0);
}

/// A peer vanishes while writes to it are delayed in flight: they fail with PeerUnreachable in
/// bounded time (no hang), while writes to another peer, in flight at the same time, succeed.
#[test]
fn a_vanishing_peer_fails_its_transfers_and_leaves_the_others_alone() {
    let fabric = MemFabric::new();
    // Every write waits 20-40 ms: the disconnect below certainly comes while they are in flight.
    let plan = FaultPlan {
        seed: 99,
        min_delay: Duration::from_millis(20),
        max_delay: Duration::from_millis(40),
        ..FaultPlan::NONE
    };
    let sender = TransferEngine::mem_with(&fabric, 1, plan, EngineConfig::default()).unwrap();
    let (doomed, healthy) = (engine(&fabric, 1), engine(&fabric, 1));
    let src = sender.alloc_mr(2000 * 64).unwrap();
    let (d_buf, h_buf) = (
        doomed.alloc_mr(2000 * 64).unwrap(),
        healthy.alloc_mr(2000 * 64).unwrap(),
    );
    src.write_at(0, &pattern(2000 * 64, 4)).unwrap();
    let pages = Pages::new((0..2000).collect::<Vec<u32>>(), 64, 0);
    let (to_doomed, to_healthy) = (DoneFlag::new(), DoneFlag::new());
    sender
        .submit_paged_writes(
            64,
            Some(1),
            (src.handle(), &pages),
            (d_buf.desc(), &pages),
            OnDone::from(&to_doomed),
        )
        .unwrap();
    sender
        .submit_paged_writes(
            64,
            Some(1),
            (src.handle(), &pages),
            (h_buf.desc(), &pages),
            OnDone::from(&to_healthy),
        )
        .unwrap();
    let start = Instant::now();
    assert_eq!(fabric.disconnect_peer(&doomed.main_address()), 1);
    wait_for("both transfers to finish", || {
        to_doomed.is_done() && to_healthy.is_done()
    });
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "failed within bounded time"
    );
    assert_eq!(
        to_doomed.result(),
        Some(Err(TransferError::PeerUnreachable))
    );
    assert_eq!(to_healthy.result(), Some(Ok(())));
    assert_eq!(h_buf.to_vec(), pattern(2000 * 64, 4));
    assert_eq!(sender.stats().groups[0].in_flight, 0);
}

fn throttled_engine(fabric: &MemFabric, controls: &Arc<Controls>) -> TransferEngine {
    let domain = Throttled {
        inner: fabric.domain(),
        controls: controls.clone(),
        one_at_a_time: true,
    };
    TransferEngine::builder()
        .group(Device::Host, vec![domain])
        .build()
        .unwrap()
}

/// Cancelling a request part-way: the pages posted before the cancellation land, no more are
/// posted, and the request finishes with Cancelled once the posted ones completed.
#[test]
fn cancellation_stops_posting_and_finishes_after_what_was_posted() {
    let fabric = MemFabric::new();
    let controls = Arc::new(Controls::default());
    // The worker stops at the gate after 100 writes, so the cancellation lands mid-transfer
    // however fast the engine posts.
    controls.close_at.store(100, Ordering::Release);
    let sender = throttled_engine(&fabric, &controls);
    let receiver = engine(&fabric, 1);
    let pages = 20_000u32;
    let src = sender.alloc_mr(pages as usize * 8).unwrap();
    let dst = receiver.alloc_mr(pages as usize * 8).unwrap();
    src.fill(0xEE);
    let token = CancellationToken::new();
    let done = DoneFlag::new();
    let p = Pages::new((0..pages).collect::<Vec<u32>>(), 8, 0);
    sender
        .submit_paged_writes(
            8,
            Some(3),
            (src.handle(), &p),
            (dst.desc(), &p),
            OnDone::from(&done).cancellable(&token),
        )
        .unwrap();
    wait_for("some pages to land", || receiver.pending_imm(3) > 10);
    wait_for("the worker at the gate", || {
        controls.waiting.load(Ordering::Acquire)
    });
    token.cancel();
    controls.close_at.store(0, Ordering::Release);
    controls.gate_closed.store(false, Ordering::Release);
    wait_for("the cancelled request to finish", || done.is_done());
    assert_eq!(done.result(), Some(Err(TransferError::Cancelled)));
    let posted = controls.accepted.load(Ordering::Acquire);
    assert!(
        posted > 10 && posted < u64::from(pages),
        "{posted} of {pages} posted"
    );
    wait_for("the posted pages' immediates", || {
        receiver.pending_imm(3) == posted
    });
    let bytes = dst.to_vec();
    let landed = bytes.chunks(8).filter(|c| c == &[0xEE; 8]).count() as u64;
    assert_eq!(landed, posted, "exactly the posted pages landed");
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        controls.accepted.load(Ordering::Acquire),
        posted,
        "nothing posted after the cancellation"
    );
}

/// A token cancelled before submission: the request posts nothing and finishes Cancelled.
#[test]
fn a_request_with_an_already_cancelled_token_posts_nothing() {
    let fabric = MemFabric::new();
    let (a, b) = (engine(&fabric, 2), engine(&fabric, 2));
    let src = a.alloc_mr(1024).unwrap();
    let dst = b.alloc_mr(1024).unwrap();
    src.fill(1);
    let token = CancellationToken::new();
    token.cancel();
    let (done, fut) = OnDone::future();
    a.submit_single_write(
        1024,
        Some(1),
        (src.handle(), 0),
        (dst.desc(), 0),
        done.cancellable(&token),
    )
    .unwrap();
    assert_eq!(block_on(fut), Err(TransferError::Cancelled));
    assert_eq!(dst.to_vec(), vec![0; 1024]);
    assert_eq!(
        a.stats().groups[0]
            .domains
            .iter()
            .map(|d| d.posted)
            .sum::<u64>(),
        0
    );
}
