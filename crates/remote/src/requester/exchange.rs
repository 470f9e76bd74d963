//! One exchange with each holder of a step: requests encoded into the link's send staging,
//! posted, and their replies (and the fetch writes the holder served) waited for with one
//! deadline. A holder that misses it, or whose writes fail, is dead for this requester.

use std::net::SocketAddr;
use std::time::Instant;

use kvroute_kernels::layout::PARTIAL_ROW_BYTES;
use kvroute_transport::{CancellationToken, DoneFlag, OnDone, StagedBytes, TransferShape};

use super::{Requester, Unfinished, wait_all};
use crate::error::RouteError;
use crate::observe::Failure;
use crate::wire::{self, SegmentSpec, Status};

/// One request encoded in a link's send staging, not yet posted.
pub(super) struct Prepared {
    pub(super) link: usize,
    /// Where in the send staging (and the reply region) this link's request and reply are.
    pub(super) staged: usize,
    pub(super) len: usize,
    pub(super) reply_len: usize,
    /// Per segment: the fetch-immediate arrivals it brings if the holder serves it (fetch and
    /// gather; 0 for routed segments).
    pub(super) fetch_arrivals: Vec<u64>,
    /// Per segment, where its in-place query rows go in the request (bytes from `staged`);
    /// or why it was not encoded.
    pub(super) in_place: Result<Vec<usize>, RouteError>,
    /// The request's bytes of send staging, lent out until [`Prepared::release_views`] (its in-place
    /// rows are written through it); a request is sent only once it is given back.
    pub(super) view: Option<StagedBytes>,
}

impl Prepared {
    /// Gives the request's staging back, so it can be written out.
    pub(super) fn release_views(prepared: &mut [Prepared]) {
        for p in prepared {
            p.view = None;
        }
    }
}

/// One request to send: its link, its segments and, per segment, how many arrivals of the
/// link's fetch immediate it brings if the holder serves it (0 for a route's segments, which
/// bring none).
pub(super) struct Batch<'a> {
    pub(super) link: usize,
    pub(super) segments: Vec<SegmentSpec<'a>>,
    pub(super) fetch_arrivals: Vec<u64>,
}

impl<'a> Batch<'a> {
    /// A request of route segments only.
    pub(super) fn routes(link: usize, segments: Vec<SegmentSpec<'a>>) -> Self {
        let fetch_arrivals = vec![0; segments.len()];
        Self {
            link,
            segments,
            fetch_arrivals,
        }
    }

    /// Adds a segment that brings `arrivals` fetch immediates if served.
    pub(super) fn push(&mut self, segment: SegmentSpec<'a>, arrivals: u64) {
        self.segments.push(segment);
        self.fetch_arrivals.push(arrivals);
    }
}

impl Requester {
    /// Sends each batch's request and waits for its reply and, for its fetch and gather
    /// segments the holder served, their arrivals of the link's fetch immediate. Returns
    /// where each reply landed: (offset, length) in `replies`.
    pub(super) fn exchange(
        &mut self,
        batches: Vec<Batch<'_>>,
    ) -> Vec<Result<(usize, usize), RouteError>> {
        let mut prepared = self.prepare(batches);
        Prepared::release_views(&mut prepared);
        self.send(&prepared)
    }

    /// Encodes each batch's request into its link's send staging (the first half of
    /// [`Requester::exchange`]); [`QueryRows::InPlace`] rows are left for the caller to write.
    pub(super) fn prepare(&mut self, batches: Vec<Batch<'_>>) -> Vec<Prepared> {
        let mut out = Vec::with_capacity(batches.len());
        for Batch {
            link,
            segments,
            fetch_arrivals,
        } in batches
        {
            let l = &mut self.links[link];
            l.seq += 1;
            let len = wire::request_len(&segments);
            let reply_len = wire::reply_len(segments.len(), wire::reply_rows(&segments));
            let limit = self.config.link_bytes.min(l.welcome.slot_bytes as usize);
            let stage = l.io.as_ref().map(|io| io.stage);
            let staged = stage.unwrap_or(0) * self.config.link_bytes;
            let mut view = None;
            let encoded = if stage.is_none() {
                Err(RouteError::HolderFailed {
                    holder: l.addr,
                    why: "marked dead earlier".into(),
                })
            } else if len > limit
                || reply_len > self.config.link_bytes.min(l.welcome.reply_bytes as usize)
            {
                Err(RouteError::TooLarge(len.max(reply_len)))
            } else {
                let encode_started = Instant::now();
                // A range taken over from a session that ended may still be read by that
                // session's last write: waited for, up to the timeout.
                let encoded = self
                    .send
                    .bytes_mut_within(staged, len, self.config.timeout)
                    .map(|mut buf| {
                        let offsets = wire::encode_request_into(
                            &mut buf,
                            l.seq,
                            l.welcome.token,
                            // The reply lands at the start of this link's own region.
                            0,
                            self.config.scale,
                            &segments,
                        );
                        view = Some(buf);
                        offsets
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
                view,
            });
        }
        out
    }

    /// Posts each prepared request and waits for every reply (the second half of
    /// [`Requester::exchange`]).
    pub(super) fn send(
        &mut self,
        prepared: &[Prepared],
    ) -> Vec<Result<(usize, usize), RouteError>> {
        let deadline = Instant::now() + self.config.timeout;
        self.landed.clear();
        let mut waits = Vec::new();
        let mut out: Vec<Result<(usize, usize), RouteError>> = Vec::new();
        for p in prepared {
            if let Err(e) = &p.in_place {
                out.push(Err(e.clone()));
                waits.push(None);
                continue;
            }
            let l = &self.links[p.link];
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
            let submitted = self.send.submit_write(
                (p.staged, p.len),
                Some(imm),
                (&l.welcome.inbox, l.welcome.slot_offset),
                OnDone::flag(&sent_flag),
            );
            match submitted {
                Ok(()) => {
                    // Until its reply has landed and been copied out.
                    out.push(Err(RouteError::HolderFailed {
                        holder: l.addr,
                        why: "no reply".into(),
                    }));
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
            let control = self.links[link].control();
            let failure = match wait_all(
                &self.engine,
                &[&sent, &reply],
                deadline,
                self.config.spin,
                control,
            ) {
                Err(e) => {
                    let reason = match e {
                        Unfinished::Late(_) => Failure::Timeout,
                        Unfinished::Closed(_) => Failure::Closed,
                    };
                    Some((
                        reason,
                        e.describe(&["send completion", "reply"], self.config.timeout),
                    ))
                }
                Ok(()) => match sent.result() {
                    Some(Err(e)) => {
                        Some((Failure::WriteFailed, format!("request write failed: {e}")))
                    }
                    _ => self
                        .copy_reply(&prepared[i])
                        .and_then(|range| {
                            out[i] = Ok(range);
                            self.await_fetch_writes(&prepared[i], range, deadline, &token)
                        })
                        .err()
                        .map(|why| (Failure::Fetch, why)),
                },
            };
            if let Some((reason, why)) = failure {
                crate::observe::holder_failure(reason);
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
        (at, len): (usize, usize),
        deadline: Instant,
        token: &CancellationToken,
    ) -> Result<(), String> {
        if p.fetch_arrivals.iter().all(|&n| n == 0) {
            return Ok(());
        }
        let l = &self.links[p.link];
        let bytes = &self.landed[at..at + len];
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
        wait_all(
            &self.engine,
            &[&flag],
            deadline,
            self.config.spin,
            l.control(),
        )
        .map_err(|e| e.describe(&["fetch pages"], self.config.timeout))
    }

    /// Copies link `p.link`'s reply, whose immediate has been counted, out of its region to
    /// the end of the requester's landed replies; returns where it lies there. A copy, so the
    /// holder (which may write its region whenever it likes) cannot change what is checked
    /// and decoded from it.
    fn copy_reply(&mut self, p: &Prepared) -> Result<(usize, usize), String> {
        let io = self.links[p.link]
            .io
            .as_ref()
            .ok_or_else(|| format!("the session of link {} has ended", p.link))?;
        let at = self.landed.len();
        io.reply
            .append_to(0, p.reply_len, &mut self.landed)
            .map_err(|e| format!("reading the reply: {e}"))?;
        Ok((at, p.reply_len))
    }

    /// The bytes of a reply [`Requester::exchange`] reported: its copy in the landed replies.
    pub(super) fn reply_bytes(
        &self,
        holder: SocketAddr,
        (offset, len): (usize, usize),
    ) -> Result<&[u8], RouteError> {
        offset
            .checked_add(len)
            .and_then(|end| self.landed.get(offset..end))
            .ok_or_else(|| RouteError::BadReply {
                holder,
                why: format!("no landed reply at [{offset}, {offset}+{len})"),
            })
    }
}

/// A reply checked against what was asked ([`decode_reply`]).
pub(super) struct Reply<'a> {
    /// One per segment sent.
    pub(super) statuses: Vec<Status>,
    /// The holder's kernel-time claim (unchecked: see [`wire::kernel_us_within`]).
    pub(super) kernel_us: f32,
    /// The partial rows, as many as the statuses promise, in their wire encoding.
    pub(super) rows: &'a [u8],
}

/// Checks a reply against what was asked: magic, the request's seq, one status per segment,
/// and as many rows as the statuses promise.
pub(super) fn decode_reply(
    holder: SocketAddr,
    seq: u64,
    bytes: &[u8],
    segments: usize,
) -> Result<Reply<'_>, RouteError> {
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
    Ok(Reply {
        statuses: header.statuses,
        kernel_us: header.kernel_us,
        rows,
    })
}
