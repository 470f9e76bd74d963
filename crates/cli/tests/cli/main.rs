//! The `kvroute` binary as a user runs it: exit codes, JSON on stdout, errors on stderr.

// Test helpers panic on failure: that is how a test reports it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod bench;
mod plan;
mod predict;
mod store;

use std::process::{Command, Output};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Tests that keep both cores busy take turns: `verify-predicate` asserts which primitive
/// measured fastest, and a bench's spinning processes beside it on a two-core machine can
/// reverse that (the test harness runs two tests at a time there).
static BUSY: Mutex<()> = Mutex::new(());

fn busy_turn() -> MutexGuard<'static, ()> {
    BUSY.lock().unwrap_or_else(PoisonError::into_inner)
}

fn kvroute(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .output()
        .expect("kvroute runs")
}

fn json(output: &Output) -> serde_json::Value {
    assert!(
        output.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("stdout is one JSON document")
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}
