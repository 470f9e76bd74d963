//! Every numeric flag of every subcommand, found through clap's introspection of the command
//! tree, given absurd values on the built binary: each run ends by itself within 10 s with exit
//! 0, 1 or 2 (clap's usage error) and, when it fails, says which flag was wrong; no panic
//! (101), no abort (134 or SIGABRT, e.g. an allocation sized by the flag), no hang. And every
//! range a numeric flag's `--help` line documents is the range its parser accepts.

// Test helpers panic on failure: that is how a test reports it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::any::TypeId;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::CommandFactory;
use kvroute_cli::Cli;

/// What the battery gives every numeric flag: below zero, just past `u32`, `u64::MAX`, not a
/// number, nothing, and a finite float that overflows any physical quantity.
const ABSURD: [&str; 6] = [
    "-1",
    "4294967296",
    "18446744073709551615",
    "NaN",
    "",
    "1e308",
];

/// Values a seed legitimately takes (any `u64`), so seeds are exempt from them.
const LARGE_INTEGERS: [&str; 2] = ["4294967296", "18446744073709551615"];

/// How long one run may take before it counts as a hang.
const HANG: Duration = Duration::from_secs(10);

/// Runs at once: parse errors are quick, and the two cores are shared.
const WORKERS: usize = 4;

/// One numeric flag: the subcommand path it belongs to, its long name, the type its parser
/// produces, its help line, and the required arguments of its subcommand.
#[derive(Debug, Clone)]
struct Flag {
    path: Vec<String>,
    long: String,
    ty: &'static str,
    help: String,
    required: Vec<String>,
}

impl Flag {
    fn is_seed(&self) -> bool {
        self.long == "seed" || self.long.ends_with("-seed")
    }

    fn is_float(&self) -> bool {
        self.ty.starts_with('f')
    }
}

/// The numeric types a value parser may produce, by name.
fn numeric_type(arg: &clap::Arg) -> Option<&'static str> {
    let id = arg.get_value_parser().type_id();
    [
        (TypeId::of::<u8>(), "u8"),
        (TypeId::of::<u16>(), "u16"),
        (TypeId::of::<u32>(), "u32"),
        (TypeId::of::<u64>(), "u64"),
        (TypeId::of::<usize>(), "usize"),
        (TypeId::of::<i8>(), "i8"),
        (TypeId::of::<i16>(), "i16"),
        (TypeId::of::<i32>(), "i32"),
        (TypeId::of::<i64>(), "i64"),
        (TypeId::of::<isize>(), "isize"),
        (TypeId::of::<f32>(), "f32"),
        (TypeId::of::<f64>(), "f64"),
    ]
    .into_iter()
    .find(|(t, _)| id == *t)
    .map(|(_, name)| name)
}

/// Every numeric flag of every subcommand, nested and hidden ones included.
fn numeric_flags() -> Vec<Flag> {
    fn walk(cmd: &clap::Command, path: &mut Vec<String>, out: &mut Vec<Flag>) {
        let required: Vec<String> = cmd
            .get_arguments()
            .filter(|a| a.is_required_set())
            .filter_map(|a| a.get_long().map(str::to_owned))
            .collect();
        for arg in cmd.get_arguments() {
            if let (Some(long), Some(ty)) = (arg.get_long(), numeric_type(arg)) {
                out.push(Flag {
                    path: path.clone(),
                    long: long.to_owned(),
                    ty,
                    help: arg.get_help().map(ToString::to_string).unwrap_or_default(),
                    required: required.clone(),
                });
            }
        }
        for sub in cmd.get_subcommands() {
            path.push(sub.get_name().to_owned());
            walk(sub, path, out);
            path.pop();
        }
    }
    let mut out = Vec::new();
    walk(&Cli::command(), &mut Vec::new(), &mut out);
    out
}

/// Inputs the runs share: a small trace, .npy files for the kernels, a scratch directory.
struct Inputs {
    dir: PathBuf,
    trace: PathBuf,
    q: PathBuf,
    cache: PathBuf,
    positions: PathBuf,
    helix_config: String,
}

impl Inputs {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("kvroute-flag-battery-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let trace = dir.join("trace.jsonl");
        std::fs::write(
            &trace,
            concat!(
                r#"{"timestamp": 0, "input_length": 1500, "output_length": 20, "hash_ids": [0, 1, 2]}"#,
                "\n",
                r#"{"timestamp": 500, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 3]}"#,
                "\n",
            ),
        )
        .unwrap();
        let npy = kvroute_kernels::npy::write_f32;
        let (q, cache, positions) = (
            dir.join("q.npy"),
            dir.join("cache.npy"),
            dir.join("pos.npy"),
        );
        let values = |n: usize| (0..n).map(|i| (i % 7) as f32 * 0.1).collect::<Vec<_>>();
        npy(&q, &[2, 576], &values(2 * 576)).unwrap();
        npy(&cache, &[64, 576], &values(64 * 576)).unwrap();
        kvroute_kernels::npy::write_i64(&positions, &[64], &(0..64).collect::<Vec<_>>()).unwrap();
        let helix_config = serde_json::to_string(&kvroute_helix::HelixConfig {
            layout: kvroute_helix::Layout::new(2, 1, 2, 1).unwrap(),
            shape: kvroute_helix::Shape::deepseek_v3_scaled(false),
            batch: 1,
            ctx: 16,
            stage: 16,
            seed: 1,
            timeout: Duration::from_millis(200),
        })
        .unwrap();
        Self {
            dir,
            trace,
            q,
            cache,
            positions,
            helix_config,
        }
    }

    fn path(p: &Path) -> String {
        p.to_str().unwrap().to_owned()
    }

    /// Valid values for the required arguments of the subcommand `path` (and what a run
    /// needs to end by itself), so that a run whose value is accepted gets past clap's check
    /// of them into the command. `case` names a fresh scratch path per run.
    fn fills(&self, path: &str, case: usize) -> Vec<(&'static str, String)> {
        let scratch = Self::path(&self.dir.join(format!("case-{case}")));
        match path {
            "predict" => vec![("mq", "256".into()), ("ct", "2048".into())],
            "helix rank" => vec![
                ("rank", "0".into()),
                ("config", self.helix_config.clone()),
                ("schedule", "0".into()),
                ("provider", "tcp".into()),
                ("dir", scratch),
            ],
            // With stdin closed, a holder stops as soon as it has started (and a small corpus
            // starts in a second, not in the default's 15 s of an unoptimised build).
            "holder" => vec![
                ("chunks", "0".into()),
                ("lifeline", "stdin".into()),
                ("tokens", "64".into()),
                ("doc-chunks", "1".into()),
            ],
            // Discard's port: nothing listens there, so the connection fails at once.
            "requester" => vec![
                ("holders", "127.0.0.1:9".into()),
                ("tokens", "64".into()),
                ("doc-chunks", "1".into()),
            ],
            "trace replay" => vec![("trace", Self::path(&self.trace))],
            "store write" => vec![
                ("dir", scratch),
                ("chunks", "1".into()),
                ("tokens", "64".into()),
            ],
            "store bench" | "bench kvpath" => vec![("dir", scratch)],
            "model init" => vec![("out", scratch)],
            "kernel partial" => vec![
                ("q", Self::path(&self.q)),
                ("cache", Self::path(&self.cache)),
                ("scale", "0.1".into()),
                ("out", scratch),
            ],
            "kernel splice" => vec![
                ("cache", Self::path(&self.cache)),
                ("from", Self::path(&self.positions)),
                ("to", Self::path(&self.positions)),
                ("theta", "10000".into()),
                (
                    "out",
                    Self::path(&self.dir.join(format!("case-{case}.npy"))),
                ),
            ],
            _ => Vec::new(),
        }
    }
}

/// Flags that clap requires together (`requires`): the partners each needs to be parsed.
fn partners(path: &str, long: &str) -> &'static [&'static str] {
    match (path, long) {
        ("predict", "probe-us") => &["--bw-gbps", "20"],
        ("predict", "bw-gbps") => &["--probe-us", "2"],
        ("predict", "holders") => &["--topk", "64"],
        ("plan prfaas", "threshold") => &["--np", "2"],
        ("plan prfaas", "np") => &["--threshold", "4096"],
        ("plan helix", "hopb-requests") => &["--hopb-attention", "1", "--hopb-comm", "1"],
        ("plan helix", "hopb-attention") => &["--hopb-requests", "4", "--hopb-comm", "1"],
        ("plan helix", "hopb-comm") => &["--hopb-requests", "4", "--hopb-attention", "1"],
        ("kernel splice", "beta-fast" | "beta-slow" | "original-max") => &["--yarn-factor", "40"],
        _ => &[],
    }
}

/// One run of the binary: `kvroute <path> <required> --flag=<value>`, stdin closed, killed
/// (with everything it started) after [`HANG`]. Returns why it failed the battery, if it did.
fn check(inputs: &Inputs, flag: &Flag, value: &str, case: usize) -> Option<String> {
    use std::os::unix::process::{CommandExt, ExitStatusExt};

    let path = flag.path.join(" ");
    let mut args: Vec<String> = flag.path.clone();
    for (long, v) in inputs.fills(&path, case) {
        if long != flag.long {
            args.push(format!("--{long}={v}"));
        }
    }
    args.extend(partners(&path, &flag.long).iter().map(|s| (*s).to_owned()));
    args.push(format!("--{}={value}", flag.long));
    let stderr_path = inputs.dir.join(format!("case-{case}.stderr"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        // Its own process group, so that what it starts dies with it.
        .process_group(0)
        .spawn()
        .expect("kvroute starts");
    let group = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > HANG {
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    // The run if it hangs, and holders or ranks it started if any are left.
    let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
    let timed_out = status.is_none();
    let status = status.unwrap_or_else(|| child.wait().unwrap());
    let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    let shown = format!("kvroute {}", args.join(" "));
    let why = match (status.code(), status.signal()) {
        _ if timed_out => format!("still running after {HANG:?}"),
        (Some(0), _) => return None,
        (Some(code @ (1 | 2)), _) if !stderr.contains(&format!("--{}", flag.long)) => {
            if stderr.contains("required") && stderr.contains("not provided") {
                format!("exit {code} before reaching the flag (the battery misses a partner)")
            } else {
                format!("exit {code} without naming --{}", flag.long)
            }
        }
        (Some(1 | 2), _) => return None,
        (Some(code), _) => format!("exit {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None) => "no exit status".to_owned(),
    };
    let last = stderr.lines().rev().find(|l| !l.trim().is_empty());
    Some(format!("{shown}: {why} ({})", last.unwrap_or("no stderr")))
}

/// Every numeric flag with every value of [`ABSURD`] (seeds: all but [`LARGE_INTEGERS`]).
/// Nothing is skipped: `holder`, the one command that serves until stopped, is run with
/// `--lifeline stdin`, and with stdin closed it stops once it has started.
#[test]
fn no_numeric_flag_panics_aborts_or_hangs_on_an_absurd_value() {
    let flags = numeric_flags();
    // The tree as of writing has about 120 numeric flags over 25 subcommands: finding far
    // fewer means the introspection broke, and the battery would pass without testing.
    assert!(
        flags.len() >= 100,
        "only {} numeric flags found",
        flags.len()
    );
    let cases: Vec<(&Flag, &str)> = flags
        .iter()
        .flat_map(|f| ABSURD.iter().map(move |v| (f, *v)))
        .filter(|(f, v)| !(f.is_seed() && LARGE_INTEGERS.contains(v)))
        .collect();
    let inputs = Inputs::new();
    for flag in &flags {
        let path = flag.path.join(" ");
        let filled: Vec<&str> = inputs.fills(&path, 0).iter().map(|(l, _)| *l).collect();
        for r in &flag.required {
            assert!(
                filled.contains(&r.as_str()),
                "`{path}` needs --{r}: add it to fills"
            );
        }
    }
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..WORKERS {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(flag, value)) = cases.get(i) else {
                        break;
                    };
                    if let Some(why) = check(&inputs, flag, value, i) {
                        failures.lock().unwrap().push(why);
                    }
                }
            });
        }
    });
    let _ = std::fs::remove_dir_all(&inputs.dir);
    println!("{} runs over {} numeric flags", cases.len(), flags.len());
    let mut failures = failures.into_inner().unwrap();
    failures.sort();
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// Whether clap's parser of `flag` accepts `value` (a missing required argument, reported
/// after the values are parsed, means it did).
fn accepts(flag: &Flag, value: &str) -> bool {
    let mut argv = vec!["kvroute".to_owned()];
    argv.extend(flag.path.iter().cloned());
    argv.push(format!("--{}={value}", flag.long));
    match Cli::command().try_get_matches_from(argv) {
        Ok(_) => true,
        Err(e) => !matches!(
            e.kind(),
            clap::error::ErrorKind::InvalidValue | clap::error::ErrorKind::ValueValidation
        ),
    }
}

/// The last `(LOW to HIGH)` or `(...; LOW to HIGH)` of a help line.
fn documented_range(help: &str) -> Option<(String, String)> {
    let mut found = None;
    for (open, _) in help.match_indices('(') {
        let Some(close) = help[open..].find(')') else {
            continue;
        };
        let inner = &help[open + 1..open + close];
        let last = inner.rsplit("; ").next().unwrap_or(inner);
        if let Some((low, high)) = last.split_once(" to ") {
            let number = |s: &str| s.parse::<f64>().is_ok();
            if number(low) && number(high) {
                found = Some((low.to_owned(), high.to_owned()));
            }
        }
    }
    found
}

#[test]
fn every_numeric_flag_documents_the_range_its_parser_accepts() {
    let flags = numeric_flags();
    assert!(
        flags.len() >= 100,
        "only {} numeric flags found",
        flags.len()
    );
    let mut problems = Vec::new();
    for flag in flags.iter().filter(|f| !f.is_seed()) {
        let name = format!("{} --{}", flag.path.join(" "), flag.long);
        let Some((low, high)) = documented_range(&flag.help) else {
            problems.push(format!("{name}: no \"(LOW to HIGH)\" in {:?}", flag.help));
            continue;
        };
        let mut expect = |value: String, accepted: bool| {
            if accepts(flag, &value) != accepted {
                let verb = if accepted { "refuses" } else { "accepts" };
                problems.push(format!(
                    "{name}: documents ({low} to {high}) but {verb} {value}"
                ));
            }
        };
        expect(low.clone(), true);
        expect(high.clone(), true);
        if flag.is_float() {
            let (lo, hi) = (low.parse::<f64>().unwrap(), high.parse::<f64>().unwrap());
            expect(
                format!("{}", if lo > 0.0 { lo / 2.0 } else { lo - 1.0 }),
                false,
            );
            expect(
                format!("{}", if hi > 0.0 { hi * 2.0 } else { hi + 1.0 }),
                false,
            );
        } else {
            let (lo, hi) = (low.parse::<i128>().unwrap(), high.parse::<i128>().unwrap());
            expect((lo - 1).to_string(), false);
            expect((hi + 1).to_string(), false);
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
