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
