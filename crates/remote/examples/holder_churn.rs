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

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
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
    let holder = start_holder(provider)?;
    let mut want = None;
    let mut warm = None;
    let started = Instant::now();
    println!("provider {provider}: {count} requester processes one after another");
    println!("requesters   rss MiB   fds   /dev/shm (this process's and its requesters')");
    let mut requesters = Requesters::start(provider, &holder, one_process)?;
    let step = if one_process { 100 } else { 1 };
    for i in (step..=count).step_by(step) {
        let digest = requesters.next(i, step)?;
        if *want.get_or_insert_with(|| digest.clone()) != digest {
            return Err(format!("requester {i}'s partial differs from the first's").into());
        }
        if i == step || i % 100 == 0 || i == count {
            stays_flat(&holder, &requesters, i, step, &mut warm)?;
        }
    }
    requesters.finish()?;
    println!(
        "{count} requesters served in {:.1} s, every partial identical",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// A holder of one chunk of one layer on an engine of `provider`, on a loopback port.
fn start_holder(provider: &str) -> Result<Holder, Error> {
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
    Ok(Holder::start(
        holder_engine,
        TcpListener::bind("127.0.0.1:0")?,
        held,
        config,
    )?)
}

/// The requesters the holder sees: processes of this program started one after another, or
/// (`--one-process`) the engines of one such process.
struct Requesters<'a> {
    me: PathBuf,
    provider: &'a str,
    holder: String,
    /// The process whose engines come and go, with `--one-process`.
    engines: Option<Engines>,
    /// This process (the holder) and the requesters it started: `/dev/shm` entries are
    /// counted for these only, as other processes on the machine come and go.
    ours: HashSet<u32>,
}

/// A requester process started with `--engines`: a line to its stdin routes a batch, whose
/// digests come back as a line on its stdout.
struct Engines {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl<'a> Requesters<'a> {
    /// Starts the engines' process with `one_process`; otherwise nothing yet.
    fn start(provider: &'a str, holder: &Holder, one_process: bool) -> Result<Self, Error> {
        let mut requesters = Self {
            me: std::env::current_exe()?,
            provider,
            holder: holder.addr().to_string(),
            engines: None,
            ours: HashSet::from([std::process::id()]),
        };
        if one_process {
            let mut child = Command::new(&requesters.me)
                .args(["--engines", provider, &requesters.holder])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()?;
            requesters.ours.insert(child.id());
            let (stdin, stdout) = (child.stdin.take(), child.stdout.take());
            requesters.engines = Some(Engines {
                child,
                stdin: stdin.ok_or("no stdin")?,
                stdout: stdout.map(BufReader::new).ok_or("no stdout")?,
            });
        }
        Ok(requesters)
    }

    /// The digest of requesters `i - step + 1` to `i`: one process's, or the one digest of a
    /// batch of engines (an error if they differ).
    fn next(&mut self, i: usize, step: usize) -> Result<String, Error> {
        match &mut self.engines {
            Some(Engines { stdin, stdout, .. }) => {
                writeln!(stdin, "next")?;
                let mut line = String::new();
                stdout.read_line(&mut line)?;
                if line.trim().is_empty() || line.trim().contains(' ') {
                    return Err(
                        format!("engines {} to {i}: {:?}", i - step + 1, line.trim()).into(),
                    );
                }
                Ok(line.trim().to_owned())
            }
            None => {
                let child = Command::new(&self.me)
                    .args(["--requester", self.provider, &self.holder])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()?;
                self.ours.insert(child.id());
                let out = child.wait_with_output()?;
                if !out.status.success() {
                    return Err(format!(
                        "requester {i} failed: {}",
                        String::from_utf8_lossy(&out.stderr).trim()
                    )
                    .into());
                }
                Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
            }
        }
    }

    /// Ends the engines' process (its stdin closes) and waits for it.
    fn finish(self) -> Result<(), Error> {
        if let Some(Engines {
            mut child, stdin, ..
        }) = self.engines
        {
            drop(stdin);
            child.wait()?;
        }
        Ok(())
    }
}

/// The holder process's footprint: resident memory (KiB), open file descriptors, and the
/// `/dev/shm` entries of it and its requesters.
#[derive(Clone, Copy)]
struct Footprint {
    rss: u64,
    fds: usize,
    shm: usize,
}

/// Once the holder has let requester `i` go (`step` requesters a round), prints its
/// footprint; from requester 100 on (`warm`, set then) it must stay flat, or this is an error.
fn stays_flat(
    holder: &Holder,
    requesters: &Requesters<'_>,
    i: usize,
    step: usize,
    warm: &mut Option<Footprint>,
) -> Result<(), Error> {
    // Wait for the holder to end the session and release the engine.
    let deadline = Instant::now() + Duration::from_secs(5);
    while holder.stats().active > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    if requesters.engines.is_some() {
        // At most 8 released engines' endpoints are kept for one live process; the
        // rest close a grace period (1 s) after their engine's region goes.
        let kept = shm_entries_of(&requesters.ours);
        if let Some(Footprint { shm: shm0, .. }) = *warm
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
    let ((rss, fds), shm) = (footprint("self")?, shm_entries_of(&requesters.ours));
    println!(
        "{i:>10}   {:>7.1}   {fds:>3}   {shm:>8} (of {} on the machine)",
        rss as f64 / 1024.0,
        shm_entries()
    );
    if i == 100 {
        *warm = Some(Footprint { rss, fds, shm });
    }
    if let Some(Footprint {
        rss: rss0,
        fds: fds0,
        shm: shm0,
    }) = *warm
        && (rss > rss0 + 16 * 1024 || fds > fds0 + 2 || shm > shm0 + 2)
    {
        return Err(format!(
            "not flat after warm-up: {rss} KiB, {fds} fds, {shm} in /dev/shm at {i} \
             against {rss0} KiB, {fds0}, {shm0} at 100"
        )
        .into());
    }
    Ok(())
}
