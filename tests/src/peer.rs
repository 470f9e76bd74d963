//! A transfer engine in another process, driven over its stdin and stdout with one JSON
//! message per line. The child (`src/bin/fabric-peer.rs`) opens a fabric engine and one
//! registered buffer, announces its `NetAddr` and `MrDesc` (exchanged out of band, as
//! deployments do), then runs [`Command`]s and reports [`Event`]s.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command as Process, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use kvroute_transport::{FabricReport, MrDesc, NetAddr};
use serde::{Deserialize, Serialize};

/// What the parent asks of a peer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Fill `[offset, offset + len)` of the peer's buffer with [`pattern`]`(len, seed)`.
    Fill {
        /// Start in the buffer.
        offset: u64,
        /// Bytes.
        len: u64,
        /// Pattern seed.
        seed: u8,
    },
    /// Report [`fnv1a`] of `[offset, offset + len)` of the buffer.
    Hash {
        /// Start in the buffer.
        offset: u64,
        /// Bytes.
        len: u64,
    },
    /// Expect `count` arrivals of `imm`; report [`Event::Fired`] with `tag` when they land.
    Expect {
        /// The immediate.
        imm: u32,
        /// Arrivals.
        count: u64,
        /// Echoed in the event.
        tag: String,
    },
    /// Report how many arrivals of `imm` are counted and unclaimed.
    Pending {
        /// The immediate.
        imm: u32,
    },
    /// Write from the buffer into `dst`; report [`Event::Done`] with `tag`.
    Write {
        /// Target region.
        dst: MrDesc,
        /// Source offset in the buffer.
        src_offset: u64,
        /// Destination offset.
        dst_offset: u64,
        /// Bytes.
        len: u64,
        /// Immediate.
        imm: Option<u32>,
        /// Echoed in the event.
        tag: String,
    },
    /// Paged writes: page `src[i]` of the buffer to page `dst[i]` of `dst_desc`.
    Paged {
        /// Target region.
        dst_desc: MrDesc,
        /// Bytes per page (and stride on both sides).
        page_len: u64,
        /// Source page indices.
        src: Vec<u32>,
        /// Destination page indices.
        dst: Vec<u32>,
        /// Immediate.
        imm: Option<u32>,
        /// Echoed in the event.
        tag: String,
    },
    /// Install a receive pool; every message is reported as [`Event::Message`].
    Receive {
        /// Bytes per buffer.
        buf_len: usize,
        /// Buffers.
        count: u32,
    },
    /// Send `bytes` to `to`; report [`Event::Done`] with `tag`.
    Send {
        /// The peer.
        to: NetAddr,
        /// Payload.
        bytes: Vec<u8>,
        /// Echoed in the event.
        tag: String,
    },
    /// Stop running the engine's passes (a peer started with `manual_progress` only) and
    /// report [`Event::Frozen`]: from then on no thread of the peer is inside libfabric, so a
    /// kill cannot land while it holds a provider lock (see [`PeerProcess::kill`]).
    Freeze,
    /// Shut the engine down and exit.
    Exit,
}

/// What a peer reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    /// The engine is up.
    Ready {
        /// Its main address.
        addr: NetAddr,
        /// Its buffer's descriptor.
        desc: MrDesc,
        /// What libfabric opened.
        report: Box<FabricReport>,
    },
    /// An expectation fired (`error` if it failed).
    Fired {
        /// The command's tag.
        tag: String,
        /// The failure, if any.
        error: Option<String>,
    },
    /// A write or send completed (`error` if it failed).
    Done {
        /// The command's tag.
        tag: String,
        /// The failure, if any.
        error: Option<String>,
    },
    /// A hash.
    Hash {
        /// FNV-1a 64 of the range.
        value: u64,
    },
    /// Unclaimed arrivals.
    Pending {
        /// The count.
        count: u64,
    },
    /// A received message.
    Message {
        /// Its bytes.
        bytes: Vec<u8>,
    },
    /// A command failed before anything was posted.
    Refused {
        /// The error.
        error: String,
    },
    /// Fill completed.
    Filled,
    /// The peer no longer runs its engine's passes.
    Frozen,
}

/// How a peer is started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSpec {
    /// `tcp` or `shm`.
    pub provider: String,
    /// Address to bind (tcp).
    pub node: Option<String>,
    /// NICs.
    pub nics: usize,
    /// Buffer bytes.
    pub buf_len: u64,
    /// Deadline for posted operations, in milliseconds.
    pub op_timeout_ms: u64,
    /// Run inside this network namespace (`ip netns exec`).
    pub netns: Option<String>,
    /// The peer's engine uses manual progress, run by a thread of the peer that
    /// [`Command::Freeze`] stops (otherwise worker threads, which run until exit).
    pub manual_progress: bool,
}

impl PeerSpec {
    /// A peer of `provider` on loopback with one NIC and a 1 MiB buffer.
    pub fn new(provider: &str) -> Self {
        Self {
            provider: provider.to_owned(),
            node: (provider != "shm").then(|| "127.0.0.1".to_owned()),
            nics: 1,
            buf_len: 1 << 20,
            op_timeout_ms: 5000,
            netns: None,
            manual_progress: false,
        }
    }
}

/// A running peer process.
#[derive(Debug)]
pub struct PeerProcess {
    child: Child,
    stdin: ChildStdin,
    events: Receiver<Event>,
    /// Its main address.
    pub addr: NetAddr,
    /// Its buffer.
    pub desc: MrDesc,
    /// What it opened.
    pub report: FabricReport,
}

/// How long a peer may take to answer.
pub const ANSWER: Duration = Duration::from_secs(60);

impl PeerProcess {
    /// Starts `binary` (the fabric-peer executable) as `spec` says and waits until it is up.
    pub fn start(binary: &str, spec: &PeerSpec) -> Result<Self, String> {
        let mut args: Vec<String> = Vec::new();
        let program = if let Some(ns) = &spec.netns {
            args.extend(["netns", "exec", ns, binary].map(str::to_owned));
            "ip".to_owned()
        } else {
            binary.to_owned()
        };
        args.extend([
            "--provider".to_owned(),
            spec.provider.clone(),
            "--nics".to_owned(),
            spec.nics.to_string(),
            "--buf".to_owned(),
            spec.buf_len.to_string(),
            "--op-timeout-ms".to_owned(),
            spec.op_timeout_ms.to_string(),
        ]);
        if let Some(node) = &spec.node {
            args.extend(["--node".to_owned(), node.clone()]);
        }
        if spec.manual_progress {
            args.extend(["--manual-progress".to_owned(), "1".to_owned()]);
        }
        let mut child = Process::new(&program)
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting {program}: {e}"))?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, events) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                match serde_json::from_str::<Event>(&line) {
                    Ok(e) => {
                        if tx.send(e).is_err() {
                            break;
                        }
                    }
                    Err(e) => eprintln!("peer said something unparsable ({e}): {line}"),
                }
            }
        });
        let ready = match events.recv_timeout(ANSWER) {
            Ok(Event::Ready { addr, desc, report }) => Ok((addr, desc, *report)),
            Ok(other) => Err(format!("the peer started with {other:?}")),
            Err(RecvTimeoutError::Timeout) => Err(format!("the peer was not up within {ANSWER:?}")),
            Err(RecvTimeoutError::Disconnected) => Err("the peer exited while starting".to_owned()),
        };
        match ready {
            Ok((addr, desc, report)) => Ok(Self {
                child,
                stdin,
                events,
                addr,
                desc,
                report,
            }),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }

    /// Sends a command.
    pub fn send(&mut self, command: &Command) -> Result<(), String> {
        let line = serde_json::to_string(command).map_err(|e| e.to_string())?;
        writeln!(self.stdin, "{line}")
            .and_then(|()| self.stdin.flush())
            .map_err(|e| format!("the peer is gone: {e}"))
    }

    /// The next event, waiting at most `timeout`.
    pub fn next(&mut self, timeout: Duration) -> Result<Event, String> {
        match self.events.recv_timeout(timeout) {
            Ok(e) => Ok(e),
            Err(RecvTimeoutError::Timeout) => Err(format!("no event within {timeout:?}")),
            Err(RecvTimeoutError::Disconnected) => Err("the peer exited".to_owned()),
        }
    }

    /// Sends `command` and returns its one answer.
    pub fn ask(&mut self, command: &Command) -> Result<Event, String> {
        self.send(command)?;
        self.next(ANSWER)
    }

    /// The hash of a range of the peer's buffer.
    pub fn hash(&mut self, offset: u64, len: u64) -> Result<u64, String> {
        match self.ask(&Command::Hash { offset, len })? {
            Event::Hash { value } => Ok(value),
            other => Err(format!("asked for a hash, got {other:?}")),
        }
    }

    /// Waits for the event matching `pred`, keeping none of the others.
    pub fn wait_for(
        &mut self,
        what: &str,
        timeout: Duration,
        mut pred: impl FnMut(&Event) -> bool,
    ) -> Result<Event, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let e = self.next(left).map_err(|e| format!("{what}: {e}"))?;
            if pred(&e) {
                return Ok(e);
            }
        }
    }

    /// Stops a `manual_progress` peer's passes and waits until it says so.
    pub fn freeze(&mut self) -> Result<(), String> {
        self.send(&Command::Freeze)?;
        self.wait_for("freezing", ANSWER, |e| *e == Event::Frozen)
            .map(drop)
    }

    /// Kills the process at once (SIGKILL): no shutdown, no goodbye.
    ///
    /// Over shm, libfabric 1.17 guards each process's shared region with a plain spinlock that
    /// senders take too: a process killed while its progress holds that lock leaves every
    /// sender spinning inside `fi_writemsg` for good. Kill shm peers after [`Self::freeze`].
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Reaped: the shm regions SIGKILL left behind are garbage.
        let _ = kvroute_transport::fabric::remove_shm_regions_of_dead_process(self.child.id());
    }

    /// Asks the peer to exit and waits for it.
    pub fn exit(mut self) -> Result<(), String> {
        self.send(&Command::Exit)?;
        let status = self.child.wait().map_err(|e| e.to_string())?;
        if status.success() {
            Ok(())
        } else {
            Err(format!("the peer exited with {status}"))
        }
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Deterministic bytes: byte i of stream `seed`.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8))
        .collect()
}

/// FNV-1a, 64-bit: enough to compare buffers across processes.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}
