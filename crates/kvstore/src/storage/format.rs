//! A block file's format: its header (written, parsed, checked against the store's layout)
//! and the checked reads of a block file, each layer against its checksum.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use kvroute_transport::file::{Links, open_regular};

use super::{StorageError, io};
use crate::layout::{BlockLayout, ROW_BYTES};

/// Bytes of the header before a block's payload.
pub const HEADER_BYTES: usize = 4096;
const MAGIC: [u8; 8] = *b"KVRBLK\0\x01";
const VERSION: u32 = 1;
/// Where the per-layer checksums start.
pub(super) const CRC_TABLE: usize = 48;
/// The most layers a header has room for.
pub const MAX_LAYERS: u32 = ((HEADER_BYTES - CRC_TABLE - 4) / 4) as u32;
/// Payload bytes per `pread`, checksummed right after while still in cache. The whole range is
/// announced to the kernel first (`POSIX_FADV_WILLNEED`), so the device reads ahead while the
/// checksums run. (1, 2 and 4 MiB measured alike on a 2-core EPYC, 512 KiB slower; what moved
/// the figure was the destination's alignment: a page-aligned one, as registered buffers are,
/// read 1.3x faster than one 16 bytes past a page, docs/history/perf.md.)
const READ_PIECE: usize = 2 << 20;

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
pub(super) fn encode_header(layout: BlockLayout, key: u64, block: &[u8]) -> Vec<u8> {
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
pub(super) fn open_checked(
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
pub(super) fn read_checked(
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
