//! A holder that requesters come to and leave one after another, as restarting requesters do:
//! each is a process of its own (this program, run with `--requester`) that connects, routes
//! one step, prints a digest of its partial and exits; every digest must equal the first (the
//! same query: bit-identical partials). Every 100 requesters the holder process's resident
//! memory, open file descriptors and the machine's `/dev/shm` entries are printed; after 100
//! requesters of warm-up they must stay flat (at most 2 more fds or `/dev/shm` entries, 16 MiB
//! more memory), or this exits non-zero.
//!
//! With `--one-process`, the requesters are engines of one process instead, each created,
//! connected, routed and dropped in turn while the process lives on (an shm holder that kept
//! every released engine's endpoint until its process exited refused the 229th, at 1.2 GB).
//!
//! `cargo run --release -p kvroute-remote --example holder_churn -- tcp 1000` (or `shm N`,
//! `shm N --one-process`). `cargo xtask test` runs `shm 300` and `shm 300 --one-process`: an
//! shm holder that kept released peers refused the 129th.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use kvroute_kernels::RopeLayout;
use kvroute_kernels::layout::D_QK;
use kvroute_kvstore::{ChunkId, CorpusSpec};
use kvroute_remote::{Call, HeldChunks, Holder, HolderConfig, Requester, RequesterConfig};

mod common;

use common::{Error, digest, engine, footprint, shm_entries, shm_entries_of};

/// The requester process: connect, route one step, print the partial's digest.
fn requester(provider: &str, holder: &str) -> Result<(), Error> {
    println!("{:016x}", route_once(provider, holder)?);
    Ok(())
}

/// A requester process whose engines come and go: for each line read on stdin, 100 engines
/// in turn each connect, route one step and are dropped, and the digests of the batch (one
/// line, all equal or not) are printed.
fn engines(provider: &str, holder: &str) -> Result<(), Error> {
    for line in std::io::stdin().lines() {
        line?;
        let mut digests = std::collections::BTreeSet::new();
        for _ in 0..100 {
            digests.insert(route_once(provider, holder)?);
        }
        let all: Vec<String> = digests.iter().map(|d| format!("{d:016x}")).collect();
        println!("{}", all.join(" "));
    }
    Ok(())
}

/// A requester on an engine of its own: connect, route one step, the partial's digest.
fn route_once(provider: &str, holder: &str) -> Result<u64, Error> {
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
    Ok(digest(&p))
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--requester") {
        let (Some(provider), Some(holder)) = (args.get(1), args.get(2)) else {
            return Err("--requester PROVIDER HOLDER_ADDR".into());
        };
        return requester(provider, holder);
    }
    if args.first().map(String::as_str) == Some("--engines") {
        let (Some(provider), Some(holder)) = (args.get(1), args.get(2)) else {
            return Err("--engines PROVIDER HOLDER_ADDR".into());
        };
        return engines(provider, holder);
    }
    let one_process = args.iter().any(|a| a == "--one-process");
    let args: Vec<&String> = args.iter().filter(|a| *a != "--one-process").collect();
    let provider = args.first().map_or("tcp", |s| s.as_str());
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
    println!("requesters   rss MiB   fds   /dev/shm (this process's and its requesters')");
    // `/dev/shm` entries are counted for this process (the holder) and the requesters it
    // starts only: other processes on the machine come and go.
    let mut ours = std::collections::HashSet::from([std::process::id()]);
    let mut batch = None;
    if one_process {
        let mut child = std::process::Command::new(&me)
            .args(["--engines", provider, &holder.addr().to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()?;
        ours.insert(child.id());
        let (stdin, stdout) = (child.stdin.take(), child.stdout.take());
        batch = Some((
            child,
            stdin.ok_or("no stdin")?,
            stdout.map(std::io::BufReader::new).ok_or("no stdout")?,
        ));
    }
    let step = if one_process { 100 } else { 1 };
    for i in (step..=count).step_by(step) {
        let digest = match &mut batch {
            Some((_, stdin, stdout)) => {
                use std::io::{BufRead, Write};
                writeln!(stdin, "next")?;
                let mut line = String::new();
                stdout.read_line(&mut line)?;
                if line.trim().is_empty() || line.trim().contains(' ') {
                    return Err(
                        format!("engines {} to {i}: {:?}", i - step + 1, line.trim()).into(),
                    );
                }
                line.trim().to_owned()
            }
            None => {
                let child = std::process::Command::new(&me)
                    .args(["--requester", provider, &holder.addr().to_string()])
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()?;
                ours.insert(child.id());
                let out = child.wait_with_output()?;
                if !out.status.success() {
                    return Err(format!(
                        "requester {i} failed: {}",
                        String::from_utf8_lossy(&out.stderr).trim()
                    )
                    .into());
                }
                String::from_utf8_lossy(&out.stdout).trim().to_owned()
            }
        };
        if *want.get_or_insert_with(|| digest.clone()) != digest {
            return Err(format!("requester {i}'s partial differs from the first's").into());
        }
        if i == step || i % 100 == 0 || i == count {
            // Wait for the holder to end the session and release the engine.
            let deadline = Instant::now() + Duration::from_secs(5);
            while holder.stats().active > 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            if one_process {
                // At most 8 released engines' endpoints are kept for one live process; the
                // rest close a grace period (1 s) after their engine's region goes.
                let kept = shm_entries_of(&ours);
                if let Some((_, _, shm0)) = warm
                    && kept > shm0 + 10
                {
                    return Err(format!(
                        "{kept} /dev/shm entries right after engines {} to {i}, {shm0} at 100",
                        i + 1 - step
                    )
                    .into());
                }
                std::thread::sleep(Duration::from_millis(1500));
            }
            let ((rss, fds), shm) = (footprint("self")?, shm_entries_of(&ours));
            println!(
                "{i:>10}   {:>7.1}   {fds:>3}   {shm:>8} (of {} on the machine)",
                rss as f64 / 1024.0,
                shm_entries()
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
    if let Some((mut child, stdin, _)) = batch {
        drop(stdin);
        child.wait()?;
    }
    println!(
        "{count} requesters served in {:.1} s, every partial identical",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
