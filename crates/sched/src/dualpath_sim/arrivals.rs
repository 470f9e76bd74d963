//! What the simulation replays: agent trajectories (synthetic, shaped like paper 003's table
//! 2) or an online trace's requests at fixed times, and the mean request both imply.

use kvroute_kvstore::{Eviction, PrefixCache, TraceRecord};
use serde::Serialize;

use crate::des::{Nanos, nanos};
use crate::dualpath::Request;
use crate::error::{Result, SchedError, count, positive};
use crate::rng::Rng;

/// One turn of an agent: tokens appended to the context, then tokens generated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Turn {
    /// Tokens appended (tool output, user input; the first turn's is the initial prompt).
    pub append: u64,
    /// Tokens generated.
    pub generate: u64,
}

/// What to replay.
#[derive(Debug, Clone)]
pub enum Arrivals {
    /// Offline rollout (section 7.3): every agent starts at time 0 and sends its next turn
    /// when the previous one finishes (no tool latency).
    Agents(Vec<Vec<Turn>>),
    /// Requests at fixed times (an online trace).
    Open(Vec<(Nanos, Request)>),
}

impl Arrivals {
    /// Requests in all.
    pub fn requests(&self) -> usize {
        match self {
            Arrivals::Agents(a) => a.iter().map(Vec::len).sum(),
            Arrivals::Open(r) => r.len(),
        }
    }
}

/// Synthetic agent trajectories shaped like paper 003 table 2.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AgenticSpec {
    /// Agents.
    pub agents: u32,
    /// Trajectories end before the context would pass this (MaxLen).
    pub max_len: u64,
    /// Mean initial prompt, tokens (exponential).
    pub initial_mean: f64,
    /// Mean tokens appended per later turn (exponential).
    pub append_mean: f64,
    /// Mean tokens generated per turn (exponential).
    pub gen_mean: f64,
    /// Seed.
    pub seed: u64,
}

impl AgenticSpec {
    /// Table 2's 64K row: appends of 429 and generations of 176 tokens on average, contexts
    /// up to 64K. The initial prompt's mean (8K) is chosen here so the mean context per turn
    /// lands near the table's 32.7K.
    pub fn paper_003_64k(agents: u32, seed: u64) -> Self {
        Self {
            agents,
            max_len: 65_536,
            initial_mean: 8192.0,
            append_mean: 429.0,
            gen_mean: 176.0,
            seed,
        }
    }

    /// The trajectories.
    pub fn generate(&self) -> Result<Vec<Vec<Turn>>> {
        count("agents", u64::from(self.agents))?;
        count("max_len", self.max_len)?;
        positive("initial_mean", self.initial_mean)?;
        positive("append_mean", self.append_mean)?;
        positive("gen_mean", self.gen_mean)?;
        let mut rng = Rng::new(self.seed);
        let draw = |rng: &mut Rng, mean: f64| (rng.exponential(mean).round() as u64).max(1);
        Ok((0..self.agents)
            .map(|_| {
                let mut turns = Vec::new();
                let mut context = 0;
                let mut append = draw(&mut rng, self.initial_mean).min(self.max_len / 2);
                loop {
                    let generate = draw(&mut rng, self.gen_mean);
                    if context + append + generate > self.max_len && !turns.is_empty() {
                        break;
                    }
                    turns.push(Turn { append, generate });
                    context += append + generate;
                    append = draw(&mut rng, self.append_mean);
                }
                turns
            })
            .collect())
    }
}

/// Requests of a Mooncake-format trace, `scale` copies (disjoint prefixes, same arrival
/// times), hits from an unbounded store of the trace's blocks (a block is a hit if it was
/// seen before as part of the request's longest cached prefix; at least one token is always
/// computed). Arrival times are divided by `time_scale`.
pub fn trace_arrivals(
    records: &[TraceRecord],
    block_tokens: u32,
    scale: u32,
    time_scale: f64,
) -> Result<Arrivals> {
    count("scale", u64::from(scale))?;
    count("block_tokens", u64::from(block_tokens))?;
    positive("time_scale", time_scale)?;
    if records.is_empty() {
        return Err(SchedError::EmptyWorkload);
    }
    let mut cache = PrefixCache::<()>::new(0, Eviction::Lru);
    let mut base = Vec::with_capacity(records.len());
    for r in records {
        let hit = (cache.longest_prefix(&r.hash_ids) as u64 * u64::from(block_tokens))
            .min(r.input_length.saturating_sub(1));
        cache.access(&r.hash_ids, |_| (), &mut |_, _| ())?;
        base.push((
            nanos(r.timestamp_ms as f64 * 1e-3 / time_scale),
            hit,
            r.input_length - hit,
            r.output_length.max(1),
        ));
    }
    let mut out = Vec::with_capacity(base.len() * scale as usize);
    for &(at, hit, miss, generate) in &base {
        for _ in 0..scale {
            let id = out.len() as u64;
            out.push((
                at,
                Request {
                    id,
                    hit_tokens: hit,
                    miss_tokens: miss.max(1),
                    gen_tokens: generate,
                },
            ));
        }
    }
    Ok(Arrivals::Open(out))
}

/// Section 6.1's beta is in tokens: derived from the workload's mean request, `(prompt
/// tokens, new tokens)`.
pub(super) fn mean_request(arrivals: &Arrivals) -> (f64, f64) {
    match arrivals {
        Arrivals::Open(r) => {
            let n = r.len() as f64;
            (
                r.iter().map(|(_, q)| q.tokens() as f64).sum::<f64>() / n,
                r.iter().map(|(_, q)| q.miss_tokens as f64).sum::<f64>() / n,
            )
        }
        Arrivals::Agents(a) => {
            let (mut ctx_sum, mut new_sum, mut n) = (0.0, 0.0, 0.0);
            for turns in a {
                let mut ctx = 0;
                for t in turns {
                    ctx_sum += (ctx + t.append) as f64;
                    new_sum += t.append as f64;
                    n += 1.0;
                    ctx += t.append + t.generate;
                }
            }
            (ctx_sum / n, new_sum / n)
        }
    }
}
