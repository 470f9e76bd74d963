//! The step's transfers: fetching a chunk (from a replica if its holder is lost), routing
//! every routed pair in one round with one fallback, gathering the selected rows, and the
//! query rotation that lets a holder's stored rows be attended at a request's placement.

use std::time::Instant;

use kvroute_kernels::Partial;
use kvroute_kernels::layout::D_QK;
use kvroute_kvstore::ChunkId;

use super::{ChunkRef, GatheredRows, Pair, StepError, StepReport, StepRequest, Stepper};
use crate::error::RouteError;
use crate::requester::{Call, GatherPart, Sparse};

impl Stepper {
    /// Fetches `chunk` spliced to `start..`, from a replica if its first holder is lost.
    pub(super) fn fetch(
        &mut self,
        chunk: ChunkId,
        start: i64,
        report: &mut StepReport,
    ) -> Result<crate::requester::Fetched, StepError> {
        let tokens = self.req.entry(chunk).ok().map_or(0, |e| e.positions.len());
        let to: Vec<i64> = (0..tokens as i64).map(|i| start + i).collect();
        let mut lost = Vec::new();
        for _ in 0..2 {
            match self
                .req
                .fetch(chunk, &to, self.config.rope, self.config.backend)
            {
                Ok(f) => {
                    let bytes = self
                        .config
                        .model
                        .chunk_bytes(tokens as u32, f.layers as u32);
                    let now = self.cal.now_ms();
                    self.cal.selector.observe_pull(bytes, f.transfer_us, now);
                    self.stats.chunk_fetches += 1;
                    self.stats.fetched_bytes += bytes as u64;
                    return Ok(f);
                }
                Err(e) if e.holder_lost() => {
                    report.fallbacks.push((chunk, e.to_string()));
                    self.stats.fallbacks += 1;
                    lost.push(e.to_string());
                }
                Err(RouteError::NoHolder(_)) => break,
                Err(source) => return Err(StepError::Chunk { chunk, source }),
            }
        }
        Err(StepError::NoCopy {
            chunk,
            why: if lost.is_empty() {
                "no live holder".into()
            } else {
                lost.join("; ")
            },
        })
    }

    /// The query rows a pair sends to (or attends with) the chunk's stored rows: rotated by
    /// `-(start - stored start)`, or `None` where the delta is 0.
    pub(super) fn rotated(&self, q: &StepRequest<'_>, c: &ChunkRef<'_>) -> Option<Vec<u16>> {
        let (stored, _) = self.stored_start(c.chunk)?;
        let delta = c.start - stored;
        if delta == 0 {
            return None;
        }
        let angles = self.config.rope.angles(-delta);
        let mut rows = q.queries.to_vec();
        for row in rows.chunks_exact_mut(D_QK) {
            kvroute_kernels::rope::rotate_row_f64(row, &angles, self.config.rope.layout());
        }
        Some(rows)
    }

    /// Routes the pairs `routes` in one round (one request per holder), re-sending once the
    /// calls of a lost holder; one partial per pair.
    pub(super) fn route(
        &mut self,
        layer: u16,
        requests: &[StepRequest<'_>],
        routes: &[&Pair],
        report: &mut StepReport,
    ) -> Result<Vec<Partial>, StepError> {
        let rotated: Vec<Option<Vec<u16>>> = routes
            .iter()
            .map(|p| {
                let q = &requests[p.request];
                self.rotated(q, &q.chunks[p.at])
            })
            .collect();
        let calls: Vec<Call<'_>> = routes
            .iter()
            .zip(&rotated)
            .map(|(p, rot)| {
                let q = &requests[p.request];
                let c = &q.chunks[p.at];
                Call {
                    chunk: c.chunk,
                    layer,
                    queries: rot.as_deref().unwrap_or(q.queries),
                    sparse: c.picks.map(|s| Sparse {
                        indices: s.indices,
                        k: s.k as u32,
                        rows_per_token: q.heads as u32,
                    }),
                }
            })
            .collect();
        // Rows per holder (the selector prices a route by the rows one holder serves).
        let mut per_holder: Vec<(usize, u32)> = Vec::new();
        for call in &calls {
            if let Ok(h) = self.req.holder_for(call.chunk) {
                let rows = (call.queries.len() / D_QK) as u32;
                match per_holder.iter_mut().find(|(x, _)| *x == h) {
                    Some((_, n)) => *n += rows,
                    None => per_holder.push((h, rows)),
                }
            }
        }
        let mut out: Vec<Option<Partial>> = vec![None; calls.len()];
        let mut pending: Vec<usize> = (0..calls.len()).collect();
        let started = Instant::now();
        for retry in [false, true] {
            if pending.is_empty() {
                break;
            }
            let subset: Vec<Call<'_>> = pending.iter().map(|&i| calls[i]).collect();
            let round = Instant::now();
            let routed = self.req.stage_copied(&subset).route_wire();
            let round_us = round.elapsed().as_secs_f64() * 1e6;
            let kernel_us = (0..subset.len())
                .filter_map(|j| routed.holder_kernel_us(j, round_us))
                .fold(0.0, f64::max);
            let mut failed = Vec::new();
            for (j, &i) in pending.iter().enumerate() {
                match routed.partial(j) {
                    Ok(w) => {
                        let mut p = Partial::empty(0);
                        kvroute_kernels::merge_wire(&[w], &mut p)?;
                        out[i] = Some(p);
                    }
                    Err(error) if !retry && error.holder_lost() => {
                        report.fallbacks.push((calls[i].chunk, error.to_string()));
                        self.stats.fallbacks += 1;
                        failed.push(i);
                    }
                    Err(error)
                        if error.holder_lost() || matches!(error, RouteError::NoHolder(_)) =>
                    {
                        return Err(StepError::NoCopy {
                            chunk: calls[i].chunk,
                            why: error.to_string(),
                        });
                    }
                    Err(source) => {
                        return Err(StepError::Chunk {
                            chunk: calls[i].chunk,
                            source,
                        });
                    }
                }
            }
            if !retry && failed.is_empty() {
                // A clean round: the fabric's part of it, at the most rows one holder served.
                if let Some(&(_, rows)) = per_holder.iter().max_by_key(|(_, n)| *n) {
                    let now = self.cal.now_ms();
                    self.cal
                        .selector
                        .observe_route(rows, (round_us - kernel_us).max(0.0), now);
                }
            }
            pending = failed;
        }
        report.route_us = started.elapsed().as_secs_f64() * 1e6;
        out.into_iter()
            .zip(&calls)
            .map(|(p, c)| {
                p.ok_or(StepError::NoCopy {
                    chunk: c.chunk,
                    why: "no reply".into(),
                })
            })
            .collect()
    }

    /// Gathers the selected rows of every pair in `gathers` for `layer` (each pair's distinct
    /// valid indices once, pair after pair), re-trying once if a holder is lost. Returns the
    /// rows and, per pair, each of its picks' slot among them; `None` where every pick is
    /// padding (those pairs attend nothing).
    pub(super) fn gather(
        &mut self,
        layer: u16,
        requests: &[StepRequest<'_>],
        gathers: &[&Pair],
        report: &mut StepReport,
    ) -> Result<Option<GatheredRows>, StepError> {
        let started = Instant::now();
        let mut tokens: Vec<Vec<i32>> = Vec::with_capacity(gathers.len());
        let mut remapped: Vec<Vec<i32>> = Vec::with_capacity(gathers.len());
        let mut offset = 0i32;
        for p in gathers {
            let c = &requests[p.request].chunks[p.at];
            let picks = c.picks.ok_or_else(|| StepError::Request {
                request: p.request,
                why: format!("chunk {}: gathered without picks", c.chunk),
            })?;
            let mut distinct: Vec<i32> =
                picks.indices.iter().copied().filter(|&i| i >= 0).collect();
            distinct.sort_unstable();
            distinct.dedup();
            let map = picks
                .indices
                .iter()
                .map(|&i| {
                    if i < 0 {
                        -1
                    } else {
                        // Present: `distinct` holds every valid index.
                        offset + distinct.binary_search(&i).unwrap_or(0) as i32
                    }
                })
                .collect();
            offset += distinct.len() as i32;
            tokens.push(distinct);
            remapped.push(map);
        }
        let parts: Vec<GatherPart<'_>> = gathers
            .iter()
            .zip(&tokens)
            .filter(|(_, t)| !t.is_empty())
            .map(|(p, t)| GatherPart {
                chunk: requests[p.request].chunks[p.at].chunk,
                tokens: t,
            })
            .collect();
        if parts.is_empty() {
            // Every pick is padding: nothing to gather; the pairs attend nothing.
            return Ok(None);
        }
        let mut last = None;
        for _ in 0..2 {
            match self.req.gather(&parts, &[layer]) {
                Ok(rows) => {
                    report.gather_us = started.elapsed().as_secs_f64() * 1e6;
                    return Ok(Some(GatheredRows { rows, remapped }));
                }
                Err(e) if e.holder_lost() => {
                    let chunk = parts[0].chunk;
                    report.fallbacks.push((chunk, e.to_string()));
                    self.stats.fallbacks += 1;
                    last = Some(e);
                }
                Err(RouteError::NoHolder(chunk)) => {
                    return Err(StepError::NoCopy {
                        chunk,
                        why: "no live holder".into(),
                    });
                }
                Err(source) => {
                    return Err(StepError::Chunk {
                        chunk: parts[0].chunk,
                        source,
                    });
                }
            }
        }
        // A lost holder twice: name a chunk none of whose holders answers.
        let dead = parts
            .iter()
            .find(|p| self.req.live_replicas(p.chunk).is_empty())
            .unwrap_or(&parts[0])
            .chunk;
        Err(StepError::NoCopy {
            chunk: dead,
            why: last.map_or_else(String::new, |e| e.to_string()),
        })
    }
}
