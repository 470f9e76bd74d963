//! Manual progress (`Progress::Manual`): no worker threads; passes run inside
//! `TransferEngine::progress`, which the application calls, and inside control calls that
//! wait for a reply. A submit that finds the pass free posts its own transfer.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{TIMEOUT, pattern};
use kvroute_transport::{
    Backpressure, DoneCounter, DoneFlag, EngineConfig, FabricConfig, FaultPlan, MemFabric, OnDone,
    Pages, Progress, ProviderChoice, TransferEngine, TransferError, TransferShape,
};

fn manual() -> EngineConfig {
    EngineConfig {
        progress: Progress::Manual,
        ..EngineConfig::default()
    }
}

fn mem(fabric: &MemFabric, config: EngineConfig) -> TransferEngine {
    TransferEngine::mem_with(fabric, 1, FaultPlan::NONE, config).unwrap()
}

/// Runs both engines' passes until `done`, failing after the test timeout.
fn progress_until(engines: &[&TransferEngine], what: &str, done: impl Fn() -> bool) {
    let start = Instant::now();
    while !done() {
        let busy = engines.iter().fold(false, |b, e| e.progress() | b);
        if !busy {
            std::thread::yield_now();
        }
        assert!(start.elapsed() < TIMEOUT, "timed out waiting for {what}");
    }
}

#[test]
fn an_immediate_nobody_waits_on_is_done_with_when_its_submit_returns() {
    let fabric = MemFabric::new();
    let (a, b) = (mem(&fabric, manual()), mem(&fabric, manual()));
    let dst = b.alloc_mr(64).unwrap();
    let landed = DoneFlag::new();
    b.expect_imm_count(5, 3, OnDone::from(&landed));
    for _ in 0..3 {
        a.submit_imm(5, dst.desc(), OnDone::nothing()).unwrap();
    }
    let nic = a.stats().groups[0].domains[0];
    assert_eq!(
        (nic.posted, nic.unreported, a.stats().groups[0].in_flight),
        (3, 3, 0),
        "posted with no completion to wait for"
    );
    // Only the target progresses: the sender has nothing left to do.
    progress_until(&[&b], "the arrivals", || landed.is_done());
    assert_eq!(landed.result(), Some(Ok(())));
    assert!(!a.progress(), "the sender's pass finds nothing");
    assert_eq!(a.stats().groups[0].domains[0].completed, 0);

    // Under a fault plan (delays and failures for writes that report), it reports.
    let faulty = TransferEngine::mem_with(
        &fabric,
        1,
        FaultPlan {
            fail_probability: 1.0,
            ..FaultPlan::NONE
        },
        manual(),
    )
    .unwrap();
    faulty.submit_imm(5, dst.desc(), OnDone::nothing()).unwrap();
    progress_until(&[&faulty], "the injected failure", || {
        faulty.stats().groups[0].domains[0].failed == 1
    });
    assert_eq!(faulty.stats().groups[0].domains[0].unreported, 0);
}

#[test]
fn a_submit_posts_its_write_and_nothing_else_moves_until_someone_progresses() {
    let fabric = MemFabric::new();
    let (a, b) = (mem(&fabric, manual()), mem(&fabric, manual()));
    assert!(a.manual_progress());
    let src = a.alloc_mr(4096).unwrap();
    let dst = b.alloc_mr(4096).unwrap();
    src.write_at(0, &pattern(4096, 4)).unwrap();
    let (sent, landed) = (DoneFlag::new(), DoneFlag::new());
    b.expect_imm_count(1, 1, OnDone::from(&landed));
    a.submit_single_write(
        4096,
        Some(1),
        (src.handle(), 0),
        (dst.desc(), 0),
        OnDone::from(&sent),
    )
    .unwrap();
    let stats = a.stats();
    assert_eq!(
        (stats.groups[0].domains[0].posted, stats.groups[0].in_flight),
        (1, 1),
        "the submitting thread posted the write"
    );
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        !sent.is_done() && !landed.is_done(),
        "no thread completes or counts it for us"
    );
    assert!(dst.to_vec().iter().all(|&x| x == 0));
    progress_until(&[&a, &b], "the write", || {
        sent.is_done() && landed.is_done()
    });
    assert_eq!(
        (sent.result(), landed.result()),
        (Some(Ok(())), Some(Ok(())))
    );
    assert_eq!(dst.to_vec(), pattern(4096, 4));
    assert!(!a.progress() && !b.progress(), "idle passes report idle");
}

#[test]
fn control_calls_progress_while_they_wait_for_their_reply() {
    let fabric = MemFabric::new();
    let (a, b) = (mem(&fabric, manual()), mem(&fabric, manual()));
    // Registration, deregistration (on drop), connecting (inside the first write) and
    // installing a receive pool all answer without anyone calling progress.
    let bufs: Vec<_> = (0..8).map(|_| a.alloc_mr(64).unwrap()).collect();
    drop(bufs);
    let dst = b.alloc_mr(64).unwrap();
    let src = a.alloc_mr(64).unwrap();
    a.submit_single_write(
        8,
        None,
        (src.handle(), 0),
        (dst.desc(), 0),
        OnDone::nothing(),
    )
    .unwrap();
    b.submit_recvs(64, 4, |_| {}).unwrap();
}

#[test]
fn the_only_thread_takes_its_submits_itself_past_the_queue_capacity() {
    let fabric = MemFabric::new();
    let config = EngineConfig {
        queue_capacity: 4,
        backpressure: Backpressure::Fail,
        ..manual()
    };
    let (a, b) = (mem(&fabric, config), mem(&fabric, manual()));
    let src = a.alloc_mr(64 * 100).unwrap();
    let dst = b.alloc_mr(64 * 100).unwrap();
    src.write_at(0, &pattern(6400, 8)).unwrap();
    let done = DoneCounter::new();
    // 100 submits beside a queue of 4 that would refuse the fifth: none is queued.
    for i in 0..100u64 {
        a.submit_single_write(
            64,
            None,
            (src.handle(), i * 64),
            (dst.desc(), i * 64),
            OnDone::from(&done),
        )
        .unwrap();
    }
    assert_eq!(a.stats().groups[0].in_flight, 100);
    progress_until(&[&a, &b], "100 writes", || done.total() == 100);
    assert_eq!(done.ok(), 100);
    assert_eq!(dst.to_vec(), pattern(6400, 8));
}

#[test]
fn submitters_racing_a_thread_in_the_pass_queue_and_wait_for_room() {
    let fabric = MemFabric::new();
    let config = EngineConfig {
        queue_capacity: 4,
        backpressure: Backpressure::Wait,
        ..manual()
    };
    let (a, b) = (mem(&fabric, config), mem(&fabric, manual()));
    const WRITES: u64 = 4000;
    let src = Arc::new(a.alloc_mr(8 * WRITES as usize).unwrap());
    let dst = b.alloc_mr(8 * WRITES as usize).unwrap();
    src.write_at(0, &pattern(8 * WRITES as usize, 9)).unwrap();
    let done = DoneCounter::new();
    let landed = DoneCounter::new();
    b.expect_imm_count(7, WRITES, OnDone::from(&landed));
    // A thread runs both engines' passes the whole time, so submits that find it in the pass
    // go to the queue of 4 (and wait for room there); the others are taken at once.
    let passes = {
        let (a, b, done, landed) = (a.clone(), b.clone(), done.clone(), landed.clone());
        std::thread::spawn(move || {
            progress_until(&[&a, &b], "the submitted writes", || {
                done.total() == WRITES && landed.total() == 1
            });
        })
    };
    let submitters: Vec<_> = (0..2u64)
        .map(|t| {
            let (a, src, desc, done) = (a.clone(), src.clone(), dst.desc().clone(), done.clone());
            std::thread::spawn(move || {
                for i in (t..WRITES).step_by(2) {
                    a.submit_single_write(
                        8,
                        Some(7),
                        (src.handle(), i * 8),
                        (&desc, i * 8),
                        OnDone::from(&done),
                    )
                    .unwrap();
                }
            })
        })
        .collect();
    for s in submitters {
        s.join().unwrap();
    }
    passes.join().unwrap();
    assert_eq!(
        (done.total(), done.ok()),
        (WRITES, WRITES),
        "each completed once"
    );
    assert_eq!(landed.ok(), 1);
    assert_eq!(dst.to_vec(), pattern(8 * WRITES as usize, 9));
}

#[test]
fn shutdown_fails_what_is_in_flight_exactly_once() {
    let fabric = MemFabric::new();
    // Writes land a minute after they are posted: posted ones stay in flight.
    let slow = FaultPlan {
        min_delay: Duration::from_secs(60),
        max_delay: Duration::from_secs(60),
        ..FaultPlan::NONE
    };
    let a = TransferEngine::mem_with(&fabric, 1, slow, manual()).unwrap();
    let b = mem(&fabric, manual());
    let src = a.alloc_mr(64).unwrap();
    let dst = b.alloc_mr(64).unwrap();
    // Each taken and posted by the submitting thread; a pass then finds nothing landed.
    let in_flight = DoneCounter::new();
    for _ in 0..10 {
        a.submit_single_write(
            8,
            None,
            (src.handle(), 0),
            (dst.desc(), 0),
            OnDone::from(&in_flight),
        )
        .unwrap();
    }
    while a.progress() {}
    assert_eq!(a.stats().groups[0].in_flight, 10, "posted, not landed");
    let waiting = a.imm_count(5, 1);
    a.shutdown();
    assert_eq!(
        (in_flight.total(), in_flight.failed()),
        (10, 10),
        "each failed once"
    );
    assert_eq!(waiting.wait(), Err(TransferError::Shutdown));
    assert!(!a.progress(), "a stopped engine has nothing to run");
    drop(src);
}

#[test]
fn two_threads_may_progress_one_engine_and_each_transfer_completes_once() {
    let fabric = MemFabric::new();
    let (a, b) = (mem(&fabric, manual()), mem(&fabric, manual()));
    let src = Arc::new(a.alloc_mr(1 << 16).unwrap());
    let dst = b.alloc_mr(1 << 16).unwrap();
    let done = DoneCounter::new();
    let pages = Pages::new((0..64).collect::<Vec<u32>>(), 1024, 0);
    let landed = DoneCounter::new();
    for round in 0..50u32 {
        b.expect_imm_count(
            round,
            b.expected_arrivals(TransferShape::PagedWrites { pages: 64 }),
            OnDone::from(&landed),
        );
        a.submit_paged_writes(
            1024,
            Some(round),
            (src.handle(), &pages),
            (dst.desc(), &pages),
            OnDone::from(&done),
        )
        .unwrap();
    }
    let helpers: Vec<_> = (0..2)
        .map(|_| {
            let (a, b, done, landed) = (a.clone(), b.clone(), done.clone(), landed.clone());
            std::thread::spawn(move || {
                progress_until(&[&a, &b], "50 paged transfers", || {
                    done.total() == 50 && landed.total() == 50
                });
            })
        })
        .collect();
    for h in helpers {
        h.join().unwrap();
    }
    std::thread::sleep(Duration::from_millis(10));
    assert_eq!(
        (done.total(), done.ok()),
        (50, 50),
        "each completed exactly once"
    );
    assert_eq!((landed.total(), landed.ok()), (50, 50));
}

#[test]
fn a_fabric_engine_runs_by_manual_progress() {
    let config = FabricConfig {
        node: Some("127.0.0.1".to_owned()),
        required: true,
        ..FabricConfig::provider(ProviderChoice::Tcp)
    };
    let a = TransferEngine::fabric(&config, manual()).unwrap().0;
    let b = TransferEngine::fabric(&config, manual()).unwrap().0;
    let src = a.alloc_mr(1 << 20).unwrap();
    let dst = b.alloc_mr(1 << 20).unwrap();
    src.write_at(0, &pattern(1 << 20, 6)).unwrap();
    let landed = DoneFlag::new();
    let pages = Pages::new((0..256).collect::<Vec<u32>>(), 4096, 0);
    b.expect_imm_count(
        9,
        b.expected_arrivals(TransferShape::PagedWrites { pages: 256 }),
        OnDone::from(&landed),
    );
    let sent = DoneFlag::new();
    a.submit_paged_writes(
        4096,
        Some(9),
        (src.handle(), &pages),
        (dst.desc(), &pages),
        OnDone::from(&sent),
    )
    .unwrap();
    progress_until(&[&a, &b], "the paged transfer", || {
        sent.is_done() && landed.is_done()
    });
    assert_eq!(sent.result(), Some(Ok(())));
    assert_eq!(dst.to_vec(), pattern(1 << 20, 6));
}
