//! Every layout of 2, 4 and 8 ranks (threads over the `mem` domain), dense and MoE, MLA and
//! GQA, matches the single-rank layer step after step, through staged appends that start with
//! empty shards; a rank that vanishes mid-run fails its peers' step with the ranks named.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use kvroute_helix::{
    Attention, Check, Ffn, HelixConfig, HelixError, HelixRank, Layout, LocalRendezvous, Reference,
    Shape, run_threads,
};
use kvroute_transport::{MemFabric, TransferEngine};

/// Shapes small enough for eight ranks and a reference in a test, with every divisibility the
/// layouts below need: 8 query heads, GQA with 8 KV heads.
fn shape(attention: Attention, moe: bool) -> Shape {
    Shape {
        attention,
        q_heads: 8,
        hidden: 256,
        ffn: if moe {
            Ffn::Moe {
                experts: 8,
                top_k: 2,
                dim: 64,
            }
        } else {
            Ffn::Dense { dim: 512 }
        },
    }
}

const GQA: Attention = Attention::Gqa {
    kv_heads: 8,
    head_dim: 32,
};

fn config(layout: Layout, shape: Shape) -> HelixConfig {
    HelixConfig {
        layout,
        shape,
        batch: 3,
        // Stages of 4 over up to 8 shards: the last shards start empty and fill during the run.
        ctx: 10,
        stage: 4,
        seed: 7,
        timeout: Duration::from_secs(20),
    }
}

fn engines(n: usize) -> Vec<TransferEngine> {
    let fabric = MemFabric::new();
    (0..n)
        .map(|_| TransferEngine::mem(&fabric, 1).unwrap())
        .collect()
}

/// Runs `steps` steps (HOP-B alternating) and checks every rank's output of every step.
fn check_layout(cfg: HelixConfig, steps: usize) {
    let hopb: Vec<bool> = (0..steps).map(|s| s % 2 == 1).collect();
    let results = run_threads(cfg, engines(cfg.layout.ranks()), &hopb);
    let mut reference = Reference::new(cfg).unwrap();
    let expected: Vec<Vec<f32>> = (0..steps).map(|_| reference.step().unwrap()).collect();
    for (rank, result) in results.into_iter().enumerate() {
        let reports = result.unwrap_or_else(|e| panic!("{cfg:?}: rank {rank}: {e}"));
        for (report, want) in reports.iter().zip(&expected) {
            let check = Check::of(&report.output, want);
            assert!(
                check.passed,
                "{:?} {:?}: rank {rank} step {}: {check:?}",
                cfg.layout, cfg.shape, report.step
            );
        }
    }
}

fn layouts(n: usize) -> Vec<Layout> {
    let mut out = Vec::new();
    for kvp in [1, 2, 4, 8].into_iter().filter(|k| n.is_multiple_of(*k)) {
        let tpa = n / kvp;
        for ep in [1, 2, 4, 8].into_iter().filter(|e| n.is_multiple_of(*e)) {
            out.push(Layout::new(kvp, tpa, n / ep, ep).unwrap());
        }
    }
    out
}

fn check_all(n: usize) {
    for layout in layouts(n) {
        for attention in [Attention::Mla, GQA] {
            for moe in [false, true] {
                let shape = shape(attention, moe);
                if shape.check(&layout).is_err() {
                    // MLA has one KV head (TPA = 1); a dense FFN runs with EP = 1.
                    assert!(layout.tpa > 1 && attention == Attention::Mla || layout.ep > 1 && !moe);
                    continue;
                }
                check_layout(config(layout, shape), 6);
            }
        }
    }
}

#[test]
fn two_ranks_match_the_single_rank_layer() {
    check_all(2);
}

#[test]
fn four_ranks_match_the_single_rank_layer() {
    check_all(4);
}

#[test]
fn eight_ranks_match_the_single_rank_layer() {
    check_all(8);
}

#[test]
fn the_check_fails_when_a_shard_is_lost() {
    let cfg = config(
        Layout::new(2, 1, 2, 1).unwrap(),
        shape(Attention::Mla, false),
    );
    let mut reference = Reference::new(cfg).unwrap();
    let want = reference.step().unwrap();
    // The layer over half the context: what a merge that dropped a shard would produce.
    let mut half = Reference::new(HelixConfig { ctx: 4, ..cfg }).unwrap();
    let got = half.step().unwrap();
    let check = Check::of(&got, &want);
    assert!(
        !check.passed && check.max_abs > 10.0 * check.tolerance,
        "{check:?}"
    );
    let mut nan = want.clone();
    nan[3] = f32::NAN;
    assert!(!Check::of(&nan, &want).passed);
}

#[test]
fn shards_grow_in_stages_and_stay_balanced() {
    let cfg = HelixConfig {
        ctx: 0,
        ..config(
            Layout::new(4, 1, 4, 1).unwrap(),
            shape(Attention::Mla, false),
        )
    };
    let results = run_threads(cfg, engines(4), &[false; 12]);
    let tokens: Vec<Vec<usize>> = results
        .into_iter()
        .map(|r| r.unwrap().iter().map(|s| s.shard_tokens[0]).collect())
        .collect();
    // Step s appends token s: shard 0 holds tokens 0-3, shard 1 4-7, shard 2 8-11.
    assert_eq!(tokens[0], [1, 2, 3, 4, 4, 4, 4, 4, 4, 4, 4, 4]);
    assert_eq!(tokens[1], [0, 0, 0, 0, 1, 2, 3, 4, 4, 4, 4, 4]);
    assert_eq!(tokens[2][11], 4);
    assert_eq!(tokens[3], [0; 12], "shard 3 is still empty after 12 tokens");
}

#[test]
fn a_rank_that_vanishes_fails_its_peers_step_with_the_rank_named() {
    let timeout = Duration::from_millis(800);
    let cfg = HelixConfig {
        timeout,
        ..config(
            Layout::new(4, 1, 4, 1).unwrap(),
            shape(Attention::Mla, false),
        )
    };
    let rendezvous = LocalRendezvous::new();
    let started = Instant::now();
    // Each thread hands back its rank and engine, so that a rank which fails stays reachable
    // until every thread is done: rank 2 is the only one that vanishes, and no peer can fail
    // on a rank that merely gave up first.
    let outcomes: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = engines(4)
            .into_iter()
            .enumerate()
            .map(|(rank, engine)| {
                let rendezvous = rendezvous.clone();
                scope.spawn(move || {
                    let mut kept = None;
                    let result = (|| {
                        let r =
                            kept.insert(HelixRank::start(cfg, rank, engine.clone(), &rendezvous)?);
                        for _ in 0..2 {
                            r.step(false)?;
                        }
                        if rank == 2 {
                            // Dies between steps: its engine and regions are gone.
                            engine.shutdown();
                            return Ok(r.steps());
                        }
                        r.step(true)?;
                        Ok(r.steps())
                    })();
                    (result, kept, engine)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let results: Vec<Result<u64, HelixError>> = outcomes.into_iter().map(|o| o.0).collect();
    // Start-up, two steps, then one timeout: seconds even on a loaded machine; a hang is not.
    assert!(
        started.elapsed() < timeout * 4 + Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    for (rank, result) in results.iter().enumerate() {
        match (rank, result) {
            (2, Ok(2)) => {}
            (
                _,
                Err(HelixError::Timeout {
                    missing,
                    unacknowledged,
                    ..
                }),
            ) => assert!(
                missing.contains(&2) || unacknowledged.contains(&2),
                "rank {rank}: {result:?}"
            ),
            (_, Err(HelixError::WriteFailed { peer: 2, .. })) => {}
            _ => panic!("rank {rank}: {result:?}"),
        }
    }
}
