//! `kvroute helix run` with ranks as processes over libfabric's shm: every layout family of
//! 2, 4 and 8 ranks matches the single-rank layer (with shards that start empty and fill in
//! stages), and a rank SIGKILLed mid-run fails every other rank within its timeout.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn helix(args: &[&str]) -> (bool, serde_json::Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["--json", "helix", "run", "--provider", "shm"])
        .args(["--batch", "2", "--ctx", "40", "--steps", "3"])
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .expect("running kvroute helix run");
    let report = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{args:?}: not a report ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    (out.status.success(), report)
}

#[test]
fn rank_processes_over_shm_match_the_single_rank_layer() {
    let runs: [&[&str]; 6] = [
        &["--ranks", "2"],
        &[
            "--ranks", "2", "--model", "gqa", "--tpa", "2", "--moe", "--ep", "2",
        ],
        &["--ranks", "4", "--moe", "--tpf", "2", "--ep", "2"],
        &["--ranks", "4", "--model", "gqa", "--tpa", "2"],
        &["--ranks", "8"],
        &[
            "--ranks", "8", "--model", "gqa", "--tpa", "2", "--moe", "--ep", "2",
        ],
    ];
    for args in runs {
        let (ok, report) = helix(args);
        let checks = report["checks"].as_array().unwrap();
        let ranks: usize = args[1].parse().unwrap();
        assert!(ok && report["passed"] == true, "{args:?}: {report:#}");
        assert_eq!(checks.len(), ranks * 3, "{args:?}");
        for c in checks {
            assert!(
                c["passed"] == true
                    && c["max_abs"].as_f64().unwrap() <= c["tolerance"].as_f64().unwrap()
            );
        }
        // Without --hopb both settings ran and were measured.
        let exposed = &report["exposed_comm_us"];
        assert!(
            exposed["hopb_off"].is_number() && exposed["hopb_on"].is_number(),
            "{exposed}"
        );
    }
}

#[test]
fn a_killed_rank_fails_every_other_rank_within_the_timeout() {
    let dir = std::env::temp_dir().join(format!("kvroute-helix-kill-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let timeout = Duration::from_millis(1500);
    let child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args([
            "--json",
            "helix",
            "run",
            "--provider",
            "shm",
            "--ranks",
            "4",
        ])
        // The most steps allowed: a run of many seconds, still going when the rank dies.
        .args(["--batch", "2", "--ctx", "64", "--steps", "500"])
        .args(["--timeout-ms", &timeout.as_millis().to_string()])
        .arg("--dir")
        .arg(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("starting kvroute helix run");
    // Rank 2's pid, once every rank has published (and so is past start-up).
    let started = Instant::now();
    let pid = loop {
        let pids: Vec<u64> = (0..4)
            .filter_map(|r| std::fs::read(dir.join(format!("rank-{r}.json"))).ok())
            .filter_map(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .filter_map(|v| v["pid"].as_u64())
            .collect();
        if pids.len() == 4 {
            break pids[2];
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the ranks never met"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    std::thread::sleep(Duration::from_millis(500));
    let killed = Instant::now();
    let status = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = child.wait_with_output().unwrap();
    let took = killed.elapsed();
    assert!(!out.status.success(), "the run must fail");
    assert!(took < timeout * 3 + Duration::from_secs(5), "took {took:?}");
    // The report, then the exit's `{"error": ...}`.
    let report: serde_json::Value = serde_json::Deserializer::from_slice(&out.stdout)
        .into_iter()
        .next()
        .unwrap()
        .unwrap();
    let errors: Vec<&str> = report["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    assert_eq!(errors.len(), 4, "every rank failed: {errors:#?}");
    assert!(
        errors
            .iter()
            .any(|e| e.starts_with("rank 2: exited with signal: 9")),
        "{errors:#?}"
    );
    assert!(
        errors
            .iter()
            .filter(|e| !e.starts_with("rank 2"))
            .all(|e| e.contains("rank")),
        "{errors:#?}"
    );
    assert!(
        errors.iter().any(|e| e.contains("nothing from ranks [2]")
            || e.contains("writes to ranks [2] not")
            || e.contains("to rank 2 failed")),
        "a survivor names rank 2: {errors:#?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
