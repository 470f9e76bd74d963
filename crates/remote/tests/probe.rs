//! The start-up fabric probe where it is normally run: on a holder other requesters share, and
//! against a holder whose counters say nothing. It must give constants either way, without
//! waiting on anything but its own routes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::Result;
use kvroute_kernels::RopeLayout;
use kvroute_kernels::layout::D_QK;
use kvroute_kvstore::{ChunkId, CorpusSpec};
use kvroute_remote::probe::{ProbeConfig, probe_fabric};
use kvroute_remote::{Call, Holder, HolderConfig, Requester, RequesterConfig};
use kvroute_transport::MemFabric;

/// Bytes a routed query row and its partial row take on the wire.
const ROW_BYTES: u64 = (D_QK * 2 + 1032) as u64;
const TIMEOUT: Duration = Duration::from_secs(3);

/// A holder of one one-layer chunk of 512 tokens (the kernel takes long enough that
/// concurrent requests overlap) for up to `cap` requesters.
fn holder(fabric: &MemFabric, cap: usize) -> Result<Holder> {
    let spec = CorpusSpec {
        layers: 1,
        chunk_tokens: 512,
        chunks: 1,
        seed: 3,
        rope_theta: 10_000.0,
        yarn: None,
        rope_layout: RopeLayout::Interleaved,
    };
    let config = HolderConfig {
        max_requesters: cap,
        max_connections: cap.max(32),
        // Every requester of these tests connects from 127.0.0.1.
        max_per_source: cap.max(32),
        slot_bytes: 1 << 18,
        reply_bytes: 1 << 18,
        gather_bytes: 1 << 16,
        ..HolderConfig::default()
    };
    common::start_holder(
        kvroute_transport::TransferEngine::mem(fabric, 1)?,
        &spec,
        &[0],
        config,
    )
}

fn requester(fabric: &MemFabric, at: SocketAddr) -> Result<Requester> {
    let config = RequesterConfig {
        timeout: TIMEOUT,
        link_bytes: 1 << 18,
        pool_pages: 8,
        ..RequesterConfig::new(0.1)
    };
    common::connect(fabric, &[at], config)
}

fn probe_config() -> ProbeConfig {
    ProbeConfig {
        mq: vec![1, 16, 64],
        reps: 3,
        ..ProbeConfig::default()
    }
}

/// 16 requesters probe one holder at the same moment while two more route without pause:
/// every probe overlaps other requests, and every probe gives positive constants.
#[test]
fn requesters_sharing_a_busy_holder_all_probe_it() -> Result<()> {
    const PROBERS: usize = 16;
    let fabric = MemFabric::new();
    let holder = holder(&fabric, PROBERS + 2)?;
    let q = vec![0x3f80u16; 64 * D_QK];
    let stop = Arc::new(AtomicBool::new(false));
    let busy: Vec<_> = (0..2)
        .map(|_| {
            let (fabric, at, stop, q) = (fabric.clone(), holder.addr(), stop.clone(), q.clone());
            std::thread::spawn(move || -> Result<u64> {
                let mut req = requester(&fabric, at)?;
                let mut routed = 0;
                while !stop.load(Ordering::Relaxed) {
                    let call = Call {
                        chunk: ChunkId(0),
                        layer: 0,
                        queries: &q,
                        sparse: None,
                    };
                    req.route(&[call]).remove(0)?;
                    routed += 1;
                }
                Ok(routed)
            })
        })
        .collect();
    let start = Arc::new(Barrier::new(PROBERS));
    let probers: Vec<_> = (0..PROBERS)
        .map(|_| {
            let (fabric, at, start, q) = (fabric.clone(), holder.addr(), start.clone(), q.clone());
            std::thread::spawn(move || {
                // The barrier is reached whether or not the session opened: one refused
                // requester fails the test instead of leaving the others waiting forever.
                let req = requester(&fabric, at);
                start.wait();
                let mut req = req?;
                Ok::<_, anyhow::Error>(probe_fabric(&mut req, &probe_config(), &q, ROW_BYTES)?)
            })
        })
        .collect();
    let probed: Vec<_> = probers.into_iter().map(|p| p.join().unwrap()).collect();
    stop.store(true, Ordering::Relaxed);
    for b in busy {
        assert!(b.join().unwrap()? > 0);
    }
    for (i, p) in probed.into_iter().enumerate() {
        let p = p.unwrap_or_else(|e| panic!("requester {i}'s probe failed: {e:#}"));
        assert_eq!(p.points.len(), 3, "{p:?}");
        assert!(p.fabric.probe_us > 0.0 && p.fabric.bw_gbps > 0.0, "{p:?}");
    }
    Ok(())
}

/// A control-connection relay that freezes the holder's counters: every stats answer after
/// the first is replaced by the first, as a holder whose counters never advance would send.
fn freezing_relay(holder: SocketAddr) -> Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let at = listener.local_addr()?;
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let Ok(upstream) = TcpStream::connect(holder) else {
                return;
            };
            let (mut to_holder, from_client) = (upstream.try_clone().unwrap(), client.try_clone());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut from_client.unwrap(), &mut to_holder);
            });
            std::thread::spawn(move || {
                let (mut to_client, mut frozen) = (client, None::<String>);
                for line in BufReader::new(upstream).lines() {
                    let Ok(mut line) = line else { return };
                    if line.contains("\"kernel_us\"") {
                        line = frozen.get_or_insert(line).clone();
                    }
                    if writeln!(to_client, "{line}").is_err() {
                        return;
                    }
                }
            });
        }
    });
    Ok(at)
}

/// Counters that never advance cost the probe nothing: it finishes in less than one
/// requester timeout (it used to wait a whole timeout for each of its routes: 9 here).
#[test]
fn a_holder_whose_counters_never_advance_does_not_stall_the_probe() -> Result<()> {
    let fabric = MemFabric::new();
    let holder = holder(&fabric, 2)?;
    let relay = freezing_relay(holder.addr())?;
    let mut req = requester(&fabric, relay)?;
    let frozen = req.holder_stats(0)?;
    let q = vec![0x3f80u16; 64 * D_QK];
    let started = Instant::now();
    let probed = probe_fabric(&mut req, &probe_config(), &q, ROW_BYTES)?;
    let took = started.elapsed();
    assert!(took < TIMEOUT, "the probe took {took:?}");
    assert_eq!(req.holder_stats(0)?, frozen, "the relay froze the counters");
    assert!(probed.fabric.probe_us > 0.0, "{probed:?}");
    Ok(())
}

/// A probe that believes no bandwidth measures every attempt, then gives the last sweep's
/// bound and says so (the unit tests check which lines are believed).
#[test]
fn a_probe_believing_no_line_measures_every_sweep_then_bounds() -> Result<()> {
    let fabric = MemFabric::new();
    let holder = holder(&fabric, 2)?;
    let mut req = requester(&fabric, holder.addr())?;
    let q = vec![0x3f80u16; 64 * D_QK];
    let disbelieving = ProbeConfig {
        max_gbps: 1e-9,
        attempts: 2,
        ..probe_config()
    };
    let started = Instant::now();
    let bounded = probe_fabric(&mut req, &disbelieving, &q, ROW_BYTES)?;
    let why = bounded.fallback.clone().unwrap_or_default();
    assert!(why.contains("no fit in 2 probe sweeps"), "{bounded:?}");
    assert_eq!(
        bounded.samples.len(),
        9,
        "the last sweep's samples: {bounded:?}"
    );
    assert!(bounded.fabric.bw_gbps > 0.0, "{bounded:?}");
    assert!(started.elapsed() < TIMEOUT, "two sweeps of nine routes");
    for (max_gbps, max_fixed_us) in [(0.0, 1.0), (1.0, f64::NAN), (-1.0, 1.0)] {
        let bad = ProbeConfig {
            max_gbps,
            max_fixed_us,
            ..probe_config()
        };
        assert!(probe_fabric(&mut req, &bad, &q, ROW_BYTES).is_err());
    }
    Ok(())
}
