//! The libfabric domain over real providers (tcp;ofi_rxm and shm), two or more engines in one
//! process: every API call through the shared suite, then what only a real provider shows
//! (its report, registration modes, refusals, a vanishing peer). Needs libfabric
//! (`cargo xtask deps` installs it).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::{TIMEOUT, block_on, pattern, suite, wait_for};
use kvroute_transport::{
    Access, DoneCounter, EngineConfig, FabricConfig, OnDone, Pages, ProviderChoice, TransferEngine,
    TransferError, TransferShape, TransportError,
};

fn config(provider: ProviderChoice, nics: usize) -> FabricConfig {
    FabricConfig {
        node: Some("127.0.0.1".to_owned()),
        required: true,
        nics,
        // Many engines share two cores here: idle workers park instead of spinning.
        idle_poll: Some(Duration::from_micros(200)),
        op_timeout: Duration::from_secs(5),
        ..FabricConfig::provider(provider)
    }
}

fn open(config: &FabricConfig) -> TransferEngine {
    match TransferEngine::fabric(config, EngineConfig::default()) {
        Ok((engine, _)) => engine,
        Err(e) => panic!("{e} (does `cargo xtask deps` pass?)"),
    }
}

macro_rules! suite_over {
    ($module:ident, $provider:expr) => {
        mod $module {
            use super::*;

            fn make(nics: usize) -> TransferEngine {
                open(&config($provider, nics))
            }

            #[test]
            fn a_single_write_lands_and_every_kind_of_on_done_sees_it() {
                suite::single_write_with_every_on_done(&make);
            }

            #[test]
            fn a_large_write_shards_over_four_nics_each_with_its_own_rkey() {
                suite::large_write_sharded_over_nics(&make, 4);
            }

            #[test]
            fn paged_writes_land_where_the_indices_say_and_fire_the_expectation_once() {
                suite::paged_writes(&make);
            }

            #[test]
            fn arrivals_before_the_expectation_count_and_the_excess_carries_over() {
                suite::arrivals_before_the_expectation(&make);
            }

            #[test]
            fn a_watched_immediate_counts_its_arrivals_without_the_counter() {
                suite::watched_immediates(&make);
            }

            #[test]
            fn immediates_to_a_resolved_target_land_and_survive_released_peers() {
                suite::resolved_immediate_targets(&make);
            }

            #[test]
            fn immediates_nobody_waits_on_post_without_a_completion() {
                // Only shm takes them without a completion (docs/fabric.md).
                suite::immediates_nobody_waits_on(&make, $provider == ProviderChoice::Shm);
            }

            #[test]
            fn unexpected_immediates_reach_the_handler_and_stay_claimable() {
                suite::unexpected_immediates(&make);
            }

            #[test]
            fn scatter_and_barrier_reach_a_group_of_8_peers() {
                suite::scatter_and_barrier(&make, 8);
            }

            #[test]
            fn more_messages_than_receive_buffers_all_arrive_through_back_pressure() {
                suite::messages_through_back_pressure(&make);
            }

            #[test]
            fn a_callback_may_submit_into_its_engine_without_deadlock() {
                suite::callback_submits_into_its_engine(&make);
            }

            #[test]
            fn messages_name_their_sender_once_it_is_connected() {
                suite::messages_name_their_sender(&make);
            }

            #[test]
            fn ten_thousand_paged_writes_land_byte_exact_and_fire_once() {
                ten_thousand_pages(&config($provider, 2));
            }

            #[test]
            fn descriptors_and_sends_through_registered_buffers_as_efa_needs() {
                let forced = FabricConfig {
                    force_mr_local: true,
                    ..config($provider, 1)
                };
                let make = |_| open(&forced);
                suite::single_write_with_every_on_done(&make);
                suite::messages_through_back_pressure(&make);
            }

            #[test]
            fn a_wrong_rkey_or_forged_descriptor_is_an_error_and_writes_nothing() {
                refusals(&config($provider, 1));
            }
        }
    };
}

suite_over!(tcp, ProviderChoice::Tcp);
suite_over!(shm, ProviderChoice::Shm);

/// Paged writes of 10,000 pages (paper 002's KV-page pattern) in one transfer: every page
/// lands where its index says, the receiver's expectation fires exactly once.
fn ten_thousand_pages(config: &FabricConfig) {
    let (a, b) = (open(config), open(config));
    let (pages, page) = (10_000u32, 256u64);
    let src = a.alloc_mr((pages as u64 * page) as usize).unwrap();
    let dst = b.alloc_mr((pages as u64 * page) as usize).unwrap();
    let bytes = pattern((pages as u64 * page) as usize, 11);
    src.write_at(0, &bytes).unwrap();
    // Reverse order on the destination, so a misplaced page cannot pass.
    let src_pages = Pages::new((0..pages).collect::<Vec<u32>>(), page, 0);
    let dst_pages = Pages::new((0..pages).rev().collect::<Vec<u32>>(), page, 0);
    let fired = DoneCounter::new();
    let expected = b.expected_arrivals(TransferShape::PagedWrites {
        pages: pages as u64,
    });
    b.expect_imm_count(7, expected, OnDone::from(&fired));
    let (done, sent) = OnDone::future();
    a.submit_paged_writes(
        page,
        Some(7),
        (src.handle(), &src_pages),
        (dst.desc(), &dst_pages),
        done,
    )
    .unwrap();
    assert_eq!(block_on(sent), Ok(()));
    wait_for("the expectation", || fired.total() == 1);
    let got = dst.to_vec();
    for i in 0..pages as usize {
        let to = (pages as usize - 1 - i) * page as usize;
        let from = i * page as usize;
        assert_eq!(
            got[to..to + page as usize],
            bytes[from..from + page as usize],
            "page {i}"
        );
    }
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!((fired.total(), fired.ok()), (1, 1), "fired exactly once");
    assert_eq!(b.pending_imm(7), 0, "no arrival left over");
}

/// A wrong rkey, a descriptor claiming more than was registered, one pointing before the
/// region: each write fails (tcp: refused by the target at once; shm: never answered, so the
/// deadline fails it), nothing lands, no immediate is counted. Each case uses a fresh pair:
/// after a refusal, libfabric 1.17's tcp drops the connection and shm's completions stall
/// behind the unanswered write (see docs/fabric.md).
fn refusals(base: &FabricConfig) {
    let config = FabricConfig {
        op_timeout: Duration::from_secs(1),
        ..base.clone()
    };
    type Forge = fn(&mut kvroute_transport::MrDesc) -> u64;
    let cases: [(&str, Forge); 3] = [
        ("wrong rkey", |d| {
            d.rkeys[0].rkey ^= 0x5a5a;
            0
        }),
        ("forged length", |d| {
            d.len = 1 << 20;
            8192
        }),
        ("forged address", |d| {
            d.addr = d.addr.wrapping_sub(4096);
            0
        }),
    ];
    for (what, forge) in cases {
        let (a, b) = (open(&config), open(&config));
        let src = a.alloc_mr(4096).unwrap();
        src.fill(0xee);
        let guard_before = b.alloc_mr(8192).unwrap();
        let dst = b.alloc_mr(4096).unwrap();
        let guard_after = b.alloc_mr(8192).unwrap();
        let mut desc = dst.desc().clone();
        let offset = forge(&mut desc);
        let (done, fut) = OnDone::future();
        let started = Instant::now();
        a.submit_single_write(4096, Some(99), (src.handle(), 0), (&desc, offset), done)
            .unwrap();
        let outcome = block_on(fut);
        assert!(outcome.is_err(), "{what}: {outcome:?}");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{what}: bounded"
        );
        for (name, buf) in [
            ("before", &guard_before),
            ("dst", &dst),
            ("after", &guard_after),
        ] {
            assert!(
                buf.to_vec().iter().all(|&x| x == 0),
                "{what}: the {name} region was written"
            );
        }
        assert_eq!(b.pending_imm(99), 0, "{what}: an immediate was counted");
    }
    // The true descriptor of a region registered local only: the provider refuses it.
    let (a, b) = (open(&config), open(&config));
    let src = a.alloc_mr(4096).unwrap();
    src.fill(0xee);
    let local = b.alloc_mr_with(4096, Access::Local).unwrap();
    let (done, fut) = OnDone::future();
    let started = Instant::now();
    a.submit_single_write(4096, Some(98), (src.handle(), 0), (local.desc(), 0), done)
        .unwrap();
    let outcome = block_on(fut);
    assert!(outcome.is_err(), "a write into a local region: {outcome:?}");
    assert!(started.elapsed() < Duration::from_secs(3), "bounded");
    assert!(
        local.to_vec().iter().all(|&x| x == 0),
        "the local region was written"
    );
    assert_eq!(b.pending_imm(98), 0, "an immediate was counted");
    // It is still a source, towards a third engine: after a refused write a cannot reach b
    // for a while (tcp;ofi_rxm closes the connection: PeerUnreachable; shm never answers the
    // write, so the engine holds new operations to b until the deadline), as after the forged
    // cases above.
    let c = open(&config);
    let dst = c.alloc_mr(4096).unwrap();
    let (done, fut) = OnDone::future();
    b.submit_single_write(4096, None, (local.handle(), 0), (dst.desc(), 0), done)
        .unwrap();
    let outcome = block_on(fut);
    assert!(
        outcome.is_ok(),
        "a local region as a write's source: {outcome:?}"
    );
}

/// A peer that goes away (its engine dropped, its endpoint closed) makes writes to it fail
/// within the deadline, while another peer keeps working. Over tcp only in one process:
/// libfabric 1.17's shm maps an in-process peer's region by pointer and faults once that peer
/// closes it; shm peers that die are tested as processes (`tests/tests/fabric_processes.rs`).
#[test]
fn writes_to_a_vanished_tcp_peer_fail_in_bounded_time() {
    let config = FabricConfig {
        op_timeout: Duration::from_secs(1),
        ..config(ProviderChoice::Tcp, 1)
    };
    let (a, gone, alive) = (open(&config), open(&config), open(&config));
    let src = a.alloc_mr(1 << 16).unwrap();
    let gone_buf = gone.alloc_mr(1 << 16).unwrap();
    let gone_dst = gone_buf.desc().clone();
    let alive_buf = alive.alloc_mr(1 << 16).unwrap();
    // Connect first, so the failure is the peer's going, not a refused connection.
    let (done, fut) = OnDone::future();
    a.submit_single_write(64, None, (src.handle(), 0), (&gone_dst, 0), done)
        .unwrap();
    assert_eq!(block_on(fut), Ok(()));
    drop((gone_buf, gone));
    let started = Instant::now();
    let failed = DoneCounter::new();
    for i in 0..16 {
        a.submit_single_write(
            4096,
            None,
            (src.handle(), 0),
            (&gone_dst, i * 4096),
            OnDone::from(&failed),
        )
        .unwrap();
    }
    let landed = alive.imm_count(3, 1);
    a.submit_single_write(
        1 << 16,
        Some(3),
        (src.handle(), 0),
        (alive_buf.desc(), 0),
        OnDone::nothing(),
    )
    .unwrap();
    assert_eq!(block_on(landed), Ok(()), "the other peer still works");
    wait_for("the writes to the vanished peer", || failed.total() == 16);
    assert_eq!(failed.ok(), 0);
    assert!(
        started.elapsed() < TIMEOUT.min(Duration::from_secs(10)),
        "failed in bounded time ({:?})",
        started.elapsed()
    );
}

/// Over tcp in this process. Over shm, engines created and dropped by the hundred in one
/// process crash libfabric 1.17's shm (SIGSEGV in `fi_enable`, docs/history/perf.md): there the
/// same check runs with a process per peer (`holder_churn shm 150`, a step of `cargo xtask
/// test`; without the release it fails at the 129th).
#[test]
fn released_peers_free_their_resources_over_tcp() {
    let make = |nics| open(&config(ProviderChoice::Tcp, nics));
    suite::released_peers_free_their_resources(&make, 200);
}

#[test]
fn the_report_names_what_was_opened() {
    let (_, report) =
        TransferEngine::fabric(&config(ProviderChoice::Tcp, 2), EngineConfig::default()).unwrap();
    assert_eq!(report.provider, "tcp;ofi_rxm");
    assert_eq!(report.requested, "tcp;ofi_rxm");
    assert_eq!(report.fell_back, None);
    assert_eq!(report.domains.len(), 2);
    assert!(
        report.stand_in_nics,
        "one loopback interface stands in for two NICs"
    );
    assert!(report.cq_data_size >= 4);
    let text = report.to_string();
    assert!(
        text.contains("tcp;ofi_rxm") && text.contains("mr_mode"),
        "{text}"
    );
    let (_, shm) =
        TransferEngine::fabric(&config(ProviderChoice::Shm, 1), EngineConfig::default()).unwrap();
    assert!(
        shm.mr_mode.to_string().contains("VIRT_ADDR"),
        "{}",
        shm.mr_mode
    );
}

#[test]
fn a_missing_provider_is_refused_when_required_and_a_visible_fallback_otherwise() {
    let missing = FabricConfig {
        provider: ProviderChoice::Efa,
        ..config(ProviderChoice::Efa, 1)
    };
    match TransferEngine::fabric(&missing, EngineConfig::default()) {
        Err(TransportError::ProviderUnavailable(why)) => assert!(why.contains("efa"), "{why}"),
        Err(e) => panic!("{e}"),
        Ok(_) => {
            kvroute_testkit::skip!("this machine has an EFA NIC");
            return;
        }
    }
    let lenient = FabricConfig {
        required: false,
        ..missing
    };
    let (_, report) = TransferEngine::fabric(&lenient, EngineConfig::default()).unwrap();
    assert_eq!(report.requested, "efa");
    assert_eq!(report.provider, "tcp;ofi_rxm");
    assert!(report.fell_back.as_deref().unwrap_or("").contains("efa"));
    assert!(report.to_string().contains("asked for efa"));
}

#[test]
fn engines_of_different_providers_refuse_each_other() {
    let tcp = open(&config(ProviderChoice::Tcp, 1));
    let shm = open(&config(ProviderChoice::Shm, 1));
    let dst = shm.alloc_mr(64).unwrap();
    let src = tcp.alloc_mr(64).unwrap();
    let err = tcp
        .submit_single_write(
            8,
            None,
            (src.handle(), 0),
            (dst.desc(), 0),
            OnDone::nothing(),
        )
        .unwrap_err();
    assert!(
        matches!(err, TransportError::ProviderMismatch { .. }),
        "{err}"
    );
}

#[test]
fn a_forged_peer_address_is_refused_before_anything_is_sent() {
    let a = open(&config(ProviderChoice::Tcp, 1));
    let b = open(&config(ProviderChoice::Tcp, 1));
    let dst = b.alloc_mr(64).unwrap();
    let src = a.alloc_mr(64).unwrap();
    let mut short = dst.desc().clone();
    short.rkeys[0].nic.bytes.truncate(3);
    let err = a
        .submit_single_write(8, None, (src.handle(), 0), (&short, 0), OnDone::nothing())
        .unwrap_err();
    assert!(matches!(err, TransportError::MalformedAddress(_)), "{err}");
    let mut long = dst.desc().clone();
    long.rkeys[0].nic.bytes.extend([0u8; 300]);
    let err = a
        .submit_single_write(8, None, (src.handle(), 0), (&long, 0), OnDone::nothing())
        .unwrap_err();
    assert!(matches!(err, TransportError::MalformedAddress(_)), "{err}");
    // A well-formed address of nobody: the write fails, it does not hang.
    let mut nobody = dst.desc().clone();
    let port = nobody.rkeys[0].nic.bytes.len().min(4);
    nobody.rkeys[0].nic.bytes[2..port].copy_from_slice(&[0, 1][..port - 2]);
    let (done, fut) = OnDone::future();
    a.submit_single_write(8, None, (src.handle(), 0), (&nobody, 0), done)
        .unwrap();
    assert!(matches!(
        block_on(fut),
        Err(TransferError::PeerUnreachable
            | TransferError::Provider(_)
            | TransferError::TimedOut(_))
    ));
}

/// A file planted in `/dev/shm` under an endpoint's name is not an endpoint: a descriptor that
/// names one is refused with a typed error before the provider maps it (libfabric 1.17's `shm`
/// trusts the mapped region's header and crashes on garbage). Planted by another user, open to
/// other users, or named for a process that does not exist: each is refused.
#[test]
fn a_planted_shm_region_is_refused_not_mapped() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let a = open(&config(ProviderChoice::Shm, 1));
    let b = open(&config(ProviderChoice::Shm, 1));
    let dst = b.alloc_mr(64).unwrap();
    let src = a.alloc_mr(64).unwrap();
    let uid = std::fs::metadata("/proc/self").unwrap().uid();
    let me = std::process::id();
    let mut dead = std::process::Command::new("true").spawn().unwrap();
    let dead_pid = dead.id();
    dead.wait().unwrap();
    let root = uid == 0;
    // (name, mode, owner): the garbage file behind each name.
    let planted = [
        (format!("{me}:{}:990", uid + 1), 0o600, None),
        (format!("{me}:{uid}:991"), 0o644, None),
        (format!("{dead_pid}:{uid}:992"), 0o600, None),
        (format!("{me}:{uid}:993"), 0o600, root.then_some(65534)),
    ];
    for (name, mode, owner) in &planted {
        if owner.is_none() && name.ends_with(":993") {
            continue; // only root can plant a file as another user
        }
        let path = format!("/dev/shm/{name}");
        std::fs::write(&path, [0xffu8; 4096]).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(*mode)).unwrap();
        if let Some(owner) = owner {
            std::os::unix::fs::chown(&path, Some(*owner), None).unwrap();
        }
        let mut forged = dst.desc().clone();
        forged.rkeys[0].nic.bytes = format!("fi_shm://{name}\0").into_bytes();
        let err = a
            .submit_single_write(8, None, (src.handle(), 0), (&forged, 0), OnDone::nothing())
            .unwrap_err();
        let _ = std::fs::remove_file(&path);
        assert!(
            matches!(err, TransportError::MalformedAddress(_)),
            "{name}: {err}"
        );
    }
    // The engine still writes to its real peer.
    let (done, fut) = OnDone::future();
    a.submit_single_write(8, None, (src.handle(), 0), (dst.desc(), 0), done)
        .unwrap();
    block_on(fut).unwrap();
}
