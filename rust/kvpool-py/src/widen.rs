//! Integer buffers copied out into a `Vec<i64>`, widened from any integer
//! width: the one copy every in-place reader (numpy arrays, CPU torch
//! tensors) ends in, with its allocation fallible.

use pyo3::PyResult;

/// `len` integers of numpy kind and size `kind` (`(b'i', 1 | 2 | 4 | 8)` or
/// `(b'u', 1 | 2 | 4)`), `stride` bytes apart from `data`, copied out and
/// widened to i64. The copy's allocation is fallible: a broadcast view
/// (stride 0) can claim far more items than memory holds, and that must be
/// a MemoryError, not an abort.
///
/// # Safety
/// `data` must point at `len` aligned items of that type, `stride` bytes
/// apart, alive and unchanged for the call.
pub unsafe fn widen(
    data: *const u8,
    len: usize,
    stride: isize,
    kind: (u8, usize),
) -> PyResult<Vec<i64>> {
    let mut out = try_vec(len)?;
    macro_rules! widen {
        ($t:ty) => {{
            if stride == std::mem::size_of::<$t>() as isize {
                let items = std::slice::from_raw_parts(data as *const $t, len);
                out.extend(items.iter().map(|&x| x as i64))
            } else {
                out.extend(
                    (0..len).map(|i| *(data.offset(i as isize * stride) as *const $t) as i64),
                )
            }
        }};
    }
    match kind {
        (b'i', 8) => widen!(i64),
        (b'i', 4) => widen!(i32),
        (b'i', 2) => widen!(i16),
        (b'i', 1) => widen!(i8),
        (b'u', 4) => widen!(u32),
        (b'u', 2) => widen!(u16),
        _ => widen!(u8),
    }
    Ok(out)
}

/// An empty Vec with room for `len` values, or MemoryError: a length
/// taken from a caller's object (a broadcast array, a tensor) must not
/// abort the process when it cannot be allocated.
pub fn try_vec(len: usize) -> PyResult<Vec<i64>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        pyo3::exceptions::PyMemoryError::new_err(format!(
            "cannot allocate {len} int64 values to copy an argument into"
        ))
    })?;
    Ok(v)
}
