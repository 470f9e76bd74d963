//! Measurements of the engine on the `mem` domain, each beside a baseline measured in the same
//! run, for `kvroute bench transport` (the criterion benches measure the same operations).
//!
//! - **Submit to posted** (paper 002 table 8: ~1.4 us p50 from the application call to the
//!   first posted write): one 64-byte write at a time; the engine records the time from the
//!   submit call to its first work request's post. Baseline: handing a timestamped message to
//!   a spinning thread through a bounded channel, the floor of any cross-thread design.
//! - **Paged-write throughput**: one transfer of many pages, end to end (every page copied
//!   and every immediate counted by the receiving engine). Baseline: one thread copying the
//!   same pages with `memcpy`, alternating with the engine's runs so that drifts in the host's
//!   memory bandwidth hit both alike.
//! - **Scatter posting** (paper 002 table 9: 8.5 us p50 to post 64 writes on ConnectX-7):
//!   the sender worker's time from before its first to after its last posted write of a
//!   scatter, to passive peers (NICs without a worker). As on hardware, posting hands
//!   descriptors to the NIC's queue and the copies run afterwards; the baseline is building the
//!   same descriptors and pushing them into a queue.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::addr::NetAddr;
use crate::domain::{Domain, WriteWr};
use crate::engine::{EngineConfig, TransferEngine};
use crate::error::TransportError;
use crate::mem::{FaultPlan, MemDomain, MemFabric};
use crate::mr::{Access, Device, MrDesc, RemoteKey};
use crate::on_done::{DoneFlag, OnDone};
use crate::request::{Pages, ScatterDst};
use kvroute_costmodel::fit::Percentiles;

/// A latency sample's percentiles in nanoseconds, as `kvroute bench transport --json` prints
/// them: the cost model's [`Percentiles`] (nearest rank) of the sample.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LatencyNs {
    /// Samples taken.
    pub samples: usize,
    /// 50th percentile (NaN for no samples).
    pub p50_ns: f64,
    /// 99th percentile (NaN for no samples).
    pub p99_ns: f64,
}

impl LatencyNs {
    /// The percentiles of `samples`.
    pub fn of(samples: &[Duration]) -> Self {
        let mut ns: Vec<f64> = samples.iter().map(|d| d.as_nanos() as f64).collect();
        let p = Percentiles::of(&mut ns);
        let or_nan = |v: f64| if samples.is_empty() { f64::NAN } else { v };
        Self {
            samples: samples.len(),
            p50_ns: or_nan(p.p50),
            p99_ns: or_nan(p.p99),
        }
    }
}

/// A NIC on the fabric with registered memory and no worker: a write target whose side costs
/// the sender nothing beyond the copy.
struct PassiveNic {
    domain: MemDomain,
    _memory: Vec<u8>,
    desc: MrDesc,
}

impl PassiveNic {
    fn new(fabric: &MemFabric, len: usize) -> Result<Self, TransportError> {
        let mut domain = fabric.domain();
        let memory = vec![0u8; len];
        // SAFETY: `memory` is kept in the returned value together with the domain and dropped
        // after it (field order), so it outlives the registration; its buffer never moves.
        let reg = unsafe {
            domain.register(
                memory.as_ptr() as u64,
                len as u64,
                Device::Host,
                Access::RemoteWrite,
            )
        }?;
        let desc = MrDesc {
            addr: reg.remote_addr,
            len: len as u64,
            rkeys: vec![RemoteKey {
                nic: domain.address(),
                rkey: reg.rkey,
            }],
        };
        Ok(Self {
            domain,
            _memory: memory,
            desc,
        })
    }

    fn addr(&self) -> NetAddr {
        NetAddr {
            nics: vec![self.domain.address()],
        }
    }

    /// Drains the NIC's completions, as a receiver's worker would.
    fn drain(&mut self) {
        let mut out = Vec::new();
        while self.domain.poll(&mut out, 1024) > 0 {
            out.clear();
        }
    }
}

fn recording_engine(fabric: &MemFabric) -> Result<TransferEngine, TransportError> {
    let config = EngineConfig {
        record_latency: true,
        idle_spin: Duration::from_millis(5),
        ..EngineConfig::default()
    };
    TransferEngine::mem_with(fabric, 1, FaultPlan::NONE, config)
}

/// Spins until `flag` is set: for the latency measurements, where the application thread is
/// hot and the receiving side is passive.
fn wait(flag: &DoneFlag) {
    while !flag.is_done() {
        std::hint::spin_loop();
    }
}

/// Submit-to-posted latency of the engine and of a bare channel hand-off.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SubmitLatency {
    /// Application submit call to the first posted work request.
    pub engine: LatencyNs,
    /// Timestamped message through a bounded channel to a spinning thread.
    pub baseline_handoff: LatencyNs,
}

/// Measures [`SubmitLatency`] over `samples` one-at-a-time writes (after 1,000 warm-up ones).
pub fn submit_latency(samples: usize) -> Result<SubmitLatency, TransportError> {
    let fabric = MemFabric::new();
    let engine = recording_engine(&fabric)?;
    let target = PassiveNic::new(&fabric, 64)?;
    let src = engine.alloc_mr(64)?;
    let write = || {
        let flag = DoneFlag::new();
        engine.submit_single_write(
            64,
            None,
            (src.handle(), 0),
            (&target.desc, 0),
            OnDone::flag(&flag),
        )?;
        wait(&flag);
        Ok::<(), TransportError>(())
    };
    for _ in 0..1000 {
        write()?;
    }
    engine.take_latency_samples();
    for _ in 0..samples {
        write()?;
    }
    let measured = engine.take_latency_samples().swap_remove(0).0;
    Ok(SubmitLatency {
        engine: LatencyNs::of(&measured),
        baseline_handoff: handoff_baseline(samples),
    })
}

fn handoff_baseline(samples: usize) -> LatencyNs {
    let (tx, rx) = crossbeam_channel::bounded::<Instant>(4096);
    let received = Arc::new(AtomicU64::new(0));
    let r = received.clone();
    let spinner = std::thread::spawn(move || {
        let mut out = Vec::with_capacity(samples + 1000);
        loop {
            match rx.try_recv() {
                Ok(sent) => {
                    out.push(sent.elapsed());
                    r.fetch_add(1, Ordering::Release);
                }
                Err(crossbeam_channel::TryRecvError::Empty) => std::hint::spin_loop(),
                Err(crossbeam_channel::TryRecvError::Disconnected) => return out,
            }
        }
    });
    for i in 0..(samples + 1000) as u64 {
        // A send fails only if the spinner died, which ends the measurement early.
        if tx.send(Instant::now()).is_err() {
            break;
        }
        while received.load(Ordering::Acquire) <= i {
            std::hint::spin_loop();
        }
    }
    drop(tx);
    let all = spinner.join().unwrap_or_default();
    let warm = all.len().min(1000);
    LatencyNs::of(&all[warm..])
}

/// Paged-write throughput of the engine and of `memcpy`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PagedThroughput {
    /// Bytes per page.
    pub page_len: usize,
    /// Pages per transfer.
    pub pages: u32,
    /// Pages per second through the engine, end to end (median transfer).
    pub engine_pages_per_s: f64,
    /// Pages per second copying the same pages with one thread (median).
    pub memcpy_pages_per_s: f64,
}

/// Measures [`PagedThroughput`]: `repeats` transfers of `pages` pages of `page_len` bytes
/// between two engines of one NIC each, pages reversed on the way.
pub fn paged_throughput(
    page_len: usize,
    pages: u32,
    repeats: usize,
) -> Result<PagedThroughput, TransportError> {
    let fabric = MemFabric::new();
    let (a, b) = (
        TransferEngine::mem(&fabric, 1)?,
        TransferEngine::mem(&fabric, 1)?,
    );
    let bytes = page_len * pages as usize;
    let (src, dst) = (a.alloc_mr(bytes)?, b.alloc_mr(bytes)?);
    src.fill(0x5A);
    let src_pages = Pages::new((0..pages).collect::<Vec<u32>>(), page_len as u64, 0);
    let dst_pages = Pages::new((0..pages).rev().collect::<Vec<u32>>(), page_len as u64, 0);
    let from = vec![0x5Au8; bytes];
    let mut to = vec![0u8; bytes];
    let (mut engine_times, mut memcpy_times) =
        (Vec::with_capacity(repeats), Vec::with_capacity(repeats));
    // Engine and memcpy alternate, so drifts in the host's memory bandwidth hit both alike.
    for r in 0..=repeats {
        let landed = b.imm_count(r as u32, u64::from(pages));
        let start = Instant::now();
        a.submit_paged_writes(
            page_len as u64,
            Some(r as u32),
            (src.handle(), &src_pages),
            (dst.desc(), &dst_pages),
            OnDone::nothing(),
        )?;
        // Parked, not spinning: both workers need the two cores.
        landed
            .wait()
            .map_err(|e| TransportError::Domain(format!("paged transfer failed: {e}")))?;
        let engine_time = start.elapsed();
        let start = Instant::now();
        for (s, d) in src_pages.indices.iter().zip(dst_pages.indices.iter()) {
            let (s, d) = (*s as usize * page_len, *d as usize * page_len);
            to[d..d + page_len].copy_from_slice(&from[s..s + page_len]);
        }
        std::hint::black_box(&mut to);
        if r > 0 {
            engine_times.push(engine_time);
            memcpy_times.push(start.elapsed());
        }
    }
    Ok(PagedThroughput {
        page_len,
        pages,
        engine_pages_per_s: pages_per_s(pages, &mut engine_times),
        memcpy_pages_per_s: pages_per_s(pages, &mut memcpy_times),
    })
}

fn pages_per_s(pages: u32, times: &mut [Duration]) -> f64 {
    times.sort_unstable();
    let median = times.get(times.len() / 2).copied().unwrap_or_default();
    f64::from(pages) / median.as_secs_f64()
}

/// Scatter posting time of the engine and of the bare copies.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ScatterPosting {
    /// Targets per scatter.
    pub peers: usize,
    /// Bytes written to each.
    pub bytes_per_peer: usize,
    /// First to last posted write of one scatter.
    pub engine: LatencyNs,
    /// Building the same descriptors and pushing them into a queue: the least posting costs.
    pub baseline_enqueue: LatencyNs,
}

/// Measures [`ScatterPosting`] to `peers` passive peers through a peer group.
pub fn scatter_posting(
    peers: usize,
    bytes_per_peer: usize,
    samples: usize,
) -> Result<ScatterPosting, TransportError> {
    let fabric = MemFabric::new();
    let engine = recording_engine(&fabric)?;
    let mut targets = (0..peers)
        .map(|_| PassiveNic::new(&fabric, bytes_per_peer))
        .collect::<Result<Vec<_>, _>>()?;
    let group = engine.add_peer_group(&targets.iter().map(PassiveNic::addr).collect::<Vec<_>>())?;
    let src = engine.alloc_mr(bytes_per_peer * peers)?;
    let dsts: Vec<ScatterDst> = targets
        .iter()
        .enumerate()
        .map(|(i, t)| ScatterDst {
            len: bytes_per_peer as u64,
            src_offset: (i * bytes_per_peer) as u64,
            dst: t.desc.clone(),
            dst_offset: 0,
        })
        .collect();
    let mut scatter = || {
        let flag = DoneFlag::new();
        engine.submit_scatter(
            Some(group),
            Some(1),
            src.handle(),
            &dsts,
            OnDone::flag(&flag),
        )?;
        wait(&flag);
        // Receivers drain their arrivals between scatters, outside the measured span.
        targets.iter_mut().for_each(PassiveNic::drain);
        Ok::<(), TransportError>(())
    };
    for _ in 0..200 {
        scatter()?;
    }
    engine.take_latency_samples();
    for _ in 0..samples {
        scatter()?;
    }
    let spans = engine.take_latency_samples().swap_remove(0).1;

    let mut queue = std::collections::VecDeque::with_capacity(peers);
    let mut floor = Vec::with_capacity(samples);
    for _ in 0..samples {
        let start = Instant::now();
        for (i, d) in dsts.iter().enumerate() {
            queue.push_back(WriteWr {
                wr_id: 1,
                peer: i as u32,
                src_addr: src.handle().addr() + d.src_offset,
                lkey: 1,
                len: d.len,
                dst_addr: d.dst.addr + d.dst_offset,
                rkey: d.dst.rkeys[0].rkey,
                imm: Some(1),
            });
        }
        std::hint::black_box(&mut queue);
        floor.push(start.elapsed());
        queue.clear();
    }
    Ok(ScatterPosting {
        peers,
        bytes_per_peer,
        engine: LatencyNs::of(&spans),
        baseline_enqueue: LatencyNs::of(&floor),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_the_median_and_the_tail() {
        let s: Vec<Duration> = (1..=100).rev().map(Duration::from_nanos).collect();
        let p = LatencyNs::of(&s);
        assert_eq!((p.samples, p.p50_ns, p.p99_ns), (100, 50.0, 99.0));
        assert!(LatencyNs::of(&[]).p50_ns.is_nan());
    }

    #[test]
    fn each_measurement_runs_end_to_end_at_a_small_size() {
        let l = submit_latency(50).unwrap();
        assert_eq!(l.engine.samples, 50);
        assert!(l.engine.p50_ns > 0.0 && l.baseline_handoff.p50_ns > 0.0);
        let t = paged_throughput(1024, 256, 2).unwrap();
        assert!(t.engine_pages_per_s > 0.0 && t.memcpy_pages_per_s > 0.0);
        let s = scatter_posting(8, 64, 20).unwrap();
        assert_eq!(s.engine.samples, 20);
    }
}
