//! NumPy `.npy` files (format 1.0-3.0, C order, little-endian): enough to read what
//! `numpy.save` writes for the dtypes the kernels take (queries, caches, indices, partials)
//! and to write f32/u16/i64 arrays back, so the kernels can be driven from Python
//! (`kvroute kernel`). A file is untrusted input: every malformed header is an [`NpyError`]
//! naming what is wrong; nothing panics.
//!
//! Format: <https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html>.

use std::path::{Path, PathBuf};

use crate::Partial;
use crate::layout::D_LATENT;

/// What is wrong with a `.npy` file, or the system error reading or writing one.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NpyError(String);

type Result<T, E = NpyError> = std::result::Result<T, E>;

macro_rules! bail {
    ($($t:tt)*) => {
        return Err(NpyError(format!($($t)*)))
    };
}

macro_rules! ensure {
    ($cond:expr, $($t:tt)*) => {
        if !$cond {
            bail!($($t)*);
        }
    };
}

/// Adds what was being done to a failure, as the message's prefix.
trait Context<T> {
    fn context(self, what: &str) -> Result<T>;
    fn with_context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: std::fmt::Display> Context<T> for std::result::Result<T, E> {
    fn context(self, what: &str) -> Result<T> {
        self.map_err(|e| NpyError(format!("{what}: {e}")))
    }
    fn with_context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| NpyError(format!("{}: {e}", what())))
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, what: &str) -> Result<T> {
        self.ok_or_else(|| NpyError(what.to_owned()))
    }
    fn with_context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.ok_or_else(|| NpyError(what()))
    }
}

const MAGIC: &[u8] = b"\x93NUMPY";

/// The element types accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    /// `<f4`
    F32,
    /// `<f8`
    F64,
    /// `<u2` (taken as raw bf16 bits by the kernel commands)
    U16,
    /// `<i4`
    I32,
    /// `<i8`
    I64,
}

impl Dtype {
    fn parse(descr: &str) -> Result<Self> {
        Ok(match descr {
            "<f4" => Self::F32,
            "<f8" => Self::F64,
            "<u2" => Self::U16,
            "<i4" => Self::I32,
            "<i8" => Self::I64,
            other => bail!(
                "dtype '{other}' is not supported (use <f4, <f8, <u2 for raw bf16 bits, <i4 or <i8)"
            ),
        })
    }

    fn size(self) -> usize {
        match self {
            Self::U16 => 2,
            Self::F32 | Self::I32 => 4,
            Self::F64 | Self::I64 => 8,
        }
    }

    fn descr(self) -> &'static str {
        match self {
            Self::F32 => "<f4",
            Self::F64 => "<f8",
            Self::U16 => "<u2",
            Self::I32 => "<i4",
            Self::I64 => "<i8",
        }
    }
}

/// An array as read: its shape, dtype and little-endian payload.
#[derive(Debug, Clone)]
pub struct Array {
    /// Its dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Its element type.
    pub dtype: Dtype,
    data: Vec<u8>,
}

/// The value of `'key': VALUE` in the header dict (up to the next top-level comma or brace).
fn dict_value<'a>(header: &'a str, key: &str) -> Result<&'a str> {
    let needle = format!("'{key}':");
    let at = header
        .find(&needle)
        .with_context(|| format!("header has no '{key}'"))?;
    let rest = header[at + needle.len()..].trim_start();
    let end = if rest.starts_with('(') {
        rest.find(')').map(|i| i + 1)
    } else {
        rest.find([',', '}'])
    }
    .with_context(|| format!("header value of '{key}' is not terminated"))?;
    Ok(rest[..end].trim())
}

fn parse_header(header: &str) -> Result<(Dtype, Vec<usize>)> {
    let descr = dict_value(header, "descr")?.trim_matches(['\'', '"']);
    let dtype = Dtype::parse(descr)?;
    match dict_value(header, "fortran_order")? {
        "False" => {}
        "True" => {
            bail!("Fortran-ordered arrays are not supported (save with np.ascontiguousarray)")
        }
        other => bail!("fortran_order is '{other}'"),
    }
    let shape = dict_value(header, "shape")?;
    let inner = shape
        .strip_prefix('(')
        .and_then(|s| s.strip_suffix(')'))
        .with_context(|| format!("shape '{shape}' is not a tuple"))?;
    let dims = inner
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| {
            d.trim_end_matches('L')
                .parse::<usize>()
                .with_context(|| format!("shape entry '{d}' is not a non-negative integer"))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((dtype, dims))
}

impl Array {
    /// Parses a whole `.npy` file's bytes.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        ensure!(bytes.starts_with(MAGIC), "not a .npy file (bad magic)");
        ensure!(bytes.len() >= 10, "truncated .npy preamble");
        let (major, rest) = (bytes[6], &bytes[8..]);
        let (len, rest) = match major {
            1 => (
                usize::from(u16::from_le_bytes([rest[0], rest[1]])),
                &rest[2..],
            ),
            2 | 3 => {
                ensure!(rest.len() >= 4, "truncated .npy preamble");
                let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
                (usize::try_from(len).context("header length")?, &rest[4..])
            }
            v => bail!(".npy format version {v} is not supported"),
        };
        ensure!(
            rest.len() >= len,
            "header length {len} runs past the end of the file"
        );
        let header = std::str::from_utf8(&rest[..len]).context("header is not text")?;
        let (dtype, shape) = parse_header(header)?;
        let count = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .context("shape overflows")?;
        let payload = &rest[len..];
        let want = count.checked_mul(dtype.size()).context("shape overflows")?;
        ensure!(
            payload.len() == want,
            "shape {shape:?} of {} needs {want} bytes of data, the file has {}",
            dtype.descr(),
            payload.len()
        );
        Ok(Self {
            shape,
            dtype,
            data: payload.to_vec(),
        })
    }

    /// Reads `path`.
    pub fn read(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&bytes)
            .with_context(|| format!("{} is not a usable .npy array", path.display()))
    }

    fn chunks<const N: usize>(&self) -> impl Iterator<Item = [u8; N]> + '_ {
        self.data.chunks_exact(N).map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            a
        })
    }

    /// As bf16 bits: `<u2` taken as raw bits, `<f4`/`<f8` rounded to nearest even (as the
    /// wire would).
    pub fn to_bf16(&self) -> Result<Vec<u16>> {
        use crate::bf16;
        Ok(match self.dtype {
            Dtype::U16 => self.chunks::<2>().map(u16::from_le_bytes).collect(),
            Dtype::F32 => self
                .chunks::<4>()
                .map(|b| bf16::from_f32(f32::from_le_bytes(b)))
                .collect(),
            Dtype::F64 => self
                .chunks::<8>()
                .map(|b| bf16::from_f64(f64::from_le_bytes(b)))
                .collect(),
            Dtype::I32 | Dtype::I64 => {
                bail!("expected float values or raw bf16 bits (<u2), got integers")
            }
        })
    }

    /// As f32 (`<f4` exactly, `<f8` rounded).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        Ok(match self.dtype {
            Dtype::F32 => self.chunks::<4>().map(f32::from_le_bytes).collect(),
            Dtype::F64 => self
                .chunks::<8>()
                .map(|b| f64::from_le_bytes(b) as f32)
                .collect(),
            other => bail!("expected <f4 or <f8, got {}", other.descr()),
        })
    }

    /// As i64 (from `<i4` or `<i8`).
    pub fn to_i64(&self) -> Result<Vec<i64>> {
        Ok(match self.dtype {
            Dtype::I32 => self
                .chunks::<4>()
                .map(|b| i64::from(i32::from_le_bytes(b)))
                .collect(),
            Dtype::I64 => self.chunks::<8>().map(i64::from_le_bytes).collect(),
            other => bail!("expected integers (<i4 or <i8), got {}", other.descr()),
        })
    }
}

/// The bytes of a version 1.0 `.npy` file holding `data` with `shape`.
fn encode(dtype: Dtype, shape: &[usize], data: &[u8]) -> Vec<u8> {
    let dims = match shape {
        [one] => format!("({one},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': {dims}, }}",
        dtype.descr()
    );
    // Pad with spaces so that magic + version + length + header + '\n' is a multiple of 64.
    let unpadded = MAGIC.len() + 2 + 2 + header.len() + 1;
    header.extend(std::iter::repeat_n(
        ' ',
        unpadded.next_multiple_of(64) - unpadded,
    ));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(
        &u16::try_from(header.len())
            .unwrap_or(u16::MAX)
            .to_le_bytes(),
    );
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// Writes f32 values with `shape` to `path`.
pub fn write_f32(path: &Path, shape: &[usize], values: &[f32]) -> Result<()> {
    let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(path, encode(Dtype::F32, shape, &data))
        .with_context(|| format!("writing {}", path.display()))
}

/// Writes raw bf16 bits (`<u2`) with `shape` to `path` (the tests' inputs).
pub fn write_u16(path: &Path, shape: &[usize], values: &[u16]) -> Result<()> {
    let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(path, encode(Dtype::U16, shape, &data))
        .with_context(|| format!("writing {}", path.display()))
}

/// Writes i64 values with `shape` to `path` (the tests' inputs).
pub fn write_i64(path: &Path, shape: &[usize], values: &[i64]) -> Result<()> {
    let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(path, encode(Dtype::I64, shape, &data))
        .with_context(|| format!("writing {}", path.display()))
}

/// Writes a partial as `o.npy` (`[rows, 512]`), `m.npy` and `l.npy` (`[rows]`) in `dir`
/// (created if missing); returns the three paths.
pub fn write_partial(dir: &Path, p: &Partial) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mq = p.rows();
    let files = [dir.join("o.npy"), dir.join("m.npy"), dir.join("l.npy")];
    write_f32(&files[0], &[mq, D_LATENT], &p.o)?;
    write_f32(&files[1], &[mq], &p.m)?;
    write_f32(&files[2], &[mq], &p.l)?;
    Ok(files.into())
}

/// Reads a partial [`write_partial`] wrote (or numpy did, in the same shapes).
pub fn read_partial(dir: &Path) -> Result<Partial> {
    let o = Array::read(&dir.join("o.npy"))?;
    let mq = match o.shape[..] {
        [rows, D_LATENT] => rows,
        _ => bail!("o.npy must be [rows, {D_LATENT}], got shape {:?}", o.shape),
    };
    let (m, l) = (
        Array::read(&dir.join("m.npy"))?,
        Array::read(&dir.join("l.npy"))?,
    );
    for (a, name) in [(&m, "m.npy"), (&l, "l.npy")] {
        ensure!(
            a.shape == [mq],
            "{}/{name} must be [{mq}] to match o.npy, got {:?}",
            dir.display(),
            a.shape
        );
    }
    Ok(Partial {
        o: o.to_f32()?,
        m: m.to_f32()?,
        l: l.to_f32()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_we_write_we_read_back() {
        let values = [1.0f32, -2.5, 3.25, f32::NEG_INFINITY, 0.0, 7.0];
        let bytes = encode(
            Dtype::F32,
            &[2, 3],
            &values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<_>>(),
        );
        assert_eq!(
            (bytes.len() - values.len() * 4) % 64,
            0,
            "header padded to 64"
        );
        let a = Array::parse(&bytes).unwrap();
        assert_eq!(a.shape, [2, 3]);
        assert_eq!(a.to_f32().unwrap(), values);
        assert_eq!(a.to_bf16().unwrap()[0], 0x3f80);
        let one = Array::parse(&encode(Dtype::I64, &[1], &5i64.to_le_bytes())).unwrap();
        assert_eq!(
            (one.shape.as_slice(), one.to_i64().unwrap()),
            (&[1usize][..], vec![5])
        );
    }

    #[test]
    fn numpy_headers_parse() {
        // Byte for byte what numpy 2.x writes for np.zeros((2, 576), np.uint16).
        let header = "{'descr': '<u2', 'fortran_order': False, 'shape': (2, 576), }";
        assert_eq!(parse_header(header).unwrap(), (Dtype::U16, vec![2, 576]));
        assert_eq!(
            parse_header("{'descr': '<i4', 'fortran_order': False, 'shape': (7,), }").unwrap(),
            (Dtype::I32, vec![7])
        );
        assert_eq!(
            parse_header("{'descr': '<f4', 'fortran_order': False, 'shape': (), }").unwrap(),
            (Dtype::F32, vec![])
        );
    }

    /// `bytes` with the first `from` replaced by `to`.
    fn replaced(bytes: &[u8], from: &str, to: &str) -> Vec<u8> {
        let at = bytes
            .windows(from.len())
            .position(|w| w == from.as_bytes())
            .unwrap();
        [&bytes[..at], to.as_bytes(), &bytes[at + from.len()..]].concat()
    }

    #[test]
    fn malformed_files_are_errors_not_panics() {
        let good = encode(Dtype::F32, &[2], &[0u8; 8]);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"PK\x03\x04".to_vec(), "magic"),
            (good[..9].to_vec(), "truncated"),
            (good[..good.len() - 1].to_vec(), "needs 8 bytes"),
            (
                {
                    let mut b = good.clone();
                    b[8] = 0xff;
                    b[9] = 0xff;
                    b
                },
                "runs past",
            ),
            (replaced(&good, "<f4", ">f4"), "not supported"),
            (replaced(&good, "False", "True "), "Fortran"),
            (replaced(&good, "(2,)", "(-2,)"), "non-negative"),
        ];
        for (bytes, why) in cases {
            let err = format!("{:#}", Array::parse(&bytes).unwrap_err());
            assert!(err.contains(why), "{why}: {err}");
        }
        let huge = "{'descr': '<f8', 'fortran_order': False, 'shape': (18446744073709551615, 3), }";
        let mut b = MAGIC.to_vec();
        b.extend([1, 0]);
        b.extend(u16::try_from(huge.len()).unwrap().to_le_bytes());
        b.extend(huge.as_bytes());
        assert!(format!("{:#}", Array::parse(&b).unwrap_err()).contains("overflows"));
        assert!(
            Array::parse(&good).unwrap().to_i64().is_err(),
            "floats are not indices"
        );
    }
}
