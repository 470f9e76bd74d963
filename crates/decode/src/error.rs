//! Why a generation failed.

use thiserror::Error;

/// Why a generation (or the holder's prefill) failed.
#[derive(Debug, Error)]
pub enum DecodeError {
    /// The context or generation settings are unusable.
    #[error("generation settings: {0}")]
    Config(String),
    /// The model refused its inputs or weights.
    #[error(transparent)]
    Model(#[from] kvroute_model::ModelError),
    /// A step of the step API failed (a chunk with no reachable copy names itself).
    #[error("token {token}, layer {layer}: {source}")]
    Step {
        /// The decode step (one token per request).
        token: usize,
        /// The layer.
        layer: usize,
        /// What failed.
        source: kvroute_remote::step::StepError,
    },
    /// Calibrating the selector on the holders.
    #[error("calibrating the selector: {0}")]
    Calibrate(kvroute_remote::step::StepError),
    /// The holders' chunks.
    #[error(transparent)]
    Remote(#[from] kvroute_remote::RemoteError),
    /// A kernel of the single-instance reference.
    #[error("the single-instance reference: {0}")]
    Kernel(#[from] kvroute_kernels::KernelError),
    /// The caller's hook between tokens.
    #[error("between tokens: {0}")]
    Hook(String),
}
