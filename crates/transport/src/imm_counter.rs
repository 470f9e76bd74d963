//! The IMM counter (paper 002 section 3.3): completion by counting. Every write that carries a
//! 32-bit immediate increments that value's count on the receiver; an expectation of `n`
//! arrivals of a value fires exactly once, when `n` have been counted, whether they arrived
//! before or after it was registered. Arrivals beyond `n` stay counted for the next
//! expectation of the same value; several expectations of one value are served in the order
//! they were registered.
//!
//! Arrivals are counted by the domain workers and expectations registered by application
//! threads, concurrently; a value's count and its waiting expectations change together under
//! one lock (sharded by value), which is what rules out the lost wake-up the loom models
//! (`loom_models`) look for. The counter stores a caller-chosen token per expectation and hands it back
//! when it fires; running the callback is the caller's business.
//!
//! Values are chosen by peers, so what a flood of them can cost is bounded: a value that finds
//! no slot of its own when its shard already holds [`MAX_SHARD_SLOTS`] is dropped and counted
//! ([`ImmCounter::dropped`]), never stored. A value the application *reserves*
//! ([`ImmCounter::reserve`]) keeps its slot, so its arrivals are counted whatever a flood of
//! other values does; a value with a waiting expectation has its slot too.
//!
//! A value may instead be *watched* ([`ImmCounter::watch`]): its arrivals are then added to one
//! atomic word of its own, found and bumped without the shard's lock, and read by the watcher
//! without any lock. That is a doorbell's path (a ping-pong, a step's notification), where a
//! lock, a queue and a callback per arrival are most of the receiver's cost. A watch and
//! expectations of the same value exclude each other.

use std::collections::VecDeque;

use crate::FastMap;
use crate::error::TransportError;

use crate::sync::{AtomicU64, Mutex, Ordering, lock};

/// Shards: enough that workers and app threads rarely contend, few enough to stay small.
const SHARDS: usize = 16;
/// Slots a shard keeps once their value has nothing counted or waiting, so a value used
/// again (every round trip's immediate) finds its slot and its queue's buffer instead of
/// inserting and allocating them anew; beyond this, idle slots are removed. Values are chosen
/// by peers, so the idle slots must stay bounded: at most `SHARDS * KEEP_IDLE` in all.
const KEEP_IDLE: usize = 8;
/// Slots a shard holds before an arrival of a value with no slot is dropped: at most
/// `SHARDS * MAX_SHARD_SLOTS` = 4,096 values stored however many a peer sends. Reserved
/// values and values with a waiting expectation always have their slot.
pub(crate) const MAX_SHARD_SLOTS: usize = 256;

#[derive(Debug)]
struct Slot<T> {
    /// Arrivals counted and not yet consumed by an expectation.
    arrived: u64,
    /// Expectations still short of arrivals, oldest first: (arrivals needed, token).
    waiting: VecDeque<(u64, T)>,
    /// Reserved by the application ([`ImmCounter::reserve`]): the slot is kept while idle.
    reserved: bool,
}

impl<T> Slot<T> {
    fn idle(&self) -> bool {
        self.arrived == 0 && self.waiting.is_empty()
    }
}

/// Removes `imm`'s slot if the caller found it `idle`, it is not reserved, and the shard
/// already holds more than [`KEEP_IDLE`] slots.
fn settle<T>(shard: &mut FastMap<u32, Slot<T>>, imm: u32, idle: bool) {
    if idle && shard.len() > KEEP_IDLE && shard.get(&imm).is_some_and(|s| !s.reserved) {
        shard.remove(&imm);
    }
}

impl<T> Default for Slot<T> {
    fn default() -> Self {
        Self {
            arrived: 0,
            reserved: false,
            waiting: VecDeque::new(),
        }
    }
}

/// Values watched at once, at most: one bit each of a mask, and a word each.
pub(crate) const MAX_WATCHES: usize = 16;

/// The watched values. Word `i` holds slot `i`'s value in its high 32 bits and its arrivals,
/// modulo 2^32, in its low 32; an arrival is added by compare-and-swap on the whole word, so it
/// counts only if the word still holds its value. A slot is claimed (bit in `claimed`), its
/// word written, then made live (bit in `live`); released in the reverse order.
#[derive(Debug)]
struct Watches {
    claimed: AtomicU64,
    live: AtomicU64,
    words: Box<[AtomicU64]>,
}

const COUNT_BITS: u64 = 0xFFFF_FFFF;

impl Watches {
    fn new() -> Self {
        Self {
            claimed: AtomicU64::new(0),
            live: AtomicU64::new(0),
            words: (0..MAX_WATCHES).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Adds `n` arrivals to `imm`'s watch, if it has a live one. No lock: a mask load when
    /// nothing is watched, a compare per live watch otherwise.
    #[inline]
    fn bump(&self, imm: u32, n: u64) -> bool {
        let Some((i, mut cur)) = self.find(imm) else {
            return false;
        };
        let word = &self.words[i];
        // The word may have been handed to another value since: then the arrival is not its.
        while (cur >> 32) as u32 == imm {
            // Wrapping within the low half: the value's bits are never touched.
            let next = (cur & !COUNT_BITS) | ((cur.wrapping_add(n)) & COUNT_BITS);
            match word.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => cur = now,
            }
        }
        false
    }

    /// The live slot watching `imm`, and its word as read.
    fn find(&self, imm: u32) -> Option<(usize, u64)> {
        let mut live = self.live.load(Ordering::Acquire);
        while live != 0 {
            let i = live.trailing_zeros() as usize;
            live &= live - 1;
            let word = self.words[i].load(Ordering::Acquire);
            if (word >> 32) as u32 == imm {
                return Some((i, word));
            }
        }
        None
    }

    /// Claims a free slot for `imm`, its count zero, and makes it live.
    fn claim(&self, imm: u32) -> Option<usize> {
        let all = u64::MAX >> (64 - MAX_WATCHES);
        let mut claimed = self.claimed.load(Ordering::Acquire);
        let i = loop {
            let free = !claimed & all;
            if free == 0 {
                return None;
            }
            let i = free.trailing_zeros() as usize;
            match self.claimed.compare_exchange_weak(
                claimed,
                claimed | 1 << i,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break i,
                Err(now) => claimed = now,
            }
        };
        // Every write of a word is a read-modify-write, so each one reads the one before: an
        // arrival's compare-and-swap that read the old value cannot land after this one.
        // (A plain store would do under the C++ model; loom's partial order needs the swap.)
        self.words[i].swap(u64::from(imm) << 32, Ordering::AcqRel);
        self.live.fetch_or(1 << i, Ordering::AcqRel);
        Some(i)
    }

    fn release(&self, i: usize) {
        self.live.fetch_and(!(1 << i), Ordering::AcqRel);
        self.claimed.fetch_and(!(1 << i), Ordering::AcqRel);
    }
}

/// A watch [`ImmCounter::watch`] set up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WatchSlot {
    /// The slot, for [`ImmCounter::watched`] and [`ImmCounter::unwatch`].
    pub(crate) index: usize,
    /// Arrivals of the value counted before the watch and taken over by it.
    pub(crate) earlier: u64,
}

/// What [`ImmCounter::expect`] did with an expectation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expectation<T> {
    /// Its arrivals had been counted already: here is its token back, fired.
    Met(T),
    /// Kept until its arrivals are counted.
    Waiting,
    /// The value is watched, so no arrival would ever reach it: its token back, unfired.
    Refused(T),
}

/// What [`ImmCounter::arrive`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// An expectation was waiting on the value.
    Expected,
    /// Nobody was waiting; the arrivals are kept for a later expectation.
    Unexpected,
    /// The value had no slot and its shard was full ([`MAX_SHARD_SLOTS`]): the arrivals
    /// were counted in [`ImmCounter::dropped`] and nowhere else.
    Dropped,
}

/// One shard: the slots of the values that hash to it.
type Shard<T> = Mutex<FastMap<u32, Slot<T>>>;

/// Per-immediate arrival counts and the expectations waiting on them.
#[derive(Debug)]
pub(crate) struct ImmCounter<T> {
    shards: Box<[Shard<T>]>,
    watches: Watches,
    /// Arrivals dropped for want of a slot.
    dropped: AtomicU64,
}

impl<T> Default for ImmCounter<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> ImmCounter<T> {
    /// An empty counter.
    pub(crate) fn new() -> Self {
        Self {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(FastMap::default()))
                .collect(),
            watches: Watches::new(),
            dropped: AtomicU64::new(0),
        }
    }

    fn shard(&self, imm: u32) -> &Shard<T> {
        &self.shards[imm as usize % SHARDS]
    }

    /// Counts `n` arrivals of `imm`; the expectations they complete are appended to `fired`,
    /// oldest first. Arrivals of a watched value go to its watch ([`Arrival::Expected`]).
    pub(crate) fn arrive(&self, imm: u32, n: u64, fired: &mut Vec<T>) -> Arrival {
        if self.watches.bump(imm, n) {
            return Arrival::Expected;
        }
        let mut shard = lock(self.shard(imm));
        // A watch set up since the look above holds this lock while it takes over the count:
        // look again under it, or the arrival would be kept where the watch no longer reads.
        if self.watches.bump(imm, n) {
            return Arrival::Expected;
        }
        if shard.len() >= MAX_SHARD_SLOTS && !shard.contains_key(&imm) {
            self.dropped.fetch_add(n, Ordering::Relaxed);
            return Arrival::Dropped;
        }
        let slot = shard.entry(imm).or_default();
        let found = if slot.waiting.is_empty() {
            Arrival::Unexpected
        } else {
            Arrival::Expected
        };
        slot.arrived += n;
        while let Some(&(needed, _)) = slot.waiting.front() {
            if slot.arrived < needed {
                break;
            }
            slot.arrived -= needed;
            if let Some((_, token)) = slot.waiting.pop_front() {
                fired.push(token);
            }
        }
        let idle = slot.idle();
        settle(&mut shard, imm, idle);
        found
    }

    /// Expects `count` arrivals of `imm`. Met at once if they have already been counted and no
    /// earlier expectation of `imm` is waiting; otherwise kept until they arrive. Refused while
    /// `imm` is watched.
    pub(crate) fn expect(&self, imm: u32, count: u64, token: T) -> Expectation<T> {
        let mut shard = lock(self.shard(imm));
        // Watches of `imm` begin under this lock, so none begins between this look and the
        // push below; one that ends meanwhile is its owner's own race with this call.
        if self.watches.find(imm).is_some() {
            return Expectation::Refused(token);
        }
        let slot = shard.entry(imm).or_default();
        if slot.waiting.is_empty() && slot.arrived >= count {
            slot.arrived -= count;
            let idle = slot.idle();
            settle(&mut shard, imm, idle);
            return Expectation::Met(token);
        }
        slot.waiting.push_back((count, token));
        Expectation::Waiting
    }

    /// Watches `imm`: from now on its arrivals are added to a word of its own, read with
    /// [`ImmCounter::watched`], and expectations of it are refused. The arrivals already
    /// counted and unclaimed are taken over ([`WatchSlot::earlier`]). Refused while `imm` is
    /// watched or expectations of it are waiting, and when all [`MAX_WATCHES`] are in use.
    pub(crate) fn watch(&self, imm: u32) -> Result<WatchSlot, TransportError> {
        let mut shard = lock(self.shard(imm));
        if self.watches.find(imm).is_some() {
            return Err(TransportError::ImmWatched(imm));
        }
        if shard.get(&imm).is_some_and(|s| !s.waiting.is_empty()) {
            return Err(TransportError::ImmAwaited(imm));
        }
        let index = self
            .watches
            .claim(imm)
            .ok_or(TransportError::ImmWatchesFull(MAX_WATCHES))?;
        let earlier = shard
            .get_mut(&imm)
            .map_or(0, |s| std::mem::take(&mut s.arrived));
        settle(&mut shard, imm, true);
        Ok(WatchSlot { index, earlier })
    }

    /// The arrivals watch `index` counted, modulo 2^32 (read it at least that often).
    #[inline]
    pub(crate) fn watched(&self, index: usize) -> u32 {
        self.watches.words[index].load(Ordering::Acquire) as u32
    }

    /// Ends watch `index`: later arrivals of its value are counted as before the watch.
    /// Arrivals racing with this call may be counted by the ended watch instead.
    pub(crate) fn unwatch(&self, index: usize) {
        self.watches.release(index);
    }

    /// Arrivals of `imm` counted and not consumed by any expectation.
    pub(crate) fn pending(&self, imm: u32) -> u64 {
        lock(self.shard(imm)).get(&imm).map_or(0, |s| s.arrived)
    }

    /// Consumes and returns the arrivals of `imm` no expectation has claimed (for values used
    /// as plain notifications, which would otherwise stay counted forever).
    pub(crate) fn take(&self, imm: u32) -> u64 {
        let mut shard = lock(self.shard(imm));
        let Some(slot) = shard.get_mut(&imm) else {
            return 0;
        };
        let taken = std::mem::take(&mut slot.arrived);
        let idle = slot.idle();
        settle(&mut shard, imm, idle);
        taken
    }

    /// Reserves `imm` for the application: its slot is kept, so its arrivals are counted even
    /// when a flood of other values fills its shard. False if it is reserved already or
    /// watched.
    pub(crate) fn reserve(&self, imm: u32) -> bool {
        let mut shard = lock(self.shard(imm));
        if self.watches.find(imm).is_some() {
            return false;
        }
        let slot = shard.entry(imm).or_default();
        !std::mem::replace(&mut slot.reserved, true)
    }

    /// Ends the reservation of `imm`; arrivals counted and unclaimed stay counted.
    pub(crate) fn release(&self, imm: u32) {
        let mut shard = lock(self.shard(imm));
        let Some(slot) = shard.get_mut(&imm) else {
            return;
        };
        slot.reserved = false;
        let idle = slot.idle();
        settle(&mut shard, imm, idle);
    }

    /// Arrivals dropped because their value had no slot and its shard was full.
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Removes every waiting expectation (engine shutdown), returning their tokens.
    pub(crate) fn drain_waiting(&self) -> Vec<T> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            for slot in shard.values_mut() {
                out.extend(slot.waiting.drain(..).map(|(_, t)| t));
            }
            shard.retain(|_, s| s.arrived > 0 || s.reserved);
        }
        out
    }

    /// Values with counts or expectations held (0 once everything is consumed: nothing leaks).
    pub(crate) fn tracked_values(&self) -> usize {
        self.shards
            .iter()
            .map(|s| lock(s).values().filter(|slot| !slot.idle()).count())
            .sum()
    }

    /// Slots held, idle ones included: at most [`KEEP_IDLE`] idle ones per shard.
    #[cfg(test)]
    fn slots(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }
}

#[cfg(all(test, not(kvroute_loom)))]
mod tests;

/// loom models: `cargo xtask loom`.
#[cfg(all(test, kvroute_loom))]
mod loom_models;
