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

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{File, OpenOptions};

use kvroute_transport::file::{Links, create_replacing, open_regular, read_bounded};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::Serialize;
use thiserror::Error;

use crate::error::StoreError;
use crate::layout::{BlockLayout, ROW_BYTES};

/// Bytes of the header before a block's payload.
pub const HEADER_BYTES: usize = 4096;
const MAGIC: [u8; 8] = *b"KVRBLK\0\x01";
const VERSION: u32 = 1;
/// Where the per-layer checksums start.
const CRC_TABLE: usize = 48;
/// The most layers a header has room for.
pub const MAX_LAYERS: u32 = ((HEADER_BYTES - CRC_TABLE - 4) / 4) as u32;
/// Payload bytes per `pread`, checksummed right after while still in cache. The whole range is
/// announced to the kernel first (`POSIX_FADV_WILLNEED`), so the device reads ahead while the
/// checksums run. (1, 2 and 4 MiB measured alike on a 2-core EPYC, 512 KiB slower; what moved
/// the figure was the destination's alignment: a page-aligned one, as registered buffers are,
/// read 1.3x faster than one 16 bytes past a page, docs/perf.md.)
const READ_PIECE: usize = 2 << 20;
const SUFFIX: &str = "kvb";
const MANIFEST: &str = "manifest";
/// The most bytes the layout file is read to (`layers tokens\n` is at most 22).
const LAYOUT_MAX_BYTES: u64 = 64;
/// The most bytes the manifest is read to: 21 a line, so some 50 million puts and deletes
/// between rewrites (each open rewrites it with the live keys only).
const MANIFEST_MAX_BYTES: u64 = 1 << 30;

/// The store's layout, `layers tokens`, written when the store is created.
const LAYOUT: &str = "layout";

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

/// A block file's header, parsed and checked against the store's layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The block's key.
    pub key: u64,
    /// The CRC-32C of each layer's bytes.
    pub layer_crcs: Vec<u32>,
}

/// Why [`parse_header`] refused a header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderFault {
    /// A whole, checksum-valid header of a block of another layout.
    Layout {
        /// Its layers.
        layers: u32,
        /// Its tokens per layer block.
        tokens: u32,
        /// Its bytes per row.
        row_bytes: u32,
    },
    /// Not a valid header, with why.
    Bad(String),
}

/// The header of a block of `layout` under `key` with payload `block`.
fn encode_header(layout: BlockLayout, key: u64, block: &[u8]) -> Vec<u8> {
    let mut h = vec![0u8; HEADER_BYTES];
    h[..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&layout.layers.to_le_bytes());
    h[16..20].copy_from_slice(&layout.tokens.to_le_bytes());
    h[20..24].copy_from_slice(&(ROW_BYTES as u32).to_le_bytes());
    h[24..32].copy_from_slice(&key.to_le_bytes());
    h[32..40].copy_from_slice(&(block.len() as u64).to_le_bytes());
    let layer_bytes = block.len() / layout.layers as usize;
    for (i, layer) in block.chunks(layer_bytes).enumerate() {
        let at = CRC_TABLE + 4 * i;
        h[at..at + 4].copy_from_slice(&crc32c::crc32c(layer).to_le_bytes());
    }
    let end = CRC_TABLE + 4 * layout.layers as usize;
    let crc = crc32c::crc32c(&h[..end]);
    h[end..end + 4].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Parses a header (untrusted bytes: any content gets an error, never a panic) and checks it
/// against the store's layout.
pub fn parse_header(bytes: &[u8], layout: BlockLayout) -> Result<Header, HeaderFault> {
    let word = |at: usize| -> Option<u32> {
        Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
    };
    let long = |at: usize| -> Option<u64> {
        Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
    };
    if bytes.len() < HEADER_BYTES {
        return Err(HeaderFault::Bad(format!(
            "header is {} bytes, {HEADER_BYTES} needed",
            bytes.len()
        )));
    }
    if bytes[..8] != MAGIC {
        return Err(HeaderFault::Bad(
            "not a kvroute block (bad magic)".to_owned(),
        ));
    }
    let version = word(8).unwrap_or(0);
    if version != VERSION {
        return Err(HeaderFault::Bad(format!(
            "format version {version}, this build reads {VERSION}"
        )));
    }
    let (layers, tokens, row) = (
        word(12).unwrap_or(0),
        word(16).unwrap_or(0),
        word(20).unwrap_or(0),
    );
    if layers == 0 || layers > MAX_LAYERS {
        return Err(HeaderFault::Bad(format!("{layers} layers")));
    }
    let end = CRC_TABLE + 4 * layers as usize;
    let stored = word(end).unwrap_or(0);
    if crc32c::crc32c(&bytes[..end]) != stored {
        return Err(HeaderFault::Bad("header checksum mismatch".to_owned()));
    }
    if (layers, tokens) != (layout.layers, layout.tokens) || row as usize != ROW_BYTES {
        return Err(HeaderFault::Layout {
            layers,
            tokens,
            row_bytes: row,
        });
    }
    let payload = long(32).unwrap_or(0);
    if payload != layout.full_bytes() as u64 {
        return Err(HeaderFault::Bad(format!(
            "payload of {payload} bytes, the layout has {}",
            layout.full_bytes()
        )));
    }
    let key = long(24).unwrap_or(0);
    let crcs = (0..layers as usize)
        .map(|i| word(CRC_TABLE + 4 * i).unwrap_or(0))
        .collect();
    Ok(Header {
        key,
        layer_crcs: crcs,
    })
}

fn read_header(file: &File, path: &Path, layout: BlockLayout) -> Result<Header, StorageError> {
    let mut bytes = vec![0u8; HEADER_BYTES];
    if let Err(e) = file.read_exact_at(&mut bytes, 0) {
        return Err(if e.kind() == std::io::ErrorKind::UnexpectedEof {
            StorageError::Corrupt {
                path: path.to_owned(),
                why: "truncated header".to_owned(),
            }
        } else {
            io("reading", path)(e)
        });
    }
    parse_header(&bytes, layout).map_err(|fault| match fault {
        HeaderFault::Layout { layers, tokens, .. } => StorageError::WrongLayout {
            path: path.to_owned(),
            layers: layout.layers,
            tokens: layout.tokens,
            found_layers: layers,
            found_tokens: tokens,
        },
        HeaderFault::Bad(why) => StorageError::Corrupt {
            path: path.to_owned(),
            why,
        },
    })
}

/// Opens a block file and checks its header, that it holds `key` and that it is whole, without
/// reading its payload.
fn open_checked(
    path: &Path,
    layout: BlockLayout,
    key: u64,
) -> Result<(File, Header), StorageError> {
    let file = open_regular(path, Links::Refuse).map_err(io("opening", path))?;
    let header = read_header(&file, path, layout)?;
    if header.key != key {
        return Err(StorageError::Corrupt {
            path: path.to_owned(),
            why: format!("holds block {:016x}", header.key),
        });
    }
    let len = file
        .metadata()
        .map_err(io("reading the size of", path))?
        .len();
    let want = (HEADER_BYTES + layout.full_bytes()) as u64;
    if len != want {
        return Err(StorageError::Corrupt {
            path: path.to_owned(),
            why: format!("{len} bytes, a whole block is {want}"),
        });
    }
    Ok((file, header))
}

/// Reads `out.len()` bytes at `at` (whole layers, the first being `first_layer`, each
/// `layer_bytes` long) in pieces, checksumming each piece while it is still in cache, and
/// checks each layer's checksum against `want` (one per layer read).
fn read_checked(
    file: &File,
    path: &Path,
    at: usize,
    out: &mut [u8],
    want: &[u32],
    first_layer: usize,
    layer_bytes: usize,
) -> Result<(), StorageError> {
    // Ask for the whole range now: the device reads ahead while the checksums run. Advice
    // only; a file system that ignores it reads on demand.
    let _ = nix::fcntl::posix_fadvise(
        file,
        at as i64,
        out.len() as i64,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_WILLNEED,
    );
    // Running checksum of the layer being read, and how far into `out` it has got.
    let mut crc = 0u32;
    let mut summed = 0;
    let mut done = 0;
    while done < out.len() {
        let end = out.len().min(done + READ_PIECE);
        let piece = &mut out[done..end];
        if let Err(e) = file.read_exact_at(piece, (at + done) as u64) {
            return Err(if e.kind() == std::io::ErrorKind::UnexpectedEof {
                StorageError::Corrupt {
                    path: path.to_owned(),
                    why: format!("truncated in layer {}", first_layer + done / layer_bytes),
                }
            } else {
                io("reading", path)(e)
            });
        }
        // Checksum what arrived, closing every layer that ends inside it.
        while summed < end {
            let layer = summed / layer_bytes;
            let layer_end = ((layer + 1) * layer_bytes).min(end);
            crc = crc32c::crc32c_append(crc, &out[summed..layer_end]);
            summed = layer_end;
            if summed.is_multiple_of(layer_bytes) {
                if crc != want[layer] {
                    return Err(StorageError::Corrupt {
                        path: path.to_owned(),
                        why: format!("layer {} checksum mismatch", first_layer + layer),
                    });
                }
                crc = 0;
            }
        }
        done = end;
    }
    Ok(())
}

/// The layout a store directory was created with, if it has one.
fn read_layout(dir: &Path) -> Result<Option<BlockLayout>, StorageError> {
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
fn parse_name(name: &str) -> Option<u64> {
    let hex = name.strip_suffix(SUFFIX)?.strip_suffix('.')?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// The keys the manifest says were put and not deleted since. Lines it cannot read are
/// skipped: the manifest only names blocks, it never makes one readable.
fn read_manifest(dir: &Path) -> Result<BTreeSet<u64>, StorageError> {
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
fn rewrite_manifest<'a>(
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
fn create_fresh(tmp: &Path) -> Result<File, StorageError> {
    create_replacing(tmp).map_err(io("creating", tmp))
}

fn sync_dir(dir: &Path) -> Result<(), StorageError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("syncing", dir))
}

fn file_name(path: &Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
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
