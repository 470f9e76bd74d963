//! A holder that requesters come to and leave one after another, as restarting requesters do:
//! each is a process of its own (this program, run with `--requester`) that connects, routes
//! one step, prints a digest of its partial and exits; every digest must equal the first (the
//! same query: bit-identical partials). Every 100 requesters the holder process's resident
//! memory, open file descriptors and the machine's `/dev/shm` entries are printed; after 100
//! requesters of warm-up they must stay flat (at most 2 more fds or `/dev/shm` entries, 16 MiB
//! more memory), or this exits non-zero.
//!
//! `cargo run --release -p kvroute-remote --example holder_churn -- tcp 1000` (or `shm N`).
//! `cargo xtask test` runs `shm 150`: an shm holder that kept released peers refused the
//! 129th.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use kvroute_kernels::RopeLayout;
use kvroute_kernels::layout::D_QK;
use kvroute_kvstore::{ChunkId, CorpusSpec};
use kvroute_remote::{Call, HeldChunks, Holder, HolderConfig, Requester, RequesterConfig};

mod common;

use common::{Error, digest, engine, footprint, shm_entries};

/// The requester process: connect, route one step, print the partial's digest.
fn requester(provider: &str, holder: &str) -> Result<(), Error> {
    let config = RequesterConfig {
        timeout: Duration::from_secs(5),
        link_bytes: 1 << 16,
        pool_pages: 4,
        ..RequesterConfig::new(0.1)
    };
    let mut req = Requester::connect(engine(provider)?, &[holder.parse()?], config)?;
    let q = vec![0x3f80u16; 4 * D_QK];
    let call = Call {
        chunk: ChunkId(0),
        layer: 0,
        queries: &q,
        sparse: None,
    };
    let p = req.route(&[call]).remove(0)?;
    let digest = digest(&p);
    println!("{digest:016x}");
    Ok(())
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--requester") {
        let (Some(provider), Some(holder)) = (args.get(1), args.get(2)) else {
            return Err("--requester PROVIDER HOLDER_ADDR".into());
        };
        return requester(provider, holder);
    }
    let provider = args.first().map_or("tcp", String::as_str);
    let count: usize = args.get(1).map_or(Ok(1000), |n| n.parse())?;
    let corpus = CorpusSpec {
        layers: 1,
        chunk_tokens: 128,
        chunks: 1,
        seed: 2,
        rope_theta: 10_000.0,
        yarn: None,
        rope_layout: RopeLayout::Interleaved,
    };
    let holder_engine = engine(provider)?;
    let held = HeldChunks::generate(&holder_engine, &corpus, &[ChunkId(0)])?;
    let config = HolderConfig {
        max_requesters: 4,
        slot_bytes: 1 << 16,
        reply_bytes: 1 << 16,
        gather_bytes: 1 << 16,
        ..HolderConfig::default()
    };
    let holder = Holder::start(
        holder_engine,
        TcpListener::bind("127.0.0.1:0")?,
        held,
        config,
    )?;
    let me = std::env::current_exe()?;
    let mut want = None;
    let mut warm = None;
    let started = Instant::now();
    println!("provider {provider}: {count} requester processes one after another");
    println!("requesters   rss MiB   fds   /dev/shm");
    for i in 1..=count {
        let out = std::process::Command::new(&me)
            .args(["--requester", provider, &holder.addr().to_string()])
            .output()?;
        if !out.status.success() {
            return Err(format!(
                "requester {i} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )
            .into());
        }
        let digest = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if *want.get_or_insert_with(|| digest.clone()) != digest {
            return Err(format!("requester {i}'s partial differs from the first's").into());
        }
        if i == 1 || i % 100 == 0 || i == count {
            // Wait for the holder to end the session and release the engine.
            let deadline = Instant::now() + Duration::from_secs(5);
            while holder.stats().active > 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            let ((rss, fds), shm) = (footprint("self")?, shm_entries());
            println!(
                "{i:>10}   {:>7.1}   {fds:>3}   {shm:>8}",
                rss as f64 / 1024.0
            );
            if i == 100 {
                warm = Some((rss, fds, shm));
            }
            if let Some((rss0, fds0, shm0)) = warm
                && (rss > rss0 + 16 * 1024 || fds > fds0 + 2 || shm > shm0 + 2)
            {
                return Err(format!(
                    "not flat after warm-up: {rss} KiB, {fds} fds, {shm} in /dev/shm at {i} \
                     against {rss0} KiB, {fds0}, {shm0} at 100"
                )
                .into());
            }
        }
    }
    println!(
        "{count} requester processes served in {:.1} s, every partial identical",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
