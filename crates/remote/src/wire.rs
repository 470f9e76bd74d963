//! The route protocol's bytes (paper 000 section 3.2 rows, section 5.3's reductions).
//!
//! A **request** is one write into the requester's inbox slot at the holder, carrying an
//! immediate: a 48-byte header, a table of 32-byte segments, then the payloads (query rows,
//! 1152 B each; sparse indices, i32; fetch destination pages, u32). Several segments, for
//! different requests and chunks bound to the same holder, share one write (the dispatcher's
//! batching). The **reply** is one write into the requester's reply region, also with an
//! immediate: a 24-byte header, one status word per segment, then every partial row of every
//! dense or sparse segment in order (1032 B each: o as bf16, m and l as f32). A fetch segment
//! answers with its status only; its bytes arrive as writes into the requester's pool pages,
//! one per run of consecutive pages ([`fetch_runs`]), with their own immediate, and so do a
//! gather segment's (sparse fetch: selected rows, one write per page they touch).
//!
//! Everything a holder reads comes from a peer: [`Request::parse`] checks every length, offset
//! and count before anything is used, and a malformed request gets a status, never a panic.

use kvroute_kernels::layout::{D_QK, PAGE_TOKENS, PARTIAL_ROW_BYTES, QUERY_ROW_BYTES};

/// "KVRQ", little-endian.
pub const REQUEST_MAGIC: u32 = u32::from_le_bytes(*b"KVRQ");
/// "KVRP", little-endian.
pub const REPLY_MAGIC: u32 = u32::from_le_bytes(*b"KVRP");
/// The protocol version this build speaks. 2: reply rows sit where the request fixes them
/// ([`reply_row_layout`]). 3: a fetch or gather segment is all or nothing (a refused one sent
/// no writes; [`Status::TransferFailed`] otherwise), which the requester's exact count of
/// fetch arrivals relies on, and a fetch is one write per run of consecutive pages
/// ([`fetch_runs`]), not per page; a version-2 peer is refused.
pub const VERSION: u16 = 3;
/// Bytes of a request header.
pub const REQUEST_HEADER: usize = 48;
/// Bytes of one segment descriptor.
pub const SEGMENT_BYTES: usize = 32;
/// Bytes of a reply header (before the status words).
pub const REPLY_HEADER: usize = 24;
/// Segments one request may carry.
pub const MAX_SEGMENTS: usize = 256;

/// The immediate of a request write: a tag, the number of arrivals the write makes (1 to 4,
/// one per NIC shard) and the session. The holder counts arrivals per value and starts on the
/// request when all shards are in.
pub fn request_imm(session: u16, shards: u64) -> u32 {
    tagged_imm(REQUEST_TAG, session, shards)
}

/// Decodes [`request_imm`]: `(session, shards)`, or `None` for a value that is not a request.
pub fn parse_request_imm(imm: u32) -> Option<(u16, u64)> {
    parse_tagged_imm(REQUEST_TAG, imm)
}

/// The top byte of a request's immediate.
const REQUEST_TAG: u32 = 0x52;
/// The top byte of a ping's immediate.
const PING_TAG: u32 = 0x50;

/// `tag` in the top byte, `shards - 1` (shards 1 to 4) in bits 16-17, the session below.
fn tagged_imm(tag: u32, session: u16, shards: u64) -> u32 {
    let shards = shards.clamp(1, 4) as u32;
    (tag << 24) | ((shards - 1) << 16) | u32::from(session)
}

/// Decodes [`tagged_imm`] for `tag`: `(session, shards)`, or `None` for another value.
fn parse_tagged_imm(tag: u32, imm: u32) -> Option<(u16, u64)> {
    if imm & 0xfffc_0000 != tag << 24 {
        return None;
    }
    Some(((imm & 0xffff) as u16, u64::from((imm >> 16) & 0x3) + 1))
}

/// "KVPG", little-endian: the header of a ping whose pong is sent from staging as it is.
pub const PING_MAGIC: u32 = u32::from_le_bytes(*b"KVPG");
/// "KVPW", little-endian: the header of a ping whose pong bytes the holder writes first.
pub const PING_WRITTEN_MAGIC: u32 = u32::from_le_bytes(*b"KVPW");
/// Bytes of a ping header: magic, reply length (u32), reply offset (u64).
pub const PING_HEADER: usize = 16;

/// The immediate of a ping write: the transport's raw write round trip through the same
/// slot, reply region, engines and serving thread as a request, with no parsing and no
/// kernel (the baseline `kvroute sweep` measures route against). Same layout as
/// [`request_imm`] under another tag.
pub fn ping_imm(session: u16, shards: u64) -> u32 {
    tagged_imm(PING_TAG, session, shards)
}

/// Decodes [`ping_imm`]: `(session, shards)`, or `None` for a value that is not a ping.
pub fn parse_ping_imm(imm: u32) -> Option<(u16, u64)> {
    parse_tagged_imm(PING_TAG, imm)
}

/// Where a pong's bytes come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pong {
    /// Staging as it is: the lines the previous pong's copy left in cache (the transport's
    /// plain raw round trip).
    Staged,
    /// Staging the holder's serving thread has just written, every byte: a route's reply
    /// rows are always freshly written (by the kernel), so this is the raw round trip for
    /// bytes in the same state. The holder times the writing ([`super::session::HolderStats`]'s
    /// `pong_write_us`), so it can be taken out of the round trip.
    Written,
}

/// Writes a ping header into the first [`PING_HEADER`] bytes of `out`: answer with
/// `reply_len` bytes at `reply_offset` of the reply region, from `pong`.
pub fn encode_ping(out: &mut [u8], reply_len: u32, reply_offset: u64, pong: Pong) {
    let magic = match pong {
        Pong::Staged => PING_MAGIC,
        Pong::Written => PING_WRITTEN_MAGIC,
    };
    out[..4].copy_from_slice(&magic.to_le_bytes());
    out[4..8].copy_from_slice(&reply_len.to_le_bytes());
    out[8..16].copy_from_slice(&reply_offset.to_le_bytes());
}

/// Parses a ping header: `(reply_len, reply_offset, pong)`, or `None` if it is not one.
pub fn parse_ping(bytes: &[u8]) -> Option<(usize, u64, Pong)> {
    if bytes.len() < PING_HEADER {
        return None;
    }
    let pong = match u32_at(bytes, 0) {
        PING_MAGIC => Pong::Staged,
        PING_WRITTEN_MAGIC => Pong::Written,
        _ => return None,
    };
    Some((u32_at(bytes, 4) as usize, u64_at(bytes, 8), pong))
}

/// What a segment asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentKind {
    /// Dense partial attention of the rows over the whole chunk (one layer).
    Dense,
    /// Sparse partial attention over selected chunk tokens (one layer).
    Sparse {
        /// Indices per query token (-1 = padding).
        k: u32,
        /// Query rows (heads) per query token.
        rows_per_token: u32,
    },
    /// Paged writes of the whole chunk (every layer) into the requester's pool pages.
    Fetch,
    /// Sparse fetch: the selected rows of one layer into the requester's pool pages, row `j`
    /// at row `first + j` of the listed pages (so the rows of several holders can follow each
    /// other in one page table), packed by the holder into one write per page
    /// ([`gather_writes`]).
    Gather {
        /// Where in the first listed page the first row goes (0 to 63).
        first: u32,
    },
}

/// The most pool pages one fetch write covers (64 pages of 72 KiB: 4.5 MiB).
pub const FETCH_RUN_PAGES: usize = 64;

/// The writes a fetch into `pages` (the requester's pool pages, in the order of the chunk's
/// pages) is sent as: `(first, count)` for each run of consecutive page numbers, at most
/// [`FETCH_RUN_PAGES`] long, as indices into `pages`. The chunk's own pages are consecutive in
/// the holder's store, so each run is one write of `count` pages. Holder and requester both
/// derive them from `pages`, so both know how many immediates come. A pool that hands out
/// ascending free pages (as `kvstore::PagedPool` does) makes a fetch a few large writes
/// instead of one per page, which providers with a per-message cost (`tcp;ofi_rxm`) need.
pub fn fetch_runs(pages: &[u32]) -> impl Iterator<Item = (usize, usize)> + '_ {
    let mut at = 0;
    std::iter::from_fn(move || {
        let first = at;
        let start = *pages.get(first)?;
        let mut count = 1;
        while count < FETCH_RUN_PAGES
            && pages.get(first + count).copied() == start.checked_add(count as u32)
        {
            count += 1;
        }
        at += count;
        Some((first, count))
    })
}

/// Pool pages a gather of `rows` rows starting at row `first` of its first page spans.
pub fn gather_pages(first: u32, rows: usize) -> usize {
    (first as usize + rows).div_ceil(PAGE_TOKENS)
}

/// The writes a gather is sent as, one per page it touches: `(page, row in the page, rows,
/// first gathered row)`, with `page` an index into the segment's page list. Holder and
/// requester both derive them from `(first, rows)`, so both know how many immediates come.
pub fn gather_writes(first: u32, rows: usize) -> impl Iterator<Item = GatherWrite> {
    let first = first as usize;
    (0..gather_pages(first as u32, rows)).map(move |page| {
        let start = (page * PAGE_TOKENS).max(first);
        let end = ((page + 1) * PAGE_TOKENS).min(first + rows);
        GatherWrite {
            page,
            row: start % PAGE_TOKENS,
            rows: end - start,
            from: start - first,
        }
    })
}

/// One write of a packed gather (see [`gather_writes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatherWrite {
    /// Index into the segment's page list.
    pub page: usize,
    /// First row written in that page.
    pub row: usize,
    /// Rows written.
    pub rows: usize,
    /// Index of the first of them among the gathered rows.
    pub from: usize,
}

/// One segment of a request, as the requester builds it.
#[derive(Debug, Clone, Copy)]
pub struct SegmentSpec<'a> {
    /// What is asked.
    pub kind: SegmentKind,
    /// The chunk.
    pub chunk: u32,
    /// The layer (dense and sparse).
    pub layer: u16,
    /// Query rows (none for a fetch or a gather).
    pub queries: QueryRows<'a>,
    /// Sparse: `rows / rows_per_token * k` chunk-local indices; gather: the tokens to send.
    pub indices: &'a [i32],
    /// Fetch: the requester's pool pages, layer-major (`layers * ceil(tokens / 64)`);
    /// gather: [`gather_pages`] pages.
    pub pages: &'a [u32],
}

/// A segment's query rows as the requester builds it.
#[derive(Debug, Clone, Copy)]
pub enum QueryRows<'a> {
    /// `[rows, 576]` bf16 bits, copied into the request by [`encode_request_into`].
    Copied(&'a [u16]),
    /// This many rows, written into the request's bytes by the caller after
    /// [`encode_request_into`] (at the offsets it returns): the producer of the queries writes
    /// them straight into registered staging, and nothing copies them.
    InPlace(usize),
}

impl QueryRows<'_> {
    /// Query rows.
    pub fn rows(&self) -> usize {
        match self {
            Self::Copied(words) => words.len() / D_QK,
            Self::InPlace(rows) => *rows,
        }
    }

    /// Bytes on the wire.
    pub fn bytes(&self) -> usize {
        match self {
            Self::Copied(words) => words.len() * 2,
            Self::InPlace(rows) => rows * QUERY_ROW_BYTES,
        }
    }
}

/// Bytes of a request carrying `segments`.
pub fn request_len(segments: &[SegmentSpec<'_>]) -> usize {
    REQUEST_HEADER
        + segments.len() * SEGMENT_BYTES
        + segments
            .iter()
            .map(|s| s.queries.bytes() + s.indices.len() * 4 + s.pages.len() * 4)
            .sum::<usize>()
}

/// Partial rows a reply to `segments` carries.
pub fn reply_rows(segments: &[SegmentSpec<'_>]) -> usize {
    segments.iter().map(|s| s.queries.rows()).sum()
}

/// Bytes of a reply with `segments` segments and `rows` partial rows.
pub fn reply_len(segments: usize, rows: usize) -> usize {
    status_end(segments) + rows * PARTIAL_ROW_BYTES
}

fn status_end(segments: usize) -> usize {
    (REPLY_HEADER + segments * 4).next_multiple_of(8)
}

/// Encodes a request into `out` (cleared first).
pub fn encode_request(
    out: &mut Vec<u8>,
    seq: u64,
    reply_offset: u64,
    scale: f32,
    segments: &[SegmentSpec<'_>],
) {
    out.clear();
    out.resize(request_len(segments), 0);
    encode_request_into(out, seq, reply_offset, scale, segments);
}

/// Encodes a request into `out`, which must be exactly [`request_len`] bytes (a staging
/// range of registered memory, so the request is written once, where the NIC reads it).
/// Returns where in `out` the [`QueryRows::InPlace`] segments' rows go, in segment order
/// (2-byte aligned: every offset before them is a multiple of 4); their bytes are left as
/// they were.
///
/// # Panics
/// If `out` is not [`request_len`] bytes (a caller's bug, not a peer's input).
pub fn encode_request_into(
    out: &mut [u8],
    seq: u64,
    reply_offset: u64,
    scale: f32,
    segments: &[SegmentSpec<'_>],
) -> Vec<usize> {
    let total = request_len(segments);
    assert_eq!(out.len(), total, "a request buffer of request_len bytes");
    out[..REQUEST_HEADER].fill(0);
    out[0..4].copy_from_slice(&REQUEST_MAGIC.to_le_bytes());
    out[4..6].copy_from_slice(&VERSION.to_le_bytes());
    out[6..8].copy_from_slice(&(segments.len() as u16).to_le_bytes());
    out[8..16].copy_from_slice(&seq.to_le_bytes());
    out[16..24].copy_from_slice(&reply_offset.to_le_bytes());
    out[24..28].copy_from_slice(&(total as u32).to_le_bytes());
    out[28..32].copy_from_slice(&scale.to_le_bytes());
    let mut payload = REQUEST_HEADER + segments.len() * SEGMENT_BYTES;
    for (i, s) in segments.iter().enumerate() {
        let (kind, k, rpt) = match s.kind {
            SegmentKind::Dense => (1u8, 0, 0),
            SegmentKind::Sparse { k, rows_per_token } => (2, k, rows_per_token),
            SegmentKind::Fetch => (3, 0, 0),
            SegmentKind::Gather { first } => (4, first, 0),
        };
        let len = s.queries.bytes() + s.indices.len() * 4 + s.pages.len() * 4;
        let rows = match s.kind {
            SegmentKind::Fetch => s.pages.len(),
            SegmentKind::Gather { .. } => s.indices.len(),
            _ => s.queries.rows(),
        };
        let d = &mut out[REQUEST_HEADER + i * SEGMENT_BYTES..][..SEGMENT_BYTES];
        d[0..2].copy_from_slice(&[kind, 0]);
        d[2..4].copy_from_slice(&s.layer.to_le_bytes());
        d[4..8].copy_from_slice(&s.chunk.to_le_bytes());
        d[8..12].copy_from_slice(&(rows as u32).to_le_bytes());
        d[12..16].copy_from_slice(&k.to_le_bytes());
        d[16..20].copy_from_slice(&rpt.to_le_bytes());
        d[20..24].copy_from_slice(&(payload as u32).to_le_bytes());
        d[24..28].copy_from_slice(&(len as u32).to_le_bytes());
        d[28..32].fill(0);
        payload += len;
    }
    let mut at = REQUEST_HEADER + segments.len() * SEGMENT_BYTES;
    let mut in_place = Vec::new();
    for s in segments {
        match s.queries {
            QueryRows::Copied(words) => at += put_le(&mut out[at..], words, u16::to_le_bytes),
            QueryRows::InPlace(rows) => {
                in_place.push(at);
                at += rows * QUERY_ROW_BYTES;
            }
        }
        at += put_le(&mut out[at..], s.indices, i32::to_le_bytes);
        at += put_le(&mut out[at..], s.pages, u32::to_le_bytes);
    }
    debug_assert_eq!(at, total);
    in_place
}

/// Stores `words` little-endian at the start of `out`; returns the bytes written. `le` is the
/// integer type's `to_le_bytes`. On a little-endian host this is one `memcpy` (the query rows
/// of a 256-row request are 288 KiB: the element-wise loop cost twice the copy,
/// docs/perf.md).
fn put_le<T: Copy, const N: usize>(out: &mut [u8], words: &[T], le: fn(T) -> [u8; N]) -> usize {
    let n = words.len() * N;
    let out = &mut out[..n];
    if cfg!(target_endian = "little") && std::mem::size_of::<T>() == N {
        // SAFETY: the callers pass integer slices (`le` is their `to_le_bytes`, so `T` is `N`
        // bytes with no padding) and the source is `n` bytes long; `out` is exactly `n` bytes
        // and cannot overlap a shared borrow.
        let bytes = unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), n) };
        out.copy_from_slice(bytes);
    } else {
        for (d, &x) in out.chunks_exact_mut(N).zip(words) {
            d.copy_from_slice(&le(x));
        }
    }
    n
}

/// Why a request or one of its segments was refused (the status words of a reply).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u32)]
pub enum Status {
    /// Served.
    #[default]
    Ok = 0,
    /// The header's magic or version is wrong.
    BadHeader = 1,
    /// A length, offset or count does not fit the slot or the payload.
    BadLength = 2,
    /// Unknown segment kind, or rows/k/rows-per-token inconsistent.
    BadSegment = 3,
    /// The holder does not hold the chunk.
    UnknownChunk = 4,
    /// Layer past the chunk's layers.
    BadLayer = 5,
    /// A kernel refused the input (an index out of range, a non-finite scale, ...).
    Kernel = 6,
    /// The reply would not fit the requester's reply region.
    ReplyTooLarge = 7,
    /// The fetch's pages do not fit the requester's pool, or its writes failed to start.
    FetchRefused = 8,
    /// A gathered token index is outside the chunk.
    BadIndex = 9,
    /// Some but maybe not all of a fetch or gather segment's writes were sent (the holder's
    /// engine failed between two of them): the requester's count of its fetch immediate is
    /// lost and it gives the link up. A segment refused with any other status sent none.
    TransferFailed = 10,
    /// A status this build does not know (from a newer peer).
    Unknown = 0xffff_ffff,
}

impl Status {
    /// From a status word.
    pub fn from_u32(v: u32) -> Self {
        match v {
            0 => Self::Ok,
            1 => Self::BadHeader,
            2 => Self::BadLength,
            3 => Self::BadSegment,
            4 => Self::UnknownChunk,
            5 => Self::BadLayer,
            6 => Self::Kernel,
            7 => Self::ReplyTooLarge,
            8 => Self::FetchRefused,
            9 => Self::BadIndex,
            10 => Self::TransferFailed,
            _ => Self::Unknown,
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

/// A parsed segment, borrowing its payload from the request's bytes.
#[derive(Debug, Clone)]
pub struct Segment<'a> {
    /// What is asked.
    pub kind: SegmentKind,
    /// The chunk.
    pub chunk: u32,
    /// The layer.
    pub layer: u16,
    /// Query rows (dense, sparse), pages (fetch) or tokens (gather).
    pub rows: usize,
    /// The payload bytes: query rows then indices, pages, or indices then pages.
    pub payload: &'a [u8],
}

impl Segment<'_> {
    /// Query rows as bf16 bits.
    pub fn queries(&self) -> Vec<u16> {
        let n = match self.kind {
            SegmentKind::Fetch | SegmentKind::Gather { .. } => 0,
            _ => self.rows * QUERY_ROW_BYTES,
        };
        self.payload[..n]
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect()
    }

    /// Query rows as bf16 bits borrowed from the request without a copy, where the payload
    /// is 2-byte aligned (it is when the slot is and the requester packed it as
    /// [`encode_request`] does) on a little-endian host; `None` otherwise (use
    /// [`Segment::queries`]).
    pub fn query_words(&self) -> Option<&[u16]> {
        let n = match self.kind {
            SegmentKind::Fetch | SegmentKind::Gather { .. } => return None,
            _ => self.rows * QUERY_ROW_BYTES,
        };
        if cfg!(target_endian = "big") {
            return None;
        }
        // SAFETY: every bit pattern is a valid u16; `align_to` only returns the aligned middle.
        let (head, words, tail) = unsafe { self.payload[..n].align_to::<u16>() };
        (head.is_empty() && tail.is_empty()).then_some(words)
    }

    /// Sparse indices or gathered tokens (empty otherwise).
    pub fn indices(&self) -> Vec<i32> {
        let bytes = match self.kind {
            SegmentKind::Sparse { .. } => &self.payload[self.rows * QUERY_ROW_BYTES..],
            SegmentKind::Gather { .. } => &self.payload[..self.rows * 4],
            _ => &[],
        };
        bytes
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    /// Fetch or gather pages (empty otherwise).
    pub fn pages(&self) -> Vec<u32> {
        let bytes = match self.kind {
            SegmentKind::Fetch => self.payload,
            SegmentKind::Gather { .. } => &self.payload[self.rows * 4..],
            _ => &[],
        };
        bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    /// Partial rows this segment contributes to the reply.
    pub fn reply_rows(&self) -> usize {
        match self.kind {
            SegmentKind::Fetch | SegmentKind::Gather { .. } => 0,
            _ => self.rows,
        }
    }
}

/// A parsed request header and its segments (each `Err` where that segment is malformed).
#[derive(Debug)]
pub struct Request<'a> {
    /// The requester's sequence number, echoed in the reply.
    pub seq: u64,
    /// Where in the requester's reply region the reply goes.
    pub reply_offset: u64,
    /// The softmax scale.
    pub scale: f32,
    /// The segments, in order.
    pub segments: Vec<Result<Segment<'a>, Status>>,
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

impl<'a> Request<'a> {
    /// Parses a request from the bytes of an inbox slot. A header that cannot be trusted is an
    /// error for the whole request (with the seq and reply offset, when they could be read, so
    /// the holder can still answer); a bad segment is an error for that segment only.
    pub fn parse(slot: &'a [u8]) -> Result<Self, (Status, Option<(u64, u64)>)> {
        if slot.len() < REQUEST_HEADER {
            return Err((Status::BadLength, None));
        }
        if u32_at(slot, 0) != REQUEST_MAGIC || u16_at(slot, 4) != VERSION {
            return Err((Status::BadHeader, None));
        }
        let (seq, reply_offset) = (u64_at(slot, 8), u64_at(slot, 16));
        let fail = |s| Err((s, Some((seq, reply_offset))));
        let segments = usize::from(u16_at(slot, 6));
        let total = u32_at(slot, 24) as usize;
        let scale = f32::from_le_bytes([slot[28], slot[29], slot[30], slot[31]]);
        if segments == 0 || segments > MAX_SEGMENTS {
            return fail(Status::BadSegment);
        }
        let table_end = REQUEST_HEADER + segments * SEGMENT_BYTES;
        if total > slot.len() || total < table_end {
            return fail(Status::BadLength);
        }
        let body = &slot[..total];
        let parsed = (0..segments)
            .map(|i| parse_segment(body, REQUEST_HEADER + i * SEGMENT_BYTES, table_end))
            .collect();
        Ok(Self {
            seq,
            reply_offset,
            scale,
            segments: parsed,
        })
    }

    /// Partial rows the reply carries (a malformed segment contributes none).
    pub fn reply_rows(&self) -> usize {
        self.segments
            .iter()
            .map(|s| s.as_ref().map_or(0, Segment::reply_rows))
            .sum()
    }
}

fn parse_segment(body: &[u8], at: usize, table_end: usize) -> Result<Segment<'_>, Status> {
    let d = &body[at..at + SEGMENT_BYTES];
    let layer = u16_at(d, 2);
    let chunk = u32_at(d, 4);
    let rows = u32_at(d, 8) as usize;
    let (k, rpt) = (u32_at(d, 12), u32_at(d, 16));
    let (offset, len) = (u32_at(d, 20) as usize, u32_at(d, 24) as usize);
    let end = offset.checked_add(len).ok_or(Status::BadLength)?;
    if offset < table_end || end > body.len() {
        return Err(Status::BadLength);
    }
    let kind = match d[0] {
        1 => SegmentKind::Dense,
        2 => SegmentKind::Sparse {
            k,
            rows_per_token: rpt,
        },
        3 => SegmentKind::Fetch,
        4 => SegmentKind::Gather { first: k },
        _ => return Err(Status::BadSegment),
    };
    let expected = match kind {
        SegmentKind::Dense => rows.checked_mul(QUERY_ROW_BYTES),
        SegmentKind::Sparse { k, rows_per_token } => {
            if rows == 0
                || k == 0
                || rows_per_token == 0
                || !rows.is_multiple_of(rows_per_token as usize)
            {
                return Err(Status::BadSegment);
            }
            (rows / rows_per_token as usize)
                .checked_mul(k as usize)
                .and_then(|n| n.checked_mul(4))
                .and_then(|n| n.checked_add(rows * QUERY_ROW_BYTES))
        }
        SegmentKind::Fetch => rows.checked_mul(4),
        SegmentKind::Gather { first } => {
            if first as usize >= PAGE_TOKENS {
                return Err(Status::BadSegment);
            }
            rows.checked_add(gather_pages(first, rows))
                .and_then(|n| n.checked_mul(4))
        }
    };
    if rows == 0 || expected != Some(len) {
        return Err(Status::BadSegment);
    }
    Ok(Segment {
        kind,
        chunk,
        layer,
        rows,
        payload: &body[offset..end],
    })
}

/// Encodes a reply header and status words into the front of `out` (which must be
/// [`reply_len`] long); the rows follow at [`reply_rows_offset`].
pub fn encode_reply_header(
    out: &mut [u8],
    status: Status,
    seq: u64,
    statuses: &[Status],
    rows: usize,
) {
    out[0..4].copy_from_slice(&REPLY_MAGIC.to_le_bytes());
    out[4..8].copy_from_slice(&(status as u32).to_le_bytes());
    out[8..16].copy_from_slice(&seq.to_le_bytes());
    out[16..18].copy_from_slice(&(statuses.len() as u16).to_le_bytes());
    out[18..20].copy_from_slice(&[0, 0]);
    out[20..24].copy_from_slice(&(rows as u32).to_le_bytes());
    for (i, s) in statuses.iter().enumerate() {
        out[REPLY_HEADER + 4 * i..REPLY_HEADER + 4 * i + 4]
            .copy_from_slice(&(*s as u32).to_le_bytes());
    }
    out[REPLY_HEADER + 4 * statuses.len()..status_end(statuses.len())].fill(0);
}

/// Where each segment's rows are among a reply's rows, given the rows each takes: `(first row
/// per segment, rows in all)`. The layout is fixed by the request, not by which segments
/// were served, so a holder's kernels write their rows into the reply before every status is
/// known. A segment takes its rows whether served or not (a refused one's are zero); a fetch,
/// a gather and a segment the holder could not parse take none. The requester derives the
/// same layout from what it sent (its segments always parse).
pub fn reply_row_layout(rows_of: &[usize]) -> (Vec<usize>, usize) {
    let mut at = 0;
    let first = rows_of
        .iter()
        .map(|&n| {
            let here = at;
            at += n;
            here
        })
        .collect();
    (first, at)
}

/// Where the partial rows start in a reply with `segments` segments.
pub fn reply_rows_offset(segments: usize) -> usize {
    status_end(segments)
}

/// A decoded reply header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplyHeader {
    /// The whole request's status.
    pub status: Status,
    /// The request's sequence number.
    pub seq: u64,
    /// One status per segment (empty when the whole request was refused).
    pub statuses: Vec<Status>,
    /// Partial rows that follow.
    pub rows: usize,
}

/// Decodes a reply's header (from the holder: checked).
pub fn decode_reply_header(bytes: &[u8]) -> Option<ReplyHeader> {
    if bytes.len() < REPLY_HEADER || u32_at(bytes, 0) != REPLY_MAGIC {
        return None;
    }
    let segments = usize::from(u16_at(bytes, 16));
    if segments > MAX_SEGMENTS || bytes.len() < status_end(segments) {
        return None;
    }
    Some(ReplyHeader {
        status: Status::from_u32(u32_at(bytes, 4)),
        seq: u64_at(bytes, 8),
        statuses: (0..segments)
            .map(|i| Status::from_u32(u32_at(bytes, REPLY_HEADER + 4 * i)))
            .collect(),
        rows: u32_at(bytes, 20) as usize,
    })
}

/// How many arrivals of its fetch immediate a requester still expects for a request, from
/// the request's reply (`None`: no reply header for this request could be read) and, per
/// segment, the arrivals it brings if served (0 for routed segments). Only the served
/// segments' writes were sent (protocol version 3: a segment is all or nothing), so that is
/// their sum; a request refused as a whole sent none. An error where the count cannot be
/// known: no header, a status count that differs from the segments sent, or a segment that
/// sent only some of its writes ([`Status::TransferFailed`]).
pub fn served_arrivals(reply: Option<&ReplyHeader>, per_segment: &[u64]) -> Result<u64, String> {
    let header =
        reply.ok_or("a reply with fetch writes outstanding has no header for this request")?;
    if header.status != Status::Ok {
        return Ok(0);
    }
    if header.statuses.len() != per_segment.len() {
        return Err("a reply's status count differs from the segments sent".into());
    }
    if header.statuses.contains(&Status::TransferFailed) {
        return Err("the holder could not send every write of a segment".into());
    }
    Ok(header
        .statuses
        .iter()
        .zip(per_segment)
        .filter(|(s, _)| **s == Status::Ok)
        .map(|(_, n)| n)
        .sum())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Vec<u8> {
        let q = vec![0x3f80u16; 3 * D_QK];
        let idx = vec![0i32, 5, -1, 2, 2, 9];
        let pages = vec![4u32, 5, 6];
        let gathered = [3i32, 0, 3];
        let segs = [
            SegmentSpec {
                kind: SegmentKind::Dense,
                chunk: 7,
                layer: 3,
                queries: QueryRows::Copied(&q[..D_QK]),
                indices: &[],
                pages: &[],
            },
            SegmentSpec {
                kind: SegmentKind::Sparse {
                    k: 3,
                    rows_per_token: 1,
                },
                chunk: 8,
                layer: 0,
                queries: QueryRows::Copied(&q[..2 * D_QK]),
                indices: &idx,
                pages: &[],
            },
            SegmentSpec {
                kind: SegmentKind::Fetch,
                chunk: 9,
                layer: 0,
                queries: QueryRows::Copied(&[]),
                indices: &[],
                pages: &pages,
            },
            // Rows 62, 63 of page 4 and row 0 of page 5.
            SegmentSpec {
                kind: SegmentKind::Gather { first: 62 },
                chunk: 9,
                layer: 2,
                queries: QueryRows::Copied(&[]),
                indices: &gathered,
                pages: &pages[..2],
            },
        ];
        let mut out = Vec::new();
        encode_request(&mut out, 42, 4096, 0.1147, &segs);
        assert_eq!(out.len(), request_len(&segs));
        assert_eq!(reply_rows(&segs), 3);
        out
    }

    #[test]
    fn request_round_trips() {
        let bytes = sample();
        let r = Request::parse(&bytes)
            .map_err(|e| e.0)
            .unwrap_or_else(|s| panic!("{s}"));
        assert_eq!((r.seq, r.reply_offset, r.scale), (42, 4096, 0.1147));
        assert_eq!(r.reply_rows(), 3);
        let segs: Vec<_> = r
            .segments
            .into_iter()
            .map(|s| s.unwrap_or_else(|e| panic!("{e}")))
            .collect();
        assert_eq!(
            (segs[0].kind, segs[0].chunk, segs[0].layer, segs[0].rows),
            (SegmentKind::Dense, 7, 3, 1)
        );
        assert_eq!(segs[0].queries(), vec![0x3f80u16; D_QK]);
        assert_eq!(segs[1].indices(), [0, 5, -1, 2, 2, 9]);
        assert_eq!(segs[1].queries().len(), 2 * D_QK);
        assert_eq!(segs[2].pages(), [4, 5, 6]);
        assert_eq!(
            (
                segs[3].kind,
                segs[3].layer,
                segs[3].rows,
                segs[3].reply_rows()
            ),
            (SegmentKind::Gather { first: 62 }, 2, 3, 0)
        );
        assert_eq!(
            (segs[3].indices(), segs[3].pages()),
            (vec![3, 0, 3], vec![4, 5])
        );
        assert!(segs[3].queries().is_empty() && segs[3].query_words().is_none());
    }

    #[test]
    fn fetch_runs_cover_every_page_once_in_consecutive_runs() {
        let runs = |pages: &[u32]| fetch_runs(pages).collect::<Vec<_>>();
        assert_eq!(runs(&[]), vec![]);
        assert_eq!(runs(&[7]), vec![(0, 1)]);
        assert_eq!(
            runs(&[3, 4, 5, 9, 10, 2, 1]),
            vec![(0, 3), (3, 2), (5, 1), (6, 1)]
        );
        // A run never wraps past u32::MAX, and never exceeds FETCH_RUN_PAGES.
        assert_eq!(runs(&[u32::MAX, 0]), vec![(0, 1), (1, 1)]);
        let long: Vec<u32> = (100..100 + 2 * FETCH_RUN_PAGES as u32 + 5).collect();
        assert_eq!(
            runs(&long),
            vec![
                (0, FETCH_RUN_PAGES),
                (FETCH_RUN_PAGES, FETCH_RUN_PAGES),
                (2 * FETCH_RUN_PAGES, 5)
            ]
        );
    }

    proptest! {
        /// Any page list: the runs tile it in order, each run's pages are consecutive, and
        /// two neighbouring runs could not have been one (unless the first is full).
        #[test]
        fn fetch_runs_tile_any_page_list(pages in proptest::collection::vec(0u32..40, 0..200)) {
            let mut next = 0;
            let mut last: Option<(usize, usize)> = None;
            for (first, count) in fetch_runs(&pages) {
                prop_assert_eq!(first, next);
                prop_assert!((1..=FETCH_RUN_PAGES).contains(&count));
                for i in 1..count {
                    prop_assert_eq!(pages[first + i], pages[first] + i as u32);
                }
                if let Some((f, c)) = last {
                    prop_assert!(
                        c == FETCH_RUN_PAGES || pages[f + c - 1].checked_add(1) != Some(pages[first])
                    );
                }
                last = Some((first, count));
                next = first + count;
            }
            prop_assert_eq!(next, pages.len());
        }
    }

    #[test]
    fn gather_writes_cover_every_row_once_one_write_per_page() {
        for (first, rows) in [
            (0, 1),
            (0, 64),
            (0, 65),
            (63, 1),
            (63, 2),
            (10, 200),
            (5, 1536),
        ] {
            let writes: Vec<_> = gather_writes(first, rows).collect();
            assert_eq!(writes.len(), gather_pages(first, rows), "{first} {rows}");
            let mut next = 0;
            for (i, w) in writes.iter().enumerate() {
                assert_eq!((w.page, w.from), (i, next), "{first} {rows}: {w:?}");
                assert!(w.rows > 0 && w.row + w.rows <= PAGE_TOKENS, "{w:?}");
                // Row `from` of the gather lands at row `first + from` of the page list.
                assert_eq!(w.page * PAGE_TOKENS + w.row, first as usize + w.from);
                next += w.rows;
            }
            assert_eq!(next, rows);
        }
    }

    /// A gather whose first row is past a page, or whose page list is not the span its rows
    /// need, is a bad segment (its neighbours still parse).
    #[test]
    fn forged_gathers_are_bad_segments() {
        let tokens = [1i32, 2, 3];
        let pages = [7u32, 8, 9];
        for (first, n_pages) in [(64u32, 1usize), (62, 1), (0, 2), (63, 3)] {
            let segs = [
                SegmentSpec {
                    kind: SegmentKind::Gather { first },
                    chunk: 0,
                    layer: 0,
                    queries: QueryRows::Copied(&[]),
                    indices: &tokens,
                    pages: &pages[..n_pages],
                },
                SegmentSpec {
                    kind: SegmentKind::Gather { first: 0 },
                    chunk: 0,
                    layer: 0,
                    queries: QueryRows::Copied(&[]),
                    indices: &tokens,
                    pages: &pages[..1],
                },
            ];
            let mut out = Vec::new();
            encode_request(&mut out, 1, 0, 0.1, &segs);
            let r = Request::parse(&out)
                .map_err(|e| e.0)
                .unwrap_or_else(|s| panic!("{s}"));
            assert!(
                matches!(r.segments[0], Err(Status::BadSegment)),
                "first {first}, {n_pages} pages: {:?}",
                r.segments[0]
            );
            assert!(r.segments[1].is_ok());
        }
        assert_eq!(
            (
                gather_pages(0, 64),
                gather_pages(1, 64),
                gather_pages(63, 1)
            ),
            (1, 2, 1)
        );
    }

    /// Each of the 11 statuses survives its word (0 to 10, none skipped); every other word is
    /// `Unknown`.
    #[test]
    fn status_words_round_trip() {
        let mut known = 0;
        for v in 0..64u32 {
            let s = Status::from_u32(v);
            if s == Status::Unknown {
                continue;
            }
            assert_eq!(s as u32, v);
            known += 1;
        }
        assert_eq!(known, 11, "statuses 0..=10 (TransferFailed is the last)");
        assert_eq!(
            Status::from_u32(Status::TransferFailed as u32),
            Status::TransferFailed
        );
        assert_eq!(Status::from_u32(u32::MAX), Status::Unknown);
    }

    /// The arrivals a requester waits for are exactly the served segments' own, whatever
    /// the mix of statuses; a count it cannot know is an error, never a guess.
    #[test]
    fn served_arrivals_count_only_served_segments() {
        let header = |status, statuses: Vec<Status>| ReplyHeader {
            status,
            seq: 1,
            statuses,
            rows: 0,
        };
        let per = [5u64, 0, 7, 3];
        let all_ok = header(Status::Ok, vec![Status::Ok; 4]);
        assert_eq!(served_arrivals(Some(&all_ok), &per), Ok(15));
        let mixed = header(
            Status::Ok,
            vec![Status::Ok, Status::Kernel, Status::BadIndex, Status::Ok],
        );
        assert_eq!(served_arrivals(Some(&mixed), &per), Ok(8));
        let refused = header(Status::ReplyTooLarge, vec![]);
        assert_eq!(served_arrivals(Some(&refused), &per), Ok(0));
        assert!(served_arrivals(None, &per).is_err());
        let short = header(Status::Ok, vec![Status::Ok; 3]);
        assert!(served_arrivals(Some(&short), &per).is_err());
        let partly = header(
            Status::Ok,
            vec![Status::Ok, Status::Ok, Status::TransferFailed, Status::Ok],
        );
        assert!(served_arrivals(Some(&partly), &per).is_err());
    }

    proptest! {
        /// Refusing one more segment lowers the count by exactly that segment's arrivals,
        /// whichever refusal it is; a partly sent segment anywhere makes it unknown.
        #[test]
        fn refusing_a_segment_removes_exactly_its_arrivals(
            words in proptest::collection::vec(0u32..10, 1..12),
            counts in proptest::collection::vec(0u64..1000, 12),
            pick in 0usize..12,
            refusal in 1u32..10,
        ) {
            let statuses: Vec<Status> = words.iter().map(|&w| Status::from_u32(w)).collect();
            let per = &counts[..statuses.len()];
            let at = pick % statuses.len();
            let reply = |statuses: Vec<Status>| ReplyHeader {
                status: Status::Ok,
                seq: 0,
                statuses,
                rows: 0,
            };
            let mut served = statuses.clone();
            served[at] = Status::Ok;
            let mut refused = statuses;
            refused[at] = Status::from_u32(refusal);
            let before = served_arrivals(Some(&reply(served.clone())), per);
            let after = served_arrivals(Some(&reply(refused)), per);
            prop_assert_eq!(after.map(|n| n + per[at]), before);
            served[at] = Status::TransferFailed;
            prop_assert!(served_arrivals(Some(&reply(served)), per).is_err());
        }
    }

    #[test]
    fn reply_header_round_trips() {
        let statuses = [Status::Ok, Status::UnknownChunk, Status::Ok];
        let mut out = vec![0xaa; reply_len(3, 2)];
        encode_reply_header(&mut out, Status::Ok, 9, &statuses, 2);
        let h = decode_reply_header(&out);
        assert_eq!(
            h,
            Some(ReplyHeader {
                status: Status::Ok,
                seq: 9,
                statuses: statuses.to_vec(),
                rows: 2
            })
        );
        assert_eq!(reply_rows_offset(3), 40);
        assert!(decode_reply_header(&out[..10]).is_none());
    }

    #[test]
    fn bad_headers_and_segments_are_refused() {
        let good = sample();
        let mut b = good.clone();
        b[0] ^= 1;
        assert_eq!(
            Request::parse(&b).err().map(|e| e.0),
            Some(Status::BadHeader)
        );
        let mut b = good.clone();
        b[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            Request::parse(&b).err().map(|e| e.0),
            Some(Status::BadLength)
        );
        let mut b = good.clone();
        b[6..8].copy_from_slice(&0u16.to_le_bytes());
        assert_eq!(
            Request::parse(&b).err().map(|e| e.0),
            Some(Status::BadSegment)
        );
        // Segment 1 claims more rows than its payload holds: that segment only is refused.
        let mut b = good.clone();
        let at = REQUEST_HEADER + SEGMENT_BYTES + 8;
        b[at..at + 4].copy_from_slice(&3u32.to_le_bytes());
        let r = Request::parse(&b).map_err(|e| e.0);
        let segs = r.map(|r| {
            r.segments
                .iter()
                .map(|s| s.as_ref().err().copied())
                .collect::<Vec<_>>()
        });
        assert_eq!(segs, Ok(vec![None, Some(Status::BadSegment), None, None]));
        // Payload offset pointing into the header.
        let mut b = good;
        let at = REQUEST_HEADER + 20;
        b[at..at + 4].copy_from_slice(&0u32.to_le_bytes());
        let r = Request::parse(&b).map_err(|e| e.0);
        assert!(r.is_ok_and(|r| r.segments[0].as_ref().err() == Some(&Status::BadLength)));
    }

    #[test]
    fn immediates_round_trip() {
        for (s, n) in [(0u16, 1u64), (7, 2), (65535, 4)] {
            assert_eq!(parse_request_imm(request_imm(s, n)), Some((s, n)));
        }
        assert_eq!(parse_request_imm(0x1234), None);
        for (s, n) in [(0u16, 1u64), (9, 3), (65535, 4)] {
            assert_eq!(parse_ping_imm(ping_imm(s, n)), Some((s, n)));
            // A ping is never taken for a request, nor the other way round.
            assert_eq!(parse_request_imm(ping_imm(s, n)), None);
            assert_eq!(parse_ping_imm(request_imm(s, n)), None);
        }
    }

    #[test]
    fn pings_round_trip_and_other_bytes_are_not_pings() {
        let mut b = [0u8; PING_HEADER];
        for pong in [Pong::Staged, Pong::Written] {
            encode_ping(&mut b, 123_456, 1 << 40, pong);
            assert_eq!(parse_ping(&b), Some((123_456, 1 << 40, pong)));
        }
        assert_eq!(parse_ping(&b[..PING_HEADER - 1]), None);
        assert_eq!(parse_ping(&sample()), None, "a request is not a ping");
    }

    #[test]
    fn query_words_borrow_what_queries_copy() {
        // The payload of the sample's first segment starts at an even offset of an aligned
        // buffer (u64 storage), as in an inbox slot.
        let bytes = sample();
        let mut aligned = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: plain bytes into plain integers of the same total size or more.
        let view = unsafe {
            std::slice::from_raw_parts_mut(aligned.as_mut_ptr().cast::<u8>(), bytes.len())
        };
        view.copy_from_slice(&bytes);
        let req = Request::parse(view).unwrap();
        for seg in req.segments.iter().flatten() {
            match seg.kind {
                SegmentKind::Fetch | SegmentKind::Gather { .. } => {
                    assert_eq!(seg.query_words(), None);
                }
                _ => assert_eq!(seg.query_words().map(<[u16]>::to_vec), Some(seg.queries())),
            }
        }
        // Shifted by one byte the payloads are misaligned: no view, `queries` still works.
        let mut odd = vec![0u8; bytes.len() + 1];
        odd[1..].copy_from_slice(&bytes);
        let req = Request::parse(&odd[1..]).unwrap();
        let seg = req.segments[0].as_ref().unwrap();
        if (seg.payload.as_ptr() as usize) % 2 == 1 {
            assert_eq!(seg.query_words(), None);
        }
        assert_eq!(seg.queries().len(), D_QK);
    }

    proptest! {
        /// Any bytes: parsing never panics, and whatever parses has payloads inside the slot.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600), seed in any::<u64>()) {
            let mut b = sample();
            // Mutate a prefix of a valid request so parsing gets past the magic sometimes.
            for (i, x) in bytes.iter().enumerate() {
                if (seed >> (i % 64)) & 1 == 1 && i < b.len() { b[i] = *x; }
            }
            if let Ok(r) = Request::parse(&b) {
                for s in r.segments.into_iter().flatten() {
                    let _ = (s.queries(), s.indices(), s.pages());
                }
            }
            let _ = Request::parse(&bytes);
            let _ = decode_reply_header(&bytes);
        }
    }
}
