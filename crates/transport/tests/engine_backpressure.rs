//! A full submission queue: with `Backpressure::Fail` the next submit is refused with
//! QueueFull; with `Backpressure::Wait` it waits for room. Nothing is dropped either way. The
//! worker is held inside `post_writes` by a gated test domain so the queue fills
//! deterministically. A full NIC queue: the worker probes it with one work request a post
//! until it takes writes again, and the transfer still lands whole.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::throttle::{Controls, Throttled};
use common::{engine, wait_for};
use kvroute_transport::{
    Backpressure, Device, DoneCounter, DoneFlag, EngineConfig, MemFabric, OnDone, Pages,
    RegisteredBuffer, TransferEngine, TransportError,
};

fn gated(
    fabric: &MemFabric,
    controls: &Arc<Controls>,
    backpressure: Backpressure,
) -> TransferEngine {
    let domain = Throttled {
        inner: fabric.domain(),
        controls: controls.clone(),
        one_at_a_time: false,
    };
    let config = EngineConfig {
        queue_capacity: 2,
        backpressure,
        ..EngineConfig::default()
    };
    TransferEngine::builder()
        .config(config)
        .group(Device::Host, vec![domain])
        .build()
        .unwrap()
}

fn write(
    e: &TransferEngine,
    src: &RegisteredBuffer,
    dst: &RegisteredBuffer,
    done: &Arc<DoneCounter>,
) -> Result<(), TransportError> {
    e.submit_single_write(
        8,
        None,
        (src.handle(), 0),
        (dst.desc(), 0),
        OnDone::from(done),
    )
}

#[test]
fn a_full_queue_refuses_with_queue_full_and_loses_nothing() {
    let fabric = MemFabric::new();
    let controls = Arc::new(Controls::default());
    let sender = gated(&fabric, &controls, Backpressure::Fail);
    let receiver = engine(&fabric, 1);
    let (src, dst) = (sender.alloc_mr(8).unwrap(), receiver.alloc_mr(8).unwrap());
    let done = DoneCounter::new();
    // Connect before closing the gate (the connect round trip needs the worker).
    write(&sender, &src, &dst, &done).unwrap();
    wait_for("the first write", || done.total() == 1);

    controls.gate_closed.store(true, Ordering::Release);
    write(&sender, &src, &dst, &done).unwrap();
    wait_for("the worker to block at the gate", || {
        controls.waiting.load(Ordering::Acquire)
    });
    write(&sender, &src, &dst, &done).unwrap();
    write(&sender, &src, &dst, &done).unwrap();
    assert_eq!(
        write(&sender, &src, &dst, &done),
        Err(TransportError::QueueFull)
    );

    controls.gate_closed.store(false, Ordering::Release);
    wait_for("every accepted write", || done.total() == 4);
    assert_eq!(
        done.ok(),
        4,
        "the refused one was never queued; the others all completed"
    );
}

#[test]
fn a_full_queue_makes_the_submitter_wait_for_room() {
    let fabric = MemFabric::new();
    let controls = Arc::new(Controls::default());
    let sender = gated(&fabric, &controls, Backpressure::Wait);
    let receiver = engine(&fabric, 1);
    let (src, dst) = (
        Arc::new(sender.alloc_mr(8).unwrap()),
        Arc::new(receiver.alloc_mr(8).unwrap()),
    );
    let done = DoneCounter::new();
    write(&sender, &src, &dst, &done).unwrap();
    wait_for("the first write", || done.total() == 1);

    controls.gate_closed.store(true, Ordering::Release);
    write(&sender, &src, &dst, &done).unwrap();
    wait_for("the worker to block at the gate", || {
        controls.waiting.load(Ordering::Acquire)
    });
    write(&sender, &src, &dst, &done).unwrap();
    write(&sender, &src, &dst, &done).unwrap();
    let (e, s, d, c) = (sender.clone(), src.clone(), dst.clone(), done.clone());
    let blocked = std::thread::spawn(move || write(&e, &s, &d, &c));
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !blocked.is_finished(),
        "the fifth submit waits while the queue is full"
    );
    controls.gate_closed.store(false, Ordering::Release);
    assert_eq!(blocked.join().unwrap(), Ok(()));
    wait_for("all five writes", || done.total() == 5);
    assert_eq!(done.ok(), 5);
}

/// While a NIC refuses posts (its queue full), each further attempt offers it one work
/// request, not a whole batch built for nothing; once it accepts, batches resume and every
/// page lands.
#[test]
fn a_full_nic_is_probed_with_one_write_until_it_takes_writes_again() {
    const PAGES: u32 = 64;
    const PAGE: u64 = 16;
    const REFUSED: u64 = 50;
    let fabric = MemFabric::new();
    let controls = Arc::new(Controls::default());
    let sender = gated(&fabric, &controls, Backpressure::Wait);
    let receiver = engine(&fabric, 1);
    let bytes = (u64::from(PAGES) * PAGE) as usize;
    let (src, dst) = (
        sender.alloc_mr(bytes).unwrap(),
        receiver.alloc_mr(bytes).unwrap(),
    );
    let pattern: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
    src.write_at(0, &pattern).unwrap();
    let done = DoneCounter::new();
    // Connected first, so that every refused post below belongs to the paged transfer.
    write(&sender, &src, &dst, &done).unwrap();
    wait_for("the first write", || done.total() == 1);
    dst.fill(0);

    controls.refuse_posts.store(REFUSED, Ordering::Release);
    let pages = Pages::new((0..PAGES).collect::<Vec<u32>>(), PAGE, 0);
    let landed = DoneFlag::new();
    receiver.expect_imm_count(7, u64::from(PAGES), OnDone::from(&landed));
    let sent = DoneFlag::new();
    sender
        .submit_paged_writes(
            PAGE,
            Some(7),
            (src.handle(), &pages),
            (dst.desc(), &pages),
            OnDone::from(&sent),
        )
        .unwrap();
    wait_for("the paged transfer", || sent.is_done() && landed.is_done());
    assert_eq!(sent.result(), Some(Ok(())));
    assert_eq!(dst.to_vec(), pattern, "every page landed whole");
    assert_eq!(controls.refuse_posts.load(Ordering::Acquire), 0);
    // The first refused post carried a full batch (32); each later one a single probe.
    let offered = controls.refused_offers.load(Ordering::Acquire);
    assert!(
        offered <= 32 + (REFUSED - 1),
        "{offered} work requests offered to {REFUSED} refused posts"
    );
}
