//! How long one route / fetch / local decision takes.
//!
//! `decide/*` is the public API: request validation, the three term-by-term breakdowns and the
//! reason. `baseline/bare-argmin` is the least a predicate can do on the same inputs: the
//! three closed forms of paper 000 section 4.2 and a two-comparison argmin, inlined, with no
//! validation and no breakdown. The ratio of the two is the price of the API; the absolute
//! `decide` time is held under 100 ns.

// A bench whose built-in presets fail to load should stop loudly, so `expect` is right here.
#![allow(clippy::expect_used)]

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use kvroute_costmodel::{CostModel, CostParams, Request, fabric_preset, model_preset};

fn bench_predicate(c: &mut Criterion) {
    let model = model_preset("deepseek-v2-lite").expect("preset").dims;
    let fabric = fabric_preset("h100-ibgda").expect("preset").fabric;
    let params = CostParams::paper_defaults(model, fabric);
    let costs = CostModel::new(params).expect("valid parameters");
    let dense = Request::contiguous(256, 2048);
    let sparse = Request::sparse(256, 8192, 2048, 4);

    let mut group = c.benchmark_group("predicate");
    group.bench_function("decide/contiguous", |b| {
        b.iter(|| costs.decide(black_box(&dense)))
    });
    group.bench_function("decide/sparse", |b| {
        b.iter(|| costs.decide(black_box(&sparse)))
    });
    group.bench_function("baseline/bare-argmin", |b| {
        b.iter(|| bare_argmin(black_box(&params), black_box(256.0), black_box(2048.0)))
    });
    group.finish();
}

/// Route, fetch and local of a contiguous request in closed form, then argmin (0, 1, 2).
fn bare_argmin(p: &CostParams, mq: f64, ct: f64) -> u8 {
    let bytes_per_us = p.fabric.bw_gbps * 1e3;
    let layers = f64::from(p.model.layers);
    let route = p.fabric.probe_us
        + p.fabric.turnaround_us
        + mq * p.model.routed_row_bytes() as f64 / bytes_per_us
        + p.holder.dense_us(mq, ct)
        + p.merge.at(mq, 1.0);
    let fetch = ct * layers * p.model.kv_bytes_per_token_layer() as f64 / bytes_per_us
        + p.splice.fixed_us
        + p.splice.per_token_us * ct;
    let local = ct * layers * p.local_us_per_token_layer;
    if route <= fetch && route <= local {
        0
    } else if fetch <= local {
        1
    } else {
        2
    }
}

criterion_group!(benches, bench_predicate);
criterion_main!(benches);
