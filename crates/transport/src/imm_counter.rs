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

use std::collections::VecDeque;

use crate::FastMap;

use crate::sync::{Mutex, lock};

/// Shards: enough that workers and app threads rarely contend, few enough to stay small.
const SHARDS: usize = 16;
/// Slots a shard keeps once their value has nothing counted or waiting, so a value used
/// again (every round trip's immediate) finds its slot and its queue's buffer instead of
/// inserting and allocating them anew; beyond this, idle slots are removed. Values are chosen
/// by peers, so the idle slots must stay bounded: at most `SHARDS * KEEP_IDLE` in all.
const KEEP_IDLE: usize = 8;

#[derive(Debug)]
struct Slot<T> {
    /// Arrivals counted and not yet consumed by an expectation.
    arrived: u64,
    /// Expectations still short of arrivals, oldest first: (arrivals needed, token).
    waiting: VecDeque<(u64, T)>,
}

impl<T> Slot<T> {
    fn idle(&self) -> bool {
        self.arrived == 0 && self.waiting.is_empty()
    }
}

/// Removes `imm`'s slot if the caller found it `idle` and the shard already holds more than
/// [`KEEP_IDLE`] slots.
fn settle<T>(shard: &mut FastMap<u32, Slot<T>>, imm: u32, idle: bool) {
    if idle && shard.len() > KEEP_IDLE {
        shard.remove(&imm);
    }
}

impl<T> Default for Slot<T> {
    fn default() -> Self {
        Self {
            arrived: 0,
            waiting: VecDeque::new(),
        }
    }
}

/// What [`ImmCounter::arrive`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// An expectation was waiting on the value.
    Expected,
    /// Nobody was waiting; the arrivals are kept for a later expectation.
    Unexpected,
}

/// One shard: the slots of the values that hash to it.
type Shard<T> = Mutex<FastMap<u32, Slot<T>>>;

/// Per-immediate arrival counts and the expectations waiting on them.
#[derive(Debug)]
pub struct ImmCounter<T> {
    shards: Box<[Shard<T>]>,
}

impl<T> Default for ImmCounter<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> ImmCounter<T> {
    /// An empty counter.
    pub fn new() -> Self {
        Self {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(FastMap::default()))
                .collect(),
        }
    }

    fn shard(&self, imm: u32) -> &Shard<T> {
        &self.shards[imm as usize % SHARDS]
    }

    /// Counts `n` arrivals of `imm`; the expectations they complete are appended to `fired`,
    /// oldest first.
    pub fn arrive(&self, imm: u32, n: u64, fired: &mut Vec<T>) -> Arrival {
        let mut shard = lock(self.shard(imm));
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

    /// Expects `count` arrivals of `imm`. Returns the token at once if they have already been
    /// counted and no earlier expectation of `imm` is waiting; otherwise keeps it until they
    /// arrive.
    pub fn expect(&self, imm: u32, count: u64, token: T) -> Option<T> {
        let mut shard = lock(self.shard(imm));
        let slot = shard.entry(imm).or_default();
        if slot.waiting.is_empty() && slot.arrived >= count {
            slot.arrived -= count;
            let idle = slot.idle();
            settle(&mut shard, imm, idle);
            return Some(token);
        }
        slot.waiting.push_back((count, token));
        None
    }

    /// Arrivals of `imm` counted and not consumed by any expectation.
    pub fn pending(&self, imm: u32) -> u64 {
        lock(self.shard(imm)).get(&imm).map_or(0, |s| s.arrived)
    }

    /// Consumes and returns the arrivals of `imm` no expectation has claimed (for values used
    /// as plain notifications, which would otherwise stay counted forever).
    pub fn take(&self, imm: u32) -> u64 {
        let mut shard = lock(self.shard(imm));
        let Some(slot) = shard.get_mut(&imm) else {
            return 0;
        };
        let taken = std::mem::take(&mut slot.arrived);
        let idle = slot.idle();
        settle(&mut shard, imm, idle);
        taken
    }

    /// Removes every waiting expectation (engine shutdown), returning their tokens.
    pub fn drain_waiting(&self) -> Vec<T> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            for slot in shard.values_mut() {
                out.extend(slot.waiting.drain(..).map(|(_, t)| t));
            }
            shard.retain(|_, s| s.arrived > 0);
        }
        out
    }

    /// Values with counts or expectations held (0 once everything is consumed: nothing leaks).
    pub fn tracked_values(&self) -> usize {
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
        assert_eq!(c.expect(7, 3, "a"), Some("a"));
        assert_eq!(c.tracked_values(), 0);
    }

    #[test]
    fn arrivals_after_the_expectation_fire_it_once_and_excess_carries_over() {
        let c = ImmCounter::new();
        let mut fired = Vec::new();
        assert_eq!(c.expect(7, 2, "first"), None);
        assert_eq!(c.expect(7, 1, "second"), None);
        assert_eq!(c.arrive(7, 1, &mut fired), Arrival::Expected);
        assert!(fired.is_empty());
        c.arrive(7, 4, &mut fired);
        assert_eq!(fired, ["first", "second"]);
        assert_eq!(c.pending(7), 2, "the excess waits for the next expectation");
        assert_eq!(c.expect(7, 2, "third"), Some("third"));
        assert_eq!(c.tracked_values(), 0);
    }

    #[test]
    fn a_later_expectation_never_overtakes_an_earlier_one() {
        let c = ImmCounter::new();
        assert_eq!(c.expect(1, 5, "big"), None);
        let mut fired = Vec::new();
        c.arrive(1, 1, &mut fired);
        assert_eq!(c.expect(1, 1, "small"), None, "queued behind the first");
        c.arrive(1, 5, &mut fired);
        assert_eq!(fired, ["big", "small"]);
    }

    #[test]
    fn values_are_independent_and_take_drains_notifications() {
        let c = ImmCounter::new();
        let mut fired = Vec::new();
        c.arrive(1, 2, &mut fired);
        c.arrive(17, 1, &mut fired); // same shard as 1
        assert_eq!(c.expect(17, 1, ()), Some(()));
        assert_eq!(c.take(1), 2);
        assert_eq!((c.take(1), c.tracked_values()), (0, 0));
    }

    #[test]
    fn idle_slots_are_kept_for_reuse_and_stay_bounded() {
        let c = ImmCounter::new();
        let mut fired = Vec::new();
        for round in 0..1000 {
            assert_eq!(c.expect(5, 1, round), None);
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
            u64::from(ImmCounter::expect(self, imm, n, ()).is_some())
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
