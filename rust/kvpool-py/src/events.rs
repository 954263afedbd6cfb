//! `SlotAllocator.take_events`: the KV events (what vLLM's KVEventBatch
//! carries) as one numpy array per field, and the count of events dropped
//! from an undrained backlog.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, MutexGuard, TryLockError};

use kvpool_core::{Drained, EventSink};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::allocator::PySlotAllocator;
use crate::errors::Result;
use crate::output::{new_uninit, to_numpy};

/// take_events' dict: one array per field.
fn events_dict<'py>(py: Python<'py>, e: &kvpool_core::Events) -> PyResult<Bound<'py, PyDict>> {
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

/// take_events' dict, for a pool whose undrained events `pending` counts
/// and `drain` drains (`take_events_into`): the events `kept` holds come
/// first (the oldest, kept back by a drain that could not deliver them);
/// else the pool's, drained straight into arrays made beforehand. Events
/// drained whose dict cannot be built are kept for the next drain.
pub(crate) fn take_dict<'py>(
    py: Python<'py>,
    kept: &mut Option<kvpool_core::Events>,
    pending: (usize, usize),
    drain: impl for<'s> FnOnce(EventSink<'s>) -> Drained,
) -> PyResult<Bound<'py, PyDict>> {
    let e = match kept.take() {
        Some(e) => e,
        None => match drained_dict(py, pending, drain)? {
            Drain::Whole(dict) => return Ok(dict),
            Drain::Short(e) => *e,
        },
    };
    events_dict(py, &e).map_err(|err| {
        *kept = Some(e);
        err
    })
}

/// What a drain into numpy arrays gave: the dict, or, when fewer events fit
/// than were pending (an overflow replaced the backlog between the count and
/// the drain), the drained events themselves, for the caller to build the
/// dict from and to keep if that fails.
enum Drain<'py> {
    Whole(Bound<'py, PyDict>),
    Short(Box<kvpool_core::Events>),
}

/// take_events' dict, its arrays filled by the core in place: `pending`
/// (events, token ids) sizes them, `drain` takes the oldest events that fit
/// (`SlotAllocator::take_events_into`) and says how many it wrote. The
/// arrays and the dict are made before anything is drained, so a
/// MemoryError leaves every event in the pool, and nothing that can fail
/// comes after the drain.
fn drained_dict<'py>(
    py: Python<'py>,
    pending: (usize, usize),
    drain: impl for<'s> FnOnce(EventSink<'s>) -> Drained,
) -> PyResult<Drain<'py>> {
    let (n, t) = pending;
    let (kind, mut kind_b) = new_uninit::<u8>(py, n)?;
    let (hash_hi, mut hash_hi_b) = new_uninit::<u64>(py, n)?;
    let (hash_lo, mut hash_lo_b) = new_uninit::<u64>(py, n)?;
    let (parent_hi, mut parent_hi_b) = new_uninit::<u64>(py, n)?;
    let (parent_lo, mut parent_lo_b) = new_uninit::<u64>(py, n)?;
    let (page, mut page_b) = new_uninit::<i32>(py, n)?;
    let (num_tokens, mut num_tokens_b) = new_uninit::<i32>(py, n)?;
    let (salt, mut salt_b) = new_uninit::<i64>(py, n)?;
    let (token_ids, mut token_ids_b) = new_uninit::<i32>(py, t)?;
    let (medium, mut medium_b) = new_uninit::<u8>(py, n)?;
    let dict = PyDict::new(py);
    dict.set_item("kind", &kind)?;
    dict.set_item("hash_hi", &hash_hi)?;
    dict.set_item("hash_lo", &hash_lo)?;
    dict.set_item("parent_hi", &parent_hi)?;
    dict.set_item("parent_lo", &parent_lo)?;
    dict.set_item("page", &page)?;
    dict.set_item("num_tokens", &num_tokens)?;
    dict.set_item("salt", &salt)?;
    dict.set_item("token_ids", &token_ids)?;
    dict.set_item("medium", &medium)?;
    // SAFETY: each buffer belongs to an array made just above, alive until
    // this function returns and reachable only through `dict`, which nothing
    // else has yet; one slice each.
    let d = drain(unsafe {
        EventSink {
            kind: kind_b.uninit(),
            hash_hi: hash_hi_b.uninit(),
            hash_lo: hash_lo_b.uninit(),
            parent_hi: parent_hi_b.uninit(),
            parent_lo: parent_lo_b.uninit(),
            page: page_b.uninit(),
            num_tokens: num_tokens_b.uninit(),
            salt: salt_b.uninit(),
            medium: medium_b.uninit(),
            token_ids: token_ids_b.uninit(),
        }
    });
    if d.events == n && d.tokens == t {
        return Ok(Drain::Whole(dict));
    }
    let m = d.events;
    // SAFETY: the drain wrote rows 0..m and token ids 0..d.tokens; the
    // arrays are alive and still unshared.
    Ok(Drain::Short(Box::new(unsafe {
        kvpool_core::Events {
            kind: kind_b.written(m).to_vec(),
            hash_hi: hash_hi_b.written(m).to_vec(),
            hash_lo: hash_lo_b.written(m).to_vec(),
            parent_hi: parent_hi_b.written(m).to_vec(),
            parent_lo: parent_lo_b.written(m).to_vec(),
            page: page_b.written(m).to_vec(),
            num_tokens: num_tokens_b.written(m).to_vec(),
            salt: salt_b.written(m).to_vec(),
            token_ids: token_ids_b.written(d.tokens).to_vec(),
            medium: medium_b.written(m).to_vec(),
        }
    })))
}

/// `Events` drained straight into vectors reserved (fallibly) before the
/// drain for `pending` (events, token ids), as `drained_dict` does for
/// arrays: a MemoryError leaves every event in the pool. Vectors take any
/// count, so a drain that finds more or fewer events than pending is whole.
pub(crate) fn drained_events(
    pending: (usize, usize),
    drain: impl for<'s> FnOnce(EventSink<'s>) -> Drained,
) -> PyResult<kvpool_core::Events> {
    let (n, t) = pending;
    let mut e = kvpool_core::Events::default();
    room(&mut e.kind, n)?;
    room(&mut e.hash_hi, n)?;
    room(&mut e.hash_lo, n)?;
    room(&mut e.parent_hi, n)?;
    room(&mut e.parent_lo, n)?;
    room(&mut e.page, n)?;
    room(&mut e.num_tokens, n)?;
    room(&mut e.salt, n)?;
    room(&mut e.token_ids, t)?;
    room(&mut e.medium, n)?;
    let d = drain(e.spare_sink());
    // SAFETY: `d` is what the drain into `spare_sink` returned.
    unsafe { e.commit_drained(d) };
    Ok(e)
}

/// Room for `n` values in an empty vector, or MemoryError.
pub(crate) fn room<T>(v: &mut Vec<T>, n: usize) -> PyResult<()> {
    v.try_reserve_exact(n).map_err(|_| {
        pyo3::exceptions::PyMemoryError::new_err(format!(
            "cannot allocate {n} drained KV events' {}-byte values",
            std::mem::size_of::<T>()
        ))
    })
}

/// Events a drain kept back, locked for a whole drain (take them or the
/// core's, build the result, keep them again if that fails), so that
/// concurrent drains neither reorder nor overwrite what is kept. Waited
/// for with the GIL released: the holder needs the GIL to build its arrays.
///
/// A drain builds Python objects while it holds the lock, and that can run
/// a finalizer (a garbage collection) on the same thread; a finalizer that
/// drains the same pool would wait for itself forever. It gets a
/// RuntimeError instead, as Python's own buffered files do on a reentrant
/// call.
pub(crate) fn lock_kept<'a>(
    py: Python<'_>,
    kept: &'a Mutex<Option<kvpool_core::Events>>,
) -> PyResult<KeptGuard<'a>> {
    let id = kept as *const _ as usize;
    if DRAINING.with_borrow(|held| held.contains(&id)) {
        return Err(PyRuntimeError::new_err(
            "reentrant take_events: this thread is already draining this pool's KV events \
             (a finalizer that ran during the drain called it); drain from outside __del__",
        ));
    }
    let guard = loop {
        match kept.try_lock() {
            Ok(guard) => break guard,
            Err(TryLockError::Poisoned(e)) => break e.into_inner(),
            Err(TryLockError::WouldBlock) => py.detach(|| {
                drop(kept.lock());
            }),
        }
    };
    DRAINING.with_borrow_mut(|held| held.push(id));
    Ok(KeptGuard { guard, id })
}

thread_local! {
    /// The kept-event locks this thread holds (their addresses): one, or a
    /// few where a finalizer drains another pool during a drain.
    static DRAINING: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// `lock_kept`'s lock: the kept events, and this thread's note that it
/// holds them, dropped together.
pub(crate) struct KeptGuard<'a> {
    guard: MutexGuard<'a, Option<kvpool_core::Events>>,
    id: usize,
}

impl Drop for KeptGuard<'_> {
    fn drop(&mut self) {
        let id = self.id;
        DRAINING.with_borrow_mut(|held| held.retain(|&h| h != id));
    }
}

impl Deref for KeptGuard<'_> {
    type Target = Option<kvpool_core::Events>;
    fn deref(&self) -> &Self::Target {
        &self.guard
    }
}

impl DerefMut for KeptGuard<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.guard
    }
}

impl PySlotAllocator {
    /// The events a failed drain kept back, locked for a whole drain
    /// (`lock_kept`).
    pub(crate) fn undelivered(&self, py: Python<'_>) -> PyResult<KeptGuard<'_>> {
        lock_kept(py, &self.undelivered)
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
    /// what went). The arrays are allocated before anything is drained: a
    /// MemoryError leaves every event in the pool for the next drain.
    ///
    /// Raises:
    ///     RuntimeError: called during a drain of the same pool on the same
    ///         thread (a finalizer that a garbage collection ran inside it).
    fn take_events<'py>(&self, py: Python<'py>) -> Result<Bound<'py, PyDict>> {
        self.drain_dict(py, usize::MAX, usize::MAX)
    }

    /// Test only (not public API): `take_events` with its arrays sized for
    /// at most `events` events and `tokens` token ids, as when an overflow
    /// replaced the backlog between the count and the drain: the oldest
    /// events that fit come back, the rest stay in the pool in order.
    #[cfg(feature = "test-hooks")]
    fn _take_events_sized_for_tests<'py>(
        &self,
        py: Python<'py>,
        events: usize,
        tokens: usize,
    ) -> Result<Bound<'py, PyDict>> {
        self.drain_dict(py, events, tokens)
    }

    /// Test only (not public API): calls `callback()` holding the lock a
    /// drain holds while it builds its arrays, as a finalizer that a
    /// garbage collection runs during a drain would be called.
    #[cfg(feature = "test-hooks")]
    fn _while_draining_for_tests<'py>(
        &self,
        py: Python<'py>,
        callback: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _kept = self.undelivered(py)?;
        callback.call0()
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

impl PySlotAllocator {
    /// `take_events`' dict, its arrays sized for the pending events and
    /// token ids, at most `events` and `tokens` of them.
    fn drain_dict<'py>(
        &self,
        py: Python<'py>,
        events: usize,
        tokens: usize,
    ) -> Result<Bound<'py, PyDict>> {
        // Kept events come from a take_events_msgpack that could not send
        // them, or a short drain whose dict could not be built.
        let mut kept = self.undelivered(py)?;
        let (n, t) = self.query(py, |a| a.pending_events());
        let pending = (n.min(events), t.min(tokens));
        Ok(take_dict(py, &mut kept, pending, |sink| {
            self.run(py, pending.0, |core| core.take_events_into(sink))
        })?)
    }
}
