//! `cargo xtask gpu-test [--require-gpu]`: builds the CLI, the CUDA test binary and the
//! kernels' examples in release mode, then runs `scripts/gpu-test.sh` with them: the device and
//! its kernels' resources, the CUDA tests against the reference and the CPU path, `kvroute
//! bench kernels --backend cuda`, the split planner against every split
//! (`examples/split_sweep.rs`), host-to-host calls against the CPU (`examples/host_to_host.rs`),
//! a holder serving routes from chunks resident on the GPU against a CPU holder (the
//! `route_mem` test `a_gpu_holder_serves_what_a_cpu_holder_serves`), where libfabric loads the
//! demo and `verify-predicate` with holder processes on the GPU, and PyTorch's SDPA on the
//! same bf16 inputs (`scripts/sdpa_compare.py`). Results land in `target/gpu-test`. Without a
//! GPU it says so and succeeds, unless `--require-gpu`.
//!
//! On a GPU machine without a Rust toolchain, build here and run the script there with the
//! binaries (docs/kernels.md has the commands).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::cargo_step;

/// The path of release test binary `test` of `package` (cargo prints it as an artifact
/// message).
fn test_binary(root: &Path, package: &str, test: &str) -> Result<PathBuf> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "test",
            "--release",
            "--locked",
            "-p",
            package,
            "--test",
            test,
            "--no-run",
            "--message-format=json",
        ])
        .current_dir(root)
        .output()
        .with_context(|| format!("building the {test} test binary"))?;
    if !out.status.success() {
        bail!(
            "building the {test} test binary failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let name = format!("\"name\":\"{test}\"");
    text.lines()
        .filter(|l| l.contains("\"reason\":\"compiler-artifact\"") && l.contains(&name))
        .find_map(|l| {
            let at = l.find("\"executable\":\"")? + "\"executable\":\"".len();
            let end = l[at..].find('"')?;
            Some(PathBuf::from(&l[at..at + end]))
        })
        .with_context(|| format!("cargo did not report the {test} test executable"))
}

pub(crate) fn run(root: &Path, require_gpu: bool) -> Result<()> {
    cargo_step(
        "gpu-test build",
        &["build", "--release", "--locked", "-p", "kvroute"],
        &[],
    )?;
    cargo_step(
        "gpu-test examples",
        &[
            "build",
            "--release",
            "--locked",
            "-p",
            "kvroute-kernels",
            "--example",
            "host_to_host",
        ],
        &[],
    )?;
    let tests = test_binary(root, "kvroute-kernels", "cuda")?;
    let route_tests = test_binary(root, "kvroute-remote", "route_mem")?;
    let kvroute = root.join("target").join("release").join("kvroute");
    let probe = Command::new(&kvroute)
        .args(["kernel", "gpu-info"])
        .output()
        .context("running kvroute kernel gpu-info")?;
    if !probe.status.success() {
        let why = String::from_utf8_lossy(&probe.stderr);
        println!("gpu-test: no GPU found here: {}", why.trim());
        if require_gpu {
            bail!("gpu-test: --require-gpu and no GPU");
        }
        println!("gpu-test: nothing run (pass --require-gpu to make this an error)");
        return Ok(());
    }
    let out = root.join("target").join("gpu-test");
    let status = Command::new("bash")
        .arg(root.join("scripts").join("gpu-test.sh"))
        .arg(&kvroute)
        .arg(&tests)
        .arg(&out)
        .arg(root.join("target").join("release").join("examples"))
        .arg(&route_tests)
        .current_dir(root)
        .status()
        .context("running scripts/gpu-test.sh")?;
    if !status.success() {
        bail!("gpu-test failed ({status}); see {}", out.display());
    }
    println!("gpu-test: passed; results in {}", out.display());
    Ok(())
}
