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
    assert_close_within(got, want, O_ABS, what);
}

/// [`assert_close`] with `o` within `o_abs`.
pub(crate) fn assert_close_within(got: &Partial, want: &Partial, o_abs: f32, what: &str) {
    let o_err = max_abs(&got.o, &want.o);
    eprintln!("{what}: o max abs error {o_err:.2e}");
    assert!(o_err <= o_abs, "{what}: o max abs error {o_err}");
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

/// One request of a batch test: query rows, context tokens, and sparse (k, rows per token).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Req {
    pub(crate) mq: usize,
    pub(crate) tokens: usize,
    pub(crate) sparse: Option<(usize, usize)>,
}

/// A dense request.
pub(crate) const fn dense(mq: usize, tokens: usize) -> Req {
    Req {
        mq,
        tokens,
        sparse: None,
    }
}

/// A sparse request: `heads` rows per query token, `new` query tokens, `k` indices each.
pub(crate) const fn sparse(heads: usize, new: usize, tokens: usize, k: usize) -> Req {
    Req {
        mq: heads * new,
        tokens,
        sparse: Some((k, heads)),
    }
}

/// A batch case: its name, tokens per block, and requests.
pub(crate) struct BatchCase {
    pub(crate) name: &'static str,
    pub(crate) block: usize,
    pub(crate) reqs: Vec<Req>,
}

/// The batches every backend is checked on (24 of them): varlen contexts, empty contexts and
/// all-padding selections, one token, lengths that are not a multiple of the block, blocks
/// of 1, 16, 64 and 100 tokens, every row-group size the CUDA kernel has (up to 16, 32 and 64
/// rows, and more), one and two new tokens, and batches of one request.
pub(crate) fn batch_cases() -> Vec<BatchCase> {
    let case = |name, block, reqs: &[Req]| BatchCase {
        name,
        block,
        reqs: reqs.to_vec(),
    };
    vec![
        case("one row, one token", 64, &[dense(1, 1)]),
        case("one row over 2048", 64, &[dense(1, 2048)]),
        case(
            "16 heads, varlen",
            64,
            &[dense(16, 300), dense(16, 1), dense(16, 129), dense(16, 64)],
        ),
        case(
            "an empty context among others",
            64,
            &[dense(16, 0), dense(16, 77)],
        ),
        case("16 heads x 2 tokens", 64, &[dense(32, 1000), dense(32, 65)]),
        case("64 heads", 64, &[dense(64, 513), dense(64, 90)]),
        case("128 heads", 64, &[dense(128, 700), dense(128, 33)]),
        case("128 heads x 2 tokens", 64, &[dense(256, 400)]),
        case(
            "odd rows",
            64,
            &[dense(3, 100), dense(17, 200), dense(33, 5), dense(70, 64)],
        ),
        case("blocks of 16", 16, &[dense(16, 250), dense(8, 17)]),
        case("blocks of 1", 1, &[dense(16, 40), dense(2, 3)]),
        case("blocks of 100", 100, &[dense(16, 250), dense(64, 99)]),
        case("many small requests", 64, &[dense(16, 50); 40]),
        case(
            "sparse top-64, 16 heads",
            64,
            &[sparse(16, 1, 500, 64), sparse(16, 1, 64, 64)],
        ),
        case(
            "sparse top-2048 over 4096",
            64,
            &[sparse(16, 1, 4096, 2048)],
        ),
        case(
            "sparse, 16 heads x 2 tokens",
            64,
            &[sparse(16, 2, 300, 100)],
        ),
        case(
            "sparse, 64 heads",
            64,
            &[sparse(64, 1, 800, 300), sparse(64, 2, 90, 40)],
        ),
        case("sparse, 128 heads", 64, &[sparse(128, 1, 1000, 500)]),
        case("sparse k = 1", 16, &[sparse(16, 3, 10, 1)]),
        case(
            "sparse over an empty context",
            64,
            &[sparse(16, 1, 0, 8), sparse(16, 1, 50, 8)],
        ),
        case(
            "sparse, blocks of 16, varlen",
            16,
            &[sparse(16, 1, 33, 20), sparse(16, 1, 400, 257)],
        ),
        case(
            "dense and sparse mixed",
            64,
            &[dense(16, 200), sparse(16, 1, 200, 50)],
        ),
        case("sparse, 20 rows per token", 64, &[sparse(20, 2, 150, 33)]),
        case("a long context", 64, &[dense(16, 9000)]),
    ]
}

/// A batch's data: a shared pool (bf16, and its FP8 form) whose blocks the requests' tables
/// take in a shuffled order (one spare block), each request's query rows and selection.
pub(crate) struct BatchData {
    pub(crate) block: usize,
    pub(crate) pool: Vec<u16>,
    pub(crate) pool8: Vec<u8>,
    pub(crate) q: Vec<Vec<u16>>,
    pub(crate) tables: Vec<Vec<u32>>,
    pub(crate) sel: Vec<Vec<i32>>,
    pub(crate) reqs: Vec<Req>,
}

impl BatchData {
    pub(crate) fn new(rng: &mut Rng, case: &BatchCase) -> Self {
        let block = case.block;
        let blocks: usize = case
            .reqs
            .iter()
            .map(|r| r.tokens.div_ceil(block))
            .sum::<usize>()
            + 1;
        let pool = rng.rows(blocks * block);
        let pool8 = kvroute_kernels::fp8::quantize(&pool).unwrap_or_default();
        let mut order: Vec<u32> = (0..blocks as u32).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.range(0, i));
        }
        let (mut q, mut tables, mut sel, mut next) = (vec![], vec![], vec![], 0);
        for r in &case.reqs {
            q.push(rng.rows(r.mq));
            let used = r.tokens.div_ceil(block);
            tables.push(order[next..next + used].to_vec());
            next += used;
            sel.push(match r.sparse {
                None => vec![],
                Some((k, heads)) if r.tokens == 0 => vec![-1; r.mq / heads * k],
                Some((k, heads)) => rng.selection(r.mq / heads, k, r.tokens),
            });
        }
        Self {
            block,
            pool,
            pool8,
            q,
            tables,
            sel,
            reqs: case.reqs.clone(),
        }
    }

    /// The requests over the pool.
    pub(crate) fn requests(&self) -> Vec<kvroute_kernels::DecodeRequest<'_>> {
        use kvroute_kernels::{DecodeRequest, Queries, Selection};
        self.reqs
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let q = Queries::new(&self.q[i]).unwrap();
                match r.sparse {
                    None => DecodeRequest::dense(q, &self.tables[i], r.tokens),
                    Some((k, heads)) => {
                        let sel = Selection::new(&self.sel[i], k, heads, r.mq, r.tokens).unwrap();
                        DecodeRequest::sparse(q, &self.tables[i], r.tokens, sel)
                    }
                }
            })
            .collect()
    }

    /// The pool, bf16 or FP8.
    pub(crate) fn pool(&self, fp8: bool) -> kvroute_kernels::KvPool<'_> {
        if fp8 {
            kvroute_kernels::KvPool::fp8(&self.pool8, self.block).unwrap()
        } else {
            kvroute_kernels::KvPool::bf16(&self.pool, self.block).unwrap()
        }
    }
}
