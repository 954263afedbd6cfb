//! `SlotAllocator`'s per-request queries: lengths, slots, pages, FlashInfer's
//! page table, table rows and whether a handle is open.

use kvpool_core::SlotAllocator;
use pyo3::prelude::*;

use crate::allocator::PySlotAllocator;
use crate::convert::{int_arg, int_scalar};
use crate::errors::Result;
use crate::output::{new_uninit, to_numpy, Arr};

impl PySlotAllocator {
    /// One int64 per handle (`lengths`, `rows`), into an array allocated
    /// first, the core answering a chunk at a time: the only allocation the
    /// batch's size sets is the result's own, so a batch too big for memory
    /// is a MemoryError. The chunks run under one lock, as one call.
    fn per_handle<'py>(
        &self,
        py: Python<'py>,
        handles: &[i64],
        query: fn(&SlotAllocator, &[i64]) -> kvpool_core::Result<Vec<i64>>,
    ) -> Result<Arr<'py, i64>> {
        const CHUNK: usize = 1024;
        let (arr, mut buf) = new_uninit::<i64>(py, handles.len())?;
        py.detach(|| {
            let core = self.lock();
            for (k, h) in handles.chunks(CHUNK).enumerate() {
                // SAFETY: `arr` is alive and not yet shared.
                unsafe { buf.write(k * CHUNK, &query(&core, h)?) };
            }
            Ok::<_, kvpool_core::PoolError>(())
        })?;
        // Every entry written: the core answers one value per handle.
        Ok(arr)
    }
}

#[pymethods]
impl PySlotAllocator {
    /// length(handle) -> int
    ///
    /// Tokens the request holds.
    ///
    /// Raises:
    ///     InvalidHandleError: unknown, closed or stale handle.
    fn length(&self, py: Python<'_>, handle: &Bound<'_, PyAny>) -> Result<usize> {
        let h = int_scalar(py, handle, "handle")?;
        Ok(self.query(py, |a| a.length(h))?)
    }

    /// lengths(handles) -> ndarray[int64]
    ///
    /// Tokens each request holds.
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    fn lengths<'py>(&self, py: Python<'py>, handles: &Bound<'py, PyAny>) -> Result<Arr<'py, i64>> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        self.per_handle(py, &h, SlotAllocator::lengths)
    }

    /// slots(handle) -> ndarray[int64]
    ///
    /// Every slot of the request, in token order.
    ///
    /// Raises:
    ///     InvalidHandleError: unknown, closed or stale handle.
    ///     RequestSwappedOutError: the request is swapped out.
    fn slots<'py>(&self, py: Python<'py>, handle: &Bound<'py, PyAny>) -> Result<Arr<'py, i64>> {
        let h = int_scalar(py, handle, "handle")?;
        let v = py.detach(|| self.lock().slots(h))?;
        Ok(to_numpy(py, &v)?)
    }

    /// pages(handle) -> ndarray[int32]
    ///
    /// The pages the request holds, in token order.
    ///
    /// Raises:
    ///     InvalidHandleError: unknown, closed or stale handle.
    ///     RequestSwappedOutError: the request is swapped out.
    fn pages<'py>(&self, py: Python<'py>, handle: &Bound<'py, PyAny>) -> Result<Arr<'py, i32>> {
        let h = int_scalar(py, handle, "handle")?;
        let v = py.detach(|| self.lock().pages(h))?;
        Ok(to_numpy(py, &v)?)
    }

    /// page_table(handles) -> (indptr, indices, last_page_len)
    ///
    /// FlashInfer's CSR page table of a batch (int32 arrays): request i's pages
    /// are indices[indptr[i]:indptr[i+1]]; last_page_len[i] in [1, page_size]
    /// (0 for an empty request).
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    ///     RequestSwappedOutError: a request is swapped out.
    fn page_table<'py>(
        &self,
        py: Python<'py>,
        handles: &Bound<'py, PyAny>,
    ) -> Result<(Arr<'py, i32>, Arr<'py, i32>, Arr<'py, i32>)> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        let t = py.detach(|| self.lock().page_table(&h))?;
        Ok((
            to_numpy(py, &t.indptr)?,
            to_numpy(py, &t.indices)?,
            to_numpy(py, &t.last_page_len)?,
        ))
    }

    /// rows(handles) -> ndarray[int64]
    ///
    /// Each request's row of a request-to-token table (fixed while it is open).
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    fn rows<'py>(&self, py: Python<'py>, handles: &Bound<'py, PyAny>) -> Result<Arr<'py, i64>> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        self.per_handle(py, &h, SlotAllocator::rows)
    }

    /// is_open(handle) -> bool
    ///
    /// Whether the handle is an open request (False for closed or stale ones).
    ///
    /// Raises:
    ///     InvalidArgumentError: handle is not an int.
    fn is_open(&self, py: Python<'_>, handle: &Bound<'_, PyAny>) -> Result<bool> {
        let h = int_scalar(py, handle, "handle")?;
        Ok(self.query(py, |a| a.is_open(h)))
    }
}
