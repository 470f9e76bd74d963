//! The holder: serves partial attention over the chunks it holds (route) and pushes them into
//! requesters' pools (fetch).
//!
//! One serving thread drains every request that has arrived, groups the segments of all of
//! them by (chunk, layer, kind) and runs one kernel call per group (paper 000 section 5.3's
//! second reduction: the batch is all requests for the same chunk), then answers each request
//! with one write of its partial rows (the first reduction). A control thread per requester
//! keeps its session; at the cap the next requester is told [`Answer::Busy`].

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use crossbeam_channel::{Receiver, RecvTimeoutError};
use kvroute_kernels::layout::{D_QK, PARTIAL_ROW_BYTES};
use kvroute_kernels::{
    Backend, Cache, Queries, Selection, WireOut, partial_dense_wire, partial_sparse_wire,
};
use kvroute_kvstore::{ChunkEntry, ChunkId, CorpusSpec, FullBlock, PAGE_BYTES, ROW_BYTES};
use kvroute_transport::{Access, MrDesc, MrHandle, OnDone, RegisteredBuffer, TransferEngine};

use super::session::{Answer, Control, Hello, HolderStats, Welcome};
use super::wire::{self, Request, SegmentKind, Status};

/// The batching key of segments that move bytes (fetch, gather) rather than attend: each is
/// served on its own.
const TRANSFER_KEY: (u32, u32) = (u32::MAX, u32::MAX);

/// How a holder is set up.
#[derive(Debug, Clone)]
pub struct HolderConfig {
    /// The corpus the chunks come from.
    pub corpus: CorpusSpec,
    /// The chunks this holder serves.
    pub chunks: Vec<ChunkId>,
    /// Concurrent requesters served; the next one is told busy (paper 000 section 6.3: ~8).
    pub max_requesters: usize,
    /// Bytes of each requester's inbox slot (the largest request).
    pub slot_bytes: usize,
    /// Bytes of each requester's reply staging (the largest reply).
    pub reply_bytes: usize,
    /// Bytes of each requester's gather staging: the selected rows of one request's gather
    /// segments, packed so that each destination page takes one write (1152 B per row).
    pub gather_bytes: usize,
    /// Which kernels run the partials.
    pub backend: Backend,
    /// How long the serving thread keeps polling for arrivals after its last batch before it
    /// blocks (with worker threads; under manual progress it polls while any session is open,
    /// as nobody else progresses the engine).
    pub idle_spin: Duration,
}

impl HolderConfig {
    /// Defaults for `corpus` and `chunks`: 8 requesters, 4 MiB slots and replies, 16 MiB of
    /// gather staging (14,563 rows: top-2048 over 7 layers), CPU kernels, 200 us of polling
    /// after each batch. Staging is touched only as far as it is used.
    pub fn new(corpus: CorpusSpec, chunks: Vec<ChunkId>) -> Self {
        Self {
            corpus,
            chunks,
            max_requesters: 8,
            slot_bytes: 4 << 20,
            reply_bytes: 4 << 20,
            gather_bytes: 16 << 20,
            backend: Backend::Cpu,
            idle_spin: Duration::from_micros(200),
        }
    }
}

/// (chunk, layer, (k, rows per token) or (0, 0) for dense, scale bits): segments that one
/// kernel call serves together.
type GroupKey = (u32, u16, (u32, u32), u32);

#[derive(Debug, Clone)]
struct Session {
    hello: Hello,
}

struct Shared {
    engine: TransferEngine,
    config: HolderConfig,
    store: RegisteredBuffer,
    inbox: RegisteredBuffer,
    staging: RegisteredBuffer,
    /// Per session, `gather_bytes` of packed gathered rows.
    gather_staging: RegisteredBuffer,
    /// Chunk -> index of its full block in `store`.
    chunk_index: BTreeMap<u32, usize>,
    entries: Vec<ChunkEntry>,
    sessions: Mutex<Vec<Option<Session>>>,
    stats: Mutex<HolderStats>,
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
    /// Generates the chunks into registered memory and starts serving on `listener`.
    pub fn start(
        engine: TransferEngine,
        listener: TcpListener,
        config: HolderConfig,
    ) -> Result<Self> {
        config.corpus.validate()?;
        if config.chunks.is_empty() || config.max_requesters == 0 || config.max_requesters > 1 << 16
        {
            bail!("a holder needs chunks and 1 to 65536 requesters");
        }
        if config.slot_bytes < wire::REQUEST_HEADER || config.reply_bytes < wire::reply_len(1, 0) {
            bail!("slot and reply sizes too small for a header");
        }
        let layout = config.corpus.layout();
        // Local only: the registry hands the store's descriptor to every requester, and no
        // peer write through it (leaked, forged or mistaken) may land in the corpus.
        let store =
            engine.alloc_mr_with(layout.full_bytes() * config.chunks.len(), Access::Local)?;
        let mut chunk_index = BTreeMap::new();
        let mut entries = Vec::new();
        for (i, &id) in config.chunks.iter().enumerate() {
            if chunk_index.insert(id.0, i).is_some() {
                bail!("{id} listed twice");
            }
            // SAFETY: the store was just allocated; no peer knows its descriptor yet and no
            // other view of it exists.
            let block = unsafe { store.u16s_mut(i * layout.full_bytes(), layout.full_elems())? };
            config.corpus.fill(id, block)?;
            entries.push(ChunkEntry {
                id,
                holder: engine.main_address(),
                desc: store.desc().clone(),
                offset: (i * layout.full_bytes()) as u64,
                layout,
                rope_layout: config.corpus.rope_layout,
                positions: config.corpus.positions(id),
            });
        }
        let inbox = engine.alloc_mr(config.slot_bytes * config.max_requesters)?;
        let staging =
            engine.alloc_mr_with(config.reply_bytes * config.max_requesters, Access::Local)?;
        let gather_staging = engine.alloc_mr_with(
            (config.gather_bytes * config.max_requesters).max(1),
            Access::Local,
        )?;
        // Arrivals straight from the progress pass: no callback-thread hop on the way to the
        // serving thread.
        let rx = engine.unexpected_imms();
        let shared = Arc::new(Shared {
            engine,
            sessions: Mutex::new(vec![None; config.max_requesters]),
            config,
            store,
            inbox,
            staging,
            gather_staging,
            chunk_index,
            entries,
            stats: Mutex::new(HolderStats::default()),
            stop: AtomicBool::new(false),
        });
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let serve = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("holder-serve".into())
                .spawn(move || shared.serve(&rx))?
        };
        let accept = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("holder-accept".into())
                .spawn(move || shared.accept(&listener))?
        };
        Ok(Self {
            shared,
            addr,
            threads: vec![serve, accept],
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
        s
    }

    fn accept(self: &Arc<Self>, listener: &TcpListener) {
        while !self.stop.load(Ordering::Acquire) {
            match listener.accept() {
                Ok((stream, _)) => {
                    let shared = self.clone();
                    let _ = std::thread::Builder::new()
                        .name("holder-session".into())
                        .spawn(move || {
                            if let Err(e) = shared.session(stream) {
                                tracing::debug!(%e, "session ended");
                            }
                        });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => {
                    tracing::warn!(%e, "accept failed");
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
    }

    /// One requester's control connection: hello, answer, then stats requests until it closes.
    fn session(&self, stream: TcpStream) -> Result<()> {
        stream.set_nodelay(true)?;
        stream.set_nonblocking(false)?;
        let mut writer = stream.try_clone()?;
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        // A hello is small; a peer that sends megabytes without a newline is cut off.
        if (&mut reader).take(1 << 20).read_line(&mut line)? == 0 {
            return Ok(());
        }
        let hello: Hello = match serde_json::from_str(&line) {
            Ok(h) => h,
            Err(e) => {
                send_line(
                    &mut writer,
                    &Answer::Refused(format!("malformed hello: {e}")),
                )?;
                return Ok(());
            }
        };
        if let Err(e) = hello.addr.validate() {
            send_line(&mut writer, &Answer::Refused(e.to_string()))?;
            return Ok(());
        }
        let slot = {
            let mut sessions = lock(&self.sessions);
            match sessions.iter().position(Option::is_none) {
                Some(i) => {
                    sessions[i] = Some(Session {
                        hello: hello.clone(),
                    });
                    i
                }
                None => {
                    let cap = sessions.len();
                    drop(sessions);
                    lock(&self.stats).busy += 1;
                    send_line(&mut writer, &Answer::Busy { active: cap, cap })?;
                    return Ok(());
                }
            }
        };
        let _release = SlotGuard { shared: self, slot };
        let welcome = Welcome {
            session: slot as u16,
            holder: self.engine.main_address(),
            inbox: self.inbox.desc().clone(),
            slot_offset: (slot * self.config.slot_bytes) as u64,
            slot_bytes: self.config.slot_bytes as u64,
            reply_bytes: self.config.reply_bytes as u64,
            gather_bytes: self.config.gather_bytes as u64,
            chunks: self.entries.clone(),
        };
        send_line(&mut writer, &Answer::Welcome(welcome))?;
        loop {
            line.clear();
            if (&mut reader).take(1 << 16).read_line(&mut line)? == 0 {
                return Ok(());
            }
            match serde_json::from_str::<Control>(&line) {
                Ok(Control::Stats) => send_line(&mut writer, &self.stats())?,
                Err(e) => tracing::debug!(%e, "ignoring a malformed control line"),
            }
        }
    }

    /// The serving loop: take arrived immediates, answer pings, serve every complete request
    /// as one batch; poll for `idle_spin` after a batch, then block (or, under manual
    /// progress, keep progressing the engine).
    fn serve(&self, rx: &Receiver<(u32, u64)>) {
        let manual = self.engine.manual_progress();
        // Arrivals counted per session, until a request's (or ping's) shards are all in.
        let mut arrived = vec![0u64; self.config.max_requesters];
        let mut pinged = vec![0u64; self.config.max_requesters];
        let mut idle_since: Option<Instant> = None;
        let mut spins = 0u32;
        let mut first = None;
        while !self.stop.load(Ordering::Acquire) {
            if manual {
                // Until nothing moves (bounded): arrivals that need several passes (a
                // rendezvous over tcp;ofi_rxm) complete now, so requests that came in during
                // the last kernel call are batched together instead of one per call.
                for _ in 0..64 {
                    if !self.engine.progress() {
                        break;
                    }
                }
            }
            let mut ready = Vec::new();
            let mut pings = Vec::new();
            for (imm, _) in first.take().into_iter().chain(rx.try_iter()) {
                // The counter has every arrival of `imm` so far; later queue entries of the
                // same value then take 0.
                let count = self.engine.take_imm(imm);
                if count == 0 {
                    continue;
                }
                let (session, shards, counts, out) =
                    match (wire::parse_request_imm(imm), wire::parse_ping_imm(imm)) {
                        (Some((s, n)), _) => (s, n, &mut arrived, &mut ready),
                        (_, Some((s, n))) => (s, n, &mut pinged, &mut pings),
                        _ => {
                            lock(&self.stats).stray_imms += count;
                            continue;
                        }
                    };
                let Some(n) = counts.get_mut(usize::from(session)) else {
                    lock(&self.stats).stray_imms += count;
                    continue;
                };
                *n += count;
                while *n >= shards {
                    *n -= shards;
                    out.push(usize::from(session));
                }
            }
            for &slot in &pings {
                self.pong(slot);
            }
            if !ready.is_empty() {
                self.serve_batch(&ready);
            }
            if !ready.is_empty() || !pings.is_empty() {
                idle_since = None;
                continue;
            }
            // Idle: poll (yielding the core now and then), then block.
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) {
                std::hint::spin_loop();
                continue;
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            if manual {
                if lock(&self.sessions).iter().any(Option::is_some) {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_millis(1));
                }
                continue;
            }
            if since.elapsed() < self.config.idle_spin {
                std::thread::yield_now();
                continue;
            }
            match rx.recv_timeout(Duration::from_millis(20)) {
                Ok(arrival) => first = Some(arrival),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            idle_since = None;
        }
    }

    /// Answers a ping: the requested number of bytes from the session's staging into its
    /// reply region, with its reply immediate. No parsing beyond the 16-byte header, no kernel;
    /// for a [`wire::Pong::Written`] ping, every byte of the pong is written first (timed).
    fn pong(&self, slot: usize) {
        let Some(session) = lock(&self.sessions)[slot].clone() else {
            lock(&self.stats).stray_imms += 1;
            return;
        };
        let mut header = [0u8; wire::PING_HEADER];
        let parsed = self
            .inbox
            .read_at(slot * self.config.slot_bytes, &mut header)
            .ok()
            .and_then(|()| wire::parse_ping(&header));
        let Some((len, offset, pong)) =
            parsed.filter(|(len, ..)| (1..=self.config.reply_bytes).contains(len))
        else {
            lock(&self.stats).refused += 1;
            return;
        };
        let source = slot * self.config.reply_bytes;
        if pong == wire::Pong::Written {
            let started = Instant::now();
            // SAFETY: the slot's own reply staging (`len` is within it, checked above); no
            // write from it is in flight, as the requester waits for each pong or reply
            // before it sends again.
            let written = unsafe { self.staging.bytes_mut(source, len) }.map(|out| {
                let value = (len as u8) | 1;
                out.fill(value);
            });
            let mut stats = lock(&self.stats);
            stats.pong_write_us += started.elapsed().as_secs_f64() * 1e6;
            if written.is_err() {
                stats.refused += 1;
                return;
            }
        }
        let result = self.engine.submit_single_write(
            len as u64,
            Some(session.hello.reply_imm),
            (self.staging.handle(), source as u64),
            (&session.hello.reply, offset),
            OnDone::nothing(),
        );
        let mut stats = lock(&self.stats);
        match result {
            Ok(()) => stats.pings += 1,
            Err(_) => stats.refused += 1,
        }
    }

    fn serve_batch(&self, ready: &[usize]) {
        let started = Instant::now();
        // A slot's request is served once per batch, however many arrived (a requester that
        // sends again before its reply breaks the protocol; it gets one answer).
        let mut ready = ready.to_vec();
        ready.sort_unstable();
        ready.dedup();
        let sessions: Vec<(usize, Option<Session>)> = {
            let all = lock(&self.sessions);
            ready.iter().map(|&s| (s, all[s].clone())).collect()
        };
        // Each slot is parsed in place: the requester writes it only after the reply to its
        // previous request and before the immediate of this one (the protocol), so nothing
        // writes it while this batch reads it. A requester that breaks the protocol changes
        // only the values of its own request, never a bound: the parser reads every length,
        // offset and count once and slices are bounds-checked.
        let slots: Vec<(usize, Session, &[u8])> = sessions
            .into_iter()
            .filter_map(|(slot, session)| {
                let Some(session) = session else {
                    lock(&self.stats).stray_imms += 1;
                    return None;
                };
                let mut header = [0u8; wire::REQUEST_HEADER];
                let base = slot * self.config.slot_bytes;
                self.inbox.read_at(base, &mut header).ok()?;
                let total =
                    u32::from_le_bytes([header[24], header[25], header[26], header[27]]) as usize;
                let len = total.clamp(wire::REQUEST_HEADER, self.config.slot_bytes);
                // SAFETY: see above; the range is inside this session's slot.
                let bytes = unsafe { self.inbox.bytes(base, len) }.ok()?;
                Some((slot, session, bytes))
            })
            .collect();
        let mut stats = HolderStats::default();
        let requests: Vec<_> = slots
            .iter()
            .map(|(_, _, bytes)| Request::parse(bytes))
            .collect();
        stats.requests += requests.len() as u64;
        // Per request: its status, its segments' statuses, and where each segment's rows go
        // in its reply (the layout is fixed by what was asked, so kernels write their rows
        // in place before every status is known).
        let mut layouts: Vec<ReplyLayout> = Vec::new();
        // (chunk, layer, kind key, scale bits) -> the (request, segment) pairs of the group.
        let mut groups: BTreeMap<GroupKey, Vec<(usize, usize)>> = BTreeMap::new();
        for (r, req) in requests.iter().enumerate() {
            let Ok(req) = req else {
                layouts.push(ReplyLayout::default());
                continue;
            };
            let mut layout = ReplyLayout::of(req);
            if wire::reply_len(req.segments.len(), layout.rows) > self.config.reply_bytes {
                layout.status = Status::ReplyTooLarge;
                layouts.push(layout);
                continue;
            }
            for (s, seg) in req.segments.iter().enumerate() {
                let seg = match seg {
                    Ok(seg) => seg,
                    Err(status) => {
                        layout.statuses[s] = *status;
                        continue;
                    }
                };
                if !self.chunk_index.contains_key(&seg.chunk) {
                    layout.statuses[s] = Status::UnknownChunk;
                } else if u32::from(seg.layer) >= self.config.corpus.layers {
                    layout.statuses[s] = Status::BadLayer;
                } else {
                    let key = match seg.kind {
                        SegmentKind::Dense => (0, 0),
                        SegmentKind::Sparse { k, rows_per_token } => (k, rows_per_token),
                        SegmentKind::Fetch | SegmentKind::Gather { .. } => TRANSFER_KEY,
                    };
                    groups
                        .entry((seg.chunk, seg.layer, key, req.scale.to_bits()))
                        .or_default()
                        .push((r, s));
                }
            }
            layouts.push(layout);
        }
        // Where segment `s` of request `r` (`rows` rows) is answered: its range of the
        // session's reply staging.
        let starts: Vec<Vec<usize>> = slots
            .iter()
            .zip(&layouts)
            .map(|((slot, _, _), layout)| {
                let rows =
                    slot * self.config.reply_bytes + wire::reply_rows_offset(layout.statuses.len());
                let at = |first: &usize| rows + first * PARTIAL_ROW_BYTES;
                layout.rows_at.iter().map(at).collect()
            })
            .collect();
        let run = |r: usize, s: usize, rows: usize| {
            let at = starts[r][s];
            // SAFETY: a session's staging range is written only by this serving thread, and
            // the previous reply's write from it has completed (the requester sent this
            // request after that reply arrived; a reply is read by the NIC before it lands).
            // Each slot is in the batch once (deduplicated above) and a request's segments
            // have disjoint row ranges ([`ReplyLayout::of`]), so no two live slices overlap.
            // No peer writes staging (it is registered local only).
            unsafe { self.staging.bytes_mut(at, rows * PARTIAL_ROW_BYTES) }
        };
        // Per request: bytes of its session's gather staging used so far.
        let mut gathered = vec![0usize; slots.len()];
        for (&(chunk, layer, key, scale), members) in &groups {
            if key == TRANSFER_KEY {
                for &(r, s) in members {
                    let (slot, session, _) = &slots[r];
                    let ok = requests[r]
                        .as_ref()
                        .ok()
                        .and_then(|req| req.segments[s].as_ref().ok());
                    let status = match ok.map(|seg| (seg, seg.kind)) {
                        Some((seg, SegmentKind::Fetch)) => self.fetch(session, chunk, &seg.pages()),
                        Some((seg, SegmentKind::Gather { first })) => self.gather(
                            (*slot, session, &mut gathered[r]),
                            (chunk, layer),
                            first,
                            &seg.indices(),
                            &seg.pages(),
                        ),
                        _ => Status::BadSegment,
                    };
                    layouts[r].statuses[s] = status;
                    stats.fetches += u64::from(status == Status::Ok);
                }
                continue;
            }
            let segs: Vec<_> = members
                .iter()
                .filter_map(|&(r, s)| {
                    let seg = requests[r].as_ref().ok()?.segments[s].as_ref().ok()?;
                    Some((r, s, seg))
                })
                .collect();
            // One segment (the common case): attend straight from the slot. Several: the
            // rows (and indices) are gathered into one batch.
            let owned;
            let (queries, indices): (&[u16], Vec<i32>) = match segs.as_slice() {
                [(_, _, seg)] => match seg.query_words() {
                    Some(words) => (words, seg.indices()),
                    None => {
                        owned = seg.queries();
                        (&owned, seg.indices())
                    }
                },
                _ => {
                    let mut q = Vec::new();
                    let mut idx = Vec::new();
                    for (_, _, seg) in &segs {
                        match seg.query_words() {
                            Some(words) => q.extend_from_slice(words),
                            None => q.extend(seg.queries()),
                        }
                        idx.extend(seg.indices());
                    }
                    owned = q;
                    (&owned, idx)
                }
            };
            let scale = f32::from_bits(scale);
            let kernel_started = Instant::now();
            // The kernel writes every row straight into its request's reply staging.
            let result = segs
                .iter()
                .map(|&(r, s, seg)| run(r, s, seg.rows))
                .collect::<Result<Vec<_>, _>>()
                .map_err(anyhow::Error::from)
                .and_then(|runs| Ok(WireOut::new(runs)?))
                .and_then(|mut out| {
                    self.attend((chunk, layer), key, scale, queries, &indices, &mut out)
                });
            stats.kernel_calls += 1;
            match result {
                Ok(()) => {
                    stats.rows += (queries.len() / D_QK) as u64;
                    stats.segments += segs.len() as u64;
                }
                Err(e) => {
                    // One bad segment (an index out of range) must not fail the others: redo
                    // the group one segment at a time.
                    tracing::debug!(%e, "batched kernel call refused; retrying per segment");
                    for &(r, s, seg) in &segs {
                        let served = run(r, s, seg.rows)
                            .map_err(anyhow::Error::from)
                            .and_then(|bytes| Ok(WireOut::new([bytes])?))
                            .and_then(|mut out| {
                                let q = seg.queries();
                                self.attend(
                                    (chunk, layer),
                                    key,
                                    scale,
                                    &q,
                                    &seg.indices(),
                                    &mut out,
                                )
                            });
                        match served {
                            Ok(()) => {
                                stats.rows += seg.rows as u64;
                                stats.segments += 1;
                            }
                            Err(_) => layouts[r].statuses[s] = Status::Kernel,
                        }
                    }
                }
            }
            stats.kernel_us += kernel_started.elapsed().as_secs_f64() * 1e6;
        }
        for (r, (slot, session, _)) in slots.iter().enumerate() {
            let layout = &layouts[r];
            let (seq, reply_offset) = match &requests[r] {
                Ok(req) => (req.seq, req.reply_offset),
                Err((_, Some(at))) => *at,
                Err((_, None)) => {
                    // Nothing says where to answer: the requester times out.
                    stats.refused += 1;
                    continue;
                }
            };
            let status = match &requests[r] {
                Err((status, _)) => *status,
                Ok(_) => layout.status,
            };
            stats.refused += layout.statuses.iter().filter(|s| **s != Status::Ok).count() as u64
                + u64::from(status != Status::Ok);
            stats.encode_us += self.reply(*slot, session, (status, seq, reply_offset), layout);
        }
        stats.serve_us = started.elapsed().as_secs_f64() * 1e6;
        stats.batches = 1;
        let mut total = lock(&self.stats);
        total.requests += stats.requests;
        total.segments += stats.segments;
        total.kernel_calls += stats.kernel_calls;
        total.rows += stats.rows;
        total.kernel_us += stats.kernel_us;
        total.serve_us += stats.serve_us;
        total.encode_us += stats.encode_us;
        total.batches += stats.batches;
        total.refused += stats.refused;
        total.fetches += stats.fetches;
    }

    fn attend(
        &self,
        (chunk, layer): (u32, u16),
        (k, rows_per_token): (u32, u32),
        scale: f32,
        queries: &[u16],
        indices: &[i32],
        out: &mut WireOut<'_>,
    ) -> Result<()> {
        let index = self.chunk_index[&chunk];
        let layout = self.config.corpus.layout();
        // SAFETY: the store is written only by `start`; peers cannot write it (it is
        // registered local only: its descriptor in the registry is for reference, and fetch
        // only reads it).
        let elems = unsafe {
            self.store
                .u16s(index * layout.full_bytes(), layout.full_elems())?
        };
        let block = FullBlock::new(elems, layout)?.layer(u32::from(layer))?;
        let cache: Cache<'_> = block.cache()?;
        let q = Queries::new(queries)?;
        if k == 0 {
            partial_dense_wire(self.config.backend, &q, &cache, scale, out)?;
        } else {
            let sel = Selection::new(
                indices,
                k as usize,
                rows_per_token as usize,
                q.len(),
                cache.tokens(),
            )?;
            partial_sparse_wire(self.config.backend, &q, &cache, &sel, scale, out)?;
        }
        Ok(())
    }

    /// Fetch: writes the chunk's pages (consecutive in the store) into the requester's pool
    /// `pages`, one write per run of consecutive pool pages ([`wire::fetch_runs`]), each
    /// carrying the session's fetch immediate. All or nothing ([`Shared::send_all`]): every
    /// run's destination is checked against the pool before the first write is sent.
    fn fetch(&self, session: &Session, chunk: u32, pages: &[u32]) -> Status {
        let layout = self.config.corpus.layout();
        let Some(pool) = &session.hello.pool else {
            return Status::FetchRefused;
        };
        if pages.len() != layout.pages() {
            return Status::FetchRefused;
        }
        let page = PAGE_BYTES as u64;
        let base = (self.chunk_index[&chunk] * layout.pages()) as u64 * page;
        let writes: Option<Vec<(u64, u64, u64)>> = wire::fetch_runs(pages)
            .map(|(first, count)| {
                let len = count as u64 * page;
                let dst = u64::from(pages[first]).checked_mul(page)?;
                (dst.checked_add(len)? <= pool.len).then_some((
                    base + first as u64 * page,
                    dst,
                    len,
                ))
            })
            .collect();
        self.send_all(writes, self.store.handle(), (pool, session.hello.fetch_imm))
    }

    /// Sends a fetch or gather segment's `writes` (source offset in `src`, destination offset
    /// in `pool`, length), each with the fetch immediate `imm`, or none of them: `None` (a
    /// write that would not fit the pool, found by the caller before anything was sent) is
    /// `FetchRefused`. The writes' checks have passed, so a submission fails only as every
    /// other would (an engine shutting down): a failure at the first sent nothing
    /// (`FetchRefused`), a later one left some sent (`TransferFailed`: the requester's count
    /// is lost and it gives the link up).
    fn send_all(
        &self,
        writes: Option<Vec<(u64, u64, u64)>>,
        src: &MrHandle,
        (pool, imm): (&MrDesc, u32),
    ) -> Status {
        let Some(writes) = writes else {
            return Status::FetchRefused;
        };
        for (n, &(from, to, len)) in writes.iter().enumerate() {
            let sent = self.engine.submit_single_write(
                len,
                Some(imm),
                (src, from),
                (pool, to),
                OnDone::nothing(),
            );
            if let Err(e) = sent {
                tracing::debug!(%e, "fetch or gather write failed");
                return if n == 0 {
                    Status::FetchRefused
                } else {
                    Status::TransferFailed
                };
            }
        }
        Status::Ok
    }

    /// Sparse fetch: writes the rows of `tokens` (layer `layer` of `chunk`) into the
    /// requester's pool, row `j` at row `first + j` of `pages`, all carrying the session's
    /// fetch immediate. The rows are first packed into the session's gather staging (after
    /// the `used` bytes earlier segments of the request took) so that each page they land in
    /// takes one write ([`wire::gather_writes`]), not one write per row.
    fn gather(
        &self,
        (slot, session, used): (usize, &Session, &mut usize),
        (chunk, layer): (u32, u16),
        first: u32,
        tokens: &[i32],
        pages: &[u32],
    ) -> Status {
        let layout = self.config.corpus.layout();
        let Some(pool) = &session.hello.pool else {
            return Status::FetchRefused;
        };
        if tokens
            .iter()
            .any(|&t| u32::try_from(t).map_or(true, |t| t >= layout.tokens))
        {
            return Status::BadIndex;
        }
        let Ok(layer_at) = layout.layer_offset(u32::from(layer)) else {
            return Status::BadLayer;
        };
        let bytes = tokens.len() * ROW_BYTES;
        if *used + bytes > self.config.gather_bytes {
            return Status::FetchRefused;
        }
        let staged = slot * self.config.gather_bytes + *used;
        let block = self.chunk_index[&chunk] * layout.full_bytes() + layer_at;
        // SAFETY: this session's staging range past `used` is written only here, by the one
        // serving thread; the writes of the previous request from it have landed (the
        // requester sends a request only after every write of the last one arrived). The
        // store is written only by `start` (and is not remotely writable).
        let packed = unsafe { self.gather_staging.bytes_mut(staged, bytes) }.and_then(|out| {
            // SAFETY: as above for the store.
            let store = unsafe { self.store.bytes(block, layout.tokens as usize * ROW_BYTES) }?;
            for (row, &t) in out.chunks_exact_mut(ROW_BYTES).zip(tokens) {
                let at = t as usize * ROW_BYTES;
                row.copy_from_slice(&store[at..at + ROW_BYTES]);
            }
            Ok(())
        });
        if let Err(e) = packed {
            tracing::debug!(%e, "gather refused");
            return Status::FetchRefused;
        }
        *used += bytes;
        // All or nothing: every write's destination is checked before the first is sent, so
        // a refused segment sent none and the requester expects no rows from it.
        let writes: Option<Vec<(u64, u64, u64)>> = wire::gather_writes(first, tokens.len())
            .map(|w| {
                let len = (w.rows * ROW_BYTES) as u64;
                let dst = u64::from(*pages.get(w.page)?)
                    .checked_mul(PAGE_BYTES as u64)?
                    .checked_add((w.row * ROW_BYTES) as u64)?;
                (dst.checked_add(len)? <= pool.len).then_some((
                    (staged + w.from * ROW_BYTES) as u64,
                    dst,
                    len,
                ))
            })
            .collect();
        self.send_all(
            writes,
            self.gather_staging.handle(),
            (pool, session.hello.fetch_imm),
        )
    }

    /// Finishes one request's reply in the session's staging (the kernels wrote the rows of
    /// the segments they served; this writes the header and status words and zeroes the rows
    /// of refused segments, which would otherwise carry an earlier session's bytes) and writes
    /// it out; returns the microseconds spent.
    fn reply(
        &self,
        slot: usize,
        session: &Session,
        (status, seq, reply_offset): (Status, u64, u64),
        layout: &ReplyLayout,
    ) -> f64 {
        let (statuses, rows): (&[Status], usize) = if status == Status::Ok {
            (&layout.statuses, layout.rows)
        } else {
            (&[], 0)
        };
        let len = wire::reply_len(statuses.len(), rows);
        let staging = slot * self.config.reply_bytes;
        let encode_started = Instant::now();
        // SAFETY: as the kernels' runs in `serve_batch`, whose slices are dropped by now; the
        // length fits (checked against `reply_bytes` when the layout was made).
        let encoded = unsafe { self.staging.bytes_mut(staging, len) }.map(|out| {
            wire::encode_reply_header(out, status, seq, statuses, rows);
            let base = wire::reply_rows_offset(statuses.len());
            for (s, &st) in statuses.iter().enumerate() {
                if st != Status::Ok {
                    let at = base + layout.rows_at[s] * PARTIAL_ROW_BYTES;
                    out[at..at + layout.rows_of[s] * PARTIAL_ROW_BYTES].fill(0);
                }
            }
        });
        let encode_us = encode_started.elapsed().as_secs_f64() * 1e6;
        let reply: &MrDesc = &session.hello.reply;
        let result = encoded.map_err(anyhow::Error::from).and_then(|()| {
            Ok(self.engine.submit_single_write(
                len as u64,
                Some(session.hello.reply_imm),
                (self.staging.handle(), staging as u64),
                (reply, reply_offset),
                OnDone::nothing(),
            )?)
        });
        if let Err(e) = result {
            // A forged reply offset or region: refused before anything was posted.
            tracing::debug!(%e, "reply not sent");
            lock(&self.stats).refused += 1;
        }
        encode_us
    }
}

/// Where a request's answer goes: its status, one status per segment and, per segment, the
/// first of its rows in the reply and how many ([`wire::reply_row_layout`]).
#[derive(Debug, Default)]
struct ReplyLayout {
    status: Status,
    statuses: Vec<Status>,
    rows_at: Vec<usize>,
    rows_of: Vec<usize>,
    rows: usize,
}

impl ReplyLayout {
    /// Every segment served (statuses Ok) until told otherwise; malformed segments take no
    /// rows, the others all of theirs, in order.
    fn of(req: &Request<'_>) -> Self {
        let rows_of: Vec<usize> = req
            .segments
            .iter()
            .map(|s| s.as_ref().map_or(0, wire::Segment::reply_rows))
            .collect();
        let (rows_at, rows) = wire::reply_row_layout(&rows_of);
        Self {
            status: Status::Ok,
            statuses: vec![Status::Ok; req.segments.len()],
            rows_at,
            rows_of,
            rows,
        }
    }
}

/// Frees a session slot when its control connection ends, however it ends.
struct SlotGuard<'a> {
    shared: &'a Shared,
    slot: usize,
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        lock(&self.shared.sessions)[self.slot] = None;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub(crate) fn send_line<T: serde::Serialize>(w: &mut TcpStream, msg: &T) -> Result<()> {
    let mut line = serde_json::to_string(msg).context("encoding a control line")?;
    line.push('\n');
    w.write_all(line.as_bytes())?;
    Ok(())
}

/// Reads one JSON line (at most `limit` bytes).
pub(crate) fn recv_line<T: serde::de::DeserializeOwned>(
    r: &mut BufReader<TcpStream>,
    limit: u64,
) -> Result<T> {
    let mut line = String::new();
    if r.take(limit).read_line(&mut line)? == 0 {
        bail!("connection closed");
    }
    serde_json::from_str(&line).with_context(|| format!("malformed control line: {}", line.trim()))
}
