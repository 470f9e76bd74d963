//! The requester: the dispatcher that routes query rows to holders and merges what comes back,
//! and fetches chunks into its own paged pool.
//!
//! [`Requester::route`] takes every call of a decode step at once, groups the calls bound to
//! the same holder into one inbox write (paper 000 section 5.3's third reduction), waits for
//! every reply with a deadline, and returns one result per call. A holder that does not answer
//! in time, whose writes fail, or whose control connection closes while it is awaited (its
//! process died), is marked dead and its calls fail with [`RouteError::HolderFailed`];
//! calling again sends them to the chunk's next replica.

use std::collections::BTreeMap;
use std::io::BufReader;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_kvstore::directory::HolderRecord;
use kvroute_kvstore::{ChunkEntry, ChunkId, ChunkRegistry, DirectoryView, PAGE_BYTES, PagedPool};
use kvroute_transport::{
    CancellationToken, DoneFlag, GrantedBuffer, MrDesc, NetAddr, OnDone, RegisteredBuffer, Staging,
    TransferEngine, TransferShape,
};

use crate::control::{recv_line, send_line};
use crate::error::{RemoteError, RouteError};
use crate::session::{Control, Hello, HolderStats, Welcome};
use crate::wire;

mod directory;
mod exchange;
mod fetch;
mod route;
mod wait;

use wait::closed;
pub(crate) use wait::{Unfinished, wait_all};

pub use directory::{DirectorySync, UNREACHABLE_FIRST_WAIT, UNREACHABLE_LONGEST_WAIT};
pub use fetch::{Fetched, GatherPart, Gathered};
pub use route::{Call, Routed, Sparse, StagedCall, StagedRoute};

/// How a requester is set up.
#[derive(Debug, Clone, PartialEq)]
pub struct RequesterConfig {
    /// How long a route or fetch waits for a holder before declaring it failed.
    pub timeout: Duration,
    /// Bytes of the send staging and of the reply region, per holder.
    pub link_bytes: usize,
    /// Pages (64 tokens x 1152 B each) of the pool fetches land in.
    pub pool_pages: u32,
    /// The softmax scale sent with every request.
    pub scale: f32,
    /// How long a wait for a reply polls (yielding the core) before it sleeps in 50 us
    /// steps: latency against CPU left to others.
    pub spin: Duration,
    /// The most sessions with holders this requester holds at once: those given to
    /// [`Requester::connect`] plus those added later by [`Requester::add_holder`] (a holder
    /// found in a directory). Each takes `link_bytes` of send staging (reserved at connect)
    /// and of reply region; a session that ends gives both back, so holders that come and go
    /// never use the room up. 0: as many as the holders given to `connect`.
    pub max_holders: usize,
}

impl RequesterConfig {
    /// Defaults for `scale`: 5 s timeout, 8 MiB per holder link, a 512-page pool,
    /// 1 ms of polling per wait, no holders added after connect.
    pub fn new(scale: f32) -> Self {
        Self {
            timeout: Duration::from_secs(5),
            link_bytes: 8 << 20,
            pool_pages: 512,
            scale,
            spin: Duration::from_millis(1),
            max_holders: 0,
        }
    }
}

/// A session with a holder, by index: the index stays the holder's for the requester's life,
/// what the session holds only while it works.
struct Link {
    addr: SocketAddr,
    welcome: Welcome,
    reply_imm: u32,
    fetch_imm: u32,
    seq: u64,
    /// While the session works (no failed write or missed reply, control connection up):
    /// what it holds. Released when it ends ([`Requester::kill`]).
    io: Option<LinkIo>,
    /// Offered by the directory followed (always, without one).
    listed: bool,
}

/// What a working session holds, all of it released when the session ends, so that a
/// requester following holders that come and go holds only what its live sessions need.
struct LinkIo {
    control: TcpStream,
    reader: BufReader<TcpStream>,
    /// The region this holder's replies land in, registered for this link alone: its
    /// descriptor goes to this holder only, so no other holder can write an answer there
    /// (each region's key is its own, and unguessable where the transport draws keys).
    /// Dropped (deregistered) with the session, so a late write of its holder lands nowhere.
    reply: RegisteredBuffer,
    /// Which `link_bytes` range of the send staging its requests are written in: one a live
    /// session alone uses, taken again by a later one once this one ends.
    stage: usize,
    /// The reservation of the link's immediates, given back with the session (its holder's
    /// late writes cannot land: their regions and grants are gone).
    _imms: LinkImms,
}

impl Link {
    /// The session works.
    fn alive(&self) -> bool {
        self.io.is_some()
    }

    /// Routes and fetches may go to it.
    fn usable(&self) -> bool {
        self.alive() && self.listed
    }

    /// Its control connection, while the session works.
    fn control(&self) -> Option<&TcpStream> {
        self.io.as_ref().map(|io| &io.control)
    }

    /// Whether it is the session with the holder `record` describes (same control and
    /// engine address).
    fn serves(&self, record: &HolderRecord) -> bool {
        self.addr == record.control && self.welcome.holder == record.engine
    }
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
    send: Staging,
    pool_mem: GrantedBuffer,
    pool: PagedPool,
    links: Vec<Link>,
    /// The most links this requester opens (its staging and reply regions hold this many).
    capacity: usize,
    registry: ChunkRegistry,
    /// Chunks whose routes and fetches go to a chosen replica ([`Requester::prefer`]) rather
    /// than to the first live one.
    preferred: BTreeMap<ChunkId, usize>,
    /// Control addresses of registered holders whose session could not be opened: not tried
    /// again before the instant, the wait doubling at each failure (see `sync_with`).
    unreachable: BTreeMap<SocketAddr, (std::time::Instant, Duration)>,
    /// Sessions being opened for the directory's records ([`Requester::sync_in_background`]).
    opening: Vec<directory::Opening>,
    /// The last directory view followed.
    view: Option<Arc<DirectoryView>>,
    codec: CodecTimes,
    /// Copies of the last exchange's replies, out of the regions their holders write
    /// ([`Requester::exchange`] returns where each lies here).
    landed: Vec<u8>,
}

impl std::fmt::Debug for Requester {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Requester")
            .field("holders", &self.links.len())
            .field("chunks", &self.registry.len())
            .finish_non_exhaustive()
    }
}

/// A link's two immediate values, reserved in the engine while the link is being opened and
/// for as long as its session works; released when dropped.
struct LinkImms {
    engine: TransferEngine,
    reply: u32,
    fetch: u32,
}

impl LinkImms {
    fn reserve(engine: &TransferEngine) -> Self {
        Self {
            engine: engine.clone(),
            reply: engine.reserve_imm(),
            fetch: engine.reserve_imm(),
        }
    }
}

impl Drop for Requester {
    fn drop(&mut self) {
        // Sessions still opening in the background hold the engine; see
        // `Requester::sync_in_background`.
        for opening in self.opening.drain(..) {
            opening.cancel();
        }
    }
}

impl Drop for LinkImms {
    fn drop(&mut self) {
        self.engine.release_imm(self.reply);
        self.engine.release_imm(self.fetch);
    }
}

/// A session opened and proven with a holder whose welcome the caller's check accepted, not
/// yet a link: no index, nothing registered.
struct Opened {
    control: TcpStream,
    reader: BufReader<TcpStream>,
    addr: SocketAddr,
    welcome: Welcome,
    reply: RegisteredBuffer,
    imms: LinkImms,
}

/// Opens and proves a session with the holder at `addr` for a requester of `engine` whose
/// fetches land in `pool`, keeping it only if `listed` accepts the engine address its welcome
/// names (otherwise it is closed here: [`RemoteError::UnlistedEngine`]). Touches nothing of
/// the requester's but the engine, so several can run at once ([`Requester::sync_with`]).
fn open_session(
    engine: &TransferEngine,
    (config, pool): (&RequesterConfig, &MrDesc),
    addr: SocketAddr,
    listed: &(dyn Fn(&NetAddr) -> bool + Sync),
) -> Result<Opened, RemoteError> {
    let control = connect_control(addr, config.timeout)?;
    open_session_over(engine, (control, addr), (config, pool), listed)
}

/// The control connection to the holder at `addr`, within `timeout`.
fn connect_control(addr: SocketAddr, timeout: Duration) -> Result<TcpStream, RemoteError> {
    TcpStream::connect_timeout(&addr, timeout).map_err(|source| RemoteError::Unreachable {
        holder: addr,
        source,
    })
}

/// [`open_session`] over a control connection already made.
fn open_session_over(
    engine: &TransferEngine,
    (control, addr): (TcpStream, SocketAddr),
    (config, pool): (&RequesterConfig, &MrDesc),
    listed: &(dyn Fn(&NetAddr) -> bool + Sync),
) -> Result<Opened, RemoteError> {
    let io = |source| RemoteError::Control { peer: addr, source };
    control.set_nodelay(true).map_err(io)?;
    control
        .set_read_timeout(Some(config.timeout.max(Duration::from_secs(1))))
        .map_err(io)?;
    let mut reader = BufReader::new(control.try_clone().map_err(io)?);
    let mut writer = control.try_clone().map_err(io)?;
    // Reserved in the engine, so never another link's or requester's (requesters may share
    // an engine), drawn at random, so a holder told its own cannot aim at another link's,
    // and counted even while a flood of stray values fills the engine's counter.
    let imms = LinkImms::reserve(engine);
    let reply = engine.alloc_mr(config.link_bytes)?;
    let hello = Hello {
        addr: engine.main_address(),
        reply: reply.desc().clone(),
        pool: Some(pool.clone()),
        reply_imm: imms.reply,
        fetch_imm: imms.fetch,
    };
    let welcome = crate::session::open(engine, (&mut writer, &mut reader), &hello, config.timeout)?;
    if !listed(&welcome.holder) {
        // Dropped here: the session closes and no link is spent on it.
        return Err(RemoteError::UnlistedEngine { holder: addr });
    }
    Ok(Opened {
        control,
        reader,
        addr,
        welcome,
        reply,
        imms,
    })
}

impl Requester {
    /// Opens a session with every holder in `holders` and builds the chunk registry from what
    /// they serve. A holder that is busy or unreachable is an error. `holders` may be empty
    /// when `config.max_holders` leaves room for holders added later.
    pub fn connect(
        engine: TransferEngine,
        holders: &[SocketAddr],
        config: RequesterConfig,
    ) -> Result<Self, RemoteError> {
        let capacity = holders.len().max(config.max_holders);
        if capacity == 0 || capacity > 1 << 12 {
            return Err(RemoteError::Config(
                "a requester needs 1 to 4096 holders".into(),
            ));
        }
        if config.link_bytes < wire::REQUEST_HEADER || config.timeout.is_zero() {
            return Err(RemoteError::Config(
                "link_bytes must hold a request header and the timeout must be positive".into(),
            ));
        }
        let link_total = config
            .link_bytes
            .checked_mul(capacity)
            .ok_or_else(|| RemoteError::Config("link buffers larger than memory".into()))?;
        let send = engine.alloc_staging(link_total)?;
        let pool = PagedPool::new(config.pool_pages.max(1), PAGE_BYTES)?;
        // No peer writes through the pool's own registration: each fetch and gather grants
        // its holder just the bytes it fills, for as long as it runs.
        let pool_mem = engine.alloc_granted(pool.bytes())?;
        let mut requester = Self {
            engine,
            config,
            send,
            pool_mem,
            pool,
            links: Vec::with_capacity(capacity),
            capacity,
            registry: ChunkRegistry::new(),
            preferred: BTreeMap::new(),
            unreachable: BTreeMap::new(),
            opening: Vec::new(),
            view: None,
            codec: CodecTimes::default(),
            landed: Vec::new(),
        };
        for &addr in holders {
            requester.open_link(addr, &|_| true)?;
        }
        for holder in 0..holders.len() {
            requester.open_data_path(holder)?;
        }
        Ok(requester)
    }

    /// Opens a session with one more holder (found after connect, in a directory) and adds
    /// the chunks it serves to the registry, after the replicas already known; returns its
    /// index (a new one: indices are never reused, so an index names one session for the
    /// requester's life). Refused when `config.max_holders` sessions are working, when its
    /// session fails, or when a chunk it serves contradicts the registered copy (the holder
    /// is then not used).
    pub fn add_holder(&mut self, addr: SocketAddr) -> Result<usize, RemoteError> {
        self.add_holder_of(addr, &|_| true)
    }

    /// [`Requester::add_holder`], keeping the session only if `listed` accepts the engine
    /// address its welcome names: otherwise it is closed before it takes a link
    /// ([`RemoteError::UnlistedEngine`]).
    fn add_holder_of(
        &mut self,
        addr: SocketAddr,
        listed: &(dyn Fn(&NetAddr) -> bool + Sync),
    ) -> Result<usize, RemoteError> {
        let holder = self.open_link(addr, listed)?;
        if let Err(e) = self.open_data_path(holder) {
            self.kill(holder);
            return Err(e);
        }
        Ok(holder)
    }

    /// The session with `addr` as link `links.len()`, its chunks registered, if `listed`
    /// accepts the engine its welcome names.
    fn open_link(
        &mut self,
        addr: SocketAddr,
        listed: &(dyn Fn(&NetAddr) -> bool + Sync),
    ) -> Result<usize, RemoteError> {
        self.room_for(addr)?;
        let opened = open_session(
            &self.engine,
            (&self.config, self.pool_mem.desc()),
            addr,
            listed,
        )?;
        self.adopt(opened)
    }

    /// A staging range no working session uses, or an error when every one is taken.
    fn room_for(&self, addr: SocketAddr) -> Result<usize, RemoteError> {
        let taken: Vec<usize> = self
            .links
            .iter()
            .filter_map(|l| l.io.as_ref().map(|io| io.stage))
            .collect();
        (0..self.capacity)
            .find(|stage| !taken.contains(stage))
            .ok_or_else(|| {
                RemoteError::Config(format!(
                    "no room for holder {addr}: {} sessions working, the most this requester holds at once",
                    taken.len()
                ))
            })
    }

    /// Makes `opened` link `links.len()` and registers its chunks: all of them or none (a
    /// chunk that contradicts the registered copy refuses the holder, and its session
    /// closes).
    fn adopt(&mut self, opened: Opened) -> Result<usize, RemoteError> {
        let stage = self.room_for(opened.addr)?;
        let mut registry = self.registry.clone();
        for entry in &opened.welcome.chunks {
            registry.register(entry.clone())?;
        }
        self.registry = registry;
        let Opened {
            control,
            reader,
            addr,
            welcome,
            reply,
            imms,
        } = opened;
        self.links.push(Link {
            addr,
            reply_imm: imms.reply,
            fetch_imm: imms.fetch,
            welcome,
            seq: 0,
            io: Some(LinkIo {
                control,
                reader,
                reply,
                stage,
                _imms: imms,
            }),
            listed: true,
        });
        Ok(self.links.len() - 1)
    }

    /// One small ping opens the data path both ways now, not on the first route or fetch:
    /// providers connect lazily (`tcp;ofi_rxm` set up its connection in the first fetch's
    /// 30 ms; `shm` mapped its peer in the first fetch's 5.6 ms).
    fn open_data_path(&mut self, holder: usize) -> Result<(), RemoteError> {
        let addr = self.links[holder].addr;
        self.ping(holder, wire::PING_HEADER, 64, wire::Pong::Staged)
            .map(|_| ())
            .map_err(|e| match e {
                RouteError::HolderFailed { why, .. } => RouteError::HolderFailed {
                    holder: addr,
                    why: format!("opening the data path: {why}"),
                },
                other => other,
            })
            .map_err(RemoteError::from)
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
        self.links.iter().filter(|l| l.usable()).count()
    }

    /// A holder's counters, over its control connection.
    pub fn holder_stats(&mut self, holder: usize) -> Result<HolderStats, RemoteError> {
        let link = self
            .links
            .get_mut(holder)
            .ok_or(RemoteError::NoSuchHolder(holder))?;
        let addr = link.addr;
        let io = link.io.as_mut().ok_or_else(|| RemoteError::Control {
            peer: addr,
            source: std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                "the session with this holder has ended",
            ),
        })?;
        send_line(&mut io.control, addr, &Control::Stats)?;
        recv_line(&mut io.reader, addr, 1 << 20)
    }

    /// Holder `holder`'s counters once they count at least `requests` requests, or as they
    /// are after the configured timeout. A holder counts a batch (times included) under the
    /// lock it sends the batch's replies in, so a read made after a reply landed already
    /// counts that reply's batch; this is for readers that did not see the replies land (the
    /// requests of other requesters or processes).
    pub fn holder_stats_counting(
        &mut self,
        holder: usize,
        requests: u64,
    ) -> Result<HolderStats, RemoteError> {
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
            .get_mut(holder)
            .ok_or(RouteError::NoHolder(ChunkId(u32::MAX)))?;
        // Pings and requests share the sequence numbers the holder admits once each.
        l.seq += 1;
        let l = &*l;
        let Some(io) = &l.io else {
            return Err(RouteError::HolderFailed {
                holder: l.addr,
                why: "marked dead earlier".into(),
            });
        };
        let limit = link_bytes.min(l.welcome.slot_bytes as usize);
        let reply_limit = link_bytes.min(l.welcome.reply_bytes as usize);
        if !(wire::PING_HEADER..=limit).contains(&request_len) {
            return Err(RouteError::TooLarge(request_len));
        }
        if !(1..=reply_limit).contains(&reply_len) {
            return Err(RouteError::TooLarge(reply_len));
        }
        let (addr, reply_imm) = (l.addr, l.reply_imm);
        let staged = io.stage * link_bytes;
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
        let submitted = self
            .send
            .bytes_mut_within(staged, wire::PING_HEADER, self.config.timeout)
            .map(|mut buf| {
                let ping = wire::Ping {
                    reply_len: reply_len as u32,
                    // The start of this link's own reply region.
                    reply_offset: 0,
                    pong,
                    token: l.welcome.token,
                    seq: l.seq,
                };
                wire::encode_ping(&mut buf, &ping);
            })
            .map_err(|e| e.to_string())
            .and_then(|()| {
                self.send
                    .submit_write(
                        (staged, request_len),
                        Some(wire::ping_imm(l.welcome.session, shards)),
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
                Some(&io.control),
            ) {
                Err(e) => Some(e.describe(&["ping completion", "pong"], self.config.timeout)),
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

    /// The time spent converting bytes since connecting (see [`CodecTimes`]; the `measure`
    /// feature).
    #[cfg(feature = "measure")]
    pub fn codec_times(&self) -> CodecTimes {
        self.codec
    }

    /// The free pages of the pool (for leak checks).
    pub fn free_pool_pages(&self) -> usize {
        self.pool.free_pages()
    }

    /// The holder (an index into the holders given to [`Requester::connect`]) that a route
    /// of `chunk` goes to now: the preferred one ([`Requester::prefer`]) while it is live and
    /// holds the chunk, else the first live one holding it.
    pub fn holder_for(&self, chunk: ChunkId) -> Result<usize, RouteError> {
        self.link_for(chunk)
    }

    /// Sends `chunk`'s routes and fetches to holder `holder` (a selector's choice among the
    /// chunk's replicas: a faster kernel, a lighter load) for as long as it is live and holds
    /// the chunk, and to the first live replica after; `None` goes back to the first live
    /// replica. A holder that does not hold the chunk is never used for it, preferred or not.
    pub fn prefer(&mut self, chunk: ChunkId, holder: Option<usize>) {
        match holder {
            Some(h) => self.preferred.insert(chunk, h),
            None => self.preferred.remove(&chunk),
        };
    }

    /// The live holders of `chunk` (indices into the holders given to
    /// [`Requester::connect`]), in the registry's replica order.
    pub fn live_replicas(&self, chunk: ChunkId) -> Vec<usize> {
        let Ok(entries) = self.registry.holders(chunk) else {
            return Vec::new();
        };
        entries
            .iter()
            .filter_map(|e| {
                self.links
                    .iter()
                    .position(|l| l.usable() && l.welcome.holder == e.holder)
            })
            .collect()
    }

    /// The softmax scale sent with every route (the configuration's).
    pub fn scale(&self) -> f32 {
        self.config.scale
    }

    /// Holders connected at start, alive or not.
    pub fn holders(&self) -> usize {
        self.links.len()
    }

    /// Holder `holder`'s control address.
    pub fn holder_addr(&self, holder: usize) -> Option<SocketAddr> {
        self.links.get(holder).map(|l| l.addr)
    }

    /// The region holder `holder` writes its replies into, as its hello described it: its
    /// own, registered for its link alone, so that what one holder may write cannot reach
    /// another's answers. `None` once its session has ended (the region is gone with it).
    pub fn reply_region(&self, holder: usize) -> Option<&MrDesc> {
        self.links
            .get(holder)
            .and_then(|l| l.io.as_ref())
            .map(|io| io.reply.desc())
    }

    /// Stops using holder `holder`, found dead by other means than a route (its control
    /// connection failed, a directory expired it): routes and fetches of its chunks go to
    /// their next live replica from now on. Its connection is shut.
    pub fn mark_dead(&mut self, holder: usize) -> Result<(), RemoteError> {
        if holder >= self.links.len() {
            return Err(RemoteError::NoSuchHolder(holder));
        }
        self.kill(holder);
        Ok(())
    }

    /// Whether holder `holder` is used: its session works and (under a directory) it is
    /// registered.
    pub fn is_alive(&self, holder: usize) -> bool {
        self.links.get(holder).is_some_and(Link::usable)
    }

    /// The first live link holding `chunk`.
    fn link_for(&self, chunk: ChunkId) -> Result<usize, RouteError> {
        let holders = self
            .registry
            .holders(chunk)
            .map_err(|_| RouteError::NoHolder(chunk))?;
        let serves = |link: usize, e: &ChunkEntry| {
            self.links
                .get(link)
                .is_some_and(|l| l.usable() && l.welcome.holder == e.holder)
        };
        if let Some(&link) = self.preferred.get(&chunk)
            && holders.iter().any(|e| serves(link, e))
        {
            return Ok(link);
        }
        holders
            .iter()
            .find_map(|e| (0..self.links.len()).find(|&link| serves(link, e)))
            .ok_or(RouteError::NoHolder(chunk))
    }

    /// A chunk's registry entry: its layout and stored positions (every replica's).
    pub(crate) fn entry(&self, chunk: ChunkId) -> Result<&ChunkEntry, RouteError> {
        // Replicas share layout and positions (the registry refuses one that differs).
        self.registry
            .holders(chunk)
            .ok()
            .and_then(|h| h.first())
            .ok_or(RouteError::NoHolder(chunk))
    }

    /// Ends link `link`'s session and releases what it held: its control connection, its
    /// reply region (deregistered: a late write of its holder lands nowhere), its staging
    /// range (for a later session) and its immediates.
    fn kill(&mut self, link: usize) {
        if let Some(io) = self.links[link].io.take() {
            let _ = io.control.shutdown(std::net::Shutdown::Both);
        }
    }
}
