//! The `SlotAllocator` Python class: converts arguments, releases the GIL
//! around batch work, and returns numpy arrays built from Vecs (no per-element
//! Python objects). One Mutex guards the core, so the object can be shared by
//! threads; code holding the Mutex never needs the GIL, so no deadlock.

use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use kvpool_core::SlotAllocator;
use pyo3::prelude::*;

use crate::convert::{
    seed_arg, size_arg, usize_arg, KvEventsFlag, LazyMetadataFlag, ManualClockFlag,
};
use crate::errors::Result;
use crate::output::{filled, new_uninit, Arr};
use crate::table::Table;

/// SlotAllocator(num_pages, page_size=1, max_requests=256, max_context_len=4096, *, hash_seed=None, handle_seed=None, kv_events=True, max_pinned_pages=None, manual_clock=False, host_pages=0, host_policy="write_back", lazy_metadata=False)
///
/// Owns which slots each request holds: free pages, per-request page lists,
/// shared pages (refcounts, a prefix cache with LRU eviction and retention
/// priorities, copy-on-write), and optionally a host tier below the device
/// pages. Thread-safe (one internal lock; batch calls release the GIL).
///
/// Args:
///     num_pages: total pages, reserved page 0 included (>= 2).
///     page_size: slots per page (>= 1).
///     max_requests: most requests open at once (<= 2**20).
///     max_context_len: most tokens per request (<= 2**28).
///     hash_seed: seed of the prefix-cache page hash (random when None).
///     handle_seed: seed of the handle generations (random when None): pools
///         built with the same seed and making the same calls hand out the
///         same handles (tensor-parallel ranks).
///     kv_events: record KV events for take_events(). Without them the prefix
///         index keys pages by a cheaper internal chain (chain_hashes() still
///         gives the xxh3 chain hashes events and page_hashes() use).
///     max_pinned_pages: most cached pages that may be pinned at once (<=
///         capacity_pages; None: a quarter of it). A pin past it is given
///         priority 99 instead.
///     manual_clock: retention durations (cache(retain_s=)) run on a clock
///         that only set_clock moves (tests; tensor-parallel ranks, which
///         must agree on time), not the system's monotonic clock.
///     host_pages: host pages of a host tier, the reserved host page 0
///         included (0: no tier, and everything behaves as without one;
///         otherwise >= 2). Cached pages then live on the device, the host
///         or both; the core queues the transfers (take_offloads,
///         take_loads) and swap_out / swap_in move whole requests.
///     host_policy: "write_back" (a cached page goes to the host when device
///         eviction would drop it) or "write_through" (when cache()
///         registers it).
///     lazy_metadata: map the per-page and per-slot metadata on first use
///         instead of at construction (and let the prefix index grow with its
///         registrations instead of reserving it for every page at the first
///         cache()), and skip priming the heap for result arrays: for a pool
///         sized far beyond what it will hold. Its first requests then pay the
///         page faults that construction otherwise takes (docs/allocator.md).
///         The free page stack (4 bytes a page) is written at construction
///         either way: 4 GiB and seconds at 2**30 pages.
///
/// Raises:
///     InvalidArgumentError: a size is zero, negative or too large, a seed
///         is not an int in [0, 2**64), host_pages is 1, or host_policy is
///         neither policy.
// Geometry is fixed at construction: fields read without taking the lock
// (extend's checks, and the Python properties of the same names).
#[pyclass(name = "SlotAllocator", module = "kvpool._core", frozen, weakref)]
pub struct PySlotAllocator {
    /// In an Arc so that the fork hooks (fork_guard) can hold it across a fork.
    pub(crate) inner: Arc<Mutex<SlotAllocator>>,
    /// Events take_events drained but could not return (their arrays did
    /// not fit in memory): the next take_events returns them first.
    pub(crate) undelivered: Arc<Mutex<Option<kvpool_core::Events>>>,
    /// Slots per page (P): slot = page * P + offset.
    #[pyo3(get)]
    pub(crate) page_size: usize,
    /// Total pages, the reserved page 0 included.
    #[pyo3(get)]
    pub(crate) num_pages: usize,
    /// num_pages * page_size: slot ids are in [0, num_slots).
    #[pyo3(get)]
    pub(crate) num_slots: usize,
    /// Most requests open at once (rows of a request-to-token table).
    #[pyo3(get)]
    pub(crate) max_requests: usize,
    /// Most tokens one request may hold.
    #[pyo3(get)]
    pub(crate) max_context_len: usize,
    /// Pages requests can ever hold: num_pages - 1 (page 0 is reserved).
    #[pyo3(get)]
    pub(crate) capacity_pages: usize,
    /// capacity_pages * page_size.
    #[pyo3(get)]
    pub(crate) capacity_slots: usize,
    /// Host pages of the host tier, the reserved host page 0 included (0: no tier).
    #[pyo3(get)]
    pub(crate) host_pages: usize,
}

impl PySlotAllocator {
    pub(crate) fn lock(&self) -> MutexGuard<'_, SlotAllocator> {
        // The core never panics on caller input; if a bug ever poisoned the
        // lock, keep serving so that check() can report what is wrong.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs a short query: like [`Self::run`] for small work (uncontended,
    /// with the GIL held; waiting on another thread's lock without it).
    pub(crate) fn query<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&SlotAllocator) -> R + Send,
    ) -> R {
        self.run(py, 0, |core| f(core))
    }
}

/// Work below this many handles or slots (extend, open) runs with the GIL
/// held: releasing and retaking it costs more than such a call's whole core
/// work (a decode step of 256 requests takes ~1 us in the core). Calls whose
/// work the arguments do not bound (close, truncate, check) always release it.
pub(crate) const SMALL_WORK: usize = 4096;

impl PySlotAllocator {
    /// Runs `f` on the core. Small work (see [`SMALL_WORK`]) takes an
    /// uncontended lock with the GIL held; large work, or a lock another
    /// thread holds, runs with the GIL released so other Python threads
    /// keep running meanwhile.
    pub(crate) fn run<R: Send>(
        &self,
        py: Python<'_>,
        work: usize,
        f: impl FnOnce(&mut SlotAllocator) -> R + Send,
    ) -> R {
        if work <= SMALL_WORK {
            if let Some(mut guard) = self.try_lock_now() {
                return f(&mut guard);
            }
        }
        py.detach(|| f(&mut self.lock()))
    }

    /// The lock if no other thread holds it (a poisoned lock is taken too,
    /// as `lock` does), else None.
    pub(crate) fn try_lock_now(&self) -> Option<MutexGuard<'_, SlotAllocator>> {
        match self.inner.try_lock() {
            Ok(guard) => Some(guard),
            Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }
}

// Only in builds with the `test-hooks` feature (on by default for cargo
// builds of this crate, off in the wheel: pyproject.toml).
#[cfg(feature = "test-hooks")]
#[pymethods]
impl PySlotAllocator {
    /// Test only (not public API): move every closed row's generation and/or
    /// the batch epoch next to their wrap points.
    #[pyo3(signature = (*, generation=None, epoch=None))]
    fn _set_counters_for_tests(
        &self,
        py: Python<'_>,
        generation: Option<u32>,
        epoch: Option<u32>,
    ) -> Result<()> {
        py.detach(|| self.lock().set_counters_for_tests(generation, epoch))?;
        Ok(())
    }
}

#[pymethods]
impl PySlotAllocator {
    #[new]
    // Arguments arrive as objects (None = default) so that a bool, float or
    // huge int is an InvalidArgumentError, not pyo3's TypeError/OverflowError.
    #[pyo3(
        signature = (num_pages, page_size=None, max_requests=None, max_context_len=None, *, hash_seed=None, handle_seed=None, kv_events=KvEventsFlag(true), max_pinned_pages=None, manual_clock=ManualClockFlag(false), host_pages=None, host_policy=None, lazy_metadata=LazyMetadataFlag(false)),
        text_signature = "(num_pages, page_size=1, max_requests=256, max_context_len=4096, *, hash_seed=None, handle_seed=None, kv_events=True, max_pinned_pages=None, manual_clock=False, host_pages=0, host_policy=\"write_back\", lazy_metadata=False)"
    )]
    // One parameter per Python keyword: the signature is the API.
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        num_pages: &Bound<'_, PyAny>,
        page_size: Option<&Bound<'_, PyAny>>,
        max_requests: Option<&Bound<'_, PyAny>>,
        max_context_len: Option<&Bound<'_, PyAny>>,
        hash_seed: Option<&Bound<'_, PyAny>>,
        handle_seed: Option<&Bound<'_, PyAny>>,
        kv_events: KvEventsFlag,
        max_pinned_pages: Option<&Bound<'_, PyAny>>,
        manual_clock: ManualClockFlag,
        host_pages: Option<&Bound<'_, PyAny>>,
        host_policy: Option<&Bound<'_, PyAny>>,
        lazy_metadata: LazyMetadataFlag,
    ) -> Result<Self> {
        // (default, least valid value)
        let or = |arg: Option<&Bound<'_, PyAny>>, what: &str, (default, least): (usize, usize)| {
            match arg {
                None => Ok(default),
                Some(v) => size_arg(py, v, what, least),
            }
        };
        let num_pages = size_arg(py, num_pages, "num_pages", 2)?;
        let page_size = or(page_size, "page_size", (1, 1))?;
        let max_requests = or(max_requests, "max_requests", (256, 1))?;
        let max_context_len = or(max_context_len, "max_context_len", (4096, 1))?;
        let seed = |arg: Option<&Bound<'_, PyAny>>, what: &str| {
            arg.map(|s| seed_arg(py, s, what)).transpose()
        };
        let opts = kvpool_core::Options {
            hash_seed: seed(hash_seed, "hash_seed")?,
            handle_seed: seed(handle_seed, "handle_seed")?,
            kv_events: kv_events.0,
            host_pages: or(host_pages, "host_pages", (0, 0))?,
            host_policy: crate::tier_args::policy_arg(py, host_policy)?,
            max_pinned_pages: max_pinned_pages
                .map(|m| usize_arg(py, m, "max_pinned_pages"))
                .transpose()?,
            manual_clock: manual_clock.0,
            lazy_metadata: lazy_metadata.0,
            ..kvpool_core::Options::new()
        };
        let core = py.detach(|| {
            let core = SlotAllocator::with_options(
                num_pages,
                page_size,
                max_requests,
                max_context_len,
                opts,
            )?;
            if !lazy_metadata.0 {
                // The largest result one call can return: every slot, or
                // every request at its longest (8 MiB with the defaults).
                let most = core
                    .num_slots()
                    .min(max_requests.saturating_mul(max_context_len));
                crate::heap_prime::prime_result_heap(most);
            }
            Ok::<_, kvpool_core::PoolError>(core)
        })?;
        let this = Self {
            page_size: core.page_size(),
            num_pages: core.num_pages(),
            num_slots: core.num_slots(),
            max_requests: core.max_requests(),
            max_context_len: core.max_context_len(),
            capacity_pages: core.capacity_pages(),
            capacity_slots: core.capacity_slots(),
            host_pages: core.host_pages(),
            inner: Arc::new(Mutex::new(core)),
            undelivered: Arc::new(Mutex::new(None)),
        };
        crate::fork_guard::track(&this.inner, &this.undelivered);
        Ok(this)
    }

    /// open(n=1) -> ndarray[int64]
    ///
    /// Opens n empty requests (no pages until they grow).
    ///
    /// Returns:
    ///     int64 array of n handles ((generation << 32) | row).
    ///
    /// Raises:
    ///     TooManyRequestsError: more than max_requests would be open.
    ///     InvalidArgumentError: n is negative.
    #[pyo3(signature = (n=None), text_signature = "($self, n=1)")]
    fn open<'py>(&self, py: Python<'py>, n: Option<&Bound<'py, PyAny>>) -> Result<Arr<'py, i64>> {
        let n = match n {
            None => 1,
            Some(n) => usize_arg(py, n, "n")?,
        };
        // The result array exists before any request is opened. More than
        // max_requests cannot succeed: the core says so (TooManyRequests)
        // before it allocates anything, so a huge n allocates nothing here.
        let (arr, buf) = new_uninit::<i64>(py, n.min(self.max_requests))?;
        let mut v = Vec::new();
        self.run(py, n, |c| c.open_into(n, &mut v))?;
        Ok(filled(py, arr, buf, &v)?)
    }

    /// check() -> None
    ///
    /// Verifies every invariant: free + held = capacity, no page in two places,
    /// owners match holders, page 0 never handed out.
    ///
    /// Raises:
    ///     InvariantError: an invariant is broken (a bug in kvpool).
    fn check(&self, py: Python<'_>) -> Result<()> {
        Ok(py.detach(|| self.lock().check())?)
    }

    /// reset() -> None
    ///
    /// Closes every request (a swapped-out one's host pages too) and releases
    /// the pages they hold; all handles become stale. The prefix cache stays:
    /// registered pages remain cached on both tiers, pinned ones pinned
    /// (clear_cache() drops them).
    fn reset(&self, py: Python<'_>) {
        py.detach(|| self.lock().reset())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        self.query(py, |a| {
            format!(
                "SlotAllocator(num_pages={}, page_size={}, max_requests={}, max_context_len={}; \
             free_pages={}, open_requests={})",
                a.num_pages(),
                a.page_size(),
                a.max_requests(),
                a.max_context_len(),
                a.free_pages(),
                a.open_requests()
            )
        })
    }
}

impl PySlotAllocator {
    /// The optional `table=` argument of extend, open_with_prefix and fork,
    /// validated against this allocator's shape.
    pub(crate) fn table_arg(
        &self,
        py: Python<'_>,
        table: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<Table>> {
        table
            .map(|t| {
                Table::from_arg(
                    py,
                    t,
                    self.max_requests,
                    self.max_context_len,
                    self.num_slots,
                )
            })
            .transpose()
    }
}
