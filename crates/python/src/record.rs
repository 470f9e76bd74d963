//! Reports as Python objects: any serialisable value of the crates becomes a
//! `kvroute.Record` (attribute access, `to_dict()`, equality) with exactly the fields its
//! serde form has, which are the fields of the command line's `--json` output.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use serde::Serialize;

use crate::errors::{Kind, error};

static FROM_JSON: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// `value` as a `kvroute.Record` (or a list or scalar, as its serde form is).
pub(crate) fn to_record<T: Serialize>(py: Python<'_>, value: &T) -> PyResult<Py<PyAny>> {
    let json = serde_json::to_string(value)
        .map_err(|e| error(Kind::Other, format!("serialising a report: {e}")))?;
    let from_json = FROM_JSON.get_or_try_init(py, || {
        py.import("kvroute._record")?
            .getattr("from_json")
            .map(Bound::unbind)
    })?;
    Ok(from_json.bind(py).call1((json,))?.unbind())
}
