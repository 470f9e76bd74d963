//! Crash safety of the storage tier, proven by killing a writer: a child process (this test
//! binary run again with `KVROUTE_CRASH_CHILD` set) writes full blocks into a store, replacing
//! old ones as it goes, and is killed with SIGKILL at a random moment; then the store is opened
//! (recovery) and every block must be either whole and checksum-valid, with exactly the bytes
//! written, or reported missing. Never torn. At least 80 kills, and more (up to 400) until 8
//! have landed mid-payload and one between records (counted from what the kill left on disk,
//! and required): where a kill lands depends on the machine's speed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use kvroute_kvstore::BlockLayout;
use kvroute_kvstore::storage::{BlockStore, StorageError};
use kvroute_kvstore::trace::synthetic;

const CHILD: &str = "KVROUTE_CRASH_CHILD";
const KILLS: u64 = 80;
const MAX_KILLS: u64 = 400;
/// Kills that must land mid-payload.
const MID_PAYLOAD: u64 = 8;
const KEYS: u64 = 24;

fn layout() -> BlockLayout {
    BlockLayout::new(2, 512).unwrap()
}

/// Writes blocks until killed: keys cycle through `KEYS` so published blocks get replaced,
/// each put in 4 KiB pieces (so a kill can land inside the payload), a short pause between
/// puts (so it can land between records). Odd rounds skip the fsyncs, so more of the time goes
/// to writing the payload (a process kill loses nothing the kernel already has; the fsyncs are
/// what a power loss needs).
fn child(dir: &Path, round: u64) {
    let (mut store, _) = BlockStore::open(dir, layout()).unwrap();
    store.set_write_piece(4 << 10);
    store.set_durable(round.is_multiple_of(2));
    let mut block = vec![0u8; layout().full_bytes()];
    println!("\nready");
    for j in 0.. {
        let key = (round * 7 + j) % KEYS;
        synthetic(key, &mut block);
        store.put(key, &block).unwrap();
        std::thread::sleep(Duration::from_micros(300));
    }
}

/// What a kill left: the size of the unfinished temporary file, if any.
fn leftover(dir: &Path) -> Option<u64> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .find(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .map(|e| e.metadata().unwrap().len())
}

fn tmpdir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-crash-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn a_killed_writer_never_leaves_a_torn_block() {
    if let Some(spec) = std::env::var_os(CHILD) {
        let spec = spec.to_string_lossy().into_owned();
        let (dir, round) = spec.rsplit_once(':').unwrap();
        return child(Path::new(dir), round.parse().unwrap());
    }
    let dir = tmpdir();
    let full = (kvroute_kvstore::storage::HEADER_BYTES + layout().full_bytes()) as u64;
    let (mut header_only, mut mid_payload, mut unpublished, mut boundary) = (0, 0, 0, 0);
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut expected = vec![0u8; layout().full_bytes()];
    let mut got = vec![0u8; layout().full_bytes()];
    let mut served = 0;
    let mut kills = 0;
    for round in 0..MAX_KILLS {
        if round >= KILLS && mid_payload >= MID_PAYLOAD && boundary >= 1 {
            break;
        }
        kills += 1;
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "a_killed_writer_never_leaves_a_torn_block",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, format!("{}:{round}", dir.display()))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        while !line.contains("ready") {
            line.clear();
            assert!(
                out.read_line(&mut line).unwrap() > 0,
                "the child exited before writing"
            );
        }
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        std::thread::sleep(Duration::from_micros(500 + seed % 15_000));
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        child.wait().unwrap();
        match leftover(&dir) {
            Some(len) if len < 4096 => header_only += 1,
            Some(len) if len < full => mid_payload += 1,
            Some(_) => unpublished += 1,
            None => boundary += 1,
        }
        // Recovery, then every block is whole and exactly what was written, or missing.
        let (mut store, recovery) = BlockStore::open(&dir, layout()).unwrap();
        assert!(
            recovery.refused.is_empty(),
            "round {round}: {:?}",
            recovery.refused
        );
        assert!(
            leftover(&dir).is_none(),
            "recovery removes unfinished writes"
        );
        for key in 0..KEYS {
            match store.get_into(key, &mut got) {
                Ok(()) => {
                    synthetic(key, &mut expected);
                    assert!(
                        got == expected,
                        "round {round}: block {key} read back different bytes"
                    );
                    served += 1;
                }
                Err(StorageError::Missing { .. }) => {}
                Err(e) => panic!("round {round}: block {key}: {e}"),
            }
        }
        let verify = store.verify().unwrap();
        assert!(
            verify.corrupt.is_empty(),
            "round {round}: {:?}",
            verify.corrupt
        );
    }
    eprintln!(
        "{kills} kills: {header_only} in the header, {mid_payload} mid-payload, {unpublished} written but not yet published, {boundary} between records; {served} blocks served whole"
    );
    assert!(
        mid_payload >= MID_PAYLOAD,
        "only {mid_payload} of {kills} kills landed mid-payload"
    );
    assert!(boundary >= 1, "no kill landed between records");
    assert!(served > 0);
    let _ = std::fs::remove_dir_all(&dir);
}
