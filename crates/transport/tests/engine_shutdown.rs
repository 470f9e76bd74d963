//! Shutdown racing everything else: callbacks that drop the last handle of a buffer, threads
//! that keep submitting and registering. Each scenario runs under a watchdog, so a deadlock
//! fails the test instead of hanging the suite.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::channel;
use std::time::Duration;

use common::{TIMEOUT, engine};
use kvroute_transport::{MemFabric, OnDone, TransferError, TransportError};

/// Runs `scenario` on its own thread and fails if it has not finished within [`TIMEOUT`].
fn watchdog(what: &str, scenario: impl FnOnce() + Send + 'static) {
    let (done_tx, done_rx) = channel();
    let runner = std::thread::spawn(move || {
        scenario();
        let _ = done_tx.send(());
    });
    match done_rx.recv_timeout(TIMEOUT) {
        Ok(()) => runner.join().unwrap(),
        // The scenario panicked: join to report its message.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => runner.join().unwrap(),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("deadlock: {what}"),
    }
}

/// A deregistration queued after the worker's last look at its queue used to wait forever
/// for a reply (the engine keeps the queue), and shutdown with it: shutdown joins the callback
/// thread, which was the one waiting.
#[test]
fn a_buffer_dropped_by_a_callback_after_the_worker_stopped_does_not_deadlock() {
    watchdog("callback deregisters during shutdown", || {
        let fabric = MemFabric::new();
        let (a, b) = (engine(&fabric, 1), engine(&fabric, 1));
        let src = a.alloc_mr(64).unwrap();
        let dst = b.alloc_mr(64).unwrap();
        let (handle, desc) = (*src.handle(), dst.desc().clone());
        let (ran_tx, ran_rx) = channel();
        let (go_tx, go_rx) = channel::<()>();
        a.submit_single_write(
            8,
            None,
            (&handle, 0),
            (&desc, 0),
            OnDone::callback(move |outcome| {
                ran_tx.send(outcome).unwrap();
                go_rx.recv_timeout(TIMEOUT).unwrap();
                // The last handle of `src`: deregisters with a worker that has stopped.
                drop(src);
            }),
        )
        .unwrap();
        assert_eq!(ran_rx.recv_timeout(TIMEOUT).unwrap(), Ok(()));
        let stopper = std::thread::spawn({
            let a = a.clone();
            move || a.shutdown()
        });
        // Shutdown has begun once submissions are refused; give the worker time to stop.
        common::wait_for("shutdown to begin", || {
            a.submit_imm(1, &desc, OnDone::nothing()) == Err(TransportError::Shutdown)
        });
        std::thread::sleep(Duration::from_millis(50));
        go_tx.send(()).unwrap();
        stopper.join().unwrap();
        assert_eq!(a.alloc_mr(8).err(), Some(TransportError::Shutdown));
        drop(dst);
    });
}

/// Every submission that was accepted completes exactly once, whether it ran, was failed by
/// the worker's shutdown, or was queued after the worker's last look; buffers registered and
/// dropped during the race neither hang nor leak a reply.
#[test]
fn submissions_racing_shutdown_each_complete_exactly_once() {
    for round in 0..20u64 {
        watchdog("submitters racing shutdown", move || {
            let fabric = MemFabric::new();
            let (a, b) = (engine(&fabric, 2), engine(&fabric, 2));
            let src = Arc::new(a.alloc_mr(4096).unwrap());
            let dst = b.alloc_mr(4096).unwrap();
            let desc = dst.desc().clone();
            let accepted = Arc::new(AtomicU64::new(0));
            let fired = Arc::new(AtomicU64::new(0));
            let shutdown_seen = Arc::new(AtomicU64::new(0));
            let stop = Arc::new(AtomicBool::new(false));
            let submitters: Vec<_> = (0..3)
                .map(|t| {
                    let (a, src, desc) = (a.clone(), src.clone(), desc.clone());
                    let (accepted, fired, seen, stop) = (
                        accepted.clone(),
                        fired.clone(),
                        shutdown_seen.clone(),
                        stop.clone(),
                    );
                    std::thread::spawn(move || {
                        let mut i = 0u64;
                        while !stop.load(Ordering::Relaxed) {
                            i += 1;
                            if t == 2 && i.is_multiple_of(8) {
                                // Registration and deregistration race the worker's stop too.
                                match a.alloc_mr(256) {
                                    Ok(buf) => drop(buf),
                                    Err(e) => assert_eq!(e, TransportError::Shutdown),
                                }
                                continue;
                            }
                            let (fired, seen) = (fired.clone(), seen.clone());
                            let done = OnDone::callback(move |outcome| {
                                if outcome == Err(TransferError::Shutdown) {
                                    seen.fetch_add(1, Ordering::Relaxed);
                                } else {
                                    assert_eq!(outcome, Ok(()));
                                }
                                fired.fetch_add(1, Ordering::Relaxed);
                            });
                            let off = (i % 64) * 64;
                            match a.submit_single_write(
                                64,
                                None,
                                (src.handle(), off),
                                (&desc, off),
                                done,
                            ) {
                                Ok(()) => {
                                    accepted.fetch_add(1, Ordering::Relaxed);
                                }
                                Err(e) => {
                                    assert_eq!(e, TransportError::Shutdown);
                                    return;
                                }
                            }
                        }
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(2 + round % 5));
            a.shutdown();
            stop.store(true, Ordering::Relaxed);
            for s in submitters {
                s.join().unwrap();
            }
            // Shutdown joined the callback thread and every submitter has returned: any
            // completion not yet run never will be.
            assert_eq!(
                fired.load(Ordering::Relaxed),
                accepted.load(Ordering::Relaxed),
                "round {round}: {} of the accepted ended with Shutdown",
                shutdown_seen.load(Ordering::Relaxed)
            );
            drop((src, dst));
        });
    }
}
