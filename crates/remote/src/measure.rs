//! Measurements of the protocol on a live holder, beside baselines from the same run:
//! [`route_sample`] times one route three ways (the transport's raw write round trip of the
//! same bytes, the copying route, the zero-copy route) with the holder's own account of its
//! kernel and serving time, and [`CopyFloor`] is the byte conversions' memory floor. What
//! `kvroute sweep` is built on; behind the `measure` feature, as are the written pongs and
//! codec timers it reads.

use std::sync::{Arc, Barrier};
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
    /// The same raw round trip with a pong the holder has just written ([`crate::Pong::Written`],
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
    let after = requester.holder_stats(0)?;
    done?;
    let mut worst = max_abs(&p.got[0], &p.local);
    if after.requests != before.requests + 1 {
        return Err(RemoteError::Probe(format!(
            "the holder served {} requests for one route",
            after.requests - before.requests
        )));
    }
    let zero_copy = zero_copy_route(requester, &p.q, &mut p.merged)?;
    let after_zc = requester.holder_stats(0)?;
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

/// One fetch sample.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FetchSample {
    /// Chunk tokens.
    pub ct: u32,
    /// Bytes pulled (every layer).
    pub bytes: u64,
    /// Submit to the last page landed, microseconds.
    pub transfer_us: f64,
    /// The in-place splice, microseconds.
    pub splice_us: f64,
}

/// One round of N concurrent requesters.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConcurrencySample {
    /// Requesters.
    pub n: u32,
    /// Each requester's round trip, microseconds.
    pub route_us: Vec<f64>,
    /// Kernel calls the holder made for the round.
    pub kernel_calls: u64,
    /// Its kernel time for the round, microseconds.
    pub kernel_us: f64,
    /// Rows it attended.
    pub rows: u64,
}

/// `reps` rounds of `requesters` (each on a thread of its own, `rows[i]` its query rows)
/// routing to chunk 0, layer 0, of their holder at the same moment (a barrier), the holder's
/// counters read between rounds through `control`, a session of its own on the same holder;
/// `on_round` is called after each round.
pub fn concurrent_rounds(
    control: &mut Requester,
    requesters: &mut [Requester],
    rows: &[Vec<u16>],
    reps: u32,
    on_round: &mut dyn FnMut(),
) -> Result<Vec<ConcurrencySample>, RemoteError> {
    let n = requesters.len() as u32;
    let barrier = Arc::new(Barrier::new(requesters.len() + 1));
    std::thread::scope(|scope| {
        let handles: Vec<_> = requesters
            .iter_mut()
            .zip(rows)
            .map(|(r, q)| {
                let barrier = barrier.clone();
                scope.spawn(move || -> Result<Vec<f64>, RemoteError> {
                    let mut times = Vec::new();
                    let mut part = [Partial::empty(0)];
                    for _ in 0..reps {
                        barrier.wait();
                        let started = Instant::now();
                        let call = Call {
                            chunk: ChunkId(0),
                            layer: 0,
                            queries: q,
                            sparse: None,
                        };
                        let got = r.route_into(&[call], &mut part).remove(0);
                        times.push(started.elapsed().as_secs_f64() * 1e6);
                        barrier.wait();
                        got?;
                    }
                    Ok(times)
                })
            })
            .collect();
        let mut rounds = Vec::new();
        let mut failed = None;
        for _ in 0..reps {
            let before = control.holder_stats(0);
            barrier.wait();
            barrier.wait();
            // Every requester has its reply, so the holder has counted every batch.
            let after = control.holder_stats(0);
            match (before, after) {
                (Ok(b), Ok(a)) => rounds.push(ConcurrencySample {
                    n,
                    route_us: Vec::new(),
                    kernel_calls: a.kernel_calls - b.kernel_calls,
                    kernel_us: a.kernel_us - b.kernel_us,
                    rows: a.rows - b.rows,
                }),
                (Err(e), _) | (_, Err(e)) => failed = Some(e),
            }
            on_round();
        }
        for (i, h) in handles.into_iter().enumerate() {
            let times = h
                .join()
                .map_err(|_| RemoteError::Probe(format!("requester thread {i} panicked")))??;
            for (round, t) in rounds.iter_mut().zip(times) {
                round.route_us.push(t);
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(rounds),
        }
    })
}

/// Medians of one Mq point.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoutePoint {
    /// Query rows.
    pub mq: u32,
    /// Route round trip.
    pub route_us: f64,
    /// Raw write round trip of the same bytes.
    pub raw_us: f64,
    /// Holder kernel.
    pub kernel_us: f64,
    /// Route minus kernel: what the fabric model prices.
    pub transport_us: f64,
    /// Route - raw - kernel (median of the per-sample differences).
    pub overhead_us: f64,
    /// Of it, the holder's part: serve - kernel.
    pub holder_overhead_us: f64,
    /// Of it, byte conversions on both sides (see [`RouteSample`]).
    pub codec_us: f64,
    /// Overhead minus byte conversions: bookkeeping, posting, polling, wake-ups.
    pub rest_us: f64,
    /// A cold `memcpy` of the conversions' bytes (their floor on this machine, this run).
    pub copy_floor_us: f64,
    /// The zero-copy route ([`RouteSample::zero_copy_us`]).
    pub zero_copy_us: f64,
    /// Raw round trip with a freshly written pong ([`RouteSample::written_raw_us`]).
    pub written_raw_us: f64,
    /// `zero_copy_us - written_raw_us -` its kernel: the host overhead against a baseline
    /// whose reply bytes are as fresh as the route's.
    pub zero_copy_written_overhead_us: f64,
    /// Its host overhead: zero-copy route - raw - its kernel (median of per-sample values).
    pub zero_copy_overhead_us: f64,
    /// The merge of its partial from wire rows ([`RouteSample::merge_us`]).
    pub merge_us: f64,
    /// The fitted model at this Mq.
    pub model_us: f64,
}

/// Medians of one ct point.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FetchPoint {
    /// Chunk tokens.
    pub ct: u32,
    /// Bytes pulled.
    pub bytes: u64,
    /// Transfer.
    pub transfer_us: f64,
    /// Splice.
    pub splice_us: f64,
    /// Transfer plus splice (median of sums).
    pub total_us: f64,
    /// Bytes per transfer time, GB/s.
    pub gbps: f64,
}

/// Medians of one N.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConcurrencyPoint {
    /// Requesters.
    pub n: u32,
    /// Rows routed per round (N x rows each).
    pub rows: u32,
    /// Holder kernel time per call.
    pub kernel_us_per_call: f64,
    /// Rows per holder kernel call (N x rows when every request of a round was batched).
    pub rows_per_call: f64,
    /// Holder kernel time per round.
    pub kernel_us_per_round: f64,
    /// One in-process kernel call over all N x rows rows (no transport), the same run.
    pub kernel_alone_us: f64,
    /// Median requester round trip.
    pub route_us: f64,
}

impl RoutePoint {
    /// The medians of `samples` at `mq` (the model line is left NaN for the fit to fill).
    pub fn of(mq: u32, samples: &[RouteSample]) -> Self {
        let s: Vec<&RouteSample> = samples.iter().filter(|s| s.mq == mq).collect();
        let pick =
            |f: &dyn Fn(&RouteSample) -> f64| median(&s.iter().map(|x| f(x)).collect::<Vec<_>>());
        RoutePoint {
            mq,
            route_us: pick(&|x| x.route_us),
            raw_us: pick(&|x| x.raw_us),
            kernel_us: pick(&|x| x.kernel_us),
            transport_us: pick(&|x| x.route_us - x.kernel_us),
            overhead_us: pick(&|x| x.route_us - x.raw_us - x.kernel_us),
            holder_overhead_us: pick(&|x| x.serve_us - x.kernel_us),
            codec_us: pick(&|x| x.codec_us()),
            rest_us: pick(&|x| x.route_us - x.raw_us - x.kernel_us - x.codec_us()),
            copy_floor_us: pick(&|x| x.copy_floor_us),
            zero_copy_us: pick(&|x| x.zero_copy_us),
            zero_copy_overhead_us: pick(&|x| x.zero_copy_us - x.raw_us - x.zero_copy_kernel_us),
            written_raw_us: pick(&|x| x.written_raw_us),
            zero_copy_written_overhead_us: pick(&|x| {
                x.zero_copy_us - x.written_raw_us - x.zero_copy_kernel_us
            }),
            merge_us: pick(&|x| x.merge_us),
            model_us: f64::NAN,
        }
    }
}

impl FetchPoint {
    /// The medians of `samples` at `ct`.
    pub fn of(ct: u32, samples: &[FetchSample]) -> Self {
        let s: Vec<&FetchSample> = samples.iter().filter(|s| s.ct == ct).collect();
        let transfer = median(&s.iter().map(|x| x.transfer_us).collect::<Vec<_>>());
        let bytes = s.first().map_or(0, |x| x.bytes);
        FetchPoint {
            ct,
            bytes,
            transfer_us: transfer,
            splice_us: median(&s.iter().map(|x| x.splice_us).collect::<Vec<_>>()),
            total_us: median(
                &s.iter()
                    .map(|x| x.transfer_us + x.splice_us)
                    .collect::<Vec<_>>(),
            ),
            gbps: bytes as f64 / (transfer * 1e3),
        }
    }
}

impl ConcurrencyPoint {
    /// The medians of `samples` with `n` requesters routing `rows` rows in all, beside one
    /// in-process kernel call over the same rows (`alone_us`).
    pub fn of(n: u32, rows: u32, alone_us: f64, samples: &[ConcurrencySample]) -> Self {
        let s: Vec<&ConcurrencySample> = samples.iter().filter(|s| s.n == n).collect();
        ConcurrencyPoint {
            n,
            rows,
            kernel_us_per_call: median(
                &s.iter()
                    .map(|x| x.kernel_us / x.kernel_calls.max(1) as f64)
                    .collect::<Vec<_>>(),
            ),
            rows_per_call: median(
                &s.iter()
                    .map(|x| x.rows as f64 / x.kernel_calls.max(1) as f64)
                    .collect::<Vec<_>>(),
            ),
            kernel_us_per_round: median(&s.iter().map(|x| x.kernel_us).collect::<Vec<_>>()),
            kernel_alone_us: alone_us,
            route_us: median(
                &s.iter()
                    .flat_map(|x| x.route_us.clone())
                    .collect::<Vec<_>>(),
            ),
        }
    }
}

/// The median of the finite values of `v` (NaN if none): the workspace's one median,
/// [`kvroute_costmodel::fit::median`], over them.
pub fn median(v: &[f64]) -> f64 {
    let mut finite: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    kvroute_costmodel::fit::median(&mut finite).unwrap_or(f64::NAN)
}

pub use crate::checked::max_abs;

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
