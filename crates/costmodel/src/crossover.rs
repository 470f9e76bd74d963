//! Closed-form crossovers: where one primitive stops winning, solved from the cost terms.
//!
//! All from paper 000 ("Move the Query, Not the Cache"): the wire-byte crossover `Mq*` and the
//! bytes route saves (section 5.2), the chunk size above which fetch beats re-prefill
//! (section 5.1), the effective bandwidth below which route loses to the splice (section 8,
//! "Congestion"), and the query batch above which route loses to fetch on time (section 5.5).

use crate::cost::CostModel;
use crate::error::{Result, count, positive};
use crate::fabric::Fabric;
use crate::model::ModelDims;
use crate::request::Request;
use crate::step_costs::SpliceCost;

/// `Mq* = ct b_KV / (q + p)`: the query batch at which routing one layer's rows moves as many
/// bytes as pulling one layer of a `tokens`-token chunk (paper 000 section 5.2).
pub fn byte_crossover_rows(model: &ModelDims, tokens: u32) -> Result<f64> {
    model.validate()?;
    count("tokens", tokens)?;
    Ok(model.chunk_bytes(tokens, 1) / model.routed_row_bytes() as f64)
}

/// The fraction of wire bytes route saves against pulling one layer of the chunk:
/// `1 - Mq (q + p) / (ct b_KV)`; negative when route would ship more than the chunk.
pub fn route_bytes_saved(model: &ModelDims, mq_rows: u32, tokens: u32) -> Result<f64> {
    count("mq_rows", mq_rows)?;
    Ok(1.0 - f64::from(mq_rows) / byte_crossover_rows(model, tokens)?)
}

/// The effective bandwidth (GB/s) below which route's transfer term alone exceeds fetch's
/// congestion-immune splice: `Mq (q + p) / T_splice` (paper 000 section 8, "Congestion").
/// It treats the pull as off the congested path, as the paper does; with the pull on the
/// same path, fetch slows down too and route never loses this way.
pub fn route_fetch_breakeven_bw_gbps(
    model: &ModelDims,
    mq_rows: u32,
    splice_us: f64,
) -> Result<f64> {
    count("mq_rows", mq_rows)?;
    positive("splice_us", splice_us)?;
    Ok(f64::from(mq_rows) * model.routed_row_bytes() as f64 / splice_us / 1e3)
}

/// The chunk size (tokens) above which a contiguous fetch (`pull + splice`) is cheaper than
/// re-prefill (`ct L c`) (paper 000 section 5.1). `None` when fetch never overtakes: the
/// per-token cost of fetching is at least that of recomputing.
pub fn fetch_local_crossover_tokens(
    model: &ModelDims,
    fabric: &Fabric,
    splice: &SpliceCost,
    local_us_per_token_layer: f64,
) -> Result<Option<f64>> {
    model.validate()?;
    fabric.validate()?;
    splice.validate()?;
    positive("local_us_per_token_layer", local_us_per_token_layer)?;
    let layers = f64::from(model.layers);
    let pull_us_per_token = fabric.transfer_us(model.kv_bytes_per_token_layer() as f64 * layers);
    let gap_us_per_token =
        layers * local_us_per_token_layer - pull_us_per_token - splice.per_token_us;
    Ok((gap_us_per_token > 0.0).then(|| splice.fixed_us / gap_us_per_token))
}

impl CostModel {
    /// The query batch above which fetch beats route on time for `request`'s chunk and
    /// selection (route grows with `Mq`, fetch does not), interpolated between the two whole
    /// batches around it. `None` if route already costs more at one row, or still costs less
    /// at `u32::MAX` rows. Route's total never falls as `Mq` grows (every term is
    /// non-decreasing in it, the compute roofline included), so a bisection finds it. Paper
    /// 000 section 5.5 puts it near `Mq ~ 10^5` at decode with the holder's compute flat.
    pub fn route_fetch_crossover_rows(&self, request: &Request) -> Result<Option<f64>> {
        let at = |mq_rows: u32| -> Result<f64> {
            Ok(self
                .route(&Request {
                    mq_rows,
                    ..*request
                })?
                .total_us())
        };
        let fetch = self
            .fetch(&Request {
                mq_rows: 1,
                ..*request
            })?
            .total_us();
        if at(1)? >= fetch || at(u32::MAX)? < fetch {
            return Ok(None);
        }
        // Invariant: route(lo) < fetch <= route(hi).
        let (mut lo, mut hi) = (1u32, u32::MAX);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if at(mid)? < fetch {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let (below, above) = (at(lo)?, at(hi)?);
        Ok(Some(f64::from(lo) + (fetch - below) / (above - below)))
    }
}
