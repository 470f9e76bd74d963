//! Fetch (the whole chunk into the pool, spliced to the requester's positions) and gather
//! (the selected rows of several holders' chunks into pool pages, for sparse attention).

use std::time::Instant;

use kvroute_kernels::layout::PAGE_TOKENS;
use kvroute_kernels::{Backend, Cache, Rope, SpliceJob, splice};
use kvroute_kvstore::{ChunkId, PAGE_BYTES, ROW_BYTES};
use kvroute_transport::{Grant, MrDesc, TransferShape, TransportError};

use super::Requester;
use super::exchange::{Batch, decode_reply};
use crate::error::{RemoteError, RouteError};
use crate::wire::{self, PoolWindow, QueryRows, SegmentKind, SegmentSpec, Status};

/// A chunk fetched into the pool and spliced to the requester's positions.
#[derive(Debug)]
pub struct Fetched {
    /// The chunk.
    pub chunk: ChunkId,
    /// Pool pages, layer-major (`layers * ceil(tokens / 64)`).
    pub pages: Vec<u32>,
    /// Tokens per layer.
    pub tokens: usize,
    /// Layers.
    pub layers: usize,
    /// Time from submitting the fetch to the last page landing, microseconds.
    pub transfer_us: f64,
    /// Time of the in-place splice, microseconds.
    pub splice_us: f64,
}

/// The selected tokens of one chunk, for [`Requester::gather`].
#[derive(Debug, Clone, Copy)]
pub struct GatherPart<'a> {
    /// The chunk.
    pub chunk: ChunkId,
    /// Chunk-local token indices (duplicates are sent twice, as a gather would).
    pub tokens: &'a [i32],
}

/// Rows gathered by [`Requester::gather`]: for each layer asked, the selected rows of every
/// part back to back (part order, token order), in pool pages.
#[derive(Debug)]
pub struct Gathered {
    /// Pool pages, layer-major (`layers.len() * ceil(rows / 64)`).
    pub pages: Vec<u32>,
    /// Rows per layer.
    pub rows: usize,
    /// The layers, in the order asked.
    pub layers: Vec<u16>,
    /// Time from submitting the requests to the last row landing, microseconds.
    pub transfer_us: f64,
}

impl Requester {
    /// Fetches `chunk` from a live holder into the pool (one write per run of consecutive
    /// pool pages, or where the holder serves from a paged cache, per piece of a block
    /// within a pool page; one immediate expectation for the whole pull) and re-rotates it in place to `to` (the requester's
    /// positions for its tokens), with `rope`, the rotation the chunk was stored with.
    pub fn fetch(
        &mut self,
        chunk: ChunkId,
        to: &[i64],
        rope: Rope,
        backend: Backend,
    ) -> Result<Fetched, RouteError> {
        let link = self.link_for(chunk)?;
        let entry = self.entry(chunk)?.clone();
        let layout = entry.layout;
        let holder = self.links[link].addr;
        let pages = self
            .pool
            .alloc(layout.pages())
            .map_err(|e| RouteError::HolderFailed {
                holder,
                why: format!("pool: {e}"),
            })?;
        let started = Instant::now();
        // The holder may write these pages and nothing else of the pool, until the grants go.
        let grants = match self.grant_rows(&pages, 0, pages.len() * PAGE_TOKENS) {
            Ok(g) => g,
            Err(e) => {
                let _ = self.pool.release(&pages);
                return Err(RouteError::HolderFailed {
                    holder,
                    why: format!("pool grant: {e}"),
                });
            }
        };
        let windows = windows(&grants);
        let seg = SegmentSpec {
            kind: SegmentKind::Fetch,
            chunk: chunk.0,
            layer: 0,
            queries: QueryRows::Copied(&[]),
            indices: &[],
            pages: &pages,
            windows: &windows,
        };
        let write = |len: u64| {
            self.engine
                .expected_arrivals(TransferShape::SingleWrite { len })
        };
        let arrivals: u64 = match entry.block_tokens {
            0 => wire::fetch_runs(&pages)
                .map(|(_, count)| write((count * PAGE_BYTES) as u64))
                .sum(),
            block => wire::fetch_pieces(layout, block)
                .map(|p| write(u64::from(p.rows) * ROW_BYTES as u64))
                .sum(),
        };
        let batch = Batch {
            link,
            segments: vec![seg],
            fetch_arrivals: vec![arrivals],
        };
        let reply = self.exchange(vec![batch]).pop();
        // Every write of the fetch was counted, or its link given up: from here no write of
        // the holder's lands in the pool.
        drop(windows);
        drop(grants);
        let reply = reply.unwrap_or(Err(RouteError::NoHolder(chunk)));
        let seq = self.links[link].seq;
        let status = reply
            .and_then(|range| self.reply_bytes(holder, range))
            .and_then(|bytes| decode_reply(holder, seq, bytes, 1).map(|r| r.statuses));
        match status {
            Ok(s) if s[0] == Status::Ok => {}
            Ok(s) => {
                let _ = self.pool.release(&pages);
                return Err(RouteError::Refused {
                    holder,
                    status: s[0],
                });
            }
            Err(e) => {
                // Even a link given up with writes in flight cannot land them: its grants are
                // gone.
                let _ = self.pool.release(&pages);
                return Err(e);
            }
        }
        let transfer_us = started.elapsed().as_secs_f64() * 1e6;
        let started = Instant::now();
        // Every grant of this fetch was dropped (deregistered) above, so no peer can write
        // the pool; the view is refused otherwise.
        let pool = self
            .pool_mem
            .u16s_mut(0, self.pool.bytes() / 2)
            .map_err(|e| RouteError::HolderFailed {
                holder,
                why: e.to_string(),
            })?;
        let job = SpliceJob::in_place(
            layout.layers as usize,
            &entry.positions,
            to,
            rope,
            pool,
            &pages,
        )
        .and_then(|job| splice(backend, job));
        if let Err(e) = job {
            let _ = self.pool.release(&pages);
            return Err(RouteError::BadReply {
                holder,
                why: format!("splice: {e}"),
            });
        }
        Ok(Fetched {
            chunk,
            pages,
            tokens: layout.tokens as usize,
            layers: layout.layers as usize,
            transfer_us,
            splice_us: started.elapsed().as_secs_f64() * 1e6,
        })
    }

    /// Sparse fetch: the rows of `parts` (each chunk's selected tokens) for each of `layers`,
    /// gathered from every holder that has some into pool pages: one request per holder
    /// (a gather segment per (part, layer)), one row-sized write per row from the holder, one
    /// immediate expectation per holder. No splice: the rows keep their stored positions, as
    /// sparse attention reads them. Attend with [`Requester::gathered_cache`].
    pub fn gather(
        &mut self,
        parts: &[GatherPart<'_>],
        layers: &[u16],
    ) -> Result<Gathered, RouteError> {
        let rows: usize = parts.iter().map(|p| p.tokens.len()).sum();
        if rows == 0 || layers.is_empty() {
            return Err(RouteError::TooLarge(0));
        }
        let ppl = rows.div_ceil(PAGE_TOKENS);
        let first_holder = self.links[0].addr;
        let no_pool = |e: &dyn std::fmt::Display| RouteError::HolderFailed {
            holder: first_holder,
            why: format!("pool: {e}"),
        };
        let pages = self
            .pool
            .alloc(ppl * layers.len())
            .map_err(|e| no_pool(&e))?;
        let mut links = Vec::with_capacity(parts.len());
        for p in parts {
            match self.link_for(p.chunk) {
                Ok(l) => links.push(l),
                Err(e) => {
                    let _ = self.pool.release(&pages);
                    return Err(e);
                }
            }
        }
        let started = Instant::now();
        // Each segment's holder may write its rows' bytes and nothing else of the pool, until
        // the grants go: per (part, layer), the grants of the rows it lands.
        let mut grants = Vec::with_capacity(parts.len() * layers.len());
        let mut at = 0;
        for p in parts {
            let n = p.tokens.len();
            for l in 0..layers.len() {
                if n == 0 {
                    continue;
                }
                match self.grant_rows(&pages[l * ppl..(l + 1) * ppl], at, n) {
                    Ok(g) => grants.push(g),
                    Err(e) => {
                        drop(grants);
                        let _ = self.pool.release(&pages);
                        return Err(no_pool(&format!("grant: {e}")));
                    }
                }
            }
            at += n;
        }
        let windows: Vec<Vec<PoolWindow<'_>>> = grants.iter().map(|g| windows(g)).collect();
        // link -> (segments, per segment the arrivals of its fetch immediate: one write per
        // page it touches, as the holder packs them, each maybe sharded over NICs)
        let mut batches: Vec<Batch<'_>> = Vec::new();
        let mut segment_windows = windows.iter();
        let mut at = 0;
        for (p, &link) in parts.iter().zip(&links) {
            let n = p.tokens.len();
            if n > 0 {
                let (first_page, end_page) = (at / PAGE_TOKENS, (at + n).div_ceil(PAGE_TOKENS));
                let first = (at % PAGE_TOKENS) as u32;
                let arrivals: u64 = wire::gather_writes(first, n)
                    .map(|w| {
                        self.engine.expected_arrivals(TransferShape::SingleWrite {
                            len: (w.rows * ROW_BYTES) as u64,
                        })
                    })
                    .sum();
                for (l, &layer) in layers.iter().enumerate() {
                    let table = &pages[l * ppl..(l + 1) * ppl];
                    let seg = SegmentSpec {
                        kind: SegmentKind::Gather { first },
                        chunk: p.chunk.0,
                        layer,
                        queries: QueryRows::Copied(&[]),
                        indices: p.tokens,
                        pages: &table[first_page..end_page],
                        windows: segment_windows.next().map_or(&[][..], Vec::as_slice),
                    };
                    match batches.iter_mut().find(|b| b.link == link) {
                        Some(batch) => batch.push(seg, arrivals),
                        None => batches.push(Batch {
                            link,
                            segments: vec![seg],
                            fetch_arrivals: vec![arrivals],
                        }),
                    }
                }
            }
            at += n;
        }
        // Each holder packs one request's gathered rows into staging it advertised.
        for batch in &batches {
            let bytes: usize = batch
                .segments
                .iter()
                .map(|s| s.indices.len() * ROW_BYTES)
                .sum();
            if bytes as u64 > self.links[batch.link].welcome.gather_bytes {
                let _ = self.pool.release(&pages);
                return Err(RouteError::TooLarge(bytes));
            }
        }
        let asked: Vec<(usize, usize)> =
            batches.iter().map(|b| (b.link, b.segments.len())).collect();
        let replies = self.exchange(batches);
        // Every write was counted, or its link given up: from here none lands in the pool.
        drop(windows);
        drop(grants);
        let mut failure = None;
        for ((link, segments), reply) in asked.into_iter().zip(replies) {
            let holder = self.links[link].addr;
            let seq = self.links[link].seq;
            let statuses = reply
                .and_then(|range| self.reply_bytes(holder, range))
                .and_then(|bytes| decode_reply(holder, seq, bytes, segments).map(|r| r.statuses));
            match statuses {
                Ok(s) => {
                    if let Some(&status) = s.iter().find(|&&st| st != Status::Ok) {
                        failure.get_or_insert(RouteError::Refused { holder, status });
                    }
                }
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
        if let Some(e) = failure {
            // As in `fetch`: a late write cannot land, its grant is gone.
            let _ = self.pool.release(&pages);
            return Err(e);
        }
        Ok(Gathered {
            pages,
            rows,
            layers: layers.to_vec(),
            transfer_us: started.elapsed().as_secs_f64() * 1e6,
        })
    }

    /// The rows gathered for `layers[layer_index]` as a paged cache (`rows` tokens).
    pub fn gathered_cache<'a>(
        &'a self,
        gathered: &'a Gathered,
        layer_index: usize,
    ) -> Result<Cache<'a>, RemoteError> {
        self.pool_layer(&gathered.pages, gathered.rows, layer_index)?
            .ok_or_else(|| RemoteError::Config(format!("no gathered layer {layer_index}")))
    }

    /// Returns gathered rows' pages to the pool.
    pub fn release_gathered(&mut self, gathered: Gathered) -> Result<(), RemoteError> {
        Ok(self.pool.release(&gathered.pages)?)
    }

    /// Layer `layer` of a fetched chunk as a paged cache the kernels read.
    pub fn fetched_cache<'a>(
        &'a self,
        fetched: &'a Fetched,
        layer: usize,
    ) -> Result<Cache<'a>, RemoteError> {
        self.pool_layer(&fetched.pages, fetched.tokens, layer)?
            .ok_or_else(|| RemoteError::Chunk {
                chunk: fetched.chunk,
                why: format!("no fetched layer {layer}"),
            })
    }

    /// Layer `layer` of `tokens` rows laid out layer-major over `pages` of the pool, as a
    /// paged cache; `None` past the last layer.
    fn pool_layer<'a>(
        &'a self,
        pages: &'a [u32],
        tokens: usize,
        layer: usize,
    ) -> Result<Option<Cache<'a>>, RemoteError> {
        let ppl = tokens.div_ceil(PAGE_TOKENS);
        let Some(table) = pages.get(layer * ppl..(layer + 1) * ppl) else {
            return Ok(None);
        };
        // Refused while a grant lives; none does between calls (each fetch and gather drops
        // its own), and none can be made while `self` is borrowed.
        let pool = self.pool_mem.u16s(0, self.pool.bytes() / 2)?;
        Ok(Some(Cache::paged(pool, table, tokens)?))
    }

    /// Returns a fetched chunk's pages to the pool.
    pub fn release(&mut self, fetched: Fetched) -> Result<(), RemoteError> {
        Ok(self.pool.release(&fetched.pages)?)
    }

    /// The descriptor of the pool, as every holder's hello names it (for tests that play a
    /// forged holder): no peer may write through it; fetches and gathers grant windows.
    pub fn pool_desc(&self) -> &MrDesc {
        self.pool_mem.desc()
    }

    /// Grants of the pool bytes that rows `first..first + rows` of `pages` fill (row `r` at
    /// row `r % 64` of page `pages[r / 64]`): one per stretch of them contiguous in the pool,
    /// so a fetch into pages the pool handed out in order is one grant.
    fn grant_rows(
        &mut self,
        pages: &[u32],
        first: usize,
        rows: usize,
    ) -> Result<Vec<Grant>, TransportError> {
        let mut stretches: Vec<(usize, usize)> = Vec::new();
        let end = first + rows;
        let mut row = first;
        while row < end {
            let page = row / PAGE_TOKENS;
            let page_end = ((page + 1) * PAGE_TOKENS).min(end);
            let &number = pages
                .get(page)
                .ok_or(TransportError::InvalidArgument("rows past the pages given"))?;
            let start = number as usize * PAGE_BYTES + (row % PAGE_TOKENS) * ROW_BYTES;
            let len = (page_end - row) * ROW_BYTES;
            match stretches.last_mut() {
                Some((at, n)) if *at + *n == start => *n += len,
                _ => stretches.push((start, len)),
            }
            row = page_end;
        }
        stretches
            .into_iter()
            .map(|(at, len)| self.pool_mem.grant(at, len))
            .collect()
    }
}

/// What a segment tells its holder of `grants`.
fn windows(grants: &[Grant]) -> Vec<PoolWindow<'_>> {
    grants
        .iter()
        .map(|g| PoolWindow {
            offset: g.offset() as u64,
            desc: g.desc(),
        })
        .collect()
}
