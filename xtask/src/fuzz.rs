//! `cargo xtask fuzz [--seconds N] [TARGET...]`: builds the libFuzzer targets in `fuzz/` with
//! coverage instrumentation (the flags cargo-fuzz passes, on the stable toolchain: no
//! sanitizer, but debug assertions and overflow checks on) and runs each for N seconds
//! (default 10), keeping its corpus in `target/fuzz-corpus/TARGET` between runs. A crash or
//! panic fails the run and leaves the input in `target/fuzz-artifacts/TARGET/`; reproduce it
//! with `target/fuzz/<host>/release/TARGET <that file>`.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Every target in `fuzz/Cargo.toml`.
pub(crate) const TARGETS: [&str; 8] = [
    "wire_request",
    "wire_reply",
    "control_json",
    "npy",
    "trace_line",
    "block_header",
    "directory_entry",
    "verbs_handshake",
];

/// What cargo-fuzz passes to instrument for libFuzzer (`-Zsanitizer` aside, which needs a
/// nightly compiler).
const COVERAGE: &str = "-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
     -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
     -Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares \
     --cfg fuzzing -Cdebug-assertions -Coverflow-checks";

pub(crate) fn run(root: &Path, args: &[String]) -> Result<()> {
    let mut seconds = 10u64;
    let mut targets = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" => {
                seconds = it
                    .next()
                    .context("--seconds needs a value")?
                    .parse()
                    .context("--seconds")?;
            }
            t if TARGETS.contains(&t) => targets.push(t),
            other => bail!("unknown fuzz argument `{other}` (targets: {TARGETS:?})"),
        }
    }
    if targets.is_empty() {
        targets = TARGETS.to_vec();
    }
    let host = host_triple()?;
    let target_dir = root.join("target").join("fuzz");
    crate::cargo_step(
        "fuzz-build",
        &[
            "build",
            "--release",
            "--locked",
            "--manifest-path",
            &root.join("fuzz").join("Cargo.toml").to_string_lossy(),
            "--target",
            &host,
            "--target-dir",
            &target_dir.to_string_lossy(),
        ],
        &[("RUSTFLAGS", COVERAGE)],
    )?;
    let mut total = 0u64;
    for t in targets {
        let corpus = root.join("target").join("fuzz-corpus").join(t);
        let artifacts = root.join("target").join("fuzz-artifacts").join(t);
        std::fs::create_dir_all(&corpus).context("creating the corpus folder")?;
        std::fs::create_dir_all(&artifacts).context("creating the artifacts folder")?;
        let binary = target_dir.join(&host).join("release").join(t);
        let out = Command::new(&binary)
            .arg(format!("-max_total_time={seconds}"))
            .arg(format!("-artifact_prefix={}/", artifacts.display()))
            .arg("-print_final_stats=1")
            .arg(&corpus)
            .output()
            .with_context(|| format!("starting {}", binary.display()))?;
        let log = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            bail!(
                "fuzz target {t} failed ({}); its input is in {}:\n{}",
                out.status,
                artifacts.display(),
                tail.join("\n")
            );
        }
        let runs = executions(&log).with_context(|| format!("no run count from {t}"))?;
        total += runs;
        println!("xtask fuzz {t}: {runs} executions in {seconds} s, no crash");
    }
    println!("xtask fuzz: {total} executions in all, no crash");
    Ok(())
}

/// The executions libFuzzer reports at the end (`Done N runs in S second(s)`).
fn executions(log: &str) -> Option<u64> {
    log.lines().rev().find_map(|l| {
        l.strip_prefix("Done ")?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    })
}

/// The compiler's host triple: instrumenting only the target (not build scripts or proc
/// macros, which would then need libFuzzer's symbols) takes an explicit `--target`.
fn host_triple() -> Result<String> {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let out = Command::new(rustc)
        .arg("-vV")
        .output()
        .context("running rustc -vV")?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .context("no host triple in rustc -vV")
}

#[cfg(test)]
mod tests {
    use super::executions;

    #[test]
    fn the_run_count_is_read_from_libfuzzers_last_line() {
        let log = "#1369292\tDONE   cov: 218 ft: 552\nDone 1369292 runs in 15 second(s)\n";
        assert_eq!(executions(log), Some(1_369_292));
        assert_eq!(executions("INFO: Seed: 1\n"), None);
    }
}
