//! `SlotAllocator.admit`: open new requests and extend them by their prompt
//! lengths in one crossing (the core's `admit_into`), with the same `table=`,
//! `tokens=` and `out=` as extend.

use pyo3::prelude::*;

use crate::allocator::PySlotAllocator;
use crate::convert::{int_arg, IntArg};
use crate::errors::{invalid_argument, Result};
use crate::extend::{tokens_arg, Dest};
use crate::output::Arr;
use crate::output::{counts_total, filled, new_i64, new_uninit};
use crate::packed::PackedHead;

#[pymethods]
impl PySlotAllocator {
    /// admit(counts, table=None, tokens=None, out=None) -> (handles, slots)
    ///
    /// Opens len(counts) new requests and extends request i by counts[i]
    /// tokens: open(len(counts)) followed by extend(handles, counts, ...),
    /// in one call, as a scheduler step admits its new requests. Atomic: on
    /// any error no request is opened and nothing changes.
    ///
    /// Args:
    ///     counts: one int >= 0 per new request (a sequence or 1-D integer
    ///         array; a single int is refused: pass [n] for one request).
    ///     table, tokens, out: as in extend (table rows of the new requests
    ///         get their slots; tokens are the prompts' ids, flattened; out
    ///         receives the slots, kept from step to step).
    ///
    /// Returns:
    ///     (handles, slots): the int64 handles, and the new slots flattened in
    ///     request order (with out=, out itself: the slots are its first
    ///     sum(counts) entries).
    ///
    /// Raises:
    ///     TooManyRequestsError: fewer than len(counts) rows are free.
    ///     PoolExhaustedError: not enough free or evictable pages.
    ///     ContextTooLongError: a count is past max_context_len.
    ///     InvalidArgumentError: counts is not a sequence of ints >= 0, or a
    ///         bad table, tokens or out (as in extend).
    #[pyo3(signature = (counts, table=None, tokens=None, out=None))]
    fn admit<'py>(
        &self,
        py: Python<'py>,
        counts: &Bound<'py, PyAny>,
        table: Option<&Bound<'py, PyAny>>,
        tokens: Option<&Bound<'py, PyAny>>,
        out: Option<&Bound<'py, PyAny>>,
    ) -> Result<(Py<PyAny>, Py<PyAny>)> {
        let c = counts_arg(py, counts)?;
        let toks = tokens_arg(py, tokens)?;
        let t = self.table_arg(py, table)?;
        let total = counts_total(&c, self.num_slots, self.max_context_len);
        let (fresh, mut dest) = Dest::new(py, out, total, t.as_ref())?;
        // Allocated before any request opens (see `open`).
        let (harr, hbuf) = new_uninit::<i64>(py, c.len().min(self.max_requests))?;
        let mut handles = Vec::new();
        let work = c.len().max(total);
        self.run(py, work, |core| {
            // SAFETY: validated by `table_arg`; the caller's array is
            // referenced for the whole call (see extend).
            let mut view = t.as_ref().map(|t| unsafe { t.view() });
            dest.apply(|dst| {
                core.admit_into(
                    &c,
                    toks.as_deref(),
                    dst,
                    view.as_mut(),
                    &mut handles,
                    |_| {},
                )
            })
        })?;
        let slots = Dest::result(py, fresh, out);
        let handles = filled(py, harr, hbuf, &handles)?;
        Ok((handles.into_any().unbind(), slots.unbind()))
    }

    /// admit_packed(counts, tokens=None) -> (handles, packed, b)
    ///
    /// admit, returning the new requests' table update in extend_packed's
    /// form (packed = [rows | starts | counts | offsets] then the slots), so
    /// that one host-to-device copy ships it. Atomic: on any error no
    /// request is opened and nothing changes.
    ///
    /// Raises:
    ///     the same errors as admit; nothing changes on any error.
    #[pyo3(signature = (counts, tokens=None))]
    fn admit_packed<'py>(
        &self,
        py: Python<'py>,
        counts: &Bound<'py, PyAny>,
        tokens: Option<&Bound<'py, PyAny>>,
    ) -> Result<(Arr<'py, i64>, Arr<'py, i64>, usize)> {
        let c = counts_arg(py, counts)?;
        let toks = tokens_arg(py, tokens)?;
        let b = c.len();
        let total = counts_total(&c, self.num_slots, self.max_context_len);
        let (arr, mut out) = new_i64(py, PackedHead::len(b) + total)?;
        let (harr, hbuf) = new_uninit::<i64>(py, b.min(self.max_requests))?;
        let mut handles = Vec::new();
        self.run(py, b.max(total), |core| {
            // SAFETY: `arr` is alive and not yet shared (see OutBuf).
            let (mut head, dst) = PackedHead::split(unsafe { out.slice() }, b);
            core.admit_into(&c, toks.as_deref(), dst, None, &mut handles, |g| {
                head.note(g)
            })
        })?;
        Ok((filled(py, harr, hbuf, &handles)?, arr, b))
    }
}

/// admit's counts: one int per new request. A single int is refused: it
/// could mean one request or a count for each of some number of them.
pub(crate) fn counts_arg(py: Python<'_>, counts: &Bound<'_, PyAny>) -> Result<Vec<i64>> {
    match int_arg(py, counts, "counts")? {
        IntArg::Many(v) => Ok(v),
        IntArg::Scalar(v) if v < 0 => Err(invalid_argument(
            py,
            format!("admit takes one count (>= 0) per new request, got the single int {v}"),
        )
        .into()),
        IntArg::Scalar(v) => Err(invalid_argument(
            py,
            format!(
                "admit takes one count per new request, got the single int {v}: \
                 pass [{v}] to admit one request"
            ),
        )
        .into()),
    }
}
