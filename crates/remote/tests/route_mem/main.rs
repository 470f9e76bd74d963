//! Route and fetch end to end in one process over the `mem` fabric: holders and a requester
//! with their own engines, the TCP rendezvous on loopback. Checks every output against
//! single-instance attention over the whole document.

#[path = "../common/mod.rs"]
mod common;
mod directory;
mod fetch;
mod gpu;

use std::net::TcpListener;
use std::time::Duration;

use anyhow::Result;
use kvroute_kernels::layout::D_QK;
use kvroute_kernels::{
    Backend, Cache, Queries, RopeLayout, Selection, merge, partial_dense, partial_sparse,
};
use kvroute_kvstore::corpus::queries;
use kvroute_kvstore::{ChunkId, CorpusSpec};
use kvroute_remote::{
    Call, GatherPart, HeldChunks, Holder, HolderConfig, Requester, RequesterConfig, RouteError,
    Sparse, wire,
};

use kvroute_remote::session;
use kvroute_transport::{MemFabric, OnDone, RegisteredBuffer, TransferEngine};

const SCALE: f32 = 0.1147;

/// The GPU tests one at a time: they count the process's launches of the decode kernel.
static ON_THE_GPU: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn spec() -> CorpusSpec {
    CorpusSpec {
        layers: 3,
        chunk_tokens: 200,
        chunks: 4,
        seed: 11,
        rope_theta: 10_000.0,
        yarn: Some(kvroute_kernels::Yarn::DEEPSEEK),
        rope_layout: RopeLayout::Interleaved,
    }
}

fn holder(fabric: &MemFabric, chunks: &[u32], cap: usize) -> Result<Holder> {
    holder_on(fabric, chunks, cap, Backend::Cpu)
}

fn holder_on(fabric: &MemFabric, chunks: &[u32], cap: usize, backend: Backend) -> Result<Holder> {
    let config = HolderConfig {
        backend,
        max_requesters: cap,
        slot_bytes: 1 << 20,
        reply_bytes: 1 << 20,
        ..HolderConfig::default()
    };
    common::start_holder(TransferEngine::mem(fabric, 1)?, &spec(), chunks, config)
}

fn requester(fabric: &MemFabric, holders: &[&Holder]) -> Result<Requester> {
    let config = RequesterConfig {
        timeout: Duration::from_secs(2),
        link_bytes: 1 << 20,
        pool_pages: 64,
        scale: SCALE,
        spin: Duration::from_millis(1),
        max_holders: 3,
    };
    let addrs: Vec<_> = holders.iter().map(|h| h.addr()).collect();
    common::connect(fabric, &addrs, config)
}

/// One dense call per chunk in `chunks`, all with the query rows `q`, at `layer`.
fn dense_calls(q: &[u16], layer: u16, chunks: std::ops::Range<u32>) -> Vec<Call<'_>> {
    chunks
        .map(|c| Call {
            chunk: ChunkId(c),
            layer,
            queries: q,
            sparse: None,
        })
        .collect()
}

/// Rows `q` attended over layer `layer` of the whole document (`blocks`, every chunk of
/// `spec()`), by the f64 reference: what a routed and merged step must match.
fn dense_whole(blocks: &[Vec<u16>], layer: u16, q: &[u16]) -> Result<kvroute_kernels::Partial> {
    let doc = spec().document_layer(blocks, u32::from(layer))?;
    Ok(partial_dense(
        Backend::Reference,
        &Queries::new(q)?,
        &Cache::contiguous(&doc)?,
        SCALE,
    )?)
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The zero-copy path: the producer writes query rows straight into registered staging
/// (`Requester::stage`), the partials stay in the reply region in their wire encoding
/// (`route_wire`), and `merge_wire` reads them there. Same merged output as `route` + `merge`
/// of the decoded partials, to f32 round-off; a call that cannot be sent gets no staging and
/// its error, and the others are served.
#[test]
fn staged_queries_and_wire_partials_merge_like_the_copying_path() -> Result<()> {
    use kvroute_kernels::{Partial, merge_wire};
    use kvroute_remote::StagedCall;
    let fabric = MemFabric::new();
    let (a, b) = (holder(&fabric, &[0, 1], 8)?, holder(&fabric, &[2, 3], 8)?);
    let mut req = requester(&fabric, &[&a, &b])?;
    let s = spec();
    let q = queries(16, 900, &s.rope()?, 5);
    let layer = 2;
    let copied = dense_calls(&q, layer, 0..4);
    let parts: Vec<_> = req.route(&copied).into_iter().collect::<Result<_, _>>()?;
    let want = merge(&parts.iter().collect::<Vec<_>>())?;
    // Chunk 7 is held by nobody: its call is refused before anything is staged.
    let plan: Vec<StagedCall<'_>> = [0, 1, 7, 2, 3]
        .into_iter()
        .map(|c| StagedCall {
            chunk: ChunkId(c),
            layer,
            rows: 16,
            sparse: None,
        })
        .collect();
    let mut staged = req.stage(&plan);
    for c in 0..plan.len() {
        match staged.queries_mut(c) {
            Some(rows) => rows.copy_from_slice(&q),
            None => assert_eq!(c, 2, "only the unheld chunk has no staging"),
        }
    }
    let routed = staged.route_wire();
    assert!(matches!(
        routed.partial(2),
        Err(RouteError::NoHolder(ChunkId(7)))
    ));
    let views = [0, 1, 3, 4]
        .into_iter()
        .map(|c| routed.partial(c))
        .collect::<Result<Vec<_>, _>>()?;
    let mut got = Partial::empty(0);
    merge_wire(&views, &mut got)?;
    assert_eq!(got.m, want.m);
    let err = max_abs(&got.o, &want.o);
    assert!(err <= 2e-6, "wire merge against decoded merge: {err}");
    drop(routed);
    // One request per holder for the staged step, as for the copying one.
    assert_eq!(req.holder_stats(0)?.requests, 2);
    assert_eq!(req.holder_stats(1)?.requests, 2);
    Ok(())
}

#[test]
fn dense_route_over_two_holders_matches_one_instance() -> Result<()> {
    let fabric = MemFabric::new();
    let (a, b) = (holder(&fabric, &[0, 1], 8)?, holder(&fabric, &[2, 3], 8)?);
    let mut req = requester(&fabric, &[&a, &b])?;
    let s = spec();
    let blocks: Vec<_> = (0..s.chunks)
        .map(|c| s.chunk(ChunkId(c)))
        .collect::<Result<_, _>>()?;
    let q = queries(16, 900, &s.rope()?, 5);
    for layer in 0..3u16 {
        let calls = dense_calls(&q, layer, 0..4);
        let parts: Vec<_> = req.route(&calls).into_iter().collect::<Result<_, _>>()?;
        let merged = merge(&parts.iter().collect::<Vec<_>>())?;
        let whole = dense_whole(&blocks, layer, &q)?;
        let err = max_abs(&merged.o, &whole.o);
        assert!(
            err < 4e-3,
            "layer {layer}: routed through the bf16 wire, max abs {err}"
        );
    }
    let stats = req.holder_stats(0)?;
    assert_eq!(
        stats.requests, 3,
        "one write per holder per step: {stats:?}"
    );
    assert_eq!(stats.kernel_calls, 6);
    Ok(())
}

/// One query token selecting `k` scattered tokens of the 800-token document
/// of `spec()`: the global selection and, per chunk, its calls' local indices.
fn scattered_selection(k: usize) -> (Vec<i32>, Vec<Vec<i32>>) {
    let global: Vec<i32> = (0..k).map(|i| ((i * 7919 + 13) % 800) as i32).collect();
    let local = (0..4i32)
        .map(|c| {
            global
                .iter()
                .filter(|&&g| g / 200 == c)
                .map(|&g| g - c * 200)
                .collect()
        })
        .collect();
    (global, local)
}

/// One sparse call per chunk at `layer`: chunk c's rows `q` (`heads` per query token) over
/// its selection `local[c]`.
fn sparse_calls<'a>(
    q: &'a [u16],
    layer: u16,
    local: &'a [Vec<i32>],
    heads: usize,
) -> Vec<Call<'a>> {
    local
        .iter()
        .enumerate()
        .map(|(c, idx)| Call {
            chunk: ChunkId(c as u32),
            layer,
            queries: q,
            sparse: Some(Sparse {
                indices: idx,
                k: idx.len() as u32,
                rows_per_token: heads as u32,
            }),
        })
        .collect()
}

#[test]
fn sparse_scattered_selection_matches_one_instance() -> Result<()> {
    let fabric = MemFabric::new();
    let (a, b) = (holder(&fabric, &[0, 2], 8)?, holder(&fabric, &[1, 3], 8)?);
    let mut req = requester(&fabric, &[&a, &b])?;
    let s = spec();
    let blocks: Vec<_> = (0..s.chunks)
        .map(|c| s.chunk(ChunkId(c)))
        .collect::<Result<_, _>>()?;
    let (heads, k) = (16usize, 300usize);
    let q = queries(heads, 900, &s.rope()?, 6);
    let (global, calls_idx) = scattered_selection(k);
    let layer = 1u16;
    let calls = sparse_calls(&q, layer, &calls_idx, heads);
    let parts: Vec<_> = req.route(&calls).into_iter().collect::<Result<_, _>>()?;
    let merged = merge(&parts.iter().collect::<Vec<_>>())?;
    let doc = s.document_layer(&blocks, u32::from(layer))?;
    let cache = Cache::contiguous(&doc)?;
    let sel = Selection::new(&global, k, heads, heads, cache.tokens())?;
    let whole = partial_sparse(Backend::Reference, &Queries::new(&q)?, &cache, &sel, SCALE)?;
    let err = max_abs(&merged.o, &whole.o);
    assert!(err < 4e-3, "max abs {err}");
    Ok(())
}

#[test]
fn malformed_requests_are_refused_and_the_holder_keeps_serving() -> Result<()> {
    let fabric = MemFabric::new();
    let a = holder(&fabric, &[0], 8)?;
    let mut req = requester(&fabric, &[&a])?;
    let q = vec![0x3f80u16; 4 * D_QK];
    bad_calls_are_refused_one_by_one(&mut req, &q)?;
    // A rogue requester with a real session writes garbage into its slot, then a request
    // whose header is fine and whose segment lies, then a stray immediate.
    let rogue = Rogue::open(&fabric, &a)?;
    rogue.writes_garbage_then_a_lying_segment(&q)?;
    rogue.engine.submit_imm(
        wire::request_imm(9999, 1),
        &rogue.welcome.inbox,
        OnDone::nothing(),
    )?;
    rogue
        .engine
        .submit_imm(0x1234_5678, &rogue.welcome.inbox, OnDone::nothing())?;
    // Forged pings: a reply longer than the holder's staging, and a ping immediate over a
    // slot that holds no ping header. Both are refused without a write.
    let before = req.holder_stats(0)?;
    rogue.forges_pings()?;
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        req.route(&dense_calls(&q, 0, 0..1))[0].is_ok(),
        "still serving after a stray immediate and forged pings"
    );
    let stats = req.holder_stats(0)?;
    assert_eq!(stats.pings, before.pings, "no forged ping answered");
    assert!(stats.refused >= before.refused + 2, "{stats:?}");
    assert!(stats.refused >= 6, "{stats:?}");
    assert!(stats.stray_imms >= 2, "{stats:?}");
    Ok(())
}

/// Unknown chunk, layer out of range, index out of range: typed refusals per call, and the
/// good call of the same request served from its own rows.
fn bad_calls_are_refused_one_by_one(req: &mut Requester, q: &[u16]) -> Result<()> {
    let bad_idx = [0i32, 250];
    let calls = [
        Call {
            chunk: ChunkId(0),
            layer: 9,
            queries: q,
            sparse: None,
        },
        Call {
            chunk: ChunkId(0),
            layer: 0,
            queries: q,
            sparse: Some(Sparse {
                indices: &bad_idx,
                k: 2,
                rows_per_token: 4,
            }),
        },
        Call {
            chunk: ChunkId(0),
            layer: 0,
            queries: q,
            sparse: None,
        },
    ];
    let out = req.route(&calls);
    assert!(
        matches!(
            out[0],
            Err(RouteError::Refused {
                status: wire::Status::BadLayer,
                ..
            })
        ),
        "{:?}",
        out[0]
    );
    assert!(
        matches!(
            out[1],
            Err(RouteError::Refused {
                status: wire::Status::Kernel,
                ..
            })
        ),
        "{:?}",
        out[1]
    );
    assert!(out[2].is_ok(), "{:?}", out[2]);
    // The served call's rows sit after the refused calls' (zeroed) rows: the same partial as
    // the call routed alone.
    let alone = req.route(&calls[2..]).remove(0)?;
    assert!(
        out[2].as_ref().is_ok_and(|p| *p == alone),
        "rows read from the wrong place"
    );
    assert!(matches!(
        req.route(&[Call {
            chunk: ChunkId(3),
            layer: 0,
            queries: q,
            sparse: None
        }])[0],
        Err(RouteError::NoHolder(_))
    ));
    Ok(())
}

/// A requester with a real session opened by hand, writing raw bytes into its slot.
struct Rogue {
    /// What is written into the session's slot, from offset 0.
    buf: RegisteredBuffer,
    welcome: session::Welcome,
    /// The session's control connection (the session lives while it is open).
    _control: (std::io::BufReader<std::net::TcpStream>, std::net::TcpStream),
    /// Where the holder's replies land.
    reply: RegisteredBuffer,
    engine: TransferEngine,
}

impl Rogue {
    /// Opens a session on `holder` from an engine of its own.
    fn open(fabric: &MemFabric, holder: &Holder) -> Result<Self> {
        let engine = TransferEngine::mem(fabric, 1)?;
        let reply = engine.alloc_mr(1 << 16)?;
        let mut control = std::net::TcpStream::connect(holder.addr())?;
        let hello = session::Hello {
            addr: engine.main_address(),
            reply: reply.desc().clone(),
            pool: None,
            reply_imm: 77,
            fetch_imm: 78,
        };
        let mut reader = std::io::BufReader::new(control.try_clone()?);
        let welcome = session::open(
            &engine,
            (&mut control, &mut reader),
            &hello,
            Duration::from_secs(5),
        )?;
        let buf = engine.alloc_mr(4096)?;
        Ok(Self {
            buf,
            welcome,
            _control: (reader, control),
            reply,
            engine,
        })
    }

    /// Writes the first `len` bytes of `buf` into the session's slot with the immediate `imm`.
    fn write_slot(&self, len: u64, imm: u32) -> Result<()> {
        let inbox = (&self.welcome.inbox, self.welcome.slot_offset);
        self.engine.submit_single_write(
            len,
            Some(imm),
            (self.buf.handle(), 0),
            inbox,
            OnDone::nothing(),
        )?;
        Ok(())
    }

    /// Writes garbage as a request, then a request whose header is fine and whose segment
    /// claims more rows than it carries: the second is answered with a bad-segment status.
    fn writes_garbage_then_a_lying_segment(&self, q: &[u16]) -> Result<()> {
        self.buf.fill(0xab);
        let imm = wire::request_imm(self.welcome.session, 1);
        self.write_slot(4096, imm)?;
        std::thread::sleep(Duration::from_millis(50));
        let mut lying = Vec::new();
        let seg = wire::SegmentSpec {
            kind: wire::SegmentKind::Dense,
            chunk: 0,
            layer: 0,
            queries: wire::QueryRows::Copied(&q[..D_QK]),
            indices: &[],
            pages: &[],
            windows: &[],
        };
        wire::encode_request(&mut lying, 5, self.welcome.token, 0, SCALE, &[seg]);
        let rows_at = wire::REQUEST_HEADER + 8;
        lying[rows_at..rows_at + 4].copy_from_slice(&1000u32.to_le_bytes());
        self.buf.write_at(0, &lying)?;
        let answered = self.engine.imm_count(77, 1);
        self.write_slot(lying.len() as u64, imm)?;
        answered.wait()?;
        let header = wire::decode_reply_header(&self.reply.to_vec())
            .ok_or_else(|| anyhow::anyhow!("no reply"))?;
        assert_eq!(
            (header.seq, header.statuses.as_slice()),
            (5, &[wire::Status::BadSegment][..])
        );
        Ok(())
    }

    /// Writes a ping asking for a reply longer than the holder's staging, then a ping
    /// immediate over a slot of garbage.
    fn forges_pings(&self) -> Result<()> {
        let mut ping = [0u8; wire::PING_HEADER];
        let forged = wire::Ping {
            reply_len: u32::MAX,
            reply_offset: 0,
            pong: wire::Pong::Staged,
            token: self.welcome.token,
            seq: 6,
        };
        wire::encode_ping(&mut ping, &forged);
        self.buf.write_at(0, &ping)?;
        let ping_imm = wire::ping_imm(self.welcome.session, 1);
        self.write_slot(wire::PING_HEADER as u64, ping_imm)?;
        self.buf.fill(0xab);
        self.write_slot(64, ping_imm)?;
        Ok(())
    }
}

#[test]
fn the_store_refuses_writes_through_its_published_descriptor() -> Result<()> {
    let fabric = MemFabric::new();
    let a = holder(&fabric, &[0], 2)?;
    let mut req = requester(&fabric, &[&a])?;
    let s = spec();
    let q = queries(2, i64::from(s.chunk_tokens), &s.rope()?, 3);
    let call = Call {
        chunk: ChunkId(0),
        layer: 1,
        queries: &q,
        sparse: None,
    };
    let before = req.route(&[call]).remove(0)?;
    // Every requester learns the store's descriptor from the registry; a peer that writes
    // through it is refused by the holder's NIC.
    let entry = req.registry().holders(ChunkId(0))?[0].clone();
    let rogue = TransferEngine::mem(&fabric, 1)?;
    let garbage = rogue.alloc_mr(4096)?;
    garbage.fill(0x7f);
    let done = kvroute_transport::DoneFlag::new();
    rogue.submit_single_write(
        4096,
        Some(5),
        (garbage.handle(), 0),
        (&entry.desc, entry.offset),
        OnDone::flag(&done),
    )?;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !done.is_done() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    let outcome = done.result().expect("the write completes");
    assert!(
        matches!(&outcome, Err(kvroute_transport::TransferError::RemoteAccess(why)) if why.contains("not remotely writable")),
        "{outcome:?}"
    );
    let after = req.route(&[call]).remove(0)?;
    assert_eq!(before, after, "the corpus is unchanged");
    Ok(())
}

/// The pong kinds a holder answers: a written pong is a measurement, served only with the
/// `measure` feature.
const PONGS: &[wire::Pong] = if cfg!(feature = "measure") {
    &[wire::Pong::Staged, wire::Pong::Written]
} else {
    &[wire::Pong::Staged]
};

/// A holder's counters include a batch, its times too, by the time the batch's reply lands:
/// a read right after each route or ping finds it counted, with nothing to wait for.
#[test]
fn counters_count_a_batch_by_the_time_its_reply_lands() -> Result<()> {
    let fabric = MemFabric::new();
    let a = holder(&fabric, &[0], 2)?;
    let mut req = requester(&fabric, &[&a])?;
    let s = spec();
    let q = queries(4, 900, &s.rope()?, 5);
    let rows = (q.len() / D_QK) as u64;
    let mut last = req.holder_stats(0)?;
    for i in 1..=200u64 {
        for part in req.route(&dense_calls(&q, 0, 0..1)) {
            part?;
        }
        let now = req.holder_stats(0)?;
        assert_eq!(
            (now.requests, now.batches, now.rows, now.kernel_calls),
            (i, i, i * rows, i),
            "after route {i}: {now:?}"
        );
        assert!(
            now.serve_us > last.serve_us && now.kernel_us > last.kernel_us,
            "after route {i}, the batch's times are in: {now:?} after {last:?}"
        );
        assert!(now.row_tokens > last.row_tokens, "route {i}: {now:?}");
        req.ping(0, wire::PING_HEADER, 1, wire::Pong::Staged)?;
        let pinged = req.holder_stats(0)?;
        assert_eq!(pinged.pings, last.pings + 1, "after ping {i}: {pinged:?}");
        last = pinged;
    }
    Ok(())
}

#[test]
fn ping_is_a_raw_round_trip_of_the_asked_sizes() -> Result<()> {
    let fabric = MemFabric::new();
    let a = holder(&fabric, &[0], 2)?;
    let mut req = requester(&fabric, &[&a])?;
    let warm = req.holder_stats(0)?.pings;
    assert_eq!(warm, 1, "connect opens the data path with one ping");
    for (out, back) in [
        (wire::PING_HEADER, 1),
        (300_000, 264_000),
        (1 << 20, 1 << 20),
    ] {
        for &pong in PONGS {
            let rtt = req.ping(0, out, back, pong)?;
            assert!(rtt > Duration::ZERO);
        }
    }
    let stats = req.holder_stats(0)?;
    assert_eq!(stats.pings, warm + 3 * PONGS.len() as u64);
    if cfg!(feature = "measure") {
        assert!(stats.pong_write_us > 0.0, "written pongs are timed");
    }
    assert_eq!(stats.requests, 0, "a ping is not a request");
    // Sizes the link or the holder cannot take are refused before anything is sent.
    assert!(matches!(
        req.ping(0, 8, 1, wire::Pong::Staged),
        Err(RouteError::TooLarge(8))
    ));
    assert!(matches!(
        req.ping(0, 64, 0, wire::Pong::Written),
        Err(RouteError::TooLarge(0))
    ));
    assert!(matches!(
        req.ping(0, 64, (1 << 20) + 1, wire::Pong::Written),
        Err(RouteError::TooLarge(_))
    ));
    assert!(matches!(
        req.ping(7, 64, 64, wire::Pong::Staged),
        Err(RouteError::NoHolder(_))
    ));
    // And routing still works on the same link afterwards.
    let q = vec![0x3f80u16; D_QK];
    let call = Call {
        chunk: ChunkId(0),
        layer: 0,
        queries: &q,
        sparse: None,
    };
    assert!(req.route(&[call])[0].is_ok());
    Ok(())
}

#[test]
fn holder_pushes_back_beyond_its_cap() -> Result<()> {
    let fabric = MemFabric::new();
    let a = holder(&fabric, &[0], 1)?;
    let first = requester(&fabric, &[&a])?;
    let second = requester(&fabric, &[&a]);
    assert!(second.is_err_and(|e| e.to_string().contains("busy")));
    drop(first);
    // The slot is freed when the first requester's control connection closes.
    let mut ok = false;
    for _ in 0..100 {
        if requester(&fabric, &[&a]).is_ok() {
            ok = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(ok, "a freed session is granted again");
    assert!(a.stats().busy >= 1);
    Ok(())
}
