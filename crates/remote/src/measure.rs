//! Measurements of the protocol on a live holder, beside baselines from the same run:
//! [`route_sample`] times one route three ways (the transport's raw write round trip of the
//! same bytes, the copying route, the zero-copy route) with the holder's own account of its
//! kernel and serving time, and [`CopyFloor`] is the byte conversions' memory floor. What
//! `kvroute sweep` is built on; behind the `measure` feature, as are the written pongs and
//! codec timers it reads.

use std::time::Instant;

use kvroute_kernels::layout::{D_LATENT, D_QK, PARTIAL_ROW_BYTES, QUERY_ROW_BYTES};
use kvroute_kernels::{Partial, merge_wire};
use kvroute_kvstore::ChunkId;
use serde::Serialize;

use crate::error::RemoteError;
use crate::requester::{Call, Requester, StagedCall};
use crate::wire;

/// One route sample.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RouteSample {
    /// Query rows.
    pub mq: u32,
    /// Request bytes (one write).
    pub request_bytes: usize,
    /// Reply bytes (one write).
    pub reply_bytes: usize,
    /// Raw write round trip of the same bytes, microseconds.
    pub raw_us: f64,
    /// The same raw round trip with a pong the holder has just written ([`wire::Pong::Written`],
    /// as a route's reply rows always are), the holder's writing taken out, microseconds.
    #[serde(default)]
    pub written_raw_us: f64,
    /// Route round trip, submit to decoded partial, microseconds.
    pub route_us: f64,
    /// The holder's kernel time for this request, microseconds.
    pub kernel_us: f64,
    /// The holder's time serving this request (parse, kernel, encode, post), microseconds.
    pub serve_us: f64,
    /// Of `serve_us`, encoding the partial rows to bf16, microseconds.
    pub holder_encode_us: f64,
    /// The requester's copy of the query rows into the request, microseconds.
    pub requester_encode_us: f64,
    /// The requester's decode and validation of the reply rows, microseconds.
    pub requester_decode_us: f64,
    /// Baseline for the three conversions, this run: one `memcpy` that reads and writes as
    /// many bytes as they do together ([`CODEC_BYTES_PER_ROW`] per row), from caches evicted
    /// as the holder's kernel evicts them, microseconds.
    pub copy_floor_us: f64,
    /// The same route with no byte conversion on the requester, right after it in the same
    /// rep: staging the request ([`Requester::stage`]), sending it and checking the reply in
    /// place ([`crate::StagedRoute::route_wire`], `m` and `l` of every row), microseconds. Excludes
    /// the producer writing the query rows into staging (`producer_us`).
    pub zero_copy_us: f64,
    /// The holder's kernel time for that request, microseconds.
    pub zero_copy_kernel_us: f64,
    /// The producer's write of the query rows into registered staging (here a `memcpy` from
    /// the sweep's rows; in a model, the query projection's output), microseconds.
    pub producer_us: f64,
    /// Merging that one partial from its wire rows into f32 ([`merge_wire`], for one part an
    /// exact decode: the cost model's merge term), microseconds.
    pub merge_us: f64,
}

/// Bytes the route's byte conversions read plus write per query row: the query copy (1152 in,
/// 1152 out), the holder's bf16 encode (2048 f32 + 8 in, 1032 out) and the requester's
/// decode (1032 in, 2048 + 8 out).
pub const CODEC_BYTES_PER_ROW: usize =
    2 * QUERY_ROW_BYTES + 2 * (D_LATENT * 4 + 8 + PARTIAL_ROW_BYTES);

/// The baseline of [`RouteSample::copy_floor_us`]: a cold `memcpy` of the codec's bytes.
#[derive(Debug)]
pub struct CopyFloor {
    evict: Vec<u8>,
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl CopyFloor {
    /// Buffers for up to `max_rows` rows, and 64 MiB to evict them with.
    pub fn new(max_rows: usize) -> Self {
        let n = max_rows * CODEC_BYTES_PER_ROW / 2;
        Self {
            evict: vec![1; 64 << 20],
            src: vec![2; n],
            dst: vec![0; n],
        }
    }

    /// Reads 64 MiB (evicting the copy's buffers from every private cache), then times the
    /// copy of `rows` rows' worth of bytes.
    pub fn us(&mut self, rows: usize) -> f64 {
        let n = (rows * CODEC_BYTES_PER_ROW / 2).min(self.src.len());
        let sum: u64 = self.evict.iter().step_by(64).map(|&b| u64::from(b)).sum();
        std::hint::black_box(sum);
        let started = Instant::now();
        self.dst[..n].copy_from_slice(&self.src[..n]);
        std::hint::black_box(&self.dst);
        started.elapsed().as_secs_f64() * 1e6
    }
}

impl RouteSample {
    /// Byte conversions (query copy, bf16 encode, decode) that a GPU deployment does in
    /// kernels: the part of the overhead that grows with the bytes.
    pub fn codec_us(&self) -> f64 {
        self.holder_encode_us + self.requester_encode_us + self.requester_decode_us
    }
}

/// The order of `reps` repetitions over `points` points, as (repetition, point): one sample
/// of every point per repetition, in alternating directions, so each point follows its
/// neighbours (or itself) and never the far end of the sweep.
pub fn interleaved(reps: usize, points: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..reps).flat_map(move |rep| {
        (0..points).map(move |i| (rep, if rep % 2 == 0 { i } else { points - 1 - i }))
    })
}

/// One Mq point of a route sweep: its rows (routed to chunk 0, layer 0, of holder 0), the
/// local kernel's partial for them (every route is checked against it), and the partials its
/// routes decode and merge into (reused every repetition, as a decode loop would).
#[derive(Debug)]
pub struct RoutePointState {
    /// Query rows.
    pub mq: u32,
    /// The rows, `mq * 576` bf16 bits.
    pub q: Vec<u16>,
    /// The local kernel's partial over the same chunk layer.
    pub local: Partial,
    got: [Partial; 1],
    merged: Partial,
}

impl RoutePointState {
    /// A point of `q` (`mq` rows) whose routes must match `local`.
    pub fn new(mq: u32, q: Vec<u16>, local: Partial) -> Self {
        Self {
            mq,
            q,
            local,
            got: [Partial::empty(mq as usize)],
            merged: Partial::empty(mq as usize),
        }
    }
}

/// One repetition at one Mq point against holder 0: the staged ping, the written ping, the
/// copying route, then the zero-copy route, each checked; with the worst difference from the
/// local kernel. A holder that served anything else meanwhile (its counters say so) is an
/// error: its times would not be this request's.
pub fn route_sample(
    requester: &mut Requester,
    p: &mut RoutePointState,
    copy_floor_us: f64,
) -> Result<(RouteSample, f32), RemoteError> {
    let mq = p.mq;
    let call = Call {
        chunk: ChunkId(0),
        layer: 0,
        queries: &p.q,
        sparse: None,
    };
    let request_bytes = wire::REQUEST_HEADER + wire::SEGMENT_BYTES + p.q.len() * 2;
    let reply_bytes = wire::reply_len(1, mq as usize);
    let raw = requester.ping(0, request_bytes, reply_bytes, wire::Pong::Staged)?;
    let unwritten = requester.holder_stats(0)?;
    let written = requester.ping(0, request_bytes, reply_bytes, wire::Pong::Written)?;
    let before = requester.holder_stats(0)?;
    let pong_write_us = before.pong_write_us - unwritten.pong_write_us;
    let codec = requester.codec_times();
    let started = Instant::now();
    let done = requester.route_into(&[call], &mut p.got).remove(0);
    let route_us = started.elapsed().as_secs_f64() * 1e6;
    let codec_after = requester.codec_times();
    let after = requester.holder_stats_counting(0, before.requests + 1)?;
    done?;
    let mut worst = max_abs(&p.got[0], &p.local);
    if after.requests != before.requests + 1 {
        return Err(RemoteError::Probe(format!(
            "the holder served {} requests for one route",
            after.requests - before.requests
        )));
    }
    let zero_copy = zero_copy_route(requester, &p.q, &mut p.merged)?;
    let after_zc = requester.holder_stats_counting(0, after.requests + 1)?;
    if after_zc.requests != after.requests + 1 {
        return Err(RemoteError::Probe(format!(
            "the holder served {} requests for one zero-copy route",
            after_zc.requests - after.requests
        )));
    }
    worst = worst.max(max_abs(&p.merged, &p.local));
    let sample = RouteSample {
        mq,
        request_bytes,
        reply_bytes,
        raw_us: raw.as_secs_f64() * 1e6,
        written_raw_us: written.as_secs_f64() * 1e6 - pong_write_us,
        route_us,
        kernel_us: after.kernel_us - before.kernel_us,
        serve_us: after.serve_us - before.serve_us,
        holder_encode_us: after.encode_us - before.encode_us,
        requester_encode_us: codec_after.encode_us - codec.encode_us,
        requester_decode_us: codec_after.decode_us - codec.decode_us,
        copy_floor_us,
        zero_copy_us: zero_copy.route_us,
        zero_copy_kernel_us: after_zc.kernel_us - after.kernel_us,
        producer_us: zero_copy.producer_us,
        merge_us: zero_copy.merge_us,
    };
    Ok((sample, worst))
}

/// Times of one [`zero_copy_route`].
struct ZeroCopy {
    route_us: f64,
    producer_us: f64,
    merge_us: f64,
}

/// Routes `q` to chunk 0 layer 0 with no byte conversion on the requester: the rows are
/// written into registered staging by their "producer" (timed apart, not part of the route),
/// the reply is checked where it landed, then merged from its wire rows into `merged`.
fn zero_copy_route(
    requester: &mut Requester,
    q: &[u16],
    merged: &mut Partial,
) -> Result<ZeroCopy, RemoteError> {
    let call = StagedCall {
        chunk: ChunkId(0),
        layer: 0,
        rows: q.len() / D_QK,
        sparse: None,
    };
    let started = Instant::now();
    let mut staged = requester.stage(&[call]);
    let stage_us = started.elapsed().as_secs_f64() * 1e6;
    let produced = Instant::now();
    staged
        .queries_mut(0)
        .ok_or_else(|| RemoteError::Probe("no staging for the query rows".into()))?
        .copy_from_slice(q);
    let producer_us = produced.elapsed().as_secs_f64() * 1e6;
    let sent = Instant::now();
    let routed = staged.route_wire();
    let part = routed.partial(0)?;
    let route_us = stage_us + sent.elapsed().as_secs_f64() * 1e6;
    let merging = Instant::now();
    merge_wire(&[part], merged)?;
    let merge_us = merging.elapsed().as_secs_f64() * 1e6;
    Ok(ZeroCopy {
        route_us,
        producer_us,
        merge_us,
    })
}

/// Max abs difference of two partials' `o` (infinite when their shapes differ).
pub fn max_abs(a: &Partial, b: &Partial) -> f32 {
    if a.o.len() != b.o.len() {
        return f32::INFINITY;
    }
    a.o.iter()
        .zip(&b.o)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repetitions_visit_every_point_once_each_in_alternating_directions() {
        let order: Vec<_> = interleaved(3, 4).collect();
        assert_eq!(order.len(), 12);
        for rep in 0..3 {
            let mut seen: Vec<usize> = order.iter().filter(|o| o.0 == rep).map(|o| o.1).collect();
            let walked = seen.clone();
            seen.sort_unstable();
            assert_eq!(seen, [0, 1, 2, 3], "repetition {rep}");
            let forward = walked.windows(2).all(|w| w[0] < w[1]);
            assert_eq!(forward, rep % 2 == 0, "repetition {rep} walks {walked:?}");
        }
        // No point follows the far end of the sweep.
        assert!(order.windows(2).all(|w| w[0].1.abs_diff(w[1].1) <= 1));
        assert_eq!(interleaved(0, 4).count(), 0);
        assert_eq!(interleaved(2, 0).count(), 0);
    }

}
