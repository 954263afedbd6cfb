//! Integer arguments given as CPU torch tensors (handles, counts and token
//! ids straight from an engine's tensors), read in place through the
//! tensor's data pointer. `numpy.asarray(tensor)` costs ~2.8 us a tensor
//! (torch's `__array__` wrapper, then a new array); the handful of attribute
//! reads here cost ~1 us. Anything that is not a plain, contiguous, 1-D CPU
//! tensor of a supported integer dtype is left to the numpy path, which
//! reads it or names what is wrong (a CUDA tensor, a float dtype).

use pyo3::exceptions::{PyException, PyMemoryError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// `torch.Tensor`, looked up when the first object that looks like one
/// arrives (torch is never imported here before that: a caller that passes
/// a tensor has imported it).
static TENSOR_TYPE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
/// torch's integer dtypes read in place, with their size and signedness.
static DTYPES: PyOnceLock<Vec<(Py<PyAny>, usize, bool)>> = PyOnceLock::new();

fn is_plain_tensor(py: Python<'_>, obj: &Bound<'_, PyAny>) -> bool {
    let ty = obj.get_type();
    if let Some(t) = TENSOR_TYPE.get(py) {
        return ty.is(t.bind(py));
    }
    // Exactly torch.Tensor: subclasses (parameters, fake and wrapper
    // tensors) may not own plain memory, so they take the numpy path. The
    // name is only a cheap filter; the type must be torch's own object (a
    // class that merely calls itself torch.Tensor is not trusted with a
    // data pointer).
    let named = ty.name().is_ok_and(|n| n == "Tensor")
        && ty
            .module()
            .is_ok_and(|m| m == "torch" || m == "torch._tensor");
    if !named {
        return false;
    }
    let Ok(real) = py
        .import("torch")
        .and_then(|t| t.getattr("Tensor"))
        .and_then(|t| Ok(t.cast_into::<PyType>()?))
    else {
        return false;
    };
    let _ = TENSOR_TYPE.set(py, real.clone().unbind());
    ty.is(&real)
}

fn dtypes(py: Python<'_>) -> PyResult<&Vec<(Py<PyAny>, usize, bool)>> {
    DTYPES.get_or_try_init(py, || {
        let torch = py.import("torch")?;
        [
            ("int64", 8, true),
            ("int32", 4, true),
            ("int16", 2, true),
            ("int8", 1, true),
            ("uint8", 1, false),
        ]
        .into_iter()
        .map(|(name, size, signed)| Ok((torch.getattr(name)?.unbind(), size, signed)))
        .collect()
    })
}

/// The tensor's values as i64, or None to leave it to the numpy path
/// (which names what is wrong). A tensor's own errors (an attribute that
/// raises) fall through to that path too; MemoryError and interrupts
/// (KeyboardInterrupt is no Exception) are the caller's and propagate.
pub fn read_tensor(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<i64>>> {
    if !is_plain_tensor(py, obj) {
        return Ok(None);
    }
    match read_plain(py, obj) {
        Err(e) if e.is_instance_of::<PyException>(py) && !e.is_instance_of::<PyMemoryError>(py) => {
            Ok(None)
        }
        other => other,
    }
}

fn read_plain(py: Python<'_>, t: &Bound<'_, PyAny>) -> PyResult<Option<Vec<i64>>> {
    let truthy = |name: &Bound<'_, pyo3::types::PyString>| -> PyResult<bool> {
        t.call_method0(name)?.extract::<bool>()
    };
    if !t.getattr(intern!(py, "is_cpu"))?.extract::<bool>()?
        || t.call_method0(intern!(py, "dim"))?.extract::<usize>()? != 1
        || !truthy(intern!(py, "is_contiguous"))?
        // A negative view stores the values unnegated.
        || truthy(intern!(py, "is_neg"))?
    {
        return Ok(None);
    }
    let dtype = t.getattr(intern!(py, "dtype"))?;
    let Some(&(_, size, signed)) = dtypes(py)?.iter().find(|(d, _, _)| d.bind(py).is(&dtype))
    else {
        return Ok(None);
    };
    let len = t.call_method0(intern!(py, "numel"))?.extract::<usize>()?;
    if len == 0 {
        return Ok(Some(Vec::new()));
    }
    let ptr = t
        .call_method0(intern!(py, "data_ptr"))?
        .extract::<usize>()?;
    if ptr == 0 || ptr % size != 0 {
        return Ok(None);
    }
    // SAFETY: a contiguous 1-D CPU tensor of this dtype (checked) holds
    // `len` aligned (checked) items at its data pointer; the tensor is
    // alive (`t`) and no Python code runs from reading the pointer to the
    // copy.
    let kind = (if signed { b'i' } else { b'u' }, size);
    unsafe { crate::convert::widen(ptr as *const u8, len, size as isize, kind) }.map(Some)
}
