//! `GroupedAllocator`'s per-request queries: lengths, table rows, whether a
//! handle is open, known token ids, and each group's slots, pages, page
//! table and state slots of a request.

use pyo3::prelude::*;

use crate::convert::{int_arg, int_scalar};
use crate::errors::Result;
use crate::grouped::PyGroupedAllocator;
use crate::output::{to_numpy, Arr};
use crate::table::Table;

type Triple<'py> = (Arr<'py, i32>, Arr<'py, i32>, Arr<'py, i32>);

#[pymethods]
impl PyGroupedAllocator {
    /// length(handle) -> int
    ///
    /// Tokens the request holds (the same in every group).
    ///
    /// Raises:
    ///     InvalidHandleError: unknown, closed or stale handle.
    fn length(&self, py: Python<'_>, handle: &Bound<'_, PyAny>) -> Result<usize> {
        let h = int_scalar(py, handle, "handle")?;
        Ok(self.run(py, |c| c.length(h))?)
    }

    /// lengths(handles) -> ndarray[int64]
    ///
    /// Tokens each request holds.
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    fn lengths<'py>(&self, py: Python<'py>, handles: &Bound<'py, PyAny>) -> Result<Arr<'py, i64>> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        let v = self.run(py, |c| c.lengths(&h))?;
        Ok(to_numpy(py, &v)?)
    }

    /// rows(handles) -> ndarray[int64]
    ///
    /// Each request's row, the same in every group's request-to-token table.
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    fn rows<'py>(&self, py: Python<'py>, handles: &Bound<'py, PyAny>) -> Result<Arr<'py, i64>> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        let v = self.run(py, |c| c.rows(&h))?;
        Ok(to_numpy(py, &v)?)
    }

    /// is_open(handle) -> bool
    ///
    /// Whether the handle is an open request.
    ///
    /// Raises:
    ///     InvalidArgumentError: handle is not an int.
    fn is_open(&self, py: Python<'_>, handle: &Bound<'_, PyAny>) -> Result<bool> {
        let h = int_scalar(py, handle, "handle")?;
        Ok(self.run(py, |c| c.is_open(h)))
    }

    /// known_tokens(handle) -> ndarray[int32]
    ///
    /// The request's token ids from position 0 as far as they are known.
    ///
    /// Raises:
    ///     InvalidHandleError: unknown, closed or stale handle.
    fn known_tokens<'py>(
        &self,
        py: Python<'py>,
        handle: &Bound<'py, PyAny>,
    ) -> Result<Arr<'py, i32>> {
        let h = int_scalar(py, handle, "handle")?;
        let v = self.run(py, |c| c.known_tokens(h))?;
        Ok(to_numpy(py, &v)?)
    }

    /// slots(handle, group) -> ndarray[int64]
    ///
    /// Every slot of the request in a page group, in token order; positions
    /// a sliding window released read as the null page's slots
    /// (position % page_size, inside the reserved page 0).
    ///
    /// Raises:
    ///     InvalidHandleError: unknown, closed or stale handle.
    ///     InvalidArgumentError: no such group, or a state group.
    fn slots<'py>(
        &self,
        py: Python<'py>,
        handle: &Bound<'py, PyAny>,
        group: &Bound<'py, PyAny>,
    ) -> Result<Arr<'py, i64>> {
        let h = int_scalar(py, handle, "handle")?;
        let g = self.group_arg(py, group)?;
        let v = self.run(py, |c| c.slots(g, h))?;
        Ok(to_numpy(py, &v)?)
    }

    /// pages(handle, group) -> ndarray[int32]
    ///
    /// The request's page list in a page group, in token order (0 where a
    /// sliding window released the page).
    ///
    /// Raises:
    ///     InvalidHandleError: unknown, closed or stale handle.
    ///     InvalidArgumentError: no such group, or a state group.
    fn pages<'py>(
        &self,
        py: Python<'py>,
        handle: &Bound<'py, PyAny>,
        group: &Bound<'py, PyAny>,
    ) -> Result<Arr<'py, i32>> {
        let h = int_scalar(py, handle, "handle")?;
        let g = self.group_arg(py, group)?;
        let v = self.run(py, |c| c.pages(g, h))?;
        Ok(to_numpy(py, &v)?)
    }

    /// page_table(handles, group) -> (indptr, indices, last_page_len)
    ///
    /// FlashInfer's CSR page table of a batch in a page group (int32): each
    /// request's held pages only (a sliding group's window: pass the
    /// window to the kernel, whose mask counts back from the last position),
    /// last_page_len in [1, page_size] (0 for an empty request).
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    ///     InvalidArgumentError: no such group, or a state group.
    fn page_table<'py>(
        &self,
        py: Python<'py>,
        handles: &Bound<'py, PyAny>,
        group: &Bound<'py, PyAny>,
    ) -> Result<Triple<'py>> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        let g = self.group_arg(py, group)?;
        let t = self.run(py, |c| c.page_table(g, &h))?;
        Ok((
            to_numpy(py, &t.indptr)?,
            to_numpy(py, &t.indices)?,
            to_numpy(py, &t.last_page_len)?,
        ))
    }

    /// fill_table(handles, table, group) -> None
    ///
    /// Writes each request's slots in a page group into its row of an int32
    /// request-to-token table (table[row, :length]; the null page's slots
    /// where a window released pages): for requests that got slots without
    /// an extend (open_with_prefix, fork). Checks everything first.
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    ///     InvalidArgumentError: no such group, a state group, a bad table.
    fn fill_table(
        &self,
        py: Python<'_>,
        handles: &Bound<'_, PyAny>,
        table: &Bound<'_, PyAny>,
        group: &Bound<'_, PyAny>,
    ) -> Result<()> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        let g = self.group_arg(py, group)?;
        let slots = self.group_slots(g);
        let t = Table::from_arg(
            py,
            table,
            self.max_requests(),
            self.max_context_len(),
            slots,
        )?;
        Ok(self.run(py, |c| {
            // SAFETY: validated by from_arg; the caller's array is held by
            // the `table` argument until the call returns.
            let mut v = unsafe { t.view() };
            c.fill_table(g, &h, &mut v)
        })?)
    }

    /// state_slots(handles, group) -> ndarray[int64]
    ///
    /// Each request's live state slot in a state group (fixed while it is
    /// open, except that a restore may move it: read it after truncate).
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    ///     InvalidArgumentError: no such group, or a page group.
    fn state_slots<'py>(
        &self,
        py: Python<'py>,
        handles: &Bound<'py, PyAny>,
        group: &Bound<'py, PyAny>,
    ) -> Result<Arr<'py, i64>> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        let g = self.group_arg(py, group)?;
        let v = self.run(py, |c| c.state_slots(g, &h))?;
        Ok(to_numpy(py, &v)?)
    }
}
