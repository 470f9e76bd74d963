//! Holders and a requester that find each other in a real etcd (skipped, and counted as
//! skipped, where no etcd binary is installed; `cargo xtask deps` installs one): holder
//! processes register, a requester discovers them and routes, a fourth holder joins
//! mid-run, a holder is SIGKILLed and its lease expires, etcd restarts, and every output
//! stays checked.

#![allow(clippy::expect_used)]

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvroute_testkit::etcd::{EtcdCluster, etcd_available};

/// The lease TTL the holders register with, seconds.
const TTL: u64 = 3;
/// A run longer than this is hung.
const HANG: Duration = Duration::from_secs(240);
const CORPUS: [&str; 4] = ["--tokens", "256", "--doc-chunks", "3"];

struct HolderProc {
    child: Child,
    addr: String,
}

impl Drop for HolderProc {
    fn drop(&mut self) {
        // Its stdin closes with it: a clean stop.
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `kvroute holder` of `chunks`, registered in `url`; returns once it printed its
/// address (it registers before printing).
fn holder(url: &str, chunks: &str, replica: u32) -> HolderProc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["holder", "--provider", "shm", "--lifeline", "stdin"])
        .args(CORPUS)
        .args(["--chunks", chunks, "--directory", url])
        .args(["--directory-ttl", &TTL.to_string()])
        .args(["--replica", &replica.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("starting a holder");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped stdout"))
        .read_line(&mut line)
        .expect("reading the holder's address");
    let v: serde_json::Value =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("holder said {line:?}: {e}"));
    let addr = v["listen"].as_str().expect("an address").to_owned();
    HolderProc { child, addr }
}

/// Milliseconds since the Unix epoch.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Text a child writes to stderr, collected as it comes.
fn collect(mut r: impl Read + Send + 'static) -> Arc<Mutex<String>> {
    let text = Arc::new(Mutex::new(String::new()));
    let out = text.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = r.read(&mut buf) {
            if n == 0 {
                break;
            }
            out.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    text
}

/// Waits until `text` contains every one of `needles`; panics after `limit`.
fn wait_for(text: &Mutex<String>, needles: &[&str], limit: Duration) -> Duration {
    let started = Instant::now();
    loop {
        {
            let t = text.lock().unwrap_or_else(|p| p.into_inner());
            if needles.iter().all(|n| t.contains(n)) {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < limit,
                "{needles:?} not seen within {limit:?}:\n{t}"
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A raw put through etcd's JSON gateway (`/v3/kv/put`, keys and values base64): contents no
/// kvroute process would write.
/// A `--json` run's report and its text, after checking that it exited 0 and passed.
fn passed_report(out: &std::process::Output) -> (serde_json::Value, String) {
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_str(&text).expect("the report");
    assert_eq!(json["passed"], true, "{text}");
    (json, text)
}

fn list(url: &str) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["--json", "directory", "list", "--directory", url])
        .output()
        .expect("running kvroute directory list");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("directory list --json")
}

#[test]
fn holders_join_die_and_etcd_restarts_under_a_running_requester() {
    if !etcd_available() {
        kvroute_testkit::skip!("no etcd binary (cargo xtask deps installs etcd-server)");
        return;
    }
    let mut etcd = EtcdCluster::start(1).expect("starting etcd");
    let url = etcd.url();
    // Contents no holder wrote: skipped by every reader, named in the listing.
    etcd.put_raw("/kvroute/v1/holders/garbage", b"{not json")
        .expect("planting garbage");
    etcd.put_raw("/kvroute/v1/holders/10.0.0.1:1", b"{\"schema\":99}")
        .expect("planting a record of another schema");

    let mut h: Vec<HolderProc> = (0..3).map(|c| holder(&url, &c.to_string(), 0)).collect();
    three_holders_and_two_skipped_are_listed(&url);

    let req = RunningRequester::start(&url);
    wait_for(&req.log, &["selector calibrated"], Duration::from_secs(120));

    // A fourth holder joins with a second copy of chunk 1.
    let h3 = holder(&url, "1", 1);
    wait_for(
        &req.log,
        &[&format!("({}) joined", h3.addr)],
        Duration::from_secs(30),
    );

    // The first copy of chunk 1 dies without a word: its lease runs out within the TTL.
    let mut victim = h.remove(1);
    let killed_unix_ms = kill_and_see_it_unregistered(&url, &mut victim);
    // And the requester sees it go.
    let gone = format!("({}): registration gone", victim.addr);
    wait_for(&req.log, &[&gone], Duration::from_secs(30));

    // etcd restarts (same data): the requester keeps its last view meanwhile and says so.
    etcd.kill(0);
    wait_for(
        &req.log,
        &["directory unreachable"],
        Duration::from_secs(15),
    );
    std::thread::sleep(Duration::from_millis(500));
    etcd.restart(0).expect("restarting etcd");
    wait_for(
        &req.log,
        &["directory reachable again"],
        Duration::from_secs(30),
    );

    let (json, text) = req.passed_report();
    let checks = json["checks"].as_array().map_or(0, Vec::len);
    assert_eq!(checks, 61 * 3, "every step checked: {text}");
    // Every holder was used; the dead one stopped being used, the late one took its chunk.
    each_holder_was_used_until_it_died(
        &json["directory"],
        &h3.addr,
        &victim.addr,
        killed_unix_ms,
        &h,
    );
    // The holders kept their registrations through the restart.
    let after = list(&url);
    assert_eq!(
        after["holders"].as_object().map(|o| o.len()),
        Some(3),
        "{after}"
    );
    drop((h, victim, h3));
}

/// The directory at `url` lists three holders, each with a lease of at most the TTL left,
/// and skips the two records no holder wrote.
fn three_holders_and_two_skipped_are_listed(url: &str) {
    let listed = list(url);
    assert_eq!(
        listed["holders"].as_object().map(|o| o.len()),
        Some(3),
        "{listed}"
    );
    assert_eq!(
        listed["skipped"].as_array().map(Vec::len),
        Some(2),
        "{listed}"
    );
    for holder in listed["holders"]
        .as_object()
        .into_iter()
        .flat_map(|o| o.values())
    {
        let ttl = holder["ttl_left_ms"].as_u64().unwrap_or(0);
        assert!((1..=TTL * 1000).contains(&ttl), "{holder}");
    }
}

/// A `kvroute requester` following the directory over 60 paced steps, its report and its log
/// collected as they come.
struct RunningRequester {
    child: Child,
    /// Its stdout, read to the end.
    stdout: std::thread::JoinHandle<String>,
    /// Its stderr (the log) so far.
    log: Arc<Mutex<String>>,
}

impl RunningRequester {
    /// Starts the requester on the directory at `url`.
    fn start(url: &str) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["--json", "requester", "--provider", "shm"])
            .args(CORPUS)
            .args(["--directory", url, "--directory-ttl", &TTL.to_string()])
            // One request a step: three checked layers each.
            .args([
                "--steps",
                "60",
                "--batch",
                "1",
                "--pause-ms",
                "400",
                "--force",
                "route",
            ])
            .env("RUST_LOG", "kvroute_cli=info,kvroute_remote::step=info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting the requester");
        let stdout = {
            let mut r = child.stdout.take().expect("piped stdout");
            std::thread::spawn(move || {
                let mut text = String::new();
                let _ = r.read_to_string(&mut text);
                text
            })
        };
        let log = collect(child.stderr.take().expect("piped stderr"));
        Self { child, stdout, log }
    }

    /// Waits for the requester to exit (at most `HANG`): its report, which must say that
    /// every check passed, and the report's text.
    fn passed_report(mut self) -> (serde_json::Value, String) {
        let started = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("waiting for the requester") {
                break status;
            }
            assert!(started.elapsed() < HANG, "the requester hung");
            std::thread::sleep(Duration::from_millis(50));
        };
        let text = self.stdout.join().unwrap_or_default();
        let log = self.log.lock().map(|t| t.clone()).unwrap_or_default();
        assert!(status.success(), "requester failed:\n{text}\n{log}");
        let json: serde_json::Value = serde_json::from_str(&text).expect("the report");
        assert_eq!(json["passed"], true, "{text}");
        (json, text)
    }
}

/// Kills `victim` without a word and waits for the directory at `url` to stop offering it,
/// which it must within the TTL after its last renewal (plus etcd's expiry pass and one
/// listing): when it was killed, Unix milliseconds.
fn kill_and_see_it_unregistered(url: &str, victim: &mut HolderProc) -> u64 {
    let killed = Instant::now();
    let killed_unix_ms = unix_ms();
    victim.child.kill().expect("killing holder 1");
    let _ = victim.child.wait();
    let _ = kvroute_transport::fabric::remove_shm_regions_of_dead_process(victim.child.id());
    loop {
        let now = list(url);
        if !now["holders"]
            .as_object()
            .is_some_and(|o| o.contains_key(&victim.addr))
        {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(TTL + 10),
            "the dead holder is still registered: {now}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let expired_after = killed.elapsed();
    assert!(
        expired_after <= Duration::from_millis(TTL * 1000 + 1500),
        "the dead holder stayed registered {expired_after:?}"
    );
    killed_unix_ms
}

/// The requester's directory report `dir`: the late holder (`late`) served, the dead one
/// (`dead`, killed at `killed_unix_ms`) was dropped within the TTL and unregistered, the
/// `others` served throughout, and the two foreign records were skipped.
fn each_holder_was_used_until_it_died(
    dir: &serde_json::Value,
    late: &str,
    dead: &str,
    killed_unix_ms: u64,
    others: &[HolderProc],
) {
    let holders = dir["holders"].as_array().cloned().unwrap_or_default();
    assert_eq!(holders.len(), 4, "{dir}");
    let by_addr = |a: &str| {
        holders
            .iter()
            .find(|u| u["addr"] == a)
            .cloned()
            .unwrap_or_else(|| panic!("{a} not in {dir}"))
    };
    let late = by_addr(late);
    assert!(late["served"].as_u64().unwrap_or(0) > 0, "{late}");
    let dead = by_addr(dead);
    // Not chosen from the step after the kill (its control connection closed), well within
    // the TTL.
    let dropped_at = dead["dropped"][0].as_u64().unwrap_or(u64::MAX);
    assert!(
        dropped_at.saturating_sub(killed_unix_ms) <= TTL * 1000,
        "{dead} (killed at {killed_unix_ms})"
    );
    assert!(!dead["unregistered_unix_ms"].is_null(), "{dead}");
    assert_eq!(dir["skipped"].as_array().map(Vec::len), Some(2), "{dir}");
    for other in others {
        let used = by_addr(&other.addr);
        assert!(used["dropped"].is_null(), "{used}");
        assert!(used["served"].as_u64().unwrap_or(0) > 0, "{used}");
    }
}

#[test]
fn the_demo_finds_its_holders_in_etcd() {
    if !etcd_available() {
        kvroute_testkit::skip!("no etcd binary (cargo xtask deps installs etcd-server)");
        return;
    }
    let etcd = EtcdCluster::start(1).expect("starting etcd");
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "--json",
            "demo",
            "--attention-checks",
            "--provider",
            "shm",
            "--tokens",
            "256",
        ])
        .args(["--holders", "2", "--steps", "1", "--directory", &etcd.url()])
        // Chosen by the calibrated selector, a loaded machine's dense steps can all be
        // local; forced, every chunk goes to its holder.
        .args(["--force", "route"])
        .output()
        .expect("running the demo");
    let (json, text) = passed_report(&out);
    let holders = json["directory"]["holders"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(holders.len(), 2, "{text}");
    assert!(
        holders
            .iter()
            .all(|h| h["served"].as_u64().unwrap_or(0) > 0),
        "{text}"
    );
    // The demo's holders left the directory when it stopped them.
    let after = list(&etcd.url());
    assert_eq!(
        after["holders"].as_object().map(|o| o.len()),
        Some(0),
        "{after}"
    );
}

#[test]
fn the_generation_finds_its_holders_in_etcd() {
    if !etcd_available() {
        kvroute_testkit::skip!("no etcd binary (cargo xtask deps installs etcd-server)");
        return;
    }
    let etcd = EtcdCluster::start(1).expect("starting etcd");
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["--json", "generate", "--provider", "shm", "--tokens", "128"])
        .args([
            "--holders",
            "2",
            "--new-tokens",
            "3",
            "--directory",
            &etcd.url(),
        ])
        .args(["--force", "route"])
        .output()
        .expect("running the generation");
    let (json, text) = passed_report(&out);
    for r in json["requests"].as_array().cloned().unwrap_or_default() {
        assert_eq!(r["tokens"], r["reference_tokens"], "{text}");
    }
    // Both holders were found through the directory and routed to.
    let holders = json["directory"]["holders"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(holders.len(), 2, "{text}");
    assert!(
        holders
            .iter()
            .all(|h| h["served"].as_u64().unwrap_or(0) > 0),
        "{text}"
    );
    let after = list(&etcd.url());
    assert_eq!(
        after["holders"].as_object().map(|o| o.len()),
        Some(0),
        "{after}"
    );
}

/// The step times of a `kvroute requester` run over the directory at `url`: 16 steps, a
/// request each, every chunk routed.
fn requester_step_ms(url: &str) -> Vec<f64> {
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["--json", "requester", "--provider", "shm"])
        .args(CORPUS)
        .args(["--directory", url, "--directory-ttl", &TTL.to_string()])
        .args(["--steps", "16", "--batch", "1", "--pause-ms", "300"])
        .args(["--force", "route", "--timeout-ms", "2000"])
        .output()
        .expect("running the requester");
    let (json, _) = passed_report(&out);
    json["step_ms"]
        .as_array()
        .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
        .unwrap_or_default()
}

/// The workspace's one median ([`kvroute_costmodel::fit::median`]); NaN for no values.
fn median(v: &[f64]) -> f64 {
    kvroute_costmodel::fit::median(&mut v.to_vec()).unwrap_or(f64::NAN)
}

/// A requester following a directory that also holds 16 records naming an honest holder's
/// control address with another engine (ids that sort first), 4 junk values of 1.4 MB
/// (together past the etcd client's 4 MiB answer limit) and 3 records whose control address
/// accepts connections and never answers, re-registered every 400 ms so that views keep
/// coming, routes every step, and no step takes more than twice the slowest step of a run
/// over the same holders with a clean directory (nor their median more than twice the
/// clean median). The records whose holders never answer are tried on threads of their
/// own, never in a step: tried in turn inside steps, each view that came after their
/// backoff cost a step the welcome's wait of each (2 s here).
#[test]
fn hostile_directory_records_cost_no_step_more_than_twice_a_clean_run() {
    use kvroute_kvstore::directory::{self as directory_api, HolderRecord, SCHEMA};
    if !etcd_available() {
        kvroute_testkit::skip!("no etcd binary (cargo xtask deps installs etcd-server)");
        return;
    }
    let etcd = EtcdCluster::start(1).expect("starting etcd");
    let url = etcd.url();
    let h: Vec<HolderProc> = (0..3).map(|c| holder(&url, &c.to_string(), 0)).collect();
    let clean = requester_step_ms(&url);

    let dir = directory_api::open(&url, Duration::from_secs(TTL)).expect("opening etcd");
    let view = dir
        .watch()
        .expect("watching etcd")
        .wait_newer(0, Duration::from_secs(10))
        .expect("a first view")
        .view;
    let records: Vec<HolderRecord> = view.holders.values().map(|v| v.record.clone()).collect();
    assert_eq!(records.len(), 3, "{:?}", view.holders.keys());
    let honest = records[0].clone();
    let elsewhere = records[1].engine.clone();
    let mut regs = Vec::new();
    for i in 0..16 {
        let poisoned = HolderRecord {
            schema: SCHEMA,
            id: format!("0-poisoned-{i:02}"),
            engine: elsewhere.clone(),
            ..honest.clone()
        };
        regs.push(dir.register(poisoned, Vec::new()).expect("registering"));
    }
    let junk = vec![b'x'; 1_400_000];
    for i in 0..4 {
        etcd.put_raw(&format!("/kvroute/v1/holders/junk-{i}"), &junk)
            .expect("planting junk");
    }
    let silent: Vec<std::net::TcpListener> = (0..3)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("binding"))
        .collect();
    let silent_record = |i: usize| HolderRecord {
        schema: SCHEMA,
        id: format!("1-silent-{i}"),
        control: silent[i].local_addr().expect("an address"),
        engine: elsewhere.clone(),
        ..honest.clone()
    };
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = {
        let (dir, stop) = (dir.clone(), stop.clone());
        let records: Vec<HolderRecord> = (0..3).map(silent_record).collect();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                held.clear();
                for r in &records {
                    held.push(dir.register(r.clone(), Vec::new()).expect("registering"));
                }
                std::thread::sleep(Duration::from_millis(400));
            }
        })
    };
    let hostile = requester_step_ms(&url);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    churn.join().expect("the churn thread");
    let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    eprintln!(
        "step ms, clean: median {:.1} max {:.1}; hostile: median {:.1} max {:.1}",
        median(&clean),
        max(&clean),
        median(&hostile),
        max(&hostile)
    );
    assert_eq!(hostile.len(), clean.len());
    assert!(
        max(&hostile) <= 2.0 * max(&clean),
        "hostile {hostile:?}\nclean {clean:?}"
    );
    assert!(
        median(&hostile) <= 2.0 * median(&clean),
        "hostile {hostile:?}\nclean {clean:?}"
    );
    drop((regs, silent, h));
}
