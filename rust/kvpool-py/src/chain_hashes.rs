//! `SlotAllocator`'s chain-hash calls, for moving a request's cached prefix
//! between pools (a router, a disaggregated prefill): chain_hashes on the
//! sender, match_chain_hashes and open_with_chain_hashes on the receiver.
//! Arguments become plain Rust values first; the work runs with the GIL
//! released.

use pyo3::prelude::*;

use crate::allocator::PySlotAllocator;
use crate::convert::{int_arg, int_scalar, usize_arg};
use crate::errors::{invalid_argument, Result};
use crate::output::{new_array, to_numpy, Arr};

/// Chain hashes as the uint64 words `chain_hashes` returns: (hi, lo) of each
/// 128-bit hash, interleaved. An int64 array of the same bits is accepted too
/// (what a torch.distributed message carries).
fn hashes_arg(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u128>> {
    // A misaligned array (a view at an odd byte offset, e.g. of a received
    // message's buffer) is read from an aligned copy: `as_array` forms a
    // reference to every item, and a misaligned one is UB in Rust.
    // A big-endian array (equal values, as tokens of '>i8' are taken) is read from a copy in
    // native order: the typed extracts below see only native uint64 / int64.
    let copy;
    let obj = match obj.cast::<numpy::PyUntypedArray>() {
        Ok(a)
            if numpy::PyArrayDescrMethods::is_native_byteorder(
                &numpy::PyUntypedArrayMethods::dtype(a),
            ) == Some(false) =>
        {
            let native =
                numpy::PyUntypedArrayMethods::dtype(a).call_method1("newbyteorder", ("=",))?;
            copy = a.call_method1("astype", (native,))?;
            &copy
        }
        Ok(a) if !numpy::PyUntypedArrayMethods::is_aligned(a) => {
            copy = a.call_method0("copy")?;
            &copy
        }
        _ => obj,
    };
    let words = if let Ok(a) = obj.extract::<numpy::PyReadonlyArray1<'_, u64>>() {
        collect(a.as_array().iter().copied())?
    } else if let Ok(a) = obj.extract::<numpy::PyReadonlyArray1<'_, i64>>() {
        collect(a.as_array().iter().map(|&w| w as u64))?
    } else {
        return Err(invalid_argument(
            py,
            "hashes must be a 1-D uint64 (or int64) numpy array of (hi, lo) words, as chain_hashes returns",
        ));
    };
    if words.len() % 2 != 0 {
        return Err(invalid_argument(
            py,
            format!(
                "hashes has {} words; each 128-bit hash is two (hi, lo)",
                words.len()
            ),
        ));
    }
    collect(
        words
            .chunks_exact(2)
            .map(|w| ((w[0] as u128) << 64) | w[1] as u128),
    )
}

/// The items of an iterator whose length a caller's array sets (a
/// broadcast view can claim more than memory holds), or MemoryError.
fn collect<T>(items: impl ExactSizeIterator<Item = T>) -> PyResult<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(items.len()).map_err(|_| {
        pyo3::exceptions::PyMemoryError::new_err(format!(
            "cannot allocate {} values to copy hashes into",
            items.len()
        ))
    })?;
    v.extend(items);
    Ok(v)
}

/// A salt argument: None is 0.
fn salt_arg(py: Python<'_>, salt: Option<&Bound<'_, PyAny>>) -> PyResult<i64> {
    salt.map_or(Ok(0), |s| int_scalar(py, s, "salt"))
}

#[pymethods]
impl PySlotAllocator {
    /// chain_hashes(handle) -> (hashes, tokens, salt)
    ///
    /// The request's leading full pages of known token ids, for a prefix-aware
    /// transfer to another pool: their chain hashes (this pool's hash_seed),
    /// their token ids and the request's salt. The receiver matches them with
    /// match_chain_hashes / open_with_chain_hashes.
    ///
    /// Returns:
    ///     (hashes uint64 [2n]: (hi, lo) of each page's 128-bit hash,
    ///      tokens int32 [n * page_size], salt int).
    ///
    /// Raises:
    ///     InvalidHandleError: unknown, closed or stale handle.
    ///     InvalidArgumentError: the chain's tokens or hashes cannot be
    ///         allocated.
    fn chain_hashes<'py>(
        &self,
        py: Python<'py>,
        handle: &Bound<'py, PyAny>,
    ) -> Result<(Arr<'py, u64>, Arr<'py, i32>, i64)> {
        let h = int_scalar(py, handle, "handle")?;
        let c = py.detach(|| self.lock().prefix_chain(h))?;
        let (words, mut buf) = new_array::<u64>(py, c.hashes.len().saturating_mul(2))?;
        // SAFETY: `words` is alive and not yet shared (see OutBuf).
        for (w, &x) in unsafe { buf.slice() }.chunks_exact_mut(2).zip(&c.hashes) {
            w[0] = (x >> 64) as u64;
            w[1] = x as u64;
        }
        Ok((words, to_numpy(py, &c.tokens)?, c.salt))
    }

    /// match_chain_hashes(hashes, tokens, salt=None) -> int
    ///
    /// How many leading pages of a chain (from another pool's chain_hashes)
    /// this pool caches on the device. A page matches only if the entry under its hash holds
    /// exactly the given tokens, the same salt and the matched parent, so a
    /// different hash_seed or a collision is a miss, never wrong KV. Read-only.
    ///
    /// Raises:
    ///     InvalidArgumentError: hashes not (hi, lo) uint64 words, tokens not
    ///         page_size per hash or out of range, a bad salt.
    #[pyo3(signature = (hashes, tokens, salt=None))]
    fn match_chain_hashes(
        &self,
        py: Python<'_>,
        hashes: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
    ) -> Result<usize> {
        let hs = hashes_arg(py, hashes)?;
        let t = int_arg(py, tokens, "tokens")?.into_vec();
        let s = salt_arg(py, salt)?;
        Ok(py.detach(|| self.lock().match_chain(&hs, &t, s))?)
    }

    /// open_with_chain_hashes(hashes, tokens, salt=None, max_pages=None, length=None) -> (handle, cached_len)
    ///
    /// Opens one request holding the leading pages of the chain this pool
    /// caches (at most max_pages; refcount + 1 each). Its length is
    /// cached_len = pages * page_size; the chain's tokens become its known
    /// prompt, so extending it records their ids and cache() can register
    /// them later. Atomic.
    ///
    /// With length (an int in [cached_len, max_context_len]), the request
    /// is also extended to length tokens in the same call, or nothing
    /// happens: the room is what is free or evictable once the matched pages
    /// are held (a matched cached page stops being room when held), so a
    /// receiver that must also take the rest of a request's pages neither
    /// over-counts free_pages nor reorders eviction by closing a failed open.
    ///
    /// Raises:
    ///     InvalidArgumentError: as match_chain_hashes; a negative max_pages;
    ///         a length below cached_len.
    ///     ContextTooLongError: more tokens than max_context_len.
    ///     TooManyRequestsError: no free row.
    ///     PoolExhaustedError: not enough room for length (counted as above).
    #[pyo3(signature = (hashes, tokens, salt=None, max_pages=None, length=None))]
    fn open_with_chain_hashes(
        &self,
        py: Python<'_>,
        hashes: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        salt: Option<&Bound<'_, PyAny>>,
        max_pages: Option<&Bound<'_, PyAny>>,
        length: Option<&Bound<'_, PyAny>>,
    ) -> Result<(i64, usize)> {
        let hs = hashes_arg(py, hashes)?;
        let t = int_arg(py, tokens, "tokens")?.into_vec();
        let s = salt_arg(py, salt)?;
        let m = match max_pages {
            None => usize::MAX,
            Some(m) => usize_arg(py, m, "max_pages")?,
        };
        let l = match length {
            None => None,
            Some(l) => Some(int_scalar(py, l, "length")?),
        };
        Ok(py.detach(|| self.lock().open_with_chain(&hs, &t, s, m, l))?)
    }
}
