//! `GroupedAllocator`'s prefix-cache calls: cache (register requests' pages and
//! checkpoints in every group), evict and clear_cache.

use pyo3::prelude::*;

use crate::convert::{int_arg, usize_arg};
use crate::errors::Result;
use crate::grouped::PyGroupedAllocator;

#[pymethods]
impl PyGroupedAllocator {
    /// cache(handles) -> None
    ///
    /// Registers each request's full pages of known tokens in every group:
    /// the anchor chain, each group's pages under it, and a state group's
    /// checkpoint of the request's slot when its length is a multiple of
    /// the group's checkpoint_every (a queued copy). Call it once the step
    /// that wrote those pages and that state has run. Atomic.
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    ///     InvalidArgumentError: a duplicate handle.
    fn cache(&self, py: Python<'_>, handles: &Bound<'_, PyAny>) -> Result<()> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        Ok(self.run(py, |c| c.cache(&h))?)
    }

    /// evict(group, n) -> int
    ///
    /// Evicts up to n cached pages (checkpoints of a state group) of one
    /// group, least recently used first; returns how many.
    ///
    /// Raises:
    ///     InvalidArgumentError: no such group, n negative.
    fn evict(
        &self,
        py: Python<'_>,
        group: &Bound<'_, PyAny>,
        n: &Bound<'_, PyAny>,
    ) -> Result<usize> {
        let g = self.group_arg(py, group)?;
        let n = usize_arg(py, n, "n")?;
        Ok(self.run(py, |c| c.evict(g, n))?)
    }

    /// clear_cache() -> None
    ///
    /// Drops every cached page and checkpoint of every group (held ones stay
    /// with their requests).
    fn clear_cache(&self, py: Python<'_>) {
        self.run(py, |c| c.clear_cache())
    }
}
