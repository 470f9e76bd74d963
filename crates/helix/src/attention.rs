//! Attention over one rank's KV shard, and the exact merge of shards' partials.
//!
//! A partial is FlashAttention's sufficient statistic per query row (see kvroute-kernels'
//! `Partial`): `o` normalised, `m` the largest scaled logit, `l` the softmax denominator
//! relative to `m`; a shard with no tokens gives `(0, -inf, 0)`, the merge's identity. MLA
//! runs kvroute-kernels' partial; GQA (other widths) computes the same statistic here; both
//! merge through kvroute-kernels' row merge.

use kvroute_kernels::{Backend, Cache, Partial, Queries, bf16};

use crate::error::Result;
use crate::model::{Attention, MLA_QK, MLA_V, Shape, element, stream};

/// Partials of `rows` query rows of width `dv`, f32.
#[derive(Debug, Clone, PartialEq)]
pub struct Partials {
    /// Output width.
    pub dv: usize,
    /// Normalised outputs, `[rows, dv]`.
    pub o: Vec<f32>,
    /// Largest scaled logit per row.
    pub m: Vec<f32>,
    /// Softmax denominator per row, relative to `m`.
    pub l: Vec<f32>,
}

impl Partials {
    /// Query rows.
    pub fn rows(&self) -> usize {
        self.m.len()
    }

    /// Bytes of one encoded row: `dv` values, `m`, `l`, f32 little-endian.
    pub const fn row_bytes(dv: usize) -> usize {
        (dv + 2) * 4
    }

    /// Rows `first..first + count` encoded into `out` (`count` rows' bytes).
    pub fn encode_rows(&self, first: usize, count: usize, out: &mut [u8]) {
        let row = Self::row_bytes(self.dv);
        for (i, dst) in out.chunks_exact_mut(row).take(count).enumerate() {
            let r = first + i;
            let values = self.o[r * self.dv..(r + 1) * self.dv]
                .iter()
                .chain([&self.m[r], &self.l[r]]);
            for (d, v) in dst.chunks_exact_mut(4).zip(values) {
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
    }

    /// Rows decoded from `bytes` (whole rows of [`Partials::row_bytes`]).
    pub fn decode(dv: usize, bytes: &[u8]) -> Self {
        let row = Self::row_bytes(dv);
        let rows = bytes.len() / row;
        let mut p = Self {
            dv,
            o: Vec::with_capacity(rows * dv),
            m: Vec::with_capacity(rows),
            l: Vec::with_capacity(rows),
        };
        for r in bytes.chunks_exact(row) {
            let mut values = r
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            p.o.extend(values.by_ref().take(dv));
            p.m.push(values.next().unwrap_or(f32::NEG_INFINITY));
            p.l.push(values.next().unwrap_or(0.0));
        }
        p
    }
}

impl Partials {
    /// Checks what a peer's partial must satisfy: `rows` rows of `dv`, `l` finite and
    /// non-negative, `m` finite where `l > 0`, `o` finite.
    pub fn validate(&self, rows: usize) -> Result<()> {
        let bad = |row: usize, why: &'static str| {
            Err(crate::HelixError::Kernel(
                kvroute_kernels::KernelError::InvalidPartial { row, why },
            ))
        };
        if self.rows() != rows || self.l.len() != rows || self.o.len() != rows * self.dv {
            return bad(0, "rows differ");
        }
        for r in 0..rows {
            if !(self.l[r].is_finite() && self.l[r] >= 0.0) {
                return bad(r, "l must be finite and non-negative");
            }
            if self.l[r] > 0.0 && !self.m[r].is_finite() {
                return bad(r, "m must be finite where l > 0");
            }
            if !self.o[r * self.dv..(r + 1) * self.dv]
                .iter()
                .all(|v| v.is_finite())
            {
                return bad(r, "o must be finite");
            }
        }
        Ok(())
    }
}

impl From<Partial> for Partials {
    fn from(p: Partial) -> Self {
        Self {
            dv: MLA_V,
            o: p.o,
            m: p.m,
            l: p.l,
        }
    }
}

/// One request's KV held by one rank: the tokens of its shard, for the KV heads of its head
/// group.
#[derive(Debug, Clone, Default)]
pub struct Shard {
    /// MLA latents, bf16 bits, `[tokens, 576]`.
    latents: Vec<u16>,
    /// GQA keys and values, `[tokens, kv_local, head_dim]`.
    keys: Vec<f32>,
    values: Vec<f32>,
    tokens: usize,
}

impl Shard {
    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Appends request `request`'s token at `position`, for KV heads `kv_heads` (all of
    /// them for MLA's one latent).
    pub fn append(
        &mut self,
        shape: &Shape,
        seed: u64,
        request: usize,
        position: u64,
        kv_heads: std::ops::Range<usize>,
    ) {
        let base = stream::KV + 4 * request as u64;
        match shape.attention {
            Attention::Mla => {
                let first = position * MLA_QK as u64;
                self.latents.extend(
                    (0..MLA_QK as u64).map(|d| bf16::from_f32(element(seed, base, first + d))),
                );
            }
            Attention::Gqa {
                kv_heads: k,
                head_dim,
            } => {
                for h in kv_heads {
                    let first = (position * k as u64 + h as u64) * head_dim as u64;
                    let range = first..first + head_dim as u64;
                    self.keys
                        .extend(range.clone().map(|i| element(seed, base, i)));
                    self.values
                        .extend(range.map(|i| element(seed, base + 1, i)));
                }
            }
        }
        self.tokens += 1;
    }

    /// Partials of query heads `heads` of one token (`q`: their rows, `[heads, qk_dim]`;
    /// bf16 bits for MLA) over this shard, whose KV heads start at `kv_first`.
    pub fn attend(
        &self,
        shape: &Shape,
        q: &Query,
        heads: std::ops::Range<usize>,
        kv_first: usize,
    ) -> Result<Partials> {
        let scale = shape.softmax_scale();
        match (shape.attention, q) {
            (Attention::Mla, Query::Mla(rows)) => {
                let queries = Queries::new(rows)?;
                let cache = Cache::contiguous(&self.latents)?;
                Ok(kvroute_kernels::partial_dense(Backend::Cpu, &queries, &cache, scale)?.into())
            }
            (Attention::Gqa { kv_heads, head_dim }, Query::Gqa(rows)) => Ok(gqa_partial(
                rows,
                heads,
                shape.q_heads / kv_heads,
                kv_first,
                self.keys.len() / (self.tokens.max(1) * head_dim),
                head_dim,
                &self.keys,
                &self.values,
                self.tokens,
                scale,
            )),
            _ => Err(crate::HelixError::Config(
                "queries of another attention kind".to_owned(),
            )),
        }
    }
}

/// One token's query rows for some heads.
#[derive(Debug, Clone)]
pub enum Query {
    /// bf16 bits, `[heads, 576]`.
    Mla(Vec<u16>),
    /// `[heads, head_dim]`.
    Gqa(Vec<f32>),
}

impl Query {
    /// Step `step`'s query of request `request` for heads `heads`.
    pub fn generate(
        shape: &Shape,
        seed: u64,
        step: u64,
        request: usize,
        heads: std::ops::Range<usize>,
    ) -> Self {
        let width = shape.qk_dim();
        let first = (request * shape.q_heads + heads.start) * width;
        let range = first as u64..(first + heads.len() * width) as u64;
        let s = stream::QUERY + step;
        match shape.attention {
            Attention::Mla => {
                Self::Mla(range.map(|i| bf16::from_f32(element(seed, s, i))).collect())
            }
            Attention::Gqa { .. } => Self::Gqa(range.map(|i| element(seed, s, i)).collect()),
        }
    }
}

/// GQA partials: query head `heads.start + i` (row `i` of `q`) reads KV head
/// `(heads.start + i) / group`, stored at `- kv_first` among the `kv_local` heads of each
/// token of `keys`/`values`.
#[allow(clippy::too_many_arguments)]
fn gqa_partial(
    q: &[f32],
    heads: std::ops::Range<usize>,
    group: usize,
    kv_first: usize,
    kv_local: usize,
    hd: usize,
    keys: &[f32],
    values: &[f32],
    tokens: usize,
    scale: f32,
) -> Partials {
    let rows = heads.len();
    let mut p = Partials {
        dv: hd,
        o: vec![0.0; rows * hd],
        m: vec![f32::NEG_INFINITY; rows],
        l: vec![0.0; rows],
    };
    if tokens == 0 {
        return p;
    }
    let mut scores = vec![0f32; tokens];
    for (i, head) in heads.enumerate() {
        let kv = head / group - kv_first;
        let qr = &q[i * hd..(i + 1) * hd];
        let at = |t: usize| (t * kv_local + kv) * hd;
        for (t, s) in scores.iter_mut().enumerate() {
            let k = &keys[at(t)..at(t) + hd];
            *s = scale * qr.iter().zip(k).map(|(a, b)| a * b).sum::<f32>();
        }
        let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let o = &mut p.o[i * hd..(i + 1) * hd];
        let mut l = 0f32;
        for (t, s) in scores.iter().enumerate() {
            let w = (s - m).exp();
            l += w;
            for (ov, vv) in o.iter_mut().zip(&values[at(t)..at(t) + hd]) {
                *ov += w * vv;
            }
        }
        o.iter_mut().for_each(|v| *v /= l);
        p.m[i] = m;
        p.l[i] = l;
    }
    p
}

/// The exact merge of `parts` (same rows, same width), every row through kvroute-kernels'
/// [`kvroute_kernels::merge_row`] (its merge's formula, for any head width up to 512).
pub fn merge(parts: &[Partials]) -> Result<Partials> {
    let dv = parts.first().map_or(MLA_V, |p| p.dv);
    let rows = parts.first().map_or(0, Partials::rows);
    for p in parts {
        if p.dv != dv {
            return Err(crate::HelixError::Kernel(
                kvroute_kernels::KernelError::InvalidPartial {
                    row: 0,
                    why: "partials of different widths",
                },
            ));
        }
        p.validate(rows)?;
    }
    let mut out = Partials {
        dv,
        o: vec![0.0; rows * dv],
        m: vec![f32::NEG_INFINITY; rows],
        l: vec![0.0; rows],
    };
    for r in 0..rows {
        let row = parts
            .iter()
            .map(|p| (p.m[r], p.l[r], &p.o[r * dv..(r + 1) * dv]));
        (out.m[r], out.l[r]) = kvroute_kernels::merge_row(row, &mut out.o[r * dv..(r + 1) * dv])?;
        if !out.o[r * dv..(r + 1) * dv].iter().all(|v| v.is_finite()) {
            return Err(crate::HelixError::Kernel(
                kvroute_kernels::KernelError::InvalidPartial {
                    row: r,
                    why: "o must be finite",
                },
            ));
        }
    }
    Ok(out)
}
