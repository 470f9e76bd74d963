//! The CLI's machine-readable output is the cost model's serde types, and its numbers are the
//! library's numbers: a scheduler may script `kvroute predict --json` or link the crate and get
//! the same answer.

// Test helpers panic on failure: that is how a test reports it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use clap::Parser;
use kvroute_cli::Cli;
use kvroute_costmodel::{CostModel, CostParams, Decision, Request, fabric_preset, model_preset};

fn run(args: &[&str]) -> serde_json::Value {
    let cli = Cli::try_parse_from(std::iter::once("kvroute").chain(args.iter().copied())).unwrap();
    serde_json::from_str(&kvroute_cli::run(&cli).unwrap()).unwrap()
}

#[test]
fn predict_json_deserialises_into_the_cost_models_decision_and_matches_the_library() {
    for (model, fabric, mq, ct) in [
        ("deepseek-v2-lite", "h100-ibgda", "256", "2048"),
        ("kimi-k2", "a40-pcie4", "4096", "64"),
        ("deepseek-v3", "h100-nvlink4", "1", "8192"),
    ] {
        let v = run(&[
            "predict", "--model", model, "--fabric", fabric, "--mq", mq, "--ct", ct, "--json",
        ]);
        let from_cli: Decision = serde_json::from_value(v["decision"].clone()).unwrap();
        let request: Request = serde_json::from_value(v["request"].clone()).unwrap();

        let params = CostParams::paper_defaults(
            model_preset(model).unwrap().dims,
            fabric_preset(fabric).unwrap().fabric,
        );
        let direct = CostModel::new(params).unwrap().decide(&request).unwrap();
        assert_eq!(from_cli, direct, "{model} on {fabric}");
    }
}

#[test]
fn tour_decisions_are_the_librarys_decisions() {
    let v = run(&["tour", "--json"]);
    let mut checked = 0;
    for stop in v["stops"].as_array().unwrap() {
        if stop["result"]["kind"] != "predict" {
            continue;
        }
        let r = &stop["result"];
        let decision: Decision = serde_json::from_value(r["decision"].clone()).unwrap();
        let request: Request = serde_json::from_value(r["request"].clone()).unwrap();
        let model = model_preset(r["model"].as_str().unwrap()).unwrap().dims;
        // The tour's congested stop changes the congestion; rebuild from the reported fabric.
        let mut params = CostParams::paper_defaults(
            model,
            fabric_preset(r["fabric"].as_str().unwrap()).unwrap().fabric,
        );
        params.congestion = derive_congestion(&params, &r["effective_fabric"]);
        let direct = CostModel::new(params).unwrap().decide(&request).unwrap();
        assert_eq!(decision.choice, direct.choice, "{}", stop["title"]);
        assert!(
            (decision.chosen().total_us - direct.chosen().total_us).abs() < 1e-6,
            "{}",
            stop["title"]
        );
        checked += 1;
    }
    assert!(checked >= 7, "{checked}");
}

/// The congestion that turns the preset fabric into the reported effective one.
fn derive_congestion(
    params: &CostParams,
    effective: &serde_json::Value,
) -> kvroute_costmodel::Congestion {
    let probe = effective["probe_us"].as_f64().unwrap();
    let bw = effective["bw_gbps"].as_f64().unwrap();
    kvroute_costmodel::Congestion {
        bw_degradation: params.fabric.bw_gbps / bw,
        probe_inflation: probe / params.fabric.probe_us,
        concurrent_flows: 1,
    }
}
