//! `PoolStats`: the pool's changing counters, read under one lock.

use kvpool_core::{SlotAllocator, Stats, MAX_PRIORITY};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::errors::invalid_argument;

/// Priorities 0..=MAX_PRIORITY: the length of `evictable_pages_by_priority`.
const PRIORITIES: usize = MAX_PRIORITY as usize + 1;
/// The scalar fields (all but `evictable_pages_by_priority`).
const SCALARS: usize = 18;

/// The pool's changing counters, read together under one lock (so they agree
/// with each other, unlike separate property reads while other threads run).
///
/// Pickles by field name. A snapshot pickled by an older kvpool loads with the
/// fields it lacks at their defaults (that kvpool did not record them):
/// dropped_events 0, evictable_pages_by_priority [] (empty, not 101 zeros,
/// which would contradict evictable_pages). A snapshot pickled by a newer
/// kvpool loads with the fields this one knows; the others are dropped.
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
    dropped_events: u64,
    // A list of 101: a metrics scrape splits it into bands that must add up to
    // evictable_pages, which only a read in the same snapshot guarantees.
    evictable_pages_by_priority: Vec<usize>,
}

impl PoolStats {
    pub(crate) fn of(a: &SlotAllocator) -> Self {
        let s: Stats = a.stats();
        Self {
            free_pages: s.free_pages,
            used_pages: s.used_pages,
            free_slots: s.free_slots,
            used_slots: s.used_slots,
            open_requests: s.open_requests,
            admissible_tokens: s.admissible_tokens,
            metadata_bytes: s.metadata_bytes,
            cached_pages: s.cached_pages,
            evictable_pages: s.evictable_pages,
            hit_tokens: s.hit_tokens,
            miss_tokens: s.miss_tokens,
            pinned_pages: s.pinned_pages,
            host_free_pages: s.host_free_pages,
            host_cached_pages: s.host_cached_pages,
            host_hit_tokens: s.host_hit_tokens,
            offloaded_pages: s.offloaded_pages,
            loaded_pages: s.loaded_pages,
            dropped_events: s.dropped_events,
            evictable_pages_by_priority: s.evictable_pages_by_priority.to_vec(),
        }
    }

    fn scalars(&self) -> [u64; SCALARS] {
        [
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
            self.dropped_events,
        ]
    }
}

/// The scalar fields' names, in declaration order.
const NAMES: [&str; SCALARS] = [
    "free_pages",
    "used_pages",
    "free_slots",
    "used_slots",
    "open_requests",
    "admissible_tokens",
    "metadata_bytes",
    "cached_pages",
    "evictable_pages",
    "hit_tokens",
    "miss_tokens",
    "pinned_pages",
    "host_free_pages",
    "host_cached_pages",
    "host_hit_tokens",
    "offloaded_pages",
    "loaded_pages",
    "dropped_events",
];
/// The counters PoolStats had when it first pickled (b2d1510): a pickle always
/// carries them. The ones after take defaults when a pickle lacks them.
const FIRST_PICKLED: usize = 17;
const BY_PRIORITY: &str = "evictable_pages_by_priority";

impl PoolStats {
    // usize is 64 bits on every platform the wheel is built for.
    fn from_parts(v: [u64; SCALARS], by_priority: Vec<u64>) -> Self {
        Self {
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
            dropped_events: v[17],
            evictable_pages_by_priority: by_priority.into_iter().map(|n| n as usize).collect(),
        }
    }
}

fn counter(py: Python<'_>, name: &str, v: &Bound<'_, PyAny>) -> PyResult<u64> {
    v.extract::<u64>().map_err(|_| {
        invalid_argument(
            py,
            format!("PoolStats field {name} must be an int in 0..2**64, got {v:?}"),
        )
    })
}

/// Rebuilds a PoolStats from what some kvpool's `PoolStats.__reduce__` put in
/// a pickle (not public API). Today's form is a dict by field name: a field
/// added after the first pickled layout takes its default when missing (an
/// older kvpool's pickle), and a key this version does not know (a newer
/// kvpool's field) is ignored. The flat lists of earlier versions load too:
/// 17 counters (b2d1510 up to 0ac4d13, defaults for the rest) or 18 counters
/// then the 101 priority counts (0ac4d13).
#[pyfunction]
pub fn _pool_stats(py: Python<'_>, state: &Bound<'_, PyAny>) -> PyResult<PoolStats> {
    let mut v = [0u64; SCALARS];
    if let Ok(d) = state.cast::<PyDict>() {
        for (i, name) in NAMES.iter().enumerate() {
            match d.get_item(name)? {
                Some(x) => v[i] = counter(py, name, &x)?,
                None if i < FIRST_PICKLED => {
                    return Err(invalid_argument(
                        py,
                        format!(
                            "_pool_stats: the state has no {name} (every pickled PoolStats \
                             carries the first {FIRST_PICKLED} counters)"
                        ),
                    ))
                }
                None => {}
            }
        }
        let by = match d.get_item(BY_PRIORITY)? {
            None => Vec::new(),
            Some(x) => {
                // Empty: a snapshot that came from an older kvpool's pickle.
                let by = x
                    .extract::<Vec<u64>>()
                    .ok()
                    .filter(|b| b.is_empty() || b.len() == PRIORITIES);
                let Some(by) = by else {
                    return Err(invalid_argument(
                        py,
                        format!(
                            "PoolStats field {BY_PRIORITY} must be a list of {PRIORITIES} \
                             ints in 0..2**64 (priorities 0..={MAX_PRIORITY}) or empty, got {x:?}"
                        ),
                    ));
                };
                by
            }
        };
        return Ok(PoolStats::from_parts(v, by));
    }
    let flat = state.extract::<Vec<u64>>().ok();
    match flat {
        Some(f) if f.len() == FIRST_PICKLED => {
            v[..FIRST_PICKLED].copy_from_slice(&f);
            Ok(PoolStats::from_parts(v, Vec::new()))
        }
        Some(f) if f.len() == SCALARS + PRIORITIES => {
            v.copy_from_slice(&f[..SCALARS]);
            Ok(PoolStats::from_parts(v, f[SCALARS..].to_vec()))
        }
        _ => Err(invalid_argument(
            py,
            format!(
                "_pool_stats takes a PoolStats' pickled state: a dict by field name, or \
                 an earlier kvpool's flat list of {FIRST_PICKLED} counters or of \
                 {SCALARS} counters then {PRIORITIES} evictable page counts by priority \
                 ({} ints in 0..2**64); got {state:?}",
                SCALARS + PRIORITIES
            ),
        )),
    }
}

#[pymethods]
impl PoolStats {
    /// Pickle support: (kvpool._core._pool_stats, ({field: value, ...},)).
    // By name, not position: a later kvpool adds keys and reads this one's
    // pickles with defaults for what is missing; this one ignores its extras.
    fn __reduce__<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let rebuild = py.import("kvpool._core")?.getattr("_pool_stats")?;
        let state = PyDict::new(py);
        for (name, v) in NAMES.iter().zip(self.scalars()) {
            state.set_item(name, v)?;
        }
        state.set_item(BY_PRIORITY, &self.evictable_pages_by_priority)?;
        Ok((rebuild, PyTuple::new(py, [state])?))
    }

    fn __repr__(&self) -> String {
        // The priorities that have pages, as {priority:pages,...}: 101 counts,
        // mostly 0, would drown the rest of a log line.
        let by: Vec<String> = self
            .evictable_pages_by_priority
            .iter()
            .enumerate()
            .filter(|(_, &n)| n != 0)
            .map(|(p, n)| format!("{p}:{n}"))
            .collect();
        format!(
            "PoolStats(free_pages={}, used_pages={}, free_slots={}, used_slots={}, \
             open_requests={}, admissible_tokens={}, metadata_bytes={}, cached_pages={}, \
             evictable_pages={}, hit_tokens={}, miss_tokens={}, pinned_pages={}, \
             host_free_pages={}, host_cached_pages={}, host_hit_tokens={}, offloaded_pages={}, \
             loaded_pages={}, dropped_events={}, evictable_pages_by_priority={{{}}})",
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
            self.loaded_pages,
            self.dropped_events,
            by.join(",")
        )
    }
}
