//! The records docs/perf.md is rendered from: `docs/perf/figures.json` (the rows and the
//! machines' legend) and the bench runs of `docs/perf/runs/`, parsed into typed values and
//! checked for what would render wrong. Unknown fields are refused, so a misspelt one does not
//! vanish from the page unnoticed.

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::{Map, Value};

use super::RUNS;

/// One row of the current figures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Figure {
    /// The component whose section holds the row.
    pub(super) component: String,
    /// What was measured.
    pub(super) measure: String,
    /// The figure itself.
    pub(super) figure: String,
    /// What it was measured against in the same run.
    pub(super) baseline: String,
    /// The target and whether it is met.
    pub(super) target: String,
    /// The machine (or machines) of the legend it ran on.
    pub(super) machine: String,
    /// The history entry with the full table and the method ("same": the row above's).
    pub(super) history: String,
    /// The command that measures it, where one does.
    pub(super) command: Option<String>,
}

/// A machine of the legend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Machine {
    /// The short name rows use.
    pub(super) name: String,
    /// What it is.
    pub(super) description: String,
}

/// `docs/perf/figures.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Figures {
    /// The page's title.
    pub(super) title: String,
    /// Markdown lines after the generated notice ("" for a paragraph break).
    pub(super) intro: Vec<String>,
    /// The legend, in its order.
    pub(super) machines: Vec<Machine>,
    /// A line after the legend (what every CPU machine shares).
    pub(super) machines_note: String,
    /// Every row.
    pub(super) figures: Vec<Figure>,
}

/// A bench's JSON report, recorded for a component.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Run {
    /// Its file name in `docs/perf/runs/`.
    pub(super) file: String,
    /// The component whose section shows it.
    pub(super) component: String,
    /// The legend's name of the machine it ran on.
    pub(super) machine: String,
    /// The command that printed the report.
    pub(super) command: String,
    /// The UTC date it was recorded, `YYYY-MM-DD`.
    pub(super) recorded: String,
    /// The report as the bench printed it.
    pub(super) report: Value,
}

/// The string at `key` of `obj` (`what` names `obj` in errors).
fn string_at(obj: &Map<String, Value>, key: &str, what: &str) -> Result<String> {
    match obj.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => bail!("{what}: `{key}` is not a string"),
        None => bail!("{what}: `{key}` is missing"),
    }
}

/// Fails on a key of `obj` outside `known` (a misspelt field would otherwise vanish).
fn only(obj: &Map<String, Value>, known: &[&str], what: &str) -> Result<()> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => bail!("{what}: unknown field `{k}` (fields: {known:?})"),
        None => Ok(()),
    }
}

/// The array at `key` of `obj`.
fn array<'a>(obj: &'a Map<String, Value>, key: &str, what: &str) -> Result<&'a Vec<Value>> {
    obj.get(key)
        .and_then(Value::as_array)
        .with_context(|| format!("{what}: `{key}` is not an array"))
}

/// Parses and checks `docs/perf/figures.json`.
pub(super) fn parse_figures(text: &str) -> Result<Figures> {
    let doc: Value = serde_json::from_str(text)?;
    let top = doc.as_object().context("not a JSON object")?;
    only(
        top,
        &["title", "intro", "machines", "machines_note", "figures"],
        "the file",
    )?;
    let intro = array(top, "intro", "the file")?
        .iter()
        .map(|l| {
            l.as_str()
                .map(str::to_owned)
                .context("`intro` holds a non-string")
        })
        .collect::<Result<_>>()?;
    let mut machines = Vec::new();
    for (i, m) in array(top, "machines", "the file")?.iter().enumerate() {
        let what = format!("machines[{i}]");
        let m = m
            .as_object()
            .with_context(|| format!("{what} is not an object"))?;
        only(m, &["name", "description"], &what)?;
        machines.push(Machine {
            name: string_at(m, "name", &what)?,
            description: string_at(m, "description", &what)?,
        });
    }
    let mut figures = Vec::new();
    for (i, f) in array(top, "figures", "the file")?.iter().enumerate() {
        let what = format!("figures[{i}]");
        let f = f
            .as_object()
            .with_context(|| format!("{what} is not an object"))?;
        let cells = [
            "component",
            "measure",
            "figure",
            "baseline",
            "target",
            "machine",
            "history",
        ];
        only(f, &[&cells[..], &["command"]].concat(), &what)?;
        let [
            component,
            measure,
            figure,
            baseline,
            target,
            machine,
            history,
        ] = cells.map(|key| string_at(f, key, &what));
        let command = match f.get("command") {
            None => None,
            Some(Value::String(c)) => Some(c.clone()),
            Some(_) => bail!("{what}: `command` is not a string"),
        };
        figures.push(Figure {
            component: component?,
            measure: measure?,
            figure: figure?,
            baseline: baseline?,
            target: target?,
            machine: machine?,
            history: history?,
            command,
        });
    }
    let figures = Figures {
        title: string_at(top, "title", "the file")?,
        intro,
        machines,
        machines_note: string_at(top, "machines_note", "the file")?,
        figures,
    };
    validate(&figures)?;
    Ok(figures)
}

/// What a table would silently get wrong: a cell with a bare `|` or a line break, a machine
/// outside the legend, a "same" history with no row above it in its section.
fn validate(figures: &Figures) -> Result<()> {
    for (component, rows) in components(&figures.figures) {
        for (n, f) in rows.iter().enumerate() {
            let what = format!("the row of {component:?} measuring {:?}", f.measure);
            let cells = [
                &f.measure,
                &f.figure,
                &f.baseline,
                &f.target,
                &f.machine,
                &f.history,
            ];
            for cell in cells {
                if cell.contains('\n') || cell.replace("\\|", "").contains('|') {
                    bail!("{what}: a cell holds a line break or an unescaped `|`: {cell:?}");
                }
            }
            if !figures
                .machines
                .iter()
                .any(|m| f.machine.contains(m.name.as_str()))
            {
                bail!(
                    "{what}: machine {:?} names no machine of the legend",
                    f.machine
                );
            }
            if n == 0
                && f.history
                    .split(';')
                    .next()
                    .is_some_and(|h| h.trim() == "same")
            {
                bail!("{what}: history \"same\" is the first row of its section, with none above");
            }
        }
    }
    Ok(())
}

/// The rows grouped by component, components in the order the rows first name them.
pub(super) fn components(figures: &[Figure]) -> Vec<(&str, Vec<&Figure>)> {
    let mut out: Vec<(&str, Vec<&Figure>)> = Vec::new();
    for f in figures {
        match out.iter_mut().find(|(c, _)| *c == f.component) {
            Some((_, rows)) => rows.push(f),
            None => out.push((&f.component, vec![f])),
        }
    }
    out
}

/// Every `*.json` of `dir` (none when it does not exist), in file-name order.
pub(super) fn load_runs(dir: &Path) -> Result<Vec<Run>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    let mut names = Vec::new();
    for entry in entries {
        let name = entry?
            .file_name()
            .into_string()
            .ok()
            .context("a run's file name is not UTF-8")?;
        if name.ends_with(".json") {
            names.push(name);
        }
    }
    names.sort();
    let mut runs = Vec::new();
    for name in names {
        let text = std::fs::read_to_string(dir.join(&name))
            .with_context(|| format!("reading {RUNS}/{name}"))?;
        runs.push(parse_run(name.clone(), &text).with_context(|| format!("in {RUNS}/{name}"))?);
    }
    Ok(runs)
}

/// One stored run.
fn parse_run(file: String, text: &str) -> Result<Run> {
    let doc: Value = serde_json::from_str(text)?;
    let obj = doc.as_object().context("not a JSON object")?;
    only(
        obj,
        &["component", "machine", "command", "recorded", "report"],
        "the run",
    )?;
    let report = obj
        .get("report")
        .filter(|r| r.is_object())
        .context("`report` is not an object")?;
    Ok(Run {
        file,
        component: text_of(obj, "component")?,
        machine: text_of(obj, "machine")?,
        command: text_of(obj, "command")?,
        recorded: text_of(obj, "recorded")?,
        report: report.clone(),
    })
}

/// [`string_at`] of a run's field.
fn text_of(obj: &Map<String, Value>, key: &str) -> Result<String> {
    string_at(obj, key, "the run")
}

/// Rows and pages for the tests of this module and of the renderer.
#[cfg(test)]
pub(super) mod fixtures {
    use super::{Figure, Figures, Machine};

    pub(in crate::perf) fn figure(
        component: &str,
        measure: &str,
        history: &str,
        command: Option<&str>,
    ) -> Figure {
        Figure {
            component: component.to_owned(),
            measure: measure.to_owned(),
            figure: "1 us".to_owned(),
            baseline: "2 us".to_owned(),
            target: "-".to_owned(),
            machine: "EPYC".to_owned(),
            history: history.to_owned(),
            command: command.map(str::to_owned),
        }
    }

    pub(in crate::perf) fn page(figures: Vec<Figure>) -> Figures {
        Figures {
            title: "Figures".to_owned(),
            intro: vec!["Intro.".to_owned()],
            machines: vec![Machine {
                name: "EPYC".to_owned(),
                description: "a VM".to_owned(),
            }],
            machines_note: "Rust.".to_owned(),
            figures,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::{figure, page};
    use super::*;

    #[test]
    fn records_that_would_render_wrong_are_refused() {
        let refused = |figures: Vec<Figure>| validate(&page(figures)).is_err();
        assert!(
            refused(vec![figure("a", "x", "same", None)]),
            "same with no row above"
        );
        assert!(refused(vec![figure("a", "x | y", "e", None)]), "bare pipe");
        let mut elsewhere = figure("a", "x", "e", None);
        elsewhere.machine = "H100".to_owned();
        assert!(refused(vec![elsewhere]), "machine outside the legend");
        assert!(!refused(vec![
            figure("a", "x \\| y", "e", None),
            figure("a", "z", "same", None)
        ]));
        let misspelt = r#"{"title": "t", "intro": [], "machines": [], "machines_note": "",
            "figures": [{"component": "a", "measure": "m", "figure": "f", "baseline": "b",
            "target": "t", "machine": "EPYC", "history": "h", "comand": "x"}]}"#;
        assert!(parse_figures(misspelt).is_err());
    }
}
