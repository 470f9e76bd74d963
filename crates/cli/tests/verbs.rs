//! Every command that takes `--provider verbs`, on a machine without an RDMA device (or
//! without libibverbs): exit status 1 and a message naming what is missing, never a panic.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

#[test]
fn verbs_without_a_device_exits_1_naming_what_is_missing() {
    let commands: [&[&str]; 8] = [
        &["demo"],
        &["generate"],
        &["holder", "--chunks", "0", "--lifeline", "stdin"],
        &["requester", "--holders", "127.0.0.1:1"],
        &["bench", "fabric"],
        &["bench", "kvpath", "--dir", "/nonexistent"],
        &["helix", "run", "--ranks", "2"],
        &["verify-predicate"],
    ];
    for args in commands {
        let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(args)
            .args(["--provider", "verbs"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(stderr.contains("verbs:"), "{args:?}: {stderr}");
        assert!(
            stderr.contains("libibverbs")
                || stderr.contains("no RDMA device")
                || stderr.contains("not built"),
            "{args:?}: {stderr}"
        );
    }
}
