//! `GroupedAllocator`'s reading side for the pool and its groups: the
//! counters per group and pool-wide, events, and each group's queued copies
//! (per-request queries are `grouped_request_queries.rs`).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::Result;
use crate::grouped::PyGroupedAllocator;
use crate::output::{filled, new_uninit, Arr};

#[pymethods]
impl PyGroupedAllocator {
    /// Requests opened and not yet closed.
    #[getter]
    fn open_requests(&self, py: Python<'_>) -> usize {
        self.run(py, |c| c.open_requests())
    }

    /// How many more requests can open now: free rows, and a free or
    /// evictable slot in every state group (the pool-wide figure for
    /// admission, with admissible_tokens()). A prefix hit's open may need
    /// one more: the checkpoint it restores from is not room for its own slot.
    #[getter]
    fn admissible_requests(&self, py: Python<'_>) -> usize {
        self.run(py, |c| c.admissible_requests())
    }

    /// Prompt tokens open_with_prefix served from the cache, cumulative.
    #[getter]
    fn hit_tokens(&self, py: Python<'_>) -> u64 {
        self.run(py, |c| c.hit_tokens())
    }

    /// Prompt tokens open_with_prefix found no cached prefix for, cumulative.
    #[getter]
    fn miss_tokens(&self, py: Python<'_>) -> u64 {
        self.run(py, |c| c.miss_tokens())
    }

    /// _uncount_opens(hit, miss) -> None
    ///
    /// Internal (kvpool.KVPool with layer_types): takes back the hit_tokens
    /// and miss_tokens that opens counted when the pool undid them (closed
    /// the requests unreturned after a state copy or table write failed).
    fn _uncount_opens(&self, py: Python<'_>, hit: u64, miss: u64) {
        self.run(py, |c| c.uncount_opens(hit, miss));
    }

    /// Heap bytes of the bookkeeping of every group and of the request table.
    #[getter]
    fn metadata_bytes(&self, py: Python<'_>) -> usize {
        self.run(py, |c| c.metadata_bytes())
    }

    /// The hash seed (pass it as hash_seed to agree with this pool's hashes).
    #[getter]
    fn hash_seed(&self, py: Python<'_>) -> u64 {
        self.run(py, |c| c.hash_seed())
    }

    /// Events dropped because too many were left undrained (cumulative).
    #[getter]
    fn dropped_events(&self, py: Python<'_>) -> u64 {
        self.run(py, |c| c.dropped_events())
    }

    /// Whether the anchor chain's KV events are recorded (the kv_events
    /// argument, fixed at construction).
    #[getter]
    fn kv_events(&self, py: Python<'_>) -> bool {
        self.run(py, |c| c.kv_events())
    }

    /// take_events() -> dict
    ///
    /// Drains the anchor chain's KV events (as SlotAllocator.take_events).
    /// They name the prefixes the anchor group has cached: an upper bound on
    /// what this pool can serve, since a hit also needs every other group's
    /// pages (a sliding window's, a state checkpoint), which they do not
    /// report.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // As SlotAllocator.take_events; the lock also keeps concurrent
        // drains in order.
        let mut kept = crate::events::lock_kept(py, &self.undelivered)?;
        let pending = self.run(py, |c| c.pending_events());
        crate::events::take_dict(py, &mut kept, pending, |sink| {
            self.run(py, |c| c.take_events_into(sink))
        })
    }

    /// free_pages(group) -> int
    ///
    /// Pages (state slots) of the group an extend can take now: FREE + evictable.
    ///
    /// Raises:
    ///     InvalidArgumentError: no such group.
    fn free_pages(&self, py: Python<'_>, group: &Bound<'_, PyAny>) -> Result<usize> {
        let g = self.group_arg(py, group)?;
        Ok(self.run(py, |c| c.free_pages(g))?)
    }

    /// used_pages(group) -> int
    ///
    /// Pages (state slots) of the group held by open requests or queued copies.
    ///
    /// Raises:
    ///     InvalidArgumentError: no such group.
    fn used_pages(&self, py: Python<'_>, group: &Bound<'_, PyAny>) -> Result<usize> {
        let g = self.group_arg(py, group)?;
        Ok(self.run(py, |c| c.used_pages(g))?)
    }

    /// cached_pages(group) -> int
    ///
    /// Registered pages (checkpoints) of the group, held or evictable.
    ///
    /// Raises:
    ///     InvalidArgumentError: no such group.
    fn cached_pages(&self, py: Python<'_>, group: &Bound<'_, PyAny>) -> Result<usize> {
        let g = self.group_arg(py, group)?;
        Ok(self.run(py, |c| c.cached_pages(g))?)
    }

    /// evictable_pages(group) -> int
    ///
    /// Cached pages (checkpoints) of the group no request holds.
    ///
    /// Raises:
    ///     InvalidArgumentError: no such group.
    fn evictable_pages(&self, py: Python<'_>, group: &Bound<'_, PyAny>) -> Result<usize> {
        let g = self.group_arg(py, group)?;
        Ok(self.run(py, |c| c.evictable_pages(g))?)
    }

    /// capacity_pages(group) -> int
    ///
    /// Pages (state slots) of the group requests can ever hold: num_pages - 1.
    ///
    /// Raises:
    ///     InvalidArgumentError: no such group.
    fn capacity_pages(&self, py: Python<'_>, group: &Bound<'_, PyAny>) -> Result<usize> {
        let g = self.group_arg(py, group)?;
        Ok(self.run(py, |c| c.capacity_pages(g))?)
    }

    /// admissible_tokens(group=None) -> int
    ///
    /// Tokens that fit in whole free or evictable pages: in one group
    /// (free_pages * page_size; state slots for a state group), or with
    /// group=None the least over every page group and the anchor chain, the
    /// pool-wide figure for admission with admissible_requests. One new
    /// request of this many tokens fits (of at most max_context_len); a batch is a page count, not a
    /// token count (each request starts a page in every page group), and a
    /// request writing into a partly filled page it shares (a fork's) takes
    /// one more page for the copy.
    ///
    /// Raises:
    ///     InvalidArgumentError: no such group.
    #[pyo3(signature = (group=None))]
    fn admissible_tokens(&self, py: Python<'_>, group: Option<&Bound<'_, PyAny>>) -> Result<usize> {
        match group {
            None => Ok(self.run(py, |c| c.admissible_tokens())),
            Some(g) => {
                let g = self.group_arg(py, g)?;
                Ok(self.run(py, |c| c.group_admissible_tokens(g))?)
            }
        }
    }

    /// take_copies(group) -> (src, dst)
    ///
    /// Drains the group's queued copies (int64): slot pairs of a page group
    /// (copy-on-write, every layer's K and V, in order), state slot pairs
    /// of a state group, where src = -1 means "zero dst" (a new request's
    /// empty state). Run them before the group's next write. A state
    /// group's batch never reads a slot it writes (one parallel copy does).
    ///
    /// Raises:
    ///     InvalidArgumentError: no such group.
    fn take_copies<'py>(
        &self,
        py: Python<'py>,
        group: &Bound<'py, PyAny>,
    ) -> Result<(Arr<'py, i64>, Arr<'py, i64>)> {
        let g = self.group_arg(py, group)?;
        // The arrays exist before the queue is drained, so a MemoryError
        // leaves every copy queued (as SlotAllocator.take_copies). Another
        // thread may queue copies between the count and the drain: then
        // count again.
        loop {
            let n = self.run(py, |c| c.pending_copies(g))?;
            let (src, src_buf) = new_uninit::<i64>(py, n)?;
            let (dst, dst_buf) = new_uninit::<i64>(py, n)?;
            let taken = self.run(py, |c| -> kvpool_core::Result<_> {
                if c.pending_copies(g)? != n {
                    return Ok(None);
                }
                c.take_copies(g).map(Some)
            })?;
            if let Some((s, d)) = taken {
                // `filled` copies into the arrays made for them (n each).
                return Ok((filled(py, src, src_buf, &s)?, filled(py, dst, dst_buf, &d)?));
            }
        }
    }

    /// pending_copies(group) -> int
    ///
    /// Copies queued in the group and not taken (slot pairs; state copies).
    ///
    /// Raises:
    ///     InvalidArgumentError: no such group.
    fn pending_copies(&self, py: Python<'_>, group: &Bound<'_, PyAny>) -> Result<usize> {
        let g = self.group_arg(py, group)?;
        Ok(self.run(py, |c| c.pending_copies(g))?)
    }
}
