//! `extend(..., table=)`: writing new slots straight into a caller's int32
//! request-to-token table (numpy array, e.g. `tensor.numpy()`), validated
//! completely before the allocator changes so that the write cannot fail.

use numpy::npyffi::{objects::_PyArray_GET_ITEM_DATA, NPY_ARRAY_WRITEABLE};
use numpy::{Element, PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use crate::errors::invalid_argument;
use kvpool_core::SlotTable;

/// A validated raw view of the table. Sent into the GIL-free section.
pub struct Table {
    /// The array itself, so that its buffer outlives every write: a
    /// `tables=` list only borrows its tables, and Python code run after
    /// the check (an argument's `__index__`, a finalizer) can empty it.
    /// The reference also makes numpy refuse to `resize` the array.
    _owner: Py<PyAny>,
    ptr: *mut i32,
    /// Elements from one row to the next: the column count, or more for a
    /// view of a wider array (a padded row stride, see `KVPool`).
    row_stride: usize,
    /// Elements from the first to one past the last of the table's extent.
    len: usize,
}

// SAFETY: the pointer targets a numpy buffer kept alive by `_owner` for
// as long as the Table; it is only written under the allocator lock,
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
        // The dtype by its type number (cached) first: the typed cast builds
        // and compares a descriptor on every call (~0.4 us of a decode
        // step's extend). numpy files int32 under C `int` or, on platforms
        // where `long` is 32 bits (Windows), under `long`: another number for
        // the same dtype, which the kind-and-size test accepts.
        static INT32: PyOnceLock<i32> = PyOnceLock::new();
        let int32_num = *INT32.get_or_init(py, || i32::get_dtype(py).num());
        let dtype = arr.dtype();
        let int32 = dtype.num() == int32_num || (dtype.kind() == b'i' && dtype.itemsize() == 4);
        if arr.ndim() != 2 || !int32 || !dtype.is_native_byteorder().unwrap_or(true) {
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
                "table must have contiguous rows, a row stride of at least its width and \
                 int32 alignment (e.g. tensor.numpy()); got strides {strides:?} for shape {shape:?}"
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
        let row_stride = (strides[0] / item) as usize;
        Ok(Self {
            _owner: a.clone().into_any().unbind(),
            ptr: data,
            row_stride,
            len: shape[0].saturating_sub(1) * row_stride + shape[1],
        })
    }

    /// The bytes the table's extent spans, as [start, end) addresses.
    pub fn byte_range(&self) -> (usize, usize) {
        let start = self.ptr as usize;
        (start, start + self.len * std::mem::size_of::<i32>())
    }

    /// The table as the core's [`SlotTable`], which extend fills in the
    /// same pass that takes the slots (bounds-checked against the extent
    /// given here).
    ///
    /// # Safety
    /// `self` must come from `validate` (its `_owner` keeps the array
    /// alive), and nothing else may access the buffer meanwhile (it is only
    /// written under the allocator lock, at rows of the requests being
    /// extended).
    pub unsafe fn view(&self) -> SlotTable<'_> {
        SlotTable::new(
            std::slice::from_raw_parts_mut(self.ptr, self.len),
            self.row_stride,
        )
    }
}

impl Table {
    /// The optional `table=` argument of extend, open_with_prefix and fork,
    /// validated for a pool of this shape.
    pub fn from_arg(
        py: Python<'_>,
        table: &Bound<'_, PyAny>,
        max_requests: usize,
        max_context_len: usize,
        num_slots: usize,
    ) -> PyResult<Self> {
        let arr = table.cast::<PyUntypedArray>().map_err(|_| {
            invalid_argument(
                py,
                "table must be a numpy int32 2-D array (e.g. tensor.numpy())",
            )
        })?;
        Self::validate(py, arr, max_requests, max_context_len, num_slots)
    }
}
