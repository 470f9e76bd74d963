//! Test bodies every domain must pass: `engine_api.rs` runs them over `mem`, `fabric_api.rs`
//! over libfabric's tcp and shm providers. Each takes a maker of connected engines.

use std::sync::{Arc, Mutex};

use kvroute_transport::{
    DoneCounter, DoneFlag, OnDone, Pages, ScatterDst, TransferEngine, TransferShape,
};

use super::{TIMEOUT, block_on, pattern, wait_for};

/// Makes an engine with the given number of NICs, reachable from the others it makes.
pub(crate) type Make<'a> = dyn Fn(usize) -> TransferEngine + 'a;

pub(crate) fn single_write_with_every_on_done(make: &Make<'_>) {
    let (a, b) = (make(1), make(1));
    let src = a.alloc_mr(4096).unwrap();
    let dst = b.alloc_mr(4096).unwrap();
    src.write_at(0, &pattern(4096, 1)).unwrap();

    let flag = DoneFlag::new();
    a.submit_single_write(
        1000,
        None,
        (src.handle(), 10),
        (dst.desc(), 20),
        OnDone::from(&flag),
    )
    .unwrap();
    wait_for("the flag", || flag.is_done());
    assert_eq!(flag.result(), Some(Ok(())));
    assert_eq!(dst.to_vec()[20..1020], pattern(4096, 1)[10..1010]);

    let counter = DoneCounter::new();
    for i in 0..8 {
        a.submit_single_write(
            8,
            None,
            (src.handle(), i * 8),
            (dst.desc(), 2048 + i * 8),
            OnDone::from(&counter),
        )
        .unwrap();
    }
    wait_for("eight writes", || counter.total() == 8);
    assert_eq!(counter.ok(), 8);

    let (tx, rx) = std::sync::mpsc::channel();
    a.submit_single_write(
        4,
        None,
        (src.handle(), 0),
        (dst.desc(), 0),
        OnDone::callback(move |o| tx.send(o).unwrap()),
    )
    .unwrap();
    assert_eq!(rx.recv_timeout(TIMEOUT).unwrap(), Ok(()));

    let (done, fut) = OnDone::future();
    a.submit_single_write(4, None, (src.handle(), 0), (dst.desc(), 4092), done)
        .unwrap();
    assert_eq!(block_on(fut), Ok(()));
    let stats = a.stats();
    assert_eq!(
        stats.groups[0].in_flight, 0,
        "no transfer context outlives its transfer"
    );
}

pub(crate) fn large_write_sharded_over_nics(make: &Make<'_>, nics: usize) {
    let (a, b) = (make(nics), make(nics));
    let len = 1 << 20;
    let src = a.alloc_mr(len).unwrap();
    let dst = b.alloc_mr(len).unwrap();
    src.write_at(0, &pattern(len, 9)).unwrap();
    assert_eq!(dst.desc().rkeys.len(), nics);
    let shards = b.expected_arrivals(TransferShape::SingleWrite { len: len as u64 });
    assert_eq!(shards, nics as u64);
    let landed = b.imm_count(5, shards);
    a.submit_single_write(
        len as u64,
        Some(5),
        (src.handle(), 0),
        (dst.desc(), 0),
        OnDone::nothing(),
    )
    .unwrap();
    assert_eq!(block_on(landed), Ok(()));
    assert_eq!(dst.to_vec(), pattern(len, 9));
    // A shard presenting another NIC's rkey would have failed with a remote access error.
    let per_nic: Vec<u64> = a.stats().groups[0]
        .domains
        .iter()
        .map(|d| d.posted)
        .collect();
    assert_eq!(per_nic.iter().sum::<u64>(), nics as u64);
    assert!(per_nic.iter().all(|&n| n == 1), "{per_nic:?}");
    assert!(a.stats().groups[0].domains.iter().all(|d| d.failed == 0));
}

pub(crate) fn paged_writes(make: &Make<'_>) {
    let (a, b) = (make(2), make(2));
    let page = 256u64;
    let src = a.alloc_mr(64 * 256 + 32).unwrap();
    let dst = b.alloc_mr(128 * 512 + 64).unwrap();
    src.write_at(0, &pattern(64 * 256 + 32, 3)).unwrap();
    let src_pages = Pages::new((0..64).rev().collect::<Vec<u32>>(), page, 32);
    let dst_pages = Pages::new((0..64).map(|i| i * 2).collect::<Vec<u32>>(), 512, 64);
    let fired = DoneCounter::new();
    b.expect_imm_count(
        77,
        b.expected_arrivals(TransferShape::PagedWrites { pages: 64 }),
        OnDone::from(&fired),
    );
    let done = DoneFlag::new();
    a.submit_paged_writes(
        page,
        Some(77),
        (src.handle(), &src_pages),
        (dst.desc(), &dst_pages),
        OnDone::from(&done),
    )
    .unwrap();
    wait_for("the expectation", || fired.total() == 1);
    wait_for("the sender", || done.is_done());
    let (s, d) = (src.to_vec(), dst.to_vec());
    for i in 0..64usize {
        let from = 32 + (63 - i) * 256;
        let to = 64 + i * 2 * 512;
        assert_eq!(d[to..to + 256], s[from..from + 256], "page {i}");
        assert!(
            d[to + 256..to + 512].iter().all(|&x| x == 0),
            "gap after page {i} untouched"
        );
    }
    std::thread::sleep(std::time::Duration::from_millis(5));
    assert_eq!(fired.total(), 1, "fired exactly once");
    assert_eq!(b.pending_imm(77), 0);
}

pub(crate) fn arrivals_before_the_expectation(make: &Make<'_>) {
    let (a, b) = (make(1), make(1));
    let dst = b.alloc_mr(64).unwrap();
    let sent = DoneCounter::new();
    for _ in 0..5 {
        a.submit_imm(9, dst.desc(), OnDone::from(&sent)).unwrap();
    }
    wait_for("five immediates", || sent.total() == 5);
    wait_for("five counted", || b.pending_imm(9) == 5);
    assert_eq!(block_on(b.imm_count(9, 3)), Ok(()));
    assert_eq!(b.pending_imm(9), 2);
    assert_eq!(block_on(b.imm_count(9, 2)), Ok(()));
    assert_eq!(b.stats().imm_values_tracked, 0);
}

/// A watched immediate: arrivals counted before the watch are taken over, later ones (a
/// write's with its bytes, immediate-only ones) counted by the watch with the bytes visible;
/// expectations of the value fail at once and its pending count reads 0 while it is watched;
/// one watch per value; dropping the watch hands the value back to the IMM counter.
pub(crate) fn watched_immediates(make: &Make<'_>) {
    let (a, b) = (make(1), make(1));
    let src = a.alloc_mr(64).unwrap();
    let dst = b.alloc_mr(64).unwrap();
    let sent = DoneCounter::new();
    a.submit_imm(40, dst.desc(), OnDone::from(&sent)).unwrap();
    wait_for("the first immediate counted", || b.pending_imm(40) == 1);

    let watch = b.watch_imm(40).unwrap();
    assert_eq!(watch.imm(), 40);
    assert_eq!(watch.arrived(), 1, "the earlier arrival is taken over");
    assert_eq!(b.pending_imm(40), 0);
    assert_eq!(
        b.watch_imm(40).unwrap_err(),
        kvroute_transport::TransportError::ImmWatched(40)
    );
    assert_eq!(
        block_on(b.imm_count(40, 1)),
        Err(kvroute_transport::TransferError::ImmWatched(40))
    );

    let bytes = pattern(64, 7);
    src.write_at(0, &bytes).unwrap();
    a.submit_single_write(
        64,
        Some(40),
        (src.handle(), 0),
        (dst.desc(), 0),
        OnDone::from(&sent),
    )
    .unwrap();
    wait_for("the write counted by the watch", || watch.arrived() == 2);
    assert_eq!(dst.to_vec(), bytes, "the counted write's bytes are there");
    for _ in 0..10 {
        a.submit_imm(40, dst.desc(), OnDone::nothing()).unwrap();
    }
    wait_for("ten more", || watch.arrived() == 12);
    wait_for("the reported writes", || sent.total() == 2);
    assert_eq!(sent.ok(), 2);
    assert_eq!(b.pending_imm(40), 0, "nothing counted beside the watch");

    drop(watch);
    let landed = b.imm_count(40, 1);
    a.submit_imm(40, dst.desc(), OnDone::nothing()).unwrap();
    assert_eq!(block_on(landed), Ok(()), "the counter has the value back");
    assert_eq!(b.stats().imm_values_tracked, 0);
}

/// Immediate-only writes to a destination resolved once: they land as `submit_imm`'s do,
/// with or without a completion; a target is refused by another engine; after a peer is
/// released (its own included) the target still reaches its peer, resolved again.
pub(crate) fn resolved_immediate_targets(make: &Make<'_>) {
    let (a, b, c) = (make(1), make(1), make(1));
    let (at_b, at_c) = (b.alloc_mr(64).unwrap(), c.alloc_mr(64).unwrap());
    let to_b = a.imm_target(at_b.desc()).unwrap();
    assert_eq!(to_b.desc(), at_b.desc());
    let watch = b.watch_imm(50).unwrap();
    let sent = DoneCounter::new();
    for _ in 0..3 {
        a.submit_imm_to(50, &to_b, OnDone::from(&sent)).unwrap();
        a.submit_imm_to(50, &to_b, OnDone::nothing()).unwrap();
    }
    wait_for("six immediates", || watch.arrived() == 6);
    wait_for("three completions", || sent.total() == 3);
    assert_eq!(sent.ok(), 3);
    assert!(matches!(
        c.submit_imm_to(50, &to_b, OnDone::nothing()),
        Err(kvroute_transport::TransportError::InvalidArgument(_))
    ));

    // Another peer released: the target is looked up again, and still reaches b.
    let to_c = a.imm_target(at_c.desc()).unwrap();
    a.submit_imm_to(51, &to_c, OnDone::nothing()).unwrap();
    wait_for("c's immediate", || c.pending_imm(51) == 1);
    assert!(a.disconnect(&c.main_address()).unwrap());
    a.submit_imm_to(50, &to_b, OnDone::nothing()).unwrap();
    wait_for("the seventh", || watch.arrived() == 7);
    // Its own peer released: the write connects it again.
    assert!(a.disconnect(&b.main_address()).unwrap());
    let landed = DoneCounter::new();
    a.submit_imm_to(50, &to_b, OnDone::from(&landed)).unwrap();
    wait_for("the eighth", || watch.arrived() == 8);
    wait_for("its completion", || landed.total() == 1);
    assert_eq!(landed.ok(), 1);
}

/// Immediate-only writes whose `on_done` does nothing post without a completion where the
/// NIC can (`unreported`): they land and are counted as posted and unreported, never as
/// completed, and leave nothing in flight. With an `on_done` that reports, or one that could
/// be cancelled, the same write completes as usual.
pub(crate) fn immediates_nobody_waits_on(make: &Make<'_>, unreported: bool) {
    let (a, b) = (make(2), make(2));
    let dst = b.alloc_mr(64).unwrap();
    let sums = |e: &TransferEngine| {
        let g = &e.stats().groups[0];
        let per_nic: Vec<u64> = g.domains.iter().map(|d| d.unreported).collect();
        let sum = |f: fn(&kvroute_transport::DomainStats) -> u64| g.domains.iter().map(f).sum();
        (
            sum(|d| d.posted),
            sum(|d| d.completed),
            sum(|d| d.failed),
            per_nic,
            g.in_flight,
        )
    };
    // One reported write on each NIC first: libfabric's shm refuses posts to a peer until
    // the peer has read the endpoint's announcement, and a refused write takes the usual path.
    let warm = DoneCounter::new();
    for _ in 0..2 {
        a.submit_imm(30, dst.desc(), OnDone::from(&warm)).unwrap();
    }
    wait_for("the first writes", || warm.total() == 2);
    assert_eq!(warm.ok(), 2);
    wait_for("their completions counted", || sums(&a).1 == 2);

    let landed = b.imm_count(31, 100);
    for _ in 0..100 {
        a.submit_imm(31, dst.desc(), OnDone::nothing()).unwrap();
    }
    assert_eq!(block_on(landed), Ok(()));
    // The sender counts a post once it returns, which may be after the write landed.
    wait_for("the posts' count", || sums(&a).0 == 102);
    if !unreported {
        wait_for("the completions", || sums(&a).1 == 102);
    }
    let (_, completed, failed, per_nic, in_flight) = sums(&a);
    assert_eq!((failed, in_flight), (0, 0));
    let quiet = if unreported { 50 } else { 0 };
    assert_eq!(per_nic, vec![quiet, quiet], "spread over both NICs");
    assert_eq!(completed, 102 - 2 * quiet);

    // Someone waits: the write reports, as every write does.
    let sent = DoneCounter::new();
    let token = kvroute_transport::CancellationToken::new();
    let landed = b.imm_count(32, 11);
    for _ in 0..10 {
        a.submit_imm(32, dst.desc(), OnDone::from(&sent)).unwrap();
    }
    a.submit_imm(32, dst.desc(), OnDone::nothing().cancellable(&token))
        .unwrap();
    assert_eq!(block_on(landed), Ok(()));
    wait_for("ten completions", || sent.total() == 10);
    assert_eq!(sent.ok(), 10);
    wait_for("the reported writes' completions", || {
        sums(&a).1 == 113 - 2 * quiet
    });
    let (posted, _, failed, per_nic, _) = sums(&a);
    assert_eq!((posted, failed), (113, 0));
    assert_eq!(per_nic, vec![quiet, quiet], "no more went unreported");
}

pub(crate) fn unexpected_immediates(make: &Make<'_>) {
    let (a, b) = (make(1), make(1));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    b.on_unexpected_imm(move |imm, n| s.lock().unwrap().push((imm, n)));
    let queue = b.unexpected_imms();
    let dst = b.alloc_mr(8).unwrap();
    a.submit_imm(123, dst.desc(), OnDone::nothing()).unwrap();
    wait_for("the handler", || !seen.lock().unwrap().is_empty());
    assert_eq!(seen.lock().unwrap()[0], (123, 1));
    // The queue saw the same arrival, once, without the callback thread.
    assert_eq!(
        queue.recv_timeout(std::time::Duration::from_secs(5)),
        Ok(Some((123, 1)))
    );
    assert_eq!(queue.try_iter().next(), None);
    assert_eq!(b.take_imm(123), 1);
    assert_eq!(b.take_imm(123), 0);
    // An expected arrival fires its expectation and is not queued.
    let expected = b.imm_count(77, 1);
    a.submit_imm(77, dst.desc(), OnDone::nothing()).unwrap();
    assert_eq!(block_on(expected), Ok(()));
    a.submit_imm(124, dst.desc(), OnDone::nothing()).unwrap();
    assert_eq!(
        b.unexpected_imms()
            .recv_timeout(std::time::Duration::from_secs(5)),
        Ok(Some((124, 1))),
        "the next queued arrival is 124: 77 was expected"
    );
    assert_eq!(b.take_imm(124), 1);
}

pub(crate) fn scatter_and_barrier(make: &Make<'_>, peers: usize) {
    let sender = make(2);
    let n = peers;
    let peers: Vec<TransferEngine> = (0..n).map(|_| make(2)).collect();
    let bufs: Vec<_> = peers.iter().map(|p| p.alloc_mr(4096).unwrap()).collect();
    let group = sender
        .add_peer_group(
            &peers
                .iter()
                .map(TransferEngine::main_address)
                .collect::<Vec<_>>(),
        )
        .unwrap();
    let src = sender.alloc_mr(n * 64).unwrap();
    src.write_at(0, &pattern(n * 64, 5)).unwrap();
    let dsts: Vec<ScatterDst> = bufs
        .iter()
        .enumerate()
        .map(|(i, b)| ScatterDst {
            len: 64,
            src_offset: i as u64 * 64,
            dst: b.desc().clone(),
            dst_offset: 128,
        })
        .collect();
    let landed: Vec<_> = peers.iter().map(|p| p.imm_count(1, 1)).collect();
    let done = DoneFlag::new();
    sender
        .submit_scatter(
            Some(group),
            Some(1),
            src.handle(),
            &dsts,
            OnDone::from(&done),
        )
        .unwrap();
    for f in landed {
        assert_eq!(block_on(f), Ok(()));
    }
    wait_for("the scatter", || done.is_done());
    assert_eq!(done.result(), Some(Ok(())));
    let expect = pattern(n * 64, 5);
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(
            b.to_vec()[128..192],
            expect[i * 64..i * 64 + 64],
            "peer {i}"
        );
    }
    // The same without the group (per-target lookups), then a barrier to all.
    let again: Vec<_> = peers.iter().map(|p| p.imm_count(2, 1)).collect();
    sender
        .submit_scatter(None, Some(2), src.handle(), &dsts, OnDone::nothing())
        .unwrap();
    for f in again {
        assert_eq!(block_on(f), Ok(()));
    }
    let barrier: Vec<_> = peers.iter().map(|p| p.imm_count(3, 1)).collect();
    let descs: Vec<_> = bufs.iter().map(|b| b.desc().clone()).collect();
    sender
        .submit_barrier(Some(group), 3, &descs, OnDone::nothing())
        .unwrap();
    for f in barrier {
        assert_eq!(block_on(f), Ok(()));
    }
    let posted = || -> u64 {
        sender.stats().groups[0]
            .domains
            .iter()
            .map(|d| d.posted)
            .sum()
    };
    // The sender counts a post once it returns, which may be after the write landed.
    wait_for("the posts' count", || posted() >= n as u64 * 3);
    assert_eq!(posted(), n as u64 * 3);
}

pub(crate) fn messages_through_back_pressure(make: &Make<'_>) {
    let (a, b) = (make(1), make(1));
    let got = Arc::new(Mutex::new(Vec::new()));
    let g = got.clone();
    b.submit_recvs(64, 4, move |msg| {
        std::thread::sleep(std::time::Duration::from_micros(50));
        g.lock()
            .unwrap()
            .push(u32::from_le_bytes(msg[..4].try_into().unwrap()));
    })
    .unwrap();
    let sent = DoneCounter::new();
    for i in 0..500u32 {
        a.submit_send(&b.main_address(), &i.to_le_bytes(), OnDone::from(&sent))
            .unwrap();
    }
    wait_for("500 messages", || got.lock().unwrap().len() == 500);
    wait_for("500 send completions", || sent.total() == 500);
    assert_eq!(sent.ok(), 500);
    let mut got = got.lock().unwrap().clone();
    got.sort_unstable();
    assert_eq!(
        got,
        (0..500).collect::<Vec<_>>(),
        "none lost, none duplicated"
    );
}

/// A received message names its sender once the receiver has connected it, and no one before:
/// what a server checks a claimed address against.
pub(crate) fn messages_name_their_sender(make: &Make<'_>) {
    let (a, b, c) = (make(1), make(1), make(1));
    let got = Arc::new(Mutex::new(Vec::new()));
    let g = got.clone();
    b.submit_recvs_from(64, 4, move |msg, from| {
        g.lock().unwrap().push((msg[0], from.cloned()));
    })
    .unwrap();
    let sent = DoneCounter::new();
    a.submit_send(&b.main_address(), &[1], OnDone::from(&sent))
        .unwrap();
    wait_for("a's first message", || got.lock().unwrap().len() == 1);
    assert_eq!(
        got.lock().unwrap()[0],
        (1, None),
        "from a peer b has not connected"
    );
    // b connects a (a send to it does), and over shm, where a sends from an endpoint of its
    // own per peer, adopts that endpoint as a's.
    b.submit_send(&a.main_address(), &[9], OnDone::nothing())
        .unwrap_or_else(|e| panic!("b -> a: {e}"));
    if let Some(sender) = a.sender_address(&b.main_address()).unwrap() {
        b.adopt_sender(&a.main_address(), &sender).unwrap();
    }
    for (engine, tag) in [(&a, 2u8), (&c, 3), (&a, 4)] {
        engine
            .submit_send(&b.main_address(), &[tag], OnDone::from(&sent))
            .unwrap();
    }
    wait_for("three more messages", || got.lock().unwrap().len() == 4);
    // Messages from different senders may come in any order.
    let mut got = got.lock().unwrap().clone();
    got.sort_by_key(|m| m.0);
    let a_addr = Some(a.main_address());
    assert_eq!(got[1..], [(2, a_addr.clone()), (3, None), (4, a_addr)]);
}

pub(crate) fn callback_submits_into_its_engine(make: &Make<'_>) {
    let (a, b) = (make(1), make(1));
    let src = Arc::new(a.alloc_mr(64).unwrap());
    let dst = Arc::new(b.alloc_mr(64).unwrap());
    src.write_at(0, &[1; 64]).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let (a2, s2, d2) = (a.clone(), src.clone(), dst.clone());
    a.submit_single_write(
        8,
        None,
        (src.handle(), 0),
        (dst.desc(), 0),
        OnDone::callback(move |first| {
            // Re-entrant: submit from the callback thread and wait for that result there too.
            let (done, fut) = OnDone::future();
            a2.submit_single_write(8, None, (s2.handle(), 8), (d2.desc(), 8), done)
                .unwrap();
            let second = fut.wait();
            tx.send((first, second)).unwrap();
        }),
    )
    .unwrap();
    assert_eq!(rx.recv_timeout(TIMEOUT).unwrap(), (Ok(()), Ok(())));
    assert_eq!(&dst.to_vec()[..16], &[1; 16]);
    drop((src, dst));
    a.shutdown();
}

/// A long-lived engine that `peers` engines write to one after another, and that writes back
/// to each, releasing it with `disconnect` once done: it serves more peers than it could
/// while released peers kept their endpoints and mappings (`shm` refused every new peer after
/// 128). A released peer that is still alive is connected afresh by the next write to it,
/// and releasing an address that is not connected says so. (`shm` in libfabric 1.17 still
/// maps each peer that *sent* to an endpoint until the endpoint closes, 256 at most: past
/// 255 peers this fails there; docs/fabric.md.)
pub(crate) fn released_peers_free_their_resources(make: &Make<'_>, peers: usize) {
    let server = make(1);
    let src = server.alloc_mr(4096).unwrap();
    src.write_at(0, &pattern(4096, 7)).unwrap();
    let write = |dst: &kvroute_transport::RegisteredBuffer| {
        let (done, fut) = OnDone::future();
        server
            .submit_single_write(4096, None, (src.handle(), 0), (dst.desc(), 0), done)
            .unwrap();
        block_on(fut)
    };
    let inbox = server.alloc_mr(4096).unwrap();
    for i in 0..peers {
        let client = make(1);
        let dst = client.alloc_mr(4096).unwrap();
        // The peer writes first, as a requester does: the server learns of it on arrival.
        let (done, fut) = OnDone::future();
        client
            .submit_single_write(64, None, (dst.handle(), 0), (inbox.desc(), 0), done)
            .unwrap();
        block_on(fut).unwrap_or_else(|e| panic!("peer {i} to the server: {e}"));
        write(&dst).unwrap_or_else(|e| panic!("peer {i}: {e}"));
        assert_eq!(dst.to_vec(), pattern(4096, 7), "peer {i}");
        assert!(
            server.disconnect(&client.main_address()).unwrap(),
            "peer {i}"
        );
        if i == 0 {
            // Released, alive: the next write connects it again.
            dst.write_at(0, &[0; 4096]).unwrap();
            write(&dst).unwrap();
            assert_eq!(dst.to_vec(), pattern(4096, 7));
            assert!(server.disconnect(&client.main_address()).unwrap());
        }
        assert!(!server.disconnect(&client.main_address()).unwrap());
    }
}
