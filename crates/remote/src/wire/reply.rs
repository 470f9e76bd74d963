//! Replies: a header, one status word per segment, then every partial row at the place the
//! request fixed ([`reply_row_layout`]); and the requester's count of fetch arrivals a reply
//! says are coming ([`served_arrivals`]).

use kvroute_kernels::layout::PARTIAL_ROW_BYTES;

use super::*;

/// Bytes of a reply with `segments` segments and `rows` partial rows.
pub fn reply_len(segments: usize, rows: usize) -> usize {
    status_end(segments) + rows * PARTIAL_ROW_BYTES
}

/// Bytes of a request that routes `rows` query rows as one segment: with [`reply_len`]`(1,
/// rows)`, what a holder's slot and reply staging and a requester's link must hold for it
/// (`HolderConfig::slot_bytes`, `reply_bytes`, `RequesterConfig::link_bytes`).
pub fn route_request_len(rows: usize) -> usize {
    REQUEST_HEADER + SEGMENT_BYTES + rows * kvroute_kernels::layout::QUERY_ROW_BYTES
}

pub(crate) fn status_end(segments: usize) -> usize {
    (REPLY_HEADER + segments * 4).next_multiple_of(8)
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

/// Encodes a reply header and status words into the front of `out` (which must be
/// [`reply_len`] long); the rows follow at [`reply_rows_offset`]. `kernel_us`: the
/// microseconds the holder's kernels ran in the batch that served the request.
pub fn encode_reply_header(
    out: &mut [u8],
    (status, seq): (Status, u64),
    statuses: &[Status],
    rows: usize,
    kernel_us: f32,
) {
    out[0..4].copy_from_slice(&REPLY_MAGIC.to_le_bytes());
    out[4..8].copy_from_slice(&(status as u32).to_le_bytes());
    out[8..16].copy_from_slice(&seq.to_le_bytes());
    out[16..18].copy_from_slice(&(statuses.len() as u16).to_le_bytes());
    out[18..20].copy_from_slice(&[0, 0]);
    out[20..24].copy_from_slice(&(rows as u32).to_le_bytes());
    out[24..28].copy_from_slice(&kernel_us.to_le_bytes());
    out[28..32].fill(0);
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
#[derive(Debug, Clone, PartialEq)]
pub struct ReplyHeader {
    /// The whole request's status.
    pub status: Status,
    /// The request's sequence number.
    pub seq: u64,
    /// One status per segment (empty when the whole request was refused).
    pub statuses: Vec<Status>,
    /// Partial rows that follow.
    pub rows: usize,
    /// Microseconds the holder says its kernels ran in the batch that served the request
    /// (other sessions' requests batched with it included: they delayed this reply too).
    /// From the peer: [`ReplyHeader::kernel_us_within`] bounds it before use.
    pub kernel_us: f32,
}

impl ReplyHeader {
    /// [`ReplyHeader::kernel_us`] as a time that can be taken out of a round trip of
    /// `round_trip_us`: a NaN, negative or infinite claim counts as 0, and no claim exceeds
    /// the round trip (a holder's word cannot make a route look faster than free).
    pub fn kernel_us_within(&self, round_trip_us: f64) -> f64 {
        kernel_us_within(self.kernel_us, round_trip_us)
    }
}

/// [`ReplyHeader::kernel_us_within`] of a claim.
pub fn kernel_us_within(claimed: f32, round_trip_us: f64) -> f64 {
    let claimed = f64::from(claimed);
    if claimed.is_finite() && claimed > 0.0 {
        claimed.min(round_trip_us.max(0.0))
    } else {
        0.0
    }
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
        kernel_us: f32::from_bits(u32_at(bytes, 24)),
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
