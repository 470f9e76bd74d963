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

use kvroute_kernels::layout::{D_QK, PAGE_TOKENS, QUERY_ROW_BYTES};
use kvroute_kvstore::BlockLayout;

/// "KVRQ", little-endian.
pub const REQUEST_MAGIC: u32 = u32::from_le_bytes(*b"KVRQ");
/// "KVRP", little-endian.
pub const REPLY_MAGIC: u32 = u32::from_le_bytes(*b"KVRP");
/// The protocol version this build speaks. 2: reply rows sit where the request fixes them
/// ([`reply_row_layout`]). 3: a fetch or gather segment is all or nothing (a refused one sent
/// no writes; [`Status::TransferFailed`] otherwise), which the requester's exact count of
/// fetch arrivals relies on, and a fetch is one write per run of consecutive pages
/// ([`fetch_runs`]), not per page. 4: every request and ping carries its session's token
/// (the secret of [`crate::session::Welcome::token`]) and a sequence number that grows with
/// each, so a holder answers only the session's owner, and each write of its slot once. 5: a
/// reply header says how long the holder's kernels ran in the batch that served the request
/// ([`ReplyHeader::kernel_us`]), so a requester can take compute out of a round trip without
/// asking for the holder's shared counters. 6: a session is served only after its requester
/// proved, with a [`encode_proof`] message the transport attributes to the hello's address,
/// that the address is its own. 7: a fetch or gather segment carries the [`PoolWindow`]s its
/// writes land through (grants of just their bytes, each with a key of its own), and the pool
/// itself takes no peer write. An older peer is refused.
pub const VERSION: u16 = 7;
/// Bytes of a request header.
pub const REQUEST_HEADER: usize = 48;
/// Bytes of one segment descriptor.
pub const SEGMENT_BYTES: usize = 32;
/// Bytes of a reply header (before the status words).
pub const REPLY_HEADER: usize = 32;
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

/// "KVPF", little-endian: a proof message.
pub const PROOF_MAGIC: u32 = u32::from_le_bytes(*b"KVPF");
/// Bytes of a proof message: magic, version (u16), session (u16), the session's token (u64).
pub const PROOF_BYTES: usize = 16;

/// The message a requester sends from its engine to the holder's (a two-sided send) to prove
/// that the engine address its hello named is its own: the holder's transport names the
/// sender of each message it receives, and the session is served only if that sender is
/// the hello's address and the message carries the session's token (which only the
/// session's control connection knows).
pub fn encode_proof(session: u16, token: u64) -> [u8; PROOF_BYTES] {
    let mut out = [0u8; PROOF_BYTES];
    out[0..4].copy_from_slice(&PROOF_MAGIC.to_le_bytes());
    out[4..6].copy_from_slice(&VERSION.to_le_bytes());
    out[6..8].copy_from_slice(&session.to_le_bytes());
    out[8..16].copy_from_slice(&token.to_le_bytes());
    out
}

/// Reads a proof message: `(session, token)`, or `None` for anything else.
pub fn parse_proof(bytes: &[u8]) -> Option<(u16, u64)> {
    let b: &[u8; PROOF_BYTES] = bytes.try_into().ok()?;
    let magic = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let version = u16::from_le_bytes([b[4], b[5]]);
    (magic == PROOF_MAGIC && version == VERSION).then(|| {
        (
            u16::from_le_bytes([b[6], b[7]]),
            u64::from_le_bytes(b[8..16].try_into().unwrap_or_default()),
        )
    })
}

/// "KVPG", little-endian: the header of a ping whose pong is sent from staging as it is.
pub const PING_MAGIC: u32 = u32::from_le_bytes(*b"KVPG");
/// "KVPW", little-endian: the header of a ping whose pong bytes the holder writes first.
pub const PING_WRITTEN_MAGIC: u32 = u32::from_le_bytes(*b"KVPW");
/// Bytes of a ping header: magic, reply length (u32), reply offset (u64), the session's
/// token (u64), the sequence number (u64).
pub const PING_HEADER: usize = 32;

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

/// A ping, as the requester asks for it and the holder parses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ping {
    /// Bytes the pong carries.
    pub reply_len: u32,
    /// Where in the requester's reply region the pong goes.
    pub reply_offset: u64,
    /// Where the pong's bytes come from.
    pub pong: Pong,
    /// The session's token.
    pub token: u64,
    /// The requester's sequence number (shared with its requests).
    pub seq: u64,
}

/// Writes a ping header into the first [`PING_HEADER`] bytes of `out`.
pub fn encode_ping(out: &mut [u8], ping: &Ping) {
    let magic = match ping.pong {
        Pong::Staged => PING_MAGIC,
        Pong::Written => PING_WRITTEN_MAGIC,
    };
    out[..4].copy_from_slice(&magic.to_le_bytes());
    out[4..8].copy_from_slice(&ping.reply_len.to_le_bytes());
    out[8..16].copy_from_slice(&ping.reply_offset.to_le_bytes());
    out[16..24].copy_from_slice(&ping.token.to_le_bytes());
    out[24..32].copy_from_slice(&ping.seq.to_le_bytes());
}

/// Parses a ping header, or `None` if it is not one.
pub fn parse_ping(bytes: &[u8]) -> Option<Ping> {
    if bytes.len() < PING_HEADER {
        return None;
    }
    let pong = match u32_at(bytes, 0) {
        PING_MAGIC => Pong::Staged,
        PING_WRITTEN_MAGIC => Pong::Written,
        _ => return None,
    };
    Some(Ping {
        reply_len: u32_at(bytes, 4),
        reply_offset: u64_at(bytes, 8),
        pong,
        token: u64_at(bytes, 16),
        seq: u64_at(bytes, 24),
    })
}

/// The session token and sequence number of a request header (its first
/// [`REQUEST_HEADER`] bytes), or `None` if it is not a request of this version. Read before
/// anything else of the request: a holder answers only a request with its session's token
/// and a sequence number it has not served.
pub fn request_credentials(header: &[u8]) -> Option<(u64, u64)> {
    (header.len() >= REQUEST_HEADER
        && u32_at(header, 0) == REQUEST_MAGIC
        && u16_at(header, 4) == VERSION)
        .then(|| (u64_at(header, 32), u64_at(header, 8)))
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

/// The writes a fetch of a chunk served from a paged KV cache of `block_tokens`-token blocks
/// is sent as: layer by layer, the chunk's tokens cut wherever a holder block or a requester
/// pool page ends, so each piece is contiguous on both sides whatever the block table says
/// (blocks below 64 tokens give several writes per pool page, blocks above it one per page).
/// Padding rows are not sent. Holder and requester both derive them from the layout and
/// `block_tokens` alone, so both know how many immediates come.
pub fn fetch_pieces(layout: BlockLayout, block_tokens: u32) -> impl Iterator<Item = FetchPiece> {
    let block = block_tokens.max(1);
    let per_layer = layout.pages_per_layer();
    (0..layout.layers).flat_map(move |layer| {
        let mut token = 0u32;
        std::iter::from_fn(move || {
            if token >= layout.tokens {
                return None;
            }
            let page_end = (token / PAGE_TOKENS as u32 + 1) * PAGE_TOKENS as u32;
            let block_end = (token / block + 1).saturating_mul(block);
            let end = page_end.min(block_end).min(layout.tokens);
            let piece = FetchPiece {
                layer,
                token,
                rows: end - token,
                page: layer as usize * per_layer + token as usize / PAGE_TOKENS,
                row: token as usize % PAGE_TOKENS,
            };
            token = end;
            Some(piece)
        })
    })
}

/// One write of a fetch from a paged holder (see [`fetch_pieces`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchPiece {
    /// The layer.
    pub layer: u32,
    /// The first token written.
    pub token: u32,
    /// Tokens written.
    pub rows: u32,
    /// Index into the fetch's page list of the page they land in.
    pub page: usize,
    /// The row of that page the first lands in.
    pub row: usize,
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

/// A window of the requester's pool that a fetch or gather segment's writes land through: a
/// [`kvroute_transport::Grant`] of just the bytes that segment fills, as the holder is told
/// it. The pool's own descriptor (in the hello) takes no write, so a holder can write only
/// where the segments sent to it land, and only until the requester drops the grants.
#[derive(Debug, Clone, Copy)]
pub struct PoolWindow<'a> {
    /// Where the window starts in the pool, bytes.
    pub offset: u64,
    /// What a write through it presents (its address, length and one key per NIC).
    pub desc: &'a kvroute_transport::MrDesc,
}

/// Bytes of one window on the wire with `keys` keys (offset, length, address, keys).
pub const fn window_bytes(keys: usize) -> usize {
    24 + 8 * keys
}

/// The most NIC keys one window carries.
pub const MAX_WINDOW_KEYS: usize = 16;

/// The most windows one segment carries.
pub const MAX_WINDOWS: usize = 4096;

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
    /// Fetch and gather: the windows of the pool the writes land through, each with as many
    /// keys as the others (none for other kinds).
    pub windows: &'a [PoolWindow<'a>],
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

pub(crate) fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

mod reply;
mod request;

pub use reply::*;
pub use request::*;

#[cfg(test)]
mod tests;
