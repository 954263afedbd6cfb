//! `encode_kv_events`' arguments: the event arrays a caller passes (the
//! dict `take_events` returns), looked up, converted and borrowed in an order
//! that runs no Python code between a borrow and its last use.

use numpy::{PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::convert::int_arg;
use crate::errors::invalid_argument;

/// `events[key]`, or InvalidArgumentError naming the missing key. A dict
/// lookup can run Python code (a key's `__eq__`): every value is looked up
/// before any array is borrowed.
pub(crate) fn item<'py>(
    py: Python<'py>,
    d: &Bound<'py, PyDict>,
    key: &str,
) -> PyResult<Bound<'py, PyAny>> {
    d.get_item(key)?
        .ok_or_else(|| invalid_argument(py, format!("events has no {key:?} array")))
}

fn array<'py, T: numpy::Element>(
    py: Python<'py>,
    v: &Bound<'py, PyAny>,
    key: &str,
    dtype: &str,
) -> PyResult<PyReadonlyArray1<'py, T>> {
    v.extract::<PyReadonlyArray1<'py, T>>().map_err(|_| {
        invalid_argument(
            py,
            format!("events[{key:?}] must be a 1-D {dtype} numpy array (what take_events returns)"),
        )
    })
}

/// The arrays `encode_kv_events` reads, in this order.
pub(crate) const KEYS: [&str; 8] = [
    "kind",
    "hash_hi",
    "hash_lo",
    "parent_hi",
    "parent_lo",
    "num_tokens",
    "salt",
    "token_ids",
];

/// The event arrays borrowed read-only (`objs`: the values of [`KEYS`]).
pub(crate) struct Borrowed<'py> {
    pub(crate) kind: PyReadonlyArray1<'py, u8>,
    pub(crate) hash_hi: PyReadonlyArray1<'py, u64>,
    pub(crate) hash_lo: PyReadonlyArray1<'py, u64>,
    pub(crate) parent_hi: PyReadonlyArray1<'py, u64>,
    pub(crate) parent_lo: PyReadonlyArray1<'py, u64>,
    pub(crate) num_tokens: PyReadonlyArray1<'py, i32>,
    pub(crate) salt: PyReadonlyArray1<'py, i64>,
    pub(crate) token_ids: PyReadonlyArray1<'py, i32>,
}

impl<'py> Borrowed<'py> {
    pub(crate) fn of(py: Python<'py>, objs: &[Bound<'py, PyAny>]) -> PyResult<Self> {
        Ok(Borrowed {
            kind: array(py, &objs[0], KEYS[0], "uint8")?,
            hash_hi: array(py, &objs[1], KEYS[1], "uint64")?,
            hash_lo: array(py, &objs[2], KEYS[2], "uint64")?,
            parent_hi: array(py, &objs[3], KEYS[3], "uint64")?,
            parent_lo: array(py, &objs[4], KEYS[4], "uint64")?,
            num_tokens: array(py, &objs[5], KEYS[5], "int32")?,
            salt: array(py, &objs[6], KEYS[6], "int64")?,
            token_ids: array(py, &objs[7], KEYS[7], "int32")?,
        })
    }
}

pub(crate) fn slice<'a, T: numpy::Element>(
    py: Python<'_>,
    a: &'a PyReadonlyArray1<'_, T>,
    key: &str,
) -> PyResult<&'a [T]> {
    a.as_slice().map_err(|_| {
        // numpy's view refuses a misaligned array too (one at an odd byte
        // offset of its buffer, contiguous or not): name which it is.
        let why = if a.is_aligned() {
            "is not contiguous"
        } else {
            "is not aligned to its dtype (a view at an odd byte offset)"
        };
        invalid_argument(
            py,
            format!("events[{key:?}] must be contiguous and aligned, but it {why}; pass a copy (arr.copy())"),
        )
    })
}

pub(crate) fn optional(
    py: Python<'_>,
    v: Option<Bound<'_, PyAny>>,
    key: &str,
    n: usize,
) -> PyResult<Option<Vec<i64>>> {
    let Some(v) = v else {
        return Ok(None);
    };
    let v = int_arg(py, &v, key)?.into_vec();
    if v.len() != n {
        return Err(invalid_argument(
            py,
            format!("events[{key:?}] has {} entries for {n} events", v.len()),
        ));
    }
    Ok(Some(v))
}

/// A copy of a caller's array, or MemoryError.
pub(crate) fn owned<T: Copy>(s: &[T]) -> PyResult<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(s.len()).map_err(|_| {
        pyo3::exceptions::PyMemoryError::new_err(format!(
            "cannot allocate {} values to copy an events array into",
            s.len()
        ))
    })?;
    v.extend_from_slice(s);
    Ok(v)
}
