//! A DeepSeek-V2-architecture language model in f32 on the CPU, split around its attention so
//! that the attention can be computed elsewhere: by a holder of the context's cache rows, over
//! the wire, through `kvroute-remote`'s step API.
//!
//! The architecture is DeepSeek-V2-Lite's (DeepSeek-V2: A Strong, Economical, and Efficient
//! Mixture-of-Experts Language Model, section 2): multi-head latent attention (MLA, section
//! 2.1) with one 512-wide latent and one 64-wide RoPE key cached per token, run in absorbed
//! form so that a query row `[512 | 64]` attends cache rows `[512 | 64]` directly (the
//! [`attention`] module derives it), YaRN RoPE and DeepSeek's softmax scale; DeepSeekMoE
//! feed-forward layers (section 2.2) with routed and shared experts after
//! `first_k_dense_replace` dense ones. [`ModelConfig`] reads a checkpoint's own `config.json`;
//! [`ModelConfig::deepseek_v2_lite`] is the published model, [`ModelConfig::tiny`] the same
//! architecture small enough to run on two cores. Weights load from safetensors files under
//! the real checkpoint's tensor names, bf16 or f32, single file or sharded ([`Model::load`]),
//! or are drawn at random ([`Model::init`]); [`Model::save`] writes a checkpoint.
//!
//! A forward pass is [`Model::embed`], then per layer [`Model::attention_inputs`] (bf16
//! query rows and cache rows in the kernels' layout), attention by whoever holds the cache
//! (locally [`Model::attend`] / [`Model::attend_causal`] over `kvroute-kernels`), and
//! [`Model::attention_output`] (the value up-projection, `o_proj`, the FFN); then
//! [`Model::logits`]. [`Model::forward`] drives that loop with the attention as a closure,
//! and [`Model::prefill`] runs it over a chunk with causal local attention, returning the
//! chunk's cache rows for every layer.
//!
//! Implemented: direct and low-rank (`q_lora_rank`, DeepSeek-V2 / V3) query projections,
//! YaRN with `mscale == mscale_all_dim`, MoE with softmax scores and greedy top-k routing
//! (`norm_topk_prob` either way, `routed_scaling_factor`). Not implemented (refused by
//! [`ModelConfig::validate`]): group-limited or `noaux_tc` routing and sigmoid scores
//! (DeepSeek-V2's full model, V3), FP8 weights, tied embeddings, a latent other than 512 + 64
//! (the kernels' row). All math is f32; weights are kept as f32 in memory.
//!
//! [`ModelConfig::tiny`] (256 hidden, 4 layers, 8 heads, head dims 128 / 64 / 128, 8 routed
//! experts of 128, 2 per token, 1 shared, 512 vocabulary: 10.7M parameters) measured in
//! release mode by `examples/timing.rs` on a 2-vCPU VM whose CPU reports itself as "Intel(R)
//! Xeon(R) Processor" (2.3 GHz, AVX-512), shared with another build while measured:
//!
//! | work | 1 thread | 2 threads |
//! |---|---|---|
//! | [`Model::prefill`] of a 2048-token chunk | 3.1-4.0 s | 2.2-2.3 s |
//! | a decode step of 4 requests, everything but attention, between attentions over 2048 rows | 5.0-5.1 ms | 5.0 ms |
//! | the same over a 64-token context (weights stay in cache) | 2.1-3.1 ms | |
//! | local attention of that step over 2048-row chunks, 4 layers ([`Model::attend`]) | 13.9-14.5 ms | 6.6-6.9 ms |
//!
//! The matmuls read bf16 weights (see the `linalg` module): the decode step is bound by
//! streaming its 21 MB of them; about half of prefill is the attention kernels.
//!
//! ```
//! use kvroute_model::{Model, ModelConfig, top2};
//!
//! let mut config = ModelConfig::tiny();
//! config.num_hidden_layers = 2;
//! let model = Model::init(config, 7)?;
//! // Prefill a 6-token chunk: each layer's cache rows, what its holder keeps.
//! let (tokens, positions) = ([1, 5, 9, 2, 7, 3], [0, 1, 2, 3, 4, 5]);
//! let kv = model.prefill(&tokens, &positions)?;
//! assert_eq!(kv[1].len(), 6 * 576);
//! // Decode token 4 at position 6: attention over the chunk's rows and its own.
//! let mut x = model.embed(4)?;
//! for (layer, rows) in kv.iter().enumerate() {
//!     let inputs = model.attention_inputs(layer, &x, &[6])?;
//!     let cache = [rows.as_slice(), inputs.kv.as_slice()].concat();
//!     let o = model.attend(&inputs.queries, &cache)?; // or route the queries to a holder
//!     x = model.attention_output(layer, &inputs.residual, &o)?;
//! }
//! let next = top2(&model.logits(&x)?)?;
//! assert!(next.token < 512);
//! # Ok::<(), kvroute_model::ModelError>(())
//! ```

pub mod attention;
mod checkpoint;
mod config;
mod error;
mod ffn;
mod forward;
mod init;
mod linalg;
mod weights;

pub use attention::AttnInputs;
pub use checkpoint::{CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE};
pub use config::{ModelConfig, RopeScaling};
pub use error::{ModelError, Result};
pub use forward::{Prefill, Top2, top2};
pub use init::LOGIT_STD;
pub use weights::{Model, TensorRef};
