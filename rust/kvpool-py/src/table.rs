//! `extend(..., table=)`: writing new slots straight into a caller's int32
//! request-to-token table (numpy array, e.g. `tensor.numpy()`), validated
//! completely before the allocator changes so that the write cannot fail.

use numpy::npyffi::{objects::_PyArray_GET_ITEM_DATA, NPY_ARRAY_WRITEABLE};
use numpy::{Element, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use crate::errors::invalid_argument;

/// A validated raw view of the table. Sent into the GIL-free section.
pub struct Table {
    ptr: *mut i32,
    /// Elements from one row to the next: the column count, or more for a
    /// view of a wider array (a padded row stride, see `KVPool`).
    row_stride: usize,
}

// SAFETY: the pointer targets a numpy buffer kept alive by the caller's
// reference for the whole call; it is only written under the allocator lock,
// at rows owned by the requests being extended.
unsafe impl Send for Table {}
// SAFETY: as above; the GIL-free closure only reads the pointer value.
unsafe impl Sync for Table {}

impl Table {
    pub fn validate(
        py: Python<'_>,
        arr: &Bound<'_, PyUntypedArray>,
        max_requests: usize,
        max_context_len: usize,
        num_slots: usize,
    ) -> PyResult<Self> {
        let bad = |m: String| Err(invalid_argument(py, m));
        // The dtype by its type number (cached), not through the typed cast:
        // that builds and compares a descriptor on every call, ~0.4 us of a
        // decode step's extend.
        static INT32: PyOnceLock<i32> = PyOnceLock::new();
        let int32 = *INT32.get_or_init(py, || i32::get_dtype(py).num());
        let dtype = arr.dtype();
        if arr.ndim() != 2 || dtype.num() != int32 || !dtype.is_native_byteorder().unwrap_or(true) {
            return bad(format!(
                "table must be a 2-D int32 array, got a {}-D array of dtype {}",
                arr.ndim(),
                dtype
            ));
        }
        let a = arr;
        let shape = a.shape();
        if shape[0] < max_requests || shape[1] < max_context_len {
            return bad(format!(
                "table shape {:?} is too small: needs at least [{max_requests}, {max_context_len}] \
                 (max_requests, max_context_len)",
                shape
            ));
        }
        // Rows must be contiguous; the row stride may exceed the row (a
        // column slice of a wider array, which KVPool uses to keep rows off
        // a power-of-two stride: see `KVPool.req_to_token`).
        let strides = a.strides();
        let item = std::mem::size_of::<i32>() as isize;
        let row_ok = strides[0] >= shape[1] as isize * item && strides[0] % item == 0;
        if (strides[1] != item && shape[1] > 1) || !row_ok || !a.is_aligned() {
            return bad(format!(
                "table must have contiguous rows, a row stride of at least its width and                  int32 alignment (e.g. tensor.numpy()); got strides {strides:?} for shape {shape:?}"
            ));
        }
        if num_slots > i32::MAX as usize + 1 {
            return bad(format!(
                "num_slots = {num_slots} does not fit an int32 table"
            ));
        }
        // The WRITEABLE flag, read directly: numpy's Rust borrow tracker
        // (try_readwrite) costs ~90 ns a call and its borrow would be dropped
        // again at once anyway (see Table's SAFETY note).
        // SAFETY: `a` is a live numpy array, so its object struct is valid.
        let flags = unsafe { (*_PyArray_GET_ITEM_DATA(a.as_array_ptr())).flags };
        if flags & NPY_ARRAY_WRITEABLE == 0 {
            return bad("table is not writable: The given array is not writeable".into());
        }
        // SAFETY: `a` is a live numpy array, so its object struct is valid.
        let data = unsafe { (*_PyArray_GET_ITEM_DATA(a.as_array_ptr())).data } as *mut i32;
        Ok(Self {
            ptr: data,
            row_stride: (strides[0] / item) as usize,
        })
    }

    /// Writes one request's new `slots` to table[row, start..start+len]: a
    /// tight copy (slots of one request are contiguous in extend's output),
    /// done right after the core wrote them, while they are still in cache.
    ///
    /// # Safety
    /// `self` must come from `validate` on an array still alive, and the
    /// arguments must be those extend reported for a request (so
    /// start + len <= max_context_len <= columns and row < max_requests).
    pub unsafe fn write_row(&self, row: usize, start: usize, slots: &[i64]) {
        let dst = self.ptr.add(row * self.row_stride + start);
        if let [s] = slots {
            // A decode step's one slot: skip the vector loop's set-up.
            *dst = *s as i32;
            return;
        }
        for (j, &s) in slots.iter().enumerate() {
            *dst.add(j) = s as i32;
        }
    }

    /// Writes what extend reported for one request: its new slots, and the
    /// slots of positions a copy-on-write moved to a new page.
    ///
    /// # Safety
    /// As [`Self::write_row`], with `g` as reported by the core.
    pub unsafe fn write_grown(&self, g: &kvpool_core::Grown<'_>) {
        self.write_row(g.row, g.start, g.slots);
        if g.moved > 0 {
            if let Some(&first) = g.slots.first() {
                let dst = self.ptr.add(g.row * self.row_stride + g.start - g.moved);
                for j in 0..g.moved {
                    *dst.add(j) = (first - (g.moved - j) as i64) as i32;
                }
            }
        }
    }
}
