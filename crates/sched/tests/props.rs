//! Property tests: under random arrivals, completions, failures and bandwidths, no request is
//! lost and none is served twice, and the schedulers' bookkeeping matches what was placed.

use std::collections::{BTreeMap, BTreeSet};

use kvroute_kvstore::TraceRecord;
use kvroute_sched::dualpath::{DualPath, Placement, Policy, Request, SchedConfig, Topology};
use kvroute_sched::dualpath_sim::{self, Arrivals, ClusterConfig, Failure, ModelProfile};
use kvroute_sched::prfaas::{Adaptation, RouterConfig};
use kvroute_sched::prfaas_sim::{self, CaseStudy, Deployment, Workload};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Submit { hit: u64, miss: u64 },
    Schedule,
    ReadDone(usize),
    PrefillDone(usize),
    DecodeDone(usize),
    Fail(u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u64..5000, 1u64..3000).prop_map(|(hit, miss)| Op::Submit { hit, miss }),
        3 => Just(Op::Schedule),
        2 => any::<usize>().prop_map(Op::ReadDone),
        2 => any::<usize>().prop_map(Op::PrefillDone),
        2 => any::<usize>().prop_map(Op::DecodeDone),
        1 => (0u32..12).prop_map(Op::Fail),
    ]
}

fn policy() -> impl Strategy<Value = Policy> {
    prop_oneof![
        Just(Policy::DualPath),
        Just(Policy::RoundRobin),
        Just(Policy::PrefillRead)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The scheduler against a model: every submitted request is waiting, placed once, or
    /// finished, never two of these; a finished request is never placed again; `tok_e` of
    /// every engine is the tokens of what the model holds on it.
    #[test]
    fn no_request_lost_or_served_twice(policy in policy(), ops in prop::collection::vec(op(), 1..300)) {
        let topo = Topology { prefill_nodes: 2, decode_nodes: 2, engines_per_node: 3, nodes_per_group: 1 };
        let kvb = 100.0;
        let mut s = DualPath::new(topo, SchedConfig {
            policy,
            short_read_queue_bytes: 200_000.0,
            max_unfinished_tokens: 8000.0,
            de_hbm_bytes: 2_000_000.0,
            kv_bytes_per_token: kvb,
        }).unwrap();
        let mut placed: BTreeMap<u64, (Placement, bool)> = BTreeMap::new(); // (placement, in decode)
        let mut waiting: BTreeSet<u64> = BTreeSet::new();
        let mut finished: BTreeSet<u64> = BTreeSet::new();
        let mut dead: BTreeSet<u32> = BTreeSet::new();
        let mut next = 0u64;
        let mut out = Vec::new();
        let mut back = Vec::new();
        for op in ops {
            match op {
                Op::Submit { hit, miss } => {
                    let r = Request { id: next, hit_tokens: hit, miss_tokens: miss, gen_tokens: 50 };
                    s.submit(r).unwrap();
                    waiting.insert(next);
                    next += 1;
                }
                Op::Schedule => {
                    out.clear();
                    s.schedule(&mut out);
                    for p in &out {
                        let id = p.request.id;
                        prop_assert!(waiting.remove(&id), "placed {id}, which was not waiting");
                        prop_assert!(!finished.contains(&id));
                        prop_assert!(!dead.contains(&p.pe) && !dead.contains(&p.de));
                        prop_assert!(p.pe < topo.prefill_engines() && p.de >= topo.prefill_engines());
                        if policy == Policy::PrefillRead {
                            prop_assert_eq!(p.read_node, topo.node_of(p.pe));
                        }
                        placed.insert(id, (*p, false));
                    }
                }
                Op::ReadDone(k) | Op::PrefillDone(k) | Op::DecodeDone(k) if !placed.is_empty() => {
                    let id = *placed.keys().nth(k % placed.len()).unwrap();
                    match op {
                        Op::ReadDone(_) => s.read_done(id),
                        Op::PrefillDone(_) => {
                            s.prefill_done(id);
                            placed.get_mut(&id).unwrap().1 = true;
                        }
                        _ => {
                            s.decode_done(id);
                            if placed[&id].1 {
                                placed.remove(&id);
                                finished.insert(id);
                            }
                        }
                    }
                }
                Op::Fail(e) => {
                    back.clear();
                    s.engine_failed(e, &mut back);
                    dead.insert(e);
                    for r in &back {
                        let (p, _) = placed.remove(&r.request.id).unwrap();
                        prop_assert!(p.pe == e || p.de == e);
                        waiting.insert(r.request.id);
                    }
                    prop_assert!(placed.values().all(|(p, decoding)| p.de != e && (p.pe != e || *decoding)));
                }
                _ => {}
            }
            prop_assert_eq!(s.waiting(), waiting.len());
            prop_assert_eq!(s.in_flight(), placed.len());
            prop_assert_eq!(waiting.len() + placed.len() + finished.len(), next as usize);
            for e in 0..topo.engines() {
                let want: u64 = placed.values().filter(|(p, decoding)| (p.pe == e && !decoding) || p.de == e).map(|(p, _)| p.request.tokens()).sum();
                prop_assert_eq!(s.tokens_of(e), want, "engine {}", e);
            }
        }
    }
}

// A test helper: a panic here is a test failure.
#[allow(clippy::unwrap_used)]
fn toy_cluster(snic_gbps: f64) -> ClusterConfig {
    ClusterConfig {
        topology: Topology {
            prefill_nodes: 2,
            decode_nodes: 2,
            engines_per_node: 2,
            nodes_per_group: 1,
        },
        model: ModelProfile::ds_27b(),
        snic_gbps,
        de_hbm_bytes: 64e9,
        ..ClusterConfig::paper_003(2, 2).unwrap()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The whole simulation: random arrival times and sizes, storage bandwidth and failures
    /// (at most one engine of each role, so the cluster can always finish): every request
    /// finishes exactly once under every policy.
    #[test]
    fn the_simulator_finishes_every_request_once(
        reqs in prop::collection::vec((0u64..60_000_000_000, 0u64..40_000, 1u64..4000, 1u64..300), 1..120),
        snic_gbps in 1.0f64..800.0,
        fail_pe in prop::option::of((0.0f64..60.0, 0u32..4)),
        fail_de in prop::option::of((0.0f64..60.0, 4u32..8)),
        policy in policy(),
    ) {
        let mut arrivals: Vec<(u64, Request)> = reqs.iter().enumerate().map(|(i, &(at, hit, miss, generate))| {
            (at, Request { id: i as u64, hit_tokens: hit, miss_tokens: miss, gen_tokens: generate })
        }).collect();
        arrivals.sort_by_key(|a| a.0);
        let failures: Vec<Failure> = fail_pe.into_iter().chain(fail_de).map(|(at_s, engine)| Failure { at_s, engine }).collect();
        let run = dualpath_sim::simulate(&toy_cluster(snic_gbps), policy, &Arrivals::Open(arrivals), &failures).unwrap();
        prop_assert_eq!(run.requests as usize, reqs.len());
        prop_assert_eq!(run.ttft_s.count as usize, reqs.len());
    }

    /// PrfaaS: random traces (with shared prefixes), egress bandwidths and adaptive routing:
    /// every request gets exactly one prefill and one decode start.
    #[test]
    fn prfaas_serves_every_request_once(
        reqs in prop::collection::vec((0u64..5000, 1u64..64, 1u64..2000, 0u64..4), 1..200),
        egress_gbps in 0.01f64..400.0,
        adapt in any::<bool>(),
    ) {
        let mut t = 0;
        let records: Vec<TraceRecord> = reqs.iter().map(|&(dt, blocks, output, family)| {
            t += dt;
            TraceRecord {
                timestamp_ms: t,
                input_length: blocks * 512,
                output_length: output,
                hash_ids: (0..blocks).map(|b| family * 1000 + b).collect(),
            }
        }).collect();
        let mut d = Deployment::paper_001(CaseStudy::PrfaasPd, 2.19).unwrap();
        d.egress_gbps = egress_gbps;
        if adapt {
            d.router = RouterConfig { adapt: Some(Adaptation { step: 0.1, min_tokens: 512.0, max_tokens: 131_072.0, high_utilization: 0.9, wait_margin_s: 1.0 }), ..d.router };
        }
        let run = prfaas_sim::simulate(&d, &Workload::Trace { records, block_tokens: 512, cache_blocks: 64, time_scale: 1.0 }).unwrap();
        prop_assert_eq!(run.ttft_s.count as usize, reqs.len());
        prop_assert!(run.computed_fraction <= 1.0 + 1e-12);
    }
}
