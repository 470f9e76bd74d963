//! The repository's documents point at documents that exist: every `docs/NAME.md` a source
//! file, script or document names, every relative Markdown link, and no reference to a design
//! document the repository does not hold. The README's crate table names every workspace
//! member.

// Test helpers panic on failure: that is how a test reports it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvroute_tests::tree::{files_with, workspace_root};

/// Every `docs/NAME.md` (and `docs/DIR/NAME.md`) named in `text`.
fn docs_named(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("docs/") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || "_-./".contains(c)))
            .unwrap_or(tail.len());
        let name = tail[..end].trim_end_matches('.');
        if name.ends_with(".md") {
            out.push(name.to_owned());
        }
        rest = &tail[5..];
    }
    out
}

/// Relative Markdown link targets (`](x.md)`, `](x.md#y)`) in `text`.
fn md_links(text: &str) -> Vec<String> {
    text.split("](")
        .skip(1)
        .filter_map(|t| t.split(')').next())
        .map(|t| t.split('#').next().unwrap_or_default().to_owned())
        .filter(|t| t.ends_with(".md") && !t.contains("://"))
        .collect()
}

#[test]
fn every_named_document_exists() {
    let root = workspace_root();
    let all = files_with(&root, &["rs", "md", "toml", "sh", "py"]);
    assert!(
        all.len() > 100,
        "found {} files under {}",
        all.len(),
        root.display()
    );
    let mut dangling = Vec::new();
    for path in &all {
        let Ok(text) = std::fs::read_to_string(path) else {
            continue;
        };
        let shown = path
            .strip_prefix(&root)
            .unwrap_or(path)
            .display()
            .to_string();
        // This file names the patterns it looks for.
        if shown.ends_with("tests/docs.rs") {
            continue;
        }
        for doc in docs_named(&text) {
            if !root.join(&doc).is_file() {
                dangling.push(format!("{shown}: {doc}"));
            }
        }
        if path.extension().is_some_and(|e| e == "md") {
            let dir = path.parent().unwrap_or(&root);
            for link in md_links(&text) {
                if !dir.join(&link).is_file() {
                    dangling.push(format!("{shown}: link {link}"));
                }
            }
        }
        if text.contains("DESIGN \"") {
            dangling.push(format!(
                "{shown}: a DESIGN document (not in the repository)"
            ));
        }
    }
    assert!(
        dangling.is_empty(),
        "dangling references:\n{}",
        dangling.join("\n")
    );
}

#[test]
fn the_readme_names_every_workspace_member() {
    let root = workspace_root();
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let members: Vec<&str> = manifest
        .split("members = [")
        .nth(1)
        .and_then(|m| m.split(']').next())
        .unwrap_or_default()
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
        .collect();
    assert!(members.len() >= 10, "{members:?}");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    for m in members {
        let toml = std::fs::read_to_string(root.join(m).join("Cargo.toml")).unwrap();
        let name = toml
            .lines()
            .find_map(|l| l.strip_prefix("name = "))
            .map(|n| n.trim().trim_matches('"'))
            .unwrap_or_default();
        assert!(
            readme.contains(&format!("`{name}`")),
            "README's crate table lacks {name} ({m})"
        );
    }
}

/// Every metric the Grafana dashboard in docs/ queries is one docs/metrics.md lists (so a
/// renamed or removed metric cannot leave a panel silently empty).
#[test]
fn the_dashboard_queries_only_documented_metrics() {
    let root = workspace_root();
    let listed = std::fs::read_to_string(root.join("docs/metrics.md")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("docs/grafana/kvroute.json")).unwrap(),
    )
    .unwrap();
    let mut names = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let mut rest = expr;
            while let Some(at) = rest.find("kvroute_") {
                let name: String = rest[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[at + name.len()..];
                names.push(name.trim_end_matches("_bucket").to_owned());
            }
        }
    }
    assert!(names.len() >= 20, "{names:?}");
    let missing: Vec<&String> = names
        .iter()
        .filter(|n| !listed.contains(&format!("`{n}`")))
        .collect();
    assert!(missing.is_empty(), "not in docs/metrics.md: {missing:?}");
}
