//! The step-level dispatcher: one decode step's route calls over every chunk, sent the way
//! paper 000 section 5.3's reductions ask (one request per holder, the query rows written
//! into registered staging, the replies merged from the bf16 rows where they landed), with
//! the calls of a holder that failed re-sent once to their chunks' next replicas.

use kvroute_kernels::{Partial, merge_wire};
use kvroute_kvstore::ChunkId;

use crate::error::{RemoteError, RouteError};
use crate::requester::{Call, Requester};

/// A call that was re-sent to another replica, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Fallback {
    /// The call's chunk.
    pub chunk: ChunkId,
    /// What happened to its first holder.
    pub error: RouteError,
}

/// What [`route_merged`] brought back.
#[derive(Debug, Clone)]
pub struct MergedStep {
    /// One partial per attempt that brought rows back (one, or two after a fallback), each the
    /// exact merge of its calls' partials: merge them with the caller's other parts.
    pub parts: Vec<Partial>,
    /// The calls re-sent after their holder failed.
    pub fallbacks: Vec<Fallback>,
    /// The longest kernel time a reply of the first attempt reported for its call (bounded
    /// by that attempt's round trip), microseconds: what a
    /// caller takes out of the step's time to see the transport's part.
    pub kernel_us: f64,
}

/// Routes `calls` and merges their partials. Each call's query rows are copied straight into
/// registered staging ([`Requester::stage_copied`]; a model's query projection would write
/// them there through [`Requester::stage`]) and the replies are merged where they landed
/// ([`crate::StagedRoute::route_wire`], [`merge_wire`]) with no decode pass. Calls whose holder
/// was lost ([`RouteError::holder_lost`]) are staged again, once, on their chunk's next live
/// replica. Any other failure, or a second one, is [`RemoteError::CallFailed`] naming the
/// chunk.
pub fn route_merged(req: &mut Requester, calls: &[Call<'_>]) -> Result<MergedStep, RemoteError> {
    let mut step = MergedStep {
        parts: Vec::new(),
        fallbacks: Vec::new(),
        kernel_us: 0.0,
    };
    let mut pending: Vec<usize> = (0..calls.len()).collect();
    for retry in [false, true] {
        if pending.is_empty() {
            break;
        }
        let subset: Vec<Call<'_>> = pending.iter().map(|&i| calls[i]).collect();
        let started = std::time::Instant::now();
        let routed = req.stage_copied(&subset).route_wire();
        let round_trip_us = started.elapsed().as_secs_f64() * 1e6;
        if !retry {
            step.kernel_us = (0..subset.len())
                .filter_map(|j| routed.holder_kernel_us(j, round_trip_us))
                .fold(0.0, f64::max);
        }
        let mut parts = Vec::with_capacity(pending.len());
        let mut failed = Vec::new();
        for (j, &i) in pending.iter().enumerate() {
            match routed.partial(j) {
                Ok(p) => parts.push(p),
                Err(error) if !retry && error.holder_lost() => {
                    step.fallbacks.push(Fallback {
                        chunk: calls[i].chunk,
                        error,
                    });
                    failed.push(i);
                }
                Err(source) => {
                    return Err(RemoteError::CallFailed {
                        chunk: calls[i].chunk,
                        source,
                    });
                }
            }
        }
        if !parts.is_empty() {
            let mut out = Partial::empty(0);
            merge_wire(&parts, &mut out)?;
            step.parts.push(out);
        }
        pending = failed;
    }
    Ok(step)
}
