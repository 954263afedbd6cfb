//! The host tier's part of `SlotAllocator`: the transfer queues
//! (`take_offloads`, `take_loads`), swapping requests out and in, and the
//! tier's counters (its constructor argument: `tier_args.rs`).

use kvpool_core::{HostPolicy, SlotAllocator};
use pyo3::prelude::*;

use crate::allocator::PySlotAllocator;
use crate::convert::{int_arg, int_scalar};
use crate::errors::Result;
use crate::output::{new_uninit, Arr};

type Pair<'py> = (Arr<'py, i64>, Arr<'py, i64>);

impl PySlotAllocator {
    /// Drains one transfer queue into two int64 arrays allocated first, so
    /// a MemoryError leaves every transfer queued. Another thread may queue
    /// more between the count and the drain: then count again.
    fn drain<'py>(
        &self,
        py: Python<'py>,
        pending: fn(&SlotAllocator) -> usize,
        take: fn(&mut SlotAllocator) -> (Vec<i64>, Vec<i64>),
    ) -> Result<Pair<'py>> {
        loop {
            let n = self.query(py, pending);
            let (a, mut a_buf) = new_uninit::<i64>(py, n)?;
            let (b, mut b_buf) = new_uninit::<i64>(py, n)?;
            let taken = self.run(py, n, |core| {
                if pending(core) != n {
                    return false;
                }
                let (x, y) = take(core);
                // SAFETY: both arrays are alive and not yet shared; n each.
                unsafe {
                    a_buf.write(0, &x);
                    b_buf.write(0, &y);
                }
                true
            });
            if taken {
                return Ok((a, b));
            }
        }
    }
}

#[pymethods]
impl PySlotAllocator {
    /// take_offloads() -> (device_pages, host_pages)
    ///
    /// Drains the queued offloads (int64 page ids, oldest first): copy every
    /// layer's K and V of device page device_pages[i] to host page
    /// host_pages[i]. Before a step's K/V writes, run the offloads, then
    /// take_loads(), then take_copies(), in that order. Each host page stays
    /// pinned (never reused or evicted) until its offload is taken here; a
    /// device page an offload reads may already be handed out again (as a
    /// load's or copy's destination, or to a new holder), which the order
    /// makes safe. Empty without a host tier.
    fn take_offloads<'py>(&self, py: Python<'py>) -> Result<Pair<'py>> {
        self.drain(
            py,
            SlotAllocator::pending_offloads,
            SlotAllocator::take_offloads,
        )
    }

    /// take_loads() -> (host_pages, device_pages)
    ///
    /// Drains the queued loads (int64 page ids, oldest first): copy host page
    /// host_pages[i] into device page device_pages[i], after the offloads and
    /// before the copies (see take_offloads). Each host page stays pinned
    /// until its load is taken here. Empty without a host tier.
    fn take_loads<'py>(&self, py: Python<'py>) -> Result<Pair<'py>> {
        self.drain(py, SlotAllocator::pending_loads, SlotAllocator::take_loads)
    }

    /// swap_out(handles) -> None
    ///
    /// Moves each request's pages that it holds alone to host pages (queued
    /// offloads, take_offloads) and frees their device pages (a registered
    /// page stays cached on the device, its entry on both tiers). Shared
    /// pages, and pages a queued load or copy has yet to fill, stay on the
    /// device, still held by the request. The request keeps its handle,
    /// length and known tokens; extend, truncate, fork, cache and its slots,
    /// pages and page table raise RequestSwappedOutError until swap_in.
    /// Atomic.
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    ///     RequestSwappedOutError: a request is swapped out already.
    ///     PoolExhaustedError: fewer free or evictable host pages than pages
    ///         to move (nothing moved).
    ///     InvalidArgumentError: a duplicate handle; no host tier.
    fn swap_out(&self, py: Python<'_>, handles: &Bound<'_, PyAny>) -> Result<()> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        Ok(py.detach(|| self.lock().swap_out(&h))?)
    }

    /// swap_in(handles) -> None
    ///
    /// Brings swapped-out requests back: for each of their host pages, the
    /// entry's device copy where it is still there (re-taken, no load), else a
    /// device page (evicting cached pages as extend does) and a queued load
    /// (take_loads); a host page is let go when re-taken or its load taken.
    /// After the loads, every position holds bitwise the K/V it held before
    /// swap_out, except a registered page whose entry's copy a duplicate
    /// registration of the same tokens replaced meanwhile: it comes back as
    /// that copy, the K/V a prefix hit would give. Atomic: all requests come
    /// back or none.
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    ///     PoolExhaustedError: not enough free or evictable device pages
    ///         (needed vs free; nothing changed).
    ///     InvalidArgumentError: a duplicate handle; a request that is not
    ///         swapped out; no host tier.
    fn swap_in(&self, py: Python<'_>, handles: &Bound<'_, PyAny>) -> Result<()> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        Ok(py.detach(|| self.lock().swap_in(&h))?)
    }

    /// is_swapped(handle) -> bool
    ///
    /// Whether the request is swapped out (swap_out, and no swap_in since).
    ///
    /// Raises:
    ///     InvalidHandleError: unknown, closed or stale handle.
    fn is_swapped(&self, py: Python<'_>, handle: &Bound<'_, PyAny>) -> Result<bool> {
        let h = int_scalar(py, handle, "handle")?;
        Ok(self.query(py, |a| a.is_swapped(h))?)
    }

    /// The host tier's policy: "write_back" or "write_through" (None without a tier).
    #[getter]
    fn host_policy(&self, py: Python<'_>) -> Option<&'static str> {
        self.query(py, |a| {
            a.host_policy().map(|p| match p {
                HostPolicy::WriteBack => "write_back",
                HostPolicy::WriteThrough => "write_through",
            })
        })
    }
    /// Host pages an offload or a swap_out can take now: free + cached (evictable).
    #[getter]
    fn host_free_pages(&self, py: Python<'_>) -> usize {
        self.query(py, SlotAllocator::host_free_pages)
    }
    /// Host pages holding a registered page's copy (held or not).
    #[getter]
    fn host_cached_pages(&self, py: Python<'_>) -> usize {
        self.query(py, SlotAllocator::host_cached_pages)
    }
    /// Prompt tokens open_with_prefix served from host copies, part of hit_tokens (cumulative).
    #[getter]
    fn host_hit_tokens(&self, py: Python<'_>) -> u64 {
        self.query(py, SlotAllocator::host_hit_tokens)
    }
    /// Pages handed out by take_offloads (cumulative; times a page's bytes: bytes offloaded).
    #[getter]
    fn offloaded_pages(&self, py: Python<'_>) -> u64 {
        self.query(py, SlotAllocator::offloaded_pages)
    }
    /// Pages handed out by take_loads (cumulative; times a page's bytes: bytes loaded).
    #[getter]
    fn loaded_pages(&self, py: Python<'_>) -> u64 {
        self.query(py, SlotAllocator::loaded_pages)
    }
    /// Offloads queued and not yet taken.
    #[getter]
    fn pending_offloads(&self, py: Python<'_>) -> usize {
        self.query(py, SlotAllocator::pending_offloads)
    }
    /// Loads queued and not yet taken.
    #[getter]
    fn pending_loads(&self, py: Python<'_>) -> usize {
        self.query(py, SlotAllocator::pending_loads)
    }
}
