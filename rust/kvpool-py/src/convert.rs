//! Argument conversion: Python int, list/tuple of ints, numpy integer arrays
//! of any dtype, and anything numpy.asarray accepts (CPU torch tensors) become
//! a plain i64 or Vec<i64> before any work starts, so the work itself can run
//! without the GIL. Floats, bools and arrays that are not 1-D are rejected
//! with InvalidArgumentError naming what was wrong.

use crate::errors::{invalid_argument, refuse_unless_interrupt};
use crate::widen::{try_vec, widen};
use kvpool_core::Counts;
use numpy::npyffi::objects::_PyArray_GET_ITEM_DATA;
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

pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
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
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        // An element that is itself a sequence: the int64 range is not the problem.
        return Err(invalid_argument(
            py,
            format!(
                "{what} must be a flat sequence of ints (1-D), got a nested {} {obj} inside it",
                type_name(obj)
            ),
        ));
    }
    obj.extract::<i64>().map_err(|e| {
        refuse_unless_interrupt(py, e, || {
            invalid_argument(
                py,
                format!(
                    "{what} must be ints in the int64 range [-2**63, 2**63), got {} {}",
                    type_name(obj),
                    obj
                ),
            )
        })
    })
}

/// One element of a list or tuple of ints. Token ids arrive as lists
/// (SGLang and vLLM keep prompts as lists of ints), thousands at a time: a
/// plain int is read straight from the borrowed item (no new reference, no
/// type object built); anything else, a bool or an int past int64 included,
/// goes through `scalar`, which accepts or names it.
///
/// # Safety
/// `item` must be a live object, borrowed from a container the caller holds.
// Inlined: it runs once per item of a list, where a call's cost adds up.
#[inline(always)]
unsafe fn item_int(py: Python<'_>, item: *mut pyo3::ffi::PyObject, what: &str) -> PyResult<i64> {
    use pyo3::ffi;
    if ffi::Py_TYPE(item) == std::ptr::addr_of_mut!(ffi::PyLong_Type) {
        let v = ffi::PyLong_AsLongLong(item);
        if v != -1 {
            return Ok(v);
        }
        // -1, or an int past int64 with OverflowError set. The item gets
        // its own reference before the error is looked at: taking it
        // (normalizing it, below Python 3.12) allocates the exception,
        // which can run the GC, whose finalizers could drop the item from
        // its list while it is only borrowed.
        let obj = Bound::from_borrowed_ptr(py, item);
        if PyErr::take(py).is_none() {
            return Ok(-1);
        }
        // Past int64: `scalar` says so.
        return scalar(py, &obj, what);
    }
    // The Bound takes its own reference: `scalar` may run Python code (an
    // __index__) that changes the container, and the item must outlive it.
    scalar(py, &Bound::from_borrowed_ptr(py, item), what)
}

/// A list's ints (see `item_int`).
fn list_ints(py: Python<'_>, list: &Bound<'_, PyList>, what: &str) -> PyResult<Vec<i64>> {
    let mut out = Vec::with_capacity(list.len());
    let mut i = 0;
    // An element's __index__ may change the list: its length is re-read
    // each time.
    while i < list.len() {
        // SAFETY: `i` is in range (checked just above, with the GIL held and
        // no Python code run since); PyList_GetItem returns a borrowed
        // reference to a live item (or null with an error set, handled).
        let item = unsafe { pyo3::ffi::PyList_GetItem(list.as_ptr(), i as pyo3::ffi::Py_ssize_t) };
        if item.is_null() {
            return Err(PyErr::fetch(py));
        }
        // SAFETY: `item` is live, borrowed from `list`.
        out.push(unsafe { item_int(py, item, what) }?);
        i += 1;
    }
    Ok(out)
}

/// A tuple's ints (see `item_int`).
fn tuple_ints(py: Python<'_>, t: &Bound<'_, PyTuple>, what: &str) -> PyResult<Vec<i64>> {
    (0..t.len())
        .map(|i| {
            // SAFETY: `i` < len of an immutable tuple; PyTuple_GetItem
            // returns a borrowed reference to a live item (or null with an
            // error set, handled).
            let item =
                unsafe { pyo3::ffi::PyTuple_GetItem(t.as_ptr(), i as pyo3::ffi::Py_ssize_t) };
            if item.is_null() {
                return Err(PyErr::fetch(py));
            }
            // SAFETY: `item` is live, borrowed from `t`.
            unsafe { item_int(py, item, what) }
        })
        .collect()
}

/// An aligned, native-order, 1-D array of a signed integer type or an
/// unsigned one narrower than 64 bits, read in place and widened to i64: no
/// `astype` call (a Python call and a new array) and no typed cast (which builds and compares a dtype
/// descriptor on every call). None for anything else.
fn read_native(arr: &Bound<'_, PyUntypedArray>) -> Option<PyResult<Vec<i64>>> {
    if arr.ndim() != 1 || !arr.is_aligned() {
        return None;
    }
    let dtype = arr.dtype();
    let kind = (dtype.kind(), dtype.itemsize());
    if !dtype.is_native_byteorder().unwrap_or(true)
        || !matches!(kind, (b'i', 1 | 2 | 4 | 8) | (b'u', 1 | 2 | 4))
    {
        return None;
    }
    let (len, stride) = (arr.len(), arr.strides()[0]);
    if len == 0 {
        return Some(Ok(Vec::new()));
    }
    // SAFETY: `arr` is a live numpy array, so its object struct is valid.
    let data = unsafe { (*_PyArray_GET_ITEM_DATA(arr.as_array_ptr())).data } as *const u8;
    // SAFETY: numpy's own shape and strides place `len` items of its dtype
    // (`kind`, checked) inside the array's buffer, each aligned (checked);
    // the array is alive (`arr`) and cannot change while the GIL is held.
    Some(unsafe { widen(data, len, stride, kind) })
}

fn from_ndarray(py: Python<'_>, arr: &Bound<'_, PyUntypedArray>, what: &str) -> PyResult<IntArg> {
    // Fast path: an aligned 1-D integer array is read in place (a
    // misaligned one, e.g. a view at an odd byte offset, goes through
    // astype, which makes an aligned copy; reading it in place would be UB
    // in Rust). Not through readonly(): numpy's Rust borrow tracker costs
    // ~50 ns per argument, and it panics if some other Rust code holds a
    // mutable borrow.
    if let Some(v) = read_native(arr) {
        return v.map(IntArg::Many);
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
            let a = cast.cast::<PyArray1<i64>>()?.readonly();
            let mut v = try_vec(a.len())?;
            v.extend(a.as_array().iter().copied());
            Ok(IntArg::Many(v))
        }
        n => Err(invalid_argument(
            py,
            format!("{what} must be an int or a 1-D integer array, got a {n}-D array"),
        )),
    }
}

/// Converts an int / sequence / array argument. `what` names it in errors.
pub fn int_arg(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<IntArg> {
    if obj.is_none() || obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        // numpy would read "12" as a 0-D string array (and None as dtype object); name the
        // real problem.
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
        return list_ints(py, list, what).map(IntArg::Many);
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return tuple_ints(py, t, what).map(IntArg::Many);
    }
    if let Some(v) = crate::torch_arg::read_tensor(py, obj, Some(what))? {
        return Ok(IntArg::Many(v));
    }
    // numpy scalars, other torch tensors, anything with __array__ / the buffer protocol.
    let asarray = ASARRAY.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        Ok(py.import("numpy")?.getattr("asarray")?.unbind())
    })?;
    let converted = asarray.bind(py).call1((obj,)).map_err(|e| {
        let msg = format!(
            "{what} must be an int, a sequence of ints or an integer array (CPU tensor); \
             got {} that numpy cannot read: {e}",
            type_name(obj)
        );
        refuse_unless_interrupt(py, e, || invalid_argument(py, msg))
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

/// A flag's value: True or False (a numpy bool too). Anything else (1, None,
/// "yes") is refused by name, as pyo3's own `bool` would only with a
/// TypeError.
fn flag(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<bool> {
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(b.is_true());
    }
    let py = obj.py();
    if obj.get_type().is(numpy::dtype::<bool>(py).typeobj()) {
        return obj.is_truthy();
    }
    Err(invalid_argument(
        py,
        format!(
            "{what} takes True or False, got {} {}",
            type_name(obj),
            obj.repr()?
        ),
    ))
}

/// Keyword flags of the bindings, one type each so that a refusal names
/// the argument (pyo3 only adds a note to an extraction error).
macro_rules! flags {
    ($($ty:ident => $what:literal),* $(,)?) => {$(
        #[doc = concat!("The `", $what, "` flag (see [`flag`]).")]
        #[derive(Clone, Copy)]
        pub struct $ty(pub bool);

        impl<'a, 'py> FromPyObject<'a, 'py> for $ty {
            type Error = PyErr;

            fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
                flag(&obj, $what).map($ty)
            }
        }
    )*};
}

flags!(
    CacheFlag => "cache",
    CowFlag => "cow",
    KvEventsFlag => "kv_events",
    ManualClockFlag => "manual_clock",
    LazyMetadataFlag => "lazy_metadata",
    IntBlockHashesFlag => "int_block_hashes",
);

pub(crate) fn counts_of(arg: &IntArg) -> Counts<'_> {
    match arg {
        IntArg::Scalar(c) => Counts::Each(*c),
        IntArg::Many(v) => Counts::PerRequest(v),
    }
}

/// A non-negative int argument: bools, floats, strings and ints outside
/// int64 are InvalidArgumentError (not TypeError / OverflowError).
pub(crate) fn usize_arg(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    size_arg(py, obj, what, 0)
}

/// `usize_arg` for a size whose least valid value is `least`: a negative
/// one is told that value, not usize's 0 (">= 0" for a `num_pages` of -1
/// suggested 0, which the range check then refuses too). Values from 0 to
/// `least - 1` are left to the range check that states the whole range.
pub(crate) fn size_arg(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    what: &str,
    least: usize,
) -> PyResult<usize> {
    let v = int_scalar(py, obj, what)?;
    usize::try_from(v)
        .map_err(|_| invalid_argument(py, format!("{what} must be >= {least}, got {v}")))
}

/// A seed (`what`: hash_seed, handle_seed): a Python int in [0, 2^64).
pub(crate) fn seed_arg(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    if obj.is_instance_of::<pyo3::types::PyBool>() {
        return Err(invalid_argument(
            py,
            format!("{what} must be an int in [0, 2**64), got bool"),
        ));
    }
    obj.extract::<u64>().map_err(|e| {
        refuse_unless_interrupt(py, e, || {
            invalid_argument(
                py,
                format!("{what} must be an int in [0, 2**64), got {obj}"),
            )
        })
    })
}
