//! Releasing an `shm` peer that has not yet read the first thing posted to it (stopped, or
//! slow) must not crash it. libfabric 1.17's `shm` announces a new sender with its first
//! command; a receiver that reads that announcement after the sender's endpoint closed (its
//! region unlinked) dereferences a null region in `smr_progress_connreq` and dies of SIGSEGV.
//! The engine keeps such an endpoint open until the peer's process exits.
//!
//! The peer is this test binary run again as a child (`KVROUTE_SHM_CHILD` set): it opens an
//! engine, prints its region's descriptor and serves until its stdin closes. The parent stops
//! it, writes to it, releases it, lets it run again, closes its stdin, and checks that it
//! exits cleanly.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvroute_transport::{
    EngineConfig, FabricConfig, MrDesc, OnDone, ProviderChoice, TransferEngine,
};

const CHILD: &str = "KVROUTE_SHM_CHILD";

fn shm() -> Option<TransferEngine> {
    let config = FabricConfig {
        required: true,
        ..FabricConfig::provider(ProviderChoice::Shm)
    };
    TransferEngine::fabric(&config, EngineConfig::default())
        .map(|(engine, _)| engine)
        .ok()
}

fn child() {
    let engine = shm().expect("an shm engine in the child");
    let region = engine.alloc_mr(4096).expect("a region");
    println!(
        "{}",
        serde_json::to_string(region.desc()).expect("a descriptor")
    );
    // Its worker keeps polling (and so reading what arrives) until the parent closes our
    // stdin, which it does only after it has stopped, released and resumed us.
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    drop(region);
    drop(engine);
}

/// Starts this binary's test `name` as the child, stops it when `stop_after_first` says, and
/// checks that both sides survive the release: `stop_after_first` false stops the child
/// before it reads anything of ours; true lets it read a first write, then stops it and
/// leaves a large write waiting for its answer when the peer is released (the endpoint then
/// lingers with that operation queued, and its peer's entry must stay mapped under it).
fn released_while_stopped(name: &str, stop_after_first: bool) {
    if std::env::var_os(CHILD).is_some() {
        return child();
    }
    let Some(engine) = shm() else {
        kvroute_testkit::skip!("no libfabric shm here");
        return;
    };
    let mut peer = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut out = BufReader::new(peer.stdout.take().unwrap());
    let desc: MrDesc = loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the child said nothing"
        );
        // The harness prints the test's name before it, on the same line.
        let json = line.find('{').map(|at| line[at..].trim());
        if let Some(desc) = json.and_then(|j| serde_json::from_str(j).ok()) {
            break desc;
        }
    };
    let pid = peer.id() as libc::pid_t;
    let src = engine.alloc_mr(4096).unwrap();
    if stop_after_first {
        let (done, first) = OnDone::future();
        engine
            .submit_single_write(64, Some(7), (src.handle(), 0), (&desc, 0), done)
            .unwrap();
        kvroute_transport::block_on(first).unwrap();
    }
    // SAFETY: signals to our own child, not yet reaped.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let len = if stop_after_first { 4096 } else { 64 };
    engine
        .submit_single_write(
            len,
            Some(7),
            (src.handle(), 0),
            (&desc, 0),
            OnDone::nothing(),
        )
        .unwrap();
    // Posted (waiting in the stopped child's queue), then released; our worker keeps
    // progressing the released peer's endpoint meanwhile.
    std::thread::sleep(Duration::from_millis(200));
    assert!(engine.disconnect(&desc.net_addr()).unwrap());
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    // Running again, it reads the announcement of a sender already released; then it may go.
    std::thread::sleep(Duration::from_millis(300));
    drop(peer.stdin.take());
    let status = wait_at_most(&mut peer, Duration::from_secs(30));
    assert!(
        status.success(),
        "the released peer died reading what we posted: {status:?}"
    );
    let _ = kvroute_transport::fabric::remove_shm_regions_of_dead_process(peer.id());
    // Our side: the lingering endpoint is closed once the child has gone, and the engine
    // still works.
    std::thread::sleep(Duration::from_millis(300));
    let again = engine.alloc_mr(64).unwrap();
    drop(again);
}

/// The child's exit status, or a failure naming the wait if it has not exited within `limit`
/// (it is killed first, so a hung child never hangs the suite).
fn wait_at_most(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the released peer had not exited {limit:?} after it was resumed");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_stopped_peer_survives_being_released_before_it_read_our_first_write() {
    released_while_stopped(
        "a_stopped_peer_survives_being_released_before_it_read_our_first_write",
        false,
    );
}

#[test]
fn releasing_a_stopped_peer_with_a_write_waiting_for_its_answer_crashes_neither_side() {
    released_while_stopped(
        "releasing_a_stopped_peer_with_a_write_waiting_for_its_answer_crashes_neither_side",
        true,
    );
}
