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
//! below look for. The counter stores a caller-chosen token per expectation and hands it back
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
mod tests {
    use super::*;

    #[test]
    fn arrivals_before_the_expectation_fire_it_at_registration() {
        let c = ImmCounter::new();
        let mut fired = Vec::new();
        assert_eq!(c.arrive(7, 3, &mut fired), Arrival::Unexpected);
        assert!(fired.is_empty());
        assert_eq!(c.expect(7, 3, "a"), Expectation::Met("a"));
        assert_eq!(c.tracked_values(), 0);
    }

    #[test]
    fn arrivals_after_the_expectation_fire_it_once_and_excess_carries_over() {
        let c = ImmCounter::new();
        let mut fired = Vec::new();
        assert_eq!(c.expect(7, 2, "first"), Expectation::Waiting);
        assert_eq!(c.expect(7, 1, "second"), Expectation::Waiting);
        assert_eq!(c.arrive(7, 1, &mut fired), Arrival::Expected);
        assert!(fired.is_empty());
        c.arrive(7, 4, &mut fired);
        assert_eq!(fired, ["first", "second"]);
        assert_eq!(c.pending(7), 2, "the excess waits for the next expectation");
        assert_eq!(c.expect(7, 2, "third"), Expectation::Met("third"));
        assert_eq!(c.tracked_values(), 0);
    }

    #[test]
    fn a_later_expectation_never_overtakes_an_earlier_one() {
        let c = ImmCounter::new();
        assert_eq!(c.expect(1, 5, "big"), Expectation::Waiting);
        let mut fired = Vec::new();
        c.arrive(1, 1, &mut fired);
        assert_eq!(
            c.expect(1, 1, "small"),
            Expectation::Waiting,
            "queued behind the first"
        );
        c.arrive(1, 5, &mut fired);
        assert_eq!(fired, ["big", "small"]);
    }

    #[test]
    fn values_are_independent_and_take_drains_notifications() {
        let c = ImmCounter::new();
        let mut fired = Vec::new();
        c.arrive(1, 2, &mut fired);
        c.arrive(17, 1, &mut fired); // same shard as 1
        assert_eq!(c.expect(17, 1, ()), Expectation::Met(()));
        assert_eq!(c.take(1), 2);
        assert_eq!((c.take(1), c.tracked_values()), (0, 0));
    }

    #[test]
    fn idle_slots_are_kept_for_reuse_and_stay_bounded() {
        let c = ImmCounter::new();
        let mut fired = Vec::new();
        for round in 0..1000 {
            assert_eq!(c.expect(5, 1, round), Expectation::Waiting);
            c.arrive(5, 1, &mut fired);
        }
        assert_eq!(fired.len(), 1000);
        assert_eq!((c.tracked_values(), c.slots()), (0, 1), "one slot, reused");
        // A peer's stream of distinct values, each consumed: idle slots stay bounded.
        for imm in 0..10_000 {
            c.arrive(imm, 1, &mut fired);
            assert_eq!(c.take(imm), 1);
        }
        assert_eq!(c.tracked_values(), 0);
        assert!(c.slots() <= SHARDS * KEEP_IDLE, "{} idle slots", c.slots());
        // Values still counted are never dropped to make room.
        for imm in 0..1000 {
            c.arrive(imm, 2, &mut fired);
        }
        assert_eq!(c.tracked_values(), 1000);
        assert!((0..1000).all(|imm| c.pending(imm) == 2));
    }

    #[test]
    fn a_flood_of_values_is_bounded_and_never_drops_a_reserved_or_awaited_one() {
        let c = ImmCounter::new();
        let mut fired = Vec::new();
        let (reserved, awaited) = (0xdead_beef, 0xfeed_f00d);
        assert!(c.reserve(reserved));
        assert!(!c.reserve(reserved), "reserved twice");
        assert_eq!(c.expect(awaited, 2, 7), Expectation::Waiting);
        let flood = 100_000u64;
        for imm in 0..flood as u32 {
            c.arrive(imm, 1, &mut fired);
        }
        let limit = SHARDS * MAX_SHARD_SLOTS;
        assert!(c.slots() <= limit, "{} slots", c.slots());
        let kept: u64 = (0..flood as u32).map(|imm| c.pending(imm)).sum();
        assert_eq!(
            kept + c.dropped(),
            flood,
            "every arrival kept or counted dropped"
        );
        assert!(c.dropped() >= flood - limit as u64);
        // The reserved value's early arrivals are counted for its later expectation, and the
        // awaited one fires.
        assert_eq!(c.arrive(reserved, 3, &mut fired), Arrival::Unexpected);
        assert_eq!(c.expect(reserved, 3, 1), Expectation::Met(1));
        c.arrive(awaited, 2, &mut fired);
        assert_eq!(fired, vec![7]);
        // A released value's slot goes once idle; reserving again works.
        c.release(reserved);
        assert!(c.reserve(reserved));
    }

    #[test]
    fn shutdown_drains_every_waiting_token() {
        let c = ImmCounter::new();
        c.expect(3, 1, 'a');
        c.expect(3, 1, 'b');
        c.expect(4, 9, 'c');
        let mut tokens = c.drain_waiting();
        tokens.sort_unstable();
        assert_eq!(tokens, ['a', 'b', 'c']);
        assert_eq!(c.tracked_values(), 0);
    }
    #[test]
    fn a_watch_takes_over_the_count_and_counts_without_the_counter() {
        let c = ImmCounter::new();
        let mut fired = Vec::new();
        c.arrive(5, 2, &mut fired);
        let w = c.watch(5).unwrap();
        assert_eq!(
            w.earlier, 2,
            "arrivals counted before the watch are taken over"
        );
        assert_eq!(c.arrive(5, 3, &mut fired), Arrival::Expected);
        assert_eq!((c.watched(w.index), c.pending(5), c.take(5)), (3, 0, 0));
        assert_eq!(c.expect(5, 1, "refused"), Expectation::Refused("refused"));
        // Other values, the same shard's included, are counted as before.
        assert_eq!(c.arrive(21, 1, &mut fired), Arrival::Unexpected);
        assert_eq!(c.pending(21), 1);
        c.unwatch(w.index);
        assert_eq!(c.arrive(5, 1, &mut fired), Arrival::Unexpected);
        assert_eq!(c.expect(5, 1, "after"), Expectation::Met("after"));
        assert!(fired.is_empty());
    }

    #[test]
    fn watches_are_refused_while_watched_expected_or_all_in_use() {
        let c = ImmCounter::new();
        let first = c.watch(0).unwrap();
        assert_eq!(c.watch(0), Err(TransportError::ImmWatched(0)));
        assert_eq!(c.expect(1, 1, ()), Expectation::Waiting);
        assert_eq!(c.watch(1), Err(TransportError::ImmAwaited(1)));
        let rest: Vec<_> = (2..)
            .take(MAX_WATCHES - 1)
            .map(|v| c.watch(v).unwrap())
            .collect();
        assert_eq!(
            c.watch(99),
            Err(TransportError::ImmWatchesFull(MAX_WATCHES))
        );
        // A released slot is reused, its count starting afresh.
        let mut fired = Vec::new();
        c.arrive(0, 4, &mut fired);
        c.unwatch(first.index);
        let again = c.watch(99).unwrap();
        assert_eq!((again.index, c.watched(again.index)), (first.index, 0));
        for (v, w) in (2..).zip(&rest) {
            c.arrive(v, 1, &mut fired);
            assert_eq!(c.watched(w.index), 1, "value {v}");
        }
    }

    #[test]
    fn a_watch_count_wraps_within_its_half_of_the_word() {
        let c = ImmCounter::<()>::new();
        let w = c.watch(u32::MAX).unwrap();
        let mut fired = Vec::new();
        c.arrive(u32::MAX, u64::from(u32::MAX), &mut fired);
        assert_eq!(c.arrive(u32::MAX, 2, &mut fired), Arrival::Expected);
        assert_eq!(c.watched(w.index), 1);
        // The value's half is untouched: the watch still matches it, and only it.
        assert_eq!(c.arrive(u32::MAX, 1, &mut fired), Arrival::Expected);
        assert_eq!(c.arrive(u32::MAX - 1, 1, &mut fired), Arrival::Unexpected);
        assert_eq!(c.watched(w.index), 2);
    }

    /// One step of [`a_counter_with_watches_keeps_every_arrival_once`].
    #[derive(Debug, Clone)]
    enum Op {
        Arrive(u32, u64),
        Expect(u32, u64),
        Take(u32),
        Watch(u32),
        Unwatch(u32),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        // Few values, in two shards, so that the operations meet.
        let imm = prop::sample::select(vec![0u32, 1, 16, 17]);
        prop_oneof![
            4 => (imm.clone(), 1..4u64).prop_map(|(v, n)| Op::Arrive(v, n)),
            2 => (imm.clone(), 1..4u64).prop_map(|(v, n)| Op::Expect(v, n)),
            1 => imm.clone().prop_map(Op::Take),
            1 => imm.clone().prop_map(Op::Watch),
            1 => imm.prop_map(Op::Unwatch),
        ]
    }

    proptest::proptest! {
        /// Every answer is the one a plain model of the rules gives: which expectations fire
        /// and in what order, what is refused, what each watch and each value's pending count
        /// hold. So every arrival ends up exactly once: in an expectation, taken, in a watch,
        /// or pending.
        #[test]
        fn a_counter_with_watches_answers_as_the_model(
            ops in proptest::collection::vec(op(), 1..60)
        ) {
            use proptest::{prop_assert, prop_assert_eq};
            use std::collections::HashMap;
            use std::collections::hash_map::Entry;
            let c = ImmCounter::new();
            let mut fired = Vec::new();
            // The model, per value: pending arrivals, waiting (need, token), a watch's
            // (slot, arrivals since it began).
            let mut pending: HashMap<u32, u64> = HashMap::new();
            let mut waiting: HashMap<u32, VecDeque<(u64, usize)>> = HashMap::new();
            let mut watches: HashMap<u32, (usize, u64)> = HashMap::new();
            let mut model_fired = Vec::new();
            for (step, op) in ops.into_iter().enumerate() {
                match op {
                    Op::Arrive(v, n) => {
                        let got = c.arrive(v, n, &mut fired);
                        if let Some((_, since)) = watches.get_mut(&v) {
                            *since += n;
                            prop_assert_eq!(got, Arrival::Expected);
                            continue;
                        }
                        let q = waiting.entry(v).or_default();
                        let want = if q.is_empty() {
                            Arrival::Unexpected
                        } else {
                            Arrival::Expected
                        };
                        prop_assert_eq!(got, want);
                        let p = pending.entry(v).or_default();
                        *p += n;
                        while let Some(&(need, token)) = q.front() {
                            if *p < need {
                                break;
                            }
                            *p -= need;
                            model_fired.push(token);
                            q.pop_front();
                        }
                    }
                    Op::Expect(v, n) => {
                        let got = c.expect(v, n, step);
                        let q = waiting.entry(v).or_default();
                        let p = pending.entry(v).or_default();
                        let want = if watches.contains_key(&v) {
                            Expectation::Refused(step)
                        } else if q.is_empty() && *p >= n {
                            *p -= n;
                            model_fired.push(step);
                            Expectation::Met(step)
                        } else {
                            q.push_back((n, step));
                            Expectation::Waiting
                        };
                        prop_assert_eq!(got, want);
                        if let Expectation::Met(token) = got {
                            fired.push(token);
                        }
                    }
                    Op::Take(v) => {
                        prop_assert_eq!(c.take(v), pending.insert(v, 0).unwrap_or(0));
                    }
                    Op::Watch(v) => {
                        let got = c.watch(v);
                        let awaited = waiting.get(&v).is_some_and(|q| !q.is_empty());
                        match watches.entry(v) {
                            Entry::Occupied(_) => {
                                prop_assert_eq!(got, Err(TransportError::ImmWatched(v)));
                            }
                            Entry::Vacant(_) if awaited => {
                                prop_assert_eq!(got, Err(TransportError::ImmAwaited(v)));
                            }
                            Entry::Vacant(free) => {
                                let slot = got.expect("a free slot: at most 4 values are watched");
                                let earlier = pending.insert(v, 0).unwrap_or(0);
                                prop_assert_eq!(slot.earlier, earlier);
                                free.insert((slot.index, 0));
                            }
                        }
                    }
                    Op::Unwatch(v) => {
                        if let Some((index, _)) = watches.remove(&v) {
                            c.unwatch(index);
                        }
                    }
                }
                for (v, &(index, since)) in &watches {
                    prop_assert_eq!(u64::from(c.watched(index)), since, "value {}", v);
                }
            }
            prop_assert_eq!(&fired, &model_fired);
            for (&v, &p) in &pending {
                prop_assert_eq!(c.pending(v), p, "value {}", v);
            }
            let indices: std::collections::HashSet<_> = watches.values().map(|w| w.0).collect();
            prop_assert!(indices.len() == watches.len(), "each watch has a slot of its own");
        }
    }
}

/// loom models: `cargo xtask loom`. Each model runs against the real counter and against a
/// deliberately broken one (check-then-act without a common lock), which must fail: that is
/// the proof the models can catch the bug they are about.
#[cfg(all(test, kvroute_loom))]
mod loom_models {
    use super::*;
    use crate::sync::{Arc, AtomicU64, Ordering};
    use Ordering::SeqCst;
    use loom::thread;

    /// The operations a model drives: counts of expectations fired by each call.
    trait Counter: Send + Sync + 'static {
        fn arrive(&self, imm: u32, n: u64) -> u64;
        fn expect(&self, imm: u32, n: u64) -> u64;
        fn pending(&self, imm: u32) -> u64;
    }

    impl Counter for ImmCounter<()> {
        fn arrive(&self, imm: u32, n: u64) -> u64 {
            let mut fired = Vec::new();
            ImmCounter::arrive(self, imm, n, &mut fired);
            fired.len() as u64
        }
        fn expect(&self, imm: u32, n: u64) -> u64 {
            u64::from(matches!(
                ImmCounter::expect(self, imm, n, ()),
                Expectation::Met(())
            ))
        }
        fn pending(&self, imm: u32) -> u64 {
            ImmCounter::pending(self, imm)
        }
    }

    /// The classic bug: the count and the waiter live in separate atomics, so an arrival that
    /// lands between the expectation's check and its registration is never matched.
    #[derive(Default)]
    struct BrokenCounter {
        arrived: AtomicU64,
        waiting: AtomicU64,
    }

    impl Counter for BrokenCounter {
        fn arrive(&self, _imm: u32, n: u64) -> u64 {
            let now = self.arrived.fetch_add(n, Ordering::SeqCst) + n;
            let need = self.waiting.load(Ordering::SeqCst);
            if need > 0 && now >= need && self.waiting.swap(0, Ordering::SeqCst) == need {
                self.arrived.fetch_sub(need, Ordering::SeqCst);
                return 1;
            }
            0
        }
        fn expect(&self, _imm: u32, n: u64) -> u64 {
            if self.arrived.load(Ordering::SeqCst) >= n {
                self.arrived.fetch_sub(n, Ordering::SeqCst);
                return 1;
            }
            self.waiting.store(n, Ordering::SeqCst);
            0
        }
        fn pending(&self, _imm: u32) -> u64 {
            self.arrived.load(Ordering::SeqCst)
        }
    }

    /// Two single arrivals race one expectation of two: it fires exactly once, nothing left.
    fn concurrent_arrivals_and_registration<C: Counter + Default>() {
        loom::model(|| {
            let c = Arc::new(C::default());
            let fired = Arc::new(AtomicU64::new(0));
            let arrivers: Vec<_> = (0..2)
                .map(|_| {
                    let (c, fired) = (c.clone(), fired.clone());
                    thread::spawn(move || fired.fetch_add(c.arrive(9, 1), SeqCst))
                })
                .collect();
            fired.fetch_add(c.expect(9, 2), SeqCst);
            for a in arrivers {
                a.join().unwrap();
            }
            assert_eq!(
                fired.load(SeqCst),
                1,
                "the expectation must fire exactly once"
            );
            assert_eq!(c.pending(9), 0);
        });
    }

    /// Three arrivals race two expectations (2 then 1): both fire, each once.
    fn excess_arrivals_carry_over<C: Counter + Default>() {
        loom::model(|| {
            let c = Arc::new(C::default());
            let fired = Arc::new(AtomicU64::new(0));
            let arriver = {
                let (c, fired) = (c.clone(), fired.clone());
                thread::spawn(move || fired.fetch_add(c.arrive(4, 3), SeqCst))
            };
            fired.fetch_add(c.expect(4, 2), SeqCst);
            fired.fetch_add(c.expect(4, 1), SeqCst);
            arriver.join().unwrap();
            assert_eq!(fired.load(SeqCst), 2);
            assert_eq!(c.pending(4), 0);
        });
    }

    /// How a watch model counts an arrival: the counter's own path, or a broken one.
    type ArriveFn = fn(&ImmCounter<()>, u32, u64);

    fn arrive(c: &ImmCounter<()>, imm: u32, n: u64) {
        c.arrive(imm, n, &mut Vec::new());
    }

    /// Broken: no second look for a watch under the shard's lock, so an arrival that missed
    /// a watch being set up is counted where the watch no longer reads.
    fn arrive_with_one_look(c: &ImmCounter<()>, imm: u32, n: u64) {
        if !c.watches.bump(imm, n) {
            lock(c.shard(imm)).entry(imm).or_default().arrived += n;
        }
    }

    /// Broken: the watch's value is checked, then the count added apart from it, so an
    /// arrival can land in a slot handed to another value meanwhile.
    fn arrive_check_then_add(c: &ImmCounter<()>, imm: u32, n: u64) {
        let mut live = c.watches.live.load(SeqCst);
        while live != 0 {
            let word = &c.watches.words[live.trailing_zeros() as usize];
            live &= live - 1;
            if (word.load(SeqCst) >> 32) as u32 == imm {
                word.fetch_add(n, SeqCst);
                return;
            }
        }
        arrive(c, imm, n);
    }

    /// An arrival races the watch's set-up: it is counted once, by the watch (taken over or
    /// added), never left with the counter.
    fn an_arrival_racing_a_watch_is_counted_by_it(arrive: ArriveFn) {
        loom::model(move || {
            let c = Arc::new(ImmCounter::<()>::new());
            let arriver = {
                let c = c.clone();
                thread::spawn(move || arrive(&c, 3, 1))
            };
            let slot = c.watch(3).unwrap();
            arriver.join().unwrap();
            assert_eq!(slot.earlier + u64::from(c.watched(slot.index)), 1);
            assert_eq!(c.pending(3), 0);
        });
    }

    /// An arrival of a value whose watch ends while a watch of another value takes its slot:
    /// the new watch never counts it.
    fn an_arrival_never_reaches_another_values_watch(arrive: ArriveFn) {
        loom::model(move || {
            let c = Arc::new(ImmCounter::<()>::new());
            let old = c.watch(3).unwrap();
            let arriver = {
                let c = c.clone();
                thread::spawn(move || arrive(&c, 3, 1))
            };
            c.unwatch(old.index);
            let new = c.watch(4).unwrap();
            arriver.join().unwrap();
            assert_eq!(new.index, old.index, "the slot is reused");
            assert_eq!(c.watched(new.index), 0, "value 3's arrival counted for 4");
        });
    }

    #[test]
    fn watches_count_each_arrival_once_and_only_for_their_value() {
        an_arrival_racing_a_watch_is_counted_by_it(arrive);
        an_arrival_never_reaches_another_values_watch(arrive);
    }

    #[test]
    fn broken_watch_paths_are_caught_by_the_models() {
        for (model, broken, name) in [
            (
                an_arrival_racing_a_watch_is_counted_by_it as fn(ArriveFn),
                arrive_with_one_look as ArriveFn,
                "one look",
            ),
            (
                an_arrival_never_reaches_another_values_watch,
                arrive_check_then_add,
                "check then add",
            ),
        ] {
            let caught = std::panic::catch_unwind(|| model(broken));
            assert!(caught.is_err(), "the model must catch the {name} arrival");
        }
    }

    #[test]
    fn imm_counter_fires_once_under_concurrent_arrivals_and_registration() {
        concurrent_arrivals_and_registration::<ImmCounter<()>>();
        excess_arrivals_carry_over::<ImmCounter<()>>();
    }

    #[test]
    fn broken_imm_counter_is_caught_by_the_models() {
        let caught =
            std::panic::catch_unwind(concurrent_arrivals_and_registration::<BrokenCounter>);
        assert!(
            caught.is_err(),
            "the model must find the lost wake-up in BrokenCounter"
        );
    }
}
