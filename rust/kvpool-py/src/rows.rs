//! `scatter_rows`: a CPU pool's `write` as one `memcpy` a row (the core's
//! `scatter_rows`), for tensors torch describes as plain C-contiguous CPU
//! memory. Anything else is left to torch's `index_copy_`: the call then
//! returns -1 and has touched nothing.

use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use kvpool_core::{check_scatter, PoolError};

use crate::torch_arg::read_tensor;
use crate::torch_dense::{dense_view, plain_span, Dense};

/// Above this many bytes the copy runs with the GIL released, as torch's
/// own copies do; below it, releasing and taking the GIL back costs more
/// than other threads gain.
const DETACH_BYTES: usize = 1 << 20;

/// A row range of memory, for the overlap test.
fn span(d: &Dense) -> (usize, usize) {
    let start = d.data as usize;
    (start, start + d.bytes())
}

fn overlaps(a: (usize, usize), b: (usize, usize)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

/// The raw parts of one cache's copy, sent across `detach`.
struct Job {
    dst: *mut u8,
    dst_len: usize,
    src: *const u8,
    src_len: usize,
}

/// The copy, moved into `detach`: raw pointers are not Send, but the
/// memory they name stays allocated for the whole call (scatter_rows holds
/// each tensor's storage), and nothing else in this call touches it while
/// the copy runs.
struct AssertSend<F>(F);
// SAFETY: see above; the closure owns its pointers and slots outright.
unsafe impl<F> Send for AssertSend<F> {}

impl<F: FnOnce() -> R, R> AssertSend<F> {
    // A method, so that a closure calling it captures the whole wrapper
    // (capturing the field alone would capture the unsendable closure).
    fn call(self) -> R {
        (self.0)()
    }
}

/// Stores row `i` of each `src[j]` at row `slots[i]` of `dst[j]` (negative
/// slots are padding) and returns the rows stored per cache, or -1 when
/// these tensors are not plain C-contiguous CPU tensors of one row shape
/// and dtype (then nothing was read or written: use `index_copy_`).
///
/// Raises IndexError, before writing anything, for a slot outside the
/// caches.
#[pyfunction]
pub fn scatter_rows(
    py: Python<'_>,
    dst: &Bound<'_, PyTuple>,
    slots: &Bound<'_, PyAny>,
    src: &Bound<'_, PyTuple>,
) -> PyResult<i64> {
    if dst.len() != src.len() || dst.is_empty() {
        return Ok(-1);
    }
    let Some(slots) = read_tensor(py, slots, None)? else {
        return Ok(-1);
    };
    // Every tensor's storage bounds first (Python code, which could change
    // a storage), then every view (no Python code), each inside its bounds.
    // The storages are held until the copy is done: with the GIL released,
    // another thread can point a tensor at other memory (`src.set_(...)`),
    // which freed the storage the copy was reading (a use-after-free).
    let mut spans = Vec::with_capacity(dst.len() * 2);
    let mut pins = Vec::with_capacity(dst.len() * 2);
    for t in dst.iter().chain(src.iter()) {
        match plain_span(py, &t)? {
            Some((storage, s)) => {
                pins.push(storage);
                spans.push(s);
            }
            None => return Ok(-1),
        }
    }
    let mut views = Vec::with_capacity(spans.len());
    for (t, s) in dst.iter().chain(src.iter()).zip(spans) {
        match dense_view(py, &t, s) {
            Some(d) => views.push(d),
            None => return Ok(-1),
        }
    }
    let (dsts, srcs) = views.split_at(dst.len());
    let first = &dsts[0];
    let same = |d: &Dense| d.dtype == first.dtype && d.row_shape == first.row_shape;
    if !dsts.iter().chain(srcs).all(same) || srcs.iter().any(|s| s.rows != slots.len()) {
        return Ok(-1);
    }
    // Rows of no bytes: torch stores them (as nothing) for any index; the core refuses
    // them, and that refusal would reach the caller as a bad slot.
    if first.row_bytes == 0 {
        return Ok(-1);
    }
    // Two caches sharing memory cannot both be borrowed mutably.
    for (i, a) in dsts.iter().enumerate() {
        if dsts[i + 1..].iter().any(|b| overlaps(span(a), span(b))) {
            return Ok(-1);
        }
    }
    // A source that is a view of a cache (rows moved within a layer) is
    // stored as it was when the call was made: copied out first.
    let owned: Vec<Option<Vec<u8>>> = srcs
        .iter()
        .map(|s| {
            dsts.iter().any(|d| overlaps(span(s), span(d))).then(|| {
                // SAFETY: torch's description of the source's live memory.
                unsafe { std::slice::from_raw_parts(s.data, s.bytes()) }.to_vec()
            })
        })
        .collect();
    let jobs: Vec<Job> = dsts
        .iter()
        .zip(srcs)
        .zip(&owned)
        .map(|((d, s), o)| Job {
            dst: d.data,
            dst_len: d.bytes(),
            src: o.as_ref().map_or(s.data as *const u8, |v| v.as_ptr()),
            src_len: s.bytes(),
        })
        .collect();
    let row_bytes = first.row_bytes;
    let total: usize = jobs.iter().map(|j| j.src_len).sum();
    let run = move || -> Result<usize, PoolError> {
        let lens: Vec<(usize, usize)> = jobs.iter().map(|j| (j.dst_len, j.src_len)).collect();
        let stored = check_scatter(&lens, row_bytes, &slots)?;
        // Row by row through raw pointers, never a `&mut [u8]` over a whole cache:
        // with the GIL released, another thread may be storing other rows of the
        // same cache (another request's write) at the same time, and two such
        // slices would alias.
        for j in &jobs {
            for (i, &slot) in slots.iter().enumerate() {
                let Ok(s) = usize::try_from(slot) else {
                    continue; // padding
                };
                // SAFETY: check_scatter proved row `s` lies inside this cache and
                // row `i` inside its source; each pointer is torch's description
                // of a live tensor whose storage `pins` holds (or a copy owned above);
                // a source overlapping a cache was copied out, so the two rows do
                // not overlap. Empty tensors have no rows to copy.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        j.src.add(i * row_bytes),
                        j.dst.add(s * row_bytes),
                        row_bytes,
                    );
                }
            }
        }
        Ok(stored)
    };
    let stored = if total >= DETACH_BYTES {
        let run = AssertSend(run);
        py.detach(move || run.call())
    } else {
        run()
    };
    drop(pins);
    match stored {
        Ok(n) => Ok(n as i64),
        Err(PoolError::InvalidArgument(m)) => Err(PyIndexError::new_err(m)),
        Err(e) => Err(PyIndexError::new_err(e.to_string())),
    }
}
