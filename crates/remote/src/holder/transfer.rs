//! What a holder sends that is not a reply: a fetch (a chunk's pages into the requester's
//! pool, one write per run of consecutive pages) and a gather (selected rows packed per
//! destination page). Both are all or nothing: every write is checked before the first is
//! sent, which the requester's exact count of arrivals relies on. Every write goes through a
//! window the segment grants ([`wire::PoolWindow`]), never through the pool's own
//! descriptor, which takes no write.

use kvroute_kvstore::{ChunkId, PAGE_BYTES, ROW_BYTES};
use kvroute_transport::{MrDesc, MrHandle, OnDone, RemoteKey, Staging};

use super::{Session, Shared};
use crate::chunks::Placement;
use crate::wire::{self, Segment, Status};

/// A write of a fetch or gather: source offset, destination offset in the pool, length.
type PoolWrite = (u64, u64, u64);

/// Where a gather packs its rows: the session's slot, the session, and the bytes of its
/// gather staging earlier segments of the same request took (advanced by each gather).
pub(super) struct GatherStaging<'a> {
    pub(super) slot: usize,
    pub(super) session: &'a Session,
    pub(super) used: &'a mut usize,
}

/// The descriptors a segment's windows name, with where each starts in the pool, if each
/// lies inside `pool` and carries one key per NIC of it: the NICs are the pool's (the
/// requester's own, proven at the hello), so a window can only ever name the requester's
/// memory.
fn window_descs(pool: &MrDesc, seg: &Segment<'_>) -> Option<Vec<(u64, MrDesc)>> {
    seg.windows()
        .map(|w| {
            let inside = w.offset.checked_add(w.len)? <= pool.len;
            (inside && seg.window_keys == pool.rkeys.len()).then(|| {
                let rkeys = pool
                    .rkeys
                    .iter()
                    .zip(w.keys())
                    .map(|(k, rkey)| RemoteKey {
                        nic: k.nic.clone(),
                        rkey,
                    })
                    .collect();
                let desc = MrDesc {
                    addr: w.addr,
                    len: w.len,
                    rkeys,
                };
                (w.offset, desc)
            })
        })
        .collect()
}

/// `writes` (destinations in pool offsets) as writes through `windows`: each through the
/// window that holds all of it, at its offset there; `None` if one lies in none.
fn through_windows(
    writes: Option<Vec<PoolWrite>>,
    windows: &[(u64, MrDesc)],
) -> Option<Vec<(u64, &MrDesc, u64, u64)>> {
    writes?
        .into_iter()
        .map(|(from, to, len)| {
            let (start, desc) = windows.iter().find(|(start, d)| {
                to >= *start && to.checked_add(len).is_some_and(|end| end - start <= d.len)
            })?;
            Some((from, desc, to - start, len))
        })
        .collect()
}

impl Shared {
    /// Fetch: writes the chunk's pages into the requester's pool `pages`, each write carrying
    /// the session's fetch immediate: from a full block, one write per run of consecutive
    /// pool pages ([`wire::fetch_runs`]); from a paged cache, one per piece of a block within
    /// a pool page ([`wire::fetch_pieces`]). All or nothing ([`Shared::send_all`]): every
    /// run's destination is checked against the pool before the first write is sent.
    pub(super) fn fetch(
        &self,
        session: &Session,
        chunk: u32,
        pages: &[u32],
        seg: &Segment<'_>,
    ) -> Status {
        let Some(held) = self.chunks.get(ChunkId(chunk)) else {
            return Status::UnknownChunk;
        };
        let layout = held.layout;
        let Some(pool) = &session.hello.pool else {
            return Status::FetchRefused;
        };
        if pages.len() != layout.pages() {
            return Status::FetchRefused;
        }
        let Some(windows) = window_descs(pool, seg) else {
            return Status::FetchRefused;
        };
        let page = PAGE_BYTES as u64;
        let writes: Option<Vec<PoolWrite>> = match held.placement {
            Placement::Full { offset } => wire::fetch_runs(pages)
                .map(|(first, count)| {
                    let len = count as u64 * page;
                    let dst = u64::from(pages[first]).checked_mul(page)?;
                    (dst.checked_add(len)? <= pool.len).then_some((
                        offset as u64 + first as u64 * page,
                        dst,
                        len,
                    ))
                })
                .collect(),
            // Paged: one write per piece of a block within a pool page, read in place.
            Placement::Paged { .. } => wire::fetch_pieces(layout, held.block_tokens())
                .map(|p| {
                    let len = u64::from(p.rows) * ROW_BYTES as u64;
                    let dst = u64::from(pages[p.page])
                        .checked_mul(page)?
                        .checked_add((p.row * ROW_BYTES) as u64)?;
                    (dst.checked_add(len)? <= pool.len).then_some((
                        held.row_offset(p.layer, p.token) as u64,
                        dst,
                        len,
                    ))
                })
                .collect(),
        };
        self.send_all(
            through_windows(writes, &windows),
            Source::Held(self.chunks.store().handle()),
            (session, session.hello.fetch_imm),
        )
    }

    /// Sends a fetch or gather segment's `writes` (source offset in `src`, the window written
    /// through, the offset in it, length), each with the fetch immediate `imm`, or none of
    /// them: `None` (a write that would not fit the pool or any window the segment granted,
    /// found by the caller before anything was sent) is `FetchRefused`. The writes' checks have passed, so a submission fails only as every
    /// other would (an engine shutting down): a failure at the first sent nothing
    /// (`FetchRefused`), a later one left some sent (`TransferFailed`: the requester's count
    /// is lost and it gives the link up).
    fn send_all(
        &self,
        writes: Option<Vec<(u64, &MrDesc, u64, u64)>>,
        src: Source<'_>,
        (session, imm): (&Session, u32),
    ) -> Status {
        let Some(writes) = writes else {
            return Status::FetchRefused;
        };
        // A session that is ending is sent nothing (see `Session::posting`).
        let Some(_posting) = session.posting() else {
            return Status::FetchRefused;
        };
        for (n, &(from, window, to, len)) in writes.iter().enumerate() {
            let sent = match src {
                Source::Held(handle) => self.engine.submit_single_write(
                    len,
                    Some(imm),
                    (handle, from),
                    (window, to),
                    OnDone::nothing(),
                ),
                Source::Staged(staging) => staging.submit_write(
                    (from as usize, len as usize),
                    Some(imm),
                    (window, to),
                    OnDone::nothing(),
                ),
            };
            if let Err(e) = sent {
                tracing::debug!(%e, "fetch or gather write failed");
                return if n == 0 {
                    Status::FetchRefused
                } else {
                    Status::TransferFailed
                };
            }
        }
        Status::Ok
    }

    /// Sparse fetch: writes the rows of `tokens` (layer `layer` of `chunk`) into the
    /// requester's pool, row `j` at row `first + j` of `pages`, all carrying the session's
    /// fetch immediate. The rows are first packed into the session's gather staging (after
    /// the `used` bytes earlier segments of the request took) so that each page they land in
    /// takes one write ([`wire::gather_writes`]), not one write per row.
    pub(super) fn gather(
        &self,
        GatherStaging {
            slot,
            session,
            used,
        }: GatherStaging<'_>,
        (chunk, layer): (u32, u16),
        first: u32,
        tokens: &[i32],
        (pages, seg): (&[u32], &Segment<'_>),
    ) -> Status {
        let Some(held) = self.chunks.get(ChunkId(chunk)) else {
            return Status::UnknownChunk;
        };
        let layout = held.layout;
        let Some(pool) = &session.hello.pool else {
            return Status::FetchRefused;
        };
        if tokens
            .iter()
            .any(|&t| u32::try_from(t).map_or(true, |t| t >= layout.tokens))
        {
            return Status::BadIndex;
        }
        if layout.layer_offset(u32::from(layer)).is_err() {
            return Status::BadLayer;
        }
        let Some(windows) = window_descs(pool, seg) else {
            return Status::FetchRefused;
        };
        let bytes = tokens.len() * ROW_BYTES;
        if *used + bytes > self.config.gather_bytes {
            return Status::FetchRefused;
        }
        let staged = slot * self.config.gather_bytes + *used;
        // The writes of the previous request from this range have landed (the requester
        // sends a request only after every write of the last one arrived); their completions
        // may not have been seen here yet: waited for, briefly.
        let packed = self
            .gather_staging
            .bytes_mut_within(staged, bytes, super::STAGING_WAIT)
            .map_err(crate::RemoteError::from)
            .and_then(|mut out| {
                for (row, &t) in out.chunks_exact_mut(ROW_BYTES).zip(tokens) {
                    // `t` was checked against the layout above.
                    let at = held.row_offset(u32::from(layer), t as u32);
                    row.copy_from_slice(self.chunks.bytes(at, ROW_BYTES)?);
                }
                Ok(())
            });
        if let Err(e) = packed {
            tracing::debug!(%e, "gather refused");
            return Status::FetchRefused;
        }
        *used += bytes;
        // All or nothing: every write's destination is checked before the first is sent, so
        // a refused segment sent none and the requester expects no rows from it.
        let writes: Option<Vec<PoolWrite>> = wire::gather_writes(first, tokens.len())
            .map(|w| {
                let len = (w.rows * ROW_BYTES) as u64;
                let dst = u64::from(*pages.get(w.page)?)
                    .checked_mul(PAGE_BYTES as u64)?
                    .checked_add((w.row * ROW_BYTES) as u64)?;
                (dst.checked_add(len)? <= pool.len).then_some((
                    (staged + w.from * ROW_BYTES) as u64,
                    dst,
                    len,
                ))
            })
            .collect();
        self.send_all(
            through_windows(writes, &windows),
            Source::Staged(&self.gather_staging),
            (session, session.hello.fetch_imm),
        )
    }
}

/// What a fetch or gather writes out of: the held chunks themselves (sealed: nothing writes
/// them) or rows packed into a session's gather staging.
#[derive(Clone, Copy)]
enum Source<'a> {
    Held(&'a MrHandle),
    Staged(&'a Staging),
}
