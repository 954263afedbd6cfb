//! Result arrays of extend, allocated once as numpy arrays before the GIL is
//! released and filled in place by the core: no intermediate Vec, no second
//! copy (a prefill's 8 x 2048 slots are 128 KiB, past malloc's mmap threshold,
//! so a Vec there also cost page faults on every call).

use std::ptr::NonNull;

use numpy::npyffi::{npy_intp, PY_ARRAY_API};
use numpy::{Element, PyArray1, PyArrayDescrMethods, PyArrayMethods};
use pyo3::prelude::*;

use crate::convert::IntArg;
use crate::errors::invalid_argument;

/// A fresh numpy array's buffer, to be filled with the GIL released.
pub struct OutBuf {
    ptr: NonNull<i64>,
    len: usize,
}

// SAFETY: the buffer belongs to an array that this call created and has not
// yet handed to Python, so no other thread can reach it; the array object is
// kept alive by the caller (it returns the array) for as long as the OutBuf.
unsafe impl Send for OutBuf {}

impl OutBuf {
    /// The buffer as a slice.
    ///
    /// # Safety
    /// Only while the array it came from is alive and still unshared, and
    /// only once per OutBuf (the slice is exclusive).
    pub unsafe fn slice(&mut self) -> &mut [i64] {
        std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len)
    }
}

/// A zero-filled int64 array of `len` entries and its buffer. Zeroed, not
/// uninitialized, so that no Rust slice ever covers uninitialized memory
/// (numpy's calloc makes that nearly free). Fallible: an array too big for
/// memory is an InvalidArgumentError (a KVPoolError), never a panic or abort.
pub fn new_i64(py: Python<'_>, len: usize) -> PyResult<(Bound<'_, PyArray1<i64>>, OutBuf)> {
    let too_big = |py: Python<'_>| {
        invalid_argument(
            py,
            format!(
                "cannot allocate the int64 result for {len} slots ({} bytes); \
                 extend in smaller batches",
                len.saturating_mul(8)
            ),
        )
    };
    let mut dims = [npy_intp::try_from(len).map_err(|_| too_big(py))?];
    // SAFETY: PyArray_Zeros steals the dtype reference that into_dtype_ptr
    // hands over, and returns a new reference or null with an exception set.
    let arr = unsafe {
        let ptr = PY_ARRAY_API.PyArray_Zeros(
            py,
            1,
            dims.as_mut_ptr(),
            i64::get_dtype(py).into_dtype_ptr(),
            0,
        );
        Bound::from_owned_ptr_or_err(py, ptr)
            .map_err(|_| too_big(py))?
            .cast_into::<PyArray1<i64>>()?
    };
    // A 0-length array may carry any data pointer; the slice needs a non-null
    // aligned one.
    let ptr = match (len, NonNull::new(arr.data())) {
        (0, _) => NonNull::dangling(),
        (_, Some(p)) => p,
        (_, None) => return Err(too_big(py)),
    };
    Ok((arr, OutBuf { ptr, len }))
}

/// The number of slots an extend with these arguments adds if it succeeds,
/// or 0 when it cannot succeed (a negative count, a count past
/// `max_context_len`, or more slots than the pool has: the core's validation
/// then reports why before anything is written, so a huge count never
/// allocates a huge array, even in a pool with a huge page size).
pub fn extend_total(
    n_handles: usize,
    counts: &IntArg,
    num_slots: usize,
    max_context_len: usize,
) -> usize {
    let one = |c: i64| usize::try_from(c).ok().filter(|&c| c <= max_context_len);
    let total = match counts {
        IntArg::Scalar(c) => one(*c).and_then(|c| c.checked_mul(n_handles)),
        IntArg::Many(v) => v
            .iter()
            .try_fold(0usize, |acc, &c| one(c).and_then(|c| acc.checked_add(c))),
    };
    total.filter(|&t| t <= num_slots).unwrap_or(0)
}
