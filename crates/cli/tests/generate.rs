//! `kvroute generate` and the demo's generation across processes over real libfabric
//! providers (`shm` and `tcp;ofi_rxm`), smaller than the default: holder processes prefill the
//! context through the model and serve it from paged caches; every request's tokens must be
//! the single-instance reference's, with a holder killed mid-generation too.

#![allow(clippy::expect_used)]

mod common;

use std::time::Duration;

/// A generation that runs longer than this is hung (they take 5-20 s here).
const HANG: Duration = Duration::from_secs(180);

/// One run at a time: each starts a requester and several holder processes on two cores.
static ONE_RUN: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `kvroute` with `args`, one run at a time.
fn kvroute(args: &[&str]) -> (bool, serde_json::Value, String) {
    let _one = ONE_RUN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    common::kvroute(args, HANG)
}

/// A passed generation: every request's tokens the reference's, as many as asked, every
/// layer's hidden-state difference within bf16 rounding, and chunks attended remotely.
fn assert_identical(json: &serde_json::Value, text: &str, new_tokens: usize) {
    assert_eq!(json["passed"], true, "{text}");
    let requests = json["requests"].as_array().cloned().unwrap_or_default();
    assert_eq!(requests.len(), 4, "{text}");
    for r in &requests {
        let tokens = r["tokens"].as_array().cloned().unwrap_or_default();
        assert_eq!(tokens.len(), new_tokens, "{text}");
        assert_eq!(r["tokens"], r["reference_tokens"], "{text}");
    }
    for d in json["layer_max_abs"]
        .as_array()
        .cloned()
        .unwrap_or_default()
    {
        assert!(d.as_f64().is_some_and(|d| d < 0.03), "{text}");
    }
    let stats = &json["stats"];
    let remote = stats["routes"].as_u64().unwrap_or(0) + stats["fetches"].as_u64().unwrap_or(0);
    assert!(remote > 0, "nothing crossed the wire: {text}");
    assert!(
        json["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0),
        "{text}"
    );
}

#[test]
fn generate_over_shm_and_tcp_gives_the_single_instance_tokens() {
    for provider in ["shm", "tcp"] {
        let args = [
            "--json",
            "generate",
            "--provider",
            provider,
            "--tokens",
            "512",
            "--new-tokens",
            "6",
        ];
        let (ok, json, text) = kvroute(&args);
        assert!(ok, "{args:?}: {text}");
        assert_identical(&json, &text, 6);
        assert_eq!(json["command"], "generate");
    }
}

#[test]
fn a_killed_holder_falls_back_to_its_replicas_and_the_tokens_stay_the_same() {
    let args = [
        "--json",
        "demo",
        "--provider",
        "shm",
        "--tokens",
        "256",
        "--new-tokens",
        "6",
        "--holders",
        "4",
        "--replicas",
        "2",
        "--kill-holder-at-token",
        "2",
        "--block-tokens",
        "16",
    ];
    let (ok, json, text) = kvroute(&args);
    assert!(ok, "{args:?}: {text}");
    assert_identical(&json, &text, 6);
    assert_eq!(json["command"], "demo");
    let events = json["events"].as_array().cloned().unwrap_or_default();
    assert!(
        events
            .iter()
            .any(|e| e.as_str().is_some_and(|e| e.contains("killed"))),
        "{text}"
    );
    // The killed holder answers nothing at the end; the other three do.
    assert_eq!(json["served"].as_array().map(Vec::len), Some(3), "{text}");
}

/// A checkpoint written by `model init` and read back by the holders and the requester
/// through the safetensors loader gives the same tokens as the default model of that seed.
#[test]
fn a_checkpoint_from_model_init_generates_what_the_default_model_does() {
    let dir = std::env::temp_dir().join(format!("kvroute-generate-test-{}", std::process::id()));
    let dir_text = dir.display().to_string();
    let (ok, json, text) = kvroute(&["--json", "model", "init", "--out", &dir_text, "--seed", "3"]);
    assert!(ok, "{text}");
    assert!(
        json["parameters"].as_u64().is_some_and(|p| p > 1_000_000),
        "{text}"
    );
    let run = |model: Option<&str>| {
        let mut args = vec![
            "--json",
            "generate",
            "--provider",
            "shm",
            "--tokens",
            "128",
            "--new-tokens",
            "4",
            "--force",
            "route",
        ];
        match model {
            Some(dir) => args.extend(["--model", dir]),
            None => args.extend(["--model-seed", "3"]),
        }
        let (ok, json, text) = kvroute(&args);
        assert!(ok, "{args:?}: {text}");
        assert_identical(&json, &text, 4);
        json["requests"].clone()
    };
    let from_file = run(Some(&dir_text));
    let drawn = run(None);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(from_file, drawn);
    // A corrupt checkpoint is refused naming the file, before any holder starts.
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    std::fs::write(dir.join("config.json"), b"{ not json").expect("writing a bad config");
    let (ok, _, text) = kvroute(&["generate", "--model", &dir_text]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!ok, "{text}");
    assert!(text.contains("config.json"), "{text}");
    assert!(!text.contains("panicked"), "{text}");
}
