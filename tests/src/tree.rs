//! The workspace's own files, for tests that read the tree: its root, and its files with
//! given extensions, build outputs, VCS data and hidden folders left out.

use std::path::{Path, PathBuf};

/// The workspace root (the folder above this crate's).
pub fn workspace_root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.parent().unwrap_or(here).to_owned()
}

/// Every file under `dir` whose extension is one of `extensions`, in no particular order;
/// `target` folders and names starting with `.` are not entered.
pub fn files_with(dir: &Path, extensions: &[&str]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    walk(dir, extensions, &mut out);
    out
}

fn walk(dir: &Path, extensions: &[&str], out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || name == "target" {
            continue;
        }
        if path.is_dir() {
            walk(&path, extensions, out);
        } else if path
            .extension()
            .is_some_and(|x| extensions.iter().any(|e| x == *e))
        {
            out.push(path);
        }
    }
}
