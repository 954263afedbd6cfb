//! A call's token ids: an int64 numpy array is copied with one memcpy into
//! a buffer each thread keeps from call to call.
//!
//! Prompts are the largest arguments the pool takes (`open_with_prefix`
//! and `admit` get thousands of ids a request). Converted as any int
//! argument (`int_arg`), they were copied one value at a time into a fresh
//! allocation, which the core then read again to narrow each id into the
//! row's prompt buffer. A copy it stays, for the reason the handles are
//! copied (`handles_arg.rs`): the core reads the ids more than once (checks
//! them, then stores them), and another thread may rewrite the array
//! meanwhile. But into memory that the last call left in cache, by memcpy.

use std::cell::Cell;
use std::ops::Deref;

use numpy::PyUntypedArray;
use pyo3::prelude::*;

use crate::convert::int_arg;
use crate::handles_arg::{copy_int64, int64_len};

/// Most ids the per-thread buffer keeps between calls (1 MiB); a larger
/// call's buffer is freed after it.
const KEEP: usize = 1 << 17;

thread_local! {
    /// The buffer the last call gave back. Taken, not borrowed, for the
    /// length of a call: a call made while converting another's arguments
    /// (Python code can run then) gets a buffer of its own.
    static SPARE: Cell<Vec<i64>> = const { Cell::new(Vec::new()) };
}

/// The token ids of one call (its `tokens` argument).
pub(crate) struct TokenIds(Vec<i64>);

impl TokenIds {
    /// Copies `obj`'s ids: one memcpy from a 1-D, aligned, contiguous,
    /// native int64 array, else the conversion of any int argument.
    pub(crate) fn extract(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        if let Ok(arr) = obj.cast::<PyUntypedArray>() {
            if let Some(len) = int64_len(arr) {
                let mut v = SPARE.take();
                copy_int64(arr, len, &mut v, "tokens")?;
                return Ok(TokenIds(v));
            }
        }
        Ok(TokenIds(int_arg(py, obj, "tokens")?.into_vec()))
    }
}

impl Deref for TokenIds {
    type Target = [i64];

    fn deref(&self) -> &[i64] {
        &self.0
    }
}

impl Drop for TokenIds {
    fn drop(&mut self) {
        if self.0.capacity() <= KEEP {
            let v = std::mem::take(&mut self.0);
            // During thread teardown the buffer is simply freed.
            let _ = SPARE.try_with(|s| s.set(v));
        }
    }
}
