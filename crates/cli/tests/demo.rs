//! The demo's holder/requester flow across processes over real libfabric providers
//! (`tcp;ofi_rxm` and `shm`), as `cargo xtask demo` runs it, smaller: every check must pass.

#![allow(clippy::expect_used)]

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A demo that runs longer than this is hung (they take 1-5 s here): it is killed and the
/// test fails, so a wedged provider cannot hold CI.
const HANG: Duration = Duration::from_secs(120);

fn demo(args: &[&str]) -> (bool, serde_json::Value, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["demo", "--json", "--tokens", "512"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running kvroute demo: {e}"));
    // Drained on threads so a chatty demo cannot block on a full pipe.
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = r.read_to_string(&mut text);
            text
        })
    };
    let out = drain(Box::new(child.stdout.take().expect("piped stdout")));
    let err = drain(Box::new(child.stderr.take().expect("piped stderr")));
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the demo") {
            break status;
        }
        if started.elapsed() > HANG {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kvroute demo {args:?} hung for {HANG:?}; killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    // A failed run prints its report, then the error object: the first JSON document.
    let json = serde_json::Deserializer::from_str(&stdout)
        .into_iter::<serde_json::Value>()
        .next()
        .and_then(Result::ok)
        .unwrap_or_default();
    (status.success(), json, format!("{stdout}\n{stderr}"))
}

fn assert_passed(args: &[&str]) -> serde_json::Value {
    let (ok, json, text) = demo(args);
    assert!(ok, "demo {args:?} failed:\n{text}");
    assert_eq!(json["passed"], true, "{text}");
    let checks = json["checks"].as_array().map_or(0, Vec::len);
    assert!(checks >= 8, "dense and sparse checks ran: {text}");
    json
}

#[test]
fn demo_over_tcp_routes_and_checks() {
    let json = assert_passed(&["--provider", "tcp", "--holders", "2", "--steps", "1"]);
    assert_eq!(json["provider"], "tcp;ofi_rxm");
}

#[test]
fn demo_over_shm_routes_and_checks() {
    let json = assert_passed(&["--provider", "shm", "--holders", "3", "--steps", "1"]);
    assert_eq!(json["provider"], "shm");
}

#[test]
fn demo_fetch_splices_and_checks() {
    let json = assert_passed(&[
        "--provider",
        "tcp",
        "--holders",
        "2",
        "--force",
        "fetch",
        "--steps",
        "1",
    ]);
    assert!(
        !json["fetch_us"].as_array().is_some_and(Vec::is_empty),
        "fetches ran"
    );
}

/// A holder killed mid-run: the requester reports the failed chunks, falls back to their
/// replicas, and every check still passes.
fn killed_holder_falls_back_to_a_replica(provider: &str) {
    let json = assert_passed(&[
        "--provider",
        provider,
        "--holders",
        "3",
        "--replicas",
        "2",
        "--steps",
        "2",
        "--kill-holder-at-step",
        "1",
        "--timeout-ms",
        "1500",
    ]);
    let failures = json["failures"].as_array().cloned().unwrap_or_default();
    assert!(
        failures.len() >= 2,
        "the kill and the failed chunk are reported: {failures:?}"
    );
    // Only the dead holder's chunks failed: the live holders kept answering (over shm a dead
    // peer used to stall every other peer's completions, see FabricConfig::tx_endpoint_per_peer).
    let dead = failures[0].as_str().unwrap_or_default().to_owned();
    let addr = dead
        .split(['(', ')'])
        .nth(1)
        .unwrap_or_else(|| panic!("the kill names the holder: {dead}"));
    for f in &failures[1..] {
        let f = f.as_str().unwrap_or_default();
        assert!(f.contains(addr), "a live holder failed: {f} ({failures:?})");
    }
}

#[test]
fn killed_holder_falls_back_to_a_replica_over_tcp() {
    killed_holder_falls_back_to_a_replica("tcp");
}

#[test]
fn killed_holder_falls_back_to_a_replica_over_shm() {
    killed_holder_falls_back_to_a_replica("shm");
}

/// A killed holder with no replica: the run fails with an error naming the chunk, and does not
/// hang.
fn killed_holder_without_replica_fails_cleanly(provider: &str) {
    let started = Instant::now();
    let (ok, _, text) = demo(&[
        "--provider",
        provider,
        "--holders",
        "2",
        "--steps",
        "2",
        "--kill-holder-at-step",
        "1",
        "--timeout-ms",
        "1000",
    ]);
    assert!(!ok, "{text}");
    assert!(text.contains("no live holder has chunk 0"), "{text}");
    assert!(started.elapsed() < Duration::from_secs(60));
}

#[test]
fn killed_holder_without_replica_fails_cleanly_over_tcp() {
    killed_holder_without_replica_fails_cleanly("tcp");
}

#[test]
fn killed_holder_without_replica_fails_cleanly_over_shm() {
    killed_holder_without_replica_fails_cleanly("shm");
}
