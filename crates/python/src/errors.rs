//! The crates' error enums mapped onto the exception classes of `kvroute.errors` (defined in
//! Python so that they can also derive from `ValueError`, `TimeoutError`, ...), variant by
//! variant: a caller catches what it can act on (busy, timed out, refused, corrupt, ...).

use std::fmt::Display;

use kvroute_costmodel::CostModelError;
use kvroute_kernels::KernelError;
use kvroute_kvstore::{CacheError, StorageError, StoreError};
use kvroute_remote::step::StepError;
use kvroute_remote::{RemoteError, RouteError};
use kvroute_sched::SchedError;
use kvroute_transport::TransportError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// The exception classes of `kvroute.errors`, by what went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    InvalidInput,
    Busy,
    TimedOut,
    Refused,
    Unreachable,
    Corrupt,
    NotFound,
    CacheFull,
    Pinned,
    Transport,
    Other,
}

impl Kind {
    const ALL: [Kind; 11] = [
        Kind::InvalidInput,
        Kind::Busy,
        Kind::TimedOut,
        Kind::Refused,
        Kind::Unreachable,
        Kind::Corrupt,
        Kind::NotFound,
        Kind::CacheFull,
        Kind::Pinned,
        Kind::Transport,
        Kind::Other,
    ];

    fn class_name(self) -> &'static str {
        match self {
            Kind::InvalidInput => "InvalidInputError",
            Kind::Busy => "BusyError",
            Kind::TimedOut => "TimedOutError",
            Kind::Refused => "RefusedError",
            Kind::Unreachable => "UnreachableError",
            Kind::Corrupt => "CorruptError",
            Kind::NotFound => "NotFoundError",
            Kind::CacheFull => "CacheFullError",
            Kind::Pinned => "PinnedError",
            Kind::Transport => "TransportError",
            Kind::Other => "KvrouteError",
        }
    }
}

/// The classes, imported once.
static CLASSES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

/// An exception of `kind` with `message`.
pub(crate) fn error(kind: Kind, message: impl Display) -> PyErr {
    let message = message.to_string();
    Python::attach(|py| {
        let classes = CLASSES.get_or_try_init(py, || -> PyResult<Vec<Py<PyType>>> {
            let module = py.import("kvroute.errors")?;
            Kind::ALL
                .iter()
                .map(|k| {
                    Ok(module
                        .getattr(k.class_name())?
                        .cast_into::<PyType>()?
                        .unbind())
                })
                .collect()
        });
        match classes {
            Ok(classes) => {
                let i = Kind::ALL.iter().position(|&k| k == kind).unwrap_or(0);
                PyErr::from_type(classes[i].bind(py).clone(), message)
            }
            // kvroute.errors missing (a broken install): still an exception, never a panic.
            Err(e) => e,
        }
    })
}

/// `InvalidInputError(message)`: the common case of a refused argument.
pub(crate) fn invalid(message: impl Display) -> PyErr {
    error(Kind::InvalidInput, message)
}

/// An error of one of the crates, as the exception its variant maps to.
pub(crate) trait ToPyErr {
    /// The exception class of this error.
    fn kind(&self) -> Kind;
}

/// Converts a crate error (anything [`ToPyErr`]) into its exception.
pub(crate) fn py_err<E: ToPyErr + Display>(e: E) -> PyErr {
    error(e.kind(), &e)
}

impl ToPyErr for RouteError {
    fn kind(&self) -> Kind {
        match self {
            RouteError::NoHolder(_) | RouteError::HolderFailed { .. } => Kind::Unreachable,
            RouteError::Refused { .. } => Kind::Refused,
            RouteError::TimedOut { .. } => Kind::TimedOut,
            RouteError::TooLarge(_) => Kind::InvalidInput,
            RouteError::BadReply { .. } => Kind::Corrupt,
        }
    }
}

impl ToPyErr for RemoteError {
    fn kind(&self) -> Kind {
        match self {
            RemoteError::Config(_) | RemoteError::Chunks(_) | RemoteError::NoSuchHolder(_) => {
                Kind::InvalidInput
            }
            RemoteError::Unreachable { .. } | RemoteError::Control { .. } => Kind::Unreachable,
            RemoteError::HolderBusy { .. } => Kind::Busy,
            RemoteError::SessionRefused { .. } | RemoteError::UnlistedEngine { .. } => {
                Kind::Refused
            }
            RemoteError::TimedOut { .. } => Kind::TimedOut,
            RemoteError::MalformedControl { .. } => Kind::Corrupt,
            RemoteError::Chunk { .. } => Kind::NotFound,
            RemoteError::Route(e) | RemoteError::CallFailed { source: e, .. } => e.kind(),
            RemoteError::CostModel(e) => e.kind(),
            RemoteError::Transport(e) => e.kind(),
            RemoteError::Store(e) => e.kind(),
            RemoteError::Kernel(e) => e.kind(),
            RemoteError::Stopped | RemoteError::Probe(_) | RemoteError::Io { .. } => Kind::Other,
        }
    }
}

impl ToPyErr for StepError {
    fn kind(&self) -> Kind {
        match self {
            StepError::NoCopy { .. } => Kind::Unreachable,
            StepError::Chunk { source, .. } => source.kind(),
            StepError::Request { .. } | StepError::Config(_) => Kind::InvalidInput,
            StepError::Remote(e) => e.kind(),
            StepError::Route(e) => e.kind(),
            StepError::Kernel(e) => e.kind(),
            StepError::Sched(e) => e.kind(),
            StepError::CostModel(e) => e.kind(),
        }
    }
}

impl ToPyErr for CostModelError {
    fn kind(&self) -> Kind {
        match self {
            CostModelError::UnknownPreset { .. } => Kind::NotFound,
            _ => Kind::InvalidInput,
        }
    }
}

impl ToPyErr for KernelError {
    fn kind(&self) -> Kind {
        Kind::InvalidInput
    }
}

impl ToPyErr for StoreError {
    fn kind(&self) -> Kind {
        match self {
            StoreError::UnknownChunk(_) | StoreError::NotAllocated(_) => Kind::NotFound,
            StoreError::PoolExhausted { .. } => Kind::CacheFull,
            _ => Kind::InvalidInput,
        }
    }
}

impl ToPyErr for StorageError {
    fn kind(&self) -> Kind {
        match self {
            StorageError::Missing { .. } => Kind::NotFound,
            StorageError::Corrupt { .. } => Kind::Corrupt,
            StorageError::WrongLayout { .. } | StorageError::Shape { .. } => Kind::InvalidInput,
            StorageError::Layout(e) => e.kind(),
            StorageError::Io { .. } => Kind::Other,
        }
    }
}

impl ToPyErr for CacheError {
    fn kind(&self) -> Kind {
        match self {
            CacheError::Full(_) => Kind::CacheFull,
            CacheError::Pinned(_) => Kind::Pinned,
            CacheError::State { state, .. } if state.starts_with("not") => Kind::NotFound,
            CacheError::State { .. } | CacheError::UnknownPolicy(_) => Kind::InvalidInput,
        }
    }
}

impl ToPyErr for SchedError {
    fn kind(&self) -> Kind {
        match self {
            SchedError::CostModel(e) => e.kind(),
            SchedError::Cache(e) => e.kind(),
            SchedError::Open { .. } => Kind::NotFound,
            SchedError::Trace(_) => Kind::Corrupt,
            SchedError::NoHolder { .. } => Kind::Unreachable,
            _ => Kind::InvalidInput,
        }
    }
}

impl ToPyErr for TransportError {
    fn kind(&self) -> Kind {
        match self {
            TransportError::OutOfBounds { .. }
            | TransportError::PageOutOfBounds { .. }
            | TransportError::StrideTooSmall { .. }
            | TransportError::PageCountMismatch { .. }
            | TransportError::EmptyTransfer
            | TransportError::InvalidArgument(_)
            | TransportError::MalformedAddress(_)
            | TransportError::MessageTooLarge { .. } => Kind::InvalidInput,
            _ => Kind::Transport,
        }
    }
}
