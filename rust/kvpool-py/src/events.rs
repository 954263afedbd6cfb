//! `SlotAllocator.take_events`: the KV events (what vLLM's KVEventBatch
//! carries) as one numpy array per field, and the count of events dropped
//! from an undrained backlog.

use std::sync::{Mutex, MutexGuard, TryLockError};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::allocator::PySlotAllocator;
use crate::errors::Result;
use crate::output::to_numpy;

/// take_events' dict: one array per field.
pub(crate) fn events_dict<'py>(
    py: Python<'py>,
    e: &kvpool_core::Events,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("kind", to_numpy(py, &e.kind)?)?;
    d.set_item("hash_hi", to_numpy(py, &e.hash_hi)?)?;
    d.set_item("hash_lo", to_numpy(py, &e.hash_lo)?)?;
    d.set_item("parent_hi", to_numpy(py, &e.parent_hi)?)?;
    d.set_item("parent_lo", to_numpy(py, &e.parent_lo)?)?;
    d.set_item("page", to_numpy(py, &e.page)?)?;
    d.set_item("num_tokens", to_numpy(py, &e.num_tokens)?)?;
    d.set_item("salt", to_numpy(py, &e.salt)?)?;
    d.set_item("token_ids", to_numpy(py, &e.token_ids)?)?;
    d.set_item("medium", to_numpy(py, &e.medium)?)?;
    Ok(d)
}

/// Events a drain kept back, locked for a whole drain (take them or the
/// core's, build the result, keep them again if that fails), so that
/// concurrent drains neither reorder nor overwrite what is kept. Waited
/// for with the GIL released: the holder needs the GIL to build its arrays.
pub(crate) fn lock_kept<'a>(
    py: Python<'_>,
    kept: &'a Mutex<Option<kvpool_core::Events>>,
) -> MutexGuard<'a, Option<kvpool_core::Events>> {
    loop {
        match kept.try_lock() {
            Ok(guard) => return guard,
            Err(TryLockError::Poisoned(e)) => return e.into_inner(),
            Err(TryLockError::WouldBlock) => py.detach(|| {
                drop(kept.lock());
            }),
        }
    }
}

impl PySlotAllocator {
    /// The events a failed drain kept back, locked for a whole drain
    /// (`lock_kept`).
    pub(crate) fn undelivered(
        &self,
        py: Python<'_>,
    ) -> MutexGuard<'_, Option<kvpool_core::Events>> {
        lock_kept(py, &self.undelivered)
    }

    /// The events to drain next: those a failed drain kept back (the
    /// oldest), else the core's.
    pub(crate) fn oldest_events(
        &self,
        py: Python<'_>,
        kept: &mut Option<kvpool_core::Events>,
    ) -> kvpool_core::Events {
        match kept.take() {
            Some(e) => e,
            None => self.run(py, 0, |core| core.take_events()),
        }
    }
}

#[pymethods]
impl PySlotAllocator {
    /// take_events() -> dict[str, ndarray]
    ///
    /// Drains the KV events (what vLLM's KVEventBatch carries), oldest
    /// first, one numpy array per field: kind (uint8: 0 Stored, 1 Removed,
    /// 2 Cleared), hash_hi / hash_lo (uint64 halves of the 128-bit page
    /// hash), parent_hi / parent_lo (the parent page's hash, 0 for a chain's
    /// first page), page (int32), num_tokens (int32), salt (int64),
    /// token_ids (int32, the Stored events' tokens concatenated), and medium
    /// (uint8: the tier a Stored or Removed event is about and whose page id
    /// `page` is, 0 device, 1 host; 0 for Cleared; encode_kv_events sends
    /// them as "GPU" and "CPU"). Past max(num_pages, 65536) undrained events
    /// the backlog is replaced by one Cleared event (dropped_events counts
    /// what went).
    fn take_events<'py>(&self, py: Python<'py>) -> Result<Bound<'py, PyDict>> {
        // Events drained by a call whose arrays could not be allocated come
        // first (they are the oldest); newer ones wait in the core.
        let mut kept = self.undelivered(py);
        let e = self.oldest_events(py, &mut kept);
        events_dict(py, &e).map_err(|err| {
            *kept = Some(e);
            err.into()
        })
    }

    /// Events dropped because more than max(num_pages, 65536) were left
    /// undrained: each overflow replaces the backlog with one Cleared event
    /// (cumulative).
    #[getter]
    fn dropped_events(&self, py: Python<'_>) -> u64 {
        self.query(py, |a| a.dropped_events())
    }

    /// Whether KV events are recorded (the kv_events argument, fixed at
    /// construction). Without them take_events() stays empty, and what
    /// learns the cache's pages from it (a router, DiskCache) learns nothing.
    #[getter]
    fn kv_events(&self, py: Python<'_>) -> bool {
        self.query(py, |a| a.kv_events())
    }
}
