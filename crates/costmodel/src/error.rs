//! The one error type of this crate: every invalid input is one of these variants, never a panic.

use std::fmt;

/// What a numeric parameter must satisfy; part of [`CostModelError::InvalidParameter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requirement {
    /// Finite (not NaN, not infinite).
    Finite,
    /// Finite and strictly greater than zero (bandwidths, latencies that cannot vanish).
    Positive,
    /// Finite and zero or greater (additive overheads that may be absent).
    NonNegative,
    /// Finite and at least one (degradation and inflation factors).
    AtLeastOne,
    /// An integer count of at least one (layers, rows, ranks, instances).
    NonZeroCount,
    /// A probability, in [0, 1].
    Probability,
}

impl fmt::Display for Requirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Finite => "finite",
            Self::Positive => "finite and > 0",
            Self::NonNegative => "finite and >= 0",
            Self::AtLeastOne => "finite and >= 1",
            Self::NonZeroCount => "a count >= 1",
            Self::Probability => "in [0, 1]",
        })
    }
}

/// Errors of the cost model. Each variant names the input at fault so a caller can fix it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CostModelError {
    /// A numeric parameter is NaN, infinite, or outside its domain.
    #[error("parameter `{name}` = {value} is invalid: it must be {requirement}")]
    InvalidParameter {
        /// The parameter's name, as it appears in the API and the CLI.
        name: &'static str,
        /// The rejected value.
        value: f64,
        /// What the value must satisfy.
        requirement: Requirement,
    },
    /// The RoPE band is wider than the row that contains it.
    #[error("rope_dims {rope_dims} exceeds the {d_qk}-wide row that contains it")]
    RopeExceedsRow {
        /// RoPE dimensions asked for.
        rope_dims: u32,
        /// Width of the row.
        d_qk: u32,
    },
    /// A sparse selection asks for more entries than the chunk holds.
    #[error("top-k selection of {topk} entries exceeds the {chunk_tokens}-token chunk")]
    TopKExceedsChunk {
        /// Selected entries per query.
        topk: u32,
        /// Tokens (cache entries) in the chunk.
        chunk_tokens: u32,
    },
    /// A sparse selection is spread over more holders than it has entries.
    #[error("a selection of {topk} entries cannot be spread over {holders} holders")]
    MoreHoldersThanEntries {
        /// Selected entries per query.
        topk: u32,
        /// Holders the selection is scattered over.
        holders: u32,
    },
    /// A preset name matches no known preset.
    #[error("unknown {kind} preset `{name}`; known: {known}")]
    UnknownPreset {
        /// `model` or `fabric`.
        kind: &'static str,
        /// The name that was asked for.
        name: String,
        /// The known names, comma separated.
        known: String,
    },
    /// Concurrent flows were given but the fabric has no link capacity to share.
    #[error(
        "{flows} concurrent flows need the fabric's link capacity (`link_gbps`), which is unset"
    )]
    MissingLinkCapacity {
        /// Concurrent flows per link that were asked for.
        flows: u32,
    },
    /// Every primitive was excluded, so there is nothing to choose from.
    #[error("no primitive is allowed: enable at least one of route, fetch, local")]
    NoPrimitiveAllowed,
    /// Every input was valid, but a primitive's cost is not a finite number (parameters at
    /// the ends of the f64 range, e.g. a bandwidth of 1e-308 GB/s): no decision is made on it.
    #[error(
        "the {primitive} cost is {value} us, not a finite number: the parameters are out of any useful range"
    )]
    NonFiniteCost {
        /// `route`, `fetch` or `local`.
        primitive: &'static str,
        /// The cost computed.
        value: f64,
    },
    /// A fit needs samples at two or more distinct abscissae.
    #[error("a fit needs samples at {needed} or more distinct sizes, got {got}")]
    TooFewSamples {
        /// Distinct sizes needed.
        needed: usize,
        /// Distinct sizes given.
        got: usize,
    },
    /// The fitted slope is not positive, so no bandwidth can be derived.
    #[error(
        "the fitted slope {slope_us_per_byte} us/B is not positive: the samples do not grow with size"
    )]
    NonIncreasingSamples {
        /// The fitted slope.
        slope_us_per_byte: f64,
    },
    /// A length profile has too few points to interpolate.
    #[error("a length profile needs at least 2 points, got {0}")]
    ProfileTooShort(usize),
    /// Length profile lengths must strictly increase.
    #[error("length profile point {index} does not come after the one before it")]
    ProfileNotIncreasing {
        /// Index of the offending point.
        index: usize,
    },
    /// A truncated distribution whose range is empty or holds no probability mass.
    #[error("truncation range [{min_tokens}, {max_tokens}] is empty or holds no probability mass")]
    EmptyTruncation {
        /// Lower bound of the range.
        min_tokens: f64,
        /// Upper bound of the range.
        max_tokens: f64,
    },
    /// More PD prefill instances than the PD cluster has.
    #[error("np = {np} exceeds the PD cluster's {pd_instances} instances")]
    NpExceedsCluster {
        /// PD prefill instances asked for.
        np: u32,
        /// Instances in the PD cluster.
        pd_instances: u32,
    },
    /// A search was asked for over an empty grid or a cluster with no room to split.
    #[error("nothing to search: {0}")]
    EmptySearch(&'static str),
}

impl CostModelError {
    /// The error for a preset name that is none of `known`.
    pub(crate) fn unknown_preset<'a>(
        kind: &'static str,
        name: &str,
        known: impl Iterator<Item = &'a str>,
    ) -> Self {
        Self::UnknownPreset {
            kind,
            name: name.to_owned(),
            known: known.collect::<Vec<_>>().join(", "),
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = CostModelError> = std::result::Result<T, E>;

/// Accepts `value` if it is finite.
pub(crate) fn finite(name: &'static str, value: f64) -> Result<f64> {
    check(name, value, Requirement::Finite, value.is_finite())
}

/// Accepts `value` if it is finite and > 0.
#[inline]
pub(crate) fn positive(name: &'static str, value: f64) -> Result<f64> {
    check(
        name,
        value,
        Requirement::Positive,
        value.is_finite() && value > 0.0,
    )
}

/// Accepts `value` if it is finite and >= 0.
#[inline]
pub(crate) fn non_negative(name: &'static str, value: f64) -> Result<f64> {
    check(
        name,
        value,
        Requirement::NonNegative,
        value.is_finite() && value >= 0.0,
    )
}

/// Accepts `value` if it is finite and >= 1.
pub(crate) fn at_least_one(name: &'static str, value: f64) -> Result<f64> {
    check(
        name,
        value,
        Requirement::AtLeastOne,
        value.is_finite() && value >= 1.0,
    )
}

/// Accepts a probability in [0, 1].
pub(crate) fn probability(name: &'static str, value: f64) -> Result<f64> {
    check(
        name,
        value,
        Requirement::Probability,
        (0.0..=1.0).contains(&value),
    )
}

/// Accepts a count of at least one.
#[inline]
pub(crate) fn count(name: &'static str, value: u32) -> Result<u32> {
    if value == 0 {
        return Err(CostModelError::InvalidParameter {
            name,
            value: 0.0,
            requirement: Requirement::NonZeroCount,
        });
    }
    Ok(value)
}

#[inline]
fn check(name: &'static str, value: f64, requirement: Requirement, ok: bool) -> Result<f64> {
    if ok {
        Ok(value)
    } else {
        Err(CostModelError::InvalidParameter {
            name,
            value,
            requirement,
        })
    }
}
