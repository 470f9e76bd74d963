//! A partial attention result and its wire encoding (paper 000 section 3.2).
//!
//! For each query row, over the keys it attended: `m` = the largest scaled logit
//! `scale * q.k` (natural-log units), `l` = sum of `exp(s - m)`, and `o` = the softmax-weighted
//! mean of the values, already normalised by `l`. `(o, m, l)` is FlashAttention's sufficient
//! statistic (Dao et al. 2022; Milakov and Gimelshein 2018), carried here between instances.
//! A partial over nothing is `(o = 0, m = -inf, l = 0)`: the identity of [`crate::merge`].

use crate::bf16;
use crate::cpu::vectorised;
use crate::error::{KernelError, check_len};
use crate::layout::{D_LATENT, D_QK, PARTIAL_ROW_BYTES, QUERY_ROW_BYTES};

/// `(o [mq, 512], m [mq], l [mq])` in f32.
#[derive(Debug, Clone, PartialEq)]
pub struct Partial {
    /// Normalised outputs, row-major `[mq, 512]`.
    pub o: Vec<f32>,
    /// Max scaled logit per row (`-inf` for a row that attended nothing).
    pub m: Vec<f32>,
    /// Softmax denominator per row relative to `m` (0 for a row that attended nothing).
    pub l: Vec<f32>,
}

impl Partial {
    /// `mq` rows that attended nothing.
    pub fn empty(mq: usize) -> Self {
        Self {
            o: vec![0.0; mq * D_LATENT],
            m: vec![f32::NEG_INFINITY; mq],
            l: vec![0.0; mq],
        }
    }

    /// Query rows.
    pub fn rows(&self) -> usize {
        self.m.len()
    }

    /// Row `r` of `o`.
    pub fn o_row(&self, r: usize) -> &[f32] {
        &self.o[r * D_LATENT..(r + 1) * D_LATENT]
    }

    /// Log-sum-exp of row `r`'s logits: `m + ln l` (`-inf` if empty).
    pub fn lse(&self, r: usize) -> f32 {
        if self.l[r] > 0.0 {
            self.m[r] + self.l[r].ln()
        } else {
            f32::NEG_INFINITY
        }
    }

    /// Checks the triple's invariants (what a partial from a peer or a file must satisfy):
    /// shapes agree, `l >= 0` and finite, `m` finite where `l > 0` and `-inf` where `l = 0`,
    /// `o` finite (zero where `l = 0`).
    pub fn validate(&self) -> Result<(), KernelError> {
        self.validate_rows(true)
    }

    /// [`Partial::validate`]; `check_o: false` skips the finiteness of `o` (checked already).
    pub(crate) fn validate_rows(&self, check_o: bool) -> Result<(), KernelError> {
        let mq = self.m.len();
        check_len("partial l", mq, self.l.len())?;
        check_len("partial o", mq * D_LATENT, self.o.len())?;
        for r in 0..mq {
            let (m, l) = (self.m[r], self.l[r]);
            check_stats(r, m, l)?;
            let bad = |why| Err(KernelError::InvalidPartial { row: r, why });
            let o = self.o_row(r);
            if check_o && !all_finite(o) {
                return bad("o must be finite");
            }
            if l == 0.0 && o.iter().any(|&x| x != 0.0) {
                return bad("an empty row (l = 0) must have o = 0");
            }
        }
        Ok(())
    }

    /// The wire encoding: per row, `o` as 512 bf16 (rounded to nearest even) then `m` and `l`
    /// as f32, little-endian: 1032 B per row.
    pub fn to_wire(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.rows() * PARTIAL_ROW_BYTES];
        // Cannot fail: the length is the encoding's.
        let _ = self.write_wire(&mut out);
        out
    }

    /// [`Partial::to_wire`] into `out` (exactly `rows * 1032` bytes), with no allocation: what
    /// a server encodes straight into registered memory. The loops are over fixed-size rows so
    /// the compiler vectorises the rounding.
    pub fn write_wire(&self, out: &mut [u8]) -> Result<(), KernelError> {
        check_len(
            "partial wire bytes",
            self.rows() * PARTIAL_ROW_BYTES,
            out.len(),
        )?;
        self.write_wire_rows(0, out)
    }

    /// Rows `first..first + out.len() / 1032` of [`Partial::to_wire`] into `out` (a whole
    /// number of rows): one request's share of a batched partial.
    pub fn write_wire_rows(&self, first: usize, out: &mut [u8]) -> Result<(), KernelError> {
        check_len("partial o", self.rows() * D_LATENT, self.o.len())?;
        check_len("partial l", self.rows(), self.l.len())?;
        let n = out.len() / PARTIAL_ROW_BYTES;
        check_len(
            "partial wire bytes (whole rows)",
            n * PARTIAL_ROW_BYTES,
            out.len(),
        )?;
        if first.checked_add(n).is_none_or(|end| end > self.rows()) {
            return Err(KernelError::Shape {
                what: "partial rows to encode",
                expected: self.rows().saturating_sub(first),
                got: n,
            });
        }
        let rows = first..first + n;
        let (o, m, l) = (
            &self.o[rows.start * D_LATENT..rows.end * D_LATENT],
            &self.m[rows.clone()],
            &self.l[rows],
        );
        vectorised(
            #[inline(always)]
            || encode(o, m, l, out),
        );
        Ok(())
    }

    /// Decodes [`Partial::to_wire`]'s bytes, validating them (they come from a peer).
    pub fn from_wire(bytes: &[u8]) -> Result<Self, KernelError> {
        let mut p = Self::empty(0);
        p.read_wire(bytes)?;
        Ok(p)
    }

    /// [`Partial::from_wire`] into `self`, reusing its allocations: what a requester that
    /// receives replies of one shape every decode step calls, so that no step allocates or
    /// faults in fresh pages (on the 2-core VM of docs/perf.md a fresh 512 KiB `o` cost about
    /// as much as decoding into it). Never leaves a half-decoded reply: bytes that are not
    /// whole rows leave `self` unchanged, and rows that fail validation leave that many
    /// empty rows (the merge's identity).
    pub fn read_wire(&mut self, bytes: &[u8]) -> Result<(), KernelError> {
        if !bytes.len().is_multiple_of(PARTIAL_ROW_BYTES) {
            return Err(KernelError::Shape {
                what: "partial wire bytes (1032 per row)",
                expected: bytes.len() / PARTIAL_ROW_BYTES * PARTIAL_ROW_BYTES,
                got: bytes.len(),
            });
        }
        let mq = bytes.len() / PARTIAL_ROW_BYTES;
        // Same shape as last time: nothing is written twice (decoding overwrites every value).
        self.o.resize(mq * D_LATENT, 0.0);
        self.m.resize(mq, f32::NEG_INFINITY);
        self.l.resize(mq, 0.0);
        // One pass converts and, per row, reduces the largest bf16 magnitude (exponent all
        // ones = infinity or NaN); `validate`'s remaining row checks are scalar per row.
        let mut worst = vec![0u16; mq];
        vectorised(
            #[inline(always)]
            || decode(bytes, self, &mut worst),
        );
        let checked = match worst.iter().position(|&w| w >= 0x7f80) {
            Some(row) => Err(KernelError::InvalidPartial {
                row,
                why: "o must be finite",
            }),
            None => self.validate_rows(false),
        };
        if checked.is_err() {
            self.o.fill(0.0);
            self.m.fill(f32::NEG_INFINITY);
            self.l.fill(0.0);
        }
        checked
    }
}

/// A partial in its wire encoding ([`Partial::to_wire`]'s bytes), borrowed where it landed:
/// what a requester hands to [`crate::merge_wire`] so the reply is read once, by the merge,
/// with no decode pass. Built only over whole rows whose `m` and `l` are a valid pair (as
/// [`Partial::validate`] checks them); `o`'s finiteness is checked by the reader.
#[derive(Debug, Clone, Copy)]
pub struct WirePartial<'a> {
    bytes: &'a [u8],
}

impl<'a> WirePartial<'a> {
    /// Checks `bytes` (from a peer): whole 1032-byte rows, `l` finite and non-negative, `m`
    /// finite where `l > 0` and `-inf` where `l = 0`.
    pub fn new(bytes: &'a [u8]) -> Result<Self, KernelError> {
        let whole = bytes.len() / PARTIAL_ROW_BYTES * PARTIAL_ROW_BYTES;
        check_len("partial wire bytes (1032 per row)", whole, bytes.len())?;
        let p = Self { bytes };
        for r in 0..p.rows() {
            check_stats(r, p.m(r), p.l(r))?;
        }
        Ok(p)
    }

    /// Query rows.
    pub fn rows(&self) -> usize {
        self.bytes.len() / PARTIAL_ROW_BYTES
    }

    /// Row `r`'s 1032 bytes.
    pub fn row(&self, r: usize) -> &'a [u8] {
        &self.bytes[r * PARTIAL_ROW_BYTES..(r + 1) * PARTIAL_ROW_BYTES]
    }

    /// Row `r`'s `m`.
    pub fn m(&self, r: usize) -> f32 {
        row_stats(self.row(r)).0
    }

    /// Row `r`'s `l`.
    pub fn l(&self, r: usize) -> f32 {
        row_stats(self.row(r)).1
    }

    /// All the bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }
}

/// Where a kernel writes a partial's wire rows ([`Partial::to_wire`]'s bytes) when its
/// epilogue encodes them itself ([`crate::partial_dense_wire`]): runs of whole 1032-byte rows,
/// in row order, so one batched call can answer several requests, each run a range of one
/// reply in registered memory. The f32 `o` then never goes to memory: each block of rows is
/// encoded while it is still in cache.
#[derive(Debug)]
pub struct WireOut<'a> {
    rows: Vec<&'a mut [u8]>,
}

impl<'a> WireOut<'a> {
    /// Destinations from `runs`, each a whole number of rows (a run may be empty).
    pub fn new(runs: impl IntoIterator<Item = &'a mut [u8]>) -> Result<Self, KernelError> {
        let mut rows = Vec::new();
        for run in runs {
            let whole = run.len() / PARTIAL_ROW_BYTES * PARTIAL_ROW_BYTES;
            check_len("partial wire run (whole 1032-byte rows)", whole, run.len())?;
            rows.extend(run.chunks_exact_mut(PARTIAL_ROW_BYTES));
        }
        Ok(Self { rows })
    }

    /// Rows the runs hold together.
    pub fn rows(&self) -> usize {
        self.rows.len()
    }

    /// Each row's 1032 bytes, in order.
    pub(crate) fn row_slices(&mut self) -> &mut [&'a mut [u8]] {
        &mut self.rows
    }

    /// Writes every row of `p` (which must have [`WireOut::rows`] rows): what a backend without
    /// a fused epilogue does after computing the partial in f32.
    pub(crate) fn write(&mut self, p: &Partial) -> Result<(), KernelError> {
        check_len("partial rows for the wire runs", self.rows.len(), p.rows())?;
        for (r, row) in self.rows.iter_mut().enumerate() {
            p.write_wire_rows(r, row)?;
        }
        Ok(())
    }
}

/// The non-finite contract ([`KernelError::NonFinite`]): a row that attends at least one token
/// (`live(r)`) must come out with `m` and `l` finite, `l > 0` and every `o` finite; a row that
/// attends none is left as the kernel made it (empty). `o_finite(r)` reports row `r`'s values.
pub(crate) fn check_result(
    rows: usize,
    live: impl Fn(usize) -> bool,
    stats: impl Fn(usize) -> (f32, f32),
    o_finite: impl Fn(usize) -> bool,
) -> Result<(), KernelError> {
    for r in (0..rows).filter(|&r| live(r)) {
        let (m, l) = stats(r);
        let why = if !(m.is_finite() && l.is_finite()) {
            "m or l is NaN or infinite"
        } else if l <= 0.0 {
            "every score is -inf or NaN (l = 0)"
        } else if !o_finite(r) {
            "o is NaN or infinite"
        } else {
            continue;
        };
        return Err(KernelError::NonFinite { row: r, why });
    }
    Ok(())
}

impl Partial {
    /// [`check_result`] on this partial's rows.
    pub(crate) fn check_finite(&self, live: impl Fn(usize) -> bool) -> Result<(), KernelError> {
        check_result(
            self.rows(),
            live,
            |r| (self.m[r], self.l[r]),
            |r| all_finite(self.o_row(r)),
        )
    }
}

impl WireOut<'_> {
    /// [`check_result`] on the rows written here (the bf16 `o`: a value that rounded to
    /// infinity on encoding counts as not finite).
    pub(crate) fn check_finite(&self, live: impl Fn(usize) -> bool) -> Result<(), KernelError> {
        check_result(
            self.rows.len(),
            live,
            |r| row_stats(self.rows[r]),
            |r| {
                self.rows[r][..D_LATENT * 2]
                    .chunks_exact(2)
                    .all(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7f80 != 0x7f80)
            },
        )
    }
}

/// A 1032-byte wire row's `(m, l)`, after its 512 bf16 values.
fn row_stats(row: &[u8]) -> (f32, f32) {
    let b = &row[D_LATENT * 2..D_LATENT * 2 + 8];
    (
        f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        f32::from_le_bytes([b[4], b[5], b[6], b[7]]),
    )
}

/// Row `r`'s `(m, l)` is a valid pair: `l` finite and non-negative, `m` finite where `l > 0`
/// and `-inf` where `l = 0`.
fn check_stats(r: usize, m: f32, l: f32) -> Result<(), KernelError> {
    let bad = |why| Err(KernelError::InvalidPartial { row: r, why });
    if !(l >= 0.0 && l.is_finite()) {
        return bad("l must be finite and non-negative");
    }
    if l > 0.0 && !m.is_finite() {
        return bad("m must be finite where l > 0");
    }
    if l == 0.0 && m != f32::NEG_INFINITY {
        return bad("an empty row (l = 0) must have m = -inf");
    }
    Ok(())
}

/// Rows of `(o, m, l)` into their wire bytes.
#[inline(always)]
fn encode(o: &[f32], m: &[f32], l: &[f32], out: &mut [u8]) {
    for (((row, src), m), l) in out
        .chunks_exact_mut(PARTIAL_ROW_BYTES)
        .zip(o.chunks_exact(D_LATENT))
        .zip(m)
        .zip(l)
    {
        let (dst, ml) = row.split_at_mut(D_LATENT * 2);
        for (d, &x) in dst.chunks_exact_mut(2).zip(src) {
            d.copy_from_slice(&bf16::from_f32(x).to_le_bytes());
        }
        ml[..4].copy_from_slice(&m.to_le_bytes());
        ml[4..8].copy_from_slice(&l.to_le_bytes());
    }
}

/// Wire bytes into `p`, and per row the largest `bits & 0x7fff` of its o.
#[inline(always)]
fn decode(bytes: &[u8], p: &mut Partial, worst: &mut [u16]) {
    for ((((row, o), m), l), w) in bytes
        .chunks_exact(PARTIAL_ROW_BYTES)
        .zip(p.o.chunks_exact_mut(D_LATENT))
        .zip(p.m.iter_mut())
        .zip(p.l.iter_mut())
        .zip(worst.iter_mut())
    {
        let (src, ml) = row.split_at(D_LATENT * 2);
        let mut big = 0u16;
        for (x, b) in o.iter_mut().zip(src.chunks_exact(2)) {
            let bits = u16::from_le_bytes([b[0], b[1]]);
            big = big.max(bits & 0x7fff);
            *x = bf16::to_f32(bits);
        }
        *w = big;
        *m = f32::from_le_bytes([ml[0], ml[1], ml[2], ml[3]]);
        *l = f32::from_le_bytes([ml[4], ml[5], ml[6], ml[7]]);
    }
}

/// Whether every value is finite: an integer reduction with no early exit over the exponent
/// bits, which the compiler turns into vector compares (the check runs on every partial a
/// requester receives).
fn all_finite(values: &[f32]) -> bool {
    vectorised(
        #[inline(always)]
        || all_finite_in(values),
    )
}

#[inline(always)]
pub(crate) fn all_finite_in(values: &[f32]) -> bool {
    let mut worst = 0i32;
    for &x in values {
        // Non-negative as i32 after the mask; >= 0x7f80_0000 is infinity or NaN.
        worst = worst.max((x.to_bits() & 0x7fff_ffff) as i32);
    }
    worst < 0x7f80_0000
}

/// Query rows on the wire: 576 bf16 little-endian per row, 1152 B.
pub fn queries_to_wire(rows: &[u16]) -> Vec<u8> {
    rows.iter().flat_map(|b| b.to_le_bytes()).collect()
}

/// Decodes [`queries_to_wire`]'s bytes (any bits are a valid bf16; the length is checked).
pub fn queries_from_wire(bytes: &[u8]) -> Result<Vec<u16>, KernelError> {
    if !bytes.len().is_multiple_of(QUERY_ROW_BYTES) {
        return Err(KernelError::Shape {
            what: "query wire bytes (1152 per row)",
            expected: bytes.len() / QUERY_ROW_BYTES * QUERY_ROW_BYTES,
            got: bytes.len(),
        });
    }
    debug_assert_eq!(QUERY_ROW_BYTES, D_QK * 2);
    Ok(bytes
        .chunks_exact(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn sample(mq: usize) -> Partial {
        let mut p = Partial::empty(mq);
        for r in 0..mq {
            for (d, o) in p.o[r * D_LATENT..(r + 1) * D_LATENT].iter_mut().enumerate() {
                *o = ((r * 7919 + d * 104_729) % 2001) as f32 / 1000.0 - 1.0 + 1.0 / 3.0;
            }
            p.m[r] = r as f32 * 0.25 - 3.0;
            p.l[r] = 1.0 + r as f32;
        }
        p
    }

    #[test]
    fn wire_rows_are_slices_of_the_whole_encoding() {
        let p = sample(5);
        let whole = p.to_wire();
        assert_eq!(whole.len(), 5 * PARTIAL_ROW_BYTES);
        let mut part = vec![0u8; 2 * PARTIAL_ROW_BYTES];
        p.write_wire_rows(1, &mut part).unwrap();
        assert_eq!(part, whole[PARTIAL_ROW_BYTES..3 * PARTIAL_ROW_BYTES]);
        // Out of range, ragged, and overflowing requests are refused.
        assert!(p.write_wire_rows(4, &mut part).is_err());
        assert!(p.write_wire_rows(usize::MAX, &mut part).is_err());
        assert!(p.write_wire_rows(0, &mut [0u8; 1031]).is_err());
        assert!(p.write_wire(&mut part).is_err());
    }

    #[test]
    fn wire_decode_names_the_row_with_a_non_finite_or_stray_o() {
        let p = sample(4);
        for (bits, row, d) in [
            (0x7f80u16, 2usize, 0usize),
            (0xff80, 1, 511),
            (0x7fc1, 3, 77),
        ] {
            let mut bytes = p.to_wire();
            let at = row * PARTIAL_ROW_BYTES + d * 2;
            bytes[at..at + 2].copy_from_slice(&bits.to_le_bytes());
            assert_eq!(
                Partial::from_wire(&bytes),
                Err(KernelError::InvalidPartial {
                    row,
                    why: "o must be finite"
                }),
                "bits {bits:#x} at row {row}"
            );
        }
        // The largest finite bf16 passes; an empty row with a nonzero o does not.
        let mut bytes = p.to_wire();
        bytes[5 * 2..5 * 2 + 2].copy_from_slice(&0x7f7fu16.to_le_bytes());
        assert!(Partial::from_wire(&bytes).is_ok());
        let mut empty = Partial::empty(2);
        empty.o[D_LATENT + 3] = 0.5;
        assert!(matches!(
            Partial::from_wire(&empty.to_wire()),
            Err(KernelError::InvalidPartial { row: 1, .. })
        ));
        // The dispatched finiteness check agrees with the scalar one.
        let mut o = vec![1.0f32; 1000];
        assert!(all_finite(&o) && all_finite_in(&o));
        o[999] = f32::NEG_INFINITY;
        assert!(!all_finite(&o) && !all_finite_in(&o));
    }

    #[test]
    fn wire_round_trip_rounds_o_once_and_keeps_m_and_l() {
        let p = sample(3);
        let back = Partial::from_wire(&p.to_wire()).unwrap();
        for (a, b) in p.o.iter().zip(&back.o) {
            assert_eq!(*b, bf16::to_f32(bf16::from_f32(*a)));
        }
        assert_eq!(back.m, p.m);
        assert_eq!(back.l, p.l);
    }
}
