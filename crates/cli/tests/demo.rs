//! The demo's holder/requester flow across processes over real libfabric providers
//! (`tcp;ofi_rxm` and `shm`), as `cargo xtask demo` runs it, smaller: every check must pass.

#![allow(clippy::expect_used)]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A demo that runs longer than this is hung (they take 1-5 s here): it is killed and the
/// test fails, so a wedged provider cannot hold CI.
const HANG: Duration = Duration::from_secs(120);

/// One demo at a time: each starts a requester and two to four holder processes, and the
/// selector prices routes by the fabric and kernel times it measures. Run side by side on a
/// two-core machine, each demo measured the others' load (probes of 4-5 ms) and chose to
/// compute locally, which leaves nothing crossing the wire to check.
static ONE_DEMO: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn demo(args: &[&str]) -> (bool, serde_json::Value, String) {
    let _one = ONE_DEMO
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut all = vec!["demo", "--attention-checks", "--json", "--tokens", "512"];
    all.extend_from_slice(args);
    common::kvroute(&all, HANG)
}

fn assert_passed(args: &[&str]) -> serde_json::Value {
    let (ok, json, text) = demo(args);
    assert!(ok, "demo {args:?} failed:\n{text}");
    assert_passed_report(&json, &text);
    json
}

/// A passed report's checks: enough of them, each of an output that crossed the wire.
fn assert_passed_report(json: &serde_json::Value, text: &str) {
    assert_eq!(json["passed"], true, "{text}");
    let checks = json["checks"].as_array().cloned().unwrap_or_default();
    // Three checked layers per request and dense step, and three for the sparse step.
    assert!(checks.len() >= 6, "dense and sparse checks ran: {text}");
    // Every checked output has a part that came through a holder: routed, fetched (now or
    // into the cache before) or gathered. A partial recomputed from the requester's own copy
    // alone tests no protocol fault.
    for c in &checks {
        let name = c["name"].as_str().unwrap_or_default();
        assert!(
            ["through the wire", "fetched", "fetch cache", "gathered"]
                .iter()
                .any(|via| name.contains(via)),
            "a check that did not cross the wire: {name}"
        );
    }
}

#[test]
fn demo_over_tcp_routes_and_checks() {
    // Routes forced: over tcp on a slow or loaded machine the selector may rightly compute
    // locally, and then nothing crosses the wire.
    let json = assert_passed(&[
        "--provider",
        "tcp",
        "--holders",
        "2",
        "--steps",
        "1",
        "--force",
        "route",
    ]);
    assert_eq!(json["provider"], "tcp;ofi_rxm");
}

#[test]
fn demo_over_shm_routes_and_checks() {
    let json = assert_passed(&["--provider", "shm", "--holders", "3", "--steps", "2"]);
    assert_eq!(json["provider"], "shm");
    // Decisions per (request, chunk), logged once per kind (chunk, shape, choice, holder)
    // with every step and request it covers: each chunk's cover both dense steps, and the
    // sparse step has its own.
    let decisions = json["decisions"].as_array().cloned().unwrap_or_default();
    for chunk in 0..3u64 {
        let mut steps: Vec<u64> = decisions
            .iter()
            .filter(|d| d["chunk"] == chunk && d["sparse"] == false)
            .flat_map(|d| d["steps"].as_array().cloned().unwrap_or_default())
            .filter_map(|s| s.as_u64())
            .collect();
        steps.sort_unstable();
        steps.dedup();
        assert_eq!(steps, vec![0, 1], "chunk {chunk}: {decisions:?}");
    }
    assert!(
        decisions.iter().any(|d| d["sparse"] == true),
        "{decisions:?}"
    );
    // Every route round (one layer call) and every step's fetches have the selector's price
    // beside the measurement.
    let timings = json["timings"].as_array().cloned().unwrap_or_default();
    for t in &timings {
        let (p, m) = (&t["predicted_us"], &t["measured_us"]);
        assert!(
            p.as_f64().is_some_and(|v| v > 0.0) && m.as_f64().is_some_and(|v| v > 0.0),
            "{t}"
        );
        // The terms it was priced with add up to it, the fabric's fixed cost among them.
        let terms = &t["predicted"];
        let sum: f64 = [
            "probe_us",
            "turnaround_us",
            "transfer_us",
            "compute_us",
            "return_us",
            "merge_us",
            "splice_us",
            "gather_us",
        ]
        .iter()
        .map(|k| terms[*k].as_f64().unwrap())
        .sum();
        let p = p.as_f64().unwrap();
        assert!((sum - p).abs() <= 1e-6 * p, "{t}");
        assert!(terms["probe_us"].as_f64().is_some_and(|v| v > 0.0), "{t}");
    }
    let kind = |k: &str| timings.iter().filter(|t| t["kind"] == k).count();
    let count = |k: &str| json[k].as_array().map_or(0, Vec::len);
    assert_eq!(
        kind("route round (one layer; one request per holder, holders in parallel)"),
        count("route_us"),
        "{timings:?}"
    );
    assert_eq!(
        kind("fetches (each chunk once, every layer, spliced)"),
        count("fetch_us"),
        "{timings:?}"
    );
    assert!(!timings.is_empty(), "{json}");
    // The calibration it priced with: the fabric fitted here, each holder's kernel report,
    // with ages.
    let cal = &json["calibration"];
    assert!(cal["bw_gbps"].as_f64().is_some_and(|v| v > 0.0), "{cal}");
    assert_eq!(
        cal["holder_kernels"].as_array().map_or(0, Vec::len),
        3,
        "{cal}"
    );
    // The fit, or (a machine too loaded for a believable line in three sweeps) the
    // estimator's refusal, said.
    assert!(
        cal["detail"]["ages_ms"]["fabric"].is_u64()
            || (cal["fabric_fitted"] == false && cal["detail"]["fabric_rejected"].is_string()),
        "{cal}"
    );
}

/// Holders of different kernels (`--holder-backend scalar,cpu,cpu`) with every chunk on two
/// of them: the scalar holder (several times slower) is the first registered replica of
/// chunks 0 and 2, yet each chunk's routes go to the replica the selector priced them on, a
/// CPU holder, and the report names the holder of each decision and of each route.
#[test]
fn demo_routes_each_chunk_to_the_replica_the_selector_chose() {
    let json = assert_passed(&[
        "--provider",
        "shm",
        "--holders",
        "3",
        "--replicas",
        "2",
        "--holder-backend",
        "scalar,cpu,cpu",
        "--steps",
        "2",
        // Routes only (the selector still picks each chunk's holder, priced for a route): on
        // a slow or loaded machine it may rightly fetch instead, and then nothing is routed.
        "--force",
        "route",
    ]);
    let served = json["served"].as_array().cloned().unwrap_or_default();
    assert_eq!(served.len(), 3, "{served:?}");
    let scalar = served[0]["holder"].as_str().unwrap_or_default().to_owned();
    let decisions = json["decisions"].as_array().cloned().unwrap_or_default();
    // A fetch costs the same from either replica; a route is priced on the holder's kernel.
    let dense_routes: Vec<_> = decisions
        .iter()
        .filter(|d| d["sparse"] == false && d["choice"] == "Route")
        .collect();
    assert!(!dense_routes.is_empty(), "{decisions:?}");
    for d in dense_routes {
        let on = d["holder"].as_str().unwrap_or_default();
        assert!(!on.is_empty(), "a dense decision names its holder: {d}");
        assert_ne!(on, scalar, "the scalar replica was chosen to route: {d}");
    }
    let timings = json["timings"].as_array().cloned().unwrap_or_default();
    // The dense steps' route rounds (the sparse step, 2, routes every holder's selection).
    let routes: Vec<_> = timings
        .iter()
        .filter(|t| {
            t["step"].as_u64() < Some(2)
                && t["kind"]
                    .as_str()
                    .is_some_and(|k| k.starts_with("route round"))
        })
        .collect();
    assert!(!routes.is_empty(), "{timings:?}");
    for t in routes {
        let on = t["holder"].as_str().unwrap_or_default();
        assert!(
            !on.is_empty() && on != scalar,
            "a route served by the scalar replica: {t}"
        );
    }
    for s in &served {
        assert_eq!(s["gpu_rows"], 0, "{s}");
    }
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
    // One fetch per chunk, whatever the number of requests and layers: the fetch cache
    // serves the rest.
    assert_eq!(
        json["stats"]["chunk_fetches"], 2,
        "one fetch of each of the 2 chunks: {}",
        json["stats"]
    );
    assert!(
        json["stats"]["cached"].as_u64().is_some_and(|c| c > 0),
        "{}",
        json["stats"]
    );
    // Under sparse selection, fetch gathers the selected rows from every holder.
    assert!(
        !json["gather_us"].as_array().is_some_and(Vec::is_empty),
        "sparse fetches ran"
    );
    let gathered = json["checks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["name"].as_str().is_some_and(|n| n.contains("gathered")))
        .count();
    assert_eq!(gathered, 3, "one gathered check per checked layer");
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
        // Every layer call polls the holders: the dead one is found before step 1 whether
        // or not the selector would route to it.
        "--poll-ms",
        "0",
        // Routes, whose fallback this checks, whatever the selector would price on this
        // machine.
        "--force",
        "route",
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
    assert!(text.contains("chunk 0: no reachable copy"), "{text}");
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

/// A `kvroute holder` process started by hand (it serves until SIGINT/SIGTERM/SIGHUP).
struct HolderProc {
    child: std::process::Child,
    addr: String,
}

impl HolderProc {
    fn start(provider: &str, chunk: u32) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["holder", "--provider", provider, "--tokens", "512"])
            .args(["--doc-chunks", "2", "--chunks", &chunk.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting kvroute holder");
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().expect("piped stdout")),
            &mut line,
        )
        .expect("reading the holder's address");
        let v: serde_json::Value = serde_json::from_str(&line).expect("the holder's JSON line");
        let addr = v["listen"].as_str().expect("a listen address").to_owned();
        Self { child, addr }
    }
}

impl HolderProc {
    /// Stops the holder as an operator would (SIGTERM) and returns whether it exited cleanly
    /// within 10 s.
    fn stop(&mut self) -> bool {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status();
        if !sent.is_ok_and(|s| s.success()) {
            return false;
        }
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for HolderProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Three processes: two holders started on their own, and `kvroute requester` finding them
/// through a static peer file; every check passes. Bad peer lists are errors, not hangs.
#[test]
fn a_requester_process_runs_against_holder_processes_from_a_peer_file() {
    let holders = [HolderProc::start("shm", 0), HolderProc::start("shm", 1)];
    let dir = std::env::temp_dir().join(format!("kvroute-peers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let peers = dir.join("peers.txt");
    std::fs::write(
        &peers,
        format!(
            "# holders of a two-chunk document\n{}\n{}  # chunk 1\n",
            holders[0].addr, holders[1].addr
        ),
    )
    .expect("writing the peer file");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args([
                "requester",
                "--json",
                "--provider",
                "shm",
                "--tokens",
                "512",
            ])
            .args(["--doc-chunks", "2", "--steps", "1"])
            // What is tested is the peer file and the checks through the wire: forced, the
            // dense chunks go to their holders even where a loaded machine (this file's tests
            // run at once) makes the calibrated selector keep them local, and check nothing.
            .args(["--force", "route"])
            .args(args)
            .output()
            .expect("running kvroute requester")
    };
    let out = run(&["--peers", peers.to_str().expect("a UTF-8 path")]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_str(&text).expect("one JSON report");
    assert_eq!(json["command"], "requester");
    assert_eq!(json["passed"], true);
    assert_eq!(json["holders"], 2);
    assert!(json["checks"].as_array().map_or(0, Vec::len) >= 6, "{text}");

    // A holder list that names nothing, a missing file, an address that is not one.
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "# nobody\n\n").expect("writing a peer file");
    for (args, says) in [
        (
            vec!["--peers", empty.to_str().unwrap_or_default()],
            "no holder addresses",
        ),
        (
            vec!["--peers", "/nonexistent/peers.txt"],
            "reading the peer file",
        ),
        (vec!["--holders", "not-an-address"], "holder address"),
    ] {
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{args:?}: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);

    // SIGTERM shuts a holder down cleanly: it exits 0 and its endpoints are closed, so shm
    // unlinked its regions (/dev/shm/<pid>:<uid>:<n>; a killed one leaves them behind).
    for mut h in holders {
        let pid = h.child.id();
        assert!(
            h.stop(),
            "holder {} did not stop cleanly on SIGTERM",
            h.addr
        );
        let left: Vec<String> = std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with(&format!("{pid}:")))
                    .collect()
            })
            .unwrap_or_default();
        assert!(left.is_empty(), "holder {pid} left shm regions {left:?}");
    }
}

/// `kvroute holder --backend` names the holder's kernels. A name that is not a backend is
/// refused before anything starts; `cuda` where no GPU is usable refuses to start, naming
/// why (where one is, `route_mem`'s `a_gpu_holder_serves_what_a_cpu_holder_serves` runs the
/// holder on it); `auto` without a GPU serves from host memory.
#[test]
fn a_holder_refuses_a_backend_it_cannot_run() {
    let run = |backend: &str| {
        Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["holder", "--provider", "tcp", "--tokens", "512"])
            .args(["--doc-chunks", "2", "--chunks", "0", "--lifeline", "stdin"])
            .args(["--backend", backend])
            .stdin(Stdio::null())
            .output()
            .expect("running kvroute holder")
    };
    let said = |out: &std::process::Output| String::from_utf8_lossy(&out.stderr).into_owned();
    let bogus = run("tpu");
    assert!(!bogus.status.success());
    assert!(said(&bogus).contains("--backend"), "{}", said(&bogus));
    let gpu = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["kernel", "gpu-info"])
        .output()
        .expect("running kvroute kernel gpu-info");
    if gpu.status.success() {
        kvroute_testkit::skip!("a GPU is usable here: a CUDA holder would start");
        return;
    }
    let cuda = run("cuda");
    assert!(
        !cuda.status.success(),
        "a CUDA holder started without a GPU"
    );
    assert!(
        said(&cuda).contains("CUDA backend unavailable"),
        "{}",
        said(&cuda)
    );
    let auto = run("auto");
    let text = String::from_utf8_lossy(&auto.stdout);
    assert!(auto.status.success(), "{text}\n{}", said(&auto));
    assert!(text.contains("\"listen\""), "{text}");
}

/// A holder process that dies while a request is out fails that request as soon as its control
/// connection closes, not at the requester's timeout: the holder is frozen (SIGSTOP) so that
/// nothing serves the request, then killed.
#[test]
fn a_holder_that_dies_mid_request_fails_it_without_waiting_out_the_timeout() {
    use kvroute_kvstore::ChunkId;
    use kvroute_remote::{Call, Requester, RequesterConfig, RouteError};
    use kvroute_transport::fabric::{FabricConfig, ProviderChoice};
    use kvroute_transport::{EngineConfig, TransferEngine};
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;

    let mut holder = HolderProc::start("shm", 0);
    let addr: std::net::SocketAddr = holder.addr.parse().expect("a socket address");
    let (engine, _) = TransferEngine::fabric(
        &FabricConfig::provider(ProviderChoice::Shm),
        EngineConfig::default(),
    )
    .expect("an shm engine");
    let mut config = RequesterConfig::new(0.1);
    config.timeout = Duration::from_secs(60);
    let mut req = Requester::connect(engine, &[addr], config).expect("connecting");
    let q = vec![0u16; 16 * kvroute_kernels::layout::D_QK];
    let call = [Call {
        chunk: ChunkId(0),
        layer: 0,
        queries: &q,
        sparse: None,
    }];
    for part in req.route(&call) {
        part.expect("the live holder answers");
    }

    let pid = Pid::from_raw(holder.child.id() as i32);
    kill(pid, Signal::SIGSTOP).expect("freezing the holder");
    // The stop lands on each of the holder's threads a moment after `kill` returns (an
    // interrupt to a thread running elsewhere, later still on a busy host): a request sent
    // before it lands may be answered.
    let frozen = until_frozen(holder.child.id(), Duration::from_secs(5));
    assert!(frozen, "the holder's threads stopped");
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        kill(pid, Signal::SIGKILL).expect("killing the holder");
    });
    let started = Instant::now();
    let failed = req.route(&call).remove(0);
    let took = started.elapsed();
    killer.join().expect("the killer thread");
    let _ = holder.child.wait();
    let _ = kvroute_transport::fabric::remove_shm_regions_of_dead_process(holder.child.id());
    match failed {
        Err(RouteError::HolderFailed { holder: h, why }) => {
            assert_eq!(h, addr);
            // The control connection's end, or (where the provider's request write needed the
            // frozen holder's progress) the transport failing that write to a dead process.
            assert!(
                why.contains("control connection") || why.contains("write failed"),
                "{why}"
            );
        }
        other => panic!("the route to a dead holder: {other:?}"),
    }
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(10),
        "failed after {took:?}, the timeout being 60 s"
    );
    assert!(!req.is_alive(0), "the dead holder is marked dead");
    let again = req.route(&call).remove(0);
    assert!(
        matches!(again, Err(RouteError::NoHolder(ChunkId(0)))),
        "{again:?}"
    );
}

/// Whether every thread of process `pid` is stopped within `limit` (state `T` in
/// `/proc/PID/task/*/stat`).
fn until_frozen(pid: u32, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        let stopped = std::fs::read_dir(format!("/proc/{pid}/task")).is_ok_and(|tasks| {
            tasks.flatten().all(|t| {
                std::fs::read_to_string(t.path().join("stat")).is_ok_and(|stat| {
                    // The state follows the command name, which is in parentheses.
                    stat.rsplit_once(')')
                        .and_then(|(_, rest)| rest.trim_start().chars().next())
                        .is_some_and(|c| c == 'T' || c == 't')
                })
            })
        });
        if stopped {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}
