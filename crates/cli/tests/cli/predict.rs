//! `predict` as a user runs it: its routing report, its flags, and the inputs it refuses
//! (typed errors, usage errors naming the flag).

use super::{json, kvroute};

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
