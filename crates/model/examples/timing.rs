//! What [`ModelConfig::tiny`] costs on this machine: prefill of 2048-token chunks, and one
//! decode step of 4 requests split into its non-attention work (everything
//! [`Model::forward`] does besides the attention) and local attention over one chunk.
//!
//! `cargo run --release -p kvroute-model --example timing [-- THREADS [CHUNK_TOKENS]]`
//! (default: rayon's pool, one thread per core; 2048-token chunks).
//!
//! The measured figures are in the crate docs.

use std::time::Instant;

use kvroute_model::{Model, ModelConfig, ModelError};

fn main() -> Result<(), ModelError> {
    if let Some(threads) = std::env::args().nth(1).and_then(|a| a.parse().ok()) {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global()
            .map_err(|e| ModelError::Config {
                field: "threads",
                value: e.to_string(),
                why: "the thread pool did not start",
            })?;
    }
    let config = ModelConfig::tiny();
    println!(
        "tiny: {} parameters, {} threads",
        config.parameters().unwrap_or(0),
        rayon::current_num_threads()
    );
    let model = Model::init(config.clone(), 1)?;
    let chunk = std::env::args()
        .nth(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2048);
    let mut kv = Vec::new();
    for c in 0..3 {
        let tokens: Vec<u32> = (0..chunk)
            .map(|i| ((i * 7 + c * 13) % 512) as u32)
            .collect();
        let positions: Vec<i64> = (0..chunk).map(|i| (c * chunk + i) as i64).collect();
        let t = Instant::now();
        kv = model.prefill(&tokens, &positions)?;
        println!("prefill chunk {c}: {:.2} s", t.elapsed().as_secs_f64());
    }
    // One decode step of 4 requests at position 3 * 2048, attending the last chunk.
    let (batch, steps) = (4, 200);
    let tokens: Vec<u32> = (0..batch).map(|i| i as u32 * 31).collect();
    let positions = vec![(3 * chunk) as i64; batch];
    let heads = config.num_attention_heads;
    // Per step, the non-attention and the attention seconds; the median of each is reported
    // (the machine is shared: the mean carries other processes' bursts).
    let mut rest = Vec::with_capacity(steps);
    let mut attn = Vec::with_capacity(steps);
    for _ in 0..steps {
        let (mut rest_s, mut attn_s) = (0.0, 0.0);
        let t = Instant::now();
        let mut x = model.embed_tokens(&tokens)?;
        rest_s += t.elapsed().as_secs_f64();
        for (layer, rows) in kv.iter().enumerate() {
            let t = Instant::now();
            let inputs = model.attention_inputs(layer, &x, &positions)?;
            rest_s += t.elapsed().as_secs_f64();
            let t = Instant::now();
            let mut o = Vec::with_capacity(batch * heads * 512);
            for r in 0..batch {
                o.extend(model.attend(&inputs.queries[r * heads * 576..][..heads * 576], rows)?);
            }
            attn_s += t.elapsed().as_secs_f64();
            let t = Instant::now();
            x = model.attention_output(layer, &inputs.residual, &o)?;
            rest_s += t.elapsed().as_secs_f64();
        }
        let t = Instant::now();
        let _ = model.greedy(&x)?;
        rest.push(rest_s + t.elapsed().as_secs_f64());
        attn.push(attn_s);
    }
    let median = |v: &mut Vec<f64>| kvroute_costmodel::fit::median(v).unwrap_or(f64::NAN) * 1e3;
    println!(
        "decode step, {batch} requests (median of {steps}): non-attention {:.3} ms, \
         attention over {chunk} rows {:.3} ms",
        median(&mut rest),
        median(&mut attn)
    );
    Ok(())
}
