//! Result arrays. Every array a call returns is allocated here, fallibly:
//! a result too big for memory is a MemoryError, never a panic (numpy's
//! own constructors panic on a failed allocation, and a PanicException is
//! not an Exception). extend's arrays are allocated once before the GIL is
//! released and filled in place by the core: no intermediate Vec, no second
//! copy (a prefill's 8 x 2048 slots are 128 KiB, past malloc's mmap
//! threshold, so a Vec there also cost page faults on every call).

use std::ptr::NonNull;

use numpy::npyffi::{npy_intp, PY_ARRAY_API};
use numpy::{Element, PyArray1, PyArrayDescrMethods, PyArrayMethods};
use pyo3::exceptions::PyMemoryError;
use pyo3::prelude::*;

use crate::convert::IntArg;
use crate::errors::invalid_argument;

pub(crate) type Arr<'py, T> = Bound<'py, PyArray1<T>>;

/// A fresh numpy array's buffer, to be filled with the GIL released.
pub struct OutBuf<T = i64> {
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: the buffer belongs to an array that this call created and has not
// yet handed to Python, so no other thread can reach it; the array object is
// kept alive by the caller (it returns the array) for as long as the OutBuf.
unsafe impl<T: Send> Send for OutBuf<T> {}

impl<T> OutBuf<T> {
    /// The buffer as a slice.
    ///
    /// # Safety
    /// Only on a zero-filled buffer ([`new_array`]), while the array it came
    /// from is alive and still unshared, and only once per OutBuf (the
    /// slice is exclusive).
    pub unsafe fn slice(&mut self) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len)
    }

    /// The buffer as a slice of possibly uninitialized values, for the core
    /// to fill ([`new_uninit`]'s buffers included).
    ///
    /// # Safety
    /// Only while the array it came from is alive and still unshared, and
    /// only once per OutBuf (the slice is exclusive).
    pub unsafe fn uninit(&mut self) -> &mut [std::mem::MaybeUninit<T>] {
        std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast(), self.len)
    }

    /// Entries `0..n` (at most the buffer's length), once written.
    ///
    /// # Safety
    /// Only on entries the caller wrote, while the array it came from is
    /// alive.
    pub unsafe fn written(&self, n: usize) -> &[T] {
        std::slice::from_raw_parts(self.ptr.as_ptr(), n.min(self.len))
    }

    /// Sets entry `at` (if the buffer has it). Usable on an uninitialized
    /// buffer, as `write`.
    ///
    /// # Safety
    /// Only while the array it came from is alive and still unshared.
    #[inline]
    pub unsafe fn set(&mut self, at: usize, v: T) {
        if at < self.len {
            self.ptr.as_ptr().add(at).write(v);
        }
    }

    /// Copies `v` to entries `at..` (what fits of it). Usable on an
    /// uninitialized buffer: no reference to its memory is formed.
    ///
    /// # Safety
    /// Only while the array it came from is alive and still unshared.
    pub unsafe fn write(&mut self, at: usize, v: &[T])
    where
        T: Copy,
    {
        let n = v.len().min(self.len.saturating_sub(at));
        if n > 0 {
            // `at + n <= len` entries of the buffer; `v` is another object.
            std::ptr::copy_nonoverlapping(v.as_ptr(), self.ptr.as_ptr().add(at), n);
        }
    }
}

fn no_memory<T>(len: usize) -> PyErr {
    let size = std::mem::size_of::<T>();
    PyMemoryError::new_err(format!(
        "cannot allocate a result array of {len} {}-byte values ({} bytes)",
        size,
        len.saturating_mul(size)
    ))
}

/// A 1-D array of `len` T, zero-filled or uninitialized, or MemoryError.
fn alloc<T: Element>(py: Python<'_>, len: usize, zeroed: bool) -> PyResult<Arr<'_, T>> {
    let mut dims = [npy_intp::try_from(len).map_err(|_| no_memory::<T>(len))?];
    // SAFETY: both constructors steal the dtype reference that
    // into_dtype_ptr hands over and return a new reference, or null with
    // an exception set (replaced by ours: it names the result).
    let ptr = unsafe {
        let dtype = T::get_dtype(py).into_dtype_ptr();
        if zeroed {
            PY_ARRAY_API.PyArray_Zeros(py, 1, dims.as_mut_ptr(), dtype, 0)
        } else {
            PY_ARRAY_API.PyArray_Empty(py, 1, dims.as_mut_ptr(), dtype, 0)
        }
    };
    // SAFETY: a non-null result is a new reference to a 1-D array of T.
    match unsafe { Bound::from_owned_ptr_or_opt(py, ptr) } {
        Some(arr) => Ok(unsafe { arr.cast_into_unchecked::<PyArray1<T>>() }),
        None => {
            let _ = PyErr::take(py);
            Err(no_memory::<T>(len))
        }
    }
}

/// A zero-filled array of `len` T and its buffer. Zeroed, not
/// uninitialized, so that no Rust slice ever covers uninitialized memory
/// (numpy's calloc makes that nearly free).
pub fn new_array<T: Element>(py: Python<'_>, len: usize) -> PyResult<(Arr<'_, T>, OutBuf<T>)> {
    with_buf(alloc::<T>(py, len, true)?, len)
}

/// An uninitialized array of `len` T and its buffer, to be filled through
/// [`OutBuf::write`] before the array is returned.
pub fn new_uninit<T: Element>(py: Python<'_>, len: usize) -> PyResult<(Arr<'_, T>, OutBuf<T>)> {
    with_buf(alloc::<T>(py, len, false)?, len)
}

fn with_buf<T: Element>(arr: Arr<'_, T>, len: usize) -> PyResult<(Arr<'_, T>, OutBuf<T>)> {
    // A 0-length array may carry any data pointer; the slice needs a non-null
    // aligned one.
    let ptr = match (len, NonNull::new(arr.data())) {
        (0, _) => NonNull::dangling(),
        (_, Some(p)) => p,
        (_, None) => return Err(no_memory::<T>(len)),
    };
    Ok((arr, OutBuf { ptr, len }))
}

/// [`new_array`] of int64.
pub fn new_i64(py: Python<'_>, len: usize) -> PyResult<(Arr<'_, i64>, OutBuf)> {
    new_array::<i64>(py, len)
}

/// A numpy array owning a copy of `v`, or MemoryError. Copying (a memcpy)
/// beats handing the Vec over (`from_vec`): that wraps it in a GC-tracked
/// container object, and the extra GC traffic costs more than the copy on
/// the hot path.
pub(crate) fn to_numpy<'py, T: Element + Copy>(py: Python<'py>, v: &[T]) -> PyResult<Arr<'py, T>> {
    let (arr, mut buf) = new_uninit::<T>(py, v.len())?;
    // SAFETY: `arr` is alive and not yet shared.
    unsafe { buf.write(0, v) };
    Ok(arr)
}

/// The result of a call that changes the pool, in an array allocated
/// before the change (a MemoryError after it would lose the result): `v`
/// copied into `arr` (from [`new_uninit`]), which was sized for it. Any
/// other length (a call that succeeded with more or fewer results than its
/// arguments promised) gets a fresh copy instead.
pub(crate) fn filled<'py, T: Element + Copy>(
    py: Python<'py>,
    arr: Arr<'py, T>,
    mut buf: OutBuf<T>,
    v: &[T],
) -> PyResult<Arr<'py, T>> {
    if buf.len != v.len() {
        return to_numpy(py, v);
    }
    // SAFETY: `arr` (the caller's, from new_uninit) is alive and not yet shared.
    unsafe { buf.write(0, v) };
    Ok(arr)
}

/// A result whose length only the call knows, at most `bound`: allocated
/// before the call changes the pool (a MemoryError after the change would
/// lose the result, as with [`filled`]) and shrunk to what the call returned.
pub(crate) struct Bounded<'py, T: Element> {
    arr: Arr<'py, T>,
    buf: OutBuf<T>,
}

impl<'py, T: Element + Copy> Bounded<'py, T> {
    pub(crate) fn new(py: Python<'py>, bound: usize) -> PyResult<Self> {
        let (arr, buf) = new_uninit::<T>(py, bound)?;
        Ok(Bounded { arr, buf })
    }

    /// The array holding `rows`' columns one after another (`[column 0 |
    /// column 1 | ...]`). Shrinking gives memory back, so it does not fail
    /// for want of it; rows past the bound (a call that returned more than
    /// its arguments allow) get a fresh array.
    pub(crate) fn fill_columns<const C: usize>(mut self, rows: &[[T; C]]) -> PyResult<Arr<'py, T>> {
        let m = rows.len();
        if C * m > self.buf.len {
            let flat: Vec<T> = (0..C)
                .flat_map(|c| rows.iter().map(move |r| r[c]))
                .collect();
            return to_numpy(self.arr.py(), &flat);
        }
        // SAFETY: `arr` (from new_uninit) is alive and not yet shared, and
        // nothing refers into its buffer while it is resized.
        unsafe {
            for (i, r) in rows.iter().enumerate() {
                for (c, &v) in r.iter().enumerate() {
                    self.buf.set(c * m + i, v);
                }
            }
            if C * m != self.buf.len {
                self.arr.resize(C * m)?;
            }
        }
        Ok(self.arr)
    }
}

/// An empty Vec with room for `n` values, or MemoryError: reserved before
/// a call changes the pool, so that filling it during the call allocates
/// nothing (a failed Rust allocation aborts the process).
pub(crate) fn vec_with_room<T>(n: usize) -> PyResult<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| no_memory::<T>(n))?;
    Ok(v)
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
