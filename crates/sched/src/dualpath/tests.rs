//! Unit tests of `dualpath`.

use super::*;
use crate::rng::Rng;

const KVB: f64 = 1000.0;

fn topo(p: u32, d: u32, per: u32, group: u32) -> Topology {
    Topology {
        prefill_nodes: p,
        decode_nodes: d,
        engines_per_node: per,
        nodes_per_group: group,
    }
}

fn config(policy: Policy) -> SchedConfig {
    SchedConfig {
        policy,
        short_read_queue_bytes: 1e6,
        max_unfinished_tokens: 10_000.0,
        de_hbm_bytes: 1e8,
        kv_bytes_per_token: KVB,
    }
}

fn req(id: u64, hit: u64, miss: u64) -> Request {
    Request {
        id,
        hit_tokens: hit,
        miss_tokens: miss,
        gen_tokens: 10,
    }
}

fn run(s: &mut DualPath) -> Vec<Placement> {
    let mut out = Vec::new();
    s.schedule(&mut out);
    out
}

/// 1P1D, 2 engines a node. r0 goes to the least-loaded PE (PE 0 on the tie), the
/// least-loaded DE, and reads on the DE side (queues tie). r1 goes to PE 1 (tok 0); the DE
/// node now queues r0's 1 MB, so r1 reads on the PE side. r2 (PE tok 3000 vs 2000) goes
/// to PE 1 and the DE side is shorter again after r0's read is done.
#[test]
fn least_tokens_and_shorter_read_queue_by_hand() {
    let mut s = DualPath::new(topo(1, 1, 2, 1), config(Policy::DualPath)).unwrap();
    s.submit(req(0, 1000, 2000)).unwrap();
    s.submit(req(1, 1000, 1000)).unwrap();
    let p = run(&mut s);
    assert_eq!((p[0].pe, p[0].de, p[0].read), (0, 2, ReadSide::Decode));
    assert_eq!((p[1].pe, p[1].de, p[1].read), (1, 3, ReadSide::Prefill));
    assert_eq!(
        (s.tokens_of(0), s.tokens_of(1), s.tokens_of(2)),
        (3000, 2000, 3000)
    );
    s.read_done(0);
    s.submit(req(2, 1000, 1000)).unwrap();
    let p = run(&mut s);
    assert_eq!((p[0].pe, p[0].de, p[0].read), (1, 3, ReadSide::Decode));
    assert_eq!(s.read_queue_bytes(0), 1e6);
    assert_eq!(s.read_queue_bytes(1), 1e6);
}

/// `beta`: a PE past 10,000 unfinished tokens takes nothing until its prefill finishes.
#[test]
fn overloaded_prefill_engines_wait() {
    let mut s = DualPath::new(topo(1, 1, 1, 1), config(Policy::DualPath)).unwrap();
    s.submit(req(0, 6000, 5000)).unwrap();
    s.submit(req(1, 10, 10)).unwrap();
    assert_eq!(run(&mut s).len(), 1);
    assert_eq!((s.waiting(), s.in_flight()), (1, 1));
    assert!(run(&mut s).is_empty());
    s.prefill_done(0);
    assert_eq!(run(&mut s).len(), 1);
    // Finishing decode of a request still in prefill does nothing.
    s.decode_done(1);
    assert_eq!(s.in_flight(), 2);
    s.decode_done(0);
    assert_eq!(s.in_flight(), 1);
}

/// `alpha`: within a group of two nodes, engines on the node with the short read queue
/// are preferred even with more unfinished tokens.
#[test]
fn short_read_queues_are_preferred() {
    let mut s = DualPath::new(topo(2, 1, 1, 2), config(Policy::PrefillRead)).unwrap();
    // Round robin puts a 2 MB read on node 0 (PE 0) and a small one on node 1 (PE 1).
    s.submit(req(0, 2000, 1)).unwrap();
    s.submit(req(1, 1, 3000)).unwrap();
    run(&mut s);
    let mut s2 = DualPath {
        config: config(Policy::DualPath),
        ..s
    };
    s2.submit(req(2, 10, 10)).unwrap();
    let p = run(&mut s2);
    // PE 0 has 2001 tokens, PE 1 3001; node 0's queue (2 MB) is over alpha (1 MB).
    assert_eq!(p[0].pe, 1);
}

#[test]
fn decode_hbm_bounds_placement() {
    let mut cfg = config(Policy::DualPath);
    cfg.de_hbm_bytes = 25_000.0 * KVB;
    let mut s = DualPath::new(topo(1, 1, 1, 1), cfg).unwrap();
    assert!(matches!(
        s.submit(req(9, 30_000, 1)),
        Err(SchedError::RequestTooLarge { .. })
    ));
    s.submit(req(0, 100, 14_000)).unwrap();
    s.submit(req(1, 100, 14_000)).unwrap();
    assert_eq!(run(&mut s).len(), 1);
    s.prefill_done(0);
    // PE free, DE full: still waiting.
    assert!(run(&mut s).is_empty());
    s.decode_done(0);
    assert_eq!(run(&mut s).len(), 1);
}

/// 1P4D, one engine a node, HBM for one request per DE: four requests fill every DE and
/// the fifth waits. Each event of the simulator calls `schedule`; once one call has found
/// no room, the next ones examine no DE while nothing is freed (a full scan each made
/// 1000 calls cost 4000 examinations). A finished decode frees
/// its DE, and the head goes there.
#[test]
fn blocked_head_examines_no_decode_engine_until_hbm_is_freed() {
    for policy in Policy::ALL {
        let mut cfg = config(policy);
        cfg.de_hbm_bytes = 25_000.0 * KVB;
        let mut s = DualPath::new(topo(1, 4, 1, 1), cfg).unwrap();
        for i in 0..5 {
            s.submit(req(i, 100, 14_000)).unwrap();
        }
        let mut placed = Vec::new();
        while placed.len() < 4 {
            let p = run(&mut s);
            assert!(!p.is_empty(), "{policy:?}");
            for p in &p {
                // Past beta: the PE takes more only once a prefill is done.
                s.prefill_done(p.request.id);
            }
            placed.extend(p);
        }
        assert_eq!(s.waiting(), 1, "{policy:?}");
        // This call finds that no DE has room.
        assert!(run(&mut s).is_empty());
        let examined = s.decode_engines_examined();
        for _ in 0..1000 {
            assert!(run(&mut s).is_empty());
        }
        assert_eq!(s.decode_engines_examined(), examined, "{policy:?}");
        let freed = placed[2].de;
        s.decode_done(placed[2].request.id);
        let p = run(&mut s);
        assert_eq!(
            (p.len(), p[0].request.id, p[0].de),
            (1, 4, freed),
            "{policy:?}"
        );
    }
}

/// The blocked-head memo changes no decision: a scheduler whose memo is cleared before
/// every `schedule` (a full scan each time) places exactly the same requests on the same
/// engines through random arrivals, completions and failures, for every policy, while the
/// memoised one examines fewer DEs.
#[test]
fn blocked_head_memo_places_exactly_as_a_full_scan() {
    for (seed, policy) in (0..24).zip(Policy::ALL.iter().cycle()) {
        let mut cfg = config(*policy);
        cfg.de_hbm_bytes = 20_000.0 * KVB;
        let mut memo = DualPath::new(topo(2, 3, 2, 1), cfg).unwrap();
        let mut scan = DualPath::new(topo(2, 3, 2, 1), cfg).unwrap();
        let mut rng = Rng::new(seed);
        // (id, in decode)
        let mut held: Vec<(u64, bool)> = Vec::new();
        let (mut next, mut back, mut back_scan) = (0, Vec::new(), Vec::new());
        for _ in 0..3000 {
            let pick = (!held.is_empty()).then(|| rng.below(held.len() as u64) as usize);
            match (rng.below(10), pick) {
                (0..=2, _) => {
                    let r = req(next, rng.below(5000), 1 + rng.below(8000));
                    next += 1;
                    memo.submit(r).unwrap();
                    scan.submit(r).unwrap();
                }
                (3..=5, _) => {
                    scan.blocked_need_bytes = f64::INFINITY;
                    let (p, q) = (run(&mut memo), run(&mut scan));
                    assert_eq!(p, q, "seed {seed} {policy:?}");
                    held.extend(p.iter().map(|p| (p.request.id, false)));
                }
                (6, Some(k)) => {
                    memo.read_done(held[k].0);
                    scan.read_done(held[k].0);
                }
                (7, Some(k)) => {
                    memo.prefill_done(held[k].0);
                    scan.prefill_done(held[k].0);
                    held[k].1 = true;
                }
                (8, Some(k)) if held[k].1 => {
                    memo.decode_done(held[k].0);
                    scan.decode_done(held[k].0);
                    held.swap_remove(k);
                }
                (9, _) if rng.below(60) == 0 => {
                    let e = rng.below(20) as u32;
                    back.clear();
                    back_scan.clear();
                    memo.engine_failed(e, &mut back);
                    scan.engine_failed(e, &mut back_scan);
                    assert_eq!(back, back_scan);
                    held.retain(|(id, _)| back.iter().all(|r| r.request.id != *id));
                }
                _ => {}
            }
        }
        assert!(
            memo.decode_engines_examined() < scan.decode_engines_examined(),
            "seed {seed} {policy:?}: the memo never applied"
        );
    }
}

#[test]
fn baselines_take_engines_in_turn() {
    let mut s = DualPath::new(topo(2, 1, 1, 1), config(Policy::PrefillRead)).unwrap();
    let mut rr = DualPath::new(topo(2, 1, 1, 1), config(Policy::RoundRobin)).unwrap();
    for i in 0..4 {
        s.submit(req(i, 100, 100)).unwrap();
        rr.submit(req(i, 100, 100)).unwrap();
    }
    let p = run(&mut s);
    assert_eq!(p.iter().map(|p| p.pe).collect::<Vec<_>>(), [0, 1, 0, 1]);
    assert!(p.iter().all(|p| p.read == ReadSide::Prefill));
    let sides: Vec<ReadSide> = run(&mut rr).iter().map(|p| p.read).collect();
    assert_eq!(
        sides,
        [
            ReadSide::Prefill,
            ReadSide::Decode,
            ReadSide::Prefill,
            ReadSide::Decode
        ]
    );
}

/// A failed engine's requests go back to the head of the queue in order, its partner's
/// accounting is released, and nothing more is placed on it.
#[test]
fn failure_requeues_in_order() {
    let mut s = DualPath::new(topo(2, 1, 1, 1), config(Policy::DualPath)).unwrap();
    for i in 0..3 {
        s.submit(req(i, 100, 100)).unwrap();
    }
    let p = run(&mut s);
    let on_pe0: Vec<u64> = p
        .iter()
        .filter(|p| p.pe == 0)
        .map(|p| p.request.id)
        .collect();
    s.submit(req(3, 100, 100)).unwrap();
    let mut back = Vec::new();
    s.engine_failed(0, &mut back);
    assert_eq!(
        back.iter().map(|r| r.request.id).collect::<Vec<_>>(),
        on_pe0
    );
    assert_eq!(s.tokens_of(0), 0);
    assert_eq!(s.waiting(), on_pe0.len() + 1);
    let again = run(&mut s);
    assert!(again.iter().all(|p| p.pe == 1));
    assert_eq!(again[0].request.id, on_pe0[0]);
    // Failing it again, or an engine that does not exist, changes nothing.
    s.engine_failed(0, &mut back);
    s.engine_failed(99, &mut back);
    assert_eq!(back.len(), on_pe0.len());
}

/// Cost = tokens x 1 ms. Quota 10 ms: the first request (4 tokens) whole, the second (9)
/// chunked to the 6 that fit, and the third not at all. A request bigger than the quota
/// alone still advances by its fitting chunk; one whose first token alone passes the
/// quota advances by one token.
#[test]
fn compute_quota_packing_by_hand() {
    let cost = |_: u64, n: u64| n as f64 * 1e-3;
    let mut taken = Vec::new();
    let spent = pack_forward([(0, 4), (100, 9), (0, 3)], 0.010, cost, |k, n| {
        taken.push((k, n))
    });
    assert_eq!(taken, [(0, 4), (1, 6)]);
    assert!((spent - 0.010).abs() < 1e-12);
    taken.clear();
    pack_forward([(0, 50)], 0.010, cost, |k, n| taken.push((k, n)));
    assert_eq!(taken, [(0, 10)]);
    taken.clear();
    let huge = |_: u64, n: u64| n as f64;
    pack_forward([(0, 50), (0, 1)], 0.010, huge, |k, n| taken.push((k, n)));
    assert_eq!(taken, [(0, 1)]);
    // The cost sees the cached length: attention grows with the context.
    taken.clear();
    let ctx = |cached: u64, n: u64| (cached + n) as f64 * n as f64 * 1e-3;
    pack_forward([(8, 4)], 0.030, ctx, |k, n| taken.push((k, n)));
    assert_eq!(taken, [(0, 2)]);
}

#[test]
fn bad_configurations_are_typed_errors() {
    assert!(matches!(
        DualPath::new(topo(0, 1, 1, 1), config(Policy::DualPath)),
        Err(SchedError::Zero { .. })
    ));
    let mut c = config(Policy::DualPath);
    c.kv_bytes_per_token = -1.0;
    assert!(matches!(
        DualPath::new(topo(1, 1, 1, 1), c),
        Err(SchedError::NotPositive { .. })
    ));
    c.kv_bytes_per_token = f64::NAN;
    assert!(DualPath::new(topo(1, 1, 1, 1), c).is_err());
    assert!(DualPath::new(topo(u32::MAX, 1, 2, 1), config(Policy::DualPath)).is_err());
}
