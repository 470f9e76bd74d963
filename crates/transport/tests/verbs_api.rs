//! The verbs domain over the fake verbs provider (in-process queue pairs, completion queues,
//! shared receive queues and memory regions that enforce what a ConnectX enforces): every API
//! call through the shared suite the `mem` and libfabric domains pass, with and without
//! delayed, reordered deliveries; then what is particular to verbs (chains of four writes per
//! doorbell, queue-pair states, a bad rkey, a vanished peer) and how a machine without an
//! RDMA device refuses it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::{block_on, pattern, suite};
use kvroute_transport::domain::{Domain, WriteWr};
use kvroute_transport::verbs::fake::{FakeFabric, FakeFaults};
use kvroute_transport::verbs::{
    MrAccess, QpAttr, QpKind, QpState, Verbs, VerbsConfig, VerbsDomain, VerbsError,
};
use kvroute_transport::{
    Access, EngineConfig, OnDone, TransferEngine, TransferError, TransportError,
};

fn make_on(fabric: &FakeFabric, faults: FakeFaults) -> impl Fn(usize) -> TransferEngine + '_ {
    move |nics| {
        TransferEngine::verbs_fake(
            fabric,
            nics,
            faults,
            &VerbsConfig::default(),
            EngineConfig::default(),
        )
        .unwrap()
    }
}

macro_rules! suite_over {
    ($module:ident, $faults:expr) => {
        mod $module {
            use super::*;

            fn run(test: impl FnOnce(&dyn Fn(usize) -> TransferEngine)) {
                let fabric = FakeFabric::new();
                let make = make_on(&fabric, $faults);
                test(&make);
            }

            #[test]
            fn a_single_write_lands_and_every_kind_of_on_done_sees_it() {
                run(|m| suite::single_write_with_every_on_done(m));
            }

            #[test]
            fn a_large_write_shards_over_four_nics_each_with_its_own_rkey() {
                run(|m| suite::large_write_sharded_over_nics(m, 4));
            }

            #[test]
            fn paged_writes_land_where_the_indices_say_and_fire_the_expectation_once() {
                run(|m| suite::paged_writes(m));
            }

            #[test]
            fn arrivals_before_the_expectation_count_and_the_excess_carries_over() {
                run(|m| suite::arrivals_before_the_expectation(m));
            }

            #[test]
            fn unexpected_immediates_reach_the_handler_and_stay_claimable() {
                run(|m| suite::unexpected_immediates(m));
            }

            #[test]
            fn immediates_nobody_waits_on_complete_as_usual() {
                run(|m| suite::immediates_nobody_waits_on(m, false));
            }

            #[test]
            fn scatter_and_barrier_reach_a_group_of_16_peers() {
                run(|m| suite::scatter_and_barrier(m, 16));
            }

            #[test]
            fn more_messages_than_receive_buffers_all_arrive_through_back_pressure() {
                run(|m| suite::messages_through_back_pressure(m));
            }

            #[test]
            fn messages_name_their_sender_once_it_is_connected() {
                run(|m| suite::messages_name_their_sender(m));
            }

            #[test]
            fn a_callback_may_submit_into_its_engine_without_deadlock() {
                run(|m| suite::callback_submits_into_its_engine(m));
            }

            #[test]
            fn released_peers_free_their_resources() {
                run(|m| suite::released_peers_free_their_resources(m, 64));
            }
        }
    };
}

suite_over!(prompt, FakeFaults::NONE);
suite_over!(
    delayed_and_reordered,
    FakeFaults {
        seed: 7,
        max_delay: Duration::from_micros(300),
        fail_one_in: 0,
    }
);

fn attr(state: QpState) -> QpAttr {
    QpAttr {
        state,
        port: 1,
        remote_write: true,
        qkey: 0,
        dest: None,
        dest_qp_num: 0,
        rq_psn: 0,
        sq_psn: 0,
        mtu: 4096,
        sgid_index: 0,
        traffic_class: 0,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        min_rnr_timer: 12,
    }
}

/// Two domains on one fake switch, connected: the handshake runs through their polls.
fn connected_pair(fabric: &FakeFabric) -> (VerbsDomain<impl Verbs>, VerbsDomain<impl Verbs>, u32) {
    let mut a = VerbsDomain::new(fabric.device(), VerbsConfig::default()).unwrap();
    let mut b = VerbsDomain::new(fabric.device(), VerbsConfig::default()).unwrap();
    let peer = a.connect(&b.address()).unwrap();
    let mut out = Vec::new();
    let started = Instant::now();
    while a.verbs().qp_state(a.queue_pairs(peer).unwrap().1) != Some(QpState::Rts) {
        a.poll(&mut out, 64);
        b.poll(&mut out, 64);
        assert!(started.elapsed() < Duration::from_secs(5), "no handshake");
    }
    (a, b, peer)
}

#[test]
fn four_writes_to_one_peer_go_as_one_chain_rung_with_one_doorbell() {
    let fabric = FakeFabric::new();
    let (mut a, mut b, peer) = connected_pair(&fabric);
    let mut src = vec![7u8; 4096];
    let mut dst = vec![0u8; 4096];
    // SAFETY: both buffers outlive the domains' use of them (the test polls to completion).
    let s = unsafe {
        a.register(
            src.as_mut_ptr() as u64,
            4096,
            kvroute_transport::Device::Host,
            Access::Local,
        )
    }
    .unwrap();
    let d = unsafe {
        b.register(
            dst.as_mut_ptr() as u64,
            4096,
            kvroute_transport::Device::Host,
            Access::RemoteWrite,
        )
    }
    .unwrap();
    let wr = |i: u64| WriteWr {
        wr_id: i,
        peer,
        src_addr: src.as_ptr() as u64 + i * 512,
        lkey: s.lkey,
        len: 512,
        dst_addr: d.remote_addr + i * 512,
        rkey: d.rkey,
        imm: Some(5),
    };
    let wrs: Vec<WriteWr> = (0..8).map(wr).collect();
    let before = a.verbs().doorbells();
    assert_eq!(a.post_writes(&wrs).unwrap(), 8);
    assert_eq!(
        a.verbs().doorbells() - before,
        2,
        "8 writes = 2 chains of 4"
    );
    let (mut done, mut arrived) = (0, 0);
    let mut out = Vec::new();
    let started = Instant::now();
    while done < 8 || arrived < 8 {
        out.clear();
        a.poll(&mut out, 64);
        b.poll(&mut out, 64);
        for c in &out {
            match c.kind {
                kvroute_transport::domain::CompletionKind::Write => {
                    assert_eq!(c.result, Ok(()));
                    done += 1;
                }
                kvroute_transport::domain::CompletionKind::Arrival { imm } => {
                    assert_eq!(imm, 5);
                    arrived += 1;
                }
                _ => {}
            }
        }
        assert!(started.elapsed() < Duration::from_secs(5));
    }
    assert!(dst.iter().all(|&x| x == 7));
}

#[test]
fn queue_pair_states_refuse_what_they_do_not_allow() {
    let fabric = FakeFabric::new();
    let mut v = fabric.device();
    let qpn = v.create_qp(QpKind::Rc, None, 16).unwrap();
    let mut buf = vec![0u8; 64];
    let (lkey, _) = unsafe {
        v.reg_mr(
            buf.as_mut_ptr() as u64,
            64,
            MrAccess {
                remote_write: false,
                relaxed_ordering: false,
            },
        )
    }
    .unwrap();
    let send = kvroute_transport::verbs::SendWr {
        wr_id: 1,
        sge: kvroute_transport::verbs::Sge {
            addr: buf.as_ptr() as u64,
            len: 8,
            lkey,
        },
        op: kvroute_transport::verbs::SendOp::Send,
        signaled: true,
    };
    // RESET: no sends, no skipping to RTS.
    assert!(matches!(
        unsafe { v.post_send(qpn, &[send]) },
        Err(VerbsError::QpState {
            state: QpState::Reset,
            ..
        })
    ));
    assert!(matches!(
        v.modify_qp(qpn, &attr(QpState::Rts)),
        Err(VerbsError::QpState { .. })
    ));
    v.modify_qp(qpn, &attr(QpState::Init)).unwrap();
    // INIT -> RTR needs the remote queue pair.
    assert!(matches!(
        v.modify_qp(qpn, &attr(QpState::Rtr)),
        Err(VerbsError::Invalid(_))
    ));
    assert!(matches!(
        unsafe { v.post_send(qpn, &[send]) },
        Err(VerbsError::QpState {
            state: QpState::Init,
            ..
        })
    ));
    let mut rtr = attr(QpState::Rtr);
    rtr.dest = Some(v.port_addr());
    rtr.dest_qp_num = qpn + 1000;
    v.modify_qp(qpn, &rtr).unwrap();
    let mut bad = attr(QpState::Rts);
    bad.retry_cnt = 9;
    assert!(v.modify_qp(qpn, &bad).is_err());
    v.modify_qp(qpn, &attr(QpState::Rts)).unwrap();
    // In RTS, a send to a queue pair that does not exist exhausts its retries and the pair
    // goes to ERROR; later work is flushed.
    unsafe {
        v.post_send(
            qpn,
            &[send, kvroute_transport::verbs::SendWr { wr_id: 2, ..send }],
        )
    }
    .unwrap();
    let mut wcs = Vec::new();
    v.poll_cq(&mut wcs, 8);
    assert_eq!(wcs.len(), 2, "{wcs:?}");
    assert_eq!(
        wcs[0].status,
        kvroute_transport::verbs::WcStatus::RetryExceeded
    );
    assert_eq!(wcs[1].status, kvroute_transport::verbs::WcStatus::Flushed);
    assert_eq!(v.qp_state(qpn), Some(QpState::Error));
    drop(buf);
}

#[test]
fn a_bad_rkey_is_a_typed_remote_access_error_and_writes_nothing() {
    let fabric = FakeFabric::new();
    let make = make_on(&fabric, FakeFaults::NONE);
    let (a, b) = (make(1), make(1));
    let src = a.alloc_mr(4096).unwrap();
    src.write_at(0, &pattern(4096, 3)).unwrap();
    let dst = b.alloc_mr(4096).unwrap();
    let local = b.alloc_mr_with(4096, Access::Local).unwrap();
    let mut forged = dst.desc().clone();
    forged.rkeys[0].rkey ^= 0x5a5a;
    for (what, desc) in [
        ("a wrong rkey", forged),
        ("a local-only region", local.desc().clone()),
    ] {
        let (done, fut) = OnDone::future();
        a.submit_single_write(4096, Some(9), (src.handle(), 0), (&desc, 0), done)
            .unwrap();
        match block_on(fut) {
            Err(TransferError::RemoteAccess(_)) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
    assert!(dst.to_vec().iter().all(|&x| x == 0) && local.to_vec().iter().all(|&x| x == 0));
    assert_eq!(b.pending_imm(9), 0);
    // The refusals broke the pair; it was replaced, and the true descriptor works.
    let (done, fut) = OnDone::future();
    a.submit_single_write(4096, Some(9), (src.handle(), 0), (dst.desc(), 0), done)
        .unwrap();
    assert_eq!(block_on(fut), Ok(()));
    assert_eq!(dst.to_vec(), pattern(4096, 3));
}

#[test]
fn a_vanished_peer_fails_writes_as_unreachable() {
    let fabric = FakeFabric::new();
    let make = make_on(&fabric, FakeFaults::NONE);
    let (a, b) = (make(1), make(1));
    let src = a.alloc_mr(4096).unwrap();
    let dst = b.alloc_mr(4096).unwrap();
    let (done, fut) = OnDone::future();
    a.submit_single_write(64, Some(1), (src.handle(), 0), (dst.desc(), 0), done)
        .unwrap();
    assert_eq!(block_on(fut), Ok(()));
    let desc = dst.desc().clone();
    b.shutdown();
    drop(dst);
    drop(b);
    let (done, fut) = OnDone::future();
    a.submit_single_write(64, Some(1), (src.handle(), 0), (&desc, 0), done)
        .unwrap();
    assert_eq!(block_on(fut), Err(TransferError::PeerUnreachable));
}

#[test]
fn without_an_rdma_device_the_verbs_engine_names_what_is_missing() {
    match TransferEngine::verbs(&VerbsConfig::default(), EngineConfig::default()) {
        Err(TransportError::ProviderUnavailable(why)) => {
            assert!(why.contains("verbs"), "{why}");
            assert!(
                why.contains("libibverbs") || why.contains("no RDMA device"),
                "{why}"
            );
        }
        Ok(_) => panic!("no verbs engine can open here"),
        Err(other) => panic!("{other:?}"),
    }
    let bad = VerbsConfig {
        mtu: 3000,
        ..VerbsConfig::default()
    };
    assert!(matches!(
        TransferEngine::verbs(&bad, EngineConfig::default()),
        Err(TransportError::InvalidArgument(_))
    ));
}

/// Device memory through the dma-buf path: an engine whose second group serves "CUDA device
/// 0" (host memory standing in, exported by the fake) registers it with `reg_dmabuf_mr`, and
/// a peer's write lands in it; a device the engine has no group for is refused.
#[test]
fn device_memory_registers_as_a_dma_buf_and_takes_writes() {
    use kvroute_transport::Device;
    let fabric = FakeFabric::new();
    let config = VerbsConfig::default();
    let gpu = TransferEngine::builder()
        .group(
            Device::Host,
            vec![VerbsDomain::new(fabric.device(), config.clone()).unwrap()],
        )
        .group(
            Device::Cuda { ordinal: 0 },
            vec![
                VerbsDomain::with_dmabuf(
                    fabric.device(),
                    config.clone(),
                    Box::new(fabric.dmabuf_exporter(0)),
                )
                .unwrap(),
            ],
        )
        .build()
        .unwrap();
    let peer = make_on(&fabric, FakeFaults::NONE)(1);
    // "Device memory": an allocation the test owns, unaligned inside its pages.
    let mut device_mem = vec![0u8; 3 * 4096];
    let (ptr, len) = (device_mem.as_mut_ptr().wrapping_add(100), 8192);
    // SAFETY: `device_mem` outlives the registration (deregistered below).
    let (handle, desc) = unsafe { gpu.reg_mr(ptr, len, Device::Cuda { ordinal: 0 }) }.unwrap();
    let src = peer.alloc_mr(len).unwrap();
    src.write_at(0, &pattern(len, 5)).unwrap();
    let (done, fut) = OnDone::future();
    peer.submit_single_write(len as u64, Some(3), (src.handle(), 0), (&desc, 0), done)
        .unwrap();
    assert_eq!(block_on(fut), Ok(()));
    assert_eq!(device_mem[100..100 + len], pattern(len, 5)[..]);
    gpu.dereg_mr(&handle).unwrap();
    // SAFETY: as above.
    let refused = unsafe { gpu.reg_mr(ptr, len, Device::Cuda { ordinal: 1 }) };
    assert!(
        matches!(refused, Err(TransportError::UnsupportedDevice(_))),
        "{refused:?}"
    );
    drop(device_mem);
}

/// Without an NVIDIA driver the CUDA exporter says so (the path runs where a GPU is).
#[cfg(feature = "cuda")]
#[test]
fn the_cuda_exporter_names_a_missing_driver() {
    match kvroute_transport::verbs::cuda::CudaDmaBuf::new(0) {
        Err(TransportError::ProviderUnavailable(why)) => assert!(why.contains("cuda"), "{why}"),
        Ok(_) => {} // a machine with a GPU and dma-buf support
        Err(other) => panic!("{other:?}"),
    }
}

/// A send queue of 4 and 300 writes submitted before the pair is connected: what waits for
/// the handshake, then for room in the queue, is all posted as completions free it.
#[test]
fn a_small_send_queue_drains_everything_that_waited() {
    let fabric = FakeFabric::new();
    let config = VerbsConfig {
        sq_depth: 4,
        ..VerbsConfig::default()
    };
    let make = |_| {
        TransferEngine::verbs_fake(
            &fabric,
            1,
            FakeFaults::NONE,
            &config,
            EngineConfig::default(),
        )
        .unwrap()
    };
    let (a, b) = (make(1), make(1));
    let src = a.alloc_mr(300 * 64).unwrap();
    src.write_at(0, &pattern(300 * 64, 9)).unwrap();
    let dst = b.alloc_mr(300 * 64).unwrap();
    let landed = b.imm_count(4, 300);
    for i in 0..300u64 {
        a.submit_single_write(
            64,
            Some(4),
            (src.handle(), i * 64),
            (dst.desc(), i * 64),
            OnDone::nothing(),
        )
        .unwrap();
    }
    assert_eq!(block_on(landed), Ok(()));
    assert_eq!(dst.to_vec(), pattern(300 * 64, 9));
}
