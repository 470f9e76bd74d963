//! One-sided requests: expectations of immediates and what arrived unexpected, reserved
//! immediates, and single, paged, immediate-only, scatter and barrier writes.

use crate::engine::TransferEngine;
use crate::engine::callbacks::Job;
use crate::engine::message::{LocalSrc, RemoteTarget, ScatterTarget, Work, Writes};
use crate::engine::shared::GroupShared;
use crate::error::{Side, TransferError, TransportError};
use crate::imm_counter::Expectation;
use crate::mr::{MrDesc, MrHandle, check_range};
use crate::on_done::{OnDone, TransferFuture};
use crate::request::{Pages, ScatterDst, validate_scatter};

use super::{ImmTarget, PeerGroupHandle, UnexpectedImms};

impl TransferEngine {
    /// Fires `on_done` once `count` writes with immediate `imm` have landed here, counting
    /// those that landed before this call (paper 002's IMM counter). Arrivals beyond `count`
    /// are kept for the next expectation of `imm`. While `imm` is watched
    /// ([`TransferEngine::watch_imm`]) it fails at once with [`TransferError::ImmWatched`].
    pub fn expect_imm_count(&self, imm: u32, count: u64, on_done: OnDone) {
        let (done, result) = match self.inner.engine.imm.expect(imm, count, on_done) {
            Expectation::Waiting => return,
            Expectation::Met(done) => (done, Ok(())),
            Expectation::Refused(done) => (done, Err(TransferError::ImmWatched(imm))),
        };
        let callbacks = &self.inner.engine.callbacks;
        done.finish(result, |f, o| callbacks.run_done(f, o));
    }

    /// [`TransferEngine::expect_imm_count`] as a future.
    pub fn imm_count(&self, imm: u32, count: u64) -> TransferFuture {
        let (done, future) = OnDone::future();
        self.expect_imm_count(imm, count, done);
        future
    }

    /// Arrivals of `imm` counted and not claimed by an expectation.
    pub fn pending_imm(&self, imm: u32) -> u64 {
        self.inner.engine.imm.pending(imm)
    }

    /// Claims and returns the arrivals of `imm` nobody expects.
    pub fn take_imm(&self, imm: u32) -> u64 {
        self.inner.engine.imm.take(imm)
    }

    /// Reserves an immediate value for the caller's own use and returns it: drawn at random
    /// among the values not reserved yet, so a peer told one value cannot derive another,
    /// and counted whatever a flood of other values does (each shard of the counter stores at
    /// most 256 values (`imm_counter::MAX_SHARD_SLOTS`); arrivals of a value with no slot
    /// beyond that are dropped and counted in [`TransferEngine::dropped_imms`]). Values whose
    /// arrivals may come before their expectation (a notification, pages fetched ahead of the
    /// reply that names them) must be reserved. [`TransferEngine::release_imm`] ends it.
    pub fn reserve_imm(&self) -> u32 {
        use std::hash::BuildHasher;
        let state = std::collections::hash_map::RandomState::new();
        (0u64..)
            .map(|draw| state.hash_one(draw) as u32)
            .find(|&imm| self.inner.engine.imm.reserve(imm))
            .unwrap_or_default()
    }

    /// Ends the reservation of `imm` ([`TransferEngine::reserve_imm`]).
    pub fn release_imm(&self, imm: u32) {
        self.inner.engine.imm.release(imm);
    }

    /// Arrivals dropped because their value had no slot in the IMM counter and its shard was
    /// full: a peer sending values nobody uses.
    pub fn dropped_imms(&self) -> u64 {
        self.inner.engine.imm.dropped()
    }

    /// Calls `handler(imm, count)` on the callback thread for arrivals that find no
    /// expectation waiting (they also stay counted, for a later expectation or `take_imm`).
    pub fn on_unexpected_imm(&self, handler: impl FnMut(u32, u64) + Send + 'static) {
        self.inner
            .engine
            .callbacks
            .push(Job::SetUnexpectedHandler(Box::new(handler)));
        self.inner
            .engine
            .unexpected_imm_handler
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// A queue of the arrivals that find no expectation waiting, as `(imm, count)`, pushed by
    /// the progress pass itself (a worker thread, or [`TransferEngine::progress`]) with no
    /// callback-thread hop: for servers that wait for requests in a loop of their own and
    /// want the lowest wake-up latency. The arrivals also stay counted, so `take_imm` claims
    /// them as with [`TransferEngine::on_unexpected_imm`], which keeps working beside it.
    /// Every call returns a receiver of the same queue; arrivals before the first call are
    /// not queued (they stay counted). The queue is unbounded: drain it.
    pub fn unexpected_imms(&self) -> UnexpectedImms {
        UnexpectedImms {
            rx: self
                .inner
                .engine
                .unexpected_imm_queue
                .get_or_init(crossbeam_channel::unbounded)
                .1
                .clone(),
        }
    }

    /// Writes `len` bytes from `src` (handle, offset) to `dst` (descriptor, offset), sharded
    /// over the NICs; each shard carries `imm`.
    pub fn submit_single_write(
        &self,
        len: u64,
        imm: Option<u32>,
        src: (&MrHandle, u64),
        dst: (&MrDesc, u64),
        on_done: OnDone,
    ) -> Result<(), TransportError> {
        if len == 0 && imm.is_none() {
            return Err(TransportError::EmptyTransfer);
        }
        let (group, region) = self.local(src.0)?;
        check_range(Side::Source, region.len, src.1, len)?;
        check_range(Side::Destination, dst.0.len, dst.1, len)?;
        let target = self.target(group, dst.0, None)?;
        let src_ref = LocalSrc {
            addr: region.addr,
            lkeys: region.lkeys,
        };
        let work = Writes::Single {
            src: src_ref,
            dst: target,
            src_offset: src.1,
            dst_offset: dst.1,
            len,
            imm,
        };
        self.submit(group, Work::Writes(work), on_done)
    }

    /// Writes `page_len`-byte pages: source page `i` of `src` to destination page `i` of
    /// `dst`, one write per page rotated over the NICs; each page carries `imm`.
    pub fn submit_paged_writes(
        &self,
        page_len: u64,
        imm: Option<u32>,
        src: (&MrHandle, &Pages),
        dst: (&MrDesc, &Pages),
        on_done: OnDone,
    ) -> Result<(), TransportError> {
        let (src_pages, dst_pages) = (src.1, dst.1);
        if src_pages.indices.len() != dst_pages.indices.len() {
            return Err(TransportError::PageCountMismatch {
                src: src_pages.indices.len(),
                dst: dst_pages.indices.len(),
            });
        }
        if src_pages.indices.is_empty() {
            return Err(TransportError::EmptyTransfer);
        }
        if page_len == 0 {
            return Err(TransportError::InvalidArgument("page_len must be positive"));
        }
        if u32::try_from(src_pages.indices.len()).is_err() {
            return Err(TransportError::InvalidArgument(
                "at most 2^32 - 1 pages per transfer",
            ));
        }
        let (group, region) = self.local(src.0)?;
        src_pages.validate(Side::Source, page_len, region.len)?;
        dst_pages.validate(Side::Destination, page_len, dst.0.len)?;
        let target = self.target(group, dst.0, None)?;
        let work = Writes::Paged {
            src: LocalSrc {
                addr: region.addr,
                lkeys: region.lkeys,
            },
            dst: target,
            page_len,
            src_pages: src_pages.clone(),
            dst_pages: dst_pages.clone(),
            imm,
        };
        self.submit(group, Work::Writes(work), on_done)
    }

    /// An immediate-only write to the region of `dst` (no bytes; the peer counts `imm`).
    ///
    /// With [`OnDone::nothing`] (not made cancellable) nobody would see its completion, so
    /// where the NIC can post it without one it does (libfabric's shm, the `mem` domain): it
    /// is then done with once posted, counted as posted and
    /// [`unreported`](crate::DomainStats::unreported), and a failure the NIC finds later goes
    /// unseen. Elsewhere, and when the NIC refuses it at the post, it completes as usual.
    pub fn submit_imm(
        &self,
        imm: u32,
        dst: &MrDesc,
        on_done: OnDone,
    ) -> Result<(), TransportError> {
        let group = self.main_group();
        let target = self.target(group, dst, None)?;
        self.submit_imm_resolved(group, target, imm, on_done)
    }

    /// Resolves `dst` for [`TransferEngine::submit_imm_to`]: connects to its peer if needed
    /// and checks the descriptor, once.
    pub fn imm_target(&self, dst: &MrDesc) -> Result<ImmTarget, TransportError> {
        let group = self.main_group();
        let removals = group.directory.removals();
        let target = self.target(group, dst, None)?;
        Ok(ImmTarget {
            desc: dst.clone(),
            directory: group.directory.id(),
            removals,
            target,
        })
    }

    /// [`TransferEngine::submit_imm`] to a destination resolved beforehand: the same write,
    /// without the per-write lookup while no peer has been released since `dst` was made.
    pub fn submit_imm_to(
        &self,
        imm: u32,
        dst: &ImmTarget,
        on_done: OnDone,
    ) -> Result<(), TransportError> {
        let group = self.main_group();
        if dst.directory != group.directory.id() {
            return Err(TransportError::InvalidArgument(
                "the immediate target was resolved by another engine",
            ));
        }
        let target = if dst.removals == group.directory.removals() {
            dst.target
        } else {
            self.target(group, &dst.desc, None)?
        };
        self.submit_imm_resolved(group, target, imm, on_done)
    }

    fn submit_imm_resolved(
        &self,
        group: &GroupShared,
        target: RemoteTarget,
        imm: u32,
        on_done: OnDone,
    ) -> Result<(), TransportError> {
        // Under manual progress, one nobody waits on goes out here without becoming a transfer.
        if on_done.reports_nothing() && self.post_unreported_here(group, &target, imm) {
            return Ok(());
        }
        self.submit(
            group,
            Work::Writes(Writes::Imm { dst: target, imm }),
            on_done,
        )
    }

    /// Writes a slice of `src` to each target (paper 002 `submit_scatter`), targets spread
    /// over the NICs. With `peers`, target `i` must be the group's member `i` and no lookups
    /// are made.
    pub fn submit_scatter(
        &self,
        peers: Option<PeerGroupHandle>,
        imm: Option<u32>,
        src: &MrHandle,
        dsts: &[ScatterDst],
        on_done: OnDone,
    ) -> Result<(), TransportError> {
        if dsts.is_empty() {
            return Err(TransportError::EmptyTransfer);
        }
        let (group, region) = self.local(src)?;
        validate_scatter(region.len, dsts)?;
        let targets = self.targets(group, peers, dsts.iter().map(|d| &d.dst), |i, dst| {
            ScatterTarget {
                dst,
                len: dsts[i].len,
                src_offset: dsts[i].src_offset,
                dst_offset: dsts[i].dst_offset,
            }
        })?;
        let work = Writes::Scatter {
            src: LocalSrc {
                addr: region.addr,
                lkeys: region.lkeys,
            },
            targets,
            imm,
        };
        self.submit(group, Work::Writes(work), on_done)
    }

    /// An immediate-only write to each target (paper 002 `submit_barrier`).
    pub fn submit_barrier(
        &self,
        peers: Option<PeerGroupHandle>,
        imm: u32,
        dsts: &[MrDesc],
        on_done: OnDone,
    ) -> Result<(), TransportError> {
        if dsts.is_empty() {
            return Err(TransportError::EmptyTransfer);
        }
        let group = self.main_group();
        let targets = self.targets(group, peers, dsts.iter(), |_, target| target)?;
        self.submit(
            group,
            Work::Writes(Writes::Barrier { targets, imm }),
            on_done,
        )
    }
}
