//! [`TransferEngine`]: the public API of paper 002 figure 2 over any [`Domain`].
//!
//! An engine is one or more *domain groups* (one per device, each with 1-4 NICs and its own
//! worker thread), an IMM counter, a callback thread on which every user callback runs, and a
//! memory-word watcher started on first use. Requests are checked and resolved on the calling
//! thread, then queued to the worker of the group that owns the source memory; a full queue
//! either waits or fails, as configured ([`Backpressure`]). With [`Progress::Manual`] a
//! request is taken by the submitting thread itself when it can be (see there).

mod api;
pub(crate) mod callbacks;
mod group;
mod imm_watch;
mod message;
mod observe;
mod pass_lock;
mod shared;
mod stats;
mod unit_wr;
mod worker;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::thread::{JoinHandle, ThreadId};
use std::time::Duration;

use crossbeam_utils::CachePadded;

pub use api::{ImmTarget, PeerGroupHandle, UnexpectedImms};
use callbacks::Job;
pub use imm_watch::ImmWatch;
pub use observe::{TRANSFER_BUCKETS, describe_metrics, export_metrics, time_transfers};
use pass_lock::PassLock;
use shared::{Directory, EngineShared, GroupShared, PeerGroupEntry, WorkerWake};
pub use stats::{DomainStats, EngineStats, GroupStats};

use crate::addr::{MAX_NICS, NetAddr};
use crate::domain::Domain;
use crate::error::{TransferError, TransportError};
use crate::imm_counter::ImmCounter;
use crate::mem::{FaultPlan, MemFabric};
use crate::mr::Device;
use crate::watcher::WatcherService;

/// Engine ids, so a handle from one engine is refused by another.
static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1);

/// What a submit does when its worker's queue is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backpressure {
    /// Wait for room (the default).
    #[default]
    Wait,
    /// Return [`TransportError::QueueFull`] at once.
    Fail,
}

/// Who runs the domain groups' passes (posting, polling, reposting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Progress {
    /// A worker thread per group (paper 002 section 3.4): the default.
    #[default]
    Thread,
    /// No worker threads: passes run inside [`TransferEngine::progress`], which the
    /// application calls (also while it waits for a completion, an arrival or a reply). For
    /// machines with fewer cores than busy threads, and for run-to-completion loops. Control
    /// calls (`reg_mr`, connecting, ...) progress the engine themselves while they wait.
    ///
    /// A transfer submitted while no other thread is running its group's pass, with nothing
    /// queued ahead of it, is taken by the submitting thread as a pass would take it: its
    /// first work requests (up to a pass's budget) are posted before the submit returns, as
    /// a libfabric post under manual progress starts its operation. Completions, arrivals,
    /// the rest of a large transfer and everything queued still move only inside `progress`.
    /// A submit that finds another thread in the pass queues its transfer for that pass.
    Manual,
}

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Submissions a worker's queue holds.
    pub queue_capacity: usize,
    /// What a submit does when the queue is full.
    pub backpressure: Backpressure,
    /// CPU cores to pin the workers to, one per group in order (missing: unpinned).
    pub pin_cores: Vec<usize>,
    /// How long an idle worker keeps polling before it parks.
    pub idle_spin: Duration,
    /// Record submit-to-post and post-span latencies (for benches; off in production).
    pub record_latency: bool,
    /// How often the watcher thread looks at idle watched words.
    pub watcher_poll: Duration,
    /// Largest message `submit_send` accepts.
    pub max_send_bytes: usize,
    /// Prefix of the engine's thread names.
    pub name: String,
    /// Worker threads, or passes run by the application.
    pub progress: Progress,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            queue_capacity: 4096,
            backpressure: Backpressure::Wait,
            pin_cores: Vec::new(),
            idle_spin: Duration::from_micros(50),
            record_latency: false,
            watcher_poll: Duration::from_micros(50),
            max_send_bytes: 1 << 20,
            name: "kvroute".to_owned(),
            progress: Progress::Thread,
        }
    }
}

/// What runs a group's passes.
enum Runner {
    Thread(JoinHandle<()>),
    Manual(Box<dyn worker::ManualProgress>),
}

type Spawner = Box<
    dyn FnOnce(
        u16,
        &Arc<EngineShared>,
        &EngineConfig,
    ) -> Result<(Arc<GroupShared>, Runner), TransportError>,
>;

/// Builds a [`TransferEngine`] from domain groups.
pub struct EngineBuilder {
    config: EngineConfig,
    groups: Vec<Spawner>,
}

impl std::fmt::Debug for EngineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineBuilder")
            .field("config", &self.config)
            .field("groups", &self.groups.len())
            .finish()
    }
}

impl EngineBuilder {
    /// Replaces the configuration.
    #[must_use]
    pub fn config(mut self, config: EngineConfig) -> Self {
        self.config = config;
        self
    }

    /// Adds a domain group serving `device` with `domains` (1 to 4 NICs of one provider). The
    /// first group added is the engine's main one (sends, receives, host memory by default).
    #[must_use]
    pub fn group<D: Domain>(mut self, device: Device, domains: Vec<D>) -> Self {
        self.groups.push(Box::new(move |index, engine, config| {
            spawn_group(index, device, domains, engine, config)
        }));
        self
    }

    /// Starts the threads.
    pub fn build(self) -> Result<TransferEngine, TransportError> {
        if self.groups.is_empty() {
            return Err(TransportError::InvalidArgument(
                "an engine needs at least one domain group",
            ));
        }
        if self.config.queue_capacity == 0 {
            return Err(TransportError::InvalidArgument(
                "queue_capacity must be positive",
            ));
        }
        let (callbacks, callback_thread) =
            callbacks::spawn(format!("{}-callbacks", self.config.name)).map_err(|e| {
                TransportError::Domain(format!("spawning the callback thread: {e}"))
            })?;
        let engine = Arc::new(EngineShared {
            id: NEXT_ENGINE.fetch_add(1, Ordering::Relaxed),
            imm: ImmCounter::new(),
            callbacks: callbacks.clone(),
            unexpected_imm_handler: AtomicBool::new(false),
            unexpected_imm_queue: std::sync::OnceLock::new(),
            record_latency: self.config.record_latency,
        });
        let callback_thread_id = callback_thread.thread().id();
        let mut inner = Inner {
            engine,
            groups: Vec::new(),
            peer_groups: RwLock::new(Vec::new()),
            backpressure: self.config.backpressure,
            max_send_bytes: self.config.max_send_bytes,
            workers: Mutex::new(Vec::new()),
            manual: Vec::new(),
            manual_progress: self.config.progress == Progress::Manual,
            callback_thread: Mutex::new(Some(callback_thread)),
            callback_thread_id,
            watcher: WatcherService::new(
                callbacks,
                self.config.watcher_poll,
                format!("{}-watcher", self.config.name),
            ),
            receiving: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
        };
        for (index, spawn) in self.groups.into_iter().enumerate() {
            match spawn(index as u16, &inner.engine, &self.config) {
                Ok((group, runner)) => {
                    inner.groups.push(group);
                    match runner {
                        Runner::Thread(thread) => inner
                            .workers
                            .get_mut()
                            .unwrap_or_else(PoisonError::into_inner)
                            .push(thread),
                        Runner::Manual(m) => inner.manual.push(PassLock::new(Some(m))),
                    }
                }
                Err(e) => {
                    inner.shutdown();
                    return Err(e);
                }
            }
        }
        tracing::info!(groups = inner.groups.len(), provider = %inner.groups[0].provider, "transfer engine started");
        let inner = Arc::new(inner);
        observe::register(&inner);
        Ok(TransferEngine { inner })
    }
}

fn spawn_group<D: Domain>(
    index: u16,
    device: Device,
    domains: Vec<D>,
    engine: &Arc<EngineShared>,
    config: &EngineConfig,
) -> Result<(Arc<GroupShared>, Runner), TransportError> {
    if domains.is_empty() || domains.len() > MAX_NICS {
        return Err(TransportError::InvalidArgument(
            "a domain group has 1 to 4 NICs",
        ));
    }
    let provider = domains[0].provider().to_owned();
    if domains.iter().any(|d| d.provider() != provider) {
        return Err(TransportError::InvalidArgument(
            "the NICs of a group must share a provider",
        ));
    }
    let addr = NetAddr {
        nics: domains.iter().map(Domain::address).collect(),
    };
    let (tx, rx) = crossbeam_channel::bounded(config.queue_capacity);
    let wake = Arc::new(WorkerWake::default());
    let shared = Arc::new(GroupShared {
        index,
        device,
        provider,
        addr,
        directory: Directory::default(),
        tx,
        rx: rx.clone(),
        worker_done: AtomicBool::new(false),
        wake: wake.clone(),
        counters: (0..domains.len())
            .map(|_| stats::DomainCounters::default())
            .collect(),
        posts_unreported: domains.iter().all(Domain::posts_unreported),
        worker_written: CachePadded::default(),
    });
    let group = group::Group::new(domains, shared.clone(), engine.clone())?;
    let driver = worker::Driver::new(group, rx);
    let retire = shared::RetireOnExit(shared.clone(), engine.callbacks.clone());
    if config.progress == Progress::Manual {
        return Ok((
            shared,
            Runner::Manual(Box::new(worker::Manual::new(driver, retire))),
        ));
    }
    let worker_config = worker::WorkerConfig {
        core: config.pin_cores.get(index as usize).copied(),
        idle_spin: config.idle_spin,
    };
    let thread = std::thread::Builder::new()
        .name(format!("{}-worker-{index}", config.name))
        .spawn(move || {
            // Dropped after the group, even if the worker panics.
            let _retire = retire;
            worker::run(driver, &wake, worker_config);
        })
        .map_err(|e| TransportError::Domain(format!("spawning a worker: {e}")))?;
    Ok((shared, Runner::Thread(thread)))
}

/// A manual-progress group's pass; `None` once the group has stopped.
type ManualGroup = Option<Box<dyn worker::ManualProgress>>;

struct Inner {
    engine: Arc<EngineShared>,
    groups: Vec<Arc<GroupShared>>,
    peer_groups: RwLock<Vec<PeerGroupEntry>>,
    backpressure: Backpressure,
    max_send_bytes: usize,
    workers: Mutex<Vec<JoinHandle<()>>>,
    /// Groups without a worker thread (manual progress), taken when they stop.
    manual: Vec<PassLock<ManualGroup>>,
    manual_progress: bool,
    callback_thread: Mutex<Option<JoinHandle<()>>>,
    callback_thread_id: ThreadId,
    watcher: WatcherService,
    receiving: AtomicBool,
    stopped: AtomicBool,
}

impl Inner {
    /// Stops everything once: workers fail what is in flight with `Shutdown`, waiting
    /// expectations are failed, then the watcher and callback threads end.
    fn shutdown(&self) {
        if self.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        for m in &self.manual {
            if let Some(mut group) = m.lock().take() {
                group.stop();
            }
        }
        for g in self.groups.iter().filter(|_| !self.manual_progress) {
            // Blocking send: a full queue drains, and Stop is handled after what precedes it.
            let _ = g.tx.send(message::Message::Command(message::Command::Stop));
            crate::domain::Notify::notify(&*g.wake);
        }
        for worker in
            std::mem::take(&mut *self.workers.lock().unwrap_or_else(PoisonError::into_inner))
        {
            if worker.join().is_err() {
                tracing::error!("a worker thread panicked");
            }
        }
        for done in self.engine.imm.drain_waiting() {
            done.finish(Err(TransferError::Shutdown), |f, o| {
                self.engine.callbacks.run_done(f, o)
            });
        }
        self.watcher.stop();
        self.engine.callbacks.push(Job::Stop);
        // A callback that drops the last engine handle runs this on the callback thread, which
        // must not wait for itself: it stops after the current job instead.
        if std::thread::current().id() != self.callback_thread_id
            && let Some(t) = self
                .callback_thread
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take()
        {
            let _ = t.join();
        }
        tracing::info!("transfer engine stopped");
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shutdown();
        observe::retire(self);
    }
}

/// A transfer engine. Cloning gives another handle to the same engine; the engine stops when
/// the last handle is dropped or [`TransferEngine::shutdown`] is called. (A callback that holds
/// a handle keeps the engine alive: call `shutdown` explicitly then.)
#[derive(Clone)]
pub struct TransferEngine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("id", &self.inner.engine.id)
            .field("groups", &self.inner.groups.len())
            .field("provider", &self.inner.groups[0].provider)
            .finish_non_exhaustive()
    }
}

impl TransferEngine {
    /// A builder with the default configuration and no groups.
    pub fn builder() -> EngineBuilder {
        EngineBuilder {
            config: EngineConfig::default(),
            groups: Vec::new(),
        }
    }

    /// An engine with one host group of `nics` NICs on an in-process fabric.
    pub fn mem(fabric: &MemFabric, nics: usize) -> Result<Self, TransportError> {
        Self::mem_with(fabric, nics, FaultPlan::NONE, EngineConfig::default())
    }

    /// The same with a fault plan on every NIC and a configuration.
    pub fn mem_with(
        fabric: &MemFabric,
        nics: usize,
        faults: FaultPlan,
        config: EngineConfig,
    ) -> Result<Self, TransportError> {
        let domains = (0..nics)
            .map(|i| {
                fabric.domain_with(FaultPlan {
                    seed: faults.seed.wrapping_add(i as u64),
                    ..faults
                })
            })
            .collect();
        Self::builder()
            .config(config)
            .group(Device::Host, domains)
            .build()
    }

    /// An engine with one host group of `nics` NICs, each a verbs domain on a device of the
    /// in-process [`crate::verbs::fake::FakeFabric`] (what the verbs domain is tested on;
    /// with the `fake-verbs` feature).
    #[cfg(feature = "fake-verbs")]
    pub fn verbs_fake(
        fabric: &crate::verbs::fake::FakeFabric,
        nics: usize,
        faults: crate::verbs::fake::FakeFaults,
        verbs: &crate::verbs::VerbsConfig,
        config: EngineConfig,
    ) -> Result<Self, TransportError> {
        let domains = (0..nics)
            .map(|i| {
                let device = fabric.device_with(crate::verbs::fake::FakeFaults {
                    seed: faults.seed.wrapping_add(i as u64),
                    ..faults
                });
                crate::verbs::VerbsDomain::new(device, verbs.clone())
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::builder()
            .config(config)
            .group(Device::Host, domains)
            .build()
    }

    /// An engine with one host group on this machine's RDMA NIC through verbs
    /// ([`crate::verbs::HwVerbs`]); an error naming what is missing where there is no
    /// `libibverbs` or no device.
    pub fn verbs(
        verbs: &crate::verbs::VerbsConfig,
        config: EngineConfig,
    ) -> Result<Self, TransportError> {
        verbs.validate()?;
        let device = crate::verbs::HwVerbs::open(verbs)?;
        let domain = crate::verbs::VerbsDomain::new(device, verbs.clone())?;
        Self::builder()
            .config(config)
            .group(Device::Host, vec![domain])
            .build()
    }

    /// [`TransferEngine::verbs`] with one more group per CUDA device of `gpus`, each on its
    /// own context of the same NIC, registering that device's memory as dma-bufs
    /// ([`crate::verbs::cuda::CudaDmaBuf`]; GPUDirect RDMA without `nvidia-peermem`).
    #[cfg(feature = "cuda")]
    pub fn verbs_with_gpus(
        verbs: &crate::verbs::VerbsConfig,
        gpus: &[u32],
        config: EngineConfig,
    ) -> Result<Self, TransportError> {
        verbs.validate()?;
        let host =
            crate::verbs::VerbsDomain::new(crate::verbs::HwVerbs::open(verbs)?, verbs.clone())?;
        let mut builder = Self::builder()
            .config(config)
            .group(Device::Host, vec![host]);
        for &ordinal in gpus {
            let exporter = crate::verbs::cuda::CudaDmaBuf::new(ordinal)?;
            let domain = crate::verbs::VerbsDomain::with_dmabuf(
                crate::verbs::HwVerbs::open(verbs)?,
                verbs.clone(),
                Box::new(exporter),
            )?;
            builder = builder.group(Device::Cuda { ordinal }, vec![domain]);
        }
        builder.build()
    }

    /// Stops the engine: workers fail what is in flight or still queued with
    /// [`TransferError::Shutdown`], waiting expectations are failed, the watcher and callback
    /// threads end. Later calls fail with [`TransportError::Shutdown`]. Every transfer whose
    /// submit returned `Ok` still completes exactly once, also one racing the shutdown from
    /// another thread.
    pub fn shutdown(&self) {
        self.inner.shutdown();
    }

    /// Runs one pass of every group (posting, polling completions, reposting receive
    /// buffers) if the engine uses [`Progress::Manual`]; returns whether any pass did
    /// something. With worker threads it does nothing and returns `false`. A group another
    /// thread is progressing at the moment is skipped.
    pub fn progress(&self) -> bool {
        let mut busy = false;
        for m in &self.inner.manual {
            if let Some(mut g) = m.try_lock()
                && let Some(group) = g.as_mut()
            {
                busy |= group.pass();
            }
        }
        busy
    }

    /// Whether the application runs the passes ([`Progress::Manual`]).
    pub fn manual_progress(&self) -> bool {
        self.inner.manual_progress
    }

    /// Counters of every group and NIC.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            groups: self
                .inner
                .groups
                .iter()
                .map(|g| stats::snapshot(&g.counters, &g.worker_written))
                .collect(),
            imm_values_tracked: self.inner.engine.imm.tracked_values(),
            imm_dropped: self.inner.engine.imm.dropped(),
        }
    }

    /// Takes the latency samples recorded so far (with `record_latency` on): per group,
    /// submit-to-first-post and first-to-last-post durations.
    pub fn take_latency_samples(&self) -> Vec<(Vec<Duration>, Vec<Duration>)> {
        self.inner
            .groups
            .iter()
            .map(|g| {
                (
                    stats::LatencyLog::take(&g.worker_written.latency.submit_to_post),
                    stats::LatencyLog::take(&g.worker_written.latency.post_span),
                )
            })
            .collect()
    }
}
