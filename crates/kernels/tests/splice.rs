//! The delta-rotation splice: re-rotating by `to - from` equals rotating to `to` directly;
//! delta 0 is the identity; latent dims are copied bit-exactly into the pages the block table
//! names; and paper 000 section 3.3's negative result: re-homing a scattered selection to
//! contiguous offsets changes attention substantially.

// Tests panic on failure: that is how a test reports it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Rng, SCALE};
use kvroute_kernels::bf16;
use kvroute_kernels::layout::{D_LATENT, D_QK, PAGE_TOKENS};
use kvroute_kernels::{
    Backend, Cache, Queries, Rope, RopeLayout, Selection, SpliceJob, Yarn, partial_sparse, splice,
};

fn ropes() -> Vec<Rope> {
    let mut v = Vec::new();
    for layout in [RopeLayout::Interleaved, RopeLayout::Half] {
        v.push(Rope::plain(10_000.0, layout).unwrap());
        v.push(Rope::yarn(10_000.0, Yarn::DEEPSEEK, layout).unwrap());
    }
    v
}

/// Runs a one-layer splice of `rows` from `from` to `to` into a fresh pool (identity table),
/// returning the rows in token order.
fn spliced(backend: Backend, rows: &[u16], from: &[i64], to: &[i64], rope: Rope) -> Vec<u16> {
    let n = from.len();
    let pages = n.div_ceil(PAGE_TOKENS);
    let mut pool = vec![0u16; pages * PAGE_TOKENS * D_QK];
    let table: Vec<u32> = (0..pages as u32).collect();
    let job = SpliceJob::new(rows, 1, from, to, rope, &mut pool, &table).unwrap();
    splice(backend, job).unwrap();
    pool.truncate(n * D_QK);
    pool
}

/// The largest difference between two spliced row sets in the RoPE band, in bf16 ulps of each
/// rotation pair's magnitude (a rotation keeps the pair's length; rounding errors of either
/// component spread into both, so a component near zero is judged at its pair's scale).
fn worst_ulps(a: &[u16], b: &[u16], layout: RopeLayout) -> f32 {
    let mut worst = 0f32;
    for (ra, rb) in a.chunks_exact(D_QK).zip(b.chunks_exact(D_QK)) {
        assert_eq!(
            ra[..D_LATENT],
            rb[..D_LATENT],
            "latent dims are copied, never rounded"
        );
        for i in 0..32 {
            let (x, y) = layout.pair(i);
            let f = |r: &[u16], d: usize| bf16::to_f32(r[D_LATENT + d]);
            let norm = f(ra, x).hypot(f(ra, y));
            let unit = bf16::ulp(norm).max(f32::MIN_POSITIVE);
            for d in [x, y] {
                worst = worst.max((f(ra, d) - f(rb, d)).abs() / unit);
            }
        }
    }
    worst
}

#[test]
fn rotating_to_old_then_by_delta_equals_rotating_to_new_within_2_bf16_ulps() {
    let mut rng = Rng::new(160);
    let n = 512;
    let raw = rng.rows(n);
    let zero = vec![0i64; n];
    for rope in ropes() {
        let old: Vec<i64> = (0..n).map(|_| rng.range(0, 163_840) as i64).collect();
        let new: Vec<i64> = (0..n).map(|_| rng.range(0, 163_840) as i64).collect();
        for backend in [Backend::Reference, Backend::Cpu] {
            let direct = spliced(backend, &raw, &zero, &new, rope);
            let at_old = spliced(backend, &raw, &zero, &old, rope);
            let moved = spliced(backend, &at_old, &old, &new, rope);
            let worst = worst_ulps(&direct, &moved, rope.layout());
            // Two bf16 roundings (at old, then at new) against one: each is at most half an
            // ulp of the pair's magnitude per component, so 2 ulps bound the difference.
            assert!(
                worst <= 2.0,
                "{:?} {backend:?}: {worst} ulps",
                rope.layout()
            );
        }
    }
}

#[test]
fn delta_zero_is_the_identity_and_latents_are_copied_bit_exactly() {
    let mut rng = Rng::new(1);
    let n = 200;
    let rows = rng.rows(n);
    let pos: Vec<i64> = (0..n as i64).map(|i| i * 811).collect();
    let shifted: Vec<i64> = pos.iter().map(|p| p + 12_345).collect();
    for rope in ropes() {
        for backend in [Backend::Reference, Backend::Cpu] {
            assert_eq!(spliced(backend, &rows, &pos, &pos, rope), rows, "delta 0");
            let out = spliced(backend, &rows, &pos, &shifted, rope);
            for t in 0..n {
                let (a, b) = (&out[t * D_QK..], &rows[t * D_QK..]);
                assert_eq!(a[..D_LATENT], b[..D_LATENT], "latent of token {t}");
                assert_ne!(
                    a[D_LATENT..D_QK],
                    b[D_LATENT..D_QK],
                    "RoPE band of token {t} moved"
                );
            }
        }
    }
}

#[test]
fn every_cpu_splice_is_bit_identical_to_the_reference_copying_or_in_place() {
    let mut rng = Rng::new(27);
    let (layers, n) = (3, 150);
    let src = rng.rows(layers * n);
    // Half the tokens share one delta (a chunk re-homed as a whole: one angle table), the rest
    // are random (one table each), and tokens 0 and 1 repeat one delta out of order.
    let from: Vec<i64> = (0..n).map(|_| rng.range(0, 100_000) as i64).collect();
    let mut to: Vec<i64> = from
        .iter()
        .enumerate()
        .map(|(t, &f)| {
            if t % 2 == 0 {
                f + 4_096
            } else {
                rng.range(0, 100_000) as i64
            }
        })
        .collect();
    to[1] = from[1] + (to[0] - from[0]);
    let pages_per_layer = n.div_ceil(PAGE_TOKENS);
    // A shuffled, sparse block table over a larger pool.
    let mut table: Vec<u32> = (0..20).collect();
    for i in (1..table.len()).rev() {
        table.swap(i, rng.range(0, i));
    }
    table.truncate(layers * pages_per_layer);
    let slot = |layer: usize, t: usize| {
        table[layer * pages_per_layer + t / PAGE_TOKENS] as usize * PAGE_TOKENS + t % PAGE_TOKENS
    };
    let mut backends = vec![Backend::Cpu];
    backends.extend(common::isas().into_iter().map(Backend::CpuWith));
    for layout in [RopeLayout::Interleaved, RopeLayout::Half] {
        let rope = Rope::yarn(10_000.0, Yarn::DEEPSEEK, layout).unwrap();
        let copying = |backend| {
            let mut pool = vec![0xdeadu16; 20 * PAGE_TOKENS * D_QK];
            let job = SpliceJob::new(&src, layers, &from, &to, rope, &mut pool, &table).unwrap();
            splice(backend, job).unwrap();
            pool
        };
        let in_place = |backend| {
            // The rows where fetch's paged writes would have put them.
            let mut pool = vec![0xdeadu16; 20 * PAGE_TOKENS * D_QK];
            for layer in 0..layers {
                for t in 0..n {
                    let (d, s) = (slot(layer, t) * D_QK, (layer * n + t) * D_QK);
                    pool[d..d + D_QK].copy_from_slice(&src[s..s + D_QK]);
                }
            }
            let job = SpliceJob::in_place(layers, &from, &to, rope, &mut pool, &table).unwrap();
            assert!(job.is_in_place());
            splice(backend, job).unwrap();
            pool
        };
        let want = copying(Backend::Reference);
        assert!(
            in_place(Backend::Reference) == want,
            "reference in place differs"
        );
        for &b in &backends {
            assert!(
                copying(b) == want,
                "{b:?} differs from the reference ({layout:?})"
            );
            assert!(in_place(b) == want, "{b:?} in place differs ({layout:?})");
        }
        // Every row landed where the table says, and nothing else was touched.
        let mut touched = vec![false; 20 * PAGE_TOKENS];
        for layer in 0..layers {
            for t in 0..n {
                let at = slot(layer, t);
                touched[at] = true;
                let s = (layer * n + t) * D_QK;
                assert_eq!(want[at * D_QK..at * D_QK + D_LATENT], src[s..s + D_LATENT]);
            }
        }
        for (at, _) in touched.iter().enumerate().filter(|(_, t)| !**t) {
            assert!(
                want[at * D_QK..(at + 1) * D_QK]
                    .iter()
                    .all(|&x| x == 0xdead)
            );
        }
    }
}

/// Paper 000 section 3.3: attending a scattered selection at the entries' canonical positions
/// is what sparse attention computes; re-homing them to contiguous offsets (the rotation a
/// contiguous-reuse fetch applies) "diverges from the reference by 25-56%".
#[test]
fn rehoming_a_scattered_selection_to_contiguous_offsets_changes_attention_substantially() {
    let mut rng = Rng::new(56);
    let (ct, k, h) = (8192usize, 2048usize, 16usize);
    let rope = Rope::yarn(10_000.0, Yarn::DEEPSEEK, RopeLayout::Interleaved).unwrap();
    // Raw keys rotated to their canonical positions 0..ct.
    let raw = rng.rows(ct);
    let zero = vec![0i64; ct];
    let canonical_pos: Vec<i64> = (0..ct as i64).collect();
    let cache_rows = spliced(Backend::Cpu, &raw, &zero, &canonical_pos, rope);
    // The query token sits at position ct; its heads' RoPE dims are rotated there too.
    let q_raw = rng.rows(h);
    let q_rows = spliced(Backend::Cpu, &q_raw, &vec![0; h], &vec![ct as i64; h], rope);
    let mut picked: Vec<i32> = (0..ct as i32).collect();
    for i in (1..picked.len()).rev() {
        picked.swap(i, rng.range(0, i));
    }
    picked.truncate(k);
    picked.sort_unstable();
    let q = Queries::new(&q_rows).unwrap();
    let cache = Cache::contiguous(&cache_rows).unwrap();
    let sel = Selection::new(&picked, k, h, h, ct).unwrap();
    let truth = partial_sparse(Backend::Cpu, &q, &cache, &sel, SCALE).unwrap();
    // Re-home: the selected rows moved to offsets ct - k .. ct (contiguous, just before the
    // query), as if the selection were a fetched contiguous chunk.
    let gathered: Vec<u16> = picked
        .iter()
        .flat_map(|&t| {
            cache_rows[t as usize * D_QK..(t as usize + 1) * D_QK]
                .iter()
                .copied()
        })
        .collect();
    let from: Vec<i64> = picked.iter().map(|&t| i64::from(t)).collect();
    let to: Vec<i64> = (0..k as i64).map(|j| (ct - k) as i64 + j).collect();
    let rehomed_rows = spliced(Backend::Cpu, &gathered, &from, &to, rope);
    let rehomed_cache = Cache::contiguous(&rehomed_rows).unwrap();
    let all: Vec<i32> = (0..k as i32).collect();
    let sel = Selection::new(&all, k, h, h, k).unwrap();
    let rehomed = partial_sparse(Backend::Cpu, &q, &rehomed_cache, &sel, SCALE).unwrap();
    // Relative L2 error of o per head, as a fraction of the true output's norm.
    let mut worst = 0f64;
    let mut mean = 0f64;
    for r in 0..h {
        let (a, b) = (truth.o_row(r), rehomed.o_row(r));
        let diff: f64 = a
            .iter()
            .zip(b)
            .map(|(x, y)| f64::from(x - y).powi(2))
            .sum::<f64>()
            .sqrt();
        let norm: f64 = a.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
        worst = worst.max(diff / norm);
        mean += diff / norm / h as f64;
    }
    eprintln!(
        "re-homing error: mean {:.0}% worst {:.0}% of |o| (paper: 25-56%)",
        mean * 100.0,
        worst * 100.0
    );
    assert!(
        mean > 0.1,
        "re-homing should change attention substantially, got {mean}"
    );
    let _ = bf16::to_f32(0);
}
