//! The shared-pages API of `SlotAllocator`: prefix caching
//! (open_with_prefix, cache, evict, clear_cache), fork and the
//! copy-on-write queue, and the cache counters (the chain-hash calls that
//! move a prefix between pools are in `chain_hashes.rs`). Arguments become plain Rust
//! values first; the work runs with the GIL released.

use pyo3::prelude::*;

use crate::allocator::PySlotAllocator;
use crate::convert::{counts_of, int_arg, int_scalar, IntArg};
use crate::errors::{invalid_argument, Result};
use crate::output::{filled, new_uninit, to_numpy, Arr};
use crate::retention_args::Retention;
use crate::table::Table;
use crate::token_ids::TokenIds;

/// Writes the rows of requests just opened into a validated `table`. It
/// cannot fail: the handles are fresh and `table_arg` checked the shape.
fn fill(
    core: &kvpool_core::SlotAllocator,
    handles: &[i64],
    table: Option<&Table>,
) -> kvpool_core::Result<()> {
    match table {
        // SAFETY: validated by table_arg; the caller's array is referenced
        // by the call's `table` argument until it returns, and the buffer is
        // only written under the allocator lock held by `core`.
        Some(t) => core.fill_table(handles, &mut unsafe { t.view() }),
        None => Ok(()),
    }
}

#[pymethods]
impl PySlotAllocator {
    /// open_with_prefix(tokens, lengths, salt=None, table=None) -> (handles, cached_lens)
    ///
    /// Opens one request per prompt, each starting on the longest cached
    /// prefix of full pages of its prompt, capped so that at least one token
    /// is left to compute (cached_len <= length - 1, rounded down to a page).
    /// Each request's length is its cached_len; its slots, pages and page
    /// table show the shared pages. The prompt's token ids are remembered:
    /// later extends take them. With a host tier, cached_lens count host
    /// hits too: a page whose only copy is on the host takes a device page
    /// (which may evict and, under "write_back", offload another) and
    /// queues its load (take_loads); a host hit that finds no device page
    /// ends that prompt's match (a miss, not an error). Atomic.
    ///
    /// Args:
    ///     tokens: the prompts' token ids concatenated (ints in [0, 2^31)).
    ///     lengths: each prompt's length.
    ///     salt: None (0), an int for all, or one int per prompt (LoRA id,
    ///         tenant, cache salt): different salts never share pages.
    ///     table: optional int32 request-to-token table, as for extend: each
    ///         new request's row gets the slots of its cached prefix
    ///         (table[row, :cached_len]), so it need not read them back.
    ///
    /// Returns:
    ///     (handles int64, cached_lens int64).
    ///
    /// Raises:
    ///     InvalidArgumentError: tokens and lengths disagree, a negative length,
    ///         a token id out of range, a salt of the wrong type or count, a
    ///         bad table.
    ///     ContextTooLongError: a prompt longer than max_context_len.
    ///     TooManyRequestsError: not enough free rows.
    #[pyo3(signature = (tokens, lengths, salt=None, table=None))]
    fn open_with_prefix<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        lengths: &Bound<'py, PyAny>,
        salt: Option<&Bound<'py, PyAny>>,
        table: Option<&Bound<'py, PyAny>>,
    ) -> Result<(Arr<'py, i64>, Arr<'py, i64>)> {
        let t = TokenIds::extract(py, tokens)?;
        let l = int_arg(py, lengths, "lengths")?.into_vec();
        let s = match salt {
            None => IntArg::Scalar(0),
            Some(s) => int_arg(py, s, "salt")?,
        };
        let tab = self.table_arg(py, table)?;
        // Allocated before any request opens (see `open`).
        let n = l.len().min(self.max_requests);
        let ((harr, hbuf), (carr, cbuf)) = (new_uninit(py, n)?, new_uninit(py, n)?);
        let (h, c) = py.detach(|| {
            let mut core = self.lock();
            let (h, c) = core.open_with_prefix(&t, &l, counts_of(&s))?;
            fill(&core, &h, tab.as_ref())?;
            Ok::<_, kvpool_core::PoolError>((h, c))
        })?;
        Ok((filled(py, harr, hbuf, &h)?, filled(py, carr, cbuf, &c)?))
    }

    /// cache(handles, priority=None, retain_s=None) -> None
    ///
    /// Registers every full page of each request whose token ids are all
    /// known and that is not registered yet, so later prompts can hit it.
    /// Call it once the step that wrote those pages has run. If the same
    /// content is registered already, the existing copy is kept. With a
    /// host tier under "write_through", each page registered also gets a
    /// host copy (an offload, take_offloads). Atomic.
    ///
    /// With a priority, every page of each request's cached prefix (its own
    /// registered pages, or the copy kept of one it duplicated) also gets that
    /// retention priority, for retain_s seconds on the pool's clock (None: no
    /// end). Eviction takes the lowest priority first, least recently used
    /// within one. Pages no caller gave a priority have DEFAULT_PRIORITY (35,
    /// as TensorRT-LLM); without a priority, pages keep theirs. A page keeps
    /// the highest priority callers gave it (at equal priority, the later
    /// end); when its retain_s is over it has the default again. Priority 100
    /// with no retain_s pins: the page is never evicted nor counted free
    /// until unpin() or clear_cache(); past max_pinned_pages pinned pages, a
    /// pin is given 99 instead (pinned_pages says how many hold).
    ///
    /// Args:
    ///     priority: an int in [0, 100] for all, or one per request.
    ///     retain_s: seconds (> 0) the priority lasts; needs a priority.
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    ///     RequestSwappedOutError: a request is swapped out.
    ///     InvalidArgumentError: a duplicate handle; a priority outside [0, 100]
    ///         or not one per request; retain_s not a number in (0, 1e9], or
    ///         given without a priority.
    #[pyo3(signature = (handles, priority=None, retain_s=None))]
    fn cache(
        &self,
        py: Python<'_>,
        handles: &Bound<'_, PyAny>,
        priority: Option<&Bound<'_, PyAny>>,
        retain_s: Option<&Bound<'_, PyAny>>,
    ) -> Result<()> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        match Retention::of(py, priority, retain_s)? {
            None => Ok(py.detach(|| self.lock().cache(&h))?),
            Some(r) => {
                Ok(py.detach(|| self.lock().cache_with_priority(&h, r.counts(), r.retain_s))?)
            }
        }
    }

    /// fork(handle, n=1, table=None) -> ndarray[int64]
    ///
    /// Opens n requests that share all of `handle`'s pages and known tokens
    /// (same length, prompt and salt). A shared, partly filled last page is
    /// copy-on-write: the first holder to extend into it gets a copy.
    /// With `table` (an int32 request-to-token table, as for extend), each
    /// new request's row gets its slots (the parent's, table[row, :length]).
    ///
    /// Raises:
    ///     InvalidHandleError: `handle` is unknown, closed or stale.
    ///     RequestSwappedOutError: `handle` is swapped out.
    ///     TooManyRequestsError: not enough free rows.
    ///     InvalidArgumentError: n is negative or not an int, a bad table.
    #[pyo3(signature = (handle, n=None, table=None))]
    fn fork<'py>(
        &self,
        py: Python<'py>,
        handle: &Bound<'py, PyAny>,
        n: Option<&Bound<'py, PyAny>>,
        table: Option<&Bound<'py, PyAny>>,
    ) -> Result<Arr<'py, i64>> {
        let h = int_scalar(py, handle, "handle")?;
        let n = match n {
            None => 1,
            Some(n) => int_scalar(py, n, "n")?,
        };
        let n = usize::try_from(n)
            .map_err(|_| invalid_argument(py, format!("n must be >= 0, got {n}")))?;
        let tab = self.table_arg(py, table)?;
        // Allocated before any request opens (see `open`).
        let (arr, buf) = new_uninit::<i64>(py, n.min(self.max_requests))?;
        let v = py.detach(|| {
            let mut core = self.lock();
            let v = core.fork(h, n)?;
            fill(&core, &v, tab.as_ref())?;
            Ok::<_, kvpool_core::PoolError>(v)
        })?;
        Ok(filled(py, arr, buf, &v)?)
    }

    /// take_copies() -> (src_slots, dst_slots)
    ///
    /// Drains the queued copy-on-write copies (int64 slot pairs). Copy every
    /// layer's K and V from src[i] to dst[i], in order, before the next write
    /// into the destination pages. Each source page stays held until its copy
    /// is taken here, so no later call frees or rewrites it meanwhile; a copy
    /// whose destination page its requests released (close, truncate, reset)
    /// is dropped, so the queue holds at most one page's copy (fewer than
    /// page_size slot pairs) per held page however long it is left. KVPool
    /// does this inside extend.
    fn take_copies<'py>(&self, py: Python<'py>) -> Result<(Arr<'py, i64>, Arr<'py, i64>)> {
        // The arrays exist before the queue is drained, so a MemoryError
        // leaves every copy queued. Another thread may queue copies between
        // the count and the drain: then count again.
        loop {
            let n = self.query(py, |c| c.pending_copies());
            let (src, mut src_buf) = new_uninit::<i64>(py, n)?;
            let (dst, mut dst_buf) = new_uninit::<i64>(py, n)?;
            let taken = self.run(py, n, |core| {
                if core.pending_copies() != n {
                    return false;
                }
                // n of each: as many as were pending.
                let (s, d) = core.take_copies();
                // SAFETY: both arrays are alive and not yet shared.
                unsafe {
                    src_buf.write(0, &s);
                    dst_buf.write(0, &d);
                }
                true
            });
            if taken {
                return Ok((src, dst));
            }
        }
    }

    /// evict(n_pages) -> int
    ///
    /// Evicts up to n_pages cached pages nobody holds, the lowest retention
    /// priority first and least recently used within one (a chain's tail
    /// before its parents), never a pinned page; they become free. Returns
    /// how many were evicted. With a host tier a page's entry keeps its host
    /// copy, and under "write_back" one without is offloaded.
    ///
    /// Raises:
    ///     InvalidArgumentError: n_pages is negative or not an int.
    fn evict(&self, py: Python<'_>, n_pages: &Bound<'_, PyAny>) -> Result<usize> {
        let n = int_scalar(py, n_pages, "n_pages")?;
        let n = usize::try_from(n)
            .map_err(|_| invalid_argument(py, format!("n_pages must be >= 0, got {n}")))?;
        Ok(py.detach(|| self.lock().evict(n)))
    }

    /// clear_cache() -> None
    ///
    /// Drops every prefix-index entry: cached pages become free (pinned ones
    /// too: nothing is pinned or has a priority after it), held pages stay
    /// with their requests (on both tiers). Records one Cleared event.
    /// Queued copies and transfers stay: they fill open requests' pages.
    fn clear_cache(&self, py: Python<'_>) {
        py.detach(|| self.lock().clear_cache())
    }

    /// known_tokens(handle) -> ndarray[int32]
    ///
    /// The request's token ids of its leading known positions.
    ///
    /// Raises:
    ///     InvalidHandleError: unknown, closed or stale handle.
    fn known_tokens<'py>(
        &self,
        py: Python<'py>,
        handle: &Bound<'py, PyAny>,
    ) -> Result<Arr<'py, i32>> {
        let h = int_scalar(py, handle, "handle")?;
        let v = py.detach(|| self.lock().known_tokens(h))?;
        Ok(to_numpy(py, &v)?)
    }

    /// The prefix hash seed (pass it as hash_seed= to agree on page hashes).
    #[getter]
    fn hash_seed(&self, py: Python<'_>) -> u64 {
        self.query(py, |a| a.hash_seed())
    }
    /// Registered device pages (held or cached).
    #[getter]
    fn cached_pages(&self, py: Python<'_>) -> usize {
        self.query(py, |a| a.cached_pages())
    }
    /// Cached pages nobody holds: evicted when pages run out (pinned ones
    /// are not counted).
    #[getter]
    fn evictable_pages(&self, py: Python<'_>) -> usize {
        self.query(py, |a| a.evictable_pages())
    }
    /// Prompt tokens served from the cache by open_with_prefix, host hits included (cumulative).
    #[getter]
    fn hit_tokens(&self, py: Python<'_>) -> u64 {
        self.query(py, |a| a.hit_tokens())
    }
    /// Prompt tokens open_with_prefix found no cached page for (cumulative).
    #[getter]
    fn miss_tokens(&self, py: Python<'_>) -> u64 {
        self.query(py, |a| a.miss_tokens())
    }
    /// _uncount_opens(hit, miss, host_hit) -> None
    ///
    /// Internal (kvpool.KVPool): takes back the hit_tokens, miss_tokens and
    /// host_hit_tokens that opens counted when the pool undid them (closed
    /// the requests unreturned after its table write or a host load failed).
    fn _uncount_opens(&self, py: Python<'_>, hit: u64, miss: u64, host_hit: u64) {
        py.detach(|| self.lock().uncount_opens(hit, miss, host_hit));
    }
    /// Copy-on-write slot copies queued and not yet taken (slot pairs, as
    /// take_copies hands them out: a page's copy counts its valid slots).
    #[getter]
    fn pending_copies(&self, py: Python<'_>) -> usize {
        self.query(py, |a| a.pending_copies())
    }
}
