//! What the integration tests share: a model small enough for debug builds, scratch
//! directories.

#![allow(dead_code)]

use std::path::PathBuf;

use kvroute_model::ModelConfig;

/// The tiny architecture shrunk further (64 wide, 4 heads, 2 layers: one dense, one MoE with 4
/// experts, 2 per token), keeping the real latent and head dims (512 + 64, 128 / 128).
pub(crate) fn small_config() -> ModelConfig {
    ModelConfig {
        vocab_size: 128,
        hidden_size: 64,
        intermediate_size: 96,
        moe_intermediate_size: 32,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        n_routed_experts: 4,
        num_experts_per_tok: 2,
        ..ModelConfig::tiny()
    }
}

/// A fresh, empty directory under the system's temporary directory, removed on drop.
pub(crate) struct Scratch(pub(crate) PathBuf);

impl Scratch {
    pub(crate) fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("kvroute-model-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `||a - b|| / ||b||`.
pub(crate) fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - y).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}
