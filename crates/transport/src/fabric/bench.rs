//! Measurements of the fabric domain between two engines, and the baseline a user would trust
//! beside them: libfabric's own `fi_pingpong` on the same provider.
//!
//! `fi_pingpong` reports, per fabtests' `show_perf`, `usec/xfer` = elapsed / (iterations x 2)
//! (half a round trip) and `MB/sec` = bytes moved / elapsed microseconds, with 2 x size bytes
//! moved per iteration. [`Pingpong`] computes the engine's ping-pong the same way, so the two
//! columns compare directly. Streams (several writes in flight) are reported separately: they
//! are what the engine is for, but have no `fi_pingpong` counterpart.
//!
//! The immediate-only ping-pong asks for no completion of its writes (`OnDone::nothing`, and
//! [`Domain::post_unreported`] on the bare NICs): the answer is what each side waits for, as
//! `fi_pingpong` sends its small messages with `fi_inject`, which reports none.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{FabricConfig, FabricDomain};
use crate::TransferEngine;
use crate::addr::DomainAddr;
use crate::buffer::RegisteredBuffer;
use crate::domain::{
    Completion, CompletionKind, Domain, PeerId, Registration, Unreported, WriteWr,
};
use crate::engine::{ImmTarget, ImmWatch};
use crate::error::TransportError;
use crate::mr::{Access, Device, MrDesc};
use crate::on_done::{DoneCounter, DoneFlag, OnDone};
use crate::request::Pages;

/// The immediate of a ping.
pub const PING: u32 = 0x5049_4e47;
/// The immediate of a pong.
pub const PONG: u32 = 0x504f_4e47;
/// The immediate of a paged transfer's pages.
pub const PAGE: u32 = 0x5041_4745;

/// A ping-pong's result in `fi_pingpong`'s units.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Pingpong {
    /// Bytes per message (0: immediate-only writes).
    pub size: u64,
    /// Round trips timed.
    pub iters: u64,
    /// Half a round trip, microseconds.
    pub usec_per_xfer: f64,
    /// Bytes moved (2 x size per round trip) per microsecond.
    pub mb_per_s: f64,
}

impl Pingpong {
    /// From `iters` round trips of `size` bytes taking `elapsed`, as fabtests computes it.
    pub fn from_elapsed(size: u64, iters: u64, elapsed: Duration) -> Self {
        let usec = elapsed.as_secs_f64() * 1e6;
        Self {
            size,
            iters,
            usec_per_xfer: usec / (iters as f64 * 2.0),
            mb_per_s: (size as f64 * iters as f64 * 2.0) / usec,
        }
    }
}

/// A one-way stream's result.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Stream {
    /// Bytes per write (or per page).
    pub size: u64,
    /// Writes (or pages).
    pub count: u64,
    /// Bytes per microsecond, from the first submit to the last completion at the sender
    /// (writes are delivery-complete: placed at the target).
    pub mb_per_s: f64,
    /// Writes (or pages) per second.
    pub per_s: f64,
}

impl Stream {
    fn from_elapsed(size: u64, count: u64, elapsed: Duration) -> Self {
        let secs = elapsed.as_secs_f64();
        Self {
            size,
            count,
            mb_per_s: size as f64 * count as f64 / (secs * 1e6),
            per_s: count as f64 / secs,
        }
    }
}

/// Spins until `cond` holds, running the engine's passes if it uses manual progress; fails
/// past `deadline`. Under manual progress the passes run back to back, as the bare NIC's loops
/// poll; with worker threads it yields now and then, so a worker sharing the core runs.
fn spin_until(
    engine: &TransferEngine,
    deadline: Instant,
    what: &str,
    mut cond: impl FnMut() -> bool,
) -> Result<(), TransportError> {
    let manual = engine.manual_progress();
    let check_every = if manual { 1024 } else { 64 };
    let mut spins = 0u32;
    while !cond() {
        if engine.progress() {
            continue;
        }
        spins = spins.wrapping_add(1);
        if !spins.is_multiple_of(check_every) {
            if !manual {
                std::hint::spin_loop();
            }
            continue;
        }
        if Instant::now() > deadline {
            return Err(TransportError::Domain(format!(
                "{what} did not happen within the bench's deadline"
            )));
        }
        if !manual {
            std::thread::yield_now();
        }
    }
    Ok(())
}

/// Waits until `watch` has counted `count` arrivals: a ping-pong's wait, which under manual
/// progress polls as the bare NIC's and fi_pingpong's do (back to back, the clock read every
/// 1024 idle passes, the core never yielded: a yield costs a system call, and here the peer is
/// another process on its own core). With worker threads it yields as [`spin_until`] does: a
/// spinning caller would keep the workers that count the arrival off the cores.
///
/// The ping-pongs watch their immediates ([`TransferEngine::watch_imm`]) rather than expect
/// each one: the pass adds an arrival to the watch's word, with no lock, queue or callback,
/// and the wait reads that word. Like the IMM counter, a watch counts an arrival that comes
/// before it is waited for, so unlike fi_pingpong, which must post the next receive between a
/// message's arrival and its answer, nothing has to happen between the two.
fn await_count(
    engine: &TransferEngine,
    watch: &ImmWatch,
    count: u64,
    deadline: Instant,
) -> Result<(), TransportError> {
    spin_until(engine, deadline, "an immediate's arrival", || {
        watch.arrived() >= count
    })
}

/// One write of `size` bytes with `imm`; `done` counts it, except an immediate-only one
/// (`size` 0), which asks for no completion (see the module's note) and goes to a destination
/// resolved once ([`TransferEngine::imm_target`]), as the bare NIC's writes do.
fn one_write(
    engine: &TransferEngine,
    buf: &RegisteredBuffer,
    peer: &ImmTarget,
    size: u64,
    imm: u32,
    done: &Arc<DoneCounter>,
) -> Result<(), TransportError> {
    if size == 0 {
        // Nobody waits on it: where the NIC can, it goes out without a completion.
        engine.submit_imm_to(imm, peer, OnDone::nothing())
    } else {
        engine.submit_single_write(
            size,
            Some(imm),
            (buf.handle(), 0),
            (peer.desc(), 0),
            OnDone::from(done),
        )
    }
}

/// How many of `writes` writes of `size` bytes [`one_write`] counts.
fn counted(size: u64, writes: u64) -> u64 {
    if size == 0 { 0 } else { writes }
}

/// Waits until all `count` writes counted by `done` completed, and fails if any failed.
/// `others` are engines of this thread whose writes `done` counts too: their passes run as
/// well.
fn settle(
    engine: &TransferEngine,
    others: &[&TransferEngine],
    done: &DoneCounter,
    count: u64,
    deadline: Instant,
) -> Result<(), TransportError> {
    spin_until(engine, deadline, "the writes' completions", || {
        for other in others {
            other.progress();
        }
        done.total() == count
    })?;
    if done.failed() > 0 {
        return Err(TransportError::Domain(format!(
            "{} of {count} writes failed",
            done.failed()
        )));
    }
    Ok(())
}

/// The initiating side of a ping-pong: `warmup` untimed round trips, then `iters` timed ones,
/// each a `size`-byte write with [`PING`] answered by one with [`PONG`] (immediate-only writes
/// for size 0). The peer runs [`answer_pings`] for `warmup + iters`.
pub fn pingpong(
    engine: &TransferEngine,
    buf: &RegisteredBuffer,
    peer: &MrDesc,
    size: u64,
    warmup: u64,
    iters: u64,
) -> Result<Pingpong, TransportError> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let done = DoneCounter::new();
    let pongs = engine.watch_imm(PONG)?;
    let peer = engine.imm_target(peer)?;
    let mut start = Instant::now();
    for i in 0..warmup + iters {
        if i == warmup {
            start = Instant::now();
        }
        one_write(engine, buf, &peer, size, PING, &done)?;
        await_count(engine, &pongs, i + 1, deadline)?;
    }
    let elapsed = start.elapsed();
    settle(engine, &[], &done, counted(size, warmup + iters), deadline)?;
    Ok(Pingpong::from_elapsed(size, iters, elapsed))
}

/// The answering side of a ping-pong: `count` times, waits for a [`PING`] and answers with a
/// [`PONG`] of the same size; returns once its pongs completed.
pub fn answer_pings(
    engine: &TransferEngine,
    buf: &RegisteredBuffer,
    peer: &MrDesc,
    size: u64,
    count: u64,
) -> Result<(), TransportError> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let done = DoneCounter::new();
    let pings = engine.watch_imm(PING)?;
    let peer = engine.imm_target(peer)?;
    for i in 0..count {
        await_count(engine, &pings, i + 1, deadline)?;
        one_write(engine, buf, &peer, size, PONG, &done)?;
    }
    // With manual progress the last pong completes only in a pass: run them until it has.
    settle(engine, &[], &done, counted(size, count), deadline)
}

/// `count` single writes of `size` bytes with at most `window` in flight.
pub fn stream(
    engine: &TransferEngine,
    buf: &RegisteredBuffer,
    peer: &MrDesc,
    size: u64,
    count: u64,
    window: u64,
) -> Result<Stream, TransportError> {
    let done = DoneCounter::new();
    let start = Instant::now();
    let deadline = start + Duration::from_secs(120);
    for i in 0..count {
        spin_until(engine, deadline, "room in the window", || {
            i - done.total() < window
        })?;
        engine.submit_single_write(
            size,
            None,
            (buf.handle(), 0),
            (peer, 0),
            OnDone::from(&done),
        )?;
    }
    spin_until(engine, deadline, "the stream's completions", || {
        done.total() == count
    })?;
    if done.failed() > 0 {
        return Err(TransportError::Domain(format!(
            "{} writes failed",
            done.failed()
        )));
    }
    Ok(Stream::from_elapsed(size, count, start.elapsed()))
}

/// One paged transfer of `pages` pages of `page` bytes (consecutive on both sides), with an
/// immediate per page as KV-cache transfers carry.
pub fn paged(
    engine: &TransferEngine,
    buf: &RegisteredBuffer,
    peer: &MrDesc,
    page: u64,
    pages: u32,
) -> Result<Stream, TransportError> {
    let indices: Vec<u32> = (0..pages).collect();
    let (src, dst) = (
        Pages::new(indices.clone(), page, 0),
        Pages::new(indices, page, 0),
    );
    let done = DoneFlag::new();
    let start = Instant::now();
    let deadline = start + Duration::from_secs(120);
    engine.submit_paged_writes(
        page,
        Some(PAGE),
        (buf.handle(), &src),
        (peer, &dst),
        OnDone::from(&done),
    )?;
    spin_until(engine, deadline, "the paged transfer", || done.is_done())?;
    if let Some(Err(e)) = done.result() {
        return Err(TransportError::Domain(format!("paged writes failed: {e}")));
    }
    Ok(Stream::from_elapsed(
        page,
        u64::from(pages),
        start.elapsed(),
    ))
}

/// What a [`RawEndpoint`]'s peer needs: its NIC address and its buffer's address and key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RawAddress {
    /// The NIC.
    pub nic: DomainAddr,
    /// The buffer's base as the NIC addresses it.
    pub remote_addr: u64,
    /// The buffer's remote key.
    pub rkey: u64,
    /// The buffer's length in bytes.
    pub len: u64,
}

/// The provider's own RMA path, without the engine: one [`FabricDomain`] and a registered
/// buffer, driven directly (no submission queue, no transfer bookkeeping, no IMM counter).
/// Its ping-pong is the baseline that separates what the engine costs from what the provider
/// costs: the engine's ping-pong minus this one is the engine's overhead.
#[derive(Debug)]
pub struct RawEndpoint {
    // Declared before the buffer: the NIC (and its registration) closes first.
    domain: FabricDomain,
    buf: Box<[u8]>,
    reg: Registration,
    peer: Option<(PeerId, RawAddress)>,
    completions: Vec<Completion>,
    outstanding: u64,
}

impl RawEndpoint {
    /// Opens one NIC of `config`'s provider with a `len`-byte registered buffer.
    pub fn open(config: &FabricConfig, len: usize) -> Result<Self, TransportError> {
        let (mut domains, _) = super::open(&FabricConfig {
            nics: 1,
            ..config.clone()
        })?;
        let mut domain = domains.remove(0);
        let buf = vec![0u8; len.max(1)].into_boxed_slice();
        // SAFETY: the buffer is owned by the endpoint and dropped after the domain.
        let reg = unsafe {
            domain.register(
                buf.as_ptr() as u64,
                buf.len() as u64,
                Device::Host,
                Access::RemoteWrite,
            )
        }?;
        Ok(Self {
            domain,
            buf,
            reg,
            peer: None,
            completions: Vec::with_capacity(64),
            outstanding: 0,
        })
    }

    /// Where a peer writes to reach this endpoint.
    pub fn address(&self) -> RawAddress {
        RawAddress {
            nic: self.domain.address(),
            remote_addr: self.reg.remote_addr,
            rkey: self.reg.rkey,
            len: self.buf.len() as u64,
        }
    }

    /// Makes `peer` the endpoint's target.
    pub fn connect(&mut self, peer: &RawAddress) -> Result<(), TransportError> {
        let id = self.domain.connect(&peer.nic)?;
        self.peer = Some((id, peer.clone()));
        Ok(())
    }

    /// Polls once; returns how many arrivals were among the completions.
    fn poll(&mut self) -> Result<u64, TransportError> {
        self.completions.clear();
        self.domain.poll(&mut self.completions, 64);
        let mut arrived = 0;
        for c in &self.completions {
            match (&c.kind, &c.result) {
                (CompletionKind::Arrival { .. }, _) => arrived += u64::from(c.count),
                (CompletionKind::Write, Ok(())) => self.outstanding -= u64::from(c.count),
                (_, Err(e)) => {
                    return Err(TransportError::Domain(format!("raw write failed: {e}")));
                }
                _ => {}
            }
        }
        Ok(arrived)
    }

    /// Writes `size` bytes at `offset` of both buffers with `imm`, polling while the provider
    /// refuses; returns the arrivals seen meanwhile.
    fn write(
        &mut self,
        size: u64,
        offset: u64,
        imm: u32,
        deadline: Instant,
    ) -> Result<u64, TransportError> {
        let mut arrived = 0;
        while !self.post_one(size, offset, imm)? {
            arrived += self.poll()?;
            if Instant::now() > deadline {
                return Err(TransportError::Domain(
                    "the raw endpoint stayed full".to_owned(),
                ));
            }
        }
        Ok(arrived)
    }

    /// Posts one write of `size` bytes at `offset` of both buffers to the peer; `Ok(false)`
    /// when the provider refused it for now.
    fn post_one(&mut self, size: u64, offset: u64, imm: u32) -> Result<bool, TransportError> {
        let Some((peer, addr)) = &self.peer else {
            return Err(TransportError::InvalidArgument(
                "the raw endpoint is not connected",
            ));
        };
        let end = offset.checked_add(size);
        if end.is_none_or(|end| end > self.buf.len() as u64 || end > addr.len) {
            return Err(TransportError::InvalidArgument(
                "a raw write past the end of a buffer",
            ));
        }
        let wr = WriteWr {
            wr_id: 1,
            peer: *peer,
            src_addr: self.buf.as_ptr() as u64 + offset,
            lkey: self.reg.lkey,
            len: size,
            dst_addr: addr.remote_addr + offset,
            rkey: addr.rkey,
            imm: Some(imm),
        };
        // An immediate-only write asks for no completion where the NIC allows, as the
        // engine's (see the module's note).
        if size == 0 {
            match self.domain.post_unreported(&wr)? {
                Unreported::Posted => return Ok(true),
                Unreported::Full => return Ok(false),
                Unreported::Unsupported => {}
            }
        }
        if self.domain.post_writes(&[wr])? == 0 {
            return Ok(false);
        }
        self.outstanding += 1;
        Ok(true)
    }

    /// Waits until `want` arrivals were seen, `already` of them while posting.
    fn await_arrivals(
        &mut self,
        mut already: u64,
        want: u64,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let mut spins = 0u32;
        while already < want {
            already += self.poll()?;
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && Instant::now() > deadline {
                return Err(TransportError::Domain(
                    "no arrival at the raw endpoint".to_owned(),
                ));
            }
        }
        Ok(())
    }

    fn settle(&mut self, deadline: Instant) -> Result<(), TransportError> {
        while self.outstanding > 0 {
            self.poll()?;
            if Instant::now() > deadline {
                return Err(TransportError::Domain(
                    "raw writes did not complete".to_owned(),
                ));
            }
        }
        Ok(())
    }

    /// The initiating side of a raw ping-pong, as [`pingpong`].
    pub fn pingpong(
        &mut self,
        size: u64,
        warmup: u64,
        iters: u64,
    ) -> Result<Pingpong, TransportError> {
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut start = Instant::now();
        for i in 0..warmup + iters {
            if i == warmup {
                start = Instant::now();
            }
            let arrived = self.write(size, 0, PING, deadline)?;
            self.await_arrivals(arrived, 1, deadline)?;
        }
        let elapsed = start.elapsed();
        self.settle(deadline)?;
        Ok(Pingpong::from_elapsed(size, iters, elapsed))
    }

    /// The answering side of a raw ping-pong, as [`answer_pings`].
    pub fn answer(&mut self, size: u64, count: u64) -> Result<(), TransportError> {
        let deadline = Instant::now() + Duration::from_secs(120);
        // An arrival seen while posting belongs to the next ping.
        let mut early = 0;
        for _ in 0..count {
            self.await_arrivals(early, 1, deadline)?;
            early = self.write(size, 0, PONG, deadline)?;
        }
        self.settle(deadline)
    }

    /// `count` writes of `size` bytes, each with [`PAGE`], at most `window` in flight, write
    /// `k` at offset `k * size` of both buffers (from the start again where the smaller ends),
    /// as [`paged`] lays out its pages: the provider's own pipelined RMA over the same memory,
    /// the baseline for the engine's paged writes. The peer runs [`RawEndpoint::absorb`] for
    /// `count`.
    pub fn stream(&mut self, size: u64, count: u64, window: u64) -> Result<Stream, TransportError> {
        let span = self
            .peer
            .as_ref()
            .map_or(0, |(_, addr)| addr.len.min(self.buf.len() as u64));
        let slots = span.checked_div(size).unwrap_or(1).max(1);
        let start = Instant::now();
        let deadline = start + Duration::from_secs(120);
        for k in 0..count {
            while self.outstanding >= window {
                self.poll()?;
                if Instant::now() > deadline {
                    return Err(TransportError::Domain(
                        "raw writes did not complete".to_owned(),
                    ));
                }
            }
            self.write(size, k % slots * size, PAGE, deadline)?;
        }
        self.settle(deadline)?;
        Ok(Stream::from_elapsed(size, count, start.elapsed()))
    }

    /// The receiving side of [`RawEndpoint::stream`]: progresses until `count` writes arrived.
    pub fn absorb(&mut self, count: u64) -> Result<(), TransportError> {
        let deadline = Instant::now() + Duration::from_secs(120);
        self.await_arrivals(0, count, deadline)
    }
}

/// What one immediate-only write costs when both ends run on the calling thread: no other
/// thread, process or scheduler in the time, so what is left is the work itself.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct OneThread {
    /// One-way trips timed on each path.
    pub trips: u64,
    /// Through two engines with manual progress: submit (to a destination resolved once),
    /// post, the arrival counted by the receiver's watch, nanoseconds per one-way trip.
    pub engine_ns: f64,
    /// The same writes posted and polled on two bare NICs, nanoseconds per one-way trip.
    pub bare_ns: f64,
}

/// Bounces immediate-only writes between two endpoints of `config`'s provider on this thread,
/// `trips` round trips timed (after a tenth as many untimed), through two manual-progress
/// engines and then on two bare NICs: [`OneThread`].
pub fn one_thread(config: &FabricConfig, trips: u64) -> Result<OneThread, TransportError> {
    let warmup = (trips / 10).max(2);
    let deadline = Instant::now() + Duration::from_secs(120);
    let engines = || {
        let engine_config = crate::EngineConfig {
            progress: crate::Progress::Manual,
            ..crate::EngineConfig::default()
        };
        TransferEngine::fabric(config, engine_config).map(|(e, _)| e)
    };
    let (a, b) = (engines()?, engines()?);
    let (abuf, bbuf) = (a.alloc_mr(64)?, b.alloc_mr(64)?);
    let (at_a, at_b) = (a.watch_imm(PING)?, b.watch_imm(PING)?);
    let mut sent = 0;
    let (to_a, to_b) = (b.imm_target(abuf.desc())?, a.imm_target(bbuf.desc())?);
    let trip = |from: &TransferEngine, to: &TransferEngine, dst: &ImmTarget, at: &ImmWatch, n| {
        from.submit_imm_to(PING, dst, OnDone::nothing())?;
        spin_until(to, deadline, "an immediate", || {
            from.progress();
            at.arrived() >= n
        })
    };
    let engine = timed_rounds(warmup, trips, || {
        sent += 1;
        trip(&a, &b, &to_b, &at_b, sent)?;
        trip(&b, &a, &to_a, &at_a, sent)
    })?;
    drop((at_a, at_b, to_a, to_b, abuf, bbuf, a, b));

    let mut x = RawEndpoint::open(config, 64)?;
    let mut y = RawEndpoint::open(config, 64)?;
    let (xa, ya) = (x.address(), y.address());
    x.connect(&ya)?;
    y.connect(&xa)?;
    // Both ends progress while a write waits: shm maps a new peer only when the receiver's
    // progress answers the sender's first message, refusing the sender's writes until then.
    let bare_trip = |from: &mut RawEndpoint, to: &mut RawEndpoint| -> Result<(), TransportError> {
        let mut spins = 0u32;
        let mut check = || {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && Instant::now() > deadline {
                return Err(TransportError::Domain(
                    "the bare one-thread trip did not finish".to_owned(),
                ));
            }
            Ok(())
        };
        while !from.post_one(0, 0, PING)? {
            from.poll()?;
            to.poll()?;
            check()?;
        }
        while to.poll()? == 0 {
            from.poll()?;
            check()?;
        }
        Ok(())
    };
    let bare = timed_rounds(warmup, trips, || {
        bare_trip(&mut x, &mut y)?;
        bare_trip(&mut y, &mut x)
    })?;
    x.settle(deadline)?;
    y.settle(deadline)?;
    let per_trip = |d: Duration| d.as_secs_f64() * 1e9 / (2 * trips) as f64;
    Ok(OneThread {
        trips: 2 * trips,
        engine_ns: per_trip(engine),
        bare_ns: per_trip(bare),
    })
}

/// Runs `round` `warmup` times untimed, then `rounds` times timed; returns the timed part.
fn timed_rounds(
    warmup: u64,
    rounds: u64,
    mut round: impl FnMut() -> Result<(), TransportError>,
) -> Result<Duration, TransportError> {
    for _ in 0..warmup {
        round()?;
    }
    let started = Instant::now();
    for _ in 0..rounds {
        round()?;
    }
    Ok(started.elapsed())
}

/// Runs `fi_pingpong` (libfabric-bin) on loopback: a server and a client on `provider`'s RDM
/// endpoints, `iters` round trips of `size` bytes, on control port `port`; returns the
/// client's row.
pub fn fi_pingpong(provider: &str, size: u64, iters: u64, port: u16) -> Result<Pingpong, String> {
    let common = |c: &mut Command| {
        c.args(["-p", provider, "-e", "rdm", "-I"])
            .arg(iters.to_string())
            .arg("-S")
            .arg(size.to_string())
            .stdin(Stdio::null());
    };
    let spawn_server = || {
        let mut server = Command::new("fi_pingpong");
        common(&mut server);
        server
            .args(["-B", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                format!("running fi_pingpong: {e} (install libfabric-bin: `cargo xtask deps`)")
            })
    };
    let mut server = spawn_server()?;
    // The server listens on its control port; retry the client until it answers, starting the
    // server again if it gave up (a port still held by a previous run, a loaded machine).
    let started = Instant::now();
    let output = loop {
        let mut client = Command::new("fi_pingpong");
        common(&mut client);
        let out = client
            .args(["-P", &port.to_string(), "127.0.0.1"])
            .output()
            .map_err(|e| format!("running fi_pingpong: {e}"))?;
        if out.status.success() || started.elapsed() > Duration::from_secs(20) {
            break out;
        }
        if matches!(server.try_wait(), Ok(Some(_))) {
            server = spawn_server()?;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if !output.status.success() {
        let _ = server.kill();
    }
    let _ = server.wait();
    if !output.status.success() {
        return Err(format!(
            "fi_pingpong failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    parse_fi_pingpong(&String::from_utf8_lossy(&output.stdout), size)
}

/// Reads the row of a `fi_pingpong` report: `bytes #sent #ack total time MB/sec usec/xfer
/// Mxfers/sec`, where `bytes` is abbreviated (`64k`, `1m`).
pub fn parse_fi_pingpong(report: &str, size: u64) -> Result<Pingpong, String> {
    for line in report.lines() {
        let cols: Vec<&str> = line.split_whitespace().collect();
        if cols.len() < 8 || cols[0] == "bytes" {
            continue;
        }
        let iters: u64 = cols[1]
            .trim_end_matches('k')
            .parse::<u64>()
            .map(|n| if cols[1].ends_with('k') { n * 1000 } else { n })
            .map_err(|_| format!("unreadable fi_pingpong row: {line}"))?;
        let mb_per_s: f64 = cols[5]
            .parse()
            .map_err(|_| format!("unreadable MB/sec in: {line}"))?;
        let usec_per_xfer: f64 = cols[6]
            .parse()
            .map_err(|_| format!("unreadable usec/xfer in: {line}"))?;
        return Ok(Pingpong {
            size,
            iters,
            usec_per_xfer,
            mb_per_s,
        });
    }
    Err(format!("no result row in fi_pingpong's output:\n{report}"))
}

#[cfg(test)]
mod tests;
