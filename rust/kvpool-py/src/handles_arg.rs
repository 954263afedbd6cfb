//! The `handles` argument of the extend calls, read in place when it is a
//! contiguous int64 numpy array (what engines keep their batch in) and the
//! call runs with the GIL held: no copy into a Vec, no allocation. A decode
//! step's extend of 256 requests then reads its handles straight from the
//! caller's array (churn at page 16, 1M slots: median 2.24 -> 2.04 us per
//! step, six runs alternated).
//!
//! Safety. The data pointer is taken only inside [`SlotAllocator::run_on`],
//! after every other argument is converted and every output allocated
//! (both can run Python code: `__index__`, `numpy.asarray`, a garbage
//! collection's finalizers), with the GIL held and the lock taken, and the
//! slice lives only for the core call, which runs no Python code. So no
//! Python code can resize or free the array while it is read. Anything
//! else (another dtype, a strided view, work large enough to release the
//! GIL, a contended lock, a `table=` or `out=` that overlaps the array) is
//! copied first, as before.

use numpy::npyffi::objects::_PyArray_GET_ITEM_DATA;
use numpy::{PyArrayDescrMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::allocator::{SlotAllocator, SMALL_WORK};
use crate::convert::int_arg;
use kvpool_core::SlotAllocator as Core;

/// The handles of one call: a numpy array to read in place, or a copy.
pub(crate) enum Handles<'a, 'py> {
    InPlace(&'a Bound<'py, PyUntypedArray>, usize),
    Copied(Vec<i64>),
}

impl<'a, 'py> Handles<'a, 'py> {
    /// Classifies `obj` (converting it now unless it can be read in place).
    pub(crate) fn new(py: Python<'py>, obj: &'a Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(arr) = obj.cast::<PyUntypedArray>() {
            if let Some(len) = in_place_len(arr) {
                return Ok(Handles::InPlace(arr, len));
            }
        }
        Ok(Handles::Copied(int_arg(py, obj, "handles")?.into_vec()))
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Handles::InPlace(_, n) => *n,
            Handles::Copied(v) => v.len(),
        }
    }
}

/// The length of a 1-D, aligned, contiguous, native int64 array with at
/// least one element, or None.
fn in_place_len(arr: &Bound<'_, PyUntypedArray>) -> Option<usize> {
    if arr.ndim() != 1 || !arr.is_aligned() || arr.len() == 0 || arr.strides()[0] != 8 {
        return None;
    }
    let dtype = arr.dtype();
    let int64 = dtype.kind() == b'i'
        && dtype.itemsize() == 8
        && dtype.is_native_byteorder().unwrap_or(true);
    int64.then(|| arr.len())
}

impl SlotAllocator {
    /// [`Self::run`] with the call's handles as a slice: read in place when
    /// `handles` allows it, the work is small and the lock is free (see the
    /// module docs), else from a copy. `avoid` holds the caller's byte
    /// ranges the call writes (`table=`, `out=`): handles that overlap one
    /// are copied first.
    pub(crate) fn run_on<R: Send>(
        &self,
        py: Python<'_>,
        handles: Handles<'_, '_>,
        work: usize,
        avoid: &[Option<(usize, usize)>],
        f: impl FnOnce(&mut Core, &[i64]) -> R + Send,
    ) -> PyResult<R> {
        let copied = match handles {
            Handles::Copied(v) => v,
            Handles::InPlace(arr, _) => {
                // Re-checked here: converting the other arguments can have
                // run Python code that changed the array.
                if let Some(len) = in_place_len(arr).filter(|_| work <= SMALL_WORK) {
                    // SAFETY: a live numpy array, so its object struct is valid.
                    let data = unsafe { (*_PyArray_GET_ITEM_DATA(arr.as_array_ptr())).data };
                    let (lo, hi) = (data as usize, data as usize + len * 8);
                    let clear = avoid.iter().flatten().all(|&(a, b)| hi <= a || b <= lo);
                    if clear {
                        if let Some(mut core) = self.try_lock_now() {
                            // SAFETY: `len` aligned, contiguous int64 items
                            // (checked just now) of an array the caller
                            // references; the GIL stays held and `f` runs no
                            // Python code, so nothing can change or free the
                            // buffer while the slice lives.
                            let h = unsafe { std::slice::from_raw_parts(data as *const i64, len) };
                            return Ok(f(&mut core, h));
                        }
                    }
                }
                // Converted like any other argument.
                int_arg(py, arr.as_any(), "handles")?.into_vec()
            }
        };
        Ok(self.run(py, work, |core| f(core, &copied)))
    }
}
