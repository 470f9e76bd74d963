//! A partial attention result and its wire encoding (paper 000 section 3.2).
//!
//! For each query row, over the keys it attended: `m` = the largest scaled logit
//! `scale * q.k` (natural-log units), `l` = sum of `exp(s - m)`, and `o` = the softmax-weighted
//! mean of the values, already normalised by `l`. `(o, m, l)` is FlashAttention's sufficient
//! statistic (Dao et al. 2022; Milakov and Gimelshein 2018), carried here between instances.
//! A partial over nothing is `(o = 0, m = -inf, l = 0)`: the identity of [`crate::merge`].

use crate::bf16;
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
        let mq = self.m.len();
        check_len("partial l", mq, self.l.len())?;
        check_len("partial o", mq * D_LATENT, self.o.len())?;
        for r in 0..mq {
            let (m, l) = (self.m[r], self.l[r]);
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
            let o = self.o_row(r);
            if o.iter().any(|x| !x.is_finite()) {
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
        let mut out = Vec::with_capacity(self.rows() * PARTIAL_ROW_BYTES);
        for r in 0..self.rows() {
            for &x in self.o_row(r) {
                out.extend_from_slice(&bf16::from_f32(x).to_le_bytes());
            }
            out.extend_from_slice(&self.m[r].to_le_bytes());
            out.extend_from_slice(&self.l[r].to_le_bytes());
        }
        out
    }

    /// Decodes [`Partial::to_wire`]'s bytes, validating them (they come from a peer).
    pub fn from_wire(bytes: &[u8]) -> Result<Self, KernelError> {
        if !bytes.len().is_multiple_of(PARTIAL_ROW_BYTES) {
            return Err(KernelError::Shape {
                what: "partial wire bytes (1032 per row)",
                expected: bytes.len() / PARTIAL_ROW_BYTES * PARTIAL_ROW_BYTES,
                got: bytes.len(),
            });
        }
        let mq = bytes.len() / PARTIAL_ROW_BYTES;
        let mut p = Self::empty(mq);
        for (r, row) in bytes.chunks_exact(PARTIAL_ROW_BYTES).enumerate() {
            let (o, ml) = row.split_at(D_LATENT * 2);
            for (d, b) in o.chunks_exact(2).enumerate() {
                p.o[r * D_LATENT + d] = bf16::to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
            p.m[r] = f32::from_le_bytes([ml[0], ml[1], ml[2], ml[3]]);
            p.l[r] = f32::from_le_bytes([ml[4], ml[5], ml[6], ml[7]]);
        }
        p.validate()?;
        Ok(p)
    }
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
