//! `GroupedAllocator.stats()`: the pool-wide and per-group counters, read
//! under one lock.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::grouped::PyGroupedAllocator;

/// One group's page counts: capacity, free (FREE + evictable), used,
/// registered, evictable.
type GroupCounts = [usize; 5];

#[pymethods]
impl PyGroupedAllocator {
    /// stats() -> dict
    ///
    /// The changing counters read under one lock, so they agree with each
    /// other even while other threads work (a metrics scrape reads this):
    /// open_requests, hit_tokens, miss_tokens, dropped_events, and groups, a
    /// list with one dict per group of capacity_pages, free_pages,
    /// used_pages, cached_pages and evictable_pages (as the per-group
    /// queries).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (open, hits, misses, dropped, groups) = self.run(py, |c| {
            // Every g below num_groups() is a group: the per-group queries cannot fail.
            let groups: Vec<GroupCounts> = (0..c.num_groups())
                .map(|g| {
                    [
                        c.capacity_pages(g).unwrap_or(0),
                        c.free_pages(g).unwrap_or(0),
                        c.used_pages(g).unwrap_or(0),
                        c.cached_pages(g).unwrap_or(0),
                        c.evictable_pages(g).unwrap_or(0),
                    ]
                })
                .collect();
            (
                c.open_requests(),
                c.hit_tokens(),
                c.miss_tokens(),
                c.dropped_events(),
                groups,
            )
        });
        let d = PyDict::new(py);
        d.set_item("open_requests", open)?;
        d.set_item("hit_tokens", hits)?;
        d.set_item("miss_tokens", misses)?;
        d.set_item("dropped_events", dropped)?;
        let list = PyList::empty(py);
        for [capacity, free, used, cached, evictable] in groups {
            let g = PyDict::new(py);
            g.set_item("capacity_pages", capacity)?;
            g.set_item("free_pages", free)?;
            g.set_item("used_pages", used)?;
            g.set_item("cached_pages", cached)?;
            g.set_item("evictable_pages", evictable)?;
            list.append(g)?;
        }
        d.set_item("groups", list)?;
        Ok(d)
    }
}
