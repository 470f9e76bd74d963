//! Route (paper 000 section 2.1): a decode step's calls grouped one request per holder, the
//! query rows copied or written in place into registered staging, the partial rows answered
//! where the request fixed them.

use std::net::SocketAddr;
use std::time::Instant;

use kvroute_kernels::layout::{D_QK, PARTIAL_ROW_BYTES};
use kvroute_kernels::{Partial, WirePartial};
use kvroute_kvstore::ChunkId;

use super::Requester;
use super::exchange::{Batch, Prepared, decode_reply};
use crate::error::RouteError;
use crate::wire::{self, QueryRows, SegmentKind, SegmentSpec, Status};

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

impl<'r> StagedRoute<'r> {
    /// Call `c`'s query rows (`rows * 576` bf16 bits as native words; the wire is
    /// little-endian and the send puts them in its order), in registered staging, for its
    /// producer to fill; `None` where the call cannot be sent (its error comes back from
    /// `route_into` or `route_wire`). Rows not written keep what staging held.
    pub fn queries_mut(&mut self, c: usize) -> Option<&mut [u16]> {
        let (b, seg) = *self.calls.get(c)?.as_ref().ok()?;
        let rows = self.rows[c];
        query_rows(&mut self.prepared[b], seg, rows)
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
            mut prepared,
        } = self;
        if cfg!(target_endian = "big") {
            // `queries_mut` hands out native words; the wire is little-endian.
            for (c, at) in calls.iter().enumerate() {
                let Ok((b, seg)) = at else { continue };
                if let Some(words) = query_rows(&mut prepared[*b], *seg, rows[c]) {
                    words.iter_mut().for_each(|w| *w = w.to_le());
                }
            }
        }
        Prepared::release_views(&mut prepared);
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
                let reply = decode_reply(holder, seq, bytes, segs.len())?;
                Ok(ReplyRows {
                    start: offset + wire::reply_rows_offset(segs.len()),
                    len: reply.rows.len(),
                    kernel_us: reply.kernel_us,
                    statuses: reply.statuses,
                })
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
                let reply = decoded[b].as_ref().map_err(Clone::clone)?;
                if reply.statuses[seg] != Status::Ok {
                    return Err(RouteError::Refused {
                        holder,
                        status: reply.statuses[seg],
                    });
                }
                // Every segment's rows are at the place the request fixed, served or not
                // (`wire::reply_row_layout`).
                let from = firsts[b][seg] * PARTIAL_ROW_BYTES;
                let n = rows[c] * PARTIAL_ROW_BYTES;
                if from + n > reply.len {
                    return Err(RouteError::BadReply {
                        holder,
                        why: "fewer rows than asked for".into(),
                    });
                }
                Ok(CallRows {
                    offset: reply.start + from,
                    len: n,
                    holder,
                    kernel_us: reply.kernel_us,
                })
            })
            .collect();
        requester.codec.decode_us += started.elapsed().as_secs_f64() * 1e6;
        Routed { requester, ranges }
    }
}

/// A request's reply as a route reads it.
struct ReplyRows {
    /// One per segment.
    statuses: Vec<Status>,
    /// Where its rows start in the reply region, and their bytes.
    start: usize,
    len: usize,
    /// The holder's kernel-time claim.
    kernel_us: f32,
}

/// Where one call's rows are.
#[derive(Debug, Clone)]
struct CallRows {
    /// Their range in the reply region.
    offset: usize,
    len: usize,
    /// The holder that wrote them.
    holder: SocketAddr,
    /// The kernel time its reply header claims.
    kernel_us: f32,
}

/// What a [`StagedRoute`] brought back: each call's partial rows where they landed, in their
/// wire encoding, or why the call failed. The rows stay valid (and unwritten) while this
/// lives: it holds the requester, and a holder writes a link's reply range only in answer to
/// the next request.
pub struct Routed<'r> {
    requester: &'r mut Requester,
    /// Per call: where its rows are, or why it failed.
    ranges: Vec<Result<CallRows, RouteError>>,
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

    /// The time the holder's kernels ran in the batch that served call `c`, as its reply
    /// claims it, bounded to `round_trip_us` (the route's measured time: a holder's word never
    /// makes a route look faster than free); `None` if the call
    /// failed.
    ///
    /// # Panics
    /// If `c` is not a call of this route.
    pub fn holder_kernel_us(&self, c: usize, round_trip_us: f64) -> Option<f64> {
        let claimed = self.ranges[c].as_ref().ok()?.kernel_us;
        Some(wire::kernel_us_within(claimed, round_trip_us))
    }

    /// Call `c`'s rows and the holder that wrote them.
    fn rows(&self, c: usize) -> Result<(&[u8], SocketAddr), RouteError> {
        let at = self.ranges[c].clone()?;
        let bytes = self.requester.reply_bytes(at.holder, (at.offset, at.len))?;
        Ok((bytes, at.holder))
    }
}

impl Requester {
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
                            windows: &[],
                        }
                    })
                    .collect::<Vec<_>>();
                Batch::routes(*link, segs)
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
}

/// Segment `seg`'s `rows` in-place query rows of request `p`, in its lent staging.
fn query_rows(p: &mut Prepared, seg: usize, rows: usize) -> Option<&mut [u16]> {
    let at = *p.in_place.as_ref().ok()?.get(seg)?;
    if !at.is_multiple_of(2) {
        return None;
    }
    let words = p.view.as_mut()?.u16s_mut().ok()?;
    words.get_mut(at / 2..at / 2 + rows * D_QK)
}
