//! The `handles` argument of the extend calls. A contiguous int64 numpy
//! array (what engines keep their batch in) is copied with one memcpy into
//! a per-thread buffer kept from call to call: no allocation and no
//! element-by-element conversion on a decode step.
//!
//! Why a copy and not the array itself: the core reads the handles more
//! than once (it validates the batch, then grows and reports it), and
//! another thread can rewrite the array meanwhile (torch's `copy_` and
//! numpy's larger copies release the GIL). A handle changed after its
//! check would grow a request that was never validated. The snapshot is
//! taken after every other argument is converted and every output
//! allocated (both can run Python code: `__index__`, `numpy.asarray`, a
//! garbage collection's finalizers), and before anything is written, so a
//! `table=` or `out=` over the same memory cannot change it either.

use std::cell::RefCell;

use numpy::npyffi::objects::_PyArray_GET_ITEM_DATA;
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::allocator::PySlotAllocator;
use crate::convert::int_arg;
use kvpool_core::SlotAllocator;

/// The handles of one call: a numpy array to snapshot, or a copy.
pub(crate) enum Handles<'a, 'py> {
    Array(&'a Bound<'py, PyUntypedArray>, usize),
    Copied(Vec<i64>),
}

/// Most handles the per-thread buffer keeps between calls (1 MiB); a
/// larger batch's buffer is freed after its call.
const SNAPSHOT_KEEP: usize = 1 << 17;

thread_local! {
    /// The snapshot of an int64 handles array, reused from call to call.
    static SNAPSHOT: RefCell<Vec<i64>> = const { RefCell::new(Vec::new()) };
}

impl<'a, 'py> Handles<'a, 'py> {
    /// Classifies `obj` (converting it now unless it is a plain int64 array).
    pub(crate) fn new(py: Python<'py>, obj: &'a Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(arr) = obj.cast::<PyUntypedArray>() {
            if let Some(len) = int64_len(arr) {
                return Ok(Handles::Array(arr, len));
            }
        }
        Ok(Handles::Copied(int_arg(py, obj, "handles")?.into_vec()))
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Handles::Array(_, n) => *n,
            Handles::Copied(v) => v.len(),
        }
    }
}

/// The length of a 1-D, aligned, contiguous, native int64 array with at
/// least one element, or None.
pub(crate) fn int64_len(arr: &Bound<'_, PyUntypedArray>) -> Option<usize> {
    if arr.ndim() != 1 || !arr.is_aligned() || arr.len() == 0 || arr.strides()[0] != 8 {
        return None;
    }
    let dtype = arr.dtype();
    let int64 = dtype.kind() == b'i'
        && dtype.itemsize() == 8
        && dtype.is_native_byteorder().unwrap_or(true);
    int64.then(|| arr.len())
}

/// Replaces `buf`'s contents with the `len` values of `arr`, an array
/// `int64_len` just measured (with the GIL held, so nothing has changed it
/// since), by one memcpy; MemoryError naming `what` if `buf` cannot grow.
pub(crate) fn copy_int64(
    arr: &Bound<'_, PyUntypedArray>,
    len: usize,
    buf: &mut Vec<i64>,
    what: &str,
) -> PyResult<()> {
    debug_assert_eq!(int64_len(arr), Some(len));
    buf.clear();
    buf.try_reserve(len).map_err(|_| {
        pyo3::exceptions::PyMemoryError::new_err(format!(
            "cannot allocate {len} int64 values to copy {what} into"
        ))
    })?;
    // SAFETY: a live numpy array (`int64_len`: `len` aligned, contiguous
    // int64 items at its data pointer), read once with the GIL held; `buf`
    // has room for `len` values, and the copy initializes them before the
    // length is set.
    unsafe {
        let data = (*_PyArray_GET_ITEM_DATA(arr.as_array_ptr())).data as *const i64;
        std::ptr::copy_nonoverlapping(data, buf.as_mut_ptr(), len);
        buf.set_len(len);
    }
    Ok(())
}

impl PySlotAllocator {
    /// [`Self::run`] with the call's handles as a slice: a snapshot of an
    /// int64 array (see the module docs), or the converted copy.
    pub(crate) fn run_on<R: Send>(
        &self,
        py: Python<'_>,
        handles: Handles<'_, '_>,
        work: usize,
        f: impl FnOnce(&mut SlotAllocator, &[i64]) -> R + Send,
    ) -> PyResult<R> {
        let (arr, measured) = match handles {
            Handles::Copied(v) => return Ok(self.run(py, work, |core| f(core, &v))),
            Handles::Array(arr, n) => (arr, n),
        };
        // Re-checked here: converting the other arguments can have run
        // Python code that changed the array (its shape or dtype). A caller
        // sized its results by the first length (`extend_packed`'s header),
        // so a batch that changed size is refused, before anything changes.
        let Some(len) = int64_len(arr) else {
            let v = int_arg(py, arr.as_any(), "handles")?.into_vec();
            same_length(py, measured, v.len())?;
            return Ok(self.run(py, work, |core| f(core, &v)));
        };
        same_length(py, measured, len)?;
        SNAPSHOT.with(|cell| {
            let mut buf = cell.borrow_mut();
            copy_int64(arr, len, &mut buf, "handles")?;
            let h: &[i64] = &buf;
            let r = self.run(py, work, |core| f(core, h));
            if buf.capacity() > SNAPSHOT_KEEP {
                *buf = Vec::new();
            }
            Ok(r)
        })
    }
}

/// InvalidArgumentError unless the handles array still has the length it
/// had when the call began.
fn same_length(py: Python<'_>, before: usize, now: usize) -> PyResult<()> {
    if before == now {
        return Ok(());
    }
    Err(crate::errors::invalid_argument(
        py,
        format!(
            "handles had {before} entries when the call began and {now} after its other \
             arguments were converted (an argument's __index__ or __int__ resized it); pass \
             an array nothing changes during the call"
        ),
    ))
}
