//! The requester: the dispatcher that routes query rows to holders and merges what comes back,
//! and fetches chunks into its own paged pool.
//!
//! [`Requester::route`] takes every call of a decode step at once, groups the calls bound to
//! the same holder into one inbox write (paper 000 section 5.3's third reduction), waits for
//! every reply with a deadline, and returns one result per call. A holder that does not answer
//! in time, or whose writes fail, is marked dead and its calls fail with
//! [`RouteError::HolderFailed`]; calling again sends them to the chunk's next replica.

use std::io::BufReader;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvroute_kernels::layout::{D_QK, PAGE_TOKENS, PARTIAL_ROW_BYTES};
use kvroute_kernels::{Backend, Cache, Partial, Rope, SpliceJob, splice};
use kvroute_kvstore::{ChunkEntry, ChunkId, ChunkRegistry, PAGE_BYTES, PagedPool, ROW_BYTES};
use kvroute_transport::{
    Access, CancellationToken, DoneFlag, MrDesc, OnDone, RegisteredBuffer, TransferEngine,
    TransferShape,
};

use super::holder::{recv_line, send_line};
use super::session::{Answer, Control, Hello, HolderStats, Welcome};
use super::wire::{self, SegmentKind, SegmentSpec, Status};

/// How a requester is set up.
#[derive(Debug, Clone)]
pub struct RequesterConfig {
    /// How long a route or fetch waits for a holder before declaring it failed.
    pub timeout: Duration,
    /// Bytes of the send staging and of the reply region, per holder.
    pub link_bytes: usize,
    /// Pages (64 tokens x 1152 B each) of the pool fetches land in.
    pub pool_pages: u32,
    /// The softmax scale sent with every request.
    pub scale: f32,
    /// This requester's immediate namespace (0 to 4095): requesters that share one engine
    /// need distinct tags, so each one's replies and fetch pages are counted apart.
    pub tag: u16,
    /// How long a wait for a reply polls (yielding the core) before it sleeps in 50 us
    /// steps: latency against CPU left to others.
    pub spin: Duration,
}

impl RequesterConfig {
    /// Defaults for `scale`: 5 s timeout, 8 MiB per holder link, a 512-page pool, tag 0,
    /// 1 ms of polling per wait.
    pub fn new(scale: f32) -> Self {
        Self {
            timeout: Duration::from_secs(5),
            link_bytes: 8 << 20,
            pool_pages: 512,
            scale,
            tag: 0,
            spin: Duration::from_millis(1),
        }
    }
}

/// One partial attention the requester wants from whoever holds `chunk`.
#[derive(Debug, Clone, Copy)]
pub struct Call<'a> {
    /// The chunk.
    pub chunk: ChunkId,
    /// The layer.
    pub layer: u16,
    /// Query rows `[mq, 576]` bf16 bits.
    pub queries: &'a [u16],
    /// A sparse selection over the chunk's tokens (chunk-local indices), or dense.
    pub sparse: Option<Sparse<'a>>,
}

/// A sparse selection in a [`Call`].
#[derive(Debug, Clone, Copy)]
pub struct Sparse<'a> {
    /// `mq / rows_per_token * k` chunk-local token indices, -1 = padding.
    pub indices: &'a [i32],
    /// Indices per query token.
    pub k: u32,
    /// Query rows per query token.
    pub rows_per_token: u32,
}

/// Why a call failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RouteError {
    /// No live holder has the chunk.
    #[error("no live holder has {0}")]
    NoHolder(ChunkId),
    /// The holder refused the segment or the request.
    #[error("holder {holder} refused: {status}")]
    Refused {
        /// The holder's control address.
        holder: SocketAddr,
        /// Its status.
        status: Status,
    },
    /// The holder did not answer in time, or the transfer to it failed; it is now dead here.
    #[error("holder {holder} failed: {why}")]
    HolderFailed {
        /// The holder's control address.
        holder: SocketAddr,
        /// What happened.
        why: String,
    },
    /// The request does not fit the link's buffers.
    #[error("request too large: {0} bytes")]
    TooLarge(usize),
    /// The reply did not decode.
    #[error("malformed reply from {holder}: {why}")]
    BadReply {
        /// The holder's control address.
        holder: SocketAddr,
        /// What was wrong.
        why: String,
    },
}

struct Link {
    control: TcpStream,
    reader: BufReader<TcpStream>,
    addr: SocketAddr,
    welcome: Welcome,
    reply_imm: u32,
    fetch_imm: u32,
    seq: u64,
    alive: bool,
}

/// A chunk fetched into the pool and spliced to the requester's positions.
#[derive(Debug)]
pub struct Fetched {
    /// The chunk.
    pub chunk: ChunkId,
    /// Pool pages, layer-major (`layers * ceil(tokens / 64)`).
    pub pages: Vec<u32>,
    /// Tokens per layer.
    pub tokens: usize,
    /// Layers.
    pub layers: usize,
    /// Time from submitting the fetch to the last page landing, microseconds.
    pub transfer_us: f64,
    /// Time of the in-place splice, microseconds.
    pub splice_us: f64,
}

/// The selected tokens of one chunk, for [`Requester::gather`].
#[derive(Debug, Clone, Copy)]
pub struct GatherPart<'a> {
    /// The chunk.
    pub chunk: ChunkId,
    /// Chunk-local token indices (duplicates are sent twice, as a gather would).
    pub tokens: &'a [i32],
}

/// Rows gathered by [`Requester::gather`]: for each layer asked, the selected rows of every
/// part back to back (part order, token order), in pool pages.
#[derive(Debug)]
pub struct Gathered {
    /// Pool pages, layer-major (`layers.len() * ceil(rows / 64)`).
    pub pages: Vec<u32>,
    /// Rows per layer.
    pub rows: usize,
    /// The layers, in the order asked.
    pub layers: Vec<u16>,
    /// Time from submitting the requests to the last row landing, microseconds.
    pub transfer_us: f64,
}

/// The requester's byte conversions since it connected: the part of a route round trip that
/// is neither transport nor kernel nor bookkeeping (a GPU requester stages query rows
/// and merges bf16 rows in kernels of its own).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct CodecTimes {
    /// Copying query rows, indices and pages into requests, microseconds.
    pub encode_us: f64,
    /// Decoding and validating reply rows into f32 partials, microseconds.
    pub decode_us: f64,
}

/// The requester side of route and fetch.
pub struct Requester {
    engine: TransferEngine,
    config: RequesterConfig,
    send: RegisteredBuffer,
    replies: RegisteredBuffer,
    pool_mem: RegisteredBuffer,
    pool: PagedPool,
    links: Vec<Link>,
    registry: ChunkRegistry,
    codec: CodecTimes,
}

impl std::fmt::Debug for Requester {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Requester")
            .field("holders", &self.links.len())
            .field("chunks", &self.registry.len())
            .finish_non_exhaustive()
    }
}

/// Waits for every flag or the deadline; `Err(i)` names the first flag not set in time.
/// Polls (yielding the core) for `spin`, then sleeps 50 us between looks.
fn wait_all(
    engine: &TransferEngine,
    flags: &[&Arc<DoneFlag>],
    deadline: Instant,
    spin: Duration,
) -> Result<(), usize> {
    let started = Instant::now();
    loop {
        match flags.iter().position(|f| !f.is_done()) {
            None => return Ok(()),
            Some(i) if Instant::now() > deadline => return Err(i),
            Some(_) => {}
        }
        if engine.manual_progress() {
            engine.progress();
        }
        if started.elapsed() < spin {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

impl Requester {
    /// Opens a session with every holder in `holders` and builds the chunk registry from what
    /// they serve. A holder that is busy or unreachable is an error.
    pub fn connect(
        engine: TransferEngine,
        holders: &[SocketAddr],
        config: RequesterConfig,
    ) -> Result<Self> {
        if holders.is_empty() || holders.len() > 1 << 12 {
            bail!("a requester needs 1 to 4096 holders");
        }
        if config.tag >= 1 << 12 {
            bail!("a requester tag is 0 to 4095");
        }
        let n = holders.len();
        let send = engine.alloc_mr_with(config.link_bytes * n, Access::Local)?;
        let replies = engine.alloc_mr(config.link_bytes * n)?;
        let pool = PagedPool::new(config.pool_pages.max(1), PAGE_BYTES)?;
        let pool_mem = engine.alloc_mr(pool.bytes())?;
        let mut links = Vec::with_capacity(n);
        let mut registry = ChunkRegistry::new();
        for (i, &addr) in holders.iter().enumerate() {
            let control = TcpStream::connect_timeout(&addr, config.timeout)
                .with_context(|| format!("connecting to holder {addr}"))?;
            control.set_nodelay(true)?;
            control.set_read_timeout(Some(config.timeout.max(Duration::from_secs(1))))?;
            let mut reader = BufReader::new(control.try_clone()?);
            let mut writer = control.try_clone()?;
            // 8 bits of kind, 12 of requester tag, 12 of link.
            let id = (u32::from(config.tag) << 12) | i as u32;
            let (reply_imm, fetch_imm) = (0x6100_0000 | id, 0x6200_0000 | id);
            let reply = replies.desc().clone();
            let hello = Hello {
                addr: engine.main_address(),
                reply,
                pool: Some(pool_mem.desc().clone()),
                reply_imm,
                fetch_imm,
            };
            send_line(&mut writer, &hello)?;
            let welcome = match recv_line::<Answer>(&mut reader, 64 << 20)? {
                Answer::Welcome(w) => w,
                Answer::Busy { active, cap } => {
                    bail!("holder {addr} is busy ({active} of {cap} requesters)")
                }
                Answer::Refused(why) => bail!("holder {addr} refused the session: {why}"),
            };
            for entry in &welcome.chunks {
                registry.register(entry.clone())?;
            }
            links.push(Link {
                control,
                reader,
                addr,
                welcome,
                reply_imm,
                fetch_imm,
                seq: 0,
                alive: true,
            });
        }
        Ok(Self {
            engine,
            config,
            send,
            replies,
            pool_mem,
            pool,
            links,
            registry,
            codec: CodecTimes::default(),
        })
    }

    /// The chunk registry the holders' welcomes built.
    pub fn registry(&self) -> &ChunkRegistry {
        &self.registry
    }

    /// The engine.
    pub fn engine(&self) -> &TransferEngine {
        &self.engine
    }

    /// Holders still considered alive.
    pub fn live_holders(&self) -> usize {
        self.links.iter().filter(|l| l.alive).count()
    }

    /// A holder's counters, over its control connection.
    pub fn holder_stats(&mut self, holder: usize) -> Result<HolderStats> {
        let link = self.links.get_mut(holder).context("no such holder")?;
        send_line(&mut link.control, &Control::Stats)?;
        recv_line(&mut link.reader, 1 << 20)
    }

    /// The transport's raw write round trip to holder `holder` (an index into the holders
    /// given to [`Requester::connect`]): `request_len` bytes out into its inbox slot and
    /// `reply_len` bytes back into the reply region, each one write with an immediate, through
    /// the same engines, buffers and serving thread as [`Requester::route`] but with no
    /// encoding, parsing or kernel. Route's round trip minus this, minus the holder's kernel
    /// time, is the protocol's host overhead (what `kvroute sweep` reports).
    pub fn ping(
        &mut self,
        holder: usize,
        request_len: usize,
        reply_len: usize,
    ) -> Result<Duration, RouteError> {
        let link_bytes = self.config.link_bytes;
        let l = self
            .links
            .get(holder)
            .ok_or(RouteError::NoHolder(ChunkId(u32::MAX)))?;
        if !l.alive {
            return Err(RouteError::HolderFailed {
                holder: l.addr,
                why: "marked dead earlier".into(),
            });
        }
        let limit = link_bytes.min(l.welcome.slot_bytes as usize);
        let reply_limit = link_bytes.min(l.welcome.reply_bytes as usize);
        if !(wire::PING_HEADER..=limit).contains(&request_len) {
            return Err(RouteError::TooLarge(request_len));
        }
        if !(1..=reply_limit).contains(&reply_len) {
            return Err(RouteError::TooLarge(reply_len));
        }
        let (addr, reply_imm) = (l.addr, l.reply_imm);
        let staged = holder * link_bytes;
        let started = Instant::now();
        let reply_flag = DoneFlag::new();
        let token = CancellationToken::new();
        let arrivals = self.engine.expected_arrivals(TransferShape::SingleWrite {
            len: reply_len as u64,
        });
        self.engine.expect_imm_count(
            reply_imm,
            arrivals,
            OnDone::flag(&reply_flag).cancellable(&token),
        );
        let shards = self.engine.expected_arrivals(TransferShape::SingleWrite {
            len: request_len as u64,
        });
        let sent_flag = DoneFlag::new();
        // SAFETY: as in `exchange`: this link's staging range, no write from it in flight.
        let submitted = unsafe { self.send.bytes_mut(staged, wire::PING_HEADER) }
            .map(|buf| wire::encode_ping(buf, reply_len as u32, staged as u64))
            .map_err(|e| e.to_string())
            .and_then(|()| {
                self.engine
                    .submit_single_write(
                        request_len as u64,
                        Some(wire::ping_imm(l.welcome.session, shards)),
                        (self.send.handle(), staged as u64),
                        (&l.welcome.inbox, l.welcome.slot_offset),
                        OnDone::flag(&sent_flag),
                    )
                    .map_err(|e| e.to_string())
            });
        let failure = match submitted {
            Err(why) => Some(why),
            Ok(()) => match wait_all(
                &self.engine,
                &[&sent_flag, &reply_flag],
                started + self.config.timeout,
                self.config.spin,
            ) {
                Err(which) => Some(format!(
                    "no {} within {:?}",
                    ["ping completion", "pong"][which],
                    self.config.timeout
                )),
                Ok(()) => match sent_flag.result() {
                    Some(Err(e)) => Some(format!("ping write failed: {e}")),
                    _ => None,
                },
            },
        };
        let elapsed = started.elapsed();
        if let Some(why) = failure {
            token.cancel();
            self.kill(holder);
            return Err(RouteError::HolderFailed { holder: addr, why });
        }
        Ok(elapsed)
    }

    /// The time spent converting bytes since connecting (see [`CodecTimes`]).
    pub fn codec_times(&self) -> CodecTimes {
        self.codec
    }

    /// The free pages of the pool (for leak checks).
    pub fn free_pool_pages(&self) -> usize {
        self.pool.free_pages()
    }

    /// The first live link holding `chunk`.
    fn link_for(&self, chunk: ChunkId) -> Result<usize, RouteError> {
        let holders = self
            .registry
            .holders(chunk)
            .map_err(|_| RouteError::NoHolder(chunk))?;
        holders
            .iter()
            .find_map(|e| {
                self.links
                    .iter()
                    .position(|l| l.alive && l.welcome.holder == e.holder)
            })
            .ok_or(RouteError::NoHolder(chunk))
    }

    fn entry(&self, chunk: ChunkId) -> Result<&ChunkEntry, RouteError> {
        self.registry
            .holders(chunk)
            .ok()
            .and_then(|h| h.first())
            .ok_or(RouteError::NoHolder(chunk))
    }

    fn kill(&mut self, link: usize) {
        self.links[link].alive = false;
        let _ = self.links[link].control.shutdown(std::net::Shutdown::Both);
    }

    /// Sends one request of `segments` to `link` and waits for its reply (and, for a fetch or
    /// gather, that many arrivals of the link's fetch immediate). Returns where each reply
    /// landed: (offset, length) in `replies`.
    fn exchange(
        &mut self,
        batches: Vec<(usize, Vec<SegmentSpec<'_>>, u64)>,
    ) -> Vec<Result<(usize, usize), RouteError>> {
        let deadline = Instant::now() + self.config.timeout;
        let mut waits = Vec::new();
        let mut out: Vec<Result<(usize, usize), RouteError>> = Vec::new();
        for (link, segments, fetch_arrivals) in &batches {
            let link = *link;
            let l = &mut self.links[link];
            l.seq += 1;
            let len = wire::request_len(segments);
            let reply_len = wire::reply_len(segments.len(), wire::reply_rows(segments));
            let limit = self.config.link_bytes.min(l.welcome.slot_bytes as usize);
            if len > limit || reply_len > self.config.link_bytes.min(l.welcome.reply_bytes as usize)
            {
                out.push(Err(RouteError::TooLarge(len.max(reply_len))));
                waits.push(None);
                continue;
            }
            let reply_offset = (link * self.config.link_bytes) as u64;
            let staged = link * self.config.link_bytes;
            // SAFETY: this link's staging range is read only by this link's request write,
            // and the previous one has completed (its completion was waited for; a link whose
            // wait failed is dead and never sends again). No peer writes it (its descriptor
            // is never handed out). The range is in bounds: `len <= link_bytes` (checked).
            let encode_started = Instant::now();
            let encoded = unsafe { self.send.bytes_mut(staged, len) }.map(|buf| {
                wire::encode_request_into(buf, l.seq, reply_offset, self.config.scale, segments);
            });
            self.codec.encode_us += encode_started.elapsed().as_secs_f64() * 1e6;
            let token = CancellationToken::new();
            let reply_flag = DoneFlag::new();
            let arrivals = self.engine.expected_arrivals(TransferShape::SingleWrite {
                len: reply_len as u64,
            });
            self.engine.expect_imm_count(
                l.reply_imm,
                arrivals,
                OnDone::flag(&reply_flag).cancellable(&token),
            );
            let fetch_flag = (*fetch_arrivals > 0).then(|| {
                let flag = DoneFlag::new();
                self.engine.expect_imm_count(
                    l.fetch_imm,
                    *fetch_arrivals,
                    OnDone::flag(&flag).cancellable(&token),
                );
                flag
            });
            let shards = self
                .engine
                .expected_arrivals(TransferShape::SingleWrite { len: len as u64 });
            let imm = wire::request_imm(l.welcome.session, shards);
            let sent_flag = DoneFlag::new();
            let submitted = encoded.map_err(|e| e.to_string()).and_then(|()| {
                self.engine
                    .submit_single_write(
                        len as u64,
                        Some(imm),
                        (self.send.handle(), staged as u64),
                        (&l.welcome.inbox, l.welcome.slot_offset),
                        OnDone::flag(&sent_flag),
                    )
                    .map_err(|e| e.to_string())
            });
            match submitted {
                Ok(()) => {
                    out.push(Ok((reply_offset as usize, reply_len)));
                    waits.push(Some((sent_flag, reply_flag, fetch_flag, token, reply_len)));
                }
                Err(why) => {
                    token.cancel();
                    out.push(Err(RouteError::HolderFailed {
                        holder: l.addr,
                        why,
                    }));
                    waits.push(None);
                }
            }
        }
        for (i, wait) in waits.into_iter().enumerate() {
            let Some((sent, reply, fetch, token, reply_len)) = wait else {
                continue;
            };
            let link = batches[i].0;
            let mut flags = vec![&sent, &reply];
            if let Some(f) = &fetch {
                flags.push(f);
            }
            let failure = match wait_all(&self.engine, &flags, deadline, self.config.spin) {
                Err(which) => Some(format!(
                    "no {} within {:?}",
                    ["send completion", "reply", "fetch pages"][which],
                    self.config.timeout
                )),
                Ok(()) => match sent.result() {
                    Some(Err(e)) => Some(format!("request write failed: {e}")),
                    _ => None,
                },
            };
            if let Some(why) = failure {
                token.cancel();
                out[i] = Err(RouteError::HolderFailed {
                    holder: self.links[link].addr,
                    why,
                });
                self.kill(link);
                continue;
            }
            debug_assert!(matches!(out[i], Ok((_, n)) if n == reply_len));
        }
        out
    }

    /// The bytes of a reply [`Requester::exchange`] reported, borrowed in place.
    fn reply_bytes(
        &self,
        holder: SocketAddr,
        (offset, len): (usize, usize),
    ) -> Result<&[u8], RouteError> {
        // SAFETY: the reply's immediate has been counted, so its write has landed, and the
        // holder writes this link's range again only after the next request. A holder that
        // writes anyway changes the values decoded (which are validated), never the bounds.
        unsafe { self.replies.bytes(offset, len) }.map_err(|e| RouteError::BadReply {
            holder,
            why: e.to_string(),
        })
    }

    /// Routes every call, one write per holder; one result per call, in order.
    pub fn route(&mut self, calls: &[Call<'_>]) -> Vec<Result<Partial, RouteError>> {
        let mut parts = vec![Partial::empty(0); calls.len()];
        let done = self.route_into(calls, &mut parts);
        done.into_iter()
            .zip(parts)
            .map(|(r, p)| r.map(|()| p))
            .collect()
    }

    /// [`Requester::route`] into partials the caller keeps: `out[c]` receives call `c`'s
    /// partial, reusing its allocations (a decode step that routes the same shapes every step
    /// allocates nothing; a fresh 256-row partial cost as much as decoding it on the VM of
    /// docs/perf.md). Where a call fails, `out[c]` holds empty rows or its old contents.
    ///
    /// # Panics
    /// If `out` and `calls` differ in length.
    pub fn route_into(
        &mut self,
        calls: &[Call<'_>],
        out: &mut [Partial],
    ) -> Vec<Result<(), RouteError>> {
        assert_eq!(calls.len(), out.len(), "one partial per call");
        let mut results: Vec<Option<Result<(), RouteError>>> = vec![None; calls.len()];
        // link -> the calls bound to it, in order.
        let mut by_link: Vec<(usize, Vec<usize>)> = Vec::new();
        for (c, call) in calls.iter().enumerate() {
            if call.queries.is_empty() || call.queries.len() % D_QK != 0 {
                results[c] = Some(Err(RouteError::TooLarge(call.queries.len())));
                continue;
            }
            match self.link_for(call.chunk) {
                Ok(link) => match by_link.iter_mut().find(|(l, _)| *l == link) {
                    Some((_, v)) => v.push(c),
                    None => by_link.push((link, vec![c])),
                },
                Err(e) => results[c] = Some(Err(e)),
            }
        }
        let batches: Vec<_> = by_link
            .iter()
            .map(|(link, members)| {
                let segs = members
                    .iter()
                    .map(|&c| {
                        let call = &calls[c];
                        let (kind, indices) = match call.sparse {
                            None => (SegmentKind::Dense, &[][..]),
                            Some(s) => (
                                SegmentKind::Sparse {
                                    k: s.k,
                                    rows_per_token: s.rows_per_token,
                                },
                                s.indices,
                            ),
                        };
                        SegmentSpec {
                            kind,
                            chunk: call.chunk.0,
                            layer: call.layer,
                            queries: call.queries,
                            indices,
                            pages: &[],
                        }
                    })
                    .collect();
                (*link, segs, 0)
            })
            .collect();
        let replies = self.exchange(batches);
        let mut decode_us = 0.0;
        for ((link, members), reply) in by_link.iter().zip(replies) {
            let holder = self.links[*link].addr;
            let seq = self.links[*link].seq;
            let decoded = reply
                .and_then(|range| self.reply_bytes(holder, range))
                .and_then(|bytes| decode_reply(holder, seq, bytes, members.len()));
            match decoded {
                Err(e) => {
                    for &c in members {
                        results[c] = Some(Err(e.clone()));
                    }
                }
                Ok((statuses, rows)) => {
                    // Every segment's rows are at the place the request fixed, served or
                    // not (`wire::reply_row_layout`).
                    let mut at = 0;
                    for (&c, status) in members.iter().zip(statuses) {
                        let n = calls[c].queries.len() / D_QK * PARTIAL_ROW_BYTES;
                        let part = rows.get(at..at + n).ok_or_else(|| RouteError::BadReply {
                            holder,
                            why: "fewer rows than asked for".into(),
                        });
                        at += n;
                        results[c] = Some(if status != Status::Ok {
                            Err(RouteError::Refused { holder, status })
                        } else {
                            part.and_then(|p| {
                                let started = Instant::now();
                                let read = out[c].read_wire(p);
                                decode_us += started.elapsed().as_secs_f64() * 1e6;
                                read.map_err(|e| RouteError::BadReply {
                                    holder,
                                    why: e.to_string(),
                                })
                            })
                        });
                    }
                }
            }
        }
        self.codec.decode_us += decode_us;
        results
            .into_iter()
            .map(|r| r.unwrap_or(Err(RouteError::NoHolder(ChunkId(u32::MAX)))))
            .collect()
    }

    /// Fetches `chunk` from a live holder into the pool (paged writes, one immediate
    /// expectation for the whole pull) and re-rotates it in place to `to` (the requester's
    /// positions for its tokens), with `rope`, the rotation the chunk was stored with.
    pub fn fetch(
        &mut self,
        chunk: ChunkId,
        to: &[i64],
        rope: Rope,
        backend: Backend,
    ) -> Result<Fetched, RouteError> {
        let link = self.link_for(chunk)?;
        let entry = self.entry(chunk)?.clone();
        let layout = entry.layout;
        let holder = self.links[link].addr;
        let pages = self
            .pool
            .alloc(layout.pages())
            .map_err(|e| RouteError::HolderFailed {
                holder,
                why: format!("pool: {e}"),
            })?;
        let started = Instant::now();
        let seg = SegmentSpec {
            kind: SegmentKind::Fetch,
            chunk: chunk.0,
            layer: 0,
            queries: &[],
            indices: &[],
            pages: &pages,
        };
        let arrivals = self.engine.expected_arrivals(TransferShape::PagedWrites {
            pages: pages.len() as u64,
        });
        let reply = self.exchange(vec![(link, vec![seg], arrivals)]).pop();
        let reply = reply.unwrap_or(Err(RouteError::NoHolder(chunk)));
        let seq = self.links[link].seq;
        let status = reply
            .and_then(|range| self.reply_bytes(holder, range))
            .and_then(|bytes| decode_reply(holder, seq, bytes, 1).map(|(s, _)| s));
        match status {
            Ok(s) if s[0] == Status::Ok => {}
            Ok(s) => {
                let _ = self.pool.release(&pages);
                return Err(RouteError::Refused {
                    holder,
                    status: s[0],
                });
            }
            Err(e) => {
                // Pages a late write may still land in are quarantined, not reused.
                return Err(e);
            }
        }
        let transfer_us = started.elapsed().as_secs_f64() * 1e6;
        let started = Instant::now();
        // SAFETY: every page write of this fetch has been counted; no other fetch is in flight
        // (the requester is used from one thread) and a timed-out fetch's pages are never
        // released, so no peer writes into the pool now; no other view of the pool exists.
        let pool = unsafe { self.pool_mem.u16s_mut(0, self.pool.bytes() / 2) }.map_err(|e| {
            RouteError::HolderFailed {
                holder,
                why: e.to_string(),
            }
        })?;
        let job = SpliceJob::in_place(
            layout.layers as usize,
            &entry.positions,
            to,
            rope,
            pool,
            &pages,
        )
        .and_then(|job| splice(backend, job));
        if let Err(e) = job {
            let _ = self.pool.release(&pages);
            return Err(RouteError::BadReply {
                holder,
                why: format!("splice: {e}"),
            });
        }
        Ok(Fetched {
            chunk,
            pages,
            tokens: layout.tokens as usize,
            layers: layout.layers as usize,
            transfer_us,
            splice_us: started.elapsed().as_secs_f64() * 1e6,
        })
    }

    /// Sparse fetch: the rows of `parts` (each chunk's selected tokens) for each of `layers`,
    /// gathered from every holder that has some into pool pages: one request per holder
    /// (a gather segment per (part, layer)), one row-sized write per row from the holder, one
    /// immediate expectation per holder. No splice: the rows keep their stored positions, as
    /// sparse attention reads them. Attend with [`Requester::gathered_cache`].
    pub fn gather(
        &mut self,
        parts: &[GatherPart<'_>],
        layers: &[u16],
    ) -> Result<Gathered, RouteError> {
        let rows: usize = parts.iter().map(|p| p.tokens.len()).sum();
        if rows == 0 || layers.is_empty() {
            return Err(RouteError::TooLarge(0));
        }
        let ppl = rows.div_ceil(PAGE_TOKENS);
        let no_pool = |e: &dyn std::fmt::Display| RouteError::HolderFailed {
            holder: self.links[0].addr,
            why: format!("pool: {e}"),
        };
        let pages = self
            .pool
            .alloc(ppl * layers.len())
            .map_err(|e| no_pool(&e))?;
        let mut links = Vec::with_capacity(parts.len());
        for p in parts {
            match self.link_for(p.chunk) {
                Ok(l) => links.push(l),
                Err(e) => {
                    let _ = self.pool.release(&pages);
                    return Err(e);
                }
            }
        }
        let started = Instant::now();
        // link -> (segments, arrivals of its fetch immediate: one write per page a segment
        // touches, as the holder packs them, each maybe sharded over NICs)
        let mut batches: Vec<(usize, Vec<SegmentSpec<'_>>, u64)> = Vec::new();
        let mut at = 0;
        for (p, &link) in parts.iter().zip(&links) {
            let n = p.tokens.len();
            if n > 0 {
                let (first_page, end_page) = (at / PAGE_TOKENS, (at + n).div_ceil(PAGE_TOKENS));
                let first = (at % PAGE_TOKENS) as u32;
                let arrivals: u64 = wire::gather_writes(first, n)
                    .map(|w| {
                        self.engine.expected_arrivals(TransferShape::SingleWrite {
                            len: (w.rows * ROW_BYTES) as u64,
                        })
                    })
                    .sum();
                for (l, &layer) in layers.iter().enumerate() {
                    let table = &pages[l * ppl..(l + 1) * ppl];
                    let seg = SegmentSpec {
                        kind: SegmentKind::Gather { first },
                        chunk: p.chunk.0,
                        layer,
                        queries: &[],
                        indices: p.tokens,
                        pages: &table[first_page..end_page],
                    };
                    match batches.iter_mut().find(|(b, _, _)| *b == link) {
                        Some((_, segs, count)) => {
                            segs.push(seg);
                            *count += arrivals;
                        }
                        None => batches.push((link, vec![seg], arrivals)),
                    }
                }
            }
            at += n;
        }
        // Each holder packs one request's gathered rows into staging it advertised.
        for (link, segs, _) in &batches {
            let bytes: usize = segs.iter().map(|s| s.indices.len() * ROW_BYTES).sum();
            if bytes as u64 > self.links[*link].welcome.gather_bytes {
                let _ = self.pool.release(&pages);
                return Err(RouteError::TooLarge(bytes));
            }
        }
        let asked: Vec<(usize, usize)> = batches.iter().map(|(l, s, _)| (*l, s.len())).collect();
        let replies = self.exchange(batches);
        let mut failure = None;
        let mut late_writes_possible = false;
        for ((link, segments), reply) in asked.into_iter().zip(replies) {
            let holder = self.links[link].addr;
            let seq = self.links[link].seq;
            let statuses = reply
                .and_then(|range| self.reply_bytes(holder, range))
                .and_then(|bytes| decode_reply(holder, seq, bytes, segments).map(|(s, _)| s));
            match statuses {
                Ok(s) => {
                    if let Some(&status) = s.iter().find(|&&st| st != Status::Ok) {
                        failure.get_or_insert(RouteError::Refused { holder, status });
                    }
                }
                Err(e) => {
                    late_writes_possible = true;
                    failure.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failure {
            // Pages a late write may still land in are quarantined, not reused.
            if !late_writes_possible {
                let _ = self.pool.release(&pages);
            }
            return Err(e);
        }
        Ok(Gathered {
            pages,
            rows,
            layers: layers.to_vec(),
            transfer_us: started.elapsed().as_secs_f64() * 1e6,
        })
    }

    /// The rows gathered for `layers[layer_index]` as a paged cache (`rows` tokens).
    pub fn gathered_cache<'a>(
        &'a self,
        gathered: &'a Gathered,
        layer_index: usize,
    ) -> Result<Cache<'a>> {
        let ppl = gathered.rows.div_ceil(PAGE_TOKENS);
        let table = gathered
            .pages
            .get(layer_index * ppl..(layer_index + 1) * ppl)
            .context("layer out of range")?;
        // SAFETY: as in `fetch`: every row write of the gather has been counted and no
        // transfer into these pages is in flight while `self` is borrowed.
        let pool = unsafe { self.pool_mem.u16s(0, self.pool.bytes() / 2)? };
        Ok(Cache::paged(pool, table, gathered.rows)?)
    }

    /// Returns gathered rows' pages to the pool.
    pub fn release_gathered(&mut self, gathered: Gathered) -> Result<()> {
        Ok(self.pool.release(&gathered.pages)?)
    }

    /// Layer `layer` of a fetched chunk as a paged cache the kernels read.
    pub fn fetched_cache<'a>(&'a self, fetched: &'a Fetched, layer: usize) -> Result<Cache<'a>> {
        let ppl = fetched.tokens.div_ceil(PAGE_TOKENS);
        let table = fetched
            .pages
            .get(layer * ppl..(layer + 1) * ppl)
            .context("layer out of range")?;
        // SAFETY: as in `fetch`: no writes into the pool are in flight while `self` is borrowed.
        let pool = unsafe { self.pool_mem.u16s(0, self.pool.bytes() / 2)? };
        Ok(Cache::paged(pool, table, fetched.tokens)?)
    }

    /// Returns a fetched chunk's pages to the pool.
    pub fn release(&mut self, fetched: Fetched) -> Result<()> {
        Ok(self.pool.release(&fetched.pages)?)
    }

    /// The descriptor of the pool (for tests that play a forged holder).
    pub fn pool_desc(&self) -> &MrDesc {
        self.pool_mem.desc()
    }
}

/// Checks a reply against what was asked: magic, the request's seq, one status per segment,
/// and as many rows as the statuses promise.
fn decode_reply(
    holder: SocketAddr,
    seq: u64,
    bytes: &[u8],
    segments: usize,
) -> Result<(Vec<Status>, &[u8]), RouteError> {
    let bad = |why: &str| RouteError::BadReply {
        holder,
        why: why.to_owned(),
    };
    let header = wire::decode_reply_header(bytes).ok_or_else(|| bad("no reply header"))?;
    if header.seq != seq {
        return Err(bad("reply to another request"));
    }
    if header.status != Status::Ok {
        return Err(RouteError::Refused {
            holder,
            status: header.status,
        });
    }
    if header.statuses.len() != segments {
        return Err(bad("status count differs from the segments sent"));
    }
    let start = wire::reply_rows_offset(segments);
    let rows = bytes
        .get(start..start + header.rows * PARTIAL_ROW_BYTES)
        .ok_or_else(|| bad("rows past the reply"))?;
    Ok((header.statuses, rows))
}
