//! The `mem` domain through the [`Domain`] trait alone, as a NIC: what lands, what is refused,
//! and that refused writes leave the target untouched.

use std::time::{Duration, Instant};

use super::*;
use crate::domain::{Completion, CompletionKind, Domain, RecvWr, Registration, SendWr, WriteWr};
use crate::error::TransferError;
use crate::mr::{Access, Device};

struct Nic {
    domain: MemDomain,
    memory: Vec<u8>,
    reg: Registration,
}

fn nic(fabric: &MemFabric, len: usize, fill: u8) -> Nic {
    let mut domain = fabric.domain();
    let memory = vec![fill; len];
    // SAFETY: `memory` is moved into the returned Nic with the domain and outlives every use;
    // its heap buffer does not move.
    let reg = unsafe {
        domain.register(
            memory.as_ptr() as u64,
            len as u64,
            Device::Host,
            Access::RemoteWrite,
        )
    }
    .unwrap();
    Nic {
        domain,
        memory,
        reg,
    }
}

fn write(
    src: &Nic,
    peer: u32,
    src_off: u64,
    dst: &Nic,
    dst_off: u64,
    len: u64,
    imm: Option<u32>,
) -> WriteWr {
    WriteWr {
        wr_id: 7,
        peer,
        src_addr: src.reg.remote_addr + src_off,
        lkey: src.reg.lkey,
        len,
        dst_addr: dst.reg.remote_addr + dst_off,
        rkey: dst.reg.rkey,
        imm,
    }
}

fn poll_all(d: &mut MemDomain) -> Vec<Completion> {
    let mut out = Vec::new();
    d.poll(&mut out, 1024);
    out
}

#[test]
fn a_write_lands_byte_exact_and_its_immediate_arrives_after_it() {
    let fabric = MemFabric::new();
    let mut a = nic(&fabric, 64, 0xAB);
    let mut b = nic(&fabric, 64, 0);
    let peer = a.domain.connect(&b.domain.address()).unwrap();
    let wr = write(&a, peer, 8, &b, 16, 32, Some(5));
    assert_eq!(
        a.domain
            .post_writes(&[wr, WriteWr { imm: Some(5), ..wr }])
            .unwrap(),
        2
    );
    assert_eq!(
        b.memory[16..48],
        [0; 32],
        "posting queues; the copy runs when the NIC is polled"
    );
    let sender = poll_all(&mut a.domain);
    assert_eq!(&b.memory[16..48], &[0xAB; 32]);
    assert_eq!(&b.memory[..16], &[0; 16]);
    assert_eq!(
        sender,
        [Completion {
            wr_id: 7,
            count: 2,
            kind: CompletionKind::Write,
            result: Ok(())
        }]
    );
    let receiver = poll_all(&mut b.domain);
    assert_eq!(
        receiver,
        [Completion {
            wr_id: 0,
            count: 2,
            kind: CompletionKind::Arrival { imm: 5 },
            result: Ok(())
        }]
    );
}

#[test]
fn a_local_region_refuses_peer_writes_but_serves_as_a_source() {
    let fabric = MemFabric::new();
    let mut a = nic(&fabric, 64, 0xCD);
    let mut b = nic(&fabric, 64, 0);
    let peer = a.domain.connect(&b.domain.address()).unwrap();
    // A second registration of b's memory, local only: its key reaches the same bytes.
    // SAFETY: `b.memory` outlives the domain's use of it (both live to the end of the test).
    let local = unsafe {
        b.domain
            .register(b.memory.as_ptr() as u64, 64, Device::Host, Access::Local)
    }
    .unwrap();
    let refused = WriteWr {
        rkey: local.rkey,
        ..write(&a, peer, 0, &b, 0, 16, Some(5))
    };
    assert_eq!(a.domain.post_writes(&[refused]).unwrap(), 1);
    let completions = poll_all(&mut a.domain);
    assert!(
        matches!(&completions[..], [c] if matches!(&c.result, Err(TransferError::RemoteAccess(why)) if why.contains("not remotely writable"))),
        "{completions:?}"
    );
    assert_eq!(b.memory, vec![0; 64], "the local region is untouched");
    assert!(poll_all(&mut b.domain).is_empty(), "no immediate");
    // As the source of b's own write it works.
    let back = b.domain.connect(&a.domain.address()).unwrap();
    let out = WriteWr {
        wr_id: 8,
        peer: back,
        src_addr: local.remote_addr,
        lkey: local.lkey,
        len: 8,
        dst_addr: a.reg.remote_addr,
        rkey: a.reg.rkey,
        imm: None,
    };
    assert_eq!(b.domain.post_writes(&[out]).unwrap(), 1);
    let done = poll_all(&mut b.domain);
    assert!(
        done.iter().all(|c| c.result.is_ok()) && !done.is_empty(),
        "{done:?}"
    );
    assert_eq!(a.memory[..8], [0; 8], "b's zeros landed in a");
}

#[test]
fn wrong_stale_or_out_of_range_keys_are_remote_access_errors_and_touch_nothing() {
    let fabric = MemFabric::new();
    let mut a = nic(&fabric, 64, 0xCD);
    let mut b = nic(&fabric, 64, 0);
    let peer = a.domain.connect(&b.domain.address()).unwrap();
    let good = write(&a, peer, 0, &b, 0, 16, Some(1));
    let forged = [
        WriteWr {
            rkey: good.rkey ^ 0xFFFF,
            ..good
        }, // wrong key
        WriteWr {
            dst_addr: good.dst_addr + 60,
            ..good
        }, // past the end (a forged length)
        WriteWr {
            dst_addr: good.dst_addr - 1,
            ..good
        }, // before the start
    ];
    assert_eq!(a.domain.post_writes(&forged).unwrap(), 3);
    let completions = poll_all(&mut a.domain);
    assert_eq!(completions.iter().map(|c| c.count).sum::<u32>(), 3);
    assert!(
        completions
            .iter()
            .all(|c| matches!(c.result, Err(TransferError::RemoteAccess(_))))
    );
    assert_eq!(b.memory, vec![0; 64], "the target is untouched");
    assert!(
        poll_all(&mut b.domain).is_empty(),
        "no immediate for a refused write"
    );

    // A key that outlived its region is stale, even after the slot is reused.
    b.domain.deregister(b.reg.rkey).unwrap();
    // SAFETY: b.memory outlives the registration.
    let again = unsafe {
        b.domain.register(
            b.memory.as_ptr() as u64,
            64,
            Device::Host,
            Access::RemoteWrite,
        )
    }
    .unwrap();
    assert_ne!(again.rkey, good.rkey);
    a.domain.post_writes(&[good]).unwrap();
    assert!(matches!(
        poll_all(&mut a.domain)[0].result,
        Err(TransferError::RemoteAccess(_))
    ));
    assert_eq!(b.memory, vec![0; 64]);
}

#[test]
fn completions_of_a_run_are_coalesced_in_order_around_a_refused_write() {
    let fabric = MemFabric::new();
    let mut a = nic(&fabric, 64, 0xEE);
    let mut b = nic(&fabric, 64, 0);
    let peer = a.domain.connect(&b.domain.address()).unwrap();
    let page = |i: u64| write(&a, peer, i * 8, &b, i * 8, 8, Some(3));
    let refused = WriteWr {
        rkey: page(2).rkey ^ 1,
        ..page(2)
    };
    let other = WriteWr {
        wr_id: 8,
        ..page(4)
    };
    let batch = [page(0), page(1), refused, page(3), other];
    assert_eq!(a.domain.post_writes(&batch).unwrap(), 5);
    let ok = |wr_id, count| Completion {
        wr_id,
        count,
        kind: CompletionKind::Write,
        result: Ok(()),
    };
    let completions = poll_all(&mut a.domain);
    assert_eq!(completions.len(), 4, "{completions:?}");
    assert_eq!(completions[0], ok(7, 2));
    assert_eq!(completions[1].count, 1);
    assert!(matches!(
        completions[1].result,
        Err(TransferError::RemoteAccess(_))
    ));
    assert_eq!(completions[2], ok(7, 1));
    assert_eq!(completions[3], ok(8, 1));
    assert_eq!(b.memory[..16], [0xEE; 16]);
    assert_eq!(b.memory[16..24], [0; 8], "the refused page is untouched");
    assert_eq!(b.memory[24..40], [0xEE; 16]);
    let arrivals: u32 = poll_all(&mut b.domain).iter().map(|c| c.count).sum();
    assert_eq!(arrivals, 4, "one immediate per landed write");
}

#[test]
fn a_bad_source_refuses_the_whole_batch() {
    let fabric = MemFabric::new();
    let mut a = nic(&fabric, 64, 1);
    let b = nic(&fabric, 64, 0);
    let peer = a.domain.connect(&b.domain.address()).unwrap();
    let good = write(&a, peer, 0, &b, 0, 8, None);
    let bad = WriteWr { len: 65, ..good };
    assert!(a.domain.post_writes(&[good, bad]).is_err());
    poll_all(&mut a.domain);
    assert_eq!(b.memory, vec![0; 64], "nothing of the batch was posted");
    assert!(
        a.domain
            .post_writes(&[WriteWr { peer: 99, ..good }])
            .is_err()
    );
}

#[test]
fn a_full_send_queue_accepts_fewer_and_drains_when_polled() {
    let fabric = MemFabric::new();
    let mut a = nic(&fabric, 8, 1);
    let b = nic(&fabric, 8, 0);
    let peer = a.domain.connect(&b.domain.address()).unwrap();
    let wrs = vec![write(&a, peer, 0, &b, 0, 8, Some(2)); SEND_QUEUE_DEPTH + 10];
    assert_eq!(
        a.domain.post_writes(&wrs).unwrap(),
        SEND_QUEUE_DEPTH,
        "the queue is full at its depth"
    );
    assert_eq!(a.domain.post_writes(&wrs[..5]).unwrap(), 0);
    assert!(
        a.domain.next_deadline().is_some(),
        "queued work is due at once"
    );
    let done: u32 = poll_all(&mut a.domain).iter().map(|c| c.count).sum();
    assert_eq!(done as usize, SEND_QUEUE_DEPTH);
    assert_eq!(
        a.domain.post_writes(&wrs[..5]).unwrap(),
        5,
        "room again after the NIC ran"
    );
}

#[test]
fn deregistering_a_source_fails_its_queued_writes_instead_of_reading_it() {
    let fabric = MemFabric::new();
    let mut a = nic(&fabric, 64, 0x11);
    let b = nic(&fabric, 64, 0);
    let peer = a.domain.connect(&b.domain.address()).unwrap();
    a.domain
        .post_writes(&[write(&a, peer, 0, &b, 0, 64, Some(1))])
        .unwrap();
    a.domain.deregister(a.reg.lkey).unwrap();
    let completions = poll_all(&mut a.domain);
    assert!(matches!(
        completions[0].result,
        Err(TransferError::Provider(_))
    ));
    assert_eq!(b.memory, vec![0; 64]);
}

#[test]
fn a_disconnected_peer_is_unreachable_and_others_are_unaffected() {
    let fabric = MemFabric::new();
    let mut a = nic(&fabric, 64, 3);
    let b = nic(&fabric, 64, 0);
    let c = nic(&fabric, 64, 0);
    let to_b = a.domain.connect(&b.domain.address()).unwrap();
    let to_c = a.domain.connect(&c.domain.address()).unwrap();
    assert!(fabric.disconnect(&b.domain.address()));
    a.domain
        .post_writes(&[
            write(&a, to_b, 0, &b, 0, 8, Some(1)),
            write(&a, to_c, 0, &c, 0, 8, Some(1)),
        ])
        .unwrap();
    let results: Vec<_> = poll_all(&mut a.domain)
        .into_iter()
        .map(|c| c.result)
        .collect();
    assert_eq!(results, [Err(TransferError::PeerUnreachable), Ok(())]);
    assert_eq!(&c.memory[..8], &[3; 8]);
    assert!(!fabric.disconnect(&b.domain.address()), "already gone");
}

#[test]
fn addresses_of_other_fabrics_or_providers_or_garbage_are_refused() {
    let (f1, f2) = (MemFabric::new(), MemFabric::new());
    let mut a = f1.domain();
    let b = f2.domain();
    assert!(matches!(
        a.connect(&b.address()),
        Err(TransportError::MalformedAddress(_))
    ));
    let verbs = DomainAddr {
        provider: "verbs".to_owned(),
        bytes: vec![0; 16],
    };
    assert!(matches!(
        a.connect(&verbs),
        Err(TransportError::ProviderMismatch { .. })
    ));
    let short = DomainAddr {
        provider: PROVIDER.to_owned(),
        bytes: vec![1, 2, 3],
    };
    assert!(matches!(
        a.connect(&short),
        Err(TransportError::MalformedAddress(_))
    ));
    let ghost = encode_addr(decode_addr(&a.address()).unwrap().0, 9999);
    assert!(a.connect(&ghost).is_err());
    let own = a.address();
    assert_eq!(
        a.connect(&own).unwrap(),
        a.connect(&own).unwrap(),
        "connect is idempotent"
    );
}

#[test]
fn a_send_waits_for_a_receive_buffer_and_then_lands() {
    let fabric = MemFabric::new();
    let mut a = nic(&fabric, 64, 0);
    let mut b = nic(&fabric, 64, 0);
    a.memory[..5].copy_from_slice(b"hello");
    let peer = a.domain.connect(&b.domain.address()).unwrap();
    let send = SendWr {
        wr_id: 3,
        peer,
        addr: a.reg.remote_addr,
        len: 5,
    };
    // SAFETY: a.memory outlives the send.
    unsafe { a.domain.post_send(&send) }.unwrap();
    assert!(
        poll_all(&mut a.domain).is_empty(),
        "no buffer posted yet: the send waits"
    );
    let recv = RecvWr {
        wr_id: 11,
        addr: b.reg.remote_addr + 32,
        len: 16,
        lkey: b.reg.lkey,
    };
    // SAFETY: b.memory outlives the posted buffer and is not read before its completion.
    unsafe { b.domain.post_recv(&recv) }.unwrap();
    let sent = poll_all(&mut a.domain);
    assert_eq!(sent[0].kind, CompletionKind::Send);
    assert_eq!(sent[0].result, Ok(()));
    assert_eq!(
        poll_all(&mut b.domain)[0].kind,
        CompletionKind::Recv { len: 5, from: None },
        "b has not connected a: the message is from no peer of its"
    );
    assert_eq!(&b.memory[32..37], b"hello");
}

#[test]
fn a_send_larger_than_the_buffer_fails_without_consuming_it() {
    let fabric = MemFabric::new();
    let mut a = nic(&fabric, 64, 0);
    let mut b = nic(&fabric, 64, 0);
    let peer = a.domain.connect(&b.domain.address()).unwrap();
    let a_at_b = b.domain.connect(&a.domain.address()).unwrap();
    // SAFETY: b.memory outlives the posted buffer.
    unsafe {
        b.domain.post_recv(&RecvWr {
            wr_id: 1,
            addr: b.reg.remote_addr,
            len: 4,
            lkey: b.reg.lkey,
        })
    }
    .unwrap();
    // SAFETY: a.memory outlives the send.
    unsafe {
        a.domain.post_send(&SendWr {
            wr_id: 2,
            peer,
            addr: a.reg.remote_addr,
            len: 8,
        })
    }
    .unwrap();
    assert_eq!(
        poll_all(&mut a.domain)[0].result,
        Err(TransferError::RemoteBufferTooSmall)
    );
    assert!(poll_all(&mut b.domain).is_empty());
    // SAFETY: as above.
    unsafe {
        a.domain.post_send(&SendWr {
            wr_id: 4,
            peer,
            addr: a.reg.remote_addr,
            len: 4,
        })
    }
    .unwrap();
    assert_eq!(
        poll_all(&mut b.domain)[0].kind,
        CompletionKind::Recv {
            len: 4,
            from: Some(a_at_b)
        },
        "the buffer was kept, and the message is a's"
    );
}

#[test]
fn a_fault_plan_delays_reorders_and_fails_deliveries_reproducibly() {
    let run = |seed| {
        let fabric = MemFabric::new();
        let plan = FaultPlan {
            fail_probability: 0.25,
            ..FaultPlan::chaos(seed, Duration::from_micros(200))
        };
        let mut a = Nic {
            domain: fabric.domain_with(plan),
            ..nic(&fabric, 256, 0)
        };
        // SAFETY: a.memory outlives the registration.
        a.reg = unsafe {
            a.domain.register(
                a.memory.as_ptr() as u64,
                256,
                Device::Host,
                Access::RemoteWrite,
            )
        }
        .unwrap();
        for (i, byte) in a.memory.iter_mut().enumerate() {
            *byte = i as u8;
        }
        let mut b = nic(&fabric, 256, 0);
        let peer = a.domain.connect(&b.domain.address()).unwrap();
        let wrs: Vec<_> = (0..32u64)
            .map(|i| WriteWr {
                wr_id: i,
                ..write(&a, peer, i * 8, &b, i * 8, 8, Some(9))
            })
            .collect();
        a.domain.post_writes(&wrs).unwrap();
        assert!(
            poll_all(&mut b.domain).is_empty(),
            "nothing lands before its delay"
        );
        assert!(a.domain.next_deadline().is_some());
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut done = Vec::new();
        while done.len() < 32 && Instant::now() < deadline {
            done.extend(
                poll_all(&mut a.domain)
                    .into_iter()
                    .map(|c| (c.wr_id, c.result.is_ok())),
            );
        }
        let arrived: u32 = poll_all(&mut b.domain).iter().map(|c| c.count).sum();
        let ok = done.iter().filter(|(_, ok)| *ok).count();
        assert_eq!(arrived as usize, ok, "one immediate per landed write");
        for &(i, landed) in &done {
            let expect: Vec<u8> = if landed {
                (i * 8..i * 8 + 8).map(|x| x as u8).collect()
            } else {
                vec![0; 8]
            };
            assert_eq!(
                b.memory[i as usize * 8..i as usize * 8 + 8],
                expect[..],
                "write {i}"
            );
        }
        done
    };
    let first = run(11);
    assert_eq!(first.len(), 32);
    assert!(first.iter().any(|(_, ok)| !ok) && first.iter().any(|(_, ok)| *ok));
    assert!(
        first.windows(2).any(|w| w[0].0 > w[1].0),
        "completions are not in posting order"
    );
    let failed = |run: &[(u64, bool)]| {
        let mut f: Vec<u64> = run.iter().filter(|(_, ok)| !ok).map(|(i, _)| *i).collect();
        f.sort_unstable();
        f
    };
    assert_eq!(
        failed(&first),
        failed(&run(11)),
        "the seed decides which writes fail"
    );
    assert_ne!(failed(&first), failed(&run(12)));
}
