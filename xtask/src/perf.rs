//! `cargo xtask perf`: docs/perf.md, rendered from recorded data.
//!
//! `docs/perf/figures.json` holds the current figure of every component (one record a row:
//! measure, figure, same-run baseline, target, machine, the history entry behind it and, where
//! known, the command that measures it) and the machines' legend; `docs/perf/runs/` holds the
//! JSON reports of bench runs recorded with `--record`. The page is a function of those files
//! alone: one section per component, in the order the records first name it, each with its
//! rows and its last recorded run. `--check` renders into memory and fails, naming the first
//! differing line, when the page on disk is not what the data renders (`cargo xtask test` runs
//! it).

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use figures::{components, load_runs, parse_figures};
use render::render;

mod figures;
mod render;
mod report;

/// The page, relative to the workspace root.
const PAGE: &str = "docs/perf.md";
/// The records it is rendered from.
const FIGURES: &str = "docs/perf/figures.json";
/// Recorded bench runs, one JSON file each.
const RUNS: &str = "docs/perf/runs";
/// The page is meant to be read in one sitting; past this many lines `perf` says so.
const PAGE_LINES_MAX: usize = 300;

/// The usage of `cargo xtask perf`.
const USAGE: &str = "usage: cargo xtask perf [--check]
       cargo xtask perf --record FILE --component NAME --machine NAME --command CMD";

/// `cargo xtask perf [--check | --record ...]`.
pub(crate) fn run(root: &Path, args: &[String]) -> Result<()> {
    let mut check_only = false;
    let (mut file, mut component, mut machine, mut command) = (None, None, None, None);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let slot = match arg.as_str() {
            "--check" => {
                check_only = true;
                continue;
            }
            "--record" => &mut file,
            "--component" => &mut component,
            "--machine" => &mut machine,
            "--command" => &mut command,
            other => bail!("perf: unexpected argument `{other}`\n{USAGE}"),
        };
        *slot = Some(
            it.next()
                .with_context(|| format!("{arg} needs a value\n{USAGE}"))?,
        );
    }
    if check_only {
        if file.is_some() {
            bail!("perf: --check does not record\n{USAGE}");
        }
        return check(root);
    }
    match (file, component, machine, command) {
        (None, None, None, None) => {}
        (Some(file), Some(component), Some(machine), Some(command)) => {
            let stored = record(root, Path::new(file), component, machine, command)?;
            println!("xtask perf: recorded {stored}");
        }
        _ => bail!("perf: --record needs --component, --machine and --command\n{USAGE}"),
    }
    let page = render_workspace(root)?;
    std::fs::write(root.join(PAGE), &page).with_context(|| format!("writing {PAGE}"))?;
    let lines = page.lines().count();
    println!("xtask perf: wrote {PAGE} ({lines} lines)");
    if lines > PAGE_LINES_MAX {
        println!("xtask perf: {PAGE} is past {PAGE_LINES_MAX} lines; move detail to docs/history/");
    }
    Ok(())
}

/// Fails, naming the first differing line, when docs/perf.md is not what its data renders.
pub(crate) fn check(root: &Path) -> Result<()> {
    let rendered = render_workspace(root)?;
    let on_disk =
        std::fs::read_to_string(root.join(PAGE)).with_context(|| format!("reading {PAGE}"))?;
    if let Some((line, disk, want)) = first_difference(&on_disk, &rendered) {
        bail!(
            "{PAGE} is not what {FIGURES} and {RUNS}/ render (run `cargo xtask perf`); first \
             difference at line {line}:\n  {PAGE}: {disk}\n  rendered: {want}"
        );
    }
    println!("xtask perf: {PAGE} matches {FIGURES} and {RUNS}/");
    Ok(())
}

/// The 1-based number of the first line where `disk` and `rendered` differ, with each side's
/// line (`<end of file>` past its end); `None` when they are equal.
fn first_difference<'a>(disk: &'a str, rendered: &'a str) -> Option<(usize, &'a str, &'a str)> {
    if disk == rendered {
        return None;
    }
    let (mut a, mut b) = (disk.split('\n'), rendered.split('\n'));
    for line in 1.. {
        match (a.next(), b.next()) {
            (Some(x), Some(y)) if x == y => {}
            (x, y) => {
                return Some((
                    line,
                    x.unwrap_or("<end of file>"),
                    y.unwrap_or("<end of file>"),
                ));
            }
        }
    }
    None
}

/// The page from the workspace's figures and runs.
fn render_workspace(root: &Path) -> Result<String> {
    let text = std::fs::read_to_string(root.join(FIGURES))
        .with_context(|| format!("reading {FIGURES}"))?;
    let figures = parse_figures(&text).with_context(|| format!("in {FIGURES}"))?;
    let runs = load_runs(&root.join(RUNS))?;
    render(&figures, &runs)
}

/// Stores the bench report in `file` as the newest run of `component` and returns its path.
fn record(
    root: &Path,
    file: &Path,
    component: &str,
    machine: &str,
    command: &str,
) -> Result<String> {
    let text = std::fs::read_to_string(root.join(FIGURES))
        .with_context(|| format!("reading {FIGURES}"))?;
    let figures = parse_figures(&text).with_context(|| format!("in {FIGURES}"))?;
    if !figures.figures.iter().any(|f| f.component == component) {
        let names: Vec<&str> = components(&figures.figures)
            .into_iter()
            .map(|(c, _)| c)
            .collect();
        bail!("no rows name the component {component:?}; one of {names:?}");
    }
    if !figures.machines.iter().any(|m| m.name == machine) {
        let names: Vec<&str> = figures.machines.iter().map(|m| m.name.as_str()).collect();
        bail!("{machine:?} is not in the legend {names:?} (add it to {FIGURES} first)");
    }
    let report_text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let report: Value = serde_json::from_str(&report_text)
        .with_context(|| format!("{} is not JSON", file.display()))?;
    if !report.is_object() {
        bail!(
            "{} holds no JSON object (a bench's `--json` report is one)",
            file.display()
        );
    }
    let dir = root.join(RUNS);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {RUNS}"))?;
    let next = load_runs(&dir)?
        .iter()
        .filter_map(|r| r.file.split('-').next()?.parse::<u32>().ok())
        .max()
        .map_or(1, |n| n + 1);
    let name = format!("{next:04}-{}.json", slug(component));
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .context("the clock is before 1970")?
        .as_secs();
    let stored = serde_json::json!({
        "component": component,
        "machine": machine,
        "command": command,
        "recorded": utc_date(secs),
        "report": report,
    });
    let mut out = serde_json::to_string_pretty(&stored)?;
    out.push('\n');
    std::fs::write(dir.join(&name), out).with_context(|| format!("writing {RUNS}/{name}"))?;
    Ok(format!("{RUNS}/{name}"))
}

/// A component's name as a file name: lower case, runs of anything else than a letter or a
/// digit as one `-`.
fn slug(component: &str) -> String {
    let mut out = String::new();
    for c in component.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.is_empty() && !out.ends_with('-') {
            out.push('-');
        }
    }
    out.trim_end_matches('-').to_owned()
}

/// `YYYY-MM-DD` of `secs` since the Unix epoch, in UTC (the proleptic Gregorian calendar,
/// from the days-to-civil algorithm of Howard Hinnant's "chrono-Compatible Low-Level Date
/// Algorithms").
fn utc_date(secs: u64) -> String {
    let z = (secs / 86_400) as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_difference_names_the_line_and_both_sides() {
        assert_eq!(first_difference("a\nb\n", "a\nb\n"), None);
        assert_eq!(first_difference("a\nb\nc", "a\nB\nc"), Some((2, "b", "B")));
        assert_eq!(first_difference("a\n", "a\nb\n"), Some((2, "", "b")));
        assert_eq!(
            first_difference("a", "a\nb"),
            Some((2, "<end of file>", "b"))
        );
    }

    #[test]
    fn dates_and_slugs() {
        assert_eq!(utc_date(0), "1970-01-01");
        assert_eq!(utc_date(1_700_000_000), "2023-11-14");
        assert_eq!(utc_date(951_782_400), "2000-02-29");
        assert_eq!(slug("transport, `mem`"), "transport-mem");
        assert_eq!(
            slug("kernels, CPU (AVX2 forced)"),
            "kernels-cpu-avx2-forced"
        );
    }
}
