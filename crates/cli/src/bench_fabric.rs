//! `kvroute bench fabric`: the libfabric domain between two processes (this one and a copy of
//! itself started as `kvroute bench fabric-peer`), each number beside `fi_pingpong` on the
//! same provider, run in the same invocation and interleaved with the engine's runs.
//!
//! Targets: single writes of 64 KiB and more at 0.9x `fi_pingpong`'s MB/s or better;
//! the immediate-only round trip at 1.2x `fi_pingpong`'s usec/xfer or less.

use std::fmt;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use kvroute_transport::fabric::bench::{
    self, OneThread, Pingpong, RawAddress, RawEndpoint, Stream,
};
use kvroute_transport::{
    EngineConfig, FabricConfig, FabricReport, MrDesc, NetAddr, Progress, ProviderChoice,
    TransferEngine,
};
use serde::{Deserialize, Serialize};

use crate::args::{FabricBenchArgs, FabricPeerArgs};
use crate::bench::{Target, machine};

mod measure;

use measure::{TwoProcesses, targets};

/// Bytes each side registers: the largest single write.
const BUFFER: usize = 32 << 20;
/// Single-write sizes (64 KiB to 32 MiB).
const SINGLE: &[u64] = &[64 << 10, 256 << 10, 1 << 20, 4 << 20, 32 << 20];
/// Page sizes of the paged writes (1 KiB to 64 KiB).
const PAGES: &[u64] = &[1 << 10, 4 << 10, 16 << 10, 64 << 10];
/// Bytes per paged transfer.
const PAGED_BYTES: u64 = 16 << 20;
/// Single writes in flight in a stream.
const WINDOW: u64 = 8;
/// Page writes in flight on the bare NIC, the baseline of a paged transfer (whose pages the
/// engine posts as fast as the send queue takes them).
const PAGED_WINDOW: u64 = 64;
/// fi_pingpong's control port (a fixed one, as fi_pingpong's own default is).
const PINGPONG_PORT: u16 = 47_611;

/// Single writes of at least 64 KiB: 0.9x fi_pingpong's MB/s or more.
const BANDWIDTH_RATIO_TARGET: f64 = 0.9;
/// The small round trip: 1.2x fi_pingpong's usec/xfer or less.
const LATENCY_RATIO_TARGET: f64 = 1.2;
/// Rounds of the round trip (each path's figure is the median of as many). On the shared
/// development VMs a whole round of shm ping-pongs runs at 0.27-0.45 us/xfer or at about
/// 1.0-1.1 us, the same code either way, by where the host happens to run the two processors
/// (drawn anew when a process wakes); with three rounds the engine's or fi_pingpong's median
/// sometimes took the slow figure while the other paths' took the fast one (docs/history/perf.md).
const LATENCY_ROUNDS: usize = 7;
/// Paged writes of 1 KiB pages against fi_pingpong's MB/s at 1 KiB: 0.8x over shm, where
/// fi_pingpong's messages go through shared memory at memory speed, and 1.0x elsewhere
/// (tcp), where a pipelined stream of writes ought to beat a ping-pong.
fn paged_ratio_target(provider: &str) -> (f64, &'static str) {
    if provider == "shm" {
        (0.8, ">= 0.8")
    } else {
        (1.0, ">= 1.0")
    }
}

/// What the parent tells the peer, one JSON line each.
#[derive(Debug, Serialize, Deserialize)]
enum PeerCommand {
    /// Answer `count` pings of `size` bytes.
    Answer { size: u64, count: u64 },
    /// Answer `count` pings of `size` bytes on the raw endpoint, from `parent`'s.
    AnswerRaw {
        parent: RawAddress,
        size: u64,
        count: u64,
    },
    /// Receive `count` writes on the raw endpoint from `parent`'s (the bare NIC's stream).
    AbsorbRaw { parent: RawAddress, count: u64 },
    /// Keep running passes until the next command (the parent is writing into this process:
    /// with manual progress its writes land only while the target progresses).
    Serve,
    /// Stop serving (the next measurement is fi_pingpong's, which must have the cores).
    Rest,
    /// Exit.
    Exit,
}

/// An address and a buffer, exchanged at start, and the raw endpoint's.
#[derive(Debug, Serialize, Deserialize)]
struct Hello {
    addr: NetAddr,
    desc: MrDesc,
    raw: RawAddress,
}

/// One size, the engine's ping-pong beside fi_pingpong's and beside the provider's bare RMA
/// path (medians over the rounds).
#[derive(Debug, Clone, Serialize)]
pub struct Compared {
    /// Bytes per message (0: the engine's immediate-only write).
    pub size: u64,
    /// The engine.
    pub engine: Pingpong,
    /// fi_pingpong on the same provider (send/recv messages).
    pub fi_pingpong: Pingpong,
    /// The same writes posted and polled on a bare NIC, without the engine.
    pub raw: Pingpong,
    /// engine / fi_pingpong, MB/s (single writes) or usec/xfer (the round trip): the target.
    pub ratio: f64,
    /// engine / raw, the same way: what the engine itself costs.
    pub over_raw: f64,
}

/// A paged transfer beside fi_pingpong at the page size and beside the same page writes
/// streamed on a bare NIC.
#[derive(Debug, Clone, Serialize)]
pub struct PagedRow {
    /// The engine's paged transfer (median over the rounds).
    pub engine: Stream,
    /// fi_pingpong at the page size.
    pub fi_pingpong: Pingpong,
    /// The same number of page-sized writes with an immediate each, 64 in flight, posted and
    /// polled on a bare NIC without the engine (median over the rounds): what the provider's
    /// RMA path allows.
    pub raw: Stream,
}

/// Everything `bench fabric` measured.
#[derive(Debug, Clone, Serialize)]
pub struct FabricBenchReport {
    /// The machine.
    pub machine: String,
    /// What libfabric opened.
    pub fabric: FabricReport,
    /// Who ran the engines' passes: `thread` (worker threads) or `manual` (the bench's threads).
    pub progress: String,
    /// Rounds each number is the median of, the round trip's aside.
    pub rounds: usize,
    /// Rounds the round trip's three figures are each the median of (7; 1 with `--quick`).
    pub round_trip_rounds: usize,
    /// The immediate-only round trip beside fi_pingpong's smallest message.
    pub round_trip: Compared,
    /// Immediate-only writes with both ends on one thread, through engines and on bare NICs
    /// (the round with the median engine time): the engine's own work per write.
    pub one_thread: OneThread,
    /// Single writes, ping-pong, beside fi_pingpong.
    pub single: Vec<Compared>,
    /// Single writes streamed (`window` in flight); no fi_pingpong counterpart.
    pub streams: Vec<Stream>,
    /// Writes in flight in the streams.
    pub window: u64,
    /// Paged writes, one transfer of 16 MiB per page size.
    pub paged: Vec<PagedRow>,
    /// The targets and whether this run met them.
    pub targets: Vec<Target>,
}

/// The three ping-pong paths a comparison measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    Engine,
    FiPingpong,
    Bare,
}

/// The paths in the order round `round` runs them: rotated every round, so in any three
/// consecutive rounds each path runs first, second and third once.
fn round_order(round: usize) -> [Path; 3] {
    const PATHS: [Path; 3] = [Path::Engine, Path::FiPingpong, Path::Bare];
    std::array::from_fn(|i| PATHS[(round + i) % 3])
}

/// The run at the middle rank by `key` (the upper of the two middle ones): a whole run to
/// report, not a statistic of the keys.
fn middle_run_by<T: Clone>(mut runs: Vec<T>, key: impl Fn(&T) -> f64) -> T {
    runs.sort_by(|a, b| key(a).total_cmp(&key(b)));
    runs[runs.len() / 2].clone()
}

/// Iterations for about `budget` of ping-pong at `size` bytes, assuming `mb_per_s`.
fn iters_for(size: u64, budget: Duration, quick: bool) -> u64 {
    // Roughly what tcp on loopback does; shm is faster, so its runs are shorter.
    let per_xfer_us = 6.0 + size as f64 / 2500.0;
    let n = (budget.as_secs_f64() * 1e6 / (2.0 * per_xfer_us)) as u64;
    n.clamp(if quick { 5 } else { 10 }, 20_000)
}

/// A copy of this binary started as a bench's second process, spoken to in JSON lines over its
/// stdin and stdout; told to exit (and waited for) on drop.
pub(crate) struct Peer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Peer {
    fn start(provider: &str, node: Option<&str>, manual: bool) -> Result<Self> {
        let mut args = vec!["bench", "fabric-peer", "--provider", provider];
        if manual {
            args.push("--manual");
        }
        if let Some(n) = node {
            args.extend(["--node", n]);
        }
        Self::spawn(&args)
    }

    /// Starts `kvroute ARGS...`.
    pub(crate) fn spawn(args: &[&str]) -> Result<Self> {
        let exe = std::env::current_exe().context("finding the kvroute binary")?;
        let mut cmd = Command::new(exe);
        cmd.args(args);
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the bench peer")?;
        let stdin = child.stdin.take().ok_or_else(|| anyhow!("no peer stdin"))?;
        let stdout = BufReader::new(
            child
                .stdout
                .take()
                .ok_or_else(|| anyhow!("no peer stdout"))?,
        );
        Ok(Self {
            child,
            stdin,
            stdout,
        })
    }

    /// Sends one JSON line.
    pub(crate) fn send<T: Serialize>(&mut self, msg: &T) -> Result<()> {
        writeln!(self.stdin, "{}", serde_json::to_string(msg)?)?;
        self.stdin.flush()?;
        Ok(())
    }

    /// Reads one JSON line.
    pub(crate) fn recv<T: for<'de> Deserialize<'de>>(&mut self) -> Result<T> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            bail!("the bench peer exited");
        }
        serde_json::from_str(&line).with_context(|| format!("the bench peer said: {line}"))
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // Every peer command enum has an `Exit` variant spelled this way.
        let _ = self.send(&PeerCommand::Exit);
        let _ = self.child.wait();
    }
}

pub(crate) fn fabric_config(
    provider: &str,
    node: Option<&str>,
    threads: bool,
) -> Result<FabricConfig> {
    Ok(FabricConfig {
        provider: provider.parse()?,
        node: node.map(str::to_owned),
        required: true,
        // Worker threads park when idle, leaving the cores to fi_pingpong's runs.
        idle_poll: threads.then_some(Duration::from_millis(1)),
        ..FabricConfig::default()
    })
}

pub(crate) fn open(
    provider: &str,
    node: Option<&str>,
    progress: Progress,
) -> Result<(TransferEngine, FabricReport)> {
    let config = fabric_config(provider, node, progress == Progress::Thread)?;
    let engine = EngineConfig {
        progress,
        ..EngineConfig::default()
    };
    Ok(TransferEngine::fabric(&config, engine)?)
}

fn progress_of(manual: bool) -> Progress {
    if manual {
        Progress::Manual
    } else {
        Progress::Thread
    }
}

/// `kvroute bench fabric-peer`: the other process of `bench fabric`. Its one thread runs the
/// engine's passes (manual progress) between commands too, since the parent's writes land only
/// while the target progresses (tcp;ofi_rxm progresses manually); a second thread reads stdin.
pub(crate) fn peer(args: &FabricPeerArgs) -> Result<()> {
    let (engine, _) = open(
        &args.provider,
        args.node.as_deref(),
        progress_of(args.manual),
    )?;
    let buf = engine.alloc_mr(BUFFER)?;
    let config = fabric_config(&args.provider, args.node.as_deref(), false)?;
    let mut raw = RawEndpoint::open(&config, BUFFER)?;
    let mut out = std::io::stdout();
    writeln!(
        out,
        "{}",
        serde_json::to_string(&Hello {
            addr: engine.main_address(),
            desc: buf.desc().clone(),
            raw: raw.address(),
        })?
    )?;
    out.flush()?;
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // While serving, spins like the bench's own waits: under manual progress back to back, as
    // the bare NIC's absorber polls; with worker threads the pause hint, and the core yielded
    // every 64 idle passes so the workers run. Otherwise it blocks, leaving the cores to
    // whatever is measured.
    let next_line = |engine: &TransferEngine, serving: bool| -> Option<String> {
        if !serving {
            return rx.recv().ok();
        }
        let mut idle = 0u32;
        loop {
            match rx.try_recv() {
                Ok(line) => return Some(line),
                Err(std::sync::mpsc::TryRecvError::Disconnected) => return None,
                Err(std::sync::mpsc::TryRecvError::Empty) => {
                    if engine.progress() {
                        continue;
                    }
                    idle = idle.wrapping_add(1);
                    if engine.manual_progress() {
                        continue;
                    }
                    if idle.is_multiple_of(64) {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                }
            }
        }
    };
    let hello = next_line(&engine, false).ok_or_else(|| anyhow!("no hello"))?;
    let parent: Hello = serde_json::from_str(&hello)?;
    let mut serving = false;
    while let Some(line) = next_line(&engine, serving) {
        match serde_json::from_str::<PeerCommand>(&line)? {
            PeerCommand::AnswerRaw {
                parent,
                size,
                count,
            } => {
                let result = raw
                    .connect(&parent)
                    .and_then(|()| raw.answer(size, count))
                    .map_err(|e| e.to_string());
                writeln!(out, "{}", serde_json::to_string(&result)?)?;
                out.flush()?;
            }
            PeerCommand::AbsorbRaw { parent, count } => {
                let result = raw
                    .connect(&parent)
                    .and_then(|()| raw.absorb(count))
                    .map_err(|e| e.to_string());
                writeln!(out, "{}", serde_json::to_string(&result)?)?;
                out.flush()?;
            }
            PeerCommand::Serve => serving = true,
            PeerCommand::Rest => serving = false,
            PeerCommand::Answer { size, count } => {
                let result = bench::answer_pings(&engine, &buf, &parent.desc, size, count)
                    .map_err(|e| e.to_string());
                writeln!(out, "{}", serde_json::to_string(&result)?)?;
                out.flush()?;
            }
            PeerCommand::Exit => break,
        }
    }
    drop((buf, raw));
    engine.shutdown();
    Ok(())
}

/// `kvroute bench fabric`.
pub(crate) fn run(args: &FabricBenchArgs) -> Result<FabricBenchReport> {
    crate::demo::holders::refuse_verbs(&args.provider)?;
    let choice: ProviderChoice = args.provider.parse()?;
    let provider = choice
        .prov_name()
        .ok_or_else(|| {
            anyhow!("bench fabric needs a named provider (tcp, shm, efa, ...), not auto")
        })?
        .to_owned();
    // Loopback for tcp; shm has no address to bind, and efa binds its NIC.
    let node = (choice == ProviderChoice::Tcp).then_some("127.0.0.1");

    let manual = args.progress == "manual";
    if !manual && args.progress != "thread" {
        bail!("--progress is thread or manual, not {}", args.progress);
    }
    let (mut two, fabric) = TwoProcesses::connect(args, provider, node, manual)?;
    let rounds = two.rounds;

    // The engine's immediate-only write carries 4 bytes (the immediate): fi_pingpong's
    // 4-byte message is its counterpart.
    let round_trip = two.compare(0, 4, true)?;
    // The peer rests: both ends on this thread, no scheduler in the time.
    let config = fabric_config(&args.provider, node, false)?;
    let trips = if args.quick { 20_000 } else { 200_000 };
    let one_thread = middle_run_by(
        (0..rounds)
            .map(|_| bench::one_thread(&config, trips))
            .collect::<Result<Vec<_>, _>>()?,
        |o| o.engine_ns,
    );
    let mut single = Vec::new();
    for &size in SINGLE {
        single.push(two.compare(size, size, false)?);
    }
    let streams = two.streams()?;
    let paged = two.paged()?;
    let latency_rounds = two.latency_rounds;
    let targets = targets(&two.provider, &round_trip, &single, &paged);
    drop(two);
    Ok(FabricBenchReport {
        machine: machine(),
        fabric,
        progress: args.progress.clone(),
        rounds,
        round_trip_rounds: latency_rounds,
        round_trip,
        one_thread,
        single,
        streams,
        window: WINDOW,
        paged,
        targets,
    })
}

fn size(bytes: u64) -> String {
    match bytes {
        0 => "imm".to_owned(),
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

impl fmt::Display for FabricBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "fabric domain between two processes; {}", self.machine)?;
        writeln!(f, "{}", self.fabric)?;
        writeln!(f, "engine progress: {}", self.progress)?;
        writeln!(
            f,
            "medians of {} rounds ({} for the round trip), engine, bare NIC and fi_pingpong \
             interleaved in turn\n",
            self.rounds, self.round_trip_rounds
        )?;
        writeln!(
            f,
            "round trip (usec/xfer = half a round trip, as fi_pingpong reports)"
        )?;
        let r = &self.round_trip;
        writeln!(
            f,
            "  engine imm-only write {:>7.2} us   fi_pingpong 4 B {:>7.2} us   ratio {:.2}",
            r.engine.usec_per_xfer, r.fi_pingpong.usec_per_xfer, r.ratio
        )?;
        writeln!(
            f,
            "  bare NIC imm-only write {:>5.2} us   (engine / bare NIC {:.2})",
            r.raw.usec_per_xfer, r.over_raw
        )?;
        let o = &self.one_thread;
        writeln!(
            f,
            "  both ends on one thread, per one-way write: engine {:.0} ns, bare NIC {:.0} ns (the engine's own work {:.0} ns)\n",
            o.engine_ns,
            o.bare_ns,
            o.engine_ns - o.bare_ns
        )?;
        writeln!(
            f,
            "single writes, ping-pong (MB/s as fi_pingpong computes it)"
        )?;
        writeln!(
            f,
            "  {:>8} {:>12} {:>12} {:>8} {:>12} {:>9}",
            "size", "engine MB/s", "fi_pp MB/s", "ratio", "bare MB/s", "eng/bare"
        )?;
        for c in &self.single {
            writeln!(
                f,
                "  {:>8} {:>12.1} {:>12.1} {:>8.2} {:>12.1} {:>9.2}",
                size(c.size),
                c.engine.mb_per_s,
                c.fi_pingpong.mb_per_s,
                c.ratio,
                c.raw.mb_per_s,
                c.over_raw
            )?;
        }
        writeln!(f, "\nsingle writes streamed, {} in flight", self.window)?;
        for s in &self.streams {
            writeln!(f, "  {:>8} {:>14.1} MB/s", size(s.size), s.mb_per_s)?;
        }
        writeln!(
            f,
            "\npaged writes, 16 MiB per transfer (fi_pingpong at the page size beside)"
        )?;
        writeln!(
            f,
            "  {:>8} {:>14} {:>14} {:>14} {:>14} {:>9}",
            "page", "pages/s", "engine MB/s", "fi_pp MB/s", "bare MB/s", "eng/bare"
        )?;
        for p in &self.paged {
            writeln!(
                f,
                "  {:>8} {:>14.0} {:>14.1} {:>14.1} {:>14.1} {:>9.2}",
                size(p.engine.size),
                p.engine.per_s,
                p.engine.mb_per_s,
                p.fi_pingpong.mb_per_s,
                p.raw.mb_per_s,
                p.engine.mb_per_s / p.raw.mb_per_s
            )?;
        }
        writeln!(
            f,
            "  (bare: the same page writes on a bare NIC, {PAGED_WINDOW} in flight)"
        )?;
        crate::bench::write_targets(f, &self.targets, 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_takes_every_place_once_in_three_rounds() {
        for first in 0..4 {
            let orders: Vec<[Path; 3]> = (first..first + 3).map(round_order).collect();
            let once = |paths: &[Path]| {
                [Path::Engine, Path::FiPingpong, Path::Bare]
                    .iter()
                    .all(|path| paths.iter().filter(|&p| p == path).count() == 1)
            };
            for place in 0..3 {
                let at: Vec<Path> = orders.iter().map(|o| o[place]).collect();
                assert!(once(&at), "place {place} from round {first}: {orders:?}");
            }
            assert!(orders.iter().all(|o| once(o)), "{orders:?}");
        }
        assert_eq!(round_order(0)[0], Path::Engine);
    }
}
