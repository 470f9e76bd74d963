//! The offline planners and simulators: `plan prfaas`, `plan helix`, `tour`, `presets`,
//! `simulate dualpath` and `simulate prfaas`.

use super::{json, kvroute, scratch};

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
