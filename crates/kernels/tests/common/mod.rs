//! Deterministic inputs for the kernel tests (fixed seeds, no dependencies).

#![allow(dead_code)]

use kvroute_kernels::layout::D_QK;
use kvroute_kernels::{Isa, Partial, bf16};

/// Every instruction set this CPU runs, widest first; each one it lacks is recorded as a skip
/// of the calling test, so `cargo xtask test` names what this machine did not check.
pub(crate) fn isas() -> Vec<Isa> {
    let all = [Isa::Avx512Bf16, Isa::Avx512, Isa::Avx2, Isa::Scalar];
    for isa in all.iter().filter(|i| !i.is_available()) {
        kvroute_testkit::skip!("this CPU cannot run {isa:?}");
    }
    all.into_iter().filter(|i| i.is_available()).collect()
}

/// SplitMix64: small, fast, good enough for test data.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub(crate) fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in `lo..=hi`.
    pub(crate) fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }

    /// Standard normal (Box-Muller).
    pub(crate) fn normal(&mut self) -> f64 {
        let u = self.uniform().max(1e-300);
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }

    /// `n` bf16 values ~ N(0, 1).
    pub(crate) fn bf16s(&mut self, n: usize) -> Vec<u16> {
        (0..n).map(|_| bf16::from_f64(self.normal())).collect()
    }

    /// Selected indices `[tokens, k]` into `ct` tokens: about 1 in 10 is padding (-1), and
    /// when k > 2 each token's entries 1 and 2 repeat entry 0 (a duplicate, counted twice).
    pub(crate) fn selection(&mut self, tokens: usize, k: usize, ct: usize) -> Vec<i32> {
        let mut idx: Vec<i32> = (0..tokens * k)
            .map(|_| match self.range(0, 9) {
                0 => -1,
                _ => self.range(0, ct - 1) as i32,
            })
            .collect();
        if k > 2 {
            idx[1] = idx[0].max(0);
            idx[2] = idx[0].max(0);
        }
        idx
    }

    /// `rows` random 576-wide bf16 rows.
    pub(crate) fn rows(&mut self, rows: usize) -> Vec<u16> {
        self.bf16s(rows * D_QK)
    }
}

/// DeepSeek-V2-Lite's softmax scale (qk_head_dim 192, YaRN factor 40, mscale 0.707).
pub(crate) const SCALE: f32 = 0.1147;

/// Largest |a - b| over two equal-length slices.
pub(crate) fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Dense (mq, ct) shapes: the corners of the kernels issue's ranges (Mq 1..512, ct 1..8192)
/// and random shapes in between, sized so the f64 reference stays quick.
pub(crate) fn dense_shapes(rng: &mut Rng) -> Vec<(usize, usize)> {
    let mut shapes = vec![
        (1, 1),
        (1, 8192),
        (512, 1),
        (512, 64),
        (16, 2048),
        (128, 300),
        (3, 65),
        // Two rows, tiles whose keys are not a multiple of four (the few-rows paths' tails).
        (2, 131),
    ];
    for _ in 0..6 {
        let mq = rng.range(1, 64);
        shapes.push((mq, rng.range(1, 40_000 / mq)));
    }
    shapes
}

/// Bounds of `assert_close` (justified in tests/against_reference.rs).
pub(crate) const O_ABS: f32 = 5e-5;
pub(crate) const LSE_ABS: f32 = 1e-4;
pub(crate) const LSE_REL: f32 = 8.0 / 65536.0;

pub(crate) fn assert_close(got: &Partial, want: &Partial, what: &str) {
    let o_err = max_abs(&got.o, &want.o);
    eprintln!("{what}: o max abs error {o_err:.2e}");
    assert!(o_err <= O_ABS, "{what}: o max abs error {o_err}");
    for r in 0..want.rows() {
        let (g, w) = (got.lse(r), want.lse(r));
        if w == f32::NEG_INFINITY {
            assert_eq!(g, w, "{what}: row {r} attended nothing");
            continue;
        }
        let err = (g - w).abs();
        assert!(
            err <= LSE_ABS + LSE_REL * w.abs(),
            "{what}: row {r} lse {g} vs {w}"
        );
    }
}
