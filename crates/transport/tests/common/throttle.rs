//! A `Domain` wrapper for tests: delegates to a `MemDomain` but accepts at most one write per
//! post (a NIC whose queue is always nearly full), can refuse a number of posts whole (a full
//! queue), and can be gated shut so the worker blocks inside `post_writes`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvroute_transport::addr::DomainAddr;
use kvroute_transport::domain::{
    Completion, Domain, Notify, PeerId, RecvWr, Registration, SendWr, WriteWr,
};
use kvroute_transport::mem::MemDomain;
use kvroute_transport::{Access, Device, TransportError};

/// Shared controls of a [`Throttled`] domain.
#[derive(Debug, Default)]
pub(crate) struct Controls {
    /// While true, `post_writes` waits (up to 30 s) before posting.
    pub(crate) gate_closed: AtomicBool,
    /// Set when a `post_writes` call is waiting at the gate.
    pub(crate) waiting: AtomicBool,
    /// Writes accepted so far.
    pub(crate) accepted: AtomicU64,
    /// When non-zero, the gate closes by itself once this many writes were accepted: a test
    /// holds the worker at a known point however fast it posts.
    pub(crate) close_at: AtomicU64,
    /// `post_writes` calls still to refuse whole (a NIC whose queue is full), one less each.
    pub(crate) refuse_posts: AtomicU64,
    /// Work requests offered to the refused calls.
    pub(crate) refused_offers: AtomicU64,
}

pub(crate) struct Throttled {
    pub(crate) inner: MemDomain,
    pub(crate) controls: Arc<Controls>,
    pub(crate) one_at_a_time: bool,
}

impl Domain for Throttled {
    fn provider(&self) -> &str {
        self.inner.provider()
    }
    fn address(&self) -> DomainAddr {
        self.inner.address()
    }
    fn supports(&self, device: Device) -> bool {
        self.inner.supports(device)
    }
    unsafe fn register(
        &mut self,
        addr: u64,
        len: u64,
        device: Device,
        access: Access,
    ) -> Result<Registration, TransportError> {
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { self.inner.register(addr, len, device, access) }
    }
    fn deregister(&mut self, lkey: u64) -> Result<(), TransportError> {
        self.inner.deregister(lkey)
    }
    fn connect(&mut self, peer: &DomainAddr) -> Result<PeerId, TransportError> {
        self.inner.connect(peer)
    }
    fn disconnect(&mut self, peer: PeerId) -> Result<(), TransportError> {
        self.inner.disconnect(peer)
    }
    fn post_writes(&mut self, wrs: &[WriteWr]) -> Result<usize, TransportError> {
        let start = Instant::now();
        while self.controls.gate_closed.load(Ordering::Acquire)
            && start.elapsed() < Duration::from_secs(30)
        {
            self.controls.waiting.store(true, Ordering::Release);
            std::thread::sleep(Duration::from_micros(100));
        }
        self.controls.waiting.store(false, Ordering::Release);
        let refuse =
            self.controls
                .refuse_posts
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        if refuse.is_ok() {
            self.controls
                .refused_offers
                .fetch_add(wrs.len() as u64, Ordering::AcqRel);
            return Ok(0);
        }
        let take = if self.one_at_a_time {
            wrs.len().min(1)
        } else {
            wrs.len()
        };
        let n = self.inner.post_writes(&wrs[..take])?;
        let accepted = self.controls.accepted.fetch_add(n as u64, Ordering::AcqRel) + n as u64;
        let close_at = self.controls.close_at.load(Ordering::Acquire);
        if close_at != 0 && accepted >= close_at {
            self.controls.gate_closed.store(true, Ordering::Release);
        }
        Ok(n)
    }
    unsafe fn post_send(&mut self, wr: &SendWr) -> Result<bool, TransportError> {
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { self.inner.post_send(wr) }
    }
    unsafe fn post_recv(&mut self, wr: &RecvWr) -> Result<bool, TransportError> {
        // SAFETY: forwarded with the caller's guarantee.
        unsafe { self.inner.post_recv(wr) }
    }
    fn poll(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        self.inner.poll(out, max)
    }
    fn set_notify(&mut self, notify: Arc<dyn Notify>) {
        self.inner.set_notify(notify);
    }
    fn next_deadline(&self) -> Option<Instant> {
        self.inner.next_deadline()
    }
    fn may_park(&self) -> bool {
        self.inner.may_park()
    }
}
