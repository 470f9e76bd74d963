//! The storage tier: full blocks on local disk, one file per block, that survive a crash at
//! any byte and are never served torn.
//!
//! A *full block* holds every layer of its tokens (paper 003 section 4.1: "For all interactions
//! with storage, we adopt Full Blocks", layer blocks for layer-wise transfer; appendix A.5 for
//! the layouts, [`crate::layout`]), so one file serves a whole-block read and, by offset, a
//! one-layer read that touches no other layer's bytes.
//!
//! # File format (version 1, little-endian)
//!
//! A 4096-byte header, then the payload (the block's bytes, layer-major, as
//! [`BlockLayout::full_bytes`] lays them out). The header is:
//!
//! | offset | bytes | field |
//! |---|---|---|
//! | 0 | 8 | magic `KVRBLK\0\x01` |
//! | 8 | 4 | format version (1) |
//! | 12 | 4 | layers |
//! | 16 | 4 | tokens per layer block |
//! | 20 | 4 | bytes per row (1152) |
//! | 24 | 8 | block key (the chained block hash) |
//! | 32 | 8 | payload bytes |
//! | 40 | 8 | zero |
//! | 48 | 4 x layers | CRC-32C of each layer's bytes |
//! | 48 + 4 x layers | 4 | CRC-32C of the header bytes before it |
//!
//! and zeros to 4096, so the payload and every layer in it start page-aligned (a layer block is
//! a whole number of 64-token pages of 73,728 bytes, 18 x 4096). A layer read checks the header
//! and its own layer's checksum; a whole-block read checks all of them.
//!
//! # Crash safety
//!
//! [`BlockStore::put`] records the key in the manifest, writes header and payload to a
//! temporary file, `fsync`s it, renames it to its final name and `fsync`s the directory. The
//! rename is atomic: a crash before it leaves only a temporary file (deleted on the next
//! [`BlockStore::open`]), a crash after it leaves the whole block. Reads check the checksums
//! anyway, so a block damaged later (a flipped bit on disk, a truncation, a file copied from a
//! store of another layout) is refused with [`StorageError::Corrupt`] or
//! [`StorageError::WrongLayout`], never returned. The manifest (`manifest`, one `put KEY` or
//! `del KEY` line each) says which blocks were meant to exist, so [`BlockStore::verify`] can name
//! a block that is missing; it is rewritten compactly at open.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::Serialize;
use thiserror::Error;

use crate::error::StoreError;
use crate::layout::BlockLayout;

mod dir;
mod format;

use dir::{
    LAYOUT, SUFFIX, create_fresh, file_name, parse_name, read_layout, read_manifest,
    rewrite_manifest, sync_dir,
};
pub use format::{HEADER_BYTES, Header, HeaderFault, MAX_LAYERS, parse_header};
use format::{encode_header, open_checked, read_checked};

/// What the storage tier refuses.
#[derive(Debug, Error)]
pub enum StorageError {
    /// The operating system refused an operation on a path.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// On which file or directory.
        path: PathBuf,
        /// Why it failed.
        source: std::io::Error,
    },
    /// No whole block of this key is stored.
    #[error("block {key:016x} is not stored")]
    Missing {
        /// The block's key.
        key: u64,
    },
    /// The file exists but is not a whole, checksum-valid block.
    #[error("{path}: corrupt block: {why}")]
    Corrupt {
        /// The block's file.
        path: PathBuf,
        /// What failed.
        why: String,
    },
    /// The file is a block of another layout than the store's.
    #[error(
        "{path}: a block of {found_layers} layers x {found_tokens} tokens, the store holds {layers} x {tokens}"
    )]
    WrongLayout {
        /// The block's file.
        path: PathBuf,
        /// The store's layers.
        layers: u32,
        /// The store's tokens per layer block.
        tokens: u32,
        /// The file's layers.
        found_layers: u32,
        /// The file's tokens.
        found_tokens: u32,
    },
    /// A buffer of the wrong size for the block or layer.
    #[error("{what}: {expected} bytes needed, {got} given")]
    Shape {
        /// What was being read or written.
        what: &'static str,
        /// Bytes the layout needs.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// The layout is not one the store can hold.
    #[error(transparent)]
    Layout(#[from] StoreError),
}

/// What [`BlockStore::open`] found on disk.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Recovery {
    /// Whole blocks with a valid header and length (payload checksums are checked on read and
    /// by [`BlockStore::verify`]).
    pub blocks: usize,
    /// Temporary files of writes that never finished, deleted.
    pub partial_writes_removed: usize,
    /// Block files refused (bad header, wrong length, other layout), with why. They are not
    /// served; a later `put` of the same key replaces them.
    pub refused: Vec<(String, String)>,
}

/// What [`BlockStore::verify`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Verify {
    /// Blocks read whole with every checksum valid.
    pub ok: usize,
    /// Block files that failed a check, with why.
    pub corrupt: Vec<(String, String)>,
    /// Keys the manifest lists whose file is absent.
    pub missing: Vec<String>,
}

impl Verify {
    /// Whether every block is whole and none is missing.
    pub fn all_ok(&self) -> bool {
        self.corrupt.is_empty() && self.missing.is_empty()
    }
}

/// Bytes moved by a store since it was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StorageStats {
    /// Payload and header bytes read.
    pub bytes_read: u64,
    /// Payload and header bytes written.
    pub bytes_written: u64,
    /// Blocks written.
    pub puts: u64,
    /// Whole-block and layer reads.
    pub reads: u64,
}

/// A directory of full blocks of one layout.
#[derive(Debug)]
pub struct BlockStore {
    dir: PathBuf,
    layout: BlockLayout,
    /// Keys with a whole block on disk.
    present: BTreeSet<u64>,
    manifest: File,
    stats: StorageStats,
    /// Whether `put` fsyncs (always, except for benchmarks that say so).
    durable: bool,
    /// Write granularity of `put`: the whole block at once unless a test asks for pieces.
    write_piece: usize,
}

impl BlockStore {
    /// Opens (creating if needed) the store in `dir` for blocks of `layout`: deletes the
    /// temporary files of writes a crash interrupted, indexes every block file whose header is
    /// valid and whose length is whole, refuses the rest (reported, not served), and rewrites
    /// the manifest compactly.
    pub fn open(dir: &Path, layout: BlockLayout) -> Result<(Self, Recovery), StorageError> {
        layout.validate()?;
        if layout.layers > MAX_LAYERS {
            return Err(StoreError::Layout("more layers than a block header holds").into());
        }
        std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
        match read_layout(dir)? {
            Some(found) if found != layout => {
                return Err(StorageError::WrongLayout {
                    path: dir.join(LAYOUT),
                    layers: layout.layers,
                    tokens: layout.tokens,
                    found_layers: found.layers,
                    found_tokens: found.tokens,
                });
            }
            Some(_) => {}
            None => {
                let tmp = dir.join(".layout.tmp");
                let text = format!("{} {}\n", layout.layers, layout.tokens);
                let mut file = create_fresh(&tmp)?;
                file.write_all(text.as_bytes())
                    .map_err(io("writing", &tmp))?;
                file.sync_all().map_err(io("syncing", &tmp))?;
                std::fs::rename(&tmp, dir.join(LAYOUT)).map_err(io("publishing", &tmp))?;
            }
        }
        let mut recovery = Recovery::default();
        let mut present = BTreeSet::new();
        for entry in std::fs::read_dir(dir).map_err(io("listing", dir))? {
            let entry = entry.map_err(io("listing", dir))?;
            let path = entry.path();
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if name.starts_with('.') && name.ends_with(".tmp") {
                // A partial write is a regular file (or a link left in its place); anything
                // else under such a name is not this store's, and is left alone.
                let kind = entry.file_type().map_err(io("listing", &path))?;
                if kind.is_file() || kind.is_symlink() {
                    std::fs::remove_file(&path).map_err(io("removing", &path))?;
                    recovery.partial_writes_removed += 1;
                } else {
                    recovery
                        .refused
                        .push((name.to_owned(), "not a regular file; left alone".to_owned()));
                }
                continue;
            }
            let Some(key) = parse_name(name) else {
                continue;
            };
            match open_checked(&path, layout, key) {
                Ok(_) => {
                    present.insert(key);
                }
                Err(e) => recovery.refused.push((name.to_owned(), e.to_string())),
            }
        }
        recovery.blocks = present.len();
        let expected = read_manifest(dir)?;
        let manifest = rewrite_manifest(dir, expected.union(&present))?;
        sync_dir(dir)?;
        Ok((
            Self {
                dir: dir.to_owned(),
                layout,
                present,
                manifest,
                stats: StorageStats::default(),
                durable: true,
                write_piece: usize::MAX,
            },
            recovery,
        ))
    }

    /// Opens an existing store with the layout it was created with.
    pub fn open_existing(dir: &Path) -> Result<(Self, Recovery), StorageError> {
        match read_layout(dir)? {
            Some(layout) => Self::open(dir, layout),
            None => Err(StorageError::Io {
                op: "opening the store",
                path: dir.join(LAYOUT),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "not a block store (no layout file)",
                ),
            }),
        }
    }

    /// The layout of every block in the store.
    pub fn layout(&self) -> BlockLayout {
        self.layout
    }

    /// The store's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether a whole block of `key` is stored.
    pub fn contains(&self, key: u64) -> bool {
        self.present.contains(&key)
    }

    /// Blocks stored.
    pub fn len(&self) -> usize {
        self.present.len()
    }

    /// Whether the store holds no block.
    pub fn is_empty(&self) -> bool {
        self.present.is_empty()
    }

    /// The keys stored, ascending.
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.present.iter().copied()
    }

    /// Bytes moved since open.
    pub fn stats(&self) -> StorageStats {
        self.stats
    }

    /// Whether `put` waits for the disk (`fsync` of the file and the directory). On by
    /// default; off only for measurements that say so, since a crash may then lose blocks
    /// `put` reported written (never tear them: the rename still publishes whole files).
    pub fn set_durable(&mut self, durable: bool) {
        self.durable = durable;
    }

    /// Writes `put`'s data in pieces of `bytes` (a test makes crashes land mid-payload with
    /// this; it does not change the file).
    pub fn set_write_piece(&mut self, bytes: usize) {
        self.write_piece = bytes.max(1);
    }

    /// Path of `key`'s block file.
    pub fn path(&self, key: u64) -> PathBuf {
        self.dir.join(format!("{key:016x}.{SUFFIX}"))
    }

    /// Stores `block` (the full block's bytes, [`BlockLayout::full_bytes`] long) under `key`,
    /// replacing any block of that key, durably: when this returns, the block survives a crash.
    pub fn put(&mut self, key: u64, block: &[u8]) -> Result<(), StorageError> {
        let full = self.layout.full_bytes();
        if block.len() != full {
            return Err(StorageError::Shape {
                what: "block",
                expected: full,
                got: block.len(),
            });
        }
        let header = encode_header(self.layout, key, block);
        writeln!(self.manifest, "put {key:016x}").map_err(io("appending to", &self.dir))?;
        let tmp = self.dir.join(format!(".{key:016x}.{SUFFIX}.tmp"));
        let file = create_fresh(&tmp)?;
        file.write_all_at(&header, 0).map_err(io("writing", &tmp))?;
        let mut at = 0;
        while at < block.len() {
            let end = block.len().min(at.saturating_add(self.write_piece));
            file.write_all_at(&block[at..end], (HEADER_BYTES + at) as u64)
                .map_err(io("writing", &tmp))?;
            at = end;
        }
        if self.durable {
            file.sync_all().map_err(io("syncing", &tmp))?;
        }
        drop(file);
        let path = self.path(key);
        std::fs::rename(&tmp, &path).map_err(io("publishing", &path))?;
        if self.durable {
            sync_dir(&self.dir)?;
        }
        self.present.insert(key);
        self.stats.puts += 1;
        self.stats.bytes_written += (HEADER_BYTES + full) as u64;
        crate::observe::storage_write((HEADER_BYTES + full) as u64);
        Ok(())
    }

    /// Reads `key`'s whole block into `out` ([`BlockLayout::full_bytes`] long: a slice of a
    /// registered region, so the transport can write it on), checking every checksum. On an
    /// error `out` holds unspecified bytes, never a block reported good. A page-aligned `out`
    /// reads fastest (the kernel's copy out of the page cache).
    pub fn get_into(&mut self, key: u64, out: &mut [u8]) -> Result<(), StorageError> {
        let full = self.layout.full_bytes();
        if out.len() != full {
            return Err(StorageError::Shape {
                what: "block buffer",
                expected: full,
                got: out.len(),
            });
        }
        let path = self.path(key);
        let (file, header) = self.open_block(key, &path)?;
        self.read_whole(&file, &path, &header, out)
    }

    /// Reads `key`'s whole block into `region` at byte `offset` (a pool slot of registered
    /// memory: once read, the transport can write it to a peer), with [`get_into`]'s checks.
    ///
    /// # Safety
    /// The range `offset..offset + full_bytes` of `region` is this call's alone while it runs:
    /// no peer write into it is in flight or may start, and no other view of it exists (the
    /// contract of [`RegisteredBuffer::bytes_mut`]). A pool that hands the slot to this read
    /// and to nothing else until it returns meets it.
    ///
    /// [`get_into`]: Self::get_into
    /// [`RegisteredBuffer::bytes_mut`]: kvroute_transport::RegisteredBuffer::bytes_mut
    pub unsafe fn get_into_region(
        &mut self,
        key: u64,
        region: &kvroute_transport::RegisteredBuffer,
        offset: usize,
    ) -> Result<(), StorageError> {
        let full = self.layout.full_bytes();
        // SAFETY: the range is bounds-checked by `bytes_mut`; exclusivity is the caller's
        // contract.
        let out = unsafe { region.bytes_mut(offset, full) }.map_err(|_| StorageError::Shape {
            what: "region range",
            expected: offset.saturating_add(full),
            got: region.len(),
        })?;
        self.get_into(key, out)
    }

    /// Reads layer `layer` of `key`'s block into `out` (one layer block's bytes), reading the
    /// header and that layer only.
    pub fn get_layer_into(
        &mut self,
        key: u64,
        layer: u32,
        out: &mut [u8],
    ) -> Result<(), StorageError> {
        let offset = self.layout.layer_offset(layer)?;
        let layer_bytes = self.layout.layer_elems() * 2;
        if out.len() != layer_bytes {
            return Err(StorageError::Shape {
                what: "layer buffer",
                expected: layer_bytes,
                got: out.len(),
            });
        }
        let path = self.path(key);
        let (file, header) = self.open_block(key, &path)?;
        let want = &header.layer_crcs[layer as usize..=layer as usize];
        read_checked(
            &file,
            &path,
            HEADER_BYTES + offset,
            out,
            want,
            layer as usize,
            layer_bytes,
        )
        .inspect_err(note_corrupt)?;
        self.stats.reads += 1;
        self.stats.bytes_read += (HEADER_BYTES + layer_bytes) as u64;
        crate::observe::storage_read((HEADER_BYTES + layer_bytes) as u64);
        Ok(())
    }

    /// Deletes `key`'s block (a demotion out of the storage tier). Missing is an error.
    pub fn remove(&mut self, key: u64) -> Result<(), StorageError> {
        if !self.present.remove(&key) {
            return Err(StorageError::Missing { key });
        }
        writeln!(self.manifest, "del {key:016x}").map_err(io("appending to", &self.dir))?;
        let path = self.path(key);
        std::fs::remove_file(&path).map_err(io("removing", &path))
    }

    /// Reads every block the manifest lists or the directory holds, whole, checking every
    /// checksum: which are good, which are corrupt (and why), which are missing.
    pub fn verify(&mut self) -> Result<Verify, StorageError> {
        let mut report = Verify::default();
        let mut buf = vec![0u8; self.layout.full_bytes()];
        let mut keys = read_manifest(&self.dir)?;
        keys.extend(self.present.iter().copied());
        for entry in std::fs::read_dir(&self.dir).map_err(io("listing", &self.dir))? {
            let entry = entry.map_err(io("listing", &self.dir))?;
            if let Some(key) = entry.file_name().to_str().and_then(parse_name) {
                keys.insert(key);
            }
        }
        for key in &keys {
            let path = self.path(*key);
            if !path.exists() {
                report.missing.push(format!("{key:016x}"));
                continue;
            }
            // Corrupt blocks are counted where they are found (`note_corrupt`).
            let read = open_checked(&path, self.layout, *key)
                .inspect_err(note_corrupt)
                .and_then(|(file, header)| self.read_whole(&file, &path, &header, &mut buf));
            match read {
                Ok(()) => {
                    self.present.insert(*key);
                    report.ok += 1;
                }
                Err(e) => {
                    self.present.remove(key);
                    report.corrupt.push((file_name(&path), e.to_string()));
                }
            }
        }
        Ok(report)
    }

    /// Opens `key`'s block file at `path` (one this store indexed) with its checked header.
    fn open_block(&self, key: u64, path: &Path) -> Result<(File, Header), StorageError> {
        if !self.present.contains(&key) {
            return Err(StorageError::Missing { key });
        }
        match open_checked(path, self.layout, key) {
            Err(StorageError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                Err(StorageError::Missing { key })
            }
            opened => opened.inspect_err(note_corrupt),
        }
    }

    /// Reads a whole block's payload from `file` into `out` (its length checked by the caller),
    /// checking every layer against `header`, and counts it.
    fn read_whole(
        &mut self,
        file: &File,
        path: &Path,
        header: &Header,
        out: &mut [u8],
    ) -> Result<(), StorageError> {
        let layer_bytes = out.len() / self.layout.layers as usize;
        read_checked(
            file,
            path,
            HEADER_BYTES,
            out,
            &header.layer_crcs,
            0,
            layer_bytes,
        )
        .inspect_err(note_corrupt)?;
        self.stats.reads += 1;
        self.stats.bytes_read += (HEADER_BYTES + out.len()) as u64;
        crate::observe::storage_read((HEADER_BYTES + out.len()) as u64);
        Ok(())
    }
}

/// Counts a read that found its block corrupt.
fn note_corrupt(e: &StorageError) {
    if matches!(e, StorageError::Corrupt { .. }) {
        crate::observe::storage_corrupt();
    }
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StorageError + 'a {
    move |source| StorageError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

#[cfg(test)]
mod tests;
