//! loom models: `cargo xtask loom`. Each model runs against the real counter and against a
//! deliberately broken one (check-then-act without a common lock), which must fail: that is
//! the proof the models can catch the bug they are about.

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
    let caught = std::panic::catch_unwind(concurrent_arrivals_and_registration::<BrokenCounter>);
    assert!(
        caught.is_err(),
        "the model must find the lost wake-up in BrokenCounter"
    );
}
