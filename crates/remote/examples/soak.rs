//! A soak of holders under requesters that come and go, misbehave and die, over shm and tcp at
//! once. Holders and requesters are processes of their own (this program, run with `--holder`,
//! `--requester` or `--rogue`). For `--minutes N` it keeps up to eight at a time, of these kinds:
//!
//! - **honest**: connects, routes 1-12 steps of two calls (two chunks, four query sets), and
//!   checks each partial bit for bit against the reference computed at start over the `mem`
//!   domain; a mismatch is a failure;
//! - **killed**: an honest requester sent SIGKILL at a random point;
//! - **stopped**: an honest requester sent SIGSTOP for 0.5-4 s, then SIGCONT (its holder may
//!   evict it meanwhile: an error of its own, never a wrong answer);
//! - **rogue**: a session that writes forged immediates, wrong tokens, replays, random bytes
//!   and corrupted requests into its inbox, and floods of up to 20,000 immediates of random
//!   values;
//! - **unproven**: a hello that never proves its address, then up to 2,000 `Stats` lines,
//!   held open for up to 6 s; any answer but the welcome is a failure;
//! - **malformed control**: connections that send garbage, truncated or forged hellos, or
//!   nothing at all;
//! - **connection flood**: 20-60 silent control connections at once, held for 1-8 s;
//! - **hostile holder**: a requester that uses two holders, one of them started in its own
//!   process, which forges 64 writes into the requester between steps with keys derived from
//!   the one it was given, at addresses up to 8 regions either side; no forged write may land
//!   and every partial must be exact;
//! - **directory follower**: a requester that knows only the directory (a real etcd the soak
//!   starts, where the main shm holder registers), poisoned with 16 records naming the main
//!   holder's control address with another engine, 4 values of 1.4 MB and 3 records whose
//!   holders never answer; it syncs, then takes new views in the background between steps.
//!
//! Per provider there is a **main** holder, never killed, whose memory and fds are measured, and
//! a **victim** holder, killed with SIGKILL and restarted every 10-30 s. A requester may end in
//! an error (busy, timed out, evicted, its holder killed); it must never give a wrong partial,
//! panic, die of a signal it was not sent, or run past 60 s (a hang). The main holders' resident
//! memory and fds are taken after a quarter of the run and at the end, each time with no
//! requester running; the end may not exceed the first by more than 16 MiB or 4 fds. When all
//! is done, the holders exit cleanly and `/dev/shm` must hold no region of any process this soak
//! started (the regions of processes it killed are removed by it, as their supervisor).
//!
//! `cargo run --release -p kvroute-remote --example soak -- --minutes 30`; `cargo xtask soak
//! --minutes N` builds and runs it, and `cargo xtask test` runs one minute.

#[path = "soak/children.rs"]
mod children;
mod common;
#[path = "soak/hostile.rs"]
mod hostile;
#[path = "soak/supervisor.rs"]
mod supervisor;

use std::time::Duration;

use common::Error;
use kvroute_kernels::RopeLayout;
use kvroute_kernels::layout::D_QK;
use kvroute_kvstore::{ChunkId, CorpusSpec};
use kvroute_remote::{Call, HolderConfig};

use children::{holder, requester, rogue, unproven};
use hostile::{follower, hostile};
use supervisor::supervise;

/// Query rows per call.
const ROWS: usize = 4;
/// Distinct query sets.
const QUERIES: u64 = 4;
/// Children alive at once.
const LIVE: usize = 8;
/// A child running longer than this is hung.
const HANG: Duration = Duration::from_secs(60);
/// Exit code of a requester that saw a wrong partial.
const WRONG: i32 = 3;
/// Exit code of a requester that ended in a typed error.
const ERRORED: i32 = 2;

fn corpus() -> CorpusSpec {
    CorpusSpec {
        layers: 1,
        chunk_tokens: 256,
        chunks: 2,
        seed: 7,
        rope_theta: 10_000.0,
        yarn: None,
        rope_layout: RopeLayout::Interleaved,
    }
}

fn holder_config() -> HolderConfig {
    HolderConfig {
        max_requesters: 4,
        slot_bytes: 1 << 16,
        reply_bytes: 1 << 16,
        gather_bytes: 1 << 16,
        hello_timeout: Duration::from_secs(2),
        open_timeout: Duration::from_secs(5),
        idle_evict: Duration::from_secs(2),
        ..HolderConfig::default()
    }
}

/// Query set `v`: bf16 rows with values in [-0.5, 0.5).
fn queries(v: u64) -> Vec<u16> {
    (0..ROWS * D_QK)
        .map(|j| {
            let x = ((j as u64 * 7 + v * 13) % 17) as f32 / 17.0 - 0.5;
            (x.to_bits() >> 16) as u16
        })
        .collect()
}

/// One step's calls for query set `v`: a call on each chunk.
fn calls(q: &[u16]) -> [Call<'_>; 2] {
    [0, 1].map(|c| Call {
        chunk: ChunkId(c),
        layer: 0,
        queries: q,
        sparse: None,
    })
}

/// A tiny generator (xorshift64*), seeded per process.
struct Rng(u64);

impl Rng {
    fn seeded() -> Self {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        Self(t ^ u64::from(std::process::id()).rotate_left(32) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `lo..hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo).max(1)
    }

    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(self.range(lo, hi))
    }
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| args.get(i).map(String::as_str).ok_or("missing argument");
    match args.first().map(String::as_str) {
        Some("--holder") => holder(arg(1)?, args.get(2).map(String::as_str)),
        Some("--requester") => requester(arg(1)?, arg(2)?, arg(3)?),
        Some("--hostile") => hostile(arg(1)?, arg(2)?, arg(3)?),
        Some("--follower") => follower(arg(1)?, arg(2)?, arg(3)?),
        // A rogue meets refusals and dead holders: its own errors are outcomes, not failures.
        Some("--rogue") => rogue(arg(1)?, arg(2)?).or_else(|e| {
            eprintln!("rogue: {e}");
            std::process::exit(ERRORED)
        }),
        // Busy, refused or a dead holder: outcomes, not failures; an answer is (exit WRONG).
        Some("--unproven") => unproven(arg(1)?, arg(2)?).or_else(|e| {
            eprintln!("unproven: {e}");
            std::process::exit(ERRORED)
        }),
        Some("--minutes") => supervise(arg(1)?.parse()?),
        _ => Err("usage: soak --minutes N".into()),
    }
}
