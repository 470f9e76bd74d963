//! The part of an in-process NIC that its peers touch: its registered regions (the target
//! checks every write against them, as a NIC checks rkeys), its inbox of arrivals and received
//! messages, and its posted receive buffers.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::domain::{Notify, RecvWr};
use crate::mr::Access;

/// A registered region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Region {
    addr: u64,
    len: u64,
    generation: u32,
    access: Access,
}

/// Registered regions by key. A key is `tag << 32 | slot`, the tag drawn at random for each
/// registration (never 0, never the slot's previous one): a key that outlives its
/// registration (a stale rkey) no longer matches once the slot is reused, and a peer that
/// holds the key of one region cannot derive another's (each peer is handed only the keys
/// of the regions meant for it; a guess is right once in 2^32).
#[derive(Debug, Default)]
pub(crate) struct RegionTable {
    slots: Vec<Option<Region>>,
    generations: Vec<u32>,
    free: Vec<u32>,
    /// Draws the tags; seeded from the process's random hasher keys.
    tags: Option<std::collections::hash_map::RandomState>,
    drawn: u64,
}

impl RegionTable {
    /// A fresh tag: neither 0 nor `previous`.
    fn tag(&mut self, previous: u32) -> u32 {
        use std::hash::BuildHasher;
        let state = self.tags.get_or_insert_with(Default::default);
        loop {
            self.drawn += 1;
            let tag = state.hash_one(self.drawn) as u32;
            if tag != 0 && tag != previous {
                return tag;
            }
        }
    }

    pub(crate) fn insert(&mut self, addr: u64, len: u64, access: Access) -> u64 {
        let slot = self.free.pop().unwrap_or_else(|| {
            self.slots.push(None);
            self.generations.push(0);
            (self.slots.len() - 1) as u32
        });
        let generation = self.tag(self.generations[slot as usize]);
        self.generations[slot as usize] = generation;
        self.slots[slot as usize] = Some(Region {
            addr,
            len,
            generation,
            access,
        });
        u64::from(generation) << 32 | u64::from(slot)
    }

    pub(crate) fn remove(&mut self, key: u64) -> bool {
        let slot = (key & 0xFFFF_FFFF) as usize;
        match self.slots.get(slot) {
            Some(Some(r)) if u64::from(r.generation) == key >> 32 => {
                self.slots[slot] = None;
                self.free.push(slot as u32);
                true
            }
            _ => false,
        }
    }

    pub(crate) fn clear(&mut self) {
        for (slot, region) in self.slots.iter_mut().enumerate() {
            if region.take().is_some() {
                self.free.push(slot as u32);
            }
        }
    }

    /// Checks that `key` names a live region containing `[addr, addr + len)` (a local
    /// access: the source of a write, a receive buffer).
    pub(crate) fn check(&self, key: u64, addr: u64, len: u64) -> Result<(), &'static str> {
        self.region(key, addr, len).map(|_| ())
    }

    /// [`RegionTable::check`] for a peer's write: the region must also accept remote writes.
    pub(crate) fn check_remote_write(
        &self,
        key: u64,
        addr: u64,
        len: u64,
    ) -> Result<(), &'static str> {
        match self.region(key, addr, len)?.access {
            Access::RemoteWrite => Ok(()),
            Access::Local => Err("the region is not remotely writable"),
        }
    }

    fn region(&self, key: u64, addr: u64, len: u64) -> Result<&Region, &'static str> {
        let slot = (key & 0xFFFF_FFFF) as usize;
        let region = match self.slots.get(slot) {
            Some(Some(r)) if u64::from(r.generation) == key >> 32 => r,
            _ => return Err("unknown or stale key"),
        };
        let end = addr.checked_add(len).ok_or("range wraps around")?;
        if addr < region.addr || end > region.addr + region.len {
            return Err("range outside the registered region");
        }
        Ok(region)
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.slots.iter().filter(|s| s.is_some()).count()
    }
}

/// Something a peer delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// `count` writes with immediate `imm` have landed.
    Arrival { imm: u32, count: u32 },
    /// A message of `len` bytes has landed in the posted receive `wr_id`.
    Recv { wr_id: u64, len: u64, from: u64 },
}

/// One in-process NIC's shared state.
#[derive(Default)]
pub(crate) struct Endpoint {
    pub(crate) id: u64,
    alive: AtomicBool,
    regions: RwLock<RegionTable>,
    /// Events from peers, drained whole by the owner (a swap, not a pop per event).
    inbox: Mutex<Vec<Event>>,
    pub(crate) recvs: Mutex<VecDeque<RecvWr>>,
    /// Senders waiting for a receive buffer (RNR), woken when one is posted.
    rnr_waiters: Mutex<Vec<Arc<dyn Notify>>>,
    notify: OnceLock<Arc<dyn Notify>>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("id", &self.id)
            .field("alive", &self.is_alive())
            .finish_non_exhaustive()
    }
}

impl Endpoint {
    pub(crate) fn new(id: u64) -> Self {
        Self {
            id,
            alive: AtomicBool::new(true),
            ..Self::default()
        }
    }

    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Takes the NIC off the fabric: every later access fails, and once this returns no write
    /// is in progress into its regions.
    pub(crate) fn kill(&self) {
        self.alive.store(false, Ordering::Release);
        self.regions_mut().clear();
        self.recvs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        self.wake();
    }

    pub(crate) fn regions(&self) -> RwLockReadGuard<'_, RegionTable> {
        self.regions.read().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn regions_mut(&self) -> RwLockWriteGuard<'_, RegionTable> {
        self.regions.write().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn set_notify(&self, notify: Arc<dyn Notify>) {
        // Set once by the owning worker; a second worker would be a wiring bug, and keeping
        // the first waker is the safe reaction.
        let _ = self.notify.set(notify);
    }

    /// Wakes the owning worker.
    pub(crate) fn wake(&self) {
        if let Some(n) = self.notify.get() {
            n.notify();
        }
    }

    /// Queues an event for the owner; consecutive arrivals of one immediate are merged.
    pub(crate) fn deliver_event(&self, event: Event) {
        let mut inbox = self.inbox.lock().unwrap_or_else(PoisonError::into_inner);
        if let (
            Event::Arrival { imm, count },
            Some(Event::Arrival {
                imm: last,
                count: n,
            }),
        ) = (event, inbox.last_mut())
            && *last == imm
            && let Some(sum) = n.checked_add(count)
        {
            *n = sum;
            return;
        }
        inbox.push(event);
    }

    /// Moves every queued event into `out` (which the caller keeps empty between calls).
    pub(crate) fn take_events(&self, out: &mut Vec<Event>) {
        let mut inbox = self.inbox.lock().unwrap_or_else(PoisonError::into_inner);
        if !inbox.is_empty() {
            std::mem::swap(&mut *inbox, out);
        }
    }

    pub(crate) fn wait_for_recv(&self, waiter: Arc<dyn Notify>) {
        self.rnr_waiters
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(waiter);
    }

    pub(crate) fn post_recv(&self, wr: RecvWr) {
        self.recvs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back(wr);
        let waiters = std::mem::take(
            &mut *self
                .rnr_waiters
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for w in waiters {
            w.notify();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_check_range_and_go_stale_when_the_slot_is_reused() {
        let mut t = RegionTable::default();
        let k = t.insert(1000, 100, Access::RemoteWrite);
        assert!(t.check(k, 1000, 100).is_ok());
        assert!(t.check_remote_write(k, 1000, 100).is_ok());
        assert!(t.check(k, 1050, 0).is_ok());
        assert_eq!(
            t.check(k, 999, 1),
            Err("range outside the registered region")
        );
        assert_eq!(
            t.check(k, 1001, 100),
            Err("range outside the registered region")
        );
        assert_eq!(t.check(k, u64::MAX, 2), Err("range wraps around"));
        assert!(t.remove(k));
        let k2 = t.insert(5000, 10, Access::Local);
        assert_eq!(k2 & 0xFFFF_FFFF, k & 0xFFFF_FFFF, "slot reused");
        assert_eq!(t.check(k, 5000, 1), Err("unknown or stale key"));
        assert!(!t.remove(k), "a stale key removes nothing");
        assert_eq!(t.len(), 1);
        // A local region: fine as a source, refused as a peer's target.
        assert!(t.check(k2, 5000, 10).is_ok());
        assert_eq!(
            t.check_remote_write(k2, 5000, 10),
            Err("the region is not remotely writable")
        );
        assert_eq!(
            t.check_remote_write(k2, 5000, 11),
            Err("range outside the registered region")
        );
    }
}
