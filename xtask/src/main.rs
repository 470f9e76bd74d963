//! `cargo xtask`: the project's automation, written in Rust so it runs wherever cargo does.
//!
//! - `deps [--check]`: check (and as root, install) the system packages the crates need, and
//!   unpack the pinned NVRTC wheel into `target/nvrtc` (the CUDA compile test's compiler).
//! - `test`: what CI runs: deps, rustfmt, the perf page against its data, clippy with warnings
//!   denied, every test, rustdoc with warnings denied; it ends by counting and naming each
//!   test that skipped on this machine (recorded through `crates/testkit`), grouped by reason.
//! - `loom`: the loom models of the transport's completion logic (each with a broken variant
//!   it must catch), built with `--cfg kvroute_loom` in a target folder of their own.
//! - `demo [ARGS]`: build and run the main job in release mode.
//! - `bench [ARGS]`: run the criterion benches (ARGS go to criterion, e.g. a name filter).
//! - `gpu-test [--require-gpu]`: the CUDA kernels against the reference and the CPU path, their
//!   benchmarks, and PyTorch's SDPA on the same inputs, on a machine with a GPU.
//! - `fuzz [--seconds N] [TARGET...]`: the libFuzzer targets of `fuzz/` (every parser of
//!   untrusted bytes), N seconds each; `test` runs each for 10 s.
//! - `soak [--minutes N]`: holders over shm and tcp under requesters that come and go,
//!   misbehave, are killed or stopped (`crates/remote/examples/soak.rs`); `test` runs 1 minute.
//! - `wheel`: build the Python package's abi3 wheel (`crates/python`, maturin) into
//!   `target/py/wheels`; `test` also installs it into a fresh virtualenv and runs its pytest
//!   suite.
//! - `api [--bless]`: the public API of each library crate, one item per line from rustdoc's
//!   JSON, against the baseline committed in `api/` (`--bless` rewrites it); `test` checks it.
//! - `package`: `cargo package` of every crate meant for crates.io, which checks that each
//!   builds alone from the files it would publish; `test` runs it.
//! - `perf [--check]`: render docs/perf.md from `docs/perf/figures.json` and the recorded bench
//!   runs in `docs/perf/runs/` (`--check`: fail where the page differs); `perf --record FILE
//!   ...` stores a bench's `--json` report as a component's last run; `test` checks the page.
//! - `bindgen`: regenerate the checked-in libfabric bindings from the installed headers.

mod api;
mod bindgen;
mod deps;
mod fuzz;
mod gpu_test;
mod nvrtc;
mod perf;
mod python;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::{Context, Result, bail};

const USAGE: &str = "usage: cargo xtask <command>

commands:
  deps [--check]  check the system packages the workspace needs; install missing ones as root;
                  unpack the pinned NVRTC wheel into target/nvrtc (CUDA compile test)
  test            what CI runs: deps, fmt --check, perf --check, clippy -D warnings, the
                  public-API check, tests, loom, 10 s of each fuzz target, a 1-minute soak,
                  docs -D warnings, cargo package
  loom            the loom models of the transport's completion logic
  demo [ARGS]     build in release mode and run the main job (ARGS are passed to it)
  bench [ARGS]    run the criterion benches (ARGS are passed to criterion)
  gpu-test [--require-gpu]
                  CUDA kernels vs reference, CPU and PyTorch SDPA, and their benchmarks, on a
                  GPU; without one, says so (and fails only with --require-gpu)
  fuzz [--seconds N] [TARGET...]
                  build the libFuzzer targets in fuzz/ and run each for N s (default 10)
  soak [--minutes N]
                  holders over shm and tcp under requesters that come, go, misbehave, are killed
                  or stopped, for N minutes (default 1): exact routes, no hang, flat holders,
                  clean /dev/shm
  etcd [--members N] [-- COMMAND...]
                  a throwaway etcd cluster of N members (default 1) on free loopback ports: runs
                  COMMAND with KVROUTE_ETCD=etcd://... set and stops etcd after; without a
                  command, prints the address and serves until stdin closes
  api [--bless]   check each library crate's public API against its baseline in api/ (one
                  item per line, from rustdoc JSON); --bless rewrites the baselines
  perf [--check]  render docs/perf.md from docs/perf/figures.json and docs/perf/runs/;
                  --check fails, naming the first differing line, where the page differs
  perf --record FILE --component NAME --machine NAME --command CMD
                  store a bench's --json report (FILE) as the component's last recorded run,
                  then render the page
  package         cargo package (with its build check) of every crate meant for crates.io
  wheel           build the Python package's abi3 wheel (crates/python, maturin from PyPI in
                  target/py) into target/py/wheels
  bindgen         regenerate the libfabric bindings (installs libfabric-dev, libclang-dev as root)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("xtask: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &[String]) -> Result<()> {
    let (command, rest) = args
        .split_first()
        .map_or(("help", &[][..]), |(c, r)| (c.as_str(), r));
    match command {
        "deps" => {
            let check = rest.iter().any(|a| a == "--check");
            deps::run(check)?;
            nvrtc::ensure(&workspace_root(), check)
        }
        "gpu-test" => gpu_test::run(&workspace_root(), rest.iter().any(|a| a == "--require-gpu")),
        "test" | "ci" => test(),
        "loom" => loom(),
        "api" => api::run(&workspace_root(), rest),
        "package" => package(),
        "perf" => perf::run(&workspace_root(), rest),
        "fuzz" => fuzz::run(&workspace_root(), rest),
        "soak" => {
            deps::run(false)?;
            soak(rest, true)
        }
        "demo" => {
            // The demo runs over libfabric: a fresh machine gets it from `deps` first.
            deps::run(false)?;
            cargo_step(
                "demo",
                &with_rest(
                    &[
                        "run",
                        "--release",
                        "--locked",
                        "-p",
                        "kvroute",
                        "--",
                        "demo",
                    ],
                    rest,
                ),
                &[],
            )
        }
        "bench" => cargo_step(
            "bench",
            &with_rest(&["bench", "--workspace", "--locked", "--"], rest),
            &[],
        ),
        "etcd" => {
            deps::run(false)?;
            etcd(rest)
        }
        "wheel" => {
            deps::run(false)?;
            python::wheel(&workspace_root()).map(drop)
        }
        "bindgen" => bindgen::run(&workspace_root()),
        "bindgen-generate" => bindgen::generate(&workspace_root()),
        "help" | "-h" | "--help" => {
            println!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown command `{other}`\n\n{USAGE}"),
    }
}

/// `cargo xtask etcd`.
fn etcd(args: &[String]) -> Result<()> {
    let (ours, command) = match args.iter().position(|a| a == "--") {
        Some(i) => (&args[..i], &args[i + 1..]),
        None => (args, &[][..]),
    };
    let members = match ours {
        [] => 1,
        [flag, n] if flag == "--members" => n
            .parse()
            .with_context(|| format!("--members {n:?} is not a number"))?,
        other => bail!("etcd: unexpected arguments {other:?}\n\n{USAGE}"),
    };
    let cluster = kvroute_testkit::etcd::EtcdCluster::start(members)
        .context("starting etcd (cargo xtask deps installs etcd-server)")?;
    let url = cluster.url();
    println!(
        "xtask etcd: {members} member(s) at {url} (data in {})",
        cluster.dir().display()
    );
    let Some((program, rest)) = command.split_first() else {
        println!("xtask etcd: serving until stdin closes");
        let mut sink = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink)?;
        return Ok(());
    };
    let status = Command::new(program)
        .args(rest)
        .env("KVROUTE_ETCD", &url)
        .status()
        .with_context(|| format!("running {program}"))?;
    drop(cluster);
    if !status.success() {
        bail!("{program} failed: {status}");
    }
    Ok(())
}

fn with_rest<'a>(base: &[&'a str], rest: &'a [String]) -> Vec<&'a str> {
    base.iter()
        .copied()
        .chain(rest.iter().map(String::as_str))
        .collect()
}

/// CI: every gate in order, stopping at the first failure, with each step's time.
fn test() -> Result<()> {
    let started = Instant::now();
    let root = workspace_root();
    deps::run(false)?;
    nvrtc::ensure(&root, false)?;
    cargo_step("fmt", &["fmt", "--all", "--check"], &[])?;
    perf::check(&root)?;
    cargo_step(
        "clippy",
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--locked",
            "--",
            "-D",
            "warnings",
        ],
        &[],
    )?;
    api::run(&root, &[])?;
    // NVRTC from target/nvrtc, and the sm_90 compile test required (it fails, not skips,
    // if NVRTC cannot be loaded).
    let library_path = nvrtc::library_path(&root);
    // Tests that cannot run on this machine append themselves here (crates/testkit).
    let skip_log = root.join("target").join("xtask-skips.tsv");
    match std::fs::remove_file(&skip_log) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("removing {}", skip_log.display()));
        }
        _ => {}
    }
    let skip_log_env = skip_log.to_string_lossy().into_owned();
    let shm_before = shm_regions();
    cargo_step(
        "test",
        &["test", "--workspace", "--locked"],
        &[
            ("LD_LIBRARY_PATH", &library_path),
            ("KVROUTE_REQUIRE_NVRTC", "1"),
            ("KVROUTE_SKIP_LOG", &skip_log_env),
        ],
    )?;
    shm_left_behind(&shm_before)?;
    library_alone()?;
    python::test(&root)?;
    loom()?;
    fuzz::run(&root, &["--seconds".to_owned(), "10".to_owned()])?;
    cargo_step(
        "doc",
        &["doc", "--workspace", "--no-deps", "--locked"],
        &[("RUSTDOCFLAGS", "-D warnings")],
    )?;
    package()?;
    let skips = match std::fs::read_to_string(&skip_log) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", skip_log.display())),
    };
    let (count, summary) = skip_summary(&skips);
    print!("{summary}");
    println!(
        "xtask test: all steps passed in {:.0} s; {count} test{} skipped on this machine{}",
        started.elapsed().as_secs_f64(),
        if count == 1 { "" } else { "s" },
        if count == 0 { "" } else { " (named above)" },
    );
    Ok(())
}

/// The skips `crates/testkit` recorded (lines `test<TAB>reason`), grouped by reason: how many
/// distinct tests skipped, and a listing naming each under its reason.
fn skip_summary(log: &str) -> (usize, String) {
    use std::collections::{BTreeMap, BTreeSet};
    use std::fmt::Write as _;
    let mut by_reason: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    let mut tests = BTreeSet::new();
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let (test, why) = line.split_once('\t').unwrap_or((line, "no reason given"));
        by_reason.entry(why).or_default().insert(test);
        tests.insert(test);
    }
    let mut out = String::new();
    for (why, names) in &by_reason {
        let _ = writeln!(out, "xtask skipped ({why}): {} test(s)", names.len());
        for name in names {
            let _ = writeln!(out, "    {name}");
        }
    }
    (tests.len(), out)
}

/// `kvroute-remote` as an adopter gets it: its normal dependencies hold none of the binary's
/// (argument parsing, plots, progress bars, `anyhow`), its tests pass built alone (no feature
/// the workspace's other members turn on), and its examples run: holder and requester over
/// the `mem` domain and `shm`, and from async code under tokio, each output checked.
/// The names in `/dev/shm` of libfabric shm regions (`<pid>:<n>:<n>`), with their pid.
fn shm_regions() -> Vec<(String, u32)> {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let name = e.ok()?.file_name().into_string().ok()?;
        let mut parts = name.split(':');
        let pid = parts.next()?.parse().ok()?;
        let rest: Vec<&str> = parts.collect();
        (rest.len() == 2 && rest.iter().all(|p| p.parse::<u32>().is_ok())).then_some((name, pid))
    })
    .collect()
}

/// Fails, naming them, if the test step left shm regions of processes that have exited
/// (each is 16 MiB of `/dev/shm` until someone removes it); removes them first, so that one
/// failed run does not leak into the next.
fn shm_left_behind(before: &[(String, u32)]) -> Result<()> {
    let left: Vec<String> = shm_regions()
        .into_iter()
        .filter(|(name, pid)| {
            !before.iter().any(|(b, _)| b == name) && !Path::new(&format!("/proc/{pid}")).exists()
        })
        .map(|(name, _)| name)
        .collect();
    if left.is_empty() {
        return Ok(());
    }
    for name in &left {
        let _ = std::fs::remove_file(Path::new("/dev/shm").join(name));
    }
    bail!(
        "the tests left shm regions of exited processes in /dev/shm (removed now): {}",
        left.join(", ")
    )
}

fn library_alone() -> Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let tree = Command::new(&cargo)
        .args([
            "tree",
            "--locked",
            "-p",
            "kvroute-remote",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .current_dir(workspace_root())
        .output()
        .context("starting cargo tree")?;
    if !tree.status.success() {
        bail!("cargo tree -p kvroute-remote failed");
    }
    let text = String::from_utf8_lossy(&tree.stdout);
    for banned in ["clap", "anyhow", "plotters", "indicatif"] {
        if text
            .lines()
            .any(|l| l.split_whitespace().next() == Some(banned))
        {
            bail!("kvroute-remote depends on {banned}:\n{text}");
        }
    }
    println!("xtask remote-deps: no clap, anyhow, plotters or indicatif");
    cargo_step(
        "remote-alone",
        &["test", "--locked", "-p", "kvroute-remote"],
        &[],
    )?;
    for example in ["route_step", "route_async"] {
        cargo_step(
            example,
            &[
                "run",
                "--locked",
                "-p",
                "kvroute-remote",
                "--example",
                example,
            ],
            &[],
        )?;
    }
    // 300 requester processes one after another against one shm holder, each partial
    // checked, the holder's memory, fds and /dev/shm flat after 100 (shm's table of peers
    // holds 256: a holder that kept its requesters' endpoints refused the 129th, one that
    // kept their senders' the 256th); then 300 engines of one requester process, one after
    // another: the holder closes each one's endpoint when its region goes, and keeps at most
    // 8 for a live process meanwhile (it used to keep every one until the process exited,
    // and refused the 229th).
    for (name, extra) in [
        ("holder_churn", None),
        ("holder_churn (one process)", Some("--one-process")),
    ] {
        let mut args = vec![
            "run",
            "--locked",
            "-p",
            "kvroute-remote",
            "--example",
            "holder_churn",
            "--",
            "shm",
            "300",
        ];
        args.extend(extra);
        cargo_step(name, &args, &[])?;
    }
    soak(&["--minutes".to_owned(), "1".to_owned()], false)
}

/// `cargo package` of every crate meant for crates.io (the workspace less `publish = false`
/// members), with its verification build: each crate must build from exactly the files it
/// would publish, against its dependencies as published (the workspace's own as packaged).
fn package() -> Result<()> {
    forget_unpacked_packages()?;
    cargo_step(
        "package",
        &[
            "package",
            "--locked",
            "--workspace",
            "--exclude",
            "xtask",
            "--exclude",
            "kvroute-tests",
            "--exclude",
            "kvroute-testkit",
            // What is checked is the tree as it is, committed or not.
            "--allow-dirty",
        ],
        &[],
    )
}

/// Removes what an earlier `cargo package` unpacked of this workspace's crates.
///
/// Its verification builds each crate against the others as packaged: their tarballs are
/// unpacked into `$CARGO_HOME/registry/src/<overlay>/<name>-<version>`, and cargo does not
/// unpack a crate again where that directory is left from an earlier run (of another tree
/// with the same versions). An earlier tree's sources would then be built in place of this
/// one's, and a crate using something new in another would fail to verify.
fn forget_unpacked_packages() -> Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(&cargo)
        .args(["metadata", "--no-deps", "--format-version", "1", "--locked"])
        .current_dir(workspace_root())
        .output()
        .context("starting cargo metadata")?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let meta: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("reading cargo metadata's output")?;
    let ours: Vec<String> = meta["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| {
            Some(format!(
                "{}-{}",
                p["name"].as_str()?,
                p["version"].as_str()?
            ))
        })
        .collect();
    let home = match std::env::var_os("CARGO_HOME") {
        Some(home) => PathBuf::from(home),
        None => {
            PathBuf::from(std::env::var_os("HOME").context("neither CARGO_HOME nor HOME is set")?)
                .join(".cargo")
        }
    };
    let src = home.join("registry").join("src");
    let Ok(registries) = std::fs::read_dir(&src) else {
        return Ok(());
    };
    for registry in registries.flatten() {
        for name in &ours {
            let unpacked = registry.path().join(name);
            if unpacked.is_dir() {
                std::fs::remove_dir_all(&unpacked)
                    .with_context(|| format!("removing {}", unpacked.display()))?;
            }
        }
    }
    Ok(())
}

/// `soak [--minutes N]`: the holders-and-requesters soak (crates/remote/examples/soak.rs) for
/// N minutes (default 1), in release mode for a long run.
fn soak(rest: &[String], release: bool) -> Result<()> {
    let minutes = match rest {
        [] => "1",
        [flag, n] if flag == "--minutes" => n.as_str(),
        _ => bail!("usage: cargo xtask soak [--minutes N]"),
    };
    let minutes_ok = minutes.parse::<f64>().is_ok_and(|m| m > 0.0);
    if !minutes_ok {
        bail!("--minutes takes a positive number, not {minutes:?}");
    }
    let mut args = vec!["run", "--locked"];
    if release {
        args.push("--release");
    }
    args.extend([
        "-p",
        "kvroute-remote",
        "--example",
        "soak",
        "--",
        "--minutes",
        minutes,
    ]);
    cargo_step("soak", &args, &[])
}

/// The loom models, in release mode (loom explores thousands of interleavings) and in their
/// own target folder, since `--cfg kvroute_loom` would otherwise invalidate the normal build.
fn loom() -> Result<()> {
    let target = workspace_root().join("target").join("loom");
    let target = target.to_string_lossy();
    cargo_step(
        "loom",
        &[
            "test",
            "--locked",
            "--release",
            "-p",
            "kvroute-transport",
            "--lib",
            "--target-dir",
            &target,
            "loom_models",
        ],
        &[("RUSTFLAGS", "--cfg kvroute_loom")],
    )
}

pub(crate) fn cargo_step(name: &str, args: &[&str], env: &[(&str, &str)]) -> Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    println!("xtask {name}: cargo {}", args.join(" "));
    let started = Instant::now();
    let status = Command::new(&cargo)
        .args(args)
        .envs(env.iter().copied())
        .current_dir(workspace_root())
        .status()
        .with_context(|| format!("starting cargo for `{name}`"))?;
    if !status.success() {
        bail!("step `{name}` failed ({status})");
    }
    println!(
        "xtask {name}: ok in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

pub(crate) fn workspace_root() -> PathBuf {
    let xtask_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    xtask_dir.parent().unwrap_or(xtask_dir).to_path_buf()
}

#[cfg(test)]
mod tests {
    use super::skip_summary;

    #[test]
    fn skips_are_counted_once_per_test_and_named_under_their_reason() {
        let log = "k: a\tno AVX-512\nk: b\tno AVX-512\nk: a\tno AVX-512 BF16\nt: c\tno GPU\n\n";
        let (count, text) = skip_summary(log);
        assert_eq!(count, 3, "{text}");
        assert_eq!(
            text,
            "xtask skipped (no AVX-512): 2 test(s)\n    k: a\n    k: b\n\
             xtask skipped (no AVX-512 BF16): 1 test(s)\n    k: a\n\
             xtask skipped (no GPU): 1 test(s)\n    t: c\n"
        );
        assert_eq!(skip_summary(""), (0, String::new()));
    }
}
