//! What can go wrong: a configuration the model cannot run, a checkpoint that does not hold
//! what the configuration says (every variant names the file and the tensor), or a forward
//! call given inputs of the wrong shape. Checkpoints and attention outputs are untrusted
//! input: they are refused with one of these, never a panic.

use std::path::PathBuf;

use thiserror::Error;

/// A refused configuration, checkpoint or call.
#[derive(Debug, Error)]
pub enum ModelError {
    /// A configuration value outside what the architecture allows.
    #[error("config {field} = {value}: {why}")]
    Config {
        /// The `config.json` field.
        field: &'static str,
        /// Its value, as written.
        value: String,
        /// What it must be.
        why: &'static str,
    },
    /// A valid DeepSeek configuration this crate does not implement.
    #[error("config {field} = {value} is not supported: {why}")]
    Unsupported {
        /// The `config.json` field.
        field: &'static str,
        /// Its value, as written.
        value: String,
        /// What is supported.
        why: &'static str,
    },
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file (`config.json`, the shard index) did not parse.
    #[error("{}: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: serde_json::Error,
    },
    /// A safetensors file is malformed (truncated, bad header, offsets past the end).
    #[error("{}: not a valid safetensors file: {source}", path.display())]
    SafeTensors {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// The shard index names a file it must not (outside the checkpoint's directory), or
    /// names no file for a tensor.
    #[error("{}: {why}: {value}", path.display())]
    ShardIndex {
        /// The index file.
        path: PathBuf,
        /// The offending entry.
        value: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A tensor the configuration implies is not in the checkpoint.
    #[error("{}: tensor {tensor} is missing", file.display())]
    MissingTensor {
        /// The file it should be in (the single file, or the one the index names).
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
    },
    /// A tensor is stored in a type other than bf16 or f32.
    #[error("{}: tensor {tensor} is {dtype}, expected BF16 or F32", file.display())]
    TensorDtype {
        /// The file.
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The stored type.
        dtype: String,
    },
    /// A tensor's shape is not the one the configuration implies.
    #[error("{}: tensor {tensor} has shape {got:?}, expected {expected:?}", file.display())]
    TensorShape {
        /// The file.
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The shape the configuration implies.
        expected: Vec<usize>,
        /// The stored shape.
        got: Vec<usize>,
    },
    /// A weight is NaN or infinite.
    #[error("{}: tensor {tensor} has a non-finite value at element {index}", file.display())]
    NonFiniteWeight {
        /// The file.
        file: PathBuf,
        /// The tensor's name.
        tensor: String,
        /// The first bad element.
        index: usize,
    },
    /// A call's buffer does not have the length its shape implies.
    #[error("{what}: expected {expected} elements, got {got}")]
    Shape {
        /// Which input.
        what: &'static str,
        /// Elements the shape implies.
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// An index (a token id, a layer) is out of range.
    #[error("{what} {index} is outside 0..{bound}")]
    OutOfRange {
        /// What it indexes.
        what: &'static str,
        /// The value.
        index: u64,
        /// The exclusive bound.
        bound: u64,
    },
    /// An input (attention outputs from another engine, logits) is NaN or infinite.
    #[error("{what} has a non-finite value at element {index}")]
    NonFiniteInput {
        /// Which input.
        what: &'static str,
        /// The first bad element.
        index: usize,
    },
    /// An attention kernel refused its call.
    #[error(transparent)]
    Kernel(#[from] kvroute_kernels::KernelError),
}

/// This crate's results.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;

/// `got` must equal `expected`.
pub(crate) fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(ModelError::Shape {
            what,
            expected,
            got,
        })
    }
}

/// Every value of `values` finite.
pub(crate) fn check_finite(what: &'static str, values: &[f32]) -> Result<()> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(ModelError::NonFiniteInput { what, index }),
        None => Ok(()),
    }
}
