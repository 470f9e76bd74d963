//! The holder: serves partial attention over the chunks it holds (route) and pushes them into
//! requesters' pools (fetch).
//!
//! One serving thread drains every request that has arrived, groups the segments of all of
//! them by (chunk, layer, kind) and runs one kernel call per group (paper 000 section 5.3's
//! second reduction: the batch is all requests for the same chunk), then answers each request
//! with one write of its partial rows (the first reduction). One control thread keeps every
//! requester's rendezvous connection (non-blocking, woken by `poll`; a connection costs no
//! thread); at the cap the next requester is told [`crate::session::Answer::Busy`], unless a
//! session has been idle long enough to give its slot up ([`HolderConfig::idle_evict`]). A
//! session that never routes loses its slot after [`HolderConfig::open_timeout`]. Each session
//! gets an inbox registered for it alone, deregistered when it ends, so a descriptor from an
//! earlier session of the slot reaches nothing.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute_costmodel::HolderCompute;
use kvroute_kernels::Backend;
use kvroute_kvstore::ChunkEntry;
use kvroute_kvstore::directory::{ChunkRecord, HolderRecord, SCHEMA};
use kvroute_transport::{NetAddr, RegisteredBuffer, Staging, TransferEngine};

use crate::chunks::HeldChunks;
use crate::error::RemoteError;
use crate::kernel_rate::{KernelRate, calibrate_with};
use crate::observe::SessionEvent;
use crate::session::{Hello, HolderStats};
use crate::wire;
use compute::Compute;

mod compute;
mod control;
mod group;
mod serve;
mod transfer;

/// How a holder is set up. [`Default`] gives 8 requesters, 4 MiB slots and replies, 16 MiB
/// of gather staging per requester (14,563 rows: top-2048 over 7 layers), CPU kernels,
/// 200 us of polling after each batch, 10 s for a hello, 32 control connections (16 from one
/// source address), 5 s for a session's proof, 30 s for its first request and 10 s of
/// idleness before a waiting requester may take a session's slot. Each requester's reply
/// staging is two replies long (consecutive answers alternate halves, so an answer never
/// waits for the write of the one before it); staging is touched only as far as it is used.
#[derive(Debug, Clone, PartialEq)]
pub struct HolderConfig {
    /// Concurrent requesters served; the next one is told busy (paper 000 section 6.3: ~8).
    pub max_requesters: usize,
    /// Bytes of each requester's inbox slot (the largest request).
    pub slot_bytes: usize,
    /// Bytes of each requester's reply staging (the largest reply).
    pub reply_bytes: usize,
    /// Bytes of each requester's gather staging: the selected rows of one request's gather
    /// segments, packed so that each destination page takes one write (1152 B per row).
    pub gather_bytes: usize,
    /// Which kernels run the partials. [`Backend::Cuda`] uploads every held chunk to the GPU
    /// when the holder starts (failing the start if it cannot) and attends them there, each
    /// call moving only its query rows and its partial; [`Backend::Auto`] does the same where
    /// a GPU is usable (else it serves from host memory) and runs a call on the GPU when
    /// [`Backend::resolve`] says so for a [`kvroute_kernels::Call::ResidentPartial`].
    pub backend: Backend,
    /// How long the serving thread keeps polling for arrivals after its last batch before it
    /// blocks (with worker threads; under manual progress it polls while any session is open,
    /// as nobody else progresses the engine).
    pub idle_spin: Duration,
    /// How long a new control connection may take to send its hello before it is closed.
    pub hello_timeout: Duration,
    /// Control connections open at once, sessions included (each holds a socket and its
    /// buffers on the one control thread); one more is closed at once. At least
    /// `max_requesters`.
    pub max_connections: usize,
    /// How long a granted session may go without its first request or ping before the holder
    /// closes it and frees its slot (a hello that never uses the data plane).
    pub open_timeout: Duration,
    /// How long a session must have gone without a request before a new requester that finds
    /// every slot taken may have its slot: the session idle longest is closed and the newcomer
    /// welcomed in its place. Sessions busier than this are never closed. Pings do not count:
    /// a session that only pings holds a slot no one else is waiting for, and no longer.
    pub idle_evict: Duration,
    /// How long a granted session may go without proving its hello's address (the proof
    /// message through the transport) before it is closed; until then it is the first to
    /// make room for a newcomer, and nothing but its welcome is answered.
    pub proof_timeout: Duration,
    /// Control connections (sessions included) one source address may hold at once. A
    /// newcomer past it, or past `max_connections`, takes the place of the oldest connection
    /// that has not said hello, else of the oldest unproven session (of that source, or of
    /// any when the holder is full); only if there is none is the newcomer closed.
    pub max_per_source: usize,
}

impl Default for HolderConfig {
    fn default() -> Self {
        Self {
            max_requesters: 8,
            slot_bytes: 4 << 20,
            reply_bytes: 4 << 20,
            gather_bytes: 16 << 20,
            backend: Backend::Cpu,
            idle_spin: Duration::from_micros(200),
            hello_timeout: Duration::from_secs(10),
            max_connections: 32,
            open_timeout: Duration::from_secs(30),
            idle_evict: Duration::from_secs(10),
            proof_timeout: Duration::from_secs(5),
            max_per_source: 16,
        }
    }
}

#[derive(Debug, Clone)]
struct Session {
    hello: Hello,
    /// The secret every request and ping of the session must carry.
    token: u64,
    /// The least sequence number the session may use next: each write of its slot is served
    /// once, and a stray immediate cannot replay it.
    next_seq: Arc<AtomicU64>,
    /// The session's inbox, registered for it alone (deregistered when the last clone goes).
    inbox: Arc<RegisteredBuffer>,
    /// When it was granted.
    granted: Instant,
    /// Microseconds after `granted` of its last admitted request or ping; 0: none yet.
    last_used_us: Arc<AtomicU64>,
    /// Microseconds after `granted` of its last admitted request; 0: none yet. What
    /// [`HolderConfig::idle_evict`] measures, so that pings alone cannot keep a slot from a
    /// requester waiting for one.
    last_request_us: Arc<AtomicU64>,
    /// Its control connection, shut down to close the session from outside the control
    /// thread's handling of it.
    control: Arc<TcpStream>,
    /// Set once the session is closing: closed by the holder, or its connection ended.
    closing: Arc<AtomicBool>,
    /// Held by the serving thread while it posts writes to the session's regions; an ending
    /// session sets `closing`, then takes it once, so that every write to its requester was
    /// submitted before the requester's engine is released (a write after the release would
    /// connect it again) and none is submitted after.
    posting: Arc<Mutex<()>>,
    /// Where the session's proof stands ([`crate::wire::encode_proof`]): [`PROOF_PENDING`],
    /// [`PROOF_OK`] once it came from the hello's address (nothing of the session is served
    /// before), [`PROOF_FAILED`] once it came from another.
    proof: Arc<AtomicU8>,
}

impl Session {
    /// Whether a request or ping with `token` and `seq` is the session's and new; if so,
    /// `seq` is spent and the session counts as used now (and as busy, for a request).
    fn admit(&self, token: u64, seq: u64, what: Use) -> bool {
        let admitted = token == self.token
            && self.proof.load(Ordering::Acquire) == PROOF_OK
            && self
                .next_seq
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |next| {
                    (seq >= next).then(|| seq.saturating_add(1))
                })
                .is_ok();
        if admitted {
            let us = self.granted.elapsed().as_micros().max(1);
            let us = u64::try_from(us).unwrap_or(u64::MAX);
            self.last_used_us.store(us, Ordering::Release);
            if what == Use::Request {
                self.last_request_us.store(us, Ordering::Release);
            }
        }
        admitted
    }

    /// How long it has gone without a request or ping (since its grant, if it had none), and
    /// whether it ever had one.
    fn idle(&self) -> (Duration, bool) {
        let used = self.last_used_us.load(Ordering::Acquire);
        let since = self.granted.elapsed();
        (since.saturating_sub(Duration::from_micros(used)), used > 0)
    }

    /// How long it has gone without a request (since its grant, if it had none).
    fn without_requests(&self) -> Duration {
        let used = self.last_request_us.load(Ordering::Acquire);
        self.granted
            .elapsed()
            .saturating_sub(Duration::from_micros(used))
    }

    /// The right to post writes to the session's regions, unless it is closing.
    fn posting(&self) -> Option<std::sync::MutexGuard<'_, ()>> {
        let guard = lock(&self.posting);
        (!self.closing.load(Ordering::Acquire)).then_some(guard)
    }

    /// Stops posting to the session: once this returns, the serving thread has submitted
    /// every write it will ever submit to it.
    fn stop_posting(&self) {
        self.closing.store(true, Ordering::Release);
        drop(lock(&self.posting));
    }

    /// Whether its proof arrived from its hello's address.
    fn proven(&self) -> bool {
        self.proof.load(Ordering::Acquire) == PROOF_OK
    }

    /// Ends the session's control connection; the control thread then frees the slot (if the
    /// slot is still this session's). Whether this call closed it (false: it was closing already).
    fn close(&self) -> bool {
        if self.closing.swap(true, Ordering::AcqRel) {
            return false;
        }
        let _ = self.control.shutdown(std::net::Shutdown::Both);
        true
    }
}

/// What a session's admitted write was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Use {
    /// A request: work, which keeps the session's slot.
    Request,
    /// A ping: keeps the session open, not its slot from a waiting requester.
    Ping,
}

/// How long serving waits for the completion of a session's earlier write out of the staging
/// its next answer goes in. Reply staging alternates halves by the request's sequence number,
/// so that write is the answer before last, which its requester has long had; gather staging
/// is one range, whose last writes have landed (the requester sent again after they arrived)
/// but whose completions may lag (over `shm` a write completes once its peer's progress has
/// answered it, and an idle worker polls every millisecond at most). A requester that breaks
/// the protocol is the only one that can make serving wait this long, and then its answer
/// fails.
const STAGING_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// A session's proof has not arrived.
const PROOF_PENDING: u8 = 0;
/// A session's proof arrived from its hello's address.
const PROOF_OK: u8 = 1;
/// A session's proof arrived from another address.
const PROOF_FAILED: u8 = 2;

/// A session token: 8 bytes from the kernel's random source.
fn new_token() -> Result<u64, RemoteError> {
    use std::io::Read as _;
    let mut bytes = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(RemoteError::io("reading /dev/urandom for a session token"))?;
    Ok(u64::from_le_bytes(bytes))
}

/// Refuses a hello whose descriptors name NICs other than its own address's: a session's
/// replies and fetches go only to the engine that asked for them, never to a third party's.
fn check_hello(hello: &Hello) -> Result<(), String> {
    hello.addr.validate().map_err(|e| e.to_string())?;
    let own = |what: &str, desc: &kvroute_transport::MrDesc| {
        if desc.net_addr() == hello.addr {
            Ok(())
        } else {
            Err(format!(
                "the {what} region belongs to another engine than the hello's"
            ))
        }
    };
    own("reply", &hello.reply)?;
    hello.pool.as_ref().map_or(Ok(()), |pool| own("pool", pool))
}

/// The kernel roofline measured on the first held chunk's first layer, with the softmax
/// scale of DeepSeek-V2-Lite (any finite scale times the same), through the calls the holder
/// serves with (on the GPU where its chunks are resident there).
fn calibrate_on(chunks: &HeldChunks, compute: &Compute) -> Result<HolderCompute, RemoteError> {
    let first = chunks
        .chunks()
        .first()
        .ok_or_else(|| RemoteError::Config("a holder needs chunks".into()))?;
    let layer = chunks.layer_cache(first, 0, None)?;
    let rows: Vec<u16> = (0..layer.tokens())
        .flat_map(|t| layer.row(t))
        .copied()
        .collect();
    calibrate_with(&rows, |q, tokens, out| {
        compute
            .partial_wire(chunks, first, (0, Some(tokens)), q, None, 0.1147, out)
            .map(drop)
    })
}

struct Shared {
    engine: TransferEngine,
    config: HolderConfig,
    chunks: HeldChunks,
    /// Where the partials run, and the chunks' copies on a GPU.
    compute: Compute,
    staging: Staging,
    /// Per session, `gather_bytes` of packed gathered rows.
    gather_staging: Staging,
    entries: Vec<ChunkEntry>,
    sessions: Mutex<Vec<Option<Session>>>,
    /// Proof messages as the transport delivered them: (session, token, sender).
    proofs: crossbeam_channel::Receiver<(u16, u64, Option<kvroute_transport::NetAddr>)>,
    stats: Mutex<HolderStats>,
    /// The kernel's roofline, calibrated at start and refitted from served calls.
    kernel: Mutex<KernelRate>,
    stop: AtomicBool,
}

/// A running holder; dropping it stops it.
pub struct Holder {
    shared: Arc<Shared>,
    addr: SocketAddr,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holder")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl Holder {
    /// Starts serving `chunks` on `listener` (the rendezvous) and `engine` (the data path).
    pub fn start(
        engine: TransferEngine,
        listener: TcpListener,
        chunks: HeldChunks,
        config: HolderConfig,
    ) -> Result<Self, RemoteError> {
        if config.max_requesters == 0 || config.max_requesters > 1 << 16 {
            return Err(RemoteError::Config(
                "max_requesters must be 1 to 65536".into(),
            ));
        }
        if config.max_connections < config.max_requesters
            || config.max_per_source == 0
            || config.hello_timeout.is_zero()
            || config.open_timeout.is_zero()
            || config.proof_timeout.is_zero()
        {
            return Err(RemoteError::Config(
                "max_connections must be at least max_requesters, max_per_source at least 1, \
                 hello_timeout, open_timeout and proof_timeout above zero"
                    .into(),
            ));
        }
        if config.slot_bytes < wire::REQUEST_HEADER || config.reply_bytes < wire::reply_len(1, 0) {
            return Err(RemoteError::Config(
                "slot_bytes and reply_bytes must hold at least a header".into(),
            ));
        }
        let staging_bytes = |per: usize| {
            per.checked_mul(config.max_requesters)
                .ok_or_else(|| RemoteError::Config("staging larger than memory".into()))
        };
        let entries = chunks.entries(&engine.main_address());
        let compute = Compute::new(&chunks, config.backend)?;
        let kernel = KernelRate::new(calibrate_on(&chunks, &compute)?);
        let staging = engine.alloc_staging(staging_bytes(config.reply_bytes.saturating_mul(2))?)?;
        let gather_staging = engine.alloc_staging(staging_bytes(config.gather_bytes)?.max(1))?;
        // Arrivals straight from the progress pass: no callback-thread hop on the way to the
        // serving thread.
        let rx = engine.unexpected_imms();
        // Proof messages go to the control thread through a queue (the handler must not hold
        // the holder: the engine would then keep itself alive).
        let (proof_tx, proofs) = crossbeam_channel::bounded(1024);
        engine.submit_recvs_from(64, 64, move |message, from| {
            if let Some((session, token)) = wire::parse_proof(message) {
                let _ = proof_tx.try_send((session, token, from.cloned()));
            }
        })?;
        let shared = Arc::new(Shared {
            engine,
            sessions: Mutex::new(vec![None; config.max_requesters]),
            proofs,
            config,
            chunks,
            compute,
            staging,
            gather_staging,
            entries,
            stats: Mutex::new(HolderStats::default()),
            kernel: Mutex::new(kernel),
            stop: AtomicBool::new(false),
        });
        let addr = listener
            .local_addr()
            .map_err(RemoteError::io("reading the listener's address"))?;
        listener
            .set_nonblocking(true)
            .map_err(RemoteError::io("setting up the listener"))?;
        let serve = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("holder-serve".into())
                .spawn(move || shared.serve(&rx))
                .map_err(RemoteError::io("starting the serving thread"))?
        };
        let control = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("holder-control".into())
                .spawn(move || shared.control(&listener))
                .map_err(RemoteError::io("starting the control thread"))?
        };
        Ok(Self {
            shared,
            addr,
            threads: vec![serve, control],
        })
    }

    /// The control listener's address (what requesters connect to).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The chunks served, as registry entries.
    pub fn entries(&self) -> &[ChunkEntry] {
        &self.shared.entries
    }

    /// The transfer engine's address (what the entries name as their holder).
    pub fn engine_addr(&self) -> NetAddr {
        self.shared.engine.main_address()
    }

    /// This holder as a directory registers it: its record (id = control address) and one
    /// chunk record per chunk served, each the copy numbered `replica`.
    pub fn directory_records(&self, replica: u32) -> (HolderRecord, Vec<ChunkRecord>) {
        let record = HolderRecord::new(self.addr, self.engine_addr());
        let chunks = self
            .entries()
            .iter()
            .map(|e| ChunkRecord {
                schema: SCHEMA,
                holder: record.id.clone(),
                replica,
                entry: e.clone(),
            })
            .collect();
        (record, chunks)
    }

    /// The counters now.
    pub fn stats(&self) -> HolderStats {
        self.shared.stats()
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Shared {
    fn stats(&self) -> HolderStats {
        let mut s = lock(&self.stats).clone();
        s.active = lock(&self.sessions).iter().flatten().count() as u64;
        s.kernel = Some(lock(&self.kernel).current());
        s.cap = self.config.max_requesters as u64;
        s.gpu_resident_bytes = self.compute.resident_bytes() as u64;
        s
    }

    /// Closes every session that has not routed within `open_timeout` of its grant.
    /// Counts a control-plane event: in the holder's stats and for a metrics recorder.
    fn session_event(&self, event: SessionEvent) {
        {
            let mut stats = lock(&self.stats);
            match event {
                SessionEvent::Evicted => stats.evicted += 1,
                SessionEvent::Busy => stats.busy += 1,
                SessionEvent::Refused => stats.refused += 1,
                // Counted by the sessions table itself (`HolderStats::active`).
                SessionEvent::Opened => {}
            }
        }
        crate::observe::holder_session(event);
    }

    fn close_unopened(&self) {
        let sessions = lock(&self.sessions);
        for s in sessions.iter().flatten() {
            let (idle, used) = s.idle();
            let unproven = !s.proven() && s.granted.elapsed() >= self.config.proof_timeout;
            if ((!used && idle >= self.config.open_timeout) || unproven) && s.close() {
                self.session_event(SessionEvent::Evicted);
            }
        }
    }

    /// A free slot for a new session, else the slot of the oldest session that has not proven
    /// its address, else of the session longest without a request if that is at least
    /// `idle_evict` (the session whose slot it was is closed); `None` if every session is
    /// proven and busier.
    fn free_slot(&self, sessions: &[Option<Session>]) -> Option<usize> {
        if let Some(free) = sessions.iter().position(Option::is_none) {
            return Some(free);
        }
        let unproven = sessions
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((i, s.as_ref()?)))
            .filter(|(_, s)| !s.proven())
            .min_by_key(|(_, s)| s.granted)
            .map(|(i, _)| i);
        if let Some(slot) = unproven {
            if sessions[slot].as_ref().is_some_and(Session::close) {
                self.session_event(SessionEvent::Evicted);
            }
            return Some(slot);
        }
        let (slot, idle) = sessions
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((i, s.as_ref()?.without_requests())))
            .max_by_key(|&(_, idle)| idle)?;
        if idle < self.config.idle_evict {
            return None;
        }
        if sessions[slot].as_ref().is_some_and(Session::close) {
            self.session_event(SessionEvent::Evicted);
        }
        Some(slot)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
