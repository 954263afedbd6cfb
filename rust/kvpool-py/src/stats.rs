//! `PoolStats`: the pool's changing counters, read under one lock.

use kvpool_core::SlotAllocator;
use pyo3::prelude::*;

/// The pool's changing counters, read together under one lock (so they agree
/// with each other, unlike separate property reads while other threads run).
#[pyclass(name = "PoolStats", module = "kvpool._core", frozen, get_all)]
pub struct PoolStats {
    free_pages: usize,
    used_pages: usize,
    free_slots: usize,
    used_slots: usize,
    open_requests: usize,
    admissible_tokens: usize,
    metadata_bytes: usize,
    cached_pages: usize,
    evictable_pages: usize,
    hit_tokens: u64,
    miss_tokens: u64,
    pinned_pages: usize,
    host_free_pages: usize,
    host_cached_pages: usize,
    host_hit_tokens: u64,
    offloaded_pages: u64,
    loaded_pages: u64,
}

impl PoolStats {
    pub(crate) fn of(a: &SlotAllocator) -> Self {
        Self {
            free_pages: a.free_pages(),
            used_pages: a.used_pages(),
            free_slots: a.free_slots(),
            used_slots: a.used_slots(),
            open_requests: a.open_requests(),
            admissible_tokens: a.admissible_tokens(),
            metadata_bytes: a.metadata_bytes(),
            cached_pages: a.cached_pages(),
            evictable_pages: a.evictable_pages(),
            hit_tokens: a.hit_tokens(),
            miss_tokens: a.miss_tokens(),
            pinned_pages: a.pinned_pages(),
            host_free_pages: a.host_free_pages(),
            host_cached_pages: a.host_cached_pages(),
            host_hit_tokens: a.host_hit_tokens(),
            offloaded_pages: a.offloaded_pages(),
            loaded_pages: a.loaded_pages(),
        }
    }
}

#[pymethods]
impl PoolStats {
    fn __repr__(&self) -> String {
        format!(
            "PoolStats(free_pages={}, used_pages={}, free_slots={}, used_slots={}, \
             open_requests={}, admissible_tokens={}, metadata_bytes={}, cached_pages={}, \
             evictable_pages={}, hit_tokens={}, miss_tokens={}, pinned_pages={}, \
             host_free_pages={}, host_cached_pages={}, host_hit_tokens={}, offloaded_pages={}, \
             loaded_pages={})",
            self.free_pages,
            self.used_pages,
            self.free_slots,
            self.used_slots,
            self.open_requests,
            self.admissible_tokens,
            self.metadata_bytes,
            self.cached_pages,
            self.evictable_pages,
            self.hit_tokens,
            self.miss_tokens,
            self.pinned_pages,
            self.host_free_pages,
            self.host_cached_pages,
            self.host_hit_tokens,
            self.offloaded_pages,
            self.loaded_pages
        )
    }
}
