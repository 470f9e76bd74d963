//! The launch plan, and the kernel itself under the CPU emulation (`emu/`: decode.cu compiled
//! as C++ with each thread a fiber and the PTX it uses emulated), against the f64 reference.
//! The emulation needs a C++20 compiler (`g++`); without one these tests are recorded as
//! skipped.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use super::*;
use crate::batch::{self, Host, KvRows};
use crate::bf16;
use crate::fp8;
use crate::layout::{D_QK, Queries, Selection};

/// DeepSeek-V2-Lite's softmax scale, as the other kernel tests use.
const SCALE: f32 = 0.1147;

/// The emulator binary, built once per test process from decode.cu (`Err`: why not).
fn emulator() -> Result<&'static Path, String> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/cuda/emu");
            let dir = std::env::temp_dir().join(format!("kvroute-emu-{}", std::process::id()));
            std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
            let exe = dir.join("emu");
            let out = Command::new("g++")
                .args(["-std=c++20", "-O2", "-Wall", "-Wno-unknown-pragmas", "-o"])
                .arg(&exe)
                .arg(src.join("main.cpp"))
                .output()
                .map_err(|e| format!("g++ could not be run ({e})"))?;
            if !out.status.success() {
                // A compiler that runs and rejects decode.cu is a failure, not a skip.
                panic!(
                    "decode.cu did not compile for the emulation:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            Ok(exe)
        })
        .as_ref()
        .map(PathBuf::as_path)
        .map_err(Clone::clone)
}

/// The emulator, or `None` with the test recorded as skipped.
fn emulator_or_skip(test: &str) -> Option<&'static Path> {
    match emulator() {
        Ok(p) => Some(p),
        Err(why) => {
            kvroute_testkit::record(&format!("kvroute-kernels: cuda::decode::{test}"), &why);
            None
        }
    }
}

fn blob(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

fn as_bytes<T: Copy>(v: &[T]) -> &[u8] {
    // SAFETY: plain integers; the slice covers the same memory.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// What one emulated launch wrote.
struct Emulated {
    o: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    wire: Vec<u8>,
    counters: Vec<u8>,
}

/// Runs `plan` over `kv` in the emulator, in `mode`.
fn emulate(exe: &Path, plan: &DecodePlan, kv: &[u8], mode: i32) -> Emulated {
    let mut input = Vec::new();
    for v in [
        plan.mt as i32,
        i32::from(plan.shape.fp8),
        plan.shape.block_tokens as i32,
        plan.rows as i32,
        mode,
        plan.work_items() as i32,
        plan.splits as i32,
        plan.scale.to_bits() as i32,
        0,
        0,
    ] {
        input.extend_from_slice(&v.to_le_bytes());
    }
    for b in [
        as_bytes(&plan.q),
        kv,
        as_bytes(&plan.tables),
        as_bytes(&plan.reqs),
        as_bytes(&plan.work),
        as_bytes(&plan.sel),
    ] {
        blob(&mut input, b);
    }
    let dir = exe.parent().unwrap();
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let (inp, outp) = (dir.join(format!("in-{n}")), dir.join(format!("out-{n}")));
    std::fs::write(&inp, &input).unwrap();
    let status = Command::new(exe).arg(&inp).arg(&outp).status().unwrap();
    assert!(status.success(), "the emulated launch failed");
    let out = std::fs::read(&outp).unwrap();
    let _ = std::fs::remove_file(&inp);
    let _ = std::fs::remove_file(&outp);
    let mut at = 0;
    let mut next = || {
        let n = u64::from_le_bytes(out[at..at + 8].try_into().unwrap()) as usize;
        at += 8 + n;
        &out[at - n..at]
    };
    let (o, m, l) = (floats(next()), floats(next()), floats(next()));
    let wire = next().to_vec();
    Emulated {
        o,
        m,
        l,
        wire,
        counters: next().to_vec(),
    }
}

/// The per-request partials of an emulated launch: mode 1 as written, mode 2 decoded from
/// the wire.
fn partials(plan: &DecodePlan, e: &Emulated, mode: i32) -> Vec<Partial> {
    let all = if mode == 2 {
        Partial::from_wire(&e.wire).expect("wire rows decode")
    } else {
        Partial {
            o: e.o.clone(),
            m: e.m.clone(),
            l: e.l.clone(),
        }
    };
    plan.row_starts
        .windows(2)
        .map(|w| Partial {
            o: all.o[w[0] * D_LATENT..w[1] * D_LATENT].to_vec(),
            m: all.m[w[0]..w[1]].to_vec(),
            l: all.l[w[0]..w[1]].to_vec(),
        })
        .collect()
}

/// SplitMix64 test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn normal(&mut self) -> f64 {
        let u = ((self.next() >> 11) as f64 / (1u64 << 53) as f64).max(1e-300);
        let v = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn bf16s(&mut self, n: usize) -> Vec<u16> {
        (0..n).map(|_| bf16::from_f64(self.normal())).collect()
    }
}

/// One request's shape: query rows, context tokens, and sparse (k, rows per token).
#[derive(Clone, Copy, Debug)]
struct Shape {
    mq: usize,
    tokens: usize,
    sparse: Option<(usize, usize)>,
}

/// A batch's data: the pool (bf16, and its FP8 form), and each request's rows, table, and
/// selection; tables take the pool's blocks in a shuffled order.
struct Data {
    pool: Vec<u16>,
    pool8: Vec<u8>,
    block: usize,
    q: Vec<Vec<u16>>,
    tables: Vec<Vec<u32>>,
    sel: Vec<Vec<i32>>,
    shapes: Vec<Shape>,
}

impl Data {
    fn new(seed: u64, block: usize, shapes: &[Shape]) -> Self {
        let mut rng = Rng(seed);
        let blocks: usize = shapes
            .iter()
            .map(|s| s.tokens.div_ceil(block))
            .sum::<usize>()
            + 1;
        let pool = rng.bf16s(blocks * block * D_QK);
        let pool8 = fp8::quantize(&pool).unwrap();
        let mut order: Vec<u32> = (0..blocks as u32).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i + 1));
        }
        let mut next = 0;
        let (mut q, mut tables, mut sel) = (Vec::new(), Vec::new(), Vec::new());
        for s in shapes {
            q.push(rng.bf16s(s.mq * D_QK));
            let used = s.tokens.div_ceil(block);
            tables.push(order[next..next + used].to_vec());
            next += used;
            sel.push(match s.sparse {
                None => Vec::new(),
                // About one index in eight is padding.
                Some((k, per)) => (0..s.mq / per * k)
                    .map(|_| match rng.below(8) {
                        _ if s.tokens == 0 => -1,
                        0 => -1,
                        _ => rng.below(s.tokens) as i32,
                    })
                    .collect(),
            });
        }
        // Every sparse query token repeats one index (counted twice, as a gather would).
        for (s, idx) in shapes.iter().zip(&mut sel) {
            if let Some((k, _)) = s.sparse
                && k >= 3
            {
                for t in idx.chunks_exact_mut(k) {
                    t[2] = t[0];
                }
            }
        }
        Self {
            pool,
            pool8,
            block,
            q,
            tables,
            sel,
            shapes: shapes.to_vec(),
        }
    }

    fn requests(&self) -> Vec<DecodeRequest<'_>> {
        self.shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let q = Queries::new(&self.q[i]).unwrap();
                match s.sparse {
                    None => DecodeRequest::dense(q, &self.tables[i], s.tokens),
                    Some((k, per)) => {
                        let sel = Selection::new(&self.sel[i], k, per, s.mq, s.tokens).unwrap();
                        DecodeRequest::sparse(q, &self.tables[i], s.tokens, sel)
                    }
                }
            })
            .collect()
    }

    fn pool(&self, fp8: bool) -> KvPool<'_> {
        if fp8 {
            KvPool::fp8(&self.pool8, self.block).unwrap()
        } else {
            KvPool::bf16(&self.pool, self.block).unwrap()
        }
    }
}

/// The emulated kernel against the f64 reference for `shapes` over blocks of `block` tokens,
/// f32 rows and wire rows, as one split and as several (the last block of each work item
/// combining, its counter left at zero).
fn check(test: &str, seed: u64, block: usize, fp8: bool, shapes: &[Shape]) {
    // One split, and three (uneven: a split may get fewer tiles than the others, or none).
    check_splits(test, seed, block, fp8, shapes, &[1, 3]);
}

/// [`check`] with each of `split_counts`.
fn check_splits(
    test: &str,
    seed: u64,
    block: usize,
    fp8: bool,
    shapes: &[Shape],
    split_counts: &[usize],
) {
    let Some(exe) = emulator_or_skip(test) else {
        return;
    };
    let data = Data::new(seed, block, shapes);
    let requests = data.requests();
    let pool = data.pool(fp8);
    let want = batch::host(Host::Reference, &pool, &requests, SCALE).unwrap();
    let kv = pool.bytes();
    for &splits in split_counts {
        let plan =
            DecodePlan::with_splits(pool.shape(), &requests, SCALE, |_, _, _| splits).unwrap();
        for mode in [1, 2] {
            let e = emulate(exe, &plan, kv, mode);
            assert!(
                e.counters.iter().all(|&b| b == 0),
                "{test}: counters left set"
            );
            let got = partials(&plan, &e, mode);
            let what = format!("{test}: {} splits, mode {mode}", plan.splits);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                compare(g, w, mode == 2, &format!("{what}, request {i}"));
            }
        }
    }
}

/// bf16 P (at most 2^-9 relative per weight) moves o by at most 2^-9 of the largest |v|
/// (N(0, 1) rows: under 4.5, so 8e-3 bounds it; under 2e-3 here, 5.04e-3 at worst on an H200),
/// and 2e-2 with the wire's own bf16 rounding of o (2^-9 of |o|). lse sums f32 weights, so it is
/// as close as f32 scores allow.
fn compare(got: &Partial, want: &Partial, wire: bool, what: &str) {
    let tol_o = if wire { 2e-2 } else { 8e-3 };
    assert_eq!(got.rows(), want.rows(), "{what}");
    for r in 0..want.rows() {
        let (g, w) = (got.lse(r), want.lse(r));
        assert!(
            g == w || (g - w).abs() <= 1e-4 * w.abs().max(1.0),
            "{what} row {r}: lse {g} against {w}"
        );
        let worst = got
            .o_row(r)
            .iter()
            .zip(want.o_row(r))
            .map(|(a, b)| (a - b).abs())
            .fold(
                0.0f32,
                |acc, x| if x.is_nan() { f32::NAN } else { acc.max(x) },
            );
        assert!(worst <= tol_o, "{what} row {r}: o off by {worst}");
    }
}

#[test]
fn the_emulated_layouts_are_decode_rs_layouts() {
    let Some(exe) = emulator_or_skip("the_emulated_layouts_are_decode_rs_layouts") else {
        return;
    };
    let out = Command::new(exe).arg("--layout").output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let mut seen = 0;
    for line in text.lines() {
        let v: Vec<usize> = line
            .split_whitespace()
            .map(|x| x.parse().unwrap())
            .collect();
        let (stages, bytes) = decode_layout(v[0], v[1] == 1);
        assert_eq!((stages, bytes), (v[2], v[3]), "MT {} FP8 {}", v[0], v[1]);
        // Within a Hopper SM's 227 KB of shared memory per block.
        assert!(bytes <= 232_448, "{bytes}");
        seen += 1;
    }
    assert_eq!(seen, 6);
}

#[test]
fn dense_batches_of_one_row_tile_match_the_reference() {
    let shapes = [
        Shape {
            mq: 16,
            tokens: 100,
            sparse: None,
        },
        Shape {
            mq: 5,
            tokens: 33,
            sparse: None,
        },
        Shape {
            mq: 1,
            tokens: 0,
            sparse: None,
        },
        Shape {
            mq: 3,
            tokens: 1,
            sparse: None,
        },
        // Enough tiles that a split's index loads run ahead of its copies.
        Shape {
            mq: 16,
            tokens: 700,
            sparse: None,
        },
    ];
    check("dense_m1", 1, 16, false, &shapes);
}

#[test]
fn dense_batches_of_two_and_four_row_tiles_match_the_reference() {
    let m2 = [
        Shape {
            mq: 32,
            tokens: 70,
            sparse: None,
        },
        Shape {
            mq: 20,
            tokens: 64,
            sparse: None,
        },
    ];
    check("dense_m2", 2, 64, false, &m2);
    let m4 = [
        Shape {
            mq: 71,
            tokens: 90,
            sparse: None,
        },
        Shape {
            mq: 48,
            tokens: 7,
            sparse: None,
        },
        Shape {
            mq: 64,
            tokens: 400,
            sparse: None,
        },
    ];
    check("dense_m4", 3, 8, false, &m4);
}

/// More (row, split) states than the freed pipeline stages hold: the last block combines its
/// rows in groups (two here, of 35 and 29 rows bf16, 37 and 27 FP8); most splits have no
/// keys and weigh nothing.
#[test]
fn a_combine_of_many_splits_goes_in_row_groups() {
    let shapes = [Shape {
        mq: 64,
        tokens: 300,
        sparse: None,
    }];
    check_splits("grouped_bf16", 8, 16, false, &shapes, &[200]);
    check_splits("grouped_fp8", 9, 16, true, &shapes, &[200]);
}

#[test]
fn sparse_batches_match_the_reference() {
    let shapes = [
        Shape {
            mq: 32,
            tokens: 150,
            sparse: Some((40, 16)),
        },
        Shape {
            mq: 16,
            tokens: 9,
            sparse: Some((5, 16)),
        },
        Shape {
            mq: 16,
            tokens: 900,
            sparse: Some((400, 16)),
        },
    ];
    check("sparse_m1", 4, 32, false, &shapes);
    let wide = [Shape {
        mq: 128,
        tokens: 77,
        sparse: Some((33, 64)),
    }];
    check("sparse_m4", 5, 16, false, &wide);
}

#[test]
fn fp8_batches_match_the_reference_over_the_dequantized_rows() {
    let shapes = [
        Shape {
            mq: 16,
            tokens: 120,
            sparse: Some((50, 16)),
        },
        Shape {
            mq: 2,
            tokens: 40,
            sparse: None,
        },
        Shape {
            mq: 16,
            tokens: 500,
            sparse: Some((300, 16)),
        },
    ];
    check("fp8_m1", 6, 64, true, &shapes);
    let wide = [Shape {
        mq: 64,
        tokens: 60,
        sparse: Some((20, 64)),
    }];
    check("fp8_m4", 7, 16, true, &wide);
}

#[test]
fn work_items_follow_the_row_groups_and_splits_the_keys() {
    let data = Data::new(
        9,
        64,
        &[
            Shape {
                mq: 200,
                tokens: 4096,
                sparse: None,
            },
            Shape {
                mq: 256,
                tokens: 8192,
                sparse: Some((2048, 128)),
            },
        ],
    );
    let requests = data.requests();
    let plan = DecodePlan::new(data.pool(false).shape(), &requests, SCALE, 132).unwrap();
    assert_eq!(plan.mt, 4);
    // 200 rows in blocks of 64 (4 items, the last of 8 rows), then 2 tokens x 2 halves.
    let work: Vec<[i32; 4]> = plan
        .work
        .chunks_exact(4)
        .map(|w| w.try_into().unwrap())
        .collect();
    assert_eq!(work.len(), 8);
    assert_eq!(work[3], [0, 192, 8, -1]);
    assert_eq!(work[4], [1, 200, 64, 0]);
    assert_eq!(work[7], [1, 200 + 192, 64, 2048]);
    assert_eq!(plan.row_starts, vec![0, 200, 456]);
    // 8 items on 132 SMs: split so that every SM has work.
    assert!(
        plan.splits > 1 && 8 * plan.splits <= 2 * 132,
        "{}",
        plan.splits
    );
    assert_eq!(plan.tables.len(), 64 + 128);
    assert_eq!(&plan.reqs[..3], &[0, 4096, 4096]);
    assert_eq!(&plan.reqs[4..7], &[64, 8192, 2048]);
}

#[test]
fn splits_fill_the_sms_without_a_ragged_wave() {
    // One request, Mq = 1 over 2048 keys: as many splits as the keys allow.
    assert_eq!(choose_splits(1, 64, 1, 132), 32);
    // 64 requests of one row tile on 132 SMs: two splits, one wave.
    assert_eq!(choose_splits(64, 128, 16, 132), 2);
    // A full wave or more: no split.
    assert_eq!(choose_splits(128, 256, 1, 132), 1);
    assert_eq!(choose_splits(256, 256, 1, 132), 1);
    // Few keys: no split below MIN_TILES_PER_SPLIT tiles each.
    assert_eq!(choose_splits(1, 3, 1, 132), 2);
    assert_eq!(choose_splits(1, 2, 1, 132), 1);
    for work in [0, 1, 7, 100, 10_000] {
        for tiles in [0, 1, 5, 1000, 100_000] {
            for rows in [1, 16, 64] {
                let s = choose_splits(work, tiles, rows, 132);
                assert!((1..=MAX_SPLITS).contains(&s));
            }
        }
    }
}

#[test]
fn many_rows_split_less_as_their_combine_outweighs_their_keys() {
    // One request over 2048 keys: 16 rows read back 2 KB a split and row, so 8 splits, not
    // 32; 64 rows, 4.
    assert_eq!(choose_splits(1, 64, 16, 132), 8);
    assert_eq!(choose_splits(1, 64, 64, 132), 4);
    // Four items of 64 rows (Mq = 256): as many.
    assert_eq!(choose_splits(4, 64, 64, 132), 4);
}

/// A batch the host refuses never reaches a plan: bad tables and selections are typed errors
/// naming the request.
#[test]
fn plans_refuse_what_the_batch_check_refuses() {
    let data = Data::new(
        10,
        16,
        &[Shape {
            mq: 4,
            tokens: 20,
            sparse: None,
        }],
    );
    let q = Queries::new(&data.q[0]).unwrap();
    let pool = data.pool(false);
    let bad = [DecodeRequest::dense(q, &[0], 20)];
    assert!(matches!(
        DecodePlan::new(pool.shape(), &bad, SCALE, 132),
        Err(KernelError::Request { request: 0, .. })
    ));
    assert!(DecodePlan::new(pool.shape(), &data.requests(), f32::INFINITY, 132).is_err());
    match pool.rows() {
        KvRows::Bf16(rows) => assert_eq!(rows.len(), pool.shape().blocks * 16 * D_QK),
        KvRows::Fp8(_) => unreachable!(),
    }
}
