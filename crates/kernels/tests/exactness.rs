//! Paper 000 section 3.3: splitting the attended set over M holders and merging their partials
//! reproduces single-instance attention over the whole set, to f32 round-off (the paper: at
//! most 4e-7 max abs, for M up to 8, contiguous or scattered disjoint subsets), and through the
//! bf16 wire to the bf16 noise floor.

// Tests panic on failure: that is how a test reports it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{Rng, SCALE, max_abs};
use kvroute_kernels::{Backend, Cache, Partial, Queries, Selection, merge, partial_sparse};

/// Split `selected` (token indices) into `m` disjoint parts, contiguous runs or scattered.
fn split(selected: &[i32], m: usize, scattered: bool, rng: &mut Rng) -> Vec<Vec<i32>> {
    let mut parts = vec![Vec::new(); m];
    for (i, &t) in selected.iter().enumerate() {
        let holder = if scattered {
            rng.range(0, m - 1)
        } else {
            i * m / selected.len()
        };
        parts[holder].push(t);
    }
    parts
}

/// Each holder's partial over its subset (padded to the full k with -1, as a fixed-size
/// selection buffer would be).
fn partials(
    q: &Queries<'_>,
    cache: &Cache<'_>,
    parts: &[Vec<i32>],
    k: usize,
    h: usize,
    backend: Backend,
) -> Vec<Partial> {
    parts
        .iter()
        .map(|p| {
            let mut idx = p.clone();
            idx.resize(k, -1);
            let sel = Selection::new(&idx, k, h, q.len(), cache.tokens()).unwrap();
            partial_sparse(backend, q, cache, &sel, SCALE).unwrap()
        })
        .collect()
}

/// One f32 ulp at |x|.
fn ulp(x: f32) -> f32 {
    let x = x.abs();
    f32::from_bits(x.to_bits() + 1) - x
}

fn max_of(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |a, x| a.max(x.abs()))
}

fn through_wire(p: &Partial) -> Partial {
    Partial::from_wire(&p.to_wire()).unwrap()
}

#[test]
fn merging_m_holders_partials_reproduces_single_instance_attention() {
    let mut rng = Rng::new(2025);
    let (ct, k, h) = (8192, 2048, 16);
    let c = rng.rows(ct);
    let q = rng.rows(h);
    let (q, cache) = (Queries::new(&q).unwrap(), Cache::contiguous(&c).unwrap());
    // A top-2048 selection: distinct tokens scattered over the cache.
    let mut all: Vec<i32> = (0..ct as i32).collect();
    for i in (1..all.len()).rev() {
        all.swap(i, rng.range(0, i));
    }
    let selected = &all[..k];
    let whole_sel = Selection::new(selected, k, h, h, ct).unwrap();
    let mut worst = [0f32; 3];
    for backend in [Backend::Reference, Backend::Cpu] {
        let whole = partial_sparse(backend, &q, &cache, &whole_sel, SCALE).unwrap();
        for m in 1..=8 {
            for scattered in [false, true] {
                let parts = split(selected, m, scattered, &mut rng);
                let ps = partials(&q, &cache, &parts, k, h, backend);
                let refs: Vec<&Partial> = ps.iter().collect();
                let merged = merge(&refs).unwrap();
                let err = max_abs(&merged.o, &whole.o);
                // f32 round-off, term by term for the reference: each partial's o and the
                // whole's o are rounded once (0.5 ulp each) and the merge rounds once more;
                // each part's m is an f32, so its weight exp(m_i - M) carries up to
                // 0.5 ulp(|m|) relative error, applied to |o_i - o| <= 2 max |o|. The CPU path
                // accumulates in f32 in another grouping (split-K): a few ulps more.
                let (max_o, max_m) = (max_of(&whole.o), max_of(&whole.m));
                let round_off = 1.5 * ulp(max_o) + 0.5 * ulp(max_m) * 2.0 * max_o;
                let bound = match backend {
                    Backend::Reference => round_off,
                    _ => round_off + 16.0 * ulp(max_o),
                };
                assert!(
                    err <= bound,
                    "{backend:?} M={m} scattered={scattered}: {err}"
                );
                let slot = usize::from(backend != Backend::Reference);
                worst[slot] = worst[slot].max(err);
                for r in 0..h {
                    assert!(
                        (merged.lse(r) - whole.lse(r)).abs() <= 1e-5 * whole.lse(r).abs().max(1.0)
                    );
                }
                // Through the bf16 wire: each partial's o is rounded to bf16, at most half an
                // ulp, i.e. 2^-8 relative; a convex combination of such errors is bounded by
                // 2^-8 max |o|.
                let wired: Vec<Partial> = ps.iter().map(through_wire).collect();
                let refs: Vec<&Partial> = wired.iter().collect();
                let merged = merge(&refs).unwrap();
                let err = max_abs(&merged.o, &whole.o);
                assert!(
                    err <= max_o / 256.0 + 1e-6,
                    "wire M={m}: {err} (max |o| {max_o})"
                );
                worst[2] = worst[2].max(err);
            }
        }
    }
    eprintln!(
        "max abs error (paper 000: <= 4e-7, wire 1.2e-3): reference split+merge {:.1e}, \
         cpu {:.1e}, through the bf16 wire {:.1e}",
        worst[0], worst[1], worst[2]
    );
}

#[test]
fn merge_is_order_independent_and_empty_partials_are_the_identity() {
    let mut rng = Rng::new(3);
    let (ct, h) = (600, 16);
    let c = rng.rows(ct);
    let q = rng.rows(h);
    let (q, cache) = (Queries::new(&q).unwrap(), Cache::contiguous(&c).unwrap());
    let selected: Vec<i32> = (0..ct as i32).collect();
    let parts = split(&selected, 5, true, &mut rng);
    let ps = partials(&q, &cache, &parts, ct, h, Backend::Cpu);
    let forward: Vec<&Partial> = ps.iter().collect();
    let backward: Vec<&Partial> = ps.iter().rev().collect();
    let (a, b) = (merge(&forward).unwrap(), merge(&backward).unwrap());
    assert!(
        max_abs(&a.o, &b.o) <= 1e-7,
        "order changes only the last rounding"
    );
    let empty = Partial::empty(h);
    let with_empty: Vec<&Partial> = [&empty]
        .into_iter()
        .chain(ps.iter())
        .chain([&empty])
        .collect();
    assert_eq!(
        merge(&with_empty).unwrap(),
        a,
        "an empty partial is the identity"
    );
    assert_eq!(
        merge(&[&ps[0]]).unwrap().o,
        ps[0].o,
        "merging one partial returns it"
    );
    assert_eq!(
        merge(&[&empty, &empty]).unwrap(),
        empty,
        "nothing merged with nothing"
    );
}
