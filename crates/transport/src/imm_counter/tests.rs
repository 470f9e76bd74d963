//! Unit tests of `imm_counter`.

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
