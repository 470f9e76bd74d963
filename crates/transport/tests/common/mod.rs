//! Helpers shared by the engine tests.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

pub(crate) mod suite;
pub(crate) mod throttle;

use std::future::Future;
use std::time::{Duration, Instant};

use kvroute_transport::{EngineConfig, FaultPlan, MemFabric, TransferEngine};

/// Generous: a 2-core CI box under load can be slow; a test that needs it has hung.
pub(crate) const TIMEOUT: Duration = Duration::from_secs(30);

/// Waits for `cond`, failing the test after [`TIMEOUT`].
pub(crate) fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < TIMEOUT, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Runs a future to completion on a fresh current-thread tokio runtime, with the timeout.
pub(crate) fn block_on<F: Future>(f: F) -> F::Output {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async { tokio::time::timeout(TIMEOUT, f).await.expect("timed out") })
}

pub(crate) fn engine(fabric: &MemFabric, nics: usize) -> TransferEngine {
    TransferEngine::mem(fabric, nics).unwrap()
}

pub(crate) fn chaos_engine(fabric: &MemFabric, nics: usize, seed: u64) -> TransferEngine {
    let plan = FaultPlan::chaos(seed, Duration::from_micros(300));
    TransferEngine::mem_with(fabric, nics, plan, EngineConfig::default()).unwrap()
}

/// Deterministic bytes for a buffer: byte i of stream `seed`.
pub(crate) fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}
