//! The transfer engine over libfabric (`tcp;ofi_rxm` and `shm`), two engines in one process,
//! each operation beside the provider's bare RMA path measured in the same run:
//!
//! - `fabric_round_trip/<provider>/{engine,bare}/<size>`: one ping-pong round trip (a write
//!   with an immediate, answered by one of the same size) through two engines, against the
//!   same ping-pong through two bare `FabricDomain`s (`fabric::bench::RawEndpoint`: no
//!   submission queue, no transfer bookkeeping, no IMM counter). The difference is what the
//!   engine costs on top of the provider. Size 0 is the immediate-only round trip.
//! - `fabric_paged/<provider>/engine/<page>`: one paged transfer of 256 pages with an
//!   immediate per page, against `bare_stream/<page>`: the same 256 page writes posted straight
//!   to the bare provider with up to 64 in flight. Throughput is in pages.
//!
//! Both engines use manual progress: the bench thread drives its engine and a helper thread
//! drives the answering one, so the two cores here are not shared with idle worker threads.
//! `kvroute bench fabric` is the fuller report (two processes, `fi_pingpong` beside every
//! row); this bench is the quick A/B for changes to the engine's fabric path. A machine
//! without libfabric prints why and runs nothing.

// A bench whose setup fails should stop loudly, so `expect` is right here.
#![allow(clippy::expect_used)]

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_transport::fabric::bench::{self, RawEndpoint};
use kvroute_transport::{
    EngineConfig, FabricConfig, MrDesc, Progress, ProviderChoice, RegisteredBuffer, TransferEngine,
};

const BUFFER: usize = 1 << 20;
const SIZES: [u64; 3] = [0, 64 << 10, 1 << 20];
const PAGES: u32 = 256;
const PAGE_SIZES: [u64; 2] = [1 << 10, 4 << 10];
/// Bare writes in flight at most (the provider pushes back earlier with EAGAIN if it must).
const WINDOW: u64 = 64;

fn config(provider: ProviderChoice) -> FabricConfig {
    FabricConfig {
        node: Some("127.0.0.1".to_owned()),
        required: true,
        ..FabricConfig::provider(provider)
    }
}

/// What the answering thread is asked to do.
enum Job {
    /// Answer `count` engine pings of `size` bytes.
    Engine { size: u64, count: u64 },
    /// Answer `count` bare pings of `size` bytes.
    Bare { size: u64, count: u64 },
    /// Take `count` bare writes.
    Absorb { count: u64 },
}

/// The answering side: its own engine and bare endpoint, driven by one thread that also runs
/// the engine's passes between jobs (tcp;ofi_rxm only moves data while its target
/// progresses).
struct Answerer {
    jobs: Option<mpsc::Sender<Job>>,
    done: mpsc::Receiver<()>,
    thread: Option<JoinHandle<()>>,
}

impl Answerer {
    /// Hands the answerer a job; [`Answerer::finish`] waits for it.
    fn start(&self, job: Job) {
        self.jobs
            .as_ref()
            .expect("the answerer is running")
            .send(job)
            .expect("the answerer is alive");
    }

    fn finish(&self) {
        self.done.recv().expect("the answerer finished its job");
    }
}

impl Drop for Answerer {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            // A panicking answerer has printed its message and failed the bench thread's wait.
            let _ = thread.join();
        }
    }
}

/// The bench thread's side of one provider.
struct Pair {
    engine: TransferEngine,
    buf: RegisteredBuffer,
    peer_buf: MrDesc,
    bare: RawEndpoint,
    answerer: Answerer,
}

fn open_engine(provider: &ProviderChoice) -> TransferEngine {
    let engine = EngineConfig {
        progress: Progress::Manual,
        ..EngineConfig::default()
    };
    TransferEngine::fabric(&config(provider.clone()), engine)
        .expect("a fabric engine")
        .0
}

/// Opens both sides, or says why not (no libfabric, provider missing).
fn pair(provider: &ProviderChoice) -> Option<Pair> {
    if let Err(e) = TransferEngine::fabric(&config(provider.clone()), EngineConfig::default()) {
        eprintln!("fabric bench over {provider} skipped: {e}");
        return None;
    }
    let engine = open_engine(provider);
    let buf = engine.alloc_mr(BUFFER).expect("a buffer");
    let mut bare = RawEndpoint::open(&config(provider.clone()), BUFFER).expect("a bare endpoint");

    let (addr_tx, addr_rx) = mpsc::channel();
    let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
    let (done_tx, done_rx) = mpsc::channel();
    let my_desc = buf.desc().clone();
    let my_bare = bare.address();
    let provider_for_thread = provider.clone();
    let thread = std::thread::spawn(move || {
        let engine = open_engine(&provider_for_thread);
        let buf = engine.alloc_mr(BUFFER).expect("a buffer");
        let mut bare =
            RawEndpoint::open(&config(provider_for_thread), BUFFER).expect("a bare endpoint");
        bare.connect(&my_bare).expect("connect the bare endpoints");
        addr_tx
            .send((buf.desc().clone(), bare.address()))
            .expect("the bench thread waits for the address");
        loop {
            match jobs_rx.try_recv() {
                Ok(Job::Engine { size, count }) => {
                    bench::answer_pings(&engine, &buf, &my_desc, size, count)
                        .expect("engine pongs");
                    done_tx.send(()).expect("the bench thread waits");
                }
                Ok(Job::Bare { size, count }) => {
                    bare.answer(size, count).expect("bare pongs");
                    done_tx.send(()).expect("the bench thread waits");
                }
                Ok(Job::Absorb { count }) => {
                    bare.absorb(count).expect("bare writes arrive");
                    done_tx.send(()).expect("the bench thread waits");
                }
                Err(mpsc::TryRecvError::Empty) => {
                    if !engine.progress() {
                        std::thread::yield_now();
                    }
                }
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        }
    });
    let (peer_buf, peer_bare) = addr_rx.recv().expect("the answerer's addresses");
    bare.connect(&peer_bare)
        .expect("connect the bare endpoints");
    let answerer = Answerer {
        jobs: Some(jobs_tx),
        done: done_rx,
        thread: Some(thread),
    };
    // Connect both directions and warm the paths before anything is timed.
    answerer.start(Job::Engine {
        size: 0,
        count: 100,
    });
    bench::pingpong(&engine, &buf, &peer_buf, 0, 100, 0).expect("engine warm-up");
    answerer.finish();
    answerer.start(Job::Bare {
        size: 0,
        count: 100,
    });
    bare.pingpong(0, 100, 0).expect("bare warm-up");
    answerer.finish();
    Some(Pair {
        engine,
        buf,
        peer_buf,
        bare,
        answerer,
    })
}

fn providers() -> [(ProviderChoice, &'static str); 2] {
    [(ProviderChoice::Tcp, "tcp"), (ProviderChoice::Shm, "shm")]
}

fn round_trip(c: &mut Criterion) {
    for (provider, name) in providers() {
        let Some(mut p) = pair(&provider) else {
            continue;
        };
        let mut group = c.benchmark_group(format!("fabric_round_trip/{name}"));
        group.measurement_time(Duration::from_secs(3));
        for size in SIZES {
            group.throughput(Throughput::Bytes(2 * size.max(1)));
            group.bench_function(BenchmarkId::new("engine", size), |b| {
                b.iter_custom(|iters| {
                    // The answerer runs in the other thread while this one pings.
                    p.answerer.start(Job::Engine { size, count: iters });
                    let r = bench::pingpong(&p.engine, &p.buf, &p.peer_buf, size, 0, iters)
                        .expect("engine ping-pong");
                    p.answerer.finish();
                    Duration::from_secs_f64(r.usec_per_xfer * 2.0 * iters as f64 / 1e6)
                });
            });
            group.bench_function(BenchmarkId::new("bare", size), |b| {
                b.iter_custom(|iters| {
                    p.answerer.start(Job::Bare { size, count: iters });
                    let r = p.bare.pingpong(size, 0, iters).expect("bare ping-pong");
                    p.answerer.finish();
                    Duration::from_secs_f64(r.usec_per_xfer * 2.0 * iters as f64 / 1e6)
                });
            });
        }
        group.finish();
    }
}

fn paged(c: &mut Criterion) {
    for (provider, name) in providers() {
        let Some(mut p) = pair(&provider) else {
            continue;
        };
        let mut group = c.benchmark_group(format!("fabric_paged/{name}"));
        group.measurement_time(Duration::from_secs(3));
        group.throughput(Throughput::Elements(u64::from(PAGES)));
        for page in PAGE_SIZES {
            group.bench_function(BenchmarkId::new("engine", page), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let s = bench::paged(&p.engine, &p.buf, &p.peer_buf, page, PAGES)
                            .expect("paged writes");
                        total += Duration::from_secs_f64(s.count as f64 / s.per_s);
                    }
                    total
                });
            });
            group.bench_function(BenchmarkId::new("bare_stream", page), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let count = u64::from(PAGES);
                        p.answerer.start(Job::Absorb { count });
                        let s = p.bare.stream(page, count, WINDOW).expect("bare stream");
                        p.answerer.finish();
                        total += Duration::from_secs_f64(s.count as f64 / s.per_s);
                    }
                    total
                });
            });
        }
        group.finish();
    }
}

criterion_group!(benches, round_trip, paged);
criterion_main!(benches);
