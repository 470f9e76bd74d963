//! Every bad input gets its typed error, and nothing is written: refused requests never reach
//! a NIC, and a forged descriptor that gets past the sender's checks is refused by the target.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{block_on, engine, wait_for};
use kvroute_transport::{
    DomainAddr, MemFabric, MrDesc, NetAddr, OnDone, Pages, RemoteKey, ScatterDst, Side,
    TransferEngine, TransferError, TransportError,
};

struct Pair {
    a: TransferEngine,
    b: TransferEngine,
    src: kvroute_transport::RegisteredBuffer,
    dst: kvroute_transport::RegisteredBuffer,
}

fn pair(fabric: &MemFabric) -> Pair {
    let (a, b) = (engine(fabric, 2), engine(fabric, 2));
    let src = a.alloc_mr(1024).unwrap();
    let dst = b.alloc_mr(1024).unwrap();
    src.fill(0xAA);
    Pair { a, b, src, dst }
}

fn untouched(p: &Pair) {
    assert_eq!(
        p.dst.to_vec(),
        vec![0; 1024],
        "the target must be untouched"
    );
    assert!(
        p.a.stats().groups[0].domains.iter().all(|d| d.posted == 0),
        "nothing may be posted"
    );
}

#[test]
fn out_of_range_writes_are_refused_on_either_side() {
    let fabric = MemFabric::new();
    let p = pair(&fabric);
    let write = |len, src_off, dst_off| {
        p.a.submit_single_write(
            len,
            None,
            (p.src.handle(), src_off),
            (p.dst.desc(), dst_off),
            OnDone::nothing(),
        )
    };
    assert_eq!(
        write(1025, 0, 0),
        Err(TransportError::OutOfBounds {
            side: Side::Source,
            offset: 0,
            len: 1025,
            region_len: 1024
        })
    );
    assert_eq!(
        write(8, 1020, 0),
        Err(TransportError::OutOfBounds {
            side: Side::Source,
            offset: 1020,
            len: 8,
            region_len: 1024
        })
    );
    assert_eq!(
        write(8, 0, 1017),
        Err(TransportError::OutOfBounds {
            side: Side::Destination,
            offset: 1017,
            len: 8,
            region_len: 1024
        })
    );
    assert!(
        matches!(
            write(8, u64::MAX, 0),
            Err(TransportError::OutOfBounds { .. })
        ),
        "no overflow"
    );
    assert_eq!(write(0, 0, 0), Err(TransportError::EmptyTransfer));
    untouched(&p);
}

#[test]
fn bad_pages_are_refused_before_any_page_is_posted() {
    let fabric = MemFabric::new();
    let p = pair(&fabric);
    let paged = |len, sp: &Pages, dp: &Pages| {
        p.a.submit_paged_writes(
            len,
            Some(1),
            (p.src.handle(), sp),
            (p.dst.desc(), dp),
            OnDone::nothing(),
        )
    };
    let ok = Pages::new(vec![0, 1, 2, 3], 128, 0);
    // One index past the end, after three good ones: the whole request is refused.
    let past_end = Pages::new(vec![0, 1, 2, 8], 128, 0);
    assert!(matches!(
        paged(128, &ok, &past_end),
        Err(TransportError::PageOutOfBounds {
            side: Side::Destination,
            index: 8,
            ..
        })
    ));
    assert!(matches!(
        paged(128, &past_end, &ok),
        Err(TransportError::PageOutOfBounds {
            side: Side::Source,
            index: 8,
            ..
        })
    ));
    let overlapping = Pages::new(vec![0, 1, 2, 3], 64, 0);
    assert_eq!(
        paged(128, &overlapping, &ok),
        Err(TransportError::StrideTooSmall {
            side: Side::Source,
            stride: 64,
            page_len: 128
        })
    );
    assert_eq!(
        paged(128, &ok, &Pages::new(vec![0, 1], 128, 0)),
        Err(TransportError::PageCountMismatch { src: 4, dst: 2 })
    );
    assert_eq!(
        paged(
            128,
            &Pages::new(Vec::new(), 128, 0),
            &Pages::new(Vec::new(), 128, 0)
        ),
        Err(TransportError::EmptyTransfer)
    );
    assert!(matches!(
        paged(0, &ok, &ok),
        Err(TransportError::InvalidArgument(_))
    ));
    untouched(&p);
}

#[test]
fn handles_of_other_engines_or_deregistered_regions_are_unknown() {
    let fabric = MemFabric::new();
    let p = pair(&fabric);
    let foreign = p.b.alloc_mr(64).unwrap();
    let err = p.a.submit_single_write(
        8,
        None,
        (foreign.handle(), 0),
        (p.dst.desc(), 0),
        OnDone::nothing(),
    );
    assert_eq!(err, Err(TransportError::UnknownRegion));
    let temp = p.a.alloc_mr(64).unwrap();
    let handle = *temp.handle();
    drop(temp);
    let err =
        p.a.submit_single_write(8, None, (&handle, 0), (p.dst.desc(), 0), OnDone::nothing());
    assert_eq!(
        err,
        Err(TransportError::UnknownRegion),
        "a handle that outlived its registration"
    );
    assert_eq!(p.a.dereg_mr(&handle), Err(TransportError::UnknownRegion));
    untouched(&p);
}

#[test]
fn descriptors_naming_other_nic_counts_providers_or_peers_are_refused() {
    let fabric = MemFabric::new();
    let p = pair(&fabric);
    let one_nic = engine(&fabric, 1);
    let small = one_nic.alloc_mr(1024).unwrap();
    let err = p.a.submit_single_write(
        8,
        None,
        (p.src.handle(), 0),
        (small.desc(), 0),
        OnDone::nothing(),
    );
    assert_eq!(
        err,
        Err(TransportError::NicCountMismatch {
            local: 2,
            remote: 1
        })
    );

    let mut verbs = p.dst.desc().clone();
    for k in &mut verbs.rkeys {
        k.nic.provider = "verbs".to_owned();
    }
    assert!(matches!(
        p.a.submit_single_write(8, None, (p.src.handle(), 0), (&verbs, 0), OnDone::nothing()),
        Err(TransportError::ProviderMismatch { .. })
    ));

    // NIC 1 of a known peer spliced into another peer's descriptor (checked by a third engine,
    // so `p.a` stays untouched): refused whichever peer the sender met first.
    let (third, other) = (engine(&fabric, 2), engine(&fabric, 2));
    let (third_src, other_buf) = (third.alloc_mr(64).unwrap(), other.alloc_mr(1024).unwrap());
    block_on(send_ok(&third, &third_src, other_buf.desc()));
    let mut spliced = p.dst.desc().clone();
    spliced.rkeys[1] = other_buf.desc().rkeys[1].clone();
    let err = third.submit_single_write(
        8,
        None,
        (third_src.handle(), 0),
        (&spliced, 0),
        OnDone::nothing(),
    );
    assert!(
        matches!(err, Err(TransportError::MalformedAddress(_))),
        "{err:?}"
    );
    block_on(send_ok(&third, &third_src, p.dst.desc()));
    let mut spliced = other_buf.desc().clone();
    spliced.rkeys[1] = p.dst.desc().rkeys[1].clone();
    let err = third.submit_single_write(
        8,
        None,
        (third_src.handle(), 0),
        (&spliced, 0),
        OnDone::nothing(),
    );
    assert!(
        matches!(err, Err(TransportError::MalformedAddress(_))),
        "{err:?}"
    );
    p.dst.fill(0);

    let garbage = MrDesc {
        addr: 0,
        len: 1024,
        rkeys: vec![
            RemoteKey {
                nic: DomainAddr {
                    provider: "mem".into(),
                    bytes: vec![1, 2]
                },
                rkey: 0
            };
            2
        ],
    };
    assert!(matches!(
        p.a.submit_single_write(
            8,
            None,
            (p.src.handle(), 0),
            (&garbage, 0),
            OnDone::nothing()
        ),
        Err(TransportError::MalformedAddress(_))
    ));
    assert!(
        p.a.submit_send(&NetAddr { nics: vec![] }, b"x", OnDone::nothing())
            .is_err()
    );
    untouched(&p);
}

/// A good 8-byte write from `engine`'s `src` to `dst`, resolving to Ok.
fn send_ok(
    engine: &TransferEngine,
    src: &kvroute_transport::RegisteredBuffer,
    dst: &MrDesc,
) -> impl std::future::Future<Output = ()> {
    let (done, fut) = OnDone::future();
    engine
        .submit_single_write(8, None, (src.handle(), 0), (dst, 0), done)
        .unwrap();
    async move { assert_eq!(fut.await, Ok(())) }
}

/// A forged descriptor passes the sender's checks (it claims a longer region, or presents a
/// wrong key) and is refused by the target like a NIC would: a remote access error through
/// OnDone, and the target memory untouched.
#[test]
fn forged_descriptors_and_wrong_rkeys_are_refused_by_the_target() {
    let fabric = MemFabric::new();
    let p = pair(&fabric);
    let mut longer = p.dst.desc().clone();
    longer.len = 1 << 20;
    let (done, fut) = OnDone::future();
    p.a.submit_single_write(512, None, (p.src.handle(), 0), (&longer, 4096), done)
        .unwrap();
    assert!(matches!(block_on(fut), Err(TransferError::RemoteAccess(_))));

    let mut wrong_key = p.dst.desc().clone();
    for k in &mut wrong_key.rkeys {
        k.rkey ^= 0xDEAD;
    }
    let (done, fut) = OnDone::future();
    p.a.submit_single_write(1024, Some(9), (p.src.handle(), 0), (&wrong_key, 0), done)
        .unwrap();
    assert!(matches!(block_on(fut), Err(TransferError::RemoteAccess(_))));

    let (done, fut) = OnDone::future();
    p.a.submit_imm(9, &wrong_key, done).unwrap();
    assert!(matches!(block_on(fut), Err(TransferError::RemoteAccess(_))));
    assert_eq!(p.dst.to_vec(), vec![0; 1024], "the target is untouched");
    assert_eq!(p.b.pending_imm(9), 0, "and counts no immediate");
}

#[test]
fn scatter_and_barrier_targets_must_match_their_peer_group() {
    let fabric = MemFabric::new();
    let p = pair(&fabric);
    let c = engine(&fabric, 2);
    let c_buf = c.alloc_mr(1024).unwrap();
    let group = p.a.add_peer_group(&[p.b.main_address()]).unwrap();
    let to = |desc: &MrDesc| ScatterDst {
        len: 8,
        src_offset: 0,
        dst: desc.clone(),
        dst_offset: 0,
    };
    let err = p.a.submit_scatter(
        Some(group),
        None,
        p.src.handle(),
        &[to(c_buf.desc())],
        OnDone::nothing(),
    );
    assert_eq!(err, Err(TransportError::NotInPeerGroup { index: 0 }));
    let err = p.a.submit_scatter(
        Some(group),
        None,
        p.src.handle(),
        &[to(p.dst.desc()), to(p.dst.desc())],
        OnDone::nothing(),
    );
    assert_eq!(
        err,
        Err(TransportError::PeerGroupSizeMismatch { given: 2, group: 1 })
    );
    let err =
        p.a.submit_barrier(Some(group), 1, &[c_buf.desc().clone()], OnDone::nothing());
    assert_eq!(err, Err(TransportError::NotInPeerGroup { index: 0 }));
    let err = p.a.submit_scatter(
        None,
        None,
        p.src.handle(),
        &[ScatterDst {
            len: 2000,
            ..to(p.dst.desc())
        }],
        OnDone::nothing(),
    );
    assert!(matches!(err, Err(TransportError::OutOfBounds { .. })));
    assert_eq!(
        p.a.submit_scatter(None, None, p.src.handle(), &[], OnDone::nothing()),
        Err(TransportError::EmptyTransfer)
    );
    let stranger = kvroute_transport::PeerGroupHandle::clone(&group);
    let other_engine = engine(&fabric, 2);
    let src2 = other_engine.alloc_mr(64).unwrap();
    assert_eq!(
        other_engine.submit_scatter(
            Some(stranger),
            None,
            src2.handle(),
            &[to(p.dst.desc())],
            OnDone::nothing()
        ),
        Err(TransportError::UnknownPeerGroup)
    );
    assert!(p.a.add_peer_group(&[]).is_err());
    untouched(&p);
}

#[test]
fn oversized_sends_second_receive_pools_and_empty_pools_are_refused() {
    let fabric = MemFabric::new();
    let p = pair(&fabric);
    let big = vec![0u8; (1 << 20) + 1];
    assert!(matches!(
        p.a.submit_send(&p.b.main_address(), &big, OnDone::nothing()),
        Err(TransportError::MessageTooLarge { .. })
    ));
    p.b.submit_recvs(16, 2, |_| {}).unwrap();
    assert_eq!(
        p.b.submit_recvs(16, 2, |_| {}),
        Err(TransportError::AlreadyReceiving)
    );
    assert!(p.a.submit_recvs(0, 2, |_| {}).is_err());
    // A message larger than the receiver's buffers fails at the sender; the buffer survives.
    let (done, fut) = OnDone::future();
    p.a.submit_send(&p.b.main_address(), &[1; 32], done)
        .unwrap();
    assert_eq!(block_on(fut), Err(TransferError::RemoteBufferTooSmall));
    let (done, fut) = OnDone::future();
    p.a.submit_send(&p.b.main_address(), &[1; 16], done)
        .unwrap();
    assert_eq!(block_on(fut), Ok(()));
    wait_for("the good message's buffer to come back", || true);
}

#[test]
fn buffer_views_are_bounds_checked() {
    let fabric = MemFabric::new();
    let p = pair(&fabric);
    // SAFETY (all views below): no peer writes into these buffers in this test, and each
    // mutable view is the only view while it lives.
    unsafe {
        assert!(p.src.bytes(1000, 25).is_err(), "past the end");
        assert!(p.src.bytes(usize::MAX, 2).is_err(), "overflowing offset");
        assert!(p.src.u16s(1, 2).is_err(), "odd offset for a u16 view");
        assert!(p.src.u16s(0, usize::MAX).is_err(), "overflowing length");
        assert!(p.dst.bytes_mut(1020, 8).is_err());
        assert_eq!(p.src.bytes(1000, 24).unwrap(), &[0xAA; 24][..]);
        p.dst
            .bytes_mut(8, 4)
            .unwrap()
            .copy_from_slice(&[1, 2, 3, 4]);
        assert_eq!(p.dst.u16s(8, 2).unwrap(), &[0x0201, 0x0403][..]);
    }
    let mut back = [0u8; 4];
    p.dst.read_at(8, &mut back).unwrap();
    assert_eq!(back, [1, 2, 3, 4]);
}

/// A grant opens just its bytes of a buffer peers may not write, and only while it lives: a
/// write through it lands, one past its end or through the buffer's own descriptor is
/// refused by the target, and once it is dropped a write through its descriptor is refused
/// too. The memory outlives the buffer while a grant onto it does.
#[test]
fn a_grant_opens_its_bytes_of_a_local_buffer_and_closes_when_dropped() {
    use kvroute_transport::Access;
    let fabric = MemFabric::new();
    let (a, b) = (engine(&fabric, 2), engine(&fabric, 2));
    let src = a.alloc_mr(1024).unwrap();
    src.fill(0xAA);
    let dst = b.alloc_mr_with(4096, Access::Local).unwrap();
    let write = |to: &MrDesc, offset: u64, len: u64| {
        let (done, fut) = OnDone::future();
        a.submit_single_write(len, None, (src.handle(), 0), (to, offset), done)
            .unwrap();
        block_on(fut)
    };
    // The buffer's own descriptor is no way in.
    assert!(matches!(
        write(dst.desc(), 0, 64),
        Err(TransferError::RemoteAccess(_))
    ));
    let grant = dst.grant(1024, 512).unwrap();
    assert_eq!((grant.offset(), grant.len()), (1024, 512));
    assert_ne!(grant.desc().rkeys[0].rkey, dst.desc().rkeys[0].rkey);
    assert_eq!(write(grant.desc(), 0, 512), Ok(()));
    // Past its end, as a forged descriptor claiming more would have it.
    let mut longer = grant.desc().clone();
    longer.len = 4096;
    assert!(matches!(
        write(&longer, 256, 512),
        Err(TransferError::RemoteAccess(_))
    ));
    let mut expected = vec![0u8; 4096];
    expected[1024..1536].fill(0xAA);
    assert_eq!(dst.to_vec(), expected);
    let given = grant.desc().clone();
    drop(grant);
    assert!(matches!(
        write(&given, 0, 64),
        Err(TransferError::RemoteAccess(_))
    ));
    assert_eq!(
        dst.to_vec(),
        expected,
        "nothing lands once the grant is gone"
    );
    // Out of the buffer's range: refused before anything is registered.
    assert!(matches!(
        dst.grant(4000, 512),
        Err(TransportError::OutOfBounds {
            side: Side::Destination,
            ..
        })
    ));
    // The memory stays while a grant onto it lives, and its window still works.
    let grant = dst.grant(0, 64).unwrap();
    drop(dst);
    assert_eq!(write(grant.desc(), 0, 64), Ok(()));
}
