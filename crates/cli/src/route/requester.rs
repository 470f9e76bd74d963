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
use kvroute_kernels::{Backend, Cache, Partial, Rope, SpliceJob, WirePartial, splice};
use kvroute_kvstore::{ChunkEntry, ChunkId, ChunkRegistry, PAGE_BYTES, PagedPool, ROW_BYTES};
use kvroute_transport::{
    Access, CancellationToken, DoneFlag, MrDesc, OnDone, RegisteredBuffer, TransferEngine,
    TransferShape,
};

use super::holder::{recv_line, send_line};
use super::session::{Answer, Control, Hello, HolderStats, Welcome};
use super::wire::{self, QueryRows, SegmentKind, SegmentSpec, Status};

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

/// A [`Call`] whose query rows its producer writes in place ([`Requester::stage`]).
#[derive(Debug, Clone, Copy)]
pub struct StagedCall<'a> {
    /// The chunk.
    pub chunk: ChunkId,
    /// The layer.
    pub layer: u16,
    /// Query rows (576 bf16 each) the producer will write.
    pub rows: usize,
    /// A sparse selection over the chunk's tokens (chunk-local indices), or dense.
    pub sparse: Option<Sparse<'a>>,
}

/// A decode step's requests, encoded in registered staging and waiting for their query rows
/// ([`Requester::stage`]).
pub struct StagedRoute<'r> {
    requester: &'r mut Requester,
    /// Per call: its query rows.
    rows: Vec<usize>,
    /// Per call: (its request in `prepared`, its segment there), or why it cannot be sent.
    calls: Vec<Result<(usize, usize), RouteError>>,
    prepared: Vec<Prepared>,
}

impl std::fmt::Debug for StagedRoute<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedRoute")
            .field("calls", &self.calls)
            .finish_non_exhaustive()
    }
}

/// One request encoded in a link's send staging, not yet posted.
struct Prepared {
    link: usize,
    /// Where in the send staging (and the reply region) this link's request and reply are.
    staged: usize,
    len: usize,
    reply_len: usize,
    /// Per segment: the fetch-immediate arrivals it brings if the holder serves it (fetch and
    /// gather; 0 for routed segments).
    fetch_arrivals: Vec<u64>,
    /// Per segment, where its in-place query rows go in the request; or why it was not
    /// encoded.
    in_place: Result<Vec<usize>, RouteError>,
}

impl<'r> StagedRoute<'r> {
    /// Call `c`'s query rows (`rows * 576` bf16 bits as native words; the wire is
    /// little-endian and the send puts them in its order), in registered staging, for its
    /// producer to fill; `None` where the call cannot be sent (its error comes back from
    /// `route_into` or `route_wire`). Rows not written keep what staging held.
    pub fn queries_mut(&mut self, c: usize) -> Option<&mut [u16]> {
        let (b, seg) = *self.calls.get(c)?.as_ref().ok()?;
        let p = &self.prepared[b];
        let at = p.staged + p.in_place.as_ref().ok()?.get(seg)?;
        // SAFETY: the range is this call's rows inside its link's request (encoded by
        // `prepare`, in bounds of the staging); calls have disjoint rows and `&mut self`
        // makes this the only view; the link's previous write has completed (see `prepare`)
        // and no peer writes send staging (registered local only).
        unsafe { self.requester.send.u16s_mut(at, self.rows[c] * D_QK) }.ok()
    }

    /// Sends every request and decodes the replies into `out` (one partial per staged call,
    /// reused as in [`Requester::route_into`]).
    ///
    /// # Panics
    /// If `out` has not one partial per staged call.
    pub fn route_into(self, out: &mut [Partial]) -> Vec<Result<(), RouteError>> {
        assert_eq!(self.calls.len(), out.len(), "one partial per call");
        let routed = self.route_wire();
        let started = Instant::now();
        let mut results = Vec::with_capacity(out.len());
        for (c, part) in out.iter_mut().enumerate() {
            results.push(routed.rows(c).and_then(|(rows, holder)| {
                part.read_wire(rows).map_err(|e| RouteError::BadReply {
                    holder,
                    why: e.to_string(),
                })
            }));
        }
        routed.requester.codec.decode_us += started.elapsed().as_secs_f64() * 1e6;
        results
    }

    /// Sends every request and waits for the replies, leaving each call's partial rows where
    /// they landed, in their wire encoding (bf16 `o`, f32 `m`, `l`): what a merge that reads
    /// bf16 rows ([`kvroute_kernels::merge_wire`]) consumes with no decode pass. The reply
    /// headers are checked here, each partial's `m` and `l` by [`Routed::partial`], and `o`
    /// by whoever reads it (the merge, [`kvroute_kernels::Partial::read_wire`]).
    pub fn route_wire(self) -> Routed<'r> {
        let Self {
            requester,
            rows,
            calls,
            prepared,
        } = self;
        if cfg!(target_endian = "big") {
            // `queries_mut` hands out native words; the wire is little-endian.
            for (c, at) in calls.iter().enumerate() {
                let Ok((b, seg)) = at else { continue };
                let p = &prepared[*b];
                let Ok(offsets) = &p.in_place else { continue };
                let start = p.staged + offsets[*seg];
                // SAFETY: as in `queries_mut`; no other view lives now.
                if let Ok(words) = unsafe { requester.send.u16s_mut(start, rows[c] * D_QK) } {
                    words.iter_mut().for_each(|w| *w = w.to_le());
                }
            }
        }
        let replies = requester.send(&prepared);
        let started = Instant::now();
        // Per request: the rows of each of its segments, in order (from the calls).
        let mut seg_rows: Vec<Vec<usize>> = prepared
            .iter()
            .map(|p| vec![0; p.in_place.as_ref().map_or(0, Vec::len)])
            .collect();
        for (c, at) in calls.iter().enumerate() {
            if let Ok((b, seg)) = at {
                seg_rows[*b][*seg] = rows[c];
            }
        }
        // Per request: its segment statuses, and where its rows are in the reply region.
        let decoded: Vec<Result<ReplyRows, RouteError>> = prepared
            .iter()
            .zip(replies)
            .zip(&seg_rows)
            .map(|((p, reply), segs)| {
                let l = &requester.links[p.link];
                let (holder, seq) = (l.addr, l.seq);
                let (offset, len) = reply?;
                let bytes = requester.reply_bytes(holder, (offset, len))?;
                let (statuses, rows) = decode_reply(holder, seq, bytes, segs.len())?;
                let start = offset + wire::reply_rows_offset(segs.len());
                Ok((statuses, start, rows.len()))
            })
            .collect();
        let firsts: Vec<Vec<usize>> = seg_rows
            .iter()
            .map(|segs| wire::reply_row_layout(segs).0)
            .collect();
        let ranges = calls
            .into_iter()
            .enumerate()
            .map(|(c, at)| {
                let (b, seg) = at?;
                let holder = requester.links[prepared[b].link].addr;
                let (statuses, start, len) = decoded[b].as_ref().map_err(Clone::clone)?;
                if statuses[seg] != Status::Ok {
                    return Err(RouteError::Refused {
                        holder,
                        status: statuses[seg],
                    });
                }
                // Every segment's rows are at the place the request fixed, served or not
                // (`wire::reply_row_layout`).
                let from = firsts[b][seg] * PARTIAL_ROW_BYTES;
                let n = rows[c] * PARTIAL_ROW_BYTES;
                if from + n > *len {
                    return Err(RouteError::BadReply {
                        holder,
                        why: "fewer rows than asked for".into(),
                    });
                }
                Ok((start + from, n, holder))
            })
            .collect();
        requester.codec.decode_us += started.elapsed().as_secs_f64() * 1e6;
        Routed { requester, ranges }
    }
}

/// A reply's segment statuses, where its rows start in the reply region, and their bytes.
type ReplyRows = (Vec<Status>, usize, usize);

/// What a [`StagedRoute`] brought back: each call's partial rows where they landed, in their
/// wire encoding, or why the call failed. The rows stay valid (and unwritten) while this
/// lives: it holds the requester, and a holder writes a link's reply range only in answer to
/// the next request.
pub struct Routed<'r> {
    requester: &'r mut Requester,
    /// Per call: (offset, length) of its rows in the reply region, and the holder that wrote
    /// them.
    ranges: Vec<Result<(usize, usize, SocketAddr), RouteError>>,
}

impl std::fmt::Debug for Routed<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routed")
            .field("ranges", &self.ranges)
            .finish_non_exhaustive()
    }
}

impl Routed<'_> {
    /// Calls routed.
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    /// Whether no call was routed.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Call `c`'s partial rows (`m` and `l` checked), or why it failed.
    ///
    /// # Panics
    /// If `c` is not a call of this route.
    pub fn partial(&self, c: usize) -> Result<WirePartial<'_>, RouteError> {
        let (bytes, holder) = self.rows(c)?;
        WirePartial::new(bytes).map_err(|e| RouteError::BadReply {
            holder,
            why: e.to_string(),
        })
    }

    /// Call `c`'s rows and the holder that wrote them.
    fn rows(&self, c: usize) -> Result<(&[u8], SocketAddr), RouteError> {
        let (offset, len, holder) = self.ranges[c].clone()?;
        Ok((self.requester.reply_bytes(holder, (offset, len))?, holder))
    }
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
        let mut requester = Self {
            engine,
            config,
            send,
            replies,
            pool_mem,
            pool,
            links,
            registry,
            codec: CodecTimes::default(),
        };
        // One small ping per holder opens the data path both ways now, not on the first
        // route or fetch: providers connect lazily (`tcp;ofi_rxm` set up its connection in
        // the first fetch's 30 ms; `shm` mapped its peer in the first fetch's 5.6 ms).
        for (holder, addr) in holders.iter().enumerate() {
            requester
                .ping(holder, wire::PING_HEADER, 64, wire::Pong::Staged)
                .with_context(|| format!("opening the data path to {addr}"))?;
        }
        Ok(requester)
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

    /// Holder `holder`'s counters once they count at least `requests` requests, or as they
    /// are after the configured timeout. A holder adds a batch to its counters just after
    /// sending the batch's replies, so a read right after a reply lands can see them without
    /// it.
    pub fn holder_stats_counting(&mut self, holder: usize, requests: u64) -> Result<HolderStats> {
        let deadline = Instant::now() + self.config.timeout;
        loop {
            let stats = self.holder_stats(holder)?;
            if stats.requests >= requests || Instant::now() >= deadline {
                return Ok(stats);
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// The transport's raw write round trip to holder `holder` (an index into the holders
    /// given to [`Requester::connect`]): `request_len` bytes out into its inbox slot and
    /// `reply_len` bytes back into the reply region, each one write with an immediate, through
    /// the same engines, buffers and serving thread as [`Requester::route`] but with no
    /// encoding, parsing or kernel; the holder sends the pong from `pong`. Route's round trip
    /// minus this, minus the holder's kernel time, is the protocol's host overhead (what
    /// `kvroute sweep` reports).
    pub fn ping(
        &mut self,
        holder: usize,
        request_len: usize,
        reply_len: usize,
        pong: wire::Pong,
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
            .map(|buf| wire::encode_ping(buf, reply_len as u32, staged as u64, pong))
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

    /// The holder (an index into the holders given to [`Requester::connect`]) that a route
    /// of `chunk` goes to now: the first live one holding it.
    pub fn holder_for(&self, chunk: ChunkId) -> Result<usize, RouteError> {
        self.link_for(chunk)
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

    /// Sends one request of `segments` to each `link` and waits for its reply and, for its
    /// fetch and gather segments the holder served, their arrivals of the link's fetch
    /// immediate (the third element: per segment, the arrivals it brings if served). Returns
    /// where each reply landed: (offset, length) in `replies`.
    fn exchange(
        &mut self,
        batches: Vec<(usize, Vec<SegmentSpec<'_>>, Vec<u64>)>,
    ) -> Vec<Result<(usize, usize), RouteError>> {
        let prepared = self.prepare(batches);
        self.send(&prepared)
    }

    /// Encodes each batch's request into its link's send staging (the first half of
    /// [`Requester::exchange`]); [`QueryRows::InPlace`] rows are left for the caller to write.
    fn prepare(&mut self, batches: Vec<(usize, Vec<SegmentSpec<'_>>, Vec<u64>)>) -> Vec<Prepared> {
        let mut out = Vec::with_capacity(batches.len());
        for (link, segments, fetch_arrivals) in batches {
            let l = &mut self.links[link];
            l.seq += 1;
            let len = wire::request_len(&segments);
            let reply_len = wire::reply_len(segments.len(), wire::reply_rows(&segments));
            let limit = self.config.link_bytes.min(l.welcome.slot_bytes as usize);
            let staged = link * self.config.link_bytes;
            let encoded = if len > limit
                || reply_len > self.config.link_bytes.min(l.welcome.reply_bytes as usize)
            {
                Err(RouteError::TooLarge(len.max(reply_len)))
            } else {
                let encode_started = Instant::now();
                // SAFETY: this link's staging range is read only by this link's request write,
                // and the previous one has completed (its completion was waited for; a link
                // whose wait failed is dead and never sends again). No peer writes it (it is
                // registered local only). In bounds: `len <= link_bytes` (checked).
                let encoded = unsafe { self.send.bytes_mut(staged, len) }
                    .map(|buf| {
                        wire::encode_request_into(
                            buf,
                            l.seq,
                            staged as u64,
                            self.config.scale,
                            &segments,
                        )
                    })
                    .map_err(|e| RouteError::HolderFailed {
                        holder: l.addr,
                        why: e.to_string(),
                    });
                self.codec.encode_us += encode_started.elapsed().as_secs_f64() * 1e6;
                encoded
            };
            out.push(Prepared {
                link,
                staged,
                len,
                reply_len,
                fetch_arrivals,
                in_place: encoded,
            });
        }
        out
    }

    /// Posts each prepared request and waits for every reply (the second half of
    /// [`Requester::exchange`]).
    fn send(&mut self, prepared: &[Prepared]) -> Vec<Result<(usize, usize), RouteError>> {
        let deadline = Instant::now() + self.config.timeout;
        let mut waits = Vec::new();
        let mut out: Vec<Result<(usize, usize), RouteError>> = Vec::new();
        for p in prepared {
            if let Err(e) = &p.in_place {
                out.push(Err(e.clone()));
                waits.push(None);
                continue;
            }
            let l = &self.links[p.link];
            // The reply lands where the request was staged, in the reply region.
            let reply_offset = p.staged as u64;
            let token = CancellationToken::new();
            let reply_flag = DoneFlag::new();
            let arrivals = self.engine.expected_arrivals(TransferShape::SingleWrite {
                len: p.reply_len as u64,
            });
            self.engine.expect_imm_count(
                l.reply_imm,
                arrivals,
                OnDone::flag(&reply_flag).cancellable(&token),
            );
            let shards = self
                .engine
                .expected_arrivals(TransferShape::SingleWrite { len: p.len as u64 });
            let imm = wire::request_imm(l.welcome.session, shards);
            let sent_flag = DoneFlag::new();
            let submitted = self.engine.submit_single_write(
                p.len as u64,
                Some(imm),
                (self.send.handle(), p.staged as u64),
                (&l.welcome.inbox, l.welcome.slot_offset),
                OnDone::flag(&sent_flag),
            );
            match submitted {
                Ok(()) => {
                    out.push(Ok((reply_offset as usize, p.reply_len)));
                    waits.push(Some((sent_flag, reply_flag, token)));
                }
                Err(e) => {
                    token.cancel();
                    out.push(Err(RouteError::HolderFailed {
                        holder: l.addr,
                        why: e.to_string(),
                    }));
                    waits.push(None);
                }
            }
        }
        for (i, wait) in waits.into_iter().enumerate() {
            let Some((sent, reply, token)) = wait else {
                continue;
            };
            let link = prepared[i].link;
            let failure = match wait_all(&self.engine, &[&sent, &reply], deadline, self.config.spin)
            {
                Err(which) => Some(format!(
                    "no {} within {:?}",
                    ["send completion", "reply"][which],
                    self.config.timeout
                )),
                Ok(()) => match sent.result() {
                    Some(Err(e)) => Some(format!("request write failed: {e}")),
                    _ => self
                        .await_fetch_writes(&prepared[i], deadline, &token)
                        .err(),
                },
            };
            if let Some(why) = failure {
                token.cancel();
                out[i] = Err(RouteError::HolderFailed {
                    holder: self.links[link].addr,
                    why,
                });
                self.kill(link);
            }
        }
        out
    }

    /// Waits for the fetch-immediate arrivals of the segments of `p` that the holder served,
    /// as its reply (landed) says. A holder submits all of a served fetch or gather segment's
    /// writes before it replies and none of a refused one's, so a refused segment costs
    /// nothing: the expectation is for exactly the writes that were sent, and no arrival is
    /// left over to be counted toward a later fetch. A reply that cannot be read, or that says
    /// some writes of a segment may have gone out ([`Status::TransferFailed`]), leaves the count
    /// unknown: an error, and the caller gives the link up.
    fn await_fetch_writes(
        &self,
        p: &Prepared,
        deadline: Instant,
        token: &CancellationToken,
    ) -> Result<(), String> {
        if p.fetch_arrivals.iter().all(|&n| n == 0) {
            return Ok(());
        }
        let l = &self.links[p.link];
        // SAFETY: as in `reply_bytes`: the reply's immediate has been counted.
        let bytes = unsafe { self.replies.bytes(p.staged, p.reply_len) }
            .map_err(|e| format!("reading the reply: {e}"))?;
        let header = wire::decode_reply_header(bytes).filter(|h| h.seq == l.seq);
        let expected = wire::served_arrivals(header.as_ref(), &p.fetch_arrivals)?;
        if expected == 0 {
            return Ok(());
        }
        let flag = DoneFlag::new();
        self.engine.expect_imm_count(
            l.fetch_imm,
            expected,
            OnDone::flag(&flag).cancellable(token),
        );
        wait_all(&self.engine, &[&flag], deadline, self.config.spin)
            .map_err(|_| format!("no fetch pages within {:?}", self.config.timeout))
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
    /// The query rows are copied into registered staging; [`Requester::stage`] lets their
    /// producer write them there instead.
    ///
    /// # Panics
    /// If `out` and `calls` differ in length.
    pub fn route_into(
        &mut self,
        calls: &[Call<'_>],
        out: &mut [Partial],
    ) -> Vec<Result<(), RouteError>> {
        assert_eq!(calls.len(), out.len(), "one partial per call");
        let mut results = self.stage_copied(calls).route_into(out);
        for (r, call) in results.iter_mut().zip(calls) {
            if matches!(r, Err(RouteError::TooLarge(0))) {
                *r = Err(RouteError::TooLarge(call.queries.len()));
            }
        }
        results
    }

    /// [`Requester::stage`] with each call's query rows copied into its staging (the copy is
    /// timed as encoding): for callers that hold the rows already. A call whose rows are not
    /// whole 576-wide rows is staged as no rows, which `stage` refuses (`TooLarge(0)`).
    pub fn stage_copied<'r>(&'r mut self, calls: &[Call<'_>]) -> StagedRoute<'r> {
        let plan: Vec<StagedCall<'_>> = calls
            .iter()
            .map(|c| StagedCall {
                chunk: c.chunk,
                layer: c.layer,
                rows: if c.queries.len().is_multiple_of(D_QK) {
                    c.queries.len() / D_QK
                } else {
                    0
                },
                sparse: c.sparse,
            })
            .collect();
        let mut staged = self.stage(&plan);
        let started = Instant::now();
        for (c, call) in calls.iter().enumerate() {
            if let Some(rows) = staged.queries_mut(c) {
                rows.copy_from_slice(call.queries);
            }
        }
        staged.requester.codec.encode_us += started.elapsed().as_secs_f64() * 1e6;
        staged
    }

    /// Prepares a decode step's calls for their producer to write the query rows in place:
    /// groups them per holder (one request each), encodes every request's header, segment
    /// table and indices into registered staging, and leaves the rows for
    /// [`StagedRoute::queries_mut`]. Nothing is sent until [`StagedRoute::route_into`] or
    /// [`StagedRoute::route_wire`]; dropping the [`StagedRoute`] sends nothing.
    ///
    /// This is how the queries reach the NIC without a copy (paper 000 section 5.3's first
    /// reduction, carried to the producer): a model writes its query projection's output
    /// straight into the slices `queries_mut` hands out.
    pub fn stage<'r>(&'r mut self, calls: &[StagedCall<'_>]) -> StagedRoute<'r> {
        let mut calls_at: Vec<Result<(usize, usize), RouteError>> = Vec::new();
        // link -> the calls bound to it, in order.
        let mut by_link: Vec<(usize, Vec<usize>)> = Vec::new();
        for (c, call) in calls.iter().enumerate() {
            calls_at.push(Err(RouteError::TooLarge(0)));
            if call.rows == 0 {
                continue;
            }
            match self.link_for(call.chunk) {
                Ok(link) => match by_link.iter_mut().find(|(l, _)| *l == link) {
                    Some((_, v)) => v.push(c),
                    None => by_link.push((link, vec![c])),
                },
                Err(e) => calls_at[c] = Err(e),
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
                            queries: QueryRows::InPlace(call.rows),
                            indices,
                            pages: &[],
                        }
                    })
                    .collect::<Vec<_>>();
                let none = vec![0; segs.len()];
                (*link, segs, none)
            })
            .collect();
        let prepared = self.prepare(batches);
        for (b, (_, members)) in by_link.iter().enumerate() {
            for (seg, &c) in members.iter().enumerate() {
                calls_at[c] = match &prepared[b].in_place {
                    Ok(_) => Ok((b, seg)),
                    Err(e) => Err(e.clone()),
                };
            }
        }
        StagedRoute {
            requester: self,
            rows: calls.iter().map(|c| c.rows).collect(),
            calls: calls_at,
            prepared,
        }
    }

    /// Fetches `chunk` from a live holder into the pool (one write per run of consecutive
    /// pool pages, [`wire::fetch_runs`]; one immediate expectation for the whole pull) and re-rotates it in place to `to` (the requester's
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
            queries: QueryRows::Copied(&[]),
            indices: &[],
            pages: &pages,
        };
        let arrivals: u64 = wire::fetch_runs(&pages)
            .map(|(_, count)| {
                self.engine.expected_arrivals(TransferShape::SingleWrite {
                    len: (count * PAGE_BYTES) as u64,
                })
            })
            .sum();
        let reply = self.exchange(vec![(link, vec![seg], vec![arrivals])]).pop();
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
                // Once the exchange returned, every write the holder sent has been counted
                // (`await_fetch_writes`); only a link given up may still have writes in
                // flight, and pages they may land in are quarantined, not reused.
                if !matches!(e, RouteError::HolderFailed { .. }) {
                    let _ = self.pool.release(&pages);
                }
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
        // link -> (segments, per segment the arrivals of its fetch immediate: one write per
        // page it touches, as the holder packs them, each maybe sharded over NICs)
        let mut batches: Vec<(usize, Vec<SegmentSpec<'_>>, Vec<u64>)> = Vec::new();
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
                        queries: QueryRows::Copied(&[]),
                        indices: p.tokens,
                        pages: &table[first_page..end_page],
                    };
                    match batches.iter_mut().find(|(b, _, _)| *b == link) {
                        Some((_, segs, counts)) => {
                            segs.push(seg);
                            counts.push(arrivals);
                        }
                        None => batches.push((link, vec![seg], vec![arrivals])),
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
                    // As in `fetch`: only a link given up may still have writes in flight.
                    late_writes_possible |= matches!(e, RouteError::HolderFailed { .. });
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
