//! The Python package (`crates/python`, its own cargo workspace): `cargo xtask wheel` builds
//! its abi3 wheel with maturin, and `cargo xtask test` checks its formatting and lints, builds
//! the wheel, installs it into a fresh virtualenv with NumPy and runs its pytest suite.
//!
//! Everything lives under `target/py`: the cargo target folder (so this build never waits on
//! the workspace's lock, and the wheel's release artifacts do not evict the debug ones), the
//! virtualenv maturin is installed in (`maturin-venv`), the test virtualenv (made afresh each run) and the
//! wheel itself (`target/py/wheels`). The extension crate is compiled by `clippy-driver`
//! with warnings denied, as `cargo clippy -- -D warnings` would run it, so one build both
//! lints it and produces the wheel (a second, check-only build would cost another minute
//! and a half of the CI's two cores).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

/// The maturin release the wheel is built with (from PyPI, into `target/py/maturin-venv`).
const MATURIN: &str = "maturin==1.16.0";
/// What the tests' virtualenv installs beside the wheel.
const TEST_REQUIREMENTS: &[&str] = &["numpy>=1.22", "pytest>=7"];

fn py_dir(root: &Path) -> PathBuf {
    root.join("target").join("py")
}

fn crate_dir(root: &Path) -> PathBuf {
    root.join("crates").join("python")
}

/// Runs `program args` in `dir`, naming the step; fails with its status.
fn run(step: &str, program: &Path, args: &[&str], dir: &Path, env: &[(&str, &str)]) -> Result<()> {
    println!("xtask {step}: {} {}", program.display(), args.join(" "));
    let started = Instant::now();
    let status = Command::new(program)
        .args(args)
        .envs(env.iter().copied())
        .current_dir(dir)
        .status()
        .with_context(|| format!("starting {} for `{step}`", program.display()))?;
    if !status.success() {
        bail!("step `{step}` failed ({status})");
    }
    println!(
        "xtask {step}: ok in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// A virtualenv at `dir` (made if missing, or afresh with `fresh`) with `packages`
/// installed; returns its python.
fn venv(dir: &Path, packages: &[&str], fresh: bool) -> Result<PathBuf> {
    let python = dir.join("bin").join("python");
    if fresh && dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    if !python.exists() {
        let dir_text = dir.to_string_lossy();
        run(
            "python-venv",
            Path::new("python3"),
            &["-m", "venv", &dir_text],
            Path::new("."),
            &[],
        )
        .context("making a virtualenv (cargo xtask deps installs python3 and python3-venv)")?;
    }
    let mut args = vec![
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
    ];
    args.extend_from_slice(packages);
    run("python-pip", &python, &args, Path::new("."), &[])?;
    Ok(python)
}

/// `cargo xtask wheel`: builds the abi3 wheel into `target/py/wheels` and returns its path.
pub(crate) fn wheel(root: &Path) -> Result<PathBuf> {
    let py = py_dir(root);
    let maturin_python = venv(&py.join("maturin-venv"), &[MATURIN], false)?;
    let maturin = maturin_python.with_file_name("maturin");
    let out = py.join("wheels");
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("removing {}", out.display()))?;
    }
    let target = py.join("target");
    let (target_text, out_text) = (target.to_string_lossy(), out.to_string_lossy());
    let clippy = clippy_driver()?;
    let clippy_text = clippy.to_string_lossy();
    run(
        "wheel",
        &maturin,
        &["build", "--release", "--locked", "--out", &out_text],
        &crate_dir(root),
        &[
            ("CARGO_TARGET_DIR", &target_text),
            ("RUSTC_WORKSPACE_WRAPPER", &clippy_text),
            // What `cargo clippy -- -D warnings` hands clippy-driver.
            (
                "CLIPPY_ARGS",
                "-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__",
            ),
        ],
    )?;
    let wheels: Vec<PathBuf> = std::fs::read_dir(&out)
        .with_context(|| format!("reading {}", out.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    match wheels.as_slice() {
        [one] => {
            println!("xtask wheel: {}", one.display());
            Ok(one.clone())
        }
        other => bail!("maturin left {} wheels in {}", other.len(), out.display()),
    }
}

/// clippy-driver of the toolchain cargo runs with (beside `cargo` and `rustc`).
fn clippy_driver() -> Result<PathBuf> {
    let out = Command::new("rustup")
        .args(["which", "clippy-driver"])
        .output();
    if let Ok(out) = out
        && out.status.success()
    {
        return Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
    }
    let cargo = std::env::var_os("CARGO").map(PathBuf::from);
    let beside = cargo.and_then(|c| c.parent().map(|d| d.join("clippy-driver")));
    match beside {
        Some(p) if p.exists() => Ok(p),
        _ => bail!("clippy-driver not found (rustup component add clippy)"),
    }
}

/// `cargo xtask test`'s Python step: rustfmt on the crate, the wheel (linted as it is
/// built), a fresh virtualenv with the wheel, NumPy and pytest, and the pytest suite.
pub(crate) fn test(root: &Path) -> Result<()> {
    let manifest = crate_dir(root).join("Cargo.toml");
    let manifest_text = manifest.to_string_lossy();
    crate::cargo_step(
        "python-fmt",
        &["fmt", "--manifest-path", &manifest_text, "--check"],
        &[],
    )?;
    let wheel = wheel(root)?;
    let wheel_text = wheel.to_string_lossy();
    let mut packages: Vec<&str> = vec![&wheel_text];
    packages.extend_from_slice(TEST_REQUIREMENTS);
    let python = venv(&py_dir(root).join("test-venv"), &packages, true)?;
    // The tests import the installed wheel, never the source tree.
    let tests = crate_dir(root).join("tests");
    let shm_before = crate::shm_regions();
    run(
        "python-test",
        &python,
        &["-m", "pytest", "-q", "-p", "no:cacheprovider", "."],
        &tests,
        &[("KVROUTE_REQUIRE_SHM", "1")],
    )?;
    // Holder and requester processes over shm leave no region behind.
    crate::shm_left_behind(&shm_before)?;
    // The package documents every public name (what `help(kvroute)` shows).
    run(
        "python-help",
        &python,
        &["-c", "import kvroute, pydoc; pydoc.render_doc(kvroute)"],
        &tests,
        &[],
    )
}
