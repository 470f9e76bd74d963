//! A full submission queue: with `Backpressure::Fail` the next submit is refused with
//! QueueFull; with `Backpressure::Wait` it waits for room. Nothing is dropped either way. The
//! worker is held inside `post_writes` by a gated test domain so the queue fills
//! deterministically.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::throttle::{Controls, Throttled};
use common::{engine, wait_for};
use kvroute_transport::{
    Backpressure, Device, DoneCounter, EngineConfig, MemFabric, OnDone, RegisteredBuffer,
    TransferEngine, TransportError,
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
