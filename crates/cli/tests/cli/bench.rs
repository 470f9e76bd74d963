//! The benches and `verify-predicate`: every measurement beside its same-run baseline, one
//! verdict per target.

use super::{busy_turn, json, kvroute, scratch};

#[test]
fn bench_transport_quick_reports_every_measurement_with_its_baseline() {
    let v = json(&kvroute(&["bench", "transport", "--quick", "--json"]));
    assert!(v["submit"]["engine"]["p50_ns"].as_f64().unwrap() > 0.0);
    assert!(v["submit"]["baseline_handoff"]["p50_ns"].as_f64().unwrap() > 0.0);
    let paged = v["paged"].as_array().unwrap();
    assert_eq!(paged.len(), 5);
    assert!(
        paged
            .iter()
            .all(|p| p["engine_pages_per_s"].as_f64().unwrap() > 0.0
                && p["memcpy_pages_per_s"].as_f64().unwrap() > 0.0)
    );
    let scatter = v["scatter"].as_array().unwrap();
    assert_eq!(
        scatter
            .iter()
            .map(|s| s["peers"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [8, 16, 32, 64]
    );
    let targets = v["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 5, "{targets:?}");
    // The two engine / memcpy lines are the 1 KiB rows' ratios, judged against 0.8.
    let of_memcpy: Vec<&serde_json::Value> = targets
        .iter()
        .filter(|t| t["what"].as_str().unwrap().contains("engine / memcpy"))
        .collect();
    assert_eq!(of_memcpy.len(), 2, "{targets:?}");
    for (t, p) in of_memcpy.iter().zip(paged) {
        assert_eq!(p["page_len"], 1024);
        let ratio =
            p["engine_pages_per_s"].as_f64().unwrap() / p["memcpy_pages_per_s"].as_f64().unwrap();
        assert!(
            (t["measured"].as_f64().unwrap() - ratio).abs() < 1e-9,
            "{t} {p}"
        );
        assert_eq!(t["met"], ratio >= 0.8, "{t}");
    }
}

/// Two processes over shm (the fastest provider here), `fi_pingpong` beside every row: the
/// report carries the provider actually opened, each measurement with both baselines, and one
/// verdict per target. Needs libfabric (`cargo xtask deps`).
#[test]
fn bench_fabric_quick_reports_the_engine_beside_fi_pingpong_and_the_bare_provider() {
    let _turn = busy_turn();
    let v = json(&kvroute(&[
        "bench",
        "fabric",
        "--provider",
        "shm",
        "--quick",
        "--json",
    ]));
    assert_eq!(v["fabric"]["provider"], "shm");
    assert_eq!(v["progress"], "manual");
    assert_eq!(
        (&v["rounds"], &v["round_trip_rounds"]),
        (&1.into(), &1.into())
    );
    let positive = |x: &serde_json::Value| x.as_f64().is_some_and(|f| f.is_finite() && f > 0.0);
    let rt = &v["round_trip"];
    for side in ["engine", "fi_pingpong", "raw"] {
        assert!(
            positive(&rt[side]["usec_per_xfer"]),
            "round trip {side}: {rt}"
        );
    }
    // Both ends on one thread: 20,000 round trips of a quick run, through engines and bare.
    let one = &v["one_thread"];
    assert!(
        positive(&one["engine_ns"]) && positive(&one["bare_ns"]),
        "{one}"
    );
    assert_eq!(one["trips"], 40_000);
    let single = v["single"].as_array().unwrap();
    assert_eq!(
        single
            .iter()
            .map(|s| s["size"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        [64 << 10, 256 << 10, 1 << 20, 4 << 20, 32 << 20]
    );
    for row in single {
        for side in ["engine", "fi_pingpong", "raw"] {
            assert!(positive(&row[side]["mb_per_s"]), "{side}: {row}");
        }
        // The ratio is the engine's MB/s over fi_pingpong's, as the report says.
        let ratio = row["engine"]["mb_per_s"].as_f64().unwrap()
            / row["fi_pingpong"]["mb_per_s"].as_f64().unwrap();
        assert!((row["ratio"].as_f64().unwrap() - ratio).abs() < 1e-9 * ratio);
    }
    let paged = v["paged"].as_array().unwrap();
    assert_eq!(paged.len(), 4);
    assert!(paged.iter().all(|p| positive(&p["engine"]["per_s"])
        && positive(&p["raw"]["mb_per_s"])
        && p["raw"]["count"] == p["engine"]["count"]));
    let targets = v["targets"].as_array().unwrap();
    // The round trip, each single write, and the 1 KiB paged transfer; each with the bare
    // NIC's own ratio as its bound.
    assert_eq!(targets.len(), 1 + single.len() + 1);
    assert!(
        targets.iter().all(|t| t["met"].is_boolean()
            && positive(&t["measured"])
            && t["bound"]
                .as_str()
                .is_some_and(|b| b.starts_with("bare NIC / fi_pingpong"))),
        "{targets:?}"
    );
    let paged_target = targets.last().unwrap();
    let kib = &paged[0];
    let ratio = kib["engine"]["mb_per_s"].as_f64().unwrap()
        / kib["fi_pingpong"]["mb_per_s"].as_f64().unwrap();
    assert!((paged_target["measured"].as_f64().unwrap() - ratio).abs() < 1e-9 * ratio);
    assert_eq!(paged_target["target"], ">= 0.8", "shm's paged target");
    assert_eq!(paged_target["met"], ratio >= 0.8);
}

/// `bench kernels --quick --json`: every workload measured beside its same-run baseline, and
/// one verdict per target.
#[test]
fn bench_kernels_quick_reports_each_kernel_beside_its_baseline() {
    let _turn = busy_turn();
    let v = json(&kvroute(&["bench", "kernels", "--quick", "--json"]));
    let positive = |x: &serde_json::Value| x.as_f64().is_some_and(|f| f.is_finite() && f > 0.0);
    assert!(v["backend"].as_str().unwrap().starts_with("cpu"));
    assert!(positive(&v["read_gbps"]) && positive(&v["chunk_read_gbps"]));
    assert!(positive(&v["fma_gflops"]));
    let dense = v["dense"].as_array().unwrap();
    let mq: Vec<u64> = dense.iter().map(|r| r["mq"].as_u64().unwrap()).collect();
    assert_eq!(mq, [1, 16, 64, 256]);
    for r in dense {
        assert!(
            positive(&r["us"])
                && positive(&r["gbps"])
                && positive(&r["gflops"])
                && positive(&r["of_fma_peak"]),
            "{r}"
        );
        // The reference runs beside the small batches (the ones the target is about).
        assert_eq!(
            positive(&r["versus_us"]),
            r["mq"].as_u64().unwrap() <= 16,
            "{r}"
        );
    }
    let ks: Vec<u64> = v["sparse"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["k"].as_u64().unwrap())
        .collect();
    assert_eq!(ks, [512, 2048]);
    let splices = v["splice"].as_array().unwrap();
    let names: Vec<&str> = splices
        .iter()
        .map(|r| r["what"].as_str().unwrap())
        .collect();
    assert!(
        names.len() == 3 && names[0].ends_with("copying") && names[1].ends_with("in place"),
        "{names:?}"
    );
    for floor in std::iter::once(&v["merge"]).chain(splices) {
        assert!(
            positive(&floor["us"]) && positive(&floor["floor_us"]),
            "{floor}"
        );
    }
    // One verdict per line of the targets table, each agreeing with its number: Mq = 1, 16
    // and 256 against their bounds, sparse against dense, the splice, the merge.
    let targets = v["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 6, "{targets:?}");
    let us = |row: &serde_json::Value| row["us"].as_f64().unwrap();
    let sparse_2048 = &v["sparse"][1];
    let sparse_ratio = us(sparse_2048) / us(&dense[1]);
    let t = |i: usize| targets[i]["measured"].as_f64().unwrap();
    assert!((t(0) - 100.0 * dense[0]["of_read_bandwidth"].as_f64().unwrap()).abs() < 1e-9);
    let of = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap();
    let mq16 = 100.0 * of(&dense[1], "of_read_bandwidth").max(of(&dense[1], "of_fma_peak"));
    assert!((t(1) - mq16).abs() < 1e-9);
    assert!((t(2) - 100.0 * of(&dense[3], "of_fma_peak")).abs() < 1e-9);
    assert!((t(3) - sparse_ratio).abs() < 1e-9 * sparse_ratio);
    assert!((t(4) - us(&splices[1])).abs() < 1e-9);
    assert!((t(5) - us(&v["merge"]) / of(&v["merge"], "floor_us")).abs() < 1e-9);
    for (i, (min, max)) in [
        (70.0, f64::INFINITY),
        (70.0, f64::INFINITY),
        (70.0, f64::INFINITY),
        (f64::NEG_INFINITY, 2.0),
        (f64::NEG_INFINITY, 999.999_999),
        (f64::NEG_INFINITY, 2.0),
    ]
    .into_iter()
    .enumerate()
    {
        assert_eq!(
            targets[i]["met"],
            (min..=max).contains(&t(i)),
            "{}",
            targets[i]
        );
    }
}

/// `kernel gpu-info` names the GPU and its kernels' resources, or fails saying why there is
/// none.
#[test]
fn kernel_gpu_info_names_the_gpu_or_says_why_there_is_none() {
    let out = kvroute(&["kernel", "gpu-info"]);
    if out.status.success() {
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("mla_partial") && text.contains("sm_"),
            "{text}"
        );
    } else {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("CUDA backend unavailable"), "{err}");
    }
}

#[test]
fn bench_kvpath_moves_blocks_both_ways_and_checks_every_one() {
    let _turn = busy_turn();
    let dir = scratch("kvpath");
    let d = dir.to_str().unwrap();
    json(&kvroute(&[
        "store", "write", "--dir", d, "--chunks", "4", "--tokens", "64", "--layers", "3", "--json",
    ]));
    let v = json(&kvroute(&[
        "bench",
        "kvpath",
        "--dir",
        d,
        "--provider",
        "shm",
        "--rounds",
        "1",
        "--json",
    ]));
    assert_eq!(
        (v["blocks"].as_u64(), v["layers"].as_u64()),
        (Some(4), Some(3))
    );
    // Two passes that write (DE path, hop alone), 4 blocks each.
    assert_eq!(
        (v["checked"].as_u64(), v["matched"].as_u64()),
        (Some(8), Some(8))
    );
    let paths = v["paths"].as_array().unwrap();
    assert_eq!(paths.len(), 3);
    assert!(
        paths
            .iter()
            .all(|p| p["median_mb_s"].as_f64().unwrap() > 0.0)
    );
    assert!(v["implied_cnic_gbps"].as_f64().unwrap() > 0.0);
    let out = kvroute(&[
        "bench",
        "kvpath",
        "--dir",
        "/nonexistent-store",
        "--rounds",
        "1",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `verify-predicate` on a live holder: at the grid's far corners (a decode batch against a
/// small chunk, a prefill-sized batch) the two primitives are several times apart, so the
/// calibrated choice is fixed there and must be the measured fastest wherever the measurements
/// separate the two; every point carries its prediction beside its measurement, and the plots
/// are PNGs.
#[test]
fn verify_predicate_predicts_then_measures_route_and_fetch() {
    let _turn = busy_turn();
    let dir = scratch("verify");
    let v = json(&kvroute(&[
        "verify-predicate",
        "--provider",
        "shm",
        "--holders",
        "1",
        "--ct",
        "256",
        "--mq",
        "16,1024",
        "--reps",
        "5",
        "--plots",
        dir.to_str().unwrap(),
        "--json",
    ]));
    let points = v["points"].as_array().unwrap();
    assert_eq!(points.len(), 2);
    for p in points {
        for k in ["route", "fetch"] {
            let (pred, meas) = (
                p[k]["predicted_us"].as_f64().unwrap(),
                p[k]["measured_us"].as_f64().unwrap(),
            );
            assert!(pred > 0.0 && meas > 0.0, "{p}");
            assert_eq!(p[k]["samples_us"].as_array().unwrap().len(), 5, "{p}");
        }
        assert!(p["cold"]["route_predicted_us"].as_f64().unwrap() > 0.0);
    }
    // The calibrated choice at each corner; the measured fastest only where the two measured
    // times are far enough apart to say (`decisive`): on a loaded machine a corner's two
    // primitives can come out within noise of each other.
    for (p, want) in points.iter().zip(["route", "fetch"]) {
        assert_eq!(p["choice"], want, "{p}");
        if p["decisive"].as_bool().unwrap() {
            assert_eq!(p["fastest"], want, "{p}");
        }
    }
    let s = &v["summary"];
    assert_eq!(s["decisive_correct"], s["decisive_points"], "{s}");
    assert!(
        s["route_median_abs_error_pct"]
            .as_f64()
            .unwrap()
            .is_finite()
    );
    let cal = &v["calibrations"][0][1];
    // The fit, or (a machine too loaded for a believable line) the estimator's refusal, said.
    assert!(
        cal["fabric_fitted"] == true
            || (cal["fabric_fitted"] == false && cal["detail"]["fabric_rejected"].is_string()),
        "{cal}"
    );
    assert!(cal["detail"]["ages_ms"]["merge"].is_u64(), "{cal}");
    for png in ["predicted-vs-measured.png", "decision-map.png"] {
        let bytes = std::fs::read(dir.join(png)).unwrap();
        assert_eq!(&bytes[..4], b"\x89PNG", "{png}");
    }
    let out = kvroute(&["verify-predicate", "--mq", "0"]);
    assert_eq!(out.status.code(), Some(2));
}
