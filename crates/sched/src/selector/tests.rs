//! Unit tests of `selector`.

use kvroute_costmodel::{SparsePremium, model_preset};

use super::*;

const ROW: f64 = 2184.0;

fn estimator() -> FabricEstimator {
    FabricEstimator::new(256, 1_000_000, FabricBounds::default()).unwrap()
}

/// A deterministic jitter in [0, 1).
fn jitter(i: usize) -> f64 {
    ((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 11) as f64 / (1u64 << 53) as f64
}

/// Samples of a 40 us + 3 GB/s path with one-sided noise, and `stalls` of every 10
/// slowed 20x (a preempted process).
fn sweep(e: &mut FabricEstimator, stalls: usize) {
    let mut i = 0;
    for rep in 0..8 {
        for mq in [1u32, 16, 64, 256, 1024, 2048] {
            let bytes = f64::from(mq) * ROW;
            let mut us = (40.0 + bytes / 3e3) * (1.0 + 0.1 * jitter(i));
            if (i % 10) < stalls {
                us *= 20.0;
            }
            e.observe(bytes, us, rep);
            i += 1;
        }
    }
}

#[test]
fn the_fabric_fit_holds_its_bandwidth_through_stalls_that_move_least_squares() {
    let mut clean = estimator();
    sweep(&mut clean, 0);
    let clean = clean.refit(10).unwrap();
    assert!((clean.bw_gbps / 3.0 - 1.0).abs() < 0.1, "{clean:?}");
    let mut stalled = estimator();
    sweep(&mut stalled, 2);
    let fit = stalled.refit(10).unwrap();
    assert!(
        (fit.bw_gbps / clean.bw_gbps - 1.0).abs() < 0.25,
        "{fit:?} against {clean:?}"
    );
    // The same samples through least squares: 20% stalls move it far more.
    let points: Vec<(f64, f64)> = stalled.window.iter().map(|s| (s.bytes, s.us)).collect();
    let ls = kvroute_costmodel::fit::least_squares(points.iter().copied()).unwrap();
    let ls_gbps = 1.0 / (ls.slope * 1e3);
    assert!((ls_gbps / clean.bw_gbps - 1.0).abs() > 0.25, "{ls_gbps}");
}

#[test]
fn an_unphysical_refit_is_refused_and_the_last_fit_stays() {
    let mut e = FabricEstimator::new(
        64,
        1_000_000,
        FabricBounds {
            max_gbps: 10.0,
            ..FabricBounds::default()
        },
    )
    .unwrap();
    sweep(&mut e, 0);
    let good = e.refit(1).unwrap();
    // Larger transfers coming back faster: a falling line.
    for mq in [1u32, 4096, 1, 4096, 1, 4096] {
        for _ in 0..20 {
            let bytes = f64::from(mq) * ROW;
            e.observe(bytes, if mq == 1 { 5000.0 } else { 100.0 }, 2);
        }
    }
    assert!(e.refit(3).is_err());
    assert_eq!(e.fit(), Some(good));
    assert!(e.rejected().is_some());
    // Bad samples are dropped, not stored.
    let before = e.len();
    e.observe(f64::NAN, 1.0, 4);
    e.observe(1.0, -1.0, 4);
    assert_eq!(e.len(), before);
    assert!(FabricEstimator::new(1, 1, FabricBounds::default()).is_err());
    assert!(FabricEstimator::new(8, 0, FabricBounds::default()).is_err());
}

#[test]
fn routes_refit_the_fabric_as_they_run() {
    let mut e = FabricEstimator::new(32, 8, FabricBounds::default()).unwrap();
    sweep(&mut e, 0);
    let first = e.fit().unwrap();
    // The path slows to 1 GB/s: the window turns over and the fit follows.
    for i in 0..64u64 {
        let mq = [16u32, 256, 1024, 2048][(i % 4) as usize];
        let bytes = f64::from(mq) * ROW;
        e.observe(bytes, 40.0 + bytes / 1e3, 100 + i);
    }
    let now = e.fit().unwrap();
    assert!(now.fits > first.fits);
    assert!((now.bw_gbps - 1.0).abs() < 0.05, "{now:?}");
    assert!(now.fitted_at_ms > first.fitted_at_ms);
}

/// A start-up sweep of a 40 us + 3 GB/s path, then live routes that each pay 60 us more
/// (threads woken on the way). Seven live routes leave the sweep's fixed cost; from the
/// eighth the live ones set it, a stalled quarter of them does not move it, and the
/// bandwidth stays the sweep's.
#[test]
fn live_routes_set_the_fixed_cost_once_eight_are_in() {
    let mut e = estimator();
    e.extend((0..8).flat_map(|_| {
        [1u32, 16, 64, 256, 1024, 2048].map(|mq| {
            let bytes = f64::from(mq) * ROW;
            (bytes, 40.0 + bytes / 3e3)
        })
    }));
    let start = e.refit(0).unwrap();
    assert!((start.fixed_us - 40.0).abs() < 1e-6, "{start:?}");
    assert_eq!(start.live_fixed, 0);
    let live = |i: usize| {
        let bytes = f64::from([16u32, 64, 256, 1024][i % 4]) * ROW;
        (bytes, 100.0 + bytes / 3e3)
    };
    for i in 0..7 {
        let (bytes, us) = live(i);
        e.observe(bytes, us, 1);
    }
    let seven = e.refit(1).unwrap();
    assert_eq!(seven.live_fixed, 0);
    assert!((seven.fixed_us - 40.0).abs() < 1e-6, "{seven:?}");
    let (bytes, us) = live(7);
    e.observe(bytes, us, 2);
    // The eighth refits on its own (this estimator's refit_every is a million).
    let eight = e.fit().unwrap();
    assert_eq!((eight.live_fixed, eight.fitted_at_ms), (8, 2));
    assert!((eight.fixed_us - 100.0).abs() < 1e-6, "{eight:?}");
    // Four more, three of them stalled 20x: a quarter of the twelve.
    for i in 8..11 {
        let (bytes, us) = live(i);
        e.observe(bytes, if i == 10 { us } else { 20.0 * us }, 3);
    }
    e.observe(live(0).0, 20.0 * live(0).1, 3);
    let now = e.refit(3).unwrap();
    assert_eq!(now.live_fixed, 12);
    assert!((now.fixed_us - 100.0).abs() < 1e-6, "{now:?}");
    assert!((now.bw_gbps - 3.0).abs() < 1e-6, "{now:?}");
}

fn cpu_kernel() -> HolderCompute {
    HolderCompute {
        fixed_us: 0.0,
        floor_us: 5.0,
        us_per_token: 0.2,
        us_per_row_token: 0.08,
        sparse: SparsePremium::NONE,
        table: None,
    }
}

fn selector(holders: usize) -> Selector {
    let v2 = model_preset("deepseek-v2-lite").unwrap().dims;
    let base = CostParams::paper_defaults(v2, Fabric::measured(40.0, 3.0).unwrap());
    let mut s = Selector::new(
        base,
        vec![HolderState::new(8); holders],
        (estimator(), estimator()),
    )
    .unwrap();
    for h in 0..holders {
        s.holder_report(h, (0, 8, Some(cpu_kernel())), 0).unwrap();
    }
    s
}

#[test]
fn a_measured_kernel_prices_route_by_rows_and_entries_and_moves_the_choice() {
    let s = selector(1);
    let req = |mq, ct| Request {
        allowed: Allowed {
            local: false,
            ..Allowed::ALL
        },
        ..Request::contiguous(mq, ct)
    };
    let small = s.decide(&[0], req(16, 2048)).unwrap();
    assert_eq!(small.primitive, Primitive::Route);
    assert!(
        (small.decision.route.breakdown.compute_us - 16.0 * 2048.0 * 0.08).abs() < 1e-6,
        "{:?}",
        small.decision.route.breakdown
    );
    // A CPU kernel at 4096 rows costs more than pulling 64 MB at 3 GB/s and splicing.
    let big = s.decide(&[0], req(4096, 2048)).unwrap();
    assert_eq!(big.primitive, Primitive::Fetch, "{}", big.decision);
    let p = s.params_for(Some(0)).unwrap();
    assert_eq!(p.sources.holder, Source::Measured);
    assert_eq!(s.params_for(None).unwrap().sources.holder, Source::Paper);
}

#[test]
fn a_pull_faster_than_the_routed_fixed_cost_keeps_a_fixed_cost_and_its_time() {
    let mut s = selector(1);
    // Routes fitted on a loaded machine: 900 us fixed, 3 GB/s.
    for mq in [1u32, 64, 1024, 1, 64, 1024] {
        s.observe_route(mq, 900.0 + f64::from(mq) * ROW / 3e3, 100);
    }
    // One pull size, faster than the routes' fixed cost alone.
    s.observe_pull(1e6, 600.0, 100);
    s.refit(100).unwrap();
    let routed = s.params_for(None).unwrap().fabric;
    assert!((routed.probe_us - 900.0).abs() < 1e-6, "{routed:?}");
    let pull = s.params_for(None).unwrap().pull.unwrap();
    // Split as the routed line splits 1 MB: 900 fixed + 333.3 transfer.
    let share = 900.0 / (900.0 + 1e6 / 3e3);
    assert!((pull.probe_us - 600.0 * share).abs() < 1e-6, "{pull:?}");
    // The pull it was measured from is predicted as measured.
    assert!(
        (pull.probe_us + pull.transfer_us(1e6) - 600.0).abs() < 1e-6,
        "{pull:?}"
    );
    let fetch = CostModel::new(s.params_for(Some(0)).unwrap())
        .unwrap()
        .decide(&Request::contiguous(16, 2048))
        .unwrap();
    assert!(fetch.fetch.breakdown.probe_us > 0.0, "{}", fetch);
}

#[test]
fn a_holder_added_later_is_decided_for_by_its_index() {
    let mut s = selector(1);
    let req = Request::contiguous(16, 2048);
    assert_eq!(s.add_holder(HolderState::new(8)), 1);
    s.set_alive(0, false).unwrap();
    let c = s.decide(&[0, 1], req).unwrap();
    assert_eq!((c.primitive, c.holder), (Primitive::Route, Some(1)));
    assert!(s.holder_report(1, (0, 8, None), 1).is_ok());
    assert!(s.holder_report(2, (0, 8, None), 1).is_err());
}

#[test]
fn a_dead_or_capped_holder_is_passed_over_for_a_replica() {
    let mut s = selector(3);
    let req = Request::contiguous(16, 2048);
    s.set_alive(0, false).unwrap();
    let c = s.decide(&[0, 1], req).unwrap();
    assert_eq!((c.primitive, c.holder), (Primitive::Route, Some(1)));
    assert_eq!(c.skipped, vec![(0, "dead".to_owned())]);
    // Holder 1 at its cap: route goes to holder 2.
    s.holder_report(1, (8, 8, None), 5).unwrap();
    let c = s.decide(&[1, 2], req).unwrap();
    assert_eq!((c.primitive, c.holder), (Primitive::Route, Some(2)));
    // A loaded holder prices its batch: 7 others make the kernel 8x the rows.
    s.holder_report(2, (7, 8, None), 5).unwrap();
    let loaded = s.decide(&[2], req).unwrap();
    assert_eq!(
        loaded.decision.route.breakdown.compute_us,
        8.0 * 16.0 * 2048.0 * 0.08
    );
    // No live replica: local, or an error where local is not allowed.
    s.set_alive(1, false).unwrap();
    s.set_alive(2, false).unwrap();
    let c = s.decide(&[0, 1, 2], req).unwrap();
    assert_eq!((c.primitive, c.holder), (Primitive::Local, None));
    let no_local = Request {
        allowed: Allowed {
            local: false,
            ..Allowed::ALL
        },
        ..req
    };
    assert!(matches!(
        s.decide(&[0, 1, 2], no_local),
        Err(SchedError::NoHolder { replicas: 3 })
    ));
    assert!(s.set_alive(9, true).is_err());
}

#[test]
fn the_calibration_says_what_was_measured_and_how_old_it_is() {
    let mut s = selector(2);
    assert!(s.calibration(0).fabric.is_none());
    for mq in [1u32, 64, 1024, 1, 64, 1024] {
        s.observe_route(mq, 40.0 + f64::from(mq) * ROW / 3e3, 100);
    }
    s.observe_pull(64e6, 40.0 + 64e6 / 2e3, 100);
    s.refit(100).unwrap();
    s.set_merge(
        MergeCost {
            fixed_us: 2.0,
            us_per_row_part: 0.01,
        },
        120,
    )
    .unwrap();
    let cal = s.calibration(1100);
    assert_eq!(cal.ages_ms.fabric, Some(1000));
    assert_eq!(cal.ages_ms.merge, Some(980));
    assert_eq!(cal.ages_ms.splice, None);
    assert_eq!(cal.ages_ms.holder_kernels, vec![Some(1100), Some(1100)]);
    let p = s.params_for(Some(0)).unwrap();
    assert_eq!(p.sources.fabric, Source::Measured);
    assert_eq!(p.sources.merge, Source::Measured);
    assert_eq!(p.sources.splice, Source::Paper);
    // One pull size: its rate with the fabric's fixed cost taken out.
    let pull = p.pull.unwrap();
    assert!((pull.bw_gbps - 2.0).abs() < 1e-6, "{pull:?}");
    let json = serde_json::to_value(&cal).unwrap();
    assert!(json["fabric"]["bw_gbps"].as_f64().unwrap() > 2.9);
    // A bad kernel report is not believed.
    let bad = HolderCompute {
        us_per_row_token: f64::NAN,
        ..cpu_kernel()
    };
    s.holder_report(0, (0, 8, Some(bad)), 2000).unwrap();
    assert_eq!(s.holders()[0].kernel, Some(cpu_kernel()));
}
