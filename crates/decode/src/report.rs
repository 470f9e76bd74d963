//! What a generation reports: each request's tokens beside the reference's, where they
//! differ and by how much the reference was sure, per-layer hidden-state differences, and
//! time per decode step with its route / fetch / local mix beside the selector's price.

use kvroute_remote::step::StepStats;
use serde::Serialize;

use crate::context::ContextSpec;

/// The largest top-2 logit margin of the reference at which a differing token is put down to
/// bf16 rounding rather than a fault. What differs between the two paths is rounding only:
/// routed partials cross the wire with `o` in bf16 (a relative error up to 2^-9 per value),
/// routed queries are rotated and rounded to bf16 again, fetched chunks are spliced with the
/// CPU's rotation. On the default configuration (the tiny model, whose logits have a standard
/// deviation of 8 and a median top-2 gap of 2.6) the largest logit difference between the
/// paths measured 0.017-0.038 over shm and tcp, with and without a killed holder
/// (`kvroute generate`, `max_logit_diff`); the bound is five times the worst of those.
pub const MARGIN_BOUND: f32 = 0.2;

/// Where a request's tokens first differ from the reference's.
#[derive(Debug, Clone, Serialize)]
pub struct Difference {
    /// The generated token's index.
    pub index: usize,
    /// The token generated through the step API.
    pub token: u32,
    /// The reference's.
    pub reference_token: u32,
    /// The reference's top-2 logit margin there.
    pub reference_margin: f32,
    /// Whether the margin is below [`MARGIN_BOUND`] (then not a failure).
    pub within_bound: bool,
}

/// One request's generation.
#[derive(Debug, Clone, Serialize)]
pub struct RequestReport {
    /// Its index.
    pub request: usize,
    /// Its chunks and where its context places them.
    pub chunks: Vec<(u32, i64)>,
    /// Its prompt's tokens.
    pub prompt: Vec<u32>,
    /// The tokens generated through the step API.
    pub tokens: Vec<u32>,
    /// The reference's tokens.
    pub reference_tokens: Vec<u32>,
    /// Where they first differ.
    pub first_difference: Option<Difference>,
}

/// One decode step's time (every layer), measured and as the selector priced it.
#[derive(Debug, Clone, Serialize)]
pub struct TokenTiming {
    /// The decode step.
    pub step: usize,
    /// Whether it generated a token (else it consumed a prompt token).
    pub generating: bool,
    /// The step through the step API, model included, microseconds (the reference excluded).
    pub measured_us: f64,
    /// The same step of the reference, microseconds.
    pub reference_us: f64,
    /// Of it, the step API's calls, microseconds.
    pub attention_us: f64,
    /// Route rounds, fetches, gathers and local partials with the merge, microseconds.
    pub route_us: f64,
    /// See `route_us`.
    pub fetch_us: f64,
    /// See `route_us`.
    pub gather_us: f64,
    /// See `route_us`.
    pub local_us: f64,
    /// The selector's price of the same route rounds and fetches, microseconds
    /// (`StepReport::priced_route_round`, `StepReport::priced_fetches`).
    pub predicted_route_us: f64,
    /// See `predicted_route_us`.
    pub predicted_fetch_us: f64,
    /// (request, chunk, layer) attended by a route, a fetch this step, the fetch cache.
    pub routes: usize,
    /// See `routes`.
    pub fetches: usize,
    /// See `routes`.
    pub cached: usize,
    /// The holders (the requester's indices) it routed to or fetched from.
    pub holders: Vec<usize>,
}

/// What a generation did and found.
#[derive(Debug, Clone, Serialize)]
pub struct GenerateReport {
    /// The context.
    pub context: ContextSpec,
    /// Each request's generation.
    pub requests: Vec<RequestReport>,
    /// Per layer, the largest absolute difference of a hidden state after it between the
    /// two paths (while each request fed both the same tokens).
    pub layer_max_abs: Vec<f32>,
    /// The largest absolute logit difference between the two paths (same condition).
    pub max_logit_diff: f32,
    /// [`MARGIN_BOUND`].
    pub margin_bound: f32,
    /// Per decode step.
    pub steps: Vec<TokenTiming>,
    /// Generated tokens per second through the step API, all requests (the prompt steps and
    /// the reference excluded).
    pub tokens_per_s: f64,
    /// The reference's time, seconds (splicing its chunks and every step).
    pub reference_s: f64,
    /// Generated tokens per second of the reference, measured in the same run over the same
    /// steps as `tokens_per_s`: the same model with the whole context in this process, one
    /// CPU kernel call per request and layer (its prefill excluded, as the holders' is).
    pub reference_tokens_per_s: f64,
    /// What the caller's hook did between steps.
    pub events: Vec<String>,
    /// Calls re-sent to a replica, and why.
    pub fallbacks: Vec<String>,
    /// Why the check failed; empty if it passed.
    pub failures: Vec<String>,
    /// Whether every token matched (or differed within the bound).
    pub passed: bool,
    /// The stepper's counters.
    pub stats: StepStats,
}

impl TokenTiming {
    pub(crate) fn new(step: usize, generating: bool) -> Self {
        Self {
            step,
            generating,
            measured_us: 0.0,
            reference_us: 0.0,
            attention_us: 0.0,
            route_us: 0.0,
            fetch_us: 0.0,
            gather_us: 0.0,
            local_us: 0.0,
            predicted_route_us: 0.0,
            predicted_fetch_us: 0.0,
            routes: 0,
            fetches: 0,
            cached: 0,
            holders: Vec::new(),
        }
    }
}
