//! `SlotAllocator`'s page, slot and request counters: each as a property
//! (one short query), and all of them at once as stats().

use kvpool_core::SlotAllocator;
use pyo3::prelude::*;

use crate::allocator::PySlotAllocator;
use crate::stats::PoolStats;

#[pymethods]
impl PySlotAllocator {
    /// stats() -> PoolStats
    ///
    /// The changing counters (free_pages, used_pages, free_slots, used_slots,
    /// open_requests, admissible_tokens, metadata_bytes, the cache's and the
    /// host tier's, dropped_events, and evictable_pages_by_priority as a list
    /// of 101) read under one lock, so they agree with each other even while
    /// other threads work: the priority counts add up to evictable_pages.
    fn stats(&self, py: Python<'_>) -> PoolStats {
        self.query(py, PoolStats::of)
    }
    /// Pages an extend can take now: FREE + CACHED (evictable); pinned cached
    /// pages are not.
    #[getter]
    fn free_pages(&self, py: Python<'_>) -> usize {
        self.query(py, SlotAllocator::free_pages)
    }
    /// Pages held by open requests.
    #[getter]
    fn used_pages(&self, py: Python<'_>) -> usize {
        self.query(py, SlotAllocator::used_pages)
    }
    /// free_pages * page_size.
    #[getter]
    fn free_slots(&self, py: Python<'_>) -> usize {
        self.query(py, SlotAllocator::free_slots)
    }
    /// Slots in held pages (including the unfilled tail of each last page).
    #[getter]
    fn used_slots(&self, py: Python<'_>) -> usize {
        self.query(py, SlotAllocator::used_slots)
    }
    /// Requests opened and not yet closed.
    #[getter]
    fn open_requests(&self, py: Python<'_>) -> usize {
        self.query(py, SlotAllocator::open_requests)
    }
    /// free_slots: tokens that fit in whole free or evictable pages (pinned
    /// cached pages are not counted). One new request of this many tokens
    /// fits (of at most max_context_len: a longer one is refused as too
    /// long, whatever is free); a batch is a page count, not a token count: each request takes
    /// pages_for(length + n) - pages_for(length) (a new one starts a page),
    /// plus one copy when it writes into a partly filled last page that is
    /// shared (fork, a queued copy's source).
    #[getter]
    fn admissible_tokens(&self, py: Python<'_>) -> usize {
        self.query(py, SlotAllocator::admissible_tokens)
    }
    /// Heap bytes of the allocator's bookkeeping.
    #[getter]
    fn metadata_bytes(&self, py: Python<'_>) -> usize {
        self.query(py, SlotAllocator::metadata_bytes)
    }
}
