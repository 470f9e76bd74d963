//! Property tests: monotonicity of every cost, the predicate's argmin, fit recovery under
//! noise, and that no input makes the model panic. The seed is fixed, so every run explores
//! the same cases and a failure reproduces; no regression files are written.

// Test helpers panic on failure: that is how a test reports it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute_costmodel::fit::{RoundTripSample, Weighting, fit_round_trips};
use kvroute_costmodel::{
    Allowed, Congestion, CostModel, CostParams, Fabric, GatherCost, HolderCompute, MergeCost,
    ModelDims, Primitive, Request, Selection, Sources, SparsePremium, SpliceCost, model_preset,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};

fn config() -> Config {
    Config {
        rng_seed: RngSeed::Fixed(0x006b_7672_6f75_7465),
        failure_persistence: None,
        ..Config::default()
    }
}

fn model_with(probe_us: f64, bw_gbps: f64) -> CostModel {
    let dims = model_preset("deepseek-v2-lite").unwrap().dims;
    CostModel::new(CostParams::paper_defaults(
        dims,
        Fabric::measured(probe_us, bw_gbps).unwrap(),
    ))
    .unwrap()
}

fn totals(costs: &CostModel, request: &Request) -> [f64; 3] {
    let d = costs.decide(request).unwrap();
    [d.route.total_us, d.fetch.total_us, d.local.total_us]
}

fn request(mq: u32, ct: u32, sparse: Option<(u32, u32)>) -> Request {
    match sparse {
        Some((topk, holders)) => Request::sparse(mq, ct, topk.min(ct), holders.min(topk.min(ct))),
        None => Request::contiguous(mq, ct),
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn every_cost_is_monotone_in_mq(mq in 1u32..100_000, extra in 1u32..10_000, ct in 1u32..100_000,
                                    sparse in proptest::option::of((1u32..4096, 1u32..16))) {
        let costs = model_with(16.0, 25.0);
        let small = totals(&costs, &request(mq, ct, sparse));
        let large = totals(&costs, &request(mq + extra, ct, sparse));
        for i in 0..3 {
            prop_assert!(large[i] >= small[i], "{i}: {} < {}", large[i], small[i]);
        }
        prop_assert!(large[0] > small[0], "route must grow with Mq");
    }

    #[test]
    fn every_cost_is_monotone_in_ct(mq in 1u32..100_000, ct in 1u32..100_000, extra in 1u32..10_000) {
        let costs = model_with(16.0, 25.0);
        let small = totals(&costs, &Request::contiguous(mq, ct));
        let large = totals(&costs, &Request::contiguous(mq, ct + extra));
        for i in 0..3 {
            prop_assert!(large[i] >= small[i], "{i}");
        }
        prop_assert!(large[1] > small[1] && large[2] > small[2], "fetch and local grow with ct");
    }

    #[test]
    fn every_cost_is_monotone_in_inverse_bandwidth(bw in 0.01f64..1000.0, factor in 1.001f64..100.0,
                                                   mq in 1u32..10_000, ct in 1u32..10_000,
                                                   sparse in proptest::option::of((1u32..4096, 1u32..16))) {
        let fast = totals(&model_with(16.0, bw), &request(mq, ct, sparse));
        let slow = totals(&model_with(16.0, bw / factor), &request(mq, ct, sparse));
        for i in 0..3 {
            prop_assert!(slow[i] >= fast[i], "{i}");
        }
        prop_assert!(slow[0] > fast[0] && slow[1] > fast[1], "network primitives slow down");
    }

    #[test]
    fn predicate_never_picks_a_costlier_allowed_primitive(
        mq in 1u32..1_000_000, ct in 1u32..1_000_000, probe in 0.1f64..1000.0, bw in 0.01f64..2000.0,
        sparse in proptest::option::of((1u32..8192, 1u32..64)), mask in 1u8..8,
    ) {
        let allowed = Allowed { route: mask & 1 != 0, fetch: mask & 2 != 0, local: mask & 4 != 0 };
        let req = Request { allowed, ..request(mq, ct, sparse) };
        let d = model_with(probe, bw).decide(&req).unwrap();
        prop_assert!(allowed.contains(d.choice));
        for p in Primitive::ALL {
            if allowed.contains(p) {
                prop_assert!(d.chosen().total_us <= d.cost(p).total_us, "{d}");
            }
        }
        prop_assert!(d.reason.speedup >= 1.0 && d.reason.margin_us >= 0.0);
    }

    /// Synthetic sweeps Mq = 1, 2, 4 ... 4096 (three repeats each) from known constants, with
    /// up to +-3% multiplicative noise: the relative-error fit recovers BW within 5% and the
    /// probe within 15%. Only sweeps that leave the probe-bound regime can show a bandwidth
    /// (paper 000 reads BW "from the large-Mq slope"), so the largest batch's transfer must be
    /// at least four probes long; below that no fit can recover BW and none is claimed.
    #[test]
    fn fit_recovers_known_constants_from_noisy_sweeps(
        probe in 1.0f64..50.0, bw in 1.0f64..400.0,
        noise in proptest::collection::vec(-0.03f64..0.03, 39),
    ) {
        let truth = Fabric::measured(probe, bw).unwrap();
        prop_assume!(truth.transfer_us(4096.0 * 2184.0) >= 4.0 * probe);
        let samples: Vec<_> = noise.iter().enumerate().map(|(i, n)| {
            let mq = 1u32 << (i / 3);
            RoundTripSample { mq_rows: mq, round_trip_us: truth.round_trip_us(f64::from(mq), 2184.0) * (1.0 + n) }
        }).collect();
        let fit = fit_round_trips(&samples, 2184, Weighting::Relative).unwrap();
        prop_assert!((fit.bw_gbps - bw).abs() / bw < 0.05, "{fit:?}");
        prop_assert!((fit.probe_us - probe).abs() / probe < 0.15, "{fit:?}");
        prop_assert!(fit.mape.all_pct < 3.0, "{fit:?}");
    }

    /// Any parameters at all: `CostModel::new` accepts them or returns an error, never panics.
    #[test]
    fn arbitrary_parameters_are_accepted_or_refused_without_panicking(
        vals in proptest::collection::vec(prop_oneof![
            Just(f64::NAN), Just(f64::INFINITY), Just(-1.0), Just(0.0), 1e-9f64..1e9
        ], 17),
        counts in proptest::collection::vec(prop_oneof![Just(0u32), Just(u32::MAX), 0u32..100_000], 3),
    ) {
        let params = CostParams {
            model: ModelDims { layers: counts[0], query_heads: counts[1], ..model_preset("deepseek-v3.2").unwrap().dims },
            fabric: Fabric { probe_us: vals[0], bw_gbps: vals[1], turnaround_us: vals[2], link_gbps: Some(vals[3]) },
            splice: SpliceCost { fixed_us: vals[4], per_token_us: vals[5] },
            gather: GatherCost { fixed_us_per_layer: vals[6], per_holder_us_per_layer: vals[7] },
            holder: HolderCompute {
                fixed_us: vals[16],
                floor_us: vals[8], us_per_token: vals[9], us_per_row_token: vals[12],
                sparse: SparsePremium { at_zero: vals[13], per_entry: vals[14] },
                table: None,
            },
            merge: MergeCost { fixed_us: vals[10], us_per_row_part: vals[11] },
            local_us_per_token_layer: vals[15],
            congestion: Congestion { concurrent_flows: counts[2], ..Congestion::NONE },
            pull: None,
            sources: Sources::PAPER,
        };
        let all_valid = vals.iter().all(|v| v.is_finite() && *v > 0.0) && counts.iter().all(|c| *c > 0);
        let accepted = CostModel::new(params).is_ok();
        prop_assert!(!all_valid || accepted, "valid parameters refused");
    }

    /// Valid parameters and any request, extreme counts included (u32::MAX layers, tokens,
    /// rows, ranks, holders): an answer or a typed error, never a panic or an overflow, and an
    /// answer's costs are finite.
    #[test]
    fn extreme_counts_never_panic_or_overflow(
        counts in proptest::collection::vec(prop_oneof![Just(0u32), Just(1u32), Just(u32::MAX), 0u32..100_000], 8),
        mask in 0u8..8,
    ) {
        let dims = ModelDims { layers: counts[0].max(1), ..model_preset("deepseek-v3.2").unwrap().dims };
        let costs = CostModel::new(CostParams::paper_defaults(dims, Fabric::measured(16.0, 25.0).unwrap())).unwrap();
        let req = Request {
            mq_rows: counts[1], chunk_tokens: counts[2],
            selection: if counts[3] % 2 == 0 { Selection::Contiguous } else {
                Selection::Sparse { topk: counts[3], holders: counts[4] }
            },
            tp_degree: counts[5], holder_requesters: counts[6],
            allowed: Allowed { route: mask & 1 != 0, fetch: mask & 2 != 0, local: mask & 4 != 0 },
        };
        if let Ok(d) = costs.decide(&req) {
            for p in Primitive::ALL {
                prop_assert!(d.cost(p).total_us.is_finite(), "{p}: {d:?}");
            }
        }
    }
}
