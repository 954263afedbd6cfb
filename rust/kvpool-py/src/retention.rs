//! Retention priorities on `SlotAllocator`: unpin, the clock and the pin
//! counters (cache and close read their priority in `retention_args`).
//! The rules are the core's (`kvpool_core`'s eviction room).

use pyo3::prelude::*;

use crate::allocator::PySlotAllocator;
use crate::convert::int_arg;
use crate::errors::Result;
use crate::output::{to_numpy, Arr};
use crate::retention_args::seconds_arg;

#[pymethods]
impl PySlotAllocator {
    /// unpin(handles) -> int
    ///
    /// Gives every pinned page of each request's cached prefix the default
    /// priority, so cached ones are evictable (and free) at once. Returns how
    /// many pages were unpinned. A pinned prefix no open request holds is
    /// reached by opening one on it: open_with_prefix(prompt + [any token]),
    /// unpin, close. clear_cache() unpins everything. Atomic.
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    ///     RequestSwappedOutError: a request is swapped out.
    ///     InvalidArgumentError: a duplicate handle.
    fn unpin(&self, py: Python<'_>, handles: &Bound<'_, PyAny>) -> Result<usize> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        Ok(py.detach(|| self.lock().unpin(&h))?)
    }

    /// set_clock(now) -> None
    ///
    /// Sets a manual clock (manual_clock=True) to `now` seconds, and ends the
    /// priorities whose retain_s is over by then (soonest first). The clock
    /// starts at 0 and never goes back.
    ///
    /// Raises:
    ///     InvalidArgumentError: the pool runs on the system clock; now is not
    ///         a number in [0, 1e9] or is earlier than the clock.
    fn set_clock(&self, py: Python<'_>, now: &Bound<'_, PyAny>) -> Result<()> {
        let t = seconds_arg(py, now, "now")?;
        Ok(self.run(py, 0, |c| c.set_clock(t))?)
    }

    /// The pool's clock in seconds: since construction (the system's
    /// monotonic clock), or as last set (manual_clock=True).
    #[getter]
    fn clock(&self, py: Python<'_>) -> f64 {
        self.query(py, |a| a.clock())
    }

    /// Registered pages pinned (priority 100 with no retain_s), held or
    /// cached; at most max_pinned_pages.
    #[getter]
    fn pinned_pages(&self, py: Python<'_>) -> usize {
        self.query(py, |a| a.pinned_pages())
    }

    /// Most registered pages that may be pinned at once.
    #[getter]
    fn max_pinned_pages(&self, py: Python<'_>) -> usize {
        self.query(py, |a| a.max_pinned_pages())
    }

    /// evictable_pages_by_priority() -> ndarray[int64]
    ///
    /// Evictable pages (cached, not pinned) at each priority 0..100 (101
    /// entries), as last filed: a retain_s that is over moves its page when
    /// the clock is next read (an eviction, a priority given, set_clock).
    fn evictable_pages_by_priority<'py>(&self, py: Python<'py>) -> Result<Arr<'py, i64>> {
        let v = self.query(py, |a| a.evictable_pages_by_priority());
        let v: Vec<i64> = v.iter().map(|&n| n as i64).collect();
        Ok(to_numpy(py, &v)?)
    }
}
