//! Argument conversion: Python int, list/tuple of ints, numpy integer arrays
//! of any dtype, and anything numpy.asarray accepts (CPU torch tensors) become
//! a plain i64 or Vec<i64> before any work starts, so the work itself can run
//! without the GIL. Floats, bools and arrays that are not 1-D are rejected
//! with InvalidArgumentError naming what was wrong.

use crate::errors::invalid_argument;
use numpy::{PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PyString, PyTuple};

pub enum IntArg {
    Scalar(i64),
    Many(Vec<i64>),
}

impl IntArg {
    pub fn into_vec(self) -> Vec<i64> {
        match self {
            IntArg::Scalar(v) => vec![v],
            IntArg::Many(v) => v,
        }
    }
}

static ASARRAY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

fn scalar(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<i64> {
    if obj.is_instance_of::<PyBool>() {
        return Err(invalid_argument(
            py,
            format!("{what} must be an int or ints, got bool {obj}: pass 0 or 1 if that is meant"),
        ));
    }
    obj.extract::<i64>().map_err(|_| {
        invalid_argument(
            py,
            format!(
                "{what} must be ints in the int64 range [-2**63, 2**63), got {} {}",
                type_name(obj),
                obj
            ),
        )
    })
}

fn from_ndarray(py: Python<'_>, arr: &Bound<'_, PyUntypedArray>, what: &str) -> PyResult<IntArg> {
    // Fast path: an aligned 1-D int64 array is copied straight out (a
    // misaligned one, e.g. a view at an odd byte offset, goes through astype,
    // which makes an aligned copy; reading it in place would be UB in Rust).
    if let (true, Ok(a)) = (arr.is_aligned(), arr.cast::<PyArray1<i64>>()) {
        // Read in place and copied at once, with the GIL held throughout, so
        // no Python code can change the array meanwhile. Not through
        // readonly(): numpy's Rust borrow tracker costs ~50 ns per argument,
        // and it panics if some other Rust code holds a mutable borrow.
        // SAFETY: aligned (checked), int64 (checked by the cast), alive (`a`),
        // and not mutated while the GIL is held.
        return Ok(IntArg::Many(match unsafe { a.as_slice() } {
            Ok(s) => s.to_vec(),
            Err(_) => unsafe { a.as_array() }.to_vec(),
        }));
    }
    let dtype = arr.dtype();
    let kind = dtype.kind();
    if kind != b'i' && kind != b'u' {
        return Err(invalid_argument(
            py,
            format!("{what} must have an integer dtype, got dtype {dtype}"),
        ));
    }
    match arr.ndim() {
        0 => Ok(IntArg::Scalar(scalar(
            py,
            &arr.call_method0("item")?,
            what,
        )?)),
        1 => {
            if kind == b'u' && dtype.itemsize() >= 8 {
                // uint64 values past int64 range would wrap on cast: refuse them.
                let too_big: bool = arr
                    .call_method0("max")
                    .and_then(|m| m.gt(i64::MAX))
                    .unwrap_or(false);
                if arr.len() > 0 && too_big {
                    return Err(invalid_argument(
                        py,
                        format!("{what} has values past int64 range"),
                    ));
                }
            }
            let cast = arr.call_method1("astype", ("int64",))?;
            let a = cast.cast::<PyArray1<i64>>()?;
            Ok(IntArg::Many(a.readonly().as_array().to_vec()))
        }
        n => Err(invalid_argument(
            py,
            format!("{what} must be an int or a 1-D integer array, got a {n}-D array"),
        )),
    }
}

/// Converts an int / sequence / array argument. `what` names it in errors.
pub fn int_arg(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<IntArg> {
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        // numpy would read "12" as a 0-D string array; name the real problem.
        return Err(invalid_argument(
            py,
            format!(
                "{what} must be an int or ints, got {} {}",
                type_name(obj),
                obj.repr()?
            ),
        ));
    }
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        return from_ndarray(py, arr, what);
    }
    if obj.is_instance_of::<PyInt>() {
        return Ok(IntArg::Scalar(scalar(py, obj, what)?));
    }
    if let Ok(list) = obj.cast::<PyList>() {
        return list
            .iter()
            .map(|x| scalar(py, &x, what))
            .collect::<PyResult<_>>()
            .map(IntArg::Many);
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return t
            .iter()
            .map(|x| scalar(py, &x, what))
            .collect::<PyResult<_>>()
            .map(IntArg::Many);
    }
    // numpy scalars, torch tensors, anything with __array__ / the buffer protocol.
    let asarray = ASARRAY.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        Ok(py.import("numpy")?.getattr("asarray")?.unbind())
    })?;
    let converted = asarray.bind(py).call1((obj,)).map_err(|e| {
        invalid_argument(
            py,
            format!(
                "{what} must be an int, a sequence of ints or an integer array (CPU tensor); \
                 got {} that numpy cannot read: {e}",
                type_name(obj)
            ),
        )
    })?;
    match converted.cast::<PyUntypedArray>() {
        Ok(arr) => from_ndarray(py, arr, what),
        Err(_) => Err(invalid_argument(
            py,
            format!("{what}: cannot read {}", type_name(obj)),
        )),
    }
}

/// A single integer (a handle, a count); arrays of one element are not accepted.
pub fn int_scalar(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<i64> {
    match int_arg(py, obj, what)? {
        IntArg::Scalar(v) => Ok(v),
        IntArg::Many(_) => Err(invalid_argument(py, format!("{what} must be a single int"))),
    }
}
