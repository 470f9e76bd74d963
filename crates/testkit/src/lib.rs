//! A test that cannot run on this machine (no AVX-512, no GPU, an EFA NIC where a missing one
//! is tested) must not pass silently: [`skip!`] prints why and, when `cargo xtask test` set
//! [`SKIP_LOG`], appends one line naming the test and the reason to that file. The xtask reads
//! the file after the test steps and prints every skip, counted and named, in its summary.
//!
//! The test's name is the name of the thread libtest runs it on (`module::path::test_name`),
//! prefixed with the package's name; a test run on the main thread (`--test-threads 1`, or a
//! harness of its own) passes its name explicitly with [`record`].

pub mod etcd;

use std::fs::OpenOptions;
use std::io::Write;
use std::path::Path;

/// The environment variable naming the file skips are appended to.
pub const SKIP_LOG: &str = "KVROUTE_SKIP_LOG";

/// Records the calling test as skipped for the reason given (a `format!` string), and returns
/// nothing: the caller returns right after.
///
/// ```
/// fn needs_a_gpu() -> bool { false }
/// if !needs_a_gpu() {
///     kvroute_testkit::skip!("no GPU on this machine");
/// }
/// ```
#[macro_export]
macro_rules! skip {
    ($($why:tt)+) => {
        $crate::record(
            &$crate::test_name(env!("CARGO_PKG_NAME"), module_path!()),
            &format!($($why)+),
        )
    };
}

/// `package: thread name`, or `package: module` when the thread has no test's name.
pub fn test_name(package: &str, module: &str) -> String {
    match std::thread::current().name() {
        Some(name) if name != "main" => format!("{package}: {name}"),
        _ => format!("{package}: {module}"),
    }
}

/// Prints `SKIPPED <test>: <why>` to stderr and appends the line `<test>\t<why>` to the file
/// [`SKIP_LOG`] names, if set. A failure to write the log panics: a skip that cannot be
/// recorded would pass silently, which is what this crate exists to prevent.
pub fn record(test: &str, why: &str) {
    eprintln!("SKIPPED {test}: {why}");
    if let Some(path) = std::env::var_os(SKIP_LOG)
        && let Err(e) = append(Path::new(&path), test, why)
    {
        panic!(
            "cannot record the skip of {test} in {}: {e}",
            path.to_string_lossy()
        );
    }
}

/// Appends one record to `path`. Tabs and newlines in either field become spaces, so a record
/// is always one line with one tab; the line is written with one `write` to a file opened for
/// appending, so records of tests running at once never interleave.
pub fn append(path: &Path, test: &str, why: &str) -> std::io::Result<()> {
    let clean = |s: &str| s.replace(['\t', '\n', '\r'], " ");
    let line = format!("{}\t{}\n", clean(test), clean(why));
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?
        .write_all(line.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_is_one_line_naming_the_test_and_the_reason() {
        let dir = std::env::temp_dir().join(format!("kvroute-testkit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let log = dir.join("skips");
        let _ = std::fs::remove_file(&log);
        let name = test_name("kvroute-testkit", module_path!());
        assert!(
            name.ends_with("a_skip_is_one_line_naming_the_test_and_the_reason"),
            "{name}"
        );
        append(&log, &name, "no\tAVX-512\non this CPU").unwrap_or_else(|e| panic!("{e}"));
        append(&log, "second", "why").unwrap_or_else(|e| panic!("{e}"));
        let text = std::fs::read_to_string(&log).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            text,
            format!("{name}\tno AVX-512 on this CPU\nsecond\twhy\n")
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
