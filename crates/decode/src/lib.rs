//! A decode loop as a serving engine runs it: a DeepSeek-V2-Lite-architecture model
//! (`kvroute-model`) whose every layer's attention is one call to `kvroute-remote`'s step
//! API, over a long shared context held by other instances, checked against the same
//! generation with the whole context on one instance.
//!
//! - [`context`]: the shared context (chunks of token ids at canonical positions) and the
//!   requests over it, some sharing chunks, some placing them elsewhere, some with their own;
//! - [`held`]: the holder's side, each chunk prefilled through the model as an independent
//!   sequence at its canonical positions (paper 000's setting) and served from a paged KV
//!   cache;
//! - [`own`]: the requests' own KV (prompt and generated tokens), paged;
//! - [`generate`]: the loop, the single-instance reference in lockstep, and the report
//!   (tokens, reference tokens, per-layer hidden-state differences, time per token with its
//!   route / fetch / local mix beside the selector's price).
//!
//! One process, one holder over the in-process `mem` fabric (over libfabric only the engines
//! differ; `kvroute generate` and `kvroute demo` run holders as processes):
//!
//! ```
//! use std::net::TcpListener;
//! use kvroute_decode::context::ContextSpec;
//! use kvroute_decode::generate::{GenerateConfig, calibrated_stepper, generate, requester_config};
//! use kvroute_decode::held::{held_chunks, prefill_chunk};
//! use kvroute_kvstore::ChunkId;
//! use kvroute_model::{Model, ModelConfig};
//! use kvroute_remote::probe::ProbeConfig;
//! use kvroute_remote::{Holder, HolderConfig, Requester};
//! use kvroute_transport::{MemFabric, TransferEngine};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut config = ModelConfig::tiny();
//! config.num_hidden_layers = 2;
//! let model = Model::init(config, 3)?;
//! let context = ContextSpec { chunks: 1, chunk_tokens: 96, requests: 2, prompt_tokens: 2, seed: 5 };
//!
//! // The holder: chunk 0 prefilled through the model, served from 16-token blocks.
//! let fabric = MemFabric::new();
//! let engine = TransferEngine::mem(&fabric, 1)?;
//! let held = held_chunks(&model, &engine, &context, &[ChunkId(0)], 16)?;
//! let holder = Holder::start(engine, TcpListener::bind("127.0.0.1:0")?, held,
//!                            HolderConfig::default())?;
//!
//! // The engine: a requester, a calibrated stepper, and the decode loop.
//! let req = Requester::connect(TransferEngine::mem(&fabric, 1)?, &[holder.addr()],
//!                              requester_config(&model, &context, std::time::Duration::from_secs(5)))?;
//! let probe = ProbeConfig { mq: vec![1, 16], reps: 4, ..ProbeConfig::default() };
//! let mut stepper = calibrated_stepper(req, &model, &context, &probe, |_| {})?;
//! let reference_chunks = vec![prefill_chunk(&model, &context, ChunkId(0))?];
//! let report = generate(&model, &mut stepper, &context, &reference_chunks,
//!                       GenerateConfig { new_tokens: 3, block_tokens: 16 },
//!                       &mut |_, _, _, _| Ok(None))?;
//! assert!(report.passed, "{:?}", report.failures);
//! assert_eq!(report.requests[0].tokens.len(), 3);
//! # Ok(()) }
//! ```

pub mod context;
mod error;
pub mod generate;
pub mod held;
pub mod own;
pub mod reference;
mod report;

pub use error::DecodeError;
