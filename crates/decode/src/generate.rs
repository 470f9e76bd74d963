//! The decode loop: R requests greedily generate N tokens, one token each per decode step,
//! every layer's attention one call to the step API, checked against the same generation
//! with the whole context on this instance.
//!
//! Per decode step and layer, each request's hidden state gives its query rows and its own
//! cache row ([`Model::attention_inputs`]); the row joins its own KV (paged,
//! [`OwnKv`]), and one [`Stepper::step`] attends every request over its chunks (held
//! elsewhere: routed, fetched into the fetch cache or read from it) and its own KV, merged
//! exactly. The outputs go through the value up-projection and the rest of the layer
//! ([`Model::attention_output`]). A request first consumes its prompt one token per step
//! (its own KV then attends causally, which one query token per step needs no mask for),
//! then feeds back its greedy choice.
//!
//! In lockstep, the reference runs the same loop with its own tokens over the whole context
//! here ([`Reference`]). The report has each request's tokens and the reference's, the
//! largest hidden-state difference after each layer (while the two have fed the same
//! tokens), and, where a token differs, the reference's top-2 logit margin at that step: a
//! difference is a failure unless that margin is below [`MARGIN_BOUND`], where the bf16
//! rounding on the wire can flip the choice.

use std::time::Instant;

use kvroute_costmodel::ModelDims;
use kvroute_kvstore::{ChunkId, ROW_BYTES};
use kvroute_model::{Model, top2};
use kvroute_remote::RequesterConfig;
use kvroute_remote::step::{ChunkRef, How, LocalKv, StepRequest, StepStats, Stepper};

use crate::context::{ContextSpec, RequestPlan};
use crate::error::DecodeError;
use crate::held::PrefilledChunk;
use crate::own::OwnKv;
use crate::reference::Reference;
pub use crate::report::{Difference, GenerateReport, MARGIN_BOUND, RequestReport, TokenTiming};

/// How a generation runs.
#[derive(Debug, Clone, Copy)]
pub struct GenerateConfig {
    /// Tokens each request generates (1 to 4096).
    pub new_tokens: usize,
    /// Tokens per block of the requests' own paged KV.
    pub block_tokens: usize,
}

/// Distinct (chunk, place) pairs the context's requests attend: what the fetch cache holds
/// when every remote chunk is fetched (a chunk placed at two positions is spliced twice).
pub fn placements(context: &ContextSpec) -> usize {
    let mut seen: Vec<(ChunkId, i64)> = (0..context.requests)
        .flat_map(|r| context.request(r, 1).chunks)
        .collect();
    seen.sort_unstable();
    seen.dedup();
    seen.len()
}

/// A requester configuration for `model` over `context`: the model's softmax scale, a pool
/// with room for every (chunk, place) in the fetch cache and one chunk more, `timeout` per
/// call.
pub fn requester_config(
    model: &Model,
    context: &ContextSpec,
    timeout: std::time::Duration,
) -> RequesterConfig {
    let layers = model.config().num_hidden_layers as u64;
    let pages = layers * u64::from(context.chunk_tokens).div_ceil(64);
    let chunks = placements(context) as u64 + 1;
    RequesterConfig {
        timeout,
        pool_pages: u32::try_from(pages * chunks).unwrap_or(u32::MAX),
        ..RequesterConfig::new(model.softmax_scale())
    }
}

/// The cost model's view of `model`, and the fetch cache's budget for `context`: every
/// (chunk, place) its requests attend.
pub fn step_dims(model: &Model, context: &ContextSpec) -> (ModelDims, usize) {
    let layers = model.config().num_hidden_layers;
    let padded = (context.chunk_tokens as usize).div_ceil(64) * 64;
    (
        model.config().dims(),
        placements(context) * layers * padded * ROW_BYTES,
    )
}

/// Between two decode steps: the step about to run, the tokens generated so far and the last
/// step's timing (which holders it used); may act (kill a holder, follow a directory) and
/// say what it did.
pub type Between<'a> = dyn FnMut(usize, usize, Option<&TokenTiming>, &mut Stepper) -> Result<Option<String>, String>
    + 'a;

/// Generates through `stepper` (connected to holders of `context`'s chunks) and checks the
/// tokens against the reference built from `chunks` (the same chunks prefilled here).
pub fn generate(
    model: &Model,
    stepper: &mut Stepper,
    context: &ContextSpec,
    chunks: &[PrefilledChunk],
    config: GenerateConfig,
    between: &mut Between<'_>,
) -> Result<GenerateReport, DecodeError> {
    context.validate()?;
    if !(1..=4096).contains(&config.new_tokens) {
        return Err(DecodeError::Config(format!(
            "{} new tokens, must be 1 to 4096",
            config.new_tokens
        )));
    }
    let started = Instant::now();
    let mut run = Lockstep::new(model, context, chunks, config.block_tokens)?;
    let mut reference_s = started.elapsed().as_secs_f64();
    let prompt = context.prompt_tokens as usize;
    let (mut timings, mut events) = (Vec::new(), Vec::new());
    let mut generating_s = 0f64;
    for step in 0..prompt + config.new_tokens - 1 {
        let generated = (step + 1).saturating_sub(prompt);
        if let Some(what) =
            between(step, generated, timings.last(), stepper).map_err(DecodeError::Hook)?
        {
            events.push(format!(
                "before step {step} ({generated} tokens generated): {what}"
            ));
        }
        let started = Instant::now();
        let mut timing = TokenTiming::new(step, step + 1 >= prompt);
        run.embed(step)?;
        for layer in 0..model.config().num_hidden_layers {
            run.attend(stepper, (step, layer), &mut timing, &mut events)?;
            run.attend_reference(layer)?;
        }
        run.choose(step)?;
        timing.measured_us = started.elapsed().as_secs_f64() * 1e6 - run.reference_us;
        timing.reference_us = run.reference_us;
        reference_s += run.reference_us / 1e6;
        run.reference_us = 0.0;
        if timing.generating {
            generating_s += timing.measured_us / 1e6;
        }
        timings.push(timing);
    }
    Ok(run.report(
        context,
        timings,
        (events, generating_s, reference_s),
        stepper.stats(),
    ))
}

/// The two generations side by side: through the step API (`x`, `fed`, `tokens`) and with
/// the whole context here (`xr`, `fed_ref`, `ref_tokens`).
struct Lockstep<'a> {
    model: &'a Model,
    plans: Vec<RequestPlan>,
    refs: Vec<Vec<ChunkRef<'static>>>,
    own: OwnKv,
    reference: Reference,
    positions: Vec<i64>,
    /// Each request's hidden state, and the token it feeds this step.
    x: Vec<Vec<f32>>,
    fed: Vec<u32>,
    tokens: Vec<Vec<u32>>,
    /// The same for the reference.
    xr: Vec<Vec<f32>>,
    fed_ref: Vec<u32>,
    ref_tokens: Vec<Vec<u32>>,
    differences: Vec<Option<Difference>>,
    layer_max: Vec<f32>,
    max_logit_diff: f32,
    fallbacks: Vec<String>,
    /// The reference's time in the current step, microseconds.
    reference_us: f64,
}

impl<'a> Lockstep<'a> {
    fn new(
        model: &'a Model,
        context: &ContextSpec,
        chunks: &[PrefilledChunk],
        block_tokens: usize,
    ) -> Result<Self, DecodeError> {
        let vocab = model.config().vocab_size;
        let layers = model.config().num_hidden_layers;
        let n = context.requests as usize;
        let plans: Vec<RequestPlan> = (0..context.requests)
            .map(|r| context.request(r, vocab))
            .collect();
        let refs = plans
            .iter()
            .map(|p| {
                p.chunks
                    .iter()
                    .map(|&(c, start)| ChunkRef::dense(c, start))
                    .collect()
            })
            .collect();
        let fed: Vec<u32> = plans.iter().map(|p| p.prompt[0]).collect();
        Ok(Self {
            model,
            refs,
            own: OwnKv::new(layers, n, block_tokens)?,
            reference: Reference::new(model, chunks, &plans)?,
            positions: vec![0; n],
            x: vec![Vec::new(); n],
            fed_ref: fed.clone(),
            fed,
            tokens: vec![Vec::new(); n],
            xr: vec![Vec::new(); n],
            ref_tokens: vec![Vec::new(); n],
            differences: vec![None; n],
            layer_max: vec![0.0; layers],
            max_logit_diff: 0.0,
            fallbacks: Vec::new(),
            reference_us: 0.0,
            plans,
        })
    }

    /// Both paths' first hidden states of the step: each request's token at its position.
    fn embed(&mut self, step: usize) -> Result<(), DecodeError> {
        for (r, plan) in self.plans.iter().enumerate() {
            self.positions[r] = plan.first_position + step as i64;
            self.x[r] = self.model.embed(self.fed[r])?;
            let at = Instant::now();
            self.xr[r] = self.model.embed(self.fed_ref[r])?;
            self.reference_us += at.elapsed().as_secs_f64() * 1e6;
        }
        Ok(())
    }

    /// One layer through the step API: every request's query rows and own cache row, one
    /// step over all requests, the rest of the layer.
    fn attend(
        &mut self,
        stepper: &mut Stepper,
        (step, layer): (usize, usize),
        timing: &mut TokenTiming,
        events: &mut Vec<String>,
    ) -> Result<(), DecodeError> {
        let model = self.model;
        let heads = model.config().num_attention_heads;
        let inputs = (0..self.plans.len())
            .map(|r| model.attention_inputs(layer, &self.x[r], &self.positions[r..=r]))
            .collect::<Result<Vec<_>, _>>()?;
        for (r, inp) in inputs.iter().enumerate() {
            self.own.push(layer, r, &inp.kv)?;
        }
        let caches = (0..self.plans.len())
            .map(|r| self.own.cache(layer, r))
            .collect::<Result<Vec<_>, _>>()?;
        let requests: Vec<StepRequest<'_>> = inputs
            .iter()
            .zip(&caches)
            .zip(&self.refs)
            .map(|((inp, cache), chunks)| StepRequest {
                queries: &inp.queries,
                heads,
                chunks,
                local: Some(LocalKv::dense(*cache)),
            })
            .collect();
        let out = stepper
            .step(layer as u16, &requests)
            .map_err(|source| DecodeError::Step {
                token: step,
                layer,
                source,
            })?;
        let rep = &out.report;
        timing.attention_us += rep.step_us;
        timing.route_us += rep.route_us;
        timing.fetch_us += rep.fetch_us;
        timing.gather_us += rep.gather_us;
        timing.local_us += rep.local_us;
        timing.predicted_route_us += rep.priced_route_round().map_or(0.0, |p| p.price.total_us());
        timing.predicted_fetch_us += rep.priced_fetches().map_or(0.0, |(_, p)| p.total_us());
        for d in &rep.decisions {
            if let (How::Route | How::Fetch, Some(h)) = (d.how, d.holder)
                && !timing.holders.contains(&h)
            {
                timing.holders.push(h);
            }
        }
        let count = |h: How| rep.decisions.iter().filter(|d| d.how == h).count();
        timing.routes += count(How::Route);
        timing.fetches += count(How::Fetch);
        timing.cached += count(How::Cached);
        events.extend(rep.lost.iter().map(|(h, why)| {
            format!(
                "step {step}, layer {layer}: holder {h} stopped answering the poll ({why}); \
                 its chunks go to their replicas"
            )
        }));
        self.fallbacks.extend(rep.fallbacks.iter().map(|(c, why)| {
            format!("step {step}, layer {layer}: {c} re-sent to a replica ({why})")
        }));
        for (r, p) in out.outputs.iter().enumerate() {
            self.x[r] = model.attention_output(layer, &inputs[r].residual, &p.o)?;
        }
        Ok(())
    }

    /// One layer of the reference, and the largest difference of its hidden states from the
    /// step API's where both fed the same tokens so far.
    fn attend_reference(&mut self, layer: usize) -> Result<(), DecodeError> {
        let at = Instant::now();
        let model = self.model;
        for r in 0..self.plans.len() {
            let inp = model.attention_inputs(layer, &self.xr[r], &self.positions[r..=r])?;
            let o = self
                .reference
                .attend(model, (r, layer), &inp.kv, &inp.queries)?;
            self.xr[r] = model.attention_output(layer, &inp.residual, &o)?;
            if self.fed[r] == self.fed_ref[r] && self.differences[r].is_none() {
                self.layer_max[layer] = self.layer_max[layer].max(max_abs(&self.x[r], &self.xr[r]));
            }
        }
        self.reference_us += at.elapsed().as_secs_f64() * 1e6;
        Ok(())
    }

    /// Both paths' next tokens: the prompt's while it lasts, then each one's greedy choice;
    /// notes where they first differ and the reference's margin there.
    fn choose(&mut self, step: usize) -> Result<(), DecodeError> {
        let model = self.model;
        for (r, plan) in self.plans.iter().enumerate() {
            let logits = model.logits(&self.x[r])?;
            let choice = top2(&logits)?;
            let at = Instant::now();
            let ref_logits = model.logits(&self.xr[r])?;
            let ref_choice = top2(&ref_logits)?;
            self.reference_us += at.elapsed().as_secs_f64() * 1e6;
            if self.differences[r].is_none() {
                self.max_logit_diff = self.max_logit_diff.max(max_abs(&logits, &ref_logits));
            }
            if let Some(&next) = plan.prompt.get(step + 1) {
                (self.fed[r], self.fed_ref[r]) = (next, next);
                continue;
            }
            if self.differences[r].is_none() && choice.token != ref_choice.token {
                self.differences[r] = Some(Difference {
                    index: self.tokens[r].len(),
                    token: choice.token,
                    reference_token: ref_choice.token,
                    reference_margin: ref_choice.margin,
                    within_bound: ref_choice.margin < MARGIN_BOUND,
                });
            }
            self.tokens[r].push(choice.token);
            self.ref_tokens[r].push(ref_choice.token);
            (self.fed[r], self.fed_ref[r]) = (choice.token, ref_choice.token);
        }
        Ok(())
    }

    fn report(
        self,
        context: &ContextSpec,
        steps: Vec<TokenTiming>,
        (events, generating_s, reference_s): (Vec<String>, f64, f64),
        stats: StepStats,
    ) -> GenerateReport {
        let failures: Vec<String> = self
            .differences
            .iter()
            .enumerate()
            .filter_map(|(r, d)| {
                let d = d.as_ref().filter(|d| !d.within_bound)?;
                Some(format!(
                    "request {r}: token {} is {} through the step API and {} in the \
                     reference, whose top-2 margin there is {:.4} (bound {MARGIN_BOUND})",
                    d.index, d.token, d.reference_token, d.reference_margin
                ))
            })
            .collect();
        let generated: usize = self.tokens.iter().map(Vec::len).sum();
        let reference_generating_s = steps
            .iter()
            .filter(|t| t.generating)
            .map(|t| t.reference_us / 1e6)
            .sum();
        let requests = self
            .plans
            .iter()
            .enumerate()
            .map(|(r, p)| RequestReport {
                request: r,
                chunks: p
                    .chunks
                    .iter()
                    .map(|&(c, s): &(ChunkId, i64)| (c.0, s))
                    .collect(),
                prompt: p.prompt.clone(),
                tokens: self.tokens[r].clone(),
                reference_tokens: self.ref_tokens[r].clone(),
                first_difference: self.differences[r].clone(),
            })
            .collect();
        GenerateReport {
            context: *context,
            requests,
            layer_max_abs: self.layer_max,
            max_logit_diff: self.max_logit_diff,
            margin_bound: MARGIN_BOUND,
            steps,
            tokens_per_s: per_s(generated, generating_s),
            reference_tokens_per_s: per_s(generated, reference_generating_s),
            reference_s,
            events,
            fallbacks: self.fallbacks,
            passed: failures.is_empty(),
            failures,
            stats,
        }
    }
}

/// `n` per `seconds` (0 over no time).
fn per_s(n: usize, seconds: f64) -> f64 {
    if seconds > 0.0 {
        n as f64 / seconds
    } else {
        0.0
    }
}

/// The largest absolute difference of two vectors (NaN if either has one; infinite where
/// their lengths differ).
fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, |m, d| {
            if d.is_nan() || m.is_nan() {
                f32::NAN
            } else {
                m.max(d)
            }
        })
}

/// A [`Stepper`] for `model` over `context` on `req`: the selector calibrated with `probe`
/// (its rows drawn here), the fetch cache sized for every chunk, then `adjust` (to force a
/// primitive, set the poll interval, the backend).
pub fn calibrated_stepper(
    req: kvroute_remote::Requester,
    model: &Model,
    context: &ContextSpec,
    probe: &kvroute_remote::probe::ProbeConfig,
    adjust: impl FnOnce(&mut kvroute_remote::step::StepConfig),
) -> Result<Stepper, DecodeError> {
    let (dims, budget) = step_dims(model, context);
    let rope = *model.rope();
    let rows = probe.mq.iter().copied().max().unwrap_or(1) as usize;
    let probe_rows = kvroute_kvstore::corpus::queries(
        rows,
        i64::from(context.chunk_tokens),
        &rope,
        context.seed,
    );
    let inputs = kvroute_remote::step::CalibrationInputs {
        model: dims,
        rope,
        chunk_tokens: context.chunk_tokens,
        probe_rows: &probe_rows,
        pull: None,
        probe,
    };
    let mut config = kvroute_remote::step::StepConfig::new(dims, rope);
    config.fetch_budget = budget;
    adjust(&mut config);
    Stepper::calibrated(req, inputs, config).map_err(DecodeError::Calibrate)
}
