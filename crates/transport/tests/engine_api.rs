//! Every TransferEngine call over the `mem` domain, on its intended path (the bodies shared
//! with the fabric domain live in `common/suite.rs`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::{Arc, Mutex};

use common::{block_on, engine, suite, wait_for};
use kvroute_transport::{MemFabric, OnDone};

#[test]
fn a_single_write_lands_and_every_kind_of_on_done_sees_it() {
    let fabric = MemFabric::new();
    let mem = |nics| engine(&fabric, nics);
    suite::single_write_with_every_on_done(&mem);
}

#[test]
fn a_large_write_shards_over_four_nics_each_with_its_own_rkey() {
    let fabric = MemFabric::new();
    let mem = |nics| engine(&fabric, nics);
    suite::large_write_sharded_over_nics(&mem, 4);
}

#[test]
fn paged_writes_land_where_the_indices_say_and_fire_the_expectation_once() {
    let fabric = MemFabric::new();
    let mem = |nics| engine(&fabric, nics);
    suite::paged_writes(&mem);
}

#[test]
fn arrivals_before_the_expectation_count_and_the_excess_carries_over() {
    let fabric = MemFabric::new();
    let mem = |nics| engine(&fabric, nics);
    suite::arrivals_before_the_expectation(&mem);
}

#[test]
fn a_watched_immediate_counts_its_arrivals_without_the_counter() {
    let fabric = MemFabric::new();
    let mem = |nics| engine(&fabric, nics);
    suite::watched_immediates(&mem);
}

#[test]
fn immediates_to_a_resolved_target_land_and_survive_released_peers() {
    let fabric = MemFabric::new();
    let mem = |nics| engine(&fabric, nics);
    suite::resolved_immediate_targets(&mem);
}

#[test]
fn immediates_nobody_waits_on_post_without_a_completion() {
    let fabric = MemFabric::new();
    let mem = |nics| engine(&fabric, nics);
    suite::immediates_nobody_waits_on(&mem, true);
}

#[test]
fn unexpected_immediates_reach_the_handler_and_stay_claimable() {
    let fabric = MemFabric::new();
    let mem = |nics| engine(&fabric, nics);
    suite::unexpected_immediates(&mem);
}

#[test]
fn scatter_and_barrier_reach_a_group_of_64_peers() {
    let fabric = MemFabric::new();
    let mem = |nics| engine(&fabric, nics);
    suite::scatter_and_barrier(&mem, 64);
}

#[test]
fn more_messages_than_receive_buffers_all_arrive_through_back_pressure() {
    let fabric = MemFabric::new();
    let mem = |nics| engine(&fabric, nics);
    suite::messages_through_back_pressure(&mem);
}

#[test]
fn messages_name_their_sender_once_it_is_connected() {
    let fabric = MemFabric::new();
    let mem = |nics| engine(&fabric, nics);
    suite::messages_name_their_sender(&mem);
}

#[test]
fn a_callback_may_submit_into_its_engine_without_deadlock() {
    let fabric = MemFabric::new();
    let mem = |nics| engine(&fabric, nics);
    suite::callback_submits_into_its_engine(&mem);
}

/// A thread remembers the peer of its last submit (no lock, no hash when the next goes there
/// too): writes still land where their descriptors say when the thread alternates between
/// peers, when a peer was released and connects again under a new index, and when an engine
/// is dropped and another takes its place.
#[test]
fn writes_reach_their_own_peer_however_a_thread_alternates_releases_and_replaces() {
    let fabric = MemFabric::new();
    let (a, b, c) = (engine(&fabric, 1), engine(&fabric, 1), engine(&fabric, 1));
    let (b_dst, c_dst) = (b.alloc_mr(64).unwrap(), c.alloc_mr(64).unwrap());
    let send = |from: &kvroute_transport::TransferEngine, to: &kvroute_transport::MrDesc| {
        let done = kvroute_transport::DoneFlag::new();
        from.submit_imm(40, to, OnDone::from(&done)).unwrap();
        wait_for("the write", || done.is_done());
        assert_eq!(done.result(), Some(Ok(())));
    };
    for _ in 0..3 {
        send(&a, c_dst.desc());
        send(&a, b_dst.desc());
    }
    wait_for("three at each", || {
        b.pending_imm(40) == 3 && c.pending_imm(40) == 3
    });

    // b was this thread's last peer when released.
    assert!(a.disconnect(&b.main_address()).unwrap());
    send(&a, b_dst.desc());
    wait_for("the write after the release", || b.pending_imm(40) == 4);

    // An engine dropped and another made on this thread: the new one knows no peer yet.
    let x = engine(&fabric, 1);
    send(&x, b_dst.desc());
    drop(x);
    let y = engine(&fabric, 1);
    send(&y, c_dst.desc());
    send(&y, b_dst.desc());
    wait_for("the replacement's writes", || {
        b.pending_imm(40) == 6 && c.pending_imm(40) == 4
    });
    assert_eq!(a.pending_imm(40), 0);
}

#[test]
fn released_peers_free_their_resources() {
    let fabric = MemFabric::new();
    let mem = |nics| engine(&fabric, nics);
    suite::released_peers_free_their_resources(&mem, 200);
}

#[test]
fn a_watched_word_reports_its_changes_with_the_old_value() {
    let fabric = MemFabric::new();
    let e = engine(&fabric, 1);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    let word = e
        .alloc_watcher(move |old, new| s.lock().unwrap().push((old, new)))
        .unwrap();
    for _ in 0..27 {
        word.fetch_add(1);
        std::thread::sleep(std::time::Duration::from_micros(300));
    }
    wait_for("the last layer", || {
        seen.lock().unwrap().last().map(|&(_, n)| n) == Some(27)
    });
    let seen = seen.lock().unwrap();
    assert_eq!(seen[0].0, 0);
    for w in seen.windows(2) {
        assert_eq!(w[0].1, w[1].0, "each change starts where the last ended");
        assert!(w[1].1 > w[1].0);
    }
    drop(word);
}

#[test]
fn shutdown_fails_waiting_expectations_and_refuses_later_calls() {
    let fabric = MemFabric::new();
    let e = engine(&fabric, 1);
    let waiting = e.imm_count(1, 10);
    let buf = e.alloc_mr(8).unwrap();
    e.shutdown();
    assert_eq!(
        block_on(waiting),
        Err(kvroute_transport::TransferError::Shutdown)
    );
    let err = e.submit_imm(1, buf.desc(), OnDone::nothing()).unwrap_err();
    assert_eq!(err, kvroute_transport::TransportError::Shutdown);
    drop(buf);
}
