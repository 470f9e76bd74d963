//! Requests: the requester encodes its segments into one write ([`encode_request_into`]); the
//! holder parses a slot's bytes into a [`Request`], checking every length, offset and count
//! before anything is used.

use kvroute_kernels::layout::QUERY_ROW_BYTES;

use super::*;

/// Bytes of a request carrying `segments`.
pub fn request_len(segments: &[SegmentSpec<'_>]) -> usize {
    REQUEST_HEADER
        + segments.len() * SEGMENT_BYTES
        + segments.iter().map(payload_len).sum::<usize>()
}

/// Keys per window of `s` (every window carries as many: the first's).
fn keys_per_window(s: &SegmentSpec<'_>) -> usize {
    s.windows.first().map_or(0, |w| w.desc.rkeys.len())
}

/// Payload bytes of `s`: query rows, indices, pages, windows.
fn payload_len(s: &SegmentSpec<'_>) -> usize {
    s.queries.bytes()
        + s.indices.len() * 4
        + s.pages.len() * 4
        + s.windows.len() * window_bytes(keys_per_window(s))
}

/// Partial rows a reply to `segments` carries.
pub fn reply_rows(segments: &[SegmentSpec<'_>]) -> usize {
    segments.iter().map(|s| s.queries.rows()).sum()
}

/// Encodes a request into `out` (cleared first).
pub fn encode_request(
    out: &mut Vec<u8>,
    seq: u64,
    token: u64,
    reply_offset: u64,
    scale: f32,
    segments: &[SegmentSpec<'_>],
) {
    out.clear();
    out.resize(request_len(segments), 0);
    encode_request_into(out, seq, token, reply_offset, scale, segments);
}

/// Encodes a request into `out`, which must be exactly [`request_len`] bytes (a staging
/// range of registered memory, so the request is written once, where the NIC reads it).
/// Returns where in `out` the [`QueryRows::InPlace`] segments' rows go, in segment order
/// (2-byte aligned: every offset before them is a multiple of 4); their bytes are left as
/// they were.
///
/// # Panics
/// If `out` is not [`request_len`] bytes, or a segment's windows carry different numbers of
/// keys, more than [`MAX_WINDOW_KEYS`] or more than [`MAX_WINDOWS`] windows (a caller's bug,
/// not a peer's input).
pub fn encode_request_into(
    out: &mut [u8],
    seq: u64,
    token: u64,
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
    out[32..40].copy_from_slice(&token.to_le_bytes());
    let mut payload = REQUEST_HEADER + segments.len() * SEGMENT_BYTES;
    for (i, s) in segments.iter().enumerate() {
        let (kind, k, rpt) = match s.kind {
            SegmentKind::Dense => (1u8, 0, 0),
            SegmentKind::Sparse { k, rows_per_token } => (2, k, rows_per_token),
            SegmentKind::Fetch => (3, 0, 0),
            SegmentKind::Gather { first } => (4, first, 0),
        };
        let len = payload_len(s);
        let keys = keys_per_window(s);
        assert!(
            s.windows.len() <= MAX_WINDOWS
                && keys <= MAX_WINDOW_KEYS
                && s.windows.iter().all(|w| w.desc.rkeys.len() == keys),
            "a segment's windows carry at most {MAX_WINDOW_KEYS} keys each, as many each"
        );
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
        d[28..30].copy_from_slice(&(s.windows.len() as u16).to_le_bytes());
        d[30] = keys as u8;
        d[31] = 0;
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
        for w in s.windows {
            let d = &mut out[at..][..window_bytes(keys_per_window(s))];
            d[0..8].copy_from_slice(&w.offset.to_le_bytes());
            d[8..16].copy_from_slice(&w.desc.len.to_le_bytes());
            d[16..24].copy_from_slice(&w.desc.addr.to_le_bytes());
            for (k, key) in d[24..].chunks_exact_mut(8).zip(&w.desc.rkeys) {
                k.copy_from_slice(&key.rkey.to_le_bytes());
            }
            at += d.len();
        }
    }
    debug_assert_eq!(at, total);
    in_place
}

/// Stores `words` little-endian at the start of `out`; returns the bytes written. `le` is the
/// integer type's `to_le_bytes`. On a little-endian host this is one `memcpy` (the query rows
/// of a 256-row request are 288 KiB: the element-wise loop cost twice the copy,
/// docs/perf.md).
pub(crate) fn put_le<T: bytemuck::NoUninit, const N: usize>(
    out: &mut [u8],
    words: &[T],
    le: fn(T) -> [u8; N],
) -> usize {
    let n = words.len() * N;
    let out = &mut out[..n];
    if cfg!(target_endian = "little") && std::mem::size_of::<T>() == N {
        // `T` is `N` bytes (checked above) with no padding (`NoUninit`), and `le` is its
        // `to_le_bytes`: on a little-endian host its bytes are already the wire's.
        out.copy_from_slice(bytemuck::cast_slice::<T, u8>(words));
    } else {
        for (d, &x) in out.chunks_exact_mut(N).zip(words) {
            d.copy_from_slice(&le(x));
        }
    }
    n
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
    /// The payload bytes: query rows then indices, pages, or indices then pages (without
    /// the windows).
    pub payload: &'a [u8],
    /// Fetch and gather: the windows' bytes ([`Segment::windows`]).
    pub windows: &'a [u8],
    /// Keys each window carries.
    pub window_keys: usize,
}

/// A window of the requester's pool as a segment names it ([`PoolWindow`] on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window<'a> {
    /// Where it starts in the pool, bytes.
    pub offset: u64,
    /// Its length, bytes.
    pub len: u64,
    /// The address a write through it names.
    pub addr: u64,
    keys: &'a [u8],
}

impl Window<'_> {
    /// Its keys, one per NIC, NIC 0 first.
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.keys.chunks_exact(8).map(|k| u64_at(k, 0))
    }

    /// Whether pool bytes `at..at + len` lie inside it.
    pub fn covers(&self, at: u64, len: u64) -> bool {
        at >= self.offset
            && at
                .checked_add(len)
                .zip(self.offset.checked_add(self.len))
                .is_some_and(|(end, window_end)| end <= window_end)
    }
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
        bytemuck::try_cast_slice::<u8, u16>(&self.payload[..n]).ok()
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

    /// The windows of the pool its writes land through (fetch and gather; none otherwise).
    pub fn windows(&self) -> impl Iterator<Item = Window<'_>> + '_ {
        self.windows
            .chunks_exact(window_bytes(self.window_keys))
            .map(|w| Window {
                offset: u64_at(w, 0),
                len: u64_at(w, 8),
                addr: u64_at(w, 16),
                keys: &w[24..],
            })
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
    /// The session's token.
    pub token: u64,
    /// Where in the requester's reply region the reply goes.
    pub reply_offset: u64,
    /// The softmax scale.
    pub scale: f32,
    /// The segments, in order.
    pub segments: Vec<Result<Segment<'a>, Status>>,
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
            token: u64_at(slot, 32),
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

pub(crate) fn parse_segment(
    body: &[u8],
    at: usize,
    table_end: usize,
) -> Result<Segment<'_>, Status> {
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
    let (windows, window_keys) = (usize::from(u16_at(d, 28)), usize::from(d[30]));
    let window_len = match kind {
        SegmentKind::Fetch | SegmentKind::Gather { .. }
            if windows <= MAX_WINDOWS
                && window_keys <= MAX_WINDOW_KEYS
                && (windows == 0) == (window_keys == 0)
                && d[31] == 0 =>
        {
            windows * window_bytes(window_keys)
        }
        SegmentKind::Dense | SegmentKind::Sparse { .. }
            if windows == 0 && d[30] == 0 && d[31] == 0 =>
        {
            0
        }
        _ => return Err(Status::BadSegment),
    };
    if rows == 0 || expected.and_then(|n| n.checked_add(window_len)) != Some(len) {
        return Err(Status::BadSegment);
    }
    let (payload, windows) = body[offset..end].split_at(len - window_len);
    Ok(Segment {
        kind,
        chunk,
        layer,
        rows,
        payload,
        windows,
        window_keys,
    })
}
