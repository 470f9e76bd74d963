//! The `kvroute` binary as a user runs it: exit codes, JSON on stdout, errors on stderr.

// Test helpers panic on failure: that is how a test reports it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Output};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Tests that keep both cores busy take turns: `verify-predicate` asserts which primitive
/// measured fastest, and a bench's spinning processes beside it on a two-core machine can
/// reverse that (the test harness runs two tests at a time there).
static BUSY: Mutex<()> = Mutex::new(());

fn busy_turn() -> MutexGuard<'static, ()> {
    BUSY.lock().unwrap_or_else(PoisonError::into_inner)
}

fn kvroute(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .output()
        .expect("kvroute runs")
}

fn json(output: &Output) -> serde_json::Value {
    assert!(
        output.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("stdout is one JSON document")
}

#[test]
fn predict_at_the_decode_point_routes_and_reports_every_cost() {
    let v = json(&kvroute(&[
        "predict",
        "--model",
        "deepseek-v2-lite",
        "--fabric",
        "h100-ibgda",
        "--mq",
        "256",
        "--ct",
        "2048",
        "--json",
    ]));
    assert_eq!(v["decision"]["choice"], "route");
    assert_eq!(v["query_row_bytes"], 1152);
    assert_eq!(v["partial_row_bytes"], 1032);
    for p in ["route", "fetch", "local"] {
        assert!(v["decision"][p]["total_us"].as_f64().unwrap() > 0.0, "{p}");
    }
    let crossover = v["byte_crossover_rows"].as_f64().unwrap();
    assert!((crossover - 1080.26).abs() < 0.01, "{crossover}");
}

#[test]
fn predict_accepts_measured_fabric_constants_and_sparse_selection() {
    let v = json(&kvroute(&[
        "predict",
        "--model",
        "glm-5.1",
        "--probe-us",
        "5",
        "--bw-gbps",
        "40",
        "--mq",
        "64",
        "--ct",
        "100000",
        "--topk",
        "2048",
        "--holders",
        "3",
        "--json",
    ]));
    assert_eq!(v["fabric"], "measured");
    assert_eq!(v["effective_fabric"]["probe_us"], 5.0);
    assert_eq!(v["request"]["selection"]["holders"], 3);
    assert_eq!(v["decision"]["fetch"]["breakdown"]["splice_us"], 0.0);
}

#[test]
fn only_forces_the_primitive() {
    let v = json(&kvroute(&[
        "predict", "--mq", "256", "--ct", "2048", "--only", "local", "--json",
    ]));
    assert_eq!(v["decision"]["choice"], "local");
    assert_eq!(v["decision"]["route"]["allowed"], false);
}

#[test]
fn text_output_names_the_choice_and_says_local_is_modelled() {
    let out = kvroute(&["predict", "--mq", "256", "--ct", "2048"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("choice: route"), "{text}");
    assert!(text.contains("not a measurement"), "{text}");
}

/// Values each in range but wrong together reach the cost model and come back as its typed
/// error: exit 1, a message on stderr naming the parameter, and with --json an
/// {"error": ...} object on stdout.
#[test]
fn bad_input_exits_non_zero_with_the_typed_error() {
    let cases = [
        (
            "predict --mq 1 --ct 1024 --topk 2048",
            "exceeds the 1024-token chunk",
        ),
        (
            "predict --mq 1 --ct 2048 --model llama",
            "unknown model preset `llama`",
        ),
        (
            "predict --mq 1 --ct 2048 --flows 4 --probe-us 1 --bw-gbps 1",
            "link capacity",
        ),
        ("plan prfaas --min-tokens 200000", "truncation range"),
        ("plan prfaas --n-pd 1", "2 instances"),
        (
            "plan prfaas --threshold 4096 --np 9",
            "exceeds the PD cluster's 8 instances",
        ),
    ];
    for (command, needle) in cases {
        let args: Vec<&str> = command.split_whitespace().collect();
        let out = kvroute(&args);
        assert_eq!(out.status.code(), Some(1), "{command}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("error") && stderr.contains(needle),
            "{command}: {stderr}"
        );
        let out = kvroute(&[args.as_slice(), &["--json"]].concat());
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(v["error"].as_str().unwrap().contains(needle), "{command}");
    }
}

/// A value outside the range a flag documents (a zero count, a NaN, an infinite or negative
/// bandwidth) is clap's usage error, before anything runs: exit 2, the flag and its range on
/// stderr, nothing on stdout even with --json.
#[test]
fn out_of_range_values_are_usage_errors_naming_the_flag() {
    let cases = [
        ("predict --mq 0 --ct 2048", "--mq"),
        (
            "predict --mq 1 --ct 2048 --probe-us nan --bw-gbps 25",
            "--probe-us",
        ),
        (
            "predict --mq 1 --ct 2048 --probe-us 16 --bw-gbps -25",
            "--bw-gbps",
        ),
        (
            "predict --mq 1 --ct 2048 --probe-us 16 --bw-gbps inf",
            "--bw-gbps",
        ),
        ("plan prfaas --sigma 0", "--sigma"),
        ("plan prfaas --decode-tps 0", "--decode-tps"),
        ("plan helix --tpa 0", "--tpa"),
        ("helix run --steps 18446744073709551615", "--steps"),
        ("simulate prfaas --h20-slowdown 1e308", "--h20-slowdown"),
    ];
    for (command, flag) in cases {
        let args: Vec<&str> = command.split_whitespace().collect();
        let out = kvroute(&[args.as_slice(), &["--json"]].concat());
        assert_eq!(out.status.code(), Some(2), "{command}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(flag) && stderr.contains("is not in"),
            "{command}: {stderr}"
        );
        assert!(out.stdout.is_empty(), "{command}");
    }
}

#[test]
fn usage_errors_exit_2() {
    assert_eq!(
        kvroute(&["predict", "--ct", "2048"]).status.code(),
        Some(2),
        "--mq is required"
    );
    assert_eq!(
        kvroute(&["predict", "--mq", "1", "--ct", "1", "--probe-us", "3"])
            .status
            .code(),
        Some(2)
    );
    assert_eq!(kvroute(&["frobnicate"]).status.code(), Some(2));
}

#[test]
fn plan_prfaas_finds_the_case_study_split_and_rejects_a_malformed_profile() {
    let v = json(&kvroute(&["plan", "prfaas", "--grid", "256", "--json"]));
    assert_eq!(
        (v["point"]["np"].as_u64(), v["point"]["nd"].as_u64()),
        (Some(3), Some(5))
    );

    let dir = std::env::temp_dir().join(format!("kvroute-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("profile.json");
    std::fs::write(&bad, r#"[{"tokens": 1024, "kv_bytes": 1e8, "prefill_s": 0.4}, {"tokens": 512, "kv_bytes": 2e8, "prefill_s": 0.8}]"#).unwrap();
    let out = kvroute(&["plan", "prfaas", "--profile", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a valid length profile"));
    let missing = dir.join("absent.json");
    assert_eq!(
        kvroute(&["plan", "prfaas", "--profile", missing.to_str().unwrap()])
            .status
            .code(),
        Some(1)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn plan_helix_reports_the_figure_3_timeline() {
    let v = json(&kvroute(&[
        "plan",
        "helix",
        "--hopb-requests",
        "8",
        "--hopb-attention",
        "2",
        "--hopb-comm",
        "1.2",
        "--json",
    ]));
    assert!((v["hopb"]["span_without"].as_f64().unwrap() - 25.6).abs() < 1e-9);
    assert!((v["hopb"]["span_with"].as_f64().unwrap() - 17.2).abs() < 1e-9);
}

#[test]
fn tour_and_presets_run_and_serialise() {
    let tour = json(&kvroute(&["tour", "--json"]));
    let stops = tour["stops"].as_array().unwrap();
    assert!(stops.len() >= 10);
    assert!(
        stops
            .iter()
            .all(|s| s["paper"].is_string() && s["result"]["kind"].is_string())
    );
    let presets = json(&kvroute(&["presets", "--json"]));
    assert_eq!(presets["models"].as_array().unwrap().len(), 7);
    assert_eq!(presets["fabrics"].as_array().unwrap().len(), 5);
}

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

/// A probe and a bandwidth whose costs would overflow to infinity are refused before any
/// pricing (the cost model's own refusal of a non-finite cost is tested in its crate).
#[test]
fn predict_refuses_a_probe_and_bandwidth_outside_their_ranges() {
    let out = kvroute(&[
        "predict",
        "--mq",
        "256",
        "--ct",
        "2048",
        "--probe-us",
        "1e308",
        "--bw-gbps",
        "1e-308",
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(2), "exit 0 on an infinite cost");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--probe-us"), "{stderr}");
    assert!(out.stdout.is_empty(), "no cost, no decision");
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn trace_replay_prints_the_traces_published_figures_and_names_a_bad_line() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../data/mooncake/conversation_trace.jsonl"
    );
    let v = json(&kvroute(&["trace", "replay", "--trace", trace, "--json"]));
    assert_eq!(v["distinct_blocks"], 182_790);
    assert_eq!(
        format!("{:.3}", v["block_prefix_hit_ratio"].as_f64().unwrap()),
        "0.366"
    );
    let text = kvroute(&[
        "trace",
        "replay",
        "--trace",
        trace,
        "--capacity-blocks",
        "1000",
    ]);
    assert!(
        String::from_utf8_lossy(&text.stdout)
            .contains("block prefix hit ratio 0.044 (12831 of 288500 blocks)")
    );

    let dir = scratch("trace");
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1, 2]}\n\
         {\"timestamp\": 1, \"input_length\": -600, \"output_length\": 1, \"hash_ids\": [1]}\n",
    )
    .unwrap();
    let out = kvroute(&["trace", "replay", "--trace", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 2: `input_length` is -600"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn store_verify_exits_1_naming_a_corrupt_and_a_missing_block() {
    let dir = scratch("store");
    let d = dir.to_str().unwrap();
    let w = json(&kvroute(&[
        "store", "write", "--dir", d, "--chunks", "3", "--tokens", "64", "--layers", "2", "--json",
    ]));
    assert_eq!(w["blocks"], 3);
    let v = json(&kvroute(&["store", "verify", "--dir", d, "--json"]));
    assert_eq!(
        (
            v["ok"].as_u64(),
            v["corrupt"].as_u64(),
            v["missing"].as_u64()
        ),
        (Some(3), Some(0), Some(0))
    );
    // One byte flipped in block 1's second layer, block 2 deleted.
    let one = dir.join("0000000000000001.kvb");
    let mut bytes = std::fs::read(&one).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 1;
    std::fs::write(&one, bytes).unwrap();
    std::fs::remove_file(dir.join("0000000000000002.kvb")).unwrap();
    let out = kvroute(&["store", "verify", "--dir", d]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("1 ok, 1 corrupt, 1 missing"), "{text}");
    assert!(
        text.contains("0000000000000001.kvb") && text.contains("layer 1 checksum mismatch"),
        "{text}"
    );
    assert!(text.contains("0000000000000002: missing"), "{text}");
    // With --json, stdout is the report alone, one document, and the exit status says the
    // rest.
    let out = kvroute(&["store", "verify", "--dir", d, "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("stdout is one JSON document");
    assert_eq!(v["corrupt"], 1, "{v}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("2 bad blocks"));
    // A FIFO named like a block file is reported, not waited on.
    let fifo = dir.join("0000000000000007.kvb");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let started = std::time::Instant::now();
    let out = kvroute(&["store", "verify", "--dir", d]);
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("0000000000000007.kvb: ") && text.contains("FIFO"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A trace that is a device or a FIFO would be read without end: refused at once.
#[test]
fn a_trace_that_is_not_a_regular_file_is_refused() {
    for args in [
        &[
            "trace",
            "replay",
            "--trace",
            "/dev/zero",
            "--capacity-blocks",
            "8",
        ][..],
        &["simulate", "prfaas", "--trace", "/dev/zero"][..],
    ] {
        let started = std::time::Instant::now();
        let out = kvroute(args);
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{args:?}"
        );
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("/dev/zero") && err.contains("a device"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn store_bench_reports_reads_and_writes_beside_dd() {
    let _turn = busy_turn();
    let dir = scratch("bench");
    let d = dir.to_str().unwrap();
    json(&kvroute(&[
        "store", "write", "--dir", d, "--chunks", "2", "--tokens", "128", "--layers", "3", "--json",
    ]));
    let v = json(&kvroute(&[
        "store", "bench", "--dir", d, "--rounds", "1", "--json",
    ]));
    let readers: Vec<&str> = v["reads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["what"].as_str().unwrap())
        .collect();
    assert!(readers.contains(&"dd bs=4M"), "{readers:?}");
    assert!(v["read_ratio"].as_f64().unwrap() > 0.0 && v["write_ratio"].as_f64().unwrap() > 0.0);
    assert!(
        !dir.join(".bench-write").exists(),
        "the write scratch is removed"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn simulate_dualpath_runs_every_policy_with_ratios_and_plots() {
    let dir = scratch("simulate");
    let v = json(&kvroute(&[
        "simulate",
        "dualpath",
        "--agents",
        "128",
        "--model",
        "ds-27b",
        "--prefill-nodes",
        "1",
        "--decode-nodes",
        "2",
        "--plots",
        dir.to_str().unwrap(),
        "--json",
    ]));
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 3);
    assert_eq!(runs[0]["policy"], "dualpath");
    assert!(
        runs.iter()
            .all(|r| r["ttft_s"]["p90"].as_f64().unwrap() > 0.0)
    );
    assert!(v["throughput_ratio"]["vs_prefill_read"].as_f64().unwrap() > 1.0);
    assert!(v["throughput_ratio"]["vs_round_robin"].is_number());
    assert_eq!(v["config"]["snic_gbps"], 400.0);
    for png in [
        "throughput.png",
        "snic_balance.png",
        "attention_balance.png",
    ] {
        assert!(
            std::fs::metadata(dir.join(png)).unwrap().len() > 1000,
            "{png}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    // Bad input: out of range, a usage error (exit 2); otherwise a typed error (exit 1).
    for (bad, code) in [
        (&["--snic-gbps", "-400"][..], 2),
        (&["--prefill-nodes", "0"], 2),
        (&["--policy", "fastest"], 1),
        (&["--trace", "/nonexistent.jsonl"], 1),
    ] {
        let mut args = vec!["simulate", "dualpath", "--agents", "4"];
        args.extend_from_slice(bad);
        let out = kvroute(&args);
        assert_eq!(out.status.code(), Some(code), "{bad:?}");
        assert!(!out.stderr.is_empty());
    }
}

#[test]
fn simulate_prfaas_reports_both_readings_and_a_trace() {
    let v = json(&kvroute(&[
        "simulate",
        "prfaas",
        "--requests",
        "20000",
        "--json",
    ]));
    let readings = v["case_study"].as_array().unwrap();
    assert_eq!(readings.len(), 2);
    let ratio = |i: usize, k: &str| readings[i]["throughput_ratio"][k].as_f64().unwrap();
    assert!(
        (ratio(0, "vs_naive") - 1.32).abs() < 0.132,
        "{}",
        ratio(0, "vs_naive")
    );
    assert!(
        (ratio(1, "vs_homogeneous") - 1.54).abs() < 0.154,
        "{}",
        ratio(1, "vs_homogeneous")
    );
    assert!(readings[0]["prfaas_pd"]["ttft_s"]["p90"].is_number());
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../data/mooncake/conversation_trace.jsonl"
    );
    let t = json(&kvroute(&[
        "simulate", "prfaas", "--trace", trace, "--json",
    ]));
    let runs = t["trace"]["at_trace_rate"].as_array().unwrap();
    assert_eq!(runs.len(), 3);
    assert_eq!(runs[0]["requests"], 12_031);
    assert!(t["trace"]["sustainable"][0]["kept_up"].as_bool().unwrap());
    assert!(t["trace"]["throughput_ratio"]["vs_homogeneous"].is_number());
    let out = kvroute(&["simulate", "prfaas", "--h20-slowdown", "nan"]);
    assert_eq!(out.status.code(), Some(2));
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
