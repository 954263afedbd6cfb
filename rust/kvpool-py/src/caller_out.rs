//! `extend(..., out=)`: the caller's own int64 array as the step's slot
//! output, checked before the call and written only after it succeeds.
//! Apart from `output.rs`, whose arrays the bindings allocate themselves.

use std::ptr::NonNull;

use numpy::PyArrayDescrMethods;
use pyo3::prelude::*;

use crate::errors::invalid_argument;

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
