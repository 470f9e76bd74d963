//! The typed errors of the schedulers and the simulator.

use thiserror::Error;

/// Why a configuration, a workload or a trace was refused.
#[derive(Debug, Error)]
pub enum SchedError {
    /// A count that must be at least one (engines, nodes, instances, slots).
    #[error("{name} must be at least 1, got {value}")]
    Zero {
        /// The field.
        name: &'static str,
        /// Its value.
        value: u64,
    },
    /// A rate, a bandwidth, a time or a size that must be finite and positive.
    #[error("{name} must be finite and > 0, got {value}")]
    NotPositive {
        /// The field.
        name: &'static str,
        /// Its value.
        value: f64,
    },
    /// A value outside its allowed range.
    #[error("{name} = {value} is outside {range}")]
    OutOfRange {
        /// The field.
        name: &'static str,
        /// Its value.
        value: f64,
        /// The allowed range, in words.
        range: &'static str,
    },
    /// A workload with nothing in it.
    #[error("the workload has no requests")]
    EmptyWorkload,
    /// A deployment that keeps up with a workload at no rate down to `lowest` times its own.
    #[error(
        "{deployment} keeps up with the workload at no rate down to {lowest} times its own (backlog {backlog} of {requests} requests at the last arrival)"
    )]
    NeverKeptUp {
        /// The deployment.
        deployment: String,
        /// The lowest multiple of the workload's rate tried.
        lowest: f64,
        /// Its backlog there.
        backlog: u64,
        /// Requests of the workload.
        requests: u64,
    },
    /// A request that no engine of the cluster could ever hold.
    #[error(
        "request {request} needs {needed_bytes} bytes of decode HBM; an engine has {hbm_bytes}"
    )]
    RequestTooLarge {
        /// The request.
        request: u64,
        /// Its KV at the end of decode.
        needed_bytes: u64,
        /// One decode engine's KV budget.
        hbm_bytes: u64,
    },
    /// A trace line the reader refused.
    #[error("trace: {0}")]
    Trace(#[from] kvroute_kvstore::trace::TraceError),
    /// The trace file could not be opened.
    #[error("opening the trace {path}: {source}")]
    Open {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The cost model refused its inputs.
    #[error("cost model: {0}")]
    CostModel(#[from] kvroute_costmodel::CostModelError),
    /// No replica of a chunk is alive and local re-prefill is not allowed.
    #[error("none of the chunk's {replicas} replicas is alive, and local is not allowed")]
    NoHolder {
        /// Replicas the chunk has.
        replicas: usize,
    },
    /// The prefix cache refused an operation.
    #[error("prefix cache: {0}")]
    Cache(#[from] kvroute_kvstore::CacheError),
}

/// The crate's result type.
pub type Result<T, E = SchedError> = std::result::Result<T, E>;

/// `value` if it is finite and positive.
pub(crate) fn positive(name: &'static str, value: f64) -> Result<f64> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(SchedError::NotPositive { name, value })
    }
}

/// `value` if it is at least one.
pub(crate) fn count(name: &'static str, value: u64) -> Result<u64> {
    if value >= 1 {
        Ok(value)
    } else {
        Err(SchedError::Zero { name, value })
    }
}

/// `value` if it is finite and in `[lo, hi]`.
pub(crate) fn within(
    name: &'static str,
    value: f64,
    lo: f64,
    hi: f64,
    range: &'static str,
) -> Result<f64> {
    if value.is_finite() && (lo..=hi).contains(&value) {
        Ok(value)
    } else {
        Err(SchedError::OutOfRange { name, value, range })
    }
}
