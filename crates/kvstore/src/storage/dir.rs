//! The store's directory around its blocks: the layout file, the manifest of keys put and
//! deleted, block file names, and the create and sync steps that make writes durable.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

use kvroute_transport::file::{Links, create_replacing, read_bounded};

use super::{StorageError, io};
use crate::layout::BlockLayout;

pub(super) const SUFFIX: &str = "kvb";
pub(super) const MANIFEST: &str = "manifest";
/// The most bytes the layout file is read to (`layers tokens\n` is at most 22).
const LAYOUT_MAX_BYTES: u64 = 64;
/// The most bytes the manifest is read to: 21 a line, so some 50 million puts and deletes
/// between rewrites (each open rewrites it with the live keys only).
const MANIFEST_MAX_BYTES: u64 = 1 << 30;

/// The store's layout, `layers tokens`, written when the store is created.
pub(super) const LAYOUT: &str = "layout";

/// The layout a store directory was created with, if it has one.
pub(super) fn read_layout(dir: &Path) -> Result<Option<BlockLayout>, StorageError> {
    let path = dir.join(LAYOUT);
    let text = match read_bounded(&path, LAYOUT_MAX_BYTES, Links::Refuse) {
        Ok(t) => String::from_utf8_lossy(&t).into_owned(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io("reading", &path)(e)),
    };
    let mut words = text.split_whitespace().map(str::parse::<u32>);
    match (words.next(), words.next(), words.next()) {
        (Some(Ok(layers)), Some(Ok(tokens)), None) => Ok(Some(BlockLayout::new(layers, tokens)?)),
        _ => Err(StorageError::Corrupt {
            path,
            why: "not `layers tokens`".to_owned(),
        }),
    }
}

/// `0123456789abcdef.kvb` -> the key.
pub(super) fn parse_name(name: &str) -> Option<u64> {
    let hex = name.strip_suffix(SUFFIX)?.strip_suffix('.')?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// The keys the manifest says were put and not deleted since. Lines it cannot read are
/// skipped: the manifest only names blocks, it never makes one readable.
pub(super) fn read_manifest(dir: &Path) -> Result<BTreeSet<u64>, StorageError> {
    let path = dir.join(MANIFEST);
    let text = match read_bounded(&path, MANIFEST_MAX_BYTES, Links::Refuse) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(io("reading", &path)(e)),
    };
    let mut state: BTreeMap<u64, bool> = BTreeMap::new();
    for line in text.lines() {
        let Some((op, key)) = line.split_once(' ') else {
            continue;
        };
        let Ok(key) = u64::from_str_radix(key, 16) else {
            continue;
        };
        match op {
            "put" => state.insert(key, true),
            "del" => state.insert(key, false),
            _ => continue,
        };
    }
    Ok(state
        .into_iter()
        .filter(|&(_, live)| live)
        .map(|(k, _)| k)
        .collect())
}

/// Replaces the manifest with `keys` (atomically: temporary file, fsync, rename) and returns it
/// open for appending.
pub(super) fn rewrite_manifest<'a>(
    dir: &Path,
    keys: impl Iterator<Item = &'a u64>,
) -> Result<File, StorageError> {
    let path = dir.join(MANIFEST);
    let tmp = dir.join(".manifest.tmp");
    let mut text = String::new();
    for key in keys {
        text.push_str(&format!("put {key:016x}\n"));
    }
    let mut file = create_fresh(&tmp)?;
    file.write_all(text.as_bytes())
        .map_err(io("writing", &tmp))?;
    file.sync_all().map_err(io("syncing", &tmp))?;
    std::fs::rename(&tmp, &path).map_err(io("publishing", &path))?;
    OpenOptions::new()
        .append(true)
        .open(&path)
        .map_err(io("opening", &path))
}

/// Creates temporary file `tmp` for writing, removing a stale one (never written through).
pub(super) fn create_fresh(tmp: &Path) -> Result<File, StorageError> {
    create_replacing(tmp).map_err(io("creating", tmp))
}

pub(super) fn sync_dir(dir: &Path) -> Result<(), StorageError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("syncing", dir))
}

pub(super) fn file_name(path: &Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}
