//! A fabric engine in its own process for the multi-process tests: opens the engine and one
//! registered buffer, prints `Ready` with its address and descriptor, then runs the commands
//! it reads from stdin (one JSON per line) and prints what happens (see `kvroute_tests::peer`).
//!
//! `fabric-peer --provider tcp|shm [--node IP] [--nics N] [--buf BYTES] [--op-timeout-ms MS]
//! [--manual-progress 1]`

use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kvroute_tests::peer::{Command, Event, fnv1a, pattern};
use kvroute_transport::{EngineConfig, FabricConfig, OnDone, Pages, Progress, TransferEngine};

/// Prints events from any thread, one line each.
#[derive(Clone)]
struct Out(Arc<Mutex<std::io::Stdout>>);

impl Out {
    fn emit(&self, event: &Event) {
        let line =
            serde_json::to_string(event).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"));
        let mut out = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // The parent reading our stdout is the only consumer; if it is gone we exit anyway.
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    }
}

struct Args {
    fabric: FabricConfig,
    buf: usize,
    manual: bool,
}

fn parse() -> Result<Args, String> {
    let mut fabric = FabricConfig {
        idle_poll: Some(Duration::from_micros(200)),
        required: true,
        ..FabricConfig::default()
    };
    let mut buf = 1 << 20;
    let mut manual = false;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--provider" => fabric.provider = value.parse().map_err(|e| format!("{e}"))?,
            "--node" => fabric.node = Some(value),
            "--nics" => fabric.nics = value.parse().map_err(|e| format!("--nics: {e}"))?,
            "--buf" => buf = value.parse().map_err(|e| format!("--buf: {e}"))?,
            "--op-timeout-ms" => {
                fabric.op_timeout = Duration::from_millis(
                    value.parse().map_err(|e| format!("--op-timeout-ms: {e}"))?,
                );
            }
            "--manual-progress" => manual = value == "1",
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(Args {
        fabric,
        buf,
        manual,
    })
}

fn main() {
    if let Err(e) = run() {
        eprintln!("fabric-peer: {e}");
        std::process::exit(1);
    }
}

fn done_event(tag: String, out: &Out) -> OnDone {
    let out = out.clone();
    OnDone::callback(move |r| {
        out.emit(&Event::Done {
            tag,
            error: r.err().map(|e| e.to_string()),
        });
    })
}

/// The thread that runs a manual-progress engine's passes until told to stop.
struct Passes {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl Passes {
    fn start(engine: &TransferEngine) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (engine, flag) = (engine.clone(), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::Acquire) {
                if !engine.progress() {
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        });
        Self { stop, thread }
    }

    /// Returns once the thread is out of its last pass.
    fn stop(self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.thread.join();
    }
}

fn run() -> Result<(), String> {
    let args = parse()?;
    let config = EngineConfig {
        progress: if args.manual {
            Progress::Manual
        } else {
            Progress::Thread
        },
        ..EngineConfig::default()
    };
    let (engine, report) =
        TransferEngine::fabric(&args.fabric, config).map_err(|e| e.to_string())?;
    let mut passes = args.manual.then(|| Passes::start(&engine));
    let buf = engine.alloc_mr(args.buf).map_err(|e| e.to_string())?;
    let out = Out(Arc::new(Mutex::new(std::io::stdout())));
    out.emit(&Event::Ready {
        addr: engine.main_address(),
        desc: buf.desc().clone(),
        report: Box::new(report),
    });
    let refused = |e: kvroute_transport::TransportError| Event::Refused {
        error: e.to_string(),
    };
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| e.to_string())?;
        let command: Command = serde_json::from_str(&line).map_err(|e| format!("{e}: {line}"))?;
        match command {
            Command::Fill { offset, len, seed } => {
                match buf.write_at(offset as usize, &pattern(len as usize, seed)) {
                    Ok(()) => out.emit(&Event::Filled),
                    Err(e) => out.emit(&refused(e)),
                }
            }
            Command::Hash { offset, len } => {
                let mut bytes = vec![0; len as usize];
                match buf.read_at(offset as usize, &mut bytes) {
                    Ok(()) => out.emit(&Event::Hash {
                        value: fnv1a(&bytes),
                    }),
                    Err(e) => out.emit(&refused(e)),
                }
            }
            Command::Expect { imm, count, tag } => {
                let o = out.clone();
                engine.expect_imm_count(
                    imm,
                    count,
                    OnDone::callback(move |r| {
                        o.emit(&Event::Fired {
                            tag,
                            error: r.err().map(|e| e.to_string()),
                        });
                    }),
                );
            }
            Command::Pending { imm } => out.emit(&Event::Pending {
                count: engine.pending_imm(imm),
            }),
            Command::Write {
                dst,
                src_offset,
                dst_offset,
                len,
                imm,
                tag,
            } => {
                let done = done_event(tag, &out);
                if let Err(e) = engine.submit_single_write(
                    len,
                    imm,
                    (buf.handle(), src_offset),
                    (&dst, dst_offset),
                    done,
                ) {
                    out.emit(&refused(e));
                }
            }
            Command::Paged {
                dst_desc,
                page_len,
                src,
                dst,
                imm,
                tag,
            } => {
                let done = done_event(tag, &out);
                let (src, dst) = (Pages::new(src, page_len, 0), Pages::new(dst, page_len, 0));
                if let Err(e) = engine.submit_paged_writes(
                    page_len,
                    imm,
                    (buf.handle(), &src),
                    (&dst_desc, &dst),
                    done,
                ) {
                    out.emit(&refused(e));
                }
            }
            Command::Receive { buf_len, count } => {
                let o = out.clone();
                if let Err(e) = engine.submit_recvs(buf_len, count, move |m| {
                    o.emit(&Event::Message { bytes: m.to_vec() });
                }) {
                    out.emit(&refused(e));
                }
            }
            Command::Send { to, bytes, tag } => {
                let done = done_event(tag, &out);
                if let Err(e) = engine.submit_send(&to, &bytes, done) {
                    out.emit(&refused(e));
                }
            }
            Command::Freeze => {
                // Only this thread is left to call into the engine, and it now only reads
                // stdin (a frozen peer is waiting to be killed).
                if let Some(p) = passes.take() {
                    p.stop();
                }
                out.emit(&Event::Frozen);
            }
            Command::Exit => break,
        }
    }
    if let Some(p) = passes.take() {
        p.stop();
    }
    drop(buf);
    engine.shutdown();
    Ok(())
}
