//! Releasing an `shm` peer that has not yet read the first thing posted to it (stopped, or
//! slow) must not crash it. libfabric 1.17's `shm` announces a new sender with its first
//! command; a receiver that reads that announcement after the sender's endpoint closed (its
//! region unlinked) dereferences a null region in `smr_progress_connreq` and dies of SIGSEGV.
//! The engine keeps such an endpoint open until the peer's process exits.
//!
//! The peer is this test binary run again as a child (`KVROUTE_SHM_CHILD` set): it opens an
//! engine, prints its region's descriptor and serves for a while. The parent stops it, writes
//! to it, releases it, lets it run again, and checks that it exits cleanly.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

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
    // Its worker keeps polling (and so reading what arrives) while it sleeps.
    std::thread::sleep(Duration::from_secs(2));
    drop(region);
    drop(engine);
}

#[test]
fn a_stopped_peer_survives_being_released_before_it_read_our_first_write() {
    if std::env::var_os(CHILD).is_some() {
        return child();
    }
    let Some(engine) = shm() else {
        kvroute_testkit::skip!("no libfabric shm here");
        return;
    };
    let mut peer = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_stopped_peer_survives_being_released_before_it_read_our_first_write",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, "1")
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
    // SAFETY: signals to our own child, not yet reaped.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let src = engine.alloc_mr(64).unwrap();
    engine
        .submit_single_write(
            64,
            Some(7),
            (src.handle(), 0),
            (&desc, 0),
            OnDone::nothing(),
        )
        .unwrap();
    // Posted (the announcement and the write wait in the stopped child's queue), then released.
    std::thread::sleep(Duration::from_millis(200));
    assert!(engine.disconnect(&desc.net_addr()).unwrap());
    std::thread::sleep(Duration::from_millis(100));
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    let status = peer.wait().unwrap();
    assert!(
        status.success(),
        "the released peer died reading our first write: {status:?}"
    );
    let _ = kvroute_transport::fabric::remove_shm_regions_of_dead_process(peer.id());
}
