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
    match counts {
        IntArg::Scalar(c) => usize::try_from(*c)
            .ok()
            .filter(|&c| c <= max_context_len)
            .and_then(|c| c.checked_mul(n_handles))
            .filter(|&t| t <= num_slots)
            .unwrap_or(0),
        IntArg::Many(v) => counts_total(v, num_slots, max_context_len),
    }
}

/// [`extend_total`] of one count per request.
pub fn counts_total(counts: &[i64], num_slots: usize, max_context_len: usize) -> usize {
    counts
        .iter()
        .try_fold(0usize, |acc, &c| {
            let c = usize::try_from(c).ok().filter(|&c| c <= max_context_len)?;
            acc.checked_add(c)
        })
        .filter(|&t| t <= num_slots)
        .unwrap_or(0)
}

/// `extend(..., out=)`: a caller's int64 array that receives the new slots,
/// so a step allocates no result array (an engine keeps one buffer, as
/// vLLM's model runner keeps its `slot_mapping` buffer). The core writes
/// into a per-thread scratch buffer and the slots are copied into `out`
/// only once the batch has succeeded: a failing call leaves `out` as it was.
pub struct CallerOut {
    ptr: NonNull<i64>,
    /// Slots this call writes (the front of the array).
    len: usize,
}

// SAFETY: the buffer belongs to an array the caller passed and keeps alive
// (it holds the reference) for the whole call; it is written once, under
// the allocator lock, after the batch has succeeded. As with `table=`, the
// caller must not resize or free the array's buffer from another thread
// during the call (numpy's own rule for buffers lent out).
unsafe impl Send for CallerOut {}

/// Most slots the per-thread scratch buffer keeps between calls (1 MiB):
/// a step's worth for any engine; a larger one is freed after its call.
const SCRATCH_KEEP: usize = 1 << 17;

thread_local! {
    /// The core's output for calls with `out=`, reused from call to call.
    static SCRATCH: std::cell::RefCell<Vec<i64>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl CallerOut {
    /// Checks that `obj` is a writeable, aligned, contiguous 1-D int64 numpy
    /// array with room for `need` slots, and that it shares no memory with
    /// `avoid` (the `table=` buffer, as a byte range).
    pub fn validate(
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        need: usize,
        avoid: Option<(usize, usize)>,
    ) -> PyResult<Self> {
        use numpy::npyffi::{objects::_PyArray_GET_ITEM_DATA, NPY_ARRAY_WRITEABLE};
        use numpy::{PyUntypedArray, PyUntypedArrayMethods};
        let bad = |m: String| Err(invalid_argument(py, m));
        let Ok(arr) = obj.cast::<PyUntypedArray>() else {
            return bad(format!(
                "out must be a 1-D int64 numpy array (e.g. np.empty(n, np.int64)), got {}",
                crate::convert::type_name(obj)
            ));
        };
        let dtype = arr.dtype();
        let int64 = dtype.kind() == b'i'
            && dtype.itemsize() == 8
            && dtype.is_native_byteorder().unwrap_or(true);
        if arr.ndim() != 1 || !int64 {
            return bad(format!(
                "out must be a 1-D int64 array, got a {}-D array of dtype {dtype}",
                arr.ndim()
            ));
        }
        let len = arr.shape()[0];
        if len < need {
            return bad(format!(
                "out holds {len} entries but this call writes {need} slots; pass an array of \
                 at least sum(counts) entries"
            ));
        }
        if (arr.strides()[0] != 8 && len > 1) || !arr.is_aligned() {
            return bad(format!(
                "out must be contiguous and int64-aligned (e.g. np.empty(n, np.int64)); got \
                 stride {} bytes",
                arr.strides()[0]
            ));
        }
        // SAFETY: `arr` is a live numpy array, so its object struct is valid.
        let (flags, data) = unsafe {
            let obj = &*_PyArray_GET_ITEM_DATA(arr.as_array_ptr());
            (obj.flags, obj.data as *mut i64)
        };
        if flags & NPY_ARRAY_WRITEABLE == 0 {
            return bad("out is not writable: The given array is not writeable".into());
        }
        let start = data as usize;
        if let Some((lo, hi)) = avoid {
            if start < hi && lo < start + len * 8 {
                return bad("out and table share memory; pass separate arrays".into());
            }
        }
        // Nothing to write: a dangling pointer (an empty array's data
        // pointer may be misaligned even when numpy flags it aligned, and a
        // zero-length copy still needs an aligned one).
        let ptr = match (need, NonNull::new(data)) {
            (0, _) => NonNull::dangling(),
            (_, Some(p)) => p,
            (_, None) => return bad("out has no data buffer".into()),
        };
        Ok(CallerOut { ptr, len: need })
    }

    /// Runs `f` on a scratch buffer of this call's length, then copies it to
    /// the caller's array if `f` succeeded.
    pub fn fill<R, E>(
        &mut self,
        f: impl FnOnce(&mut [i64]) -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E>
    where
        E: From<kvpool_core::PoolError>,
    {
        SCRATCH.with(|cell| {
            let mut scratch = cell.borrow_mut();
            // Grown, never cleared: only its growth is zero-filled, so a
            // call costs one copy of its slots, not a fill and a copy.
            if scratch.len() < self.len {
                let more = self.len - scratch.len();
                scratch.try_reserve(more).map_err(|_| {
                    E::from(kvpool_core::PoolError::InvalidArgument(format!(
                        "cannot allocate scratch for {} slots; extend in smaller batches",
                        self.len
                    )))
                })?;
                scratch.resize(self.len, 0);
            }
            let r = f(&mut scratch[..self.len]);
            if r.is_ok() {
                // SAFETY: the caller's array is alive and holds at least
                // `len` int64 entries, contiguous and aligned (validated),
                // and shares no memory with the scratch buffer or the table.
                unsafe {
                    std::ptr::copy_nonoverlapping(scratch.as_ptr(), self.ptr.as_ptr(), self.len)
                };
            }
            if scratch.capacity() > SCRATCH_KEEP {
                // A rare huge prefill: do not keep its buffer for good.
                *scratch = Vec::new();
            }
            r
        })
    }
}
