//! `PoolStats`: the pool's changing counters, read under one lock.

use kvpool_core::SlotAllocator;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::errors::invalid_argument;

/// The pool's changing counters, read together under one lock (so they agree
/// with each other, unlike separate property reads while other threads run).
// eq and pickling: engines send stats() to another process (a metrics or
// scheduler process) and compare snapshots.
#[pyclass(name = "PoolStats", module = "kvpool._core", frozen, get_all, eq)]
#[derive(PartialEq)]
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

/// Rebuilds a PoolStats from its fields in declaration order (what
/// `PoolStats.__reduce__` returns; not public API).
#[pyfunction]
pub fn _pool_stats(py: Python<'_>, fields: Vec<u64>) -> PyResult<PoolStats> {
    let v = fields;
    if v.len() != 17 {
        return Err(invalid_argument(
            py,
            format!(
                "_pool_stats takes the 17 fields of a PoolStats, got {}",
                v.len()
            ),
        ));
    }
    // usize is 64 bits on every platform the wheel is built for.
    Ok(PoolStats {
        free_pages: v[0] as usize,
        used_pages: v[1] as usize,
        free_slots: v[2] as usize,
        used_slots: v[3] as usize,
        open_requests: v[4] as usize,
        admissible_tokens: v[5] as usize,
        metadata_bytes: v[6] as usize,
        cached_pages: v[7] as usize,
        evictable_pages: v[8] as usize,
        hit_tokens: v[9],
        miss_tokens: v[10],
        pinned_pages: v[11] as usize,
        host_free_pages: v[12] as usize,
        host_cached_pages: v[13] as usize,
        host_hit_tokens: v[14],
        offloaded_pages: v[15],
        loaded_pages: v[16],
    })
}

#[pymethods]
impl PoolStats {
    /// Pickle support: (kvpool._core._pool_stats, (fields,)).
    fn __reduce__<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let rebuild = py.import("kvpool._core")?.getattr("_pool_stats")?;
        let fields: Vec<u64> = vec![
            self.free_pages as u64,
            self.used_pages as u64,
            self.free_slots as u64,
            self.used_slots as u64,
            self.open_requests as u64,
            self.admissible_tokens as u64,
            self.metadata_bytes as u64,
            self.cached_pages as u64,
            self.evictable_pages as u64,
            self.hit_tokens,
            self.miss_tokens,
            self.pinned_pages as u64,
            self.host_free_pages as u64,
            self.host_cached_pages as u64,
            self.host_hit_tokens,
            self.offloaded_pages,
            self.loaded_pages,
        ];
        Ok((rebuild, PyTuple::new(py, [fields])?))
    }

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
