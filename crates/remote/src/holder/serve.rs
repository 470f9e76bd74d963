//! The holder's serving thread: takes arrived immediates, answers pings, parses every
//! complete request of a batch, runs one kernel call per (chunk, layer, kind) group (on a GPU,
//! one launch for every group of the batch) straight into the requests' reply staging, and
//! answers each request with one write.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvroute_kernels::layout::{D_QK, PARTIAL_ROW_BYTES};
use kvroute_kernels::{Queries, WireOut};
use kvroute_transport::{MrDesc, OnDone, StagedBytes, TransportError, UnexpectedImms};

use super::compute::GroupCall;
use super::group::{GroupKey, GroupKind, GroupWork, Member, group_work};
use super::transfer::GatherStaging;
use super::{STAGING_WAIT, Session, Shared, Use, lock};
use crate::error::RemoteError;
use crate::session::HolderStats;
use crate::wire::{self, Request, SegmentKind, Status};

/// The servable segments of a batch by what serves them: (request, segment) pairs.
type Groups = BTreeMap<GroupKey, Vec<(usize, usize)>>;

/// A request's inbox slot in a batch: the slot, its session and the request's bytes.
type Slot<'a> = (usize, &'a Session, &'a [u8]);

/// A request as parsed from its slot: the request, or the status it is refused with (and,
/// when they could be read, its seq and reply offset, to answer it at).
pub(super) type Parsed<'a> = Result<Request<'a>, (Status, Option<(u64, u64)>)>;

impl Shared {
    /// The serving loop: take arrived immediates, answer pings, serve every complete request
    /// as one batch; poll for `idle_spin` after a batch, then block (or, under manual
    /// progress, keep progressing the engine).
    pub(super) fn serve(&self, rx: &UnexpectedImms) {
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
                            {
                                lock(&self.stats).stray_imms += count;
                                crate::observe::holder_stray_imms(count);
                            }
                            continue;
                        }
                    };
                let Some(n) = counts.get_mut(usize::from(session)) else {
                    {
                        lock(&self.stats).stray_imms += count;
                        crate::observe::holder_stray_imms(count);
                    }
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
                Ok(arrival) => first = arrival,
                // The engine stopped: nothing more will arrive.
                Err(_) => return,
            }
            idle_since = None;
        }
    }

    /// Where the answer to `slot`'s request (or ping) `seq` is staged: the slot's half for
    /// the parity of `seq`. Consecutive answers alternate halves, so the one being filled is
    /// the answer before last's, whose write has completed (see [`STAGING_WAIT`]).
    fn reply_staging(&self, slot: usize, seq: u64) -> usize {
        (2 * slot + (seq % 2) as usize) * self.config.reply_bytes
    }

    /// Answers a ping: the requested number of bytes from the session's staging into its
    /// reply region, with its reply immediate. No parsing beyond the 16-byte header, no kernel;
    /// for a [`wire::Pong::Written`] ping, every byte of the pong is written first (timed).
    fn pong(&self, slot: usize) {
        let Some(session) = lock(&self.sessions)[slot].clone() else {
            {
                lock(&self.stats).stray_imms += 1;
                crate::observe::holder_stray_imms(1);
            }
            return;
        };
        let mut header = [0u8; wire::PING_HEADER];
        let parsed = session
            .inbox
            .read_at(0, &mut header)
            .ok()
            .and_then(|()| wire::parse_ping(&header));
        // Only the session's owner is answered, once per ping. A written pong is a
        // measurement (the `measure` feature); a holder built without it refuses one.
        let Some(wire::Ping {
            reply_len,
            reply_offset: offset,
            pong,
            seq,
            ..
        }) = parsed.filter(|p| {
            session.admit(p.token, p.seq, Use::Ping)
                && (1..=self.config.reply_bytes).contains(&(p.reply_len as usize))
                && (cfg!(feature = "measure") || p.pong == wire::Pong::Staged)
        })
        else {
            {
                lock(&self.stats).refused += 1;
                crate::observe::holder_refused_request();
            }
            return;
        };
        let Some(_posting) = session.posting() else {
            return;
        };
        let len = reply_len as usize;
        let source = self.reply_staging(slot, seq);
        if pong == wire::Pong::Written {
            let started = Instant::now();
            // The slot's own reply staging (`len` is within it, checked above).
            let written = self
                .staging
                .bytes_mut_within(source, len, STAGING_WAIT)
                .map(|mut out| {
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
        // Counted under the lock the pong is sent in: a reader that saw it land finds it
        // counted.
        let mut stats = lock(&self.stats);
        let result = self.staging.submit_write(
            (source, len),
            Some(session.hello.reply_imm),
            (&session.hello.reply, offset),
            OnDone::nothing(),
        );
        match result {
            Ok(()) => stats.pings += 1,
            Err(_) => stats.refused += 1,
        }
    }

    pub(super) fn serve_batch(&self, ready: &[usize]) {
        let started = Instant::now();
        let admitted = self.admit(ready);
        // Each request is copied out of its inbox before it is parsed: the requester may
        // write its inbox whenever it likes, and what is checked must not change under the
        // checks.
        let copies: Vec<Option<Vec<u8>>> = admitted
            .iter()
            .map(|(_, session, len)| {
                let mut bytes = Vec::new();
                session.inbox.append_to(0, *len, &mut bytes).ok()?;
                Some(bytes)
            })
            .collect();
        let slots: Vec<Slot<'_>> = admitted
            .iter()
            .zip(&copies)
            .filter_map(|((slot, session, _), bytes)| Some((*slot, session, bytes.as_deref()?)))
            .collect();
        let mut stats = HolderStats::default();
        let requests: Vec<Parsed<'_>> = slots
            .iter()
            .map(|(_, _, bytes)| Request::parse(bytes))
            .collect();
        stats.requests += requests.len() as u64;
        let (mut layouts, groups) = self.group(&requests);
        // Where segment `s` of request `r` (`rows` rows) is answered: its range of the
        // session's reply staging.
        let starts: Vec<Vec<usize>> = slots
            .iter()
            .zip(&layouts)
            .zip(&requests)
            .map(|(((slot, _, _), layout), request)| {
                let seq = request.as_ref().map_or(0, |q| q.seq);
                let rows =
                    self.reply_staging(*slot, seq) + wire::reply_rows_offset(layout.statuses.len());
                let at = |first: &usize| rows + first * PARTIAL_ROW_BYTES;
                layout.rows_at.iter().map(at).collect()
            })
            .collect();
        // A segment's rows of its session's reply staging: the half the reply before last was
        // written out of, whose write completed long ago (waited for otherwise, briefly).
        let run = |r: usize, s: usize, rows: usize| {
            let at = starts[r][s];
            self.staging
                .bytes_mut_within(at, rows * PARTIAL_ROW_BYTES, STAGING_WAIT)
        };
        // Per request: bytes of its session's gather staging used so far.
        let mut gathered = vec![0usize; slots.len()];
        // The partial groups, gathered; transfers are served as they come.
        let mut work: Vec<GroupWork<'_>> = Vec::new();
        for (key, members) in &groups {
            if key.kind == GroupKind::Transfer {
                let at = (&slots[..], &requests[..]);
                self.serve_transfers(key, members, at, (&mut layouts, &mut gathered), &mut stats);
            } else {
                work.push(group_work(key, members, &requests));
            }
        }
        let served = self.attend_batched(&work, &run, &mut stats);
        self.attend_each(&work, &served, &run, &mut layouts, &mut stats);
        self.answer(&slots, &requests, &layouts, (stats, started));
    }

    /// The sessions of `ready` (each once, however many of its immediates arrived: a
    /// requester that sends again before its reply breaks the protocol and gets one answer)
    /// whose request header carries their token and a sequence number they have not used,
    /// with how far their slot is read; the others are counted (stray or refused) and get no
    /// answer at all, not even a status.
    fn admit(&self, ready: &[usize]) -> Vec<(usize, Session, usize)> {
        let mut ready = ready.to_vec();
        ready.sort_unstable();
        ready.dedup();
        let sessions: Vec<(usize, Option<Session>)> = {
            let all = lock(&self.sessions);
            ready.iter().map(|&s| (s, all[s].clone())).collect()
        };
        sessions
            .into_iter()
            .filter_map(|(slot, session)| {
                let Some(session) = session else {
                    {
                        lock(&self.stats).stray_imms += 1;
                        crate::observe::holder_stray_imms(1);
                    }
                    return None;
                };
                let mut header = [0u8; wire::REQUEST_HEADER];
                session.inbox.read_at(0, &mut header).ok()?;
                // A request from anyone but the session's owner, or the session's last one
                // replayed by a stray immediate, is dropped.
                let admitted = wire::request_credentials(&header)
                    .is_some_and(|(token, seq)| session.admit(token, seq, Use::Request));
                if !admitted {
                    {
                        lock(&self.stats).refused += 1;
                        crate::observe::holder_refused_request();
                    }
                    return None;
                }
                let total =
                    u32::from_le_bytes([header[24], header[25], header[26], header[27]]) as usize;
                let len = total.clamp(wire::REQUEST_HEADER, self.config.slot_bytes);
                Some((slot, session, len))
            })
            .collect()
    }

    /// Per request: its status, its segments' statuses, and where each segment's rows go in
    /// its reply (the layout is fixed by what was asked, so kernels write their rows in place
    /// before every status is known); and the servable segments grouped by what serves them,
    /// as (request, segment) pairs.
    fn group(&self, requests: &[Parsed<'_>]) -> (Vec<ReplyLayout>, Groups) {
        let mut layouts: Vec<ReplyLayout> = Vec::with_capacity(requests.len());
        let mut groups = Groups::new();
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
                let held = self.chunks.get(kvroute_kvstore::ChunkId(seg.chunk));
                if held.is_none() {
                    layout.statuses[s] = Status::UnknownChunk;
                } else if held.is_some_and(|c| u32::from(seg.layer) >= c.layout.layers) {
                    layout.statuses[s] = Status::BadLayer;
                } else {
                    let kind = match seg.kind {
                        SegmentKind::Dense => GroupKind::Dense,
                        SegmentKind::Sparse { k, rows_per_token } => {
                            GroupKind::Sparse { k, rows_per_token }
                        }
                        SegmentKind::Fetch | SegmentKind::Gather { .. } => GroupKind::Transfer,
                    };
                    let key = GroupKey {
                        chunk: seg.chunk,
                        layer: seg.layer,
                        kind,
                        scale_bits: req.scale.to_bits(),
                    };
                    groups.entry(key).or_default().push((r, s));
                }
            }
            layouts.push(layout);
        }
        (layouts, groups)
    }

    /// Serves the fetch and gather segments of a transfer group (their writes go out now),
    /// each one's status noted in its request's layout.
    fn serve_transfers(
        &self,
        &GroupKey { chunk, layer, .. }: &GroupKey,
        members: &[(usize, usize)],
        (slots, requests): (&[Slot<'_>], &[Parsed<'_>]),
        (layouts, gathered): (&mut [ReplyLayout], &mut [usize]),
        stats: &mut HolderStats,
    ) {
        for &(r, s) in members {
            let (slot, session, _) = &slots[r];
            let ok = requests[r]
                .as_ref()
                .ok()
                .and_then(|req| req.segments[s].as_ref().ok());
            let status = match ok.map(|seg| (seg, seg.kind)) {
                Some((seg, SegmentKind::Fetch)) => self.fetch(session, chunk, &seg.pages(), seg),
                Some((seg, SegmentKind::Gather { first })) => self.gather(
                    GatherStaging {
                        slot: *slot,
                        session,
                        used: &mut gathered[r],
                    },
                    (chunk, layer),
                    first,
                    &seg.indices(),
                    (&seg.pages(), seg),
                ),
                _ => Status::BadSegment,
            };
            layouts[r].statuses[s] = status;
            stats.fetches += u64::from(status == Status::Ok);
        }
    }

    /// On a GPU, every group of one scale in one launch: the batched kernel takes each
    /// (chunk, layer) group as a request. Returns which groups were served; a refused batch
    /// (a bad index in one segment, say) leaves its groups to [`Shared::attend_each`], which
    /// names the segment.
    fn attend_batched(
        &self,
        work: &[GroupWork<'_>],
        run: &dyn Fn(usize, usize, usize) -> Result<StagedBytes, TransportError>,
        stats: &mut HolderStats,
    ) -> Vec<bool> {
        let mut served = vec![false; work.len()];
        let mut scales: Vec<u32> = work.iter().map(|w| w.scale.to_bits()).collect();
        scales.sort_unstable();
        scales.dedup();
        for scale in scales.into_iter().filter(|_| self.compute.batches()) {
            let members: Vec<usize> = (0..work.len())
                .filter(|&i| work[i].scale.to_bits() == scale)
                .collect();
            if members.len() < 2 {
                continue; // the per-group call is the same launch
            }
            let runs = members
                .iter()
                .flat_map(|&i| {
                    work[i]
                        .segs
                        .iter()
                        .map(|m| run(m.request, m.segment, m.seg.rows))
                })
                .collect::<Result<Vec<_>, _>>();
            // Timed from here: a wait for staging is not the kernel's.
            let kernel_started = Instant::now();
            let result = runs.map_err(RemoteError::from).and_then(|mut runs| {
                let mut out = WireOut::new(runs.iter_mut().map(|r| &mut **r))?;
                let calls = members
                    .iter()
                    .map(|&i| self.group_call(&work[i]))
                    .collect::<Result<Vec<_>, RemoteError>>()?;
                self.compute
                    .batch_wire(&calls, f32::from_bits(scale), &mut out)
            });
            stats.kernel_calls += 1;
            match result {
                Ok(entries) => {
                    for (&i, entries) in members.iter().zip(entries) {
                        let w = &work[i];
                        let rows = w.queries.len() / D_QK;
                        served[i] = true;
                        stats.rows += rows as u64;
                        stats.gpu_rows += rows as u64;
                        stats.row_tokens += (rows * entries) as u64;
                        stats.segments += w.segs.len() as u64;
                    }
                }
                Err(e) => {
                    tracing::debug!(%e, "batched launch refused; serving its groups one by one")
                }
            }
            stats.kernel_us += kernel_started.elapsed().as_secs_f64() * 1e6;
        }
        served
    }

    /// One kernel call per group not `served` yet, writing every row straight into its
    /// request's reply staging; a group the kernel refuses is served again one segment at a
    /// time, so one bad segment (an index out of range) fails only itself (`Status::Kernel`).
    fn attend_each(
        &self,
        work: &[GroupWork<'_>],
        served: &[bool],
        run: &dyn Fn(usize, usize, usize) -> Result<StagedBytes, TransportError>,
        layouts: &mut [ReplyLayout],
        stats: &mut HolderStats,
    ) {
        for w in work
            .iter()
            .zip(served)
            .filter(|(_, s)| !**s)
            .map(|(w, _)| w)
        {
            let GroupWork {
                chunk,
                layer,
                kind,
                scale,
                ref segs,
                ref queries,
                ref indices,
            } = *w;
            let runs = segs
                .iter()
                .map(|m| run(m.request, m.segment, m.seg.rows))
                .collect::<Result<Vec<_>, _>>();
            // Timed from here: a wait for staging is not the kernel's.
            let kernel_started = Instant::now();
            let result = runs.map_err(RemoteError::from).and_then(|mut runs| {
                let mut out = WireOut::new(runs.iter_mut().map(|r| &mut **r))?;
                self.attend((chunk, layer), kind, scale, queries, indices, &mut out)
            });
            stats.kernel_calls += 1;
            match result {
                Ok(entries) => {
                    let rows = queries.len() / D_QK;
                    stats.rows += rows as u64;
                    if self.compute.on_gpu(rows) {
                        stats.gpu_rows += rows as u64;
                    }
                    stats.row_tokens += (rows * entries) as u64;
                    stats.segments += segs.len() as u64;
                    let us = kernel_started.elapsed().as_secs_f64() * 1e6;
                    if indices.is_empty() {
                        lock(&self.kernel).observe(rows, entries, us);
                    }
                }
                Err(e) => {
                    tracing::debug!(%e, "batched kernel call refused; retrying per segment");
                    for &Member {
                        request: r,
                        segment: s,
                        seg,
                    } in segs
                    {
                        let served =
                            run(r, s, seg.rows)
                                .map_err(RemoteError::from)
                                .and_then(|mut bytes| {
                                    let mut out = WireOut::new([&mut *bytes])?;
                                    let q = seg.queries();
                                    self.attend(
                                        (chunk, layer),
                                        kind,
                                        scale,
                                        &q,
                                        &seg.indices(),
                                        &mut out,
                                    )
                                });
                        match served {
                            Ok(entries) => {
                                stats.rows += seg.rows as u64;
                                if self.compute.on_gpu(seg.rows) {
                                    stats.gpu_rows += seg.rows as u64;
                                }
                                stats.row_tokens += (seg.rows * entries) as u64;
                                stats.segments += 1;
                            }
                            Err(_) => layouts[r].statuses[s] = Status::Kernel,
                        }
                    }
                }
            }
            stats.kernel_us += kernel_started.elapsed().as_secs_f64() * 1e6;
        }
    }

    /// Answers every request of the batch with one write, and counts the batch under the
    /// lock its replies are sent in, so a reader that saw a reply land (and then asked for
    /// the counters) finds the whole batch counted, times included.
    fn answer(
        &self,
        slots: &[Slot<'_>],
        requests: &[Parsed<'_>],
        layouts: &[ReplyLayout],
        (mut stats, started): (HolderStats, Instant),
    ) {
        let mut total = lock(&self.stats);
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
            let kernel_us = stats.kernel_us;
            self.reply(
                *slot,
                session,
                (status, seq, reply_offset, kernel_us),
                layout,
                &mut stats,
            );
        }
        stats.serve_us = started.elapsed().as_secs_f64() * 1e6;
        stats.batches = 1;
        total.requests += stats.requests;
        total.segments += stats.segments;
        total.kernel_calls += stats.kernel_calls;
        total.rows += stats.rows;
        total.row_tokens += stats.row_tokens;
        total.gpu_rows += stats.gpu_rows;
        total.kernel_us += stats.kernel_us;
        total.serve_us += stats.serve_us;
        total.encode_us += stats.encode_us;
        total.batches += stats.batches;
        total.refused += stats.refused;
        total.fetches += stats.fetches;
        drop(total);
        crate::observe::holder_batch(&stats, self.compute.backend_label());
    }

    /// A gathered group as the batched kernel takes it.
    fn group_call<'a>(&'a self, w: &'a GroupWork<'_>) -> Result<GroupCall<'a>, RemoteError> {
        let held =
            self.chunks
                .get(kvroute_kvstore::ChunkId(w.chunk))
                .ok_or(RemoteError::Chunk {
                    chunk: kvroute_kvstore::ChunkId(w.chunk),
                    why: "not held".into(),
                })?;
        Ok(GroupCall {
            held,
            layer: u32::from(w.layer),
            q: Queries::new(&w.queries)?,
            sel: w.kind.selection(&w.indices),
        })
    }

    fn attend(
        &self,
        (chunk, layer): (u32, u16),
        kind: GroupKind,
        scale: f32,
        queries: &[u16],
        indices: &[i32],
        out: &mut WireOut<'_>,
    ) -> Result<usize, RemoteError> {
        let held = self
            .chunks
            .get(kvroute_kvstore::ChunkId(chunk))
            .ok_or(RemoteError::Chunk {
                chunk: kvroute_kvstore::ChunkId(chunk),
                why: "not held".into(),
            })?;
        let q = Queries::new(queries)?;
        let sel = kind.selection(indices);
        self.compute.partial_wire(
            &self.chunks,
            held,
            (u32::from(layer), None),
            &q,
            sel,
            scale,
            out,
        )
    }

    /// Finishes one request's reply in the session's staging (the kernels wrote the rows of
    /// the segments they served; this writes the header and status words and zeroes the rows
    /// of refused segments, which would otherwise carry an earlier session's bytes) and writes
    /// it out, adding the time spent encoding (and a reply refused for a forged offset or
    /// region) to `stats`. `kernel_us`: the batch's kernel time, which the header carries.
    fn reply(
        &self,
        slot: usize,
        session: &Session,
        (status, seq, reply_offset, kernel_us): (Status, u64, u64, f64),
        layout: &ReplyLayout,
        stats: &mut HolderStats,
    ) {
        let (statuses, rows): (&[Status], usize) = if status == Status::Ok {
            (&layout.statuses, layout.rows)
        } else {
            (&[], 0)
        };
        let len = wire::reply_len(statuses.len(), rows);
        let staging = self.reply_staging(slot, seq);
        let encode_started = Instant::now();
        // The kernels' views of the rows are dropped by now; the length fits (checked against
        // `reply_bytes` when the layout was made).
        let encoded = self
            .staging
            .bytes_mut_within(staging, len, STAGING_WAIT)
            .map(|mut out| {
                wire::encode_reply_header(
                    &mut out,
                    (status, seq),
                    statuses,
                    rows,
                    kernel_us as f32,
                );
                let base = wire::reply_rows_offset(statuses.len());
                for (s, &st) in statuses.iter().enumerate() {
                    if st != Status::Ok {
                        let at = base + layout.rows_at[s] * PARTIAL_ROW_BYTES;
                        out[at..at + layout.rows_of[s] * PARTIAL_ROW_BYTES].fill(0);
                    }
                }
            });
        stats.encode_us += encode_started.elapsed().as_secs_f64() * 1e6;
        let reply: &MrDesc = &session.hello.reply;
        let Some(_posting) = session.posting() else {
            return;
        };
        let result = encoded.map_err(RemoteError::from).and_then(|()| {
            Ok(self.staging.submit_write(
                (staging, len),
                Some(session.hello.reply_imm),
                (reply, reply_offset),
                OnDone::nothing(),
            )?)
        });
        if let Err(e) = result {
            // A forged reply offset or region: refused before anything was posted.
            tracing::debug!(%e, "reply not sent");
            stats.refused += 1;
        }
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
