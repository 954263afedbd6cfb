//! The `GroupedAllocator` Python class: a pool of layer groups (full,
//! sliding, state) sharing one request handle space. Arguments become
//! plain Rust values, the work runs under one lock (the GIL released for
//! batch work), and each group's results come back as numpy arrays.

use std::sync::{Arc, Mutex, MutexGuard};

use kvpool_core::{GroupSpec, GroupedAllocator};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::convert::{counts_of, int_arg, seed_arg, size_arg, usize_arg, CacheFlag, KvEventsFlag};
use crate::errors::{invalid_argument, Result};
use crate::extend::tokens_arg;
use crate::grouped_args::{filled_lists, group_spec, slot_rooms, spec_dict, tables_arg, views};
use crate::output::{counts_total, extend_total, filled, new_uninit, Arr};

/// GroupedAllocator(groups, max_requests=256, max_context_len=4096, *, hash_seed=None, handle_seed=None, kv_events=True, anchor_pages=None)
///
/// A pool of layer groups that share one request handle space: full
/// attention, sliding-window attention and fixed-size state (linear
/// attention, Mamba), each with its own pages, page size and prefix cache.
/// Every call acts on all groups at once and changes nothing in any group
/// when it refuses. A prefix hit of length L needs every full group's pages
/// for [0, L), every sliding group's for [L - window + 1, L) and every state
/// group's checkpoint at L; it is the longest such L (docs/allocator.md).
/// Thread-safe (one internal lock).
///
/// Args:
///     groups: one dict per group: {"kind": "full", "num_pages": N,
///         "page_size": P}, {"kind": "sliding", "num_pages": N, "page_size":
///         P, "window": W} (a token attends to itself and W - 1 before it, as
///         in Hugging Face configs), or {"kind": "state", "num_slots": S,
///         "checkpoint_every": C} (C = 0: the pool's hit step). Page and slot
///         counts include the reserved page (slot) 0.
///     max_requests: most requests open at once (<= 2**20).
///     max_context_len: most tokens per request (<= 2**28).
///     hash_seed: seed of the prefix-cache page hash (random when None).
///     handle_seed: seed of the handle generations (random when None).
///     kv_events: record the anchor chain's KV events for take_events().
///     anchor_pages: pages of the token-only anchor chain, used when no full
///         group's page size divides every other (default: room for every
///         request's longest context twice); 2 to 2**31 - 1, checked even
///         where a full group holds the anchor and the value goes unused.
///
/// Raises:
///     InvalidArgumentError: no groups, a bad group dict, a size, page size,
///         window, checkpoint_every or anchor_pages out of range, or a seed
///         that is not an int in [0, 2**64).
#[pyclass(name = "GroupedAllocator", module = "kvpool._core", frozen, weakref)]
pub struct PyGroupedAllocator {
    /// In an Arc so that the fork hooks (fork_guard) can hold it across a fork.
    inner: Arc<Mutex<GroupedAllocator>>,
    /// Events a take_events drained but could not return (a short drain's
    /// dict that could not be built; see SlotAllocator's), locked for a whole
    /// drain so that concurrent drains stay in order.
    pub(crate) undelivered: Arc<Mutex<Option<kvpool_core::Events>>>,
    /// Number of layer groups.
    #[pyo3(get)]
    num_groups: usize,
    /// Most requests open at once (rows of every group's request-to-token table).
    #[pyo3(get)]
    max_requests: usize,
    /// Most tokens one request may hold.
    #[pyo3(get)]
    max_context_len: usize,
    /// The group carrying the anchor chain, or None for a token-only anchor.
    #[pyo3(get)]
    anchor_group: Option<usize>,
    /// Page size of the anchor chain (the gcd of the groups' page sizes).
    #[pyo3(get)]
    anchor_page_size: usize,
    /// Prefix hits are multiples of this (the lcm of every page size).
    #[pyo3(get)]
    hit_step: usize,
    /// Each group's spec (checkpoint_every resolved).
    specs: Vec<GroupSpec>,
}

impl PyGroupedAllocator {
    pub(crate) fn lock(&self) -> MutexGuard<'_, GroupedAllocator> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the core with the GIL released.
    pub(crate) fn run<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut GroupedAllocator) -> R + Send,
    ) -> R {
        py.detach(|| f(&mut self.lock()))
    }

    pub(crate) fn max_requests(&self) -> usize {
        self.max_requests
    }

    pub(crate) fn max_context_len(&self) -> usize {
        self.max_context_len
    }

    /// Slots of group `g` (num_pages * page_size).
    pub(crate) fn group_slots(&self, g: usize) -> usize {
        self.specs[g].num_pages * self.specs[g].page_size
    }

    /// A group index, checked.
    pub(crate) fn group_arg(&self, py: Python<'_>, group: &Bound<'_, PyAny>) -> PyResult<usize> {
        let g = usize_arg(py, group, "group")?;
        if g >= self.num_groups {
            return Err(invalid_argument(
                py,
                format!(
                    "group {g} does not exist; this pool has groups 0 to {}",
                    self.num_groups - 1
                ),
            ));
        }
        Ok(g)
    }
}

#[pymethods]
impl PyGroupedAllocator {
    #[new]
    #[pyo3(
        signature = (groups, max_requests=None, max_context_len=None, *, hash_seed=None, handle_seed=None, kv_events=KvEventsFlag(true), anchor_pages=None),
        text_signature = "(groups, max_requests=256, max_context_len=4096, *, hash_seed=None, handle_seed=None, kv_events=True, anchor_pages=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        groups: &Bound<'_, PyAny>,
        max_requests: Option<&Bound<'_, PyAny>>,
        max_context_len: Option<&Bound<'_, PyAny>>,
        hash_seed: Option<&Bound<'_, PyAny>>,
        handle_seed: Option<&Bound<'_, PyAny>>,
        kv_events: KvEventsFlag,
        anchor_pages: Option<&Bound<'_, PyAny>>,
    ) -> Result<Self> {
        let items: Vec<Bound<'_, PyAny>> = groups
            .try_iter()
            .map_err(|_| invalid_argument(py, "groups must be a list of group dicts"))?
            .collect::<PyResult<_>>()?;
        let specs = items
            .iter()
            .enumerate()
            .map(|(g, d)| group_spec(py, g, d))
            .collect::<PyResult<Vec<_>>>()?;
        let or = |arg: Option<&Bound<'_, PyAny>>, what: &str, default: usize| match arg {
            None => Ok(default),
            Some(v) => size_arg(py, v, what, 1),
        };
        let max_requests = or(max_requests, "max_requests", 256)?;
        let max_context_len = or(max_context_len, "max_context_len", 4096)?;
        let anchor_pages = anchor_pages
            .map(|v| size_arg(py, v, "anchor_pages", 2))
            .transpose()?;
        let seed = |arg: Option<&Bound<'_, PyAny>>, what: &str| {
            arg.map(|s| seed_arg(py, s, what)).transpose()
        };
        let opts = kvpool_core::Options {
            hash_seed: seed(hash_seed, "hash_seed")?,
            handle_seed: seed(handle_seed, "handle_seed")?,
            kv_events: kv_events.0,
            ..kvpool_core::Options::new()
        };
        let core = py.detach(|| {
            GroupedAllocator::new(&specs, max_requests, max_context_len, opts, anchor_pages)
        })?;
        let specs = (0..core.num_groups())
            .map(|g| core.group_spec(g))
            .collect::<kvpool_core::Result<Vec<_>>>()?;
        let this = Self {
            num_groups: core.num_groups(),
            max_requests: core.max_requests(),
            max_context_len: core.max_context_len(),
            anchor_group: core.anchor_group(),
            anchor_page_size: core.anchor_page_size(),
            hit_step: core.hit_step(),
            specs,
            inner: Arc::new(Mutex::new(core)),
            undelivered: Arc::new(Mutex::new(None)),
        };
        crate::fork_guard::track(&this.inner, &this.undelivered);
        Ok(this)
    }

    /// Each group's spec, as the dicts the constructor takes (checkpoint_every resolved).
    #[getter]
    fn groups<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let ds = self
            .specs
            .iter()
            .map(|s| spec_dict(py, s))
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, ds)
    }

    /// open(n=1) -> ndarray[int64]
    ///
    /// Opens n empty requests in every group; a state group gives each a
    /// slot, queued to be zeroed (take_copies).
    ///
    /// Raises:
    ///     TooManyRequestsError: more than max_requests would be open.
    ///     PoolExhaustedError: a state group has fewer than n free or
    ///         evictable slots (the message names the group).
    ///     InvalidArgumentError: n is negative.
    #[pyo3(signature = (n=None), text_signature = "($self, n=1)")]
    fn open<'py>(&self, py: Python<'py>, n: Option<&Bound<'py, PyAny>>) -> Result<Arr<'py, i64>> {
        let n = match n {
            None => 1,
            Some(n) => usize_arg(py, n, "n")?,
        };
        // Allocated first: a MemoryError once the rows are open would lose them.
        let (arr, buf) = new_uninit::<i64>(py, n.min(self.max_requests))?;
        let v = self.run(py, |c| c.open(n))?;
        Ok(filled(py, arr, buf, &v)?)
    }

    /// admit(counts, tokens=None, tables=None) -> (handles, slots)
    ///
    /// Opens len(counts) requests and extends request i by counts[i] tokens
    /// in every group, as open then extend, in one call. Atomic. A single int
    /// is refused, as SlotAllocator.admit refuses it: pass [n] for one request.
    ///
    /// Returns:
    ///     (handles int64, a list with each group's new slots (int64,
    ///     flattened in request order; empty for a state group)).
    ///
    /// Raises:
    ///     TooManyRequestsError: not enough free rows.
    ///     PoolExhaustedError: a group is short of pages or state slots (the
    ///         message names the first such group).
    ///     ContextTooLongError: a count past max_context_len.
    ///     InvalidArgumentError: a negative count, a single int, tokens of the
    ///         wrong length or range, bad tables.
    #[pyo3(signature = (counts, tokens=None, tables=None))]
    fn admit<'py>(
        &self,
        py: Python<'py>,
        counts: &Bound<'py, PyAny>,
        tokens: Option<&Bound<'py, PyAny>>,
        tables: Option<&Bound<'py, PyAny>>,
    ) -> Result<(Arr<'py, i64>, Bound<'py, PyList>)> {
        let c = crate::admit::counts_arg(py, counts)?;
        let toks = tokens_arg(py, tokens)?;
        let t = tables_arg(
            py,
            tables,
            &self.specs,
            self.max_requests,
            self.max_context_len,
        )?;
        // The results are allocated first: a MemoryError once the requests
        // are open would lose them.
        let ctx = self.max_context_len;
        let (arr, buf) = new_uninit::<i64>(py, c.len().min(self.max_requests))?;
        let rooms = slot_rooms(py, &self.specs, |g| {
            counts_total(&c, self.group_slots(g), ctx)
        })?;
        let (h, outs) = self.run(py, |core| {
            // SAFETY: see `views`.
            let mut v = unsafe { views(&t) };
            core.admit(&c, toks.as_deref(), &mut v)
        })?;
        Ok((filled(py, arr, buf, &h)?, filled_lists(py, rooms, &outs)?))
    }

    /// extend(handles, counts, tokens=None, tables=None) -> list[ndarray]
    ///
    /// Appends counts[i] tokens (or counts for all) to request handles[i] in
    /// every group. A sliding group first releases the pages wholly before
    /// start - window + 1 of each growing request (start: its length before
    /// the call), which the step no longer attends to; registered ones stay
    /// cached. With tables (one int32 request-to-token table or None per
    /// group), each group's new slots are written in the same call, and a
    /// sliding group's released positions get the null page's slots. Copies
    /// on write are queued per group (take_copies). Atomic.
    ///
    /// Returns:
    ///     each group's new slots (int64, flattened in request order; empty
    ///     for a state group).
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    ///     PoolExhaustedError: a group is short of pages (the message names
    ///         the first such group).
    ///     ContextTooLongError: a request would pass max_context_len.
    ///     InvalidArgumentError: negative count, mismatched lengths, duplicate
    ///         handle, tokens of the wrong length or range or disagreeing with
    ///         the prompt, bad or overlapping tables.
    #[pyo3(signature = (handles, counts, tokens=None, tables=None))]
    fn extend<'py>(
        &self,
        py: Python<'py>,
        handles: &Bound<'py, PyAny>,
        counts: &Bound<'py, PyAny>,
        tokens: Option<&Bound<'py, PyAny>>,
        tables: Option<&Bound<'py, PyAny>>,
    ) -> Result<Bound<'py, PyList>> {
        let c = int_arg(py, counts, "counts")?;
        let toks = tokens_arg(py, tokens)?;
        // Before the tables: converting handles can run Python code (an
        // `__index__`), which could make a checked table read-only.
        let h = int_arg(py, handles, "handles")?.into_vec();
        let t = tables_arg(
            py,
            tables,
            &self.specs,
            self.max_requests,
            self.max_context_len,
        )?;
        // The results are allocated first: a MemoryError once the requests
        // grew would lose their slots.
        let ctx = self.max_context_len;
        let rooms = slot_rooms(py, &self.specs, |g| {
            extend_total(h.len(), &c, self.group_slots(g), ctx)
        })?;
        let outs = self.run(py, |core| {
            // SAFETY: see `views`.
            let mut v = unsafe { views(&t) };
            core.extend(&h, counts_of(&c), toks.as_deref(), &mut v)
        })?;
        Ok(filled_lists(py, rooms, &outs)?)
    }

    /// close(handles, cache=False) -> None
    ///
    /// Closes requests in every group, releasing their pages and state
    /// slots; their handles become stale. With cache=True, first registers
    /// them as cache() does. Atomic.
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, already closed or stale.
    ///     InvalidArgumentError: a duplicate handle.
    #[pyo3(signature = (handles, cache=CacheFlag(false)), text_signature = "($self, handles, cache=False)")]
    fn close(&self, py: Python<'_>, handles: &Bound<'_, PyAny>, cache: CacheFlag) -> Result<()> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        Ok(self.run(py, |c| c.close(&h, cache.0))?)
    }

    /// reset() -> None
    ///
    /// Closes every request in every group; all handles become stale.
    fn reset(&self, py: Python<'_>) {
        self.run(py, |c| c.reset())
    }

    /// check() -> None
    ///
    /// Verifies every invariant of every group and of what ties them to the
    /// request table.
    ///
    /// Raises:
    ///     InvariantError: an invariant is broken (a bug in kvpool).
    fn check(&self, py: Python<'_>) -> Result<()> {
        Ok(self.run(py, |c| c.check())?)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let kinds: Vec<&str> = self.specs.iter().map(|s| s.kind.name()).collect();
        self.run(py, |c| {
            format!(
                "GroupedAllocator(groups={kinds:?}, max_requests={}, max_context_len={}; open_requests={})",
                c.max_requests(),
                c.max_context_len(),
                c.open_requests()
            )
        })
    }
}
