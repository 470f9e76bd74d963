//! NumPy in and out without copies: bf16 rows borrowed as `uint16` (an `int16`, ml_dtypes
//! `bfloat16` or any 2-byte array is viewed as `uint16`, a PyTorch CPU tensor taken through
//! DLPack), and results handed over as arrays that own the Rust vectors they were computed in.

use numpy::ndarray::{Array1, Array2};
use numpy::{PyArray1, PyArray2, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use crate::errors::invalid;

static NUMPY: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

fn numpy_module(py: Python<'_>) -> PyResult<&Bound<'_, PyModule>> {
    Ok(NUMPY
        .get_or_try_init(py, || py.import("numpy").map(Bound::unbind))?
        .bind(py))
}

/// Borrows `obj` as C-contiguous `uint16` (bf16 bits): a `uint16` array as it is, any other
/// array of 2-byte items through a `uint16` view, an object with `__dlpack__` (a PyTorch CPU
/// tensor; bf16 viewed as int16 first) through `numpy.from_dlpack`. No element is copied.
pub(crate) fn u16_rows<'py>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, u16>> {
    if let Ok(a) = obj.extract::<PyReadonlyArrayDyn<'py, u16>>() {
        return contiguous(a, what);
    }
    let py = obj.py();
    let np = numpy_module(py)?;
    let array = if obj.is_instance(&np.getattr("ndarray")?)? {
        obj.clone()
    } else if obj.hasattr("__dlpack__")? {
        let tensor = match obj.getattr("dtype")?.str()?.to_str()? {
            "torch.bfloat16" | "torch.float16" => {
                let int16 = py.import("torch")?.getattr("int16")?;
                obj.call_method1("view", (int16,))?
            }
            _ => obj.clone(),
        };
        np.call_method1("from_dlpack", (tensor,)).map_err(|e| {
            invalid(format!(
                "{what}: {e} (only host memory comes in: a CPU tensor, not a GPU one)"
            ))
        })?
    } else {
        return Err(invalid(format!(
            "{what}: expected a NumPy array of bf16 bits (uint16), got {}",
            obj.get_type().name()?
        )));
    };
    let itemsize: usize = array.getattr("itemsize")?.extract()?;
    if itemsize != 2 {
        return Err(invalid(format!(
            "{what}: expected bf16 bits (uint16, 2 bytes an element), got dtype {}",
            array.getattr("dtype")?.str()?
        )));
    }
    let view = array.call_method1("view", ("uint16",))?;
    contiguous(view.extract()?, what)
}

/// `obj` as C-contiguous `int32` (token indices).
pub(crate) fn i32_indices<'py>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, i32>> {
    let a = obj.extract::<PyReadonlyArrayDyn<'py, i32>>().map_err(|_| {
        invalid(format!(
            "{what}: expected a NumPy int32 array of token indices"
        ))
    })?;
    if !a.is_c_contiguous() {
        return Err(invalid(format!("{what}: the array must be C-contiguous")));
    }
    Ok(a)
}

fn contiguous<'py>(
    a: PyReadonlyArrayDyn<'py, u16>,
    what: &str,
) -> PyResult<PyReadonlyArrayDyn<'py, u16>> {
    if a.is_c_contiguous() {
        Ok(a)
    } else {
        Err(invalid(format!(
            "{what}: the array must be C-contiguous (numpy.ascontiguousarray copies it once)"
        )))
    }
}

/// The slice of a borrowed contiguous array.
pub(crate) fn slice<'a, T: numpy::Element>(
    a: &'a PyReadonlyArrayDyn<'_, T>,
    what: &str,
) -> PyResult<&'a [T]> {
    a.as_slice().map_err(|e| invalid(format!("{what}: {e}")))
}

/// `values` as a `[rows, cols]` float32 array that owns them (no copy).
pub(crate) fn owned_2d(
    py: Python<'_>,
    values: Vec<f32>,
    rows: usize,
    cols: usize,
) -> PyResult<Py<PyArray2<f32>>> {
    let a = Array2::from_shape_vec((rows, cols), values)
        .map_err(|e| invalid(format!("output shape: {e}")))?;
    Ok(PyArray2::from_owned_array(py, a).unbind())
}

/// `values` as a float32 vector that owns them (no copy).
pub(crate) fn owned_1d(py: Python<'_>, values: Vec<f32>) -> Py<PyArray1<f32>> {
    PyArray1::from_owned_array(py, Array1::from_vec(values)).unbind()
}

/// `values` as a uint16 vector that owns them (no copy).
pub(crate) fn owned_u16(py: Python<'_>, values: Vec<u16>) -> Py<PyArray1<u16>> {
    PyArray1::from_owned_array(py, Array1::from_vec(values)).unbind()
}
