//! `GroupedAllocator`'s calls that shorten requests in every group: truncate,
//! and roll_back_extend (which keeps the prompt a prefix hit opened them with).

use pyo3::prelude::*;

use crate::convert::{counts_of, int_arg};
use crate::errors::Result;
use crate::grouped::PyGroupedAllocator;

#[pymethods]
impl PyGroupedAllocator {
    /// truncate(handles, lengths) -> None
    ///
    /// Shortens requests to lengths[i] tokens (or lengths for all) in every
    /// group. A sliding group needs the new length's window still held, or
    /// the pages it released still cached (it takes them back); a state
    /// group restores the request's slot from a checkpoint at exactly the
    /// new length (a queued copy; at 0, a queued zeroing). The current
    /// length changes nothing. Atomic.
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    ///     RollbackUnavailableError: a group cannot restore a request at its
    ///         new length (the message names the group and why).
    ///     PoolExhaustedError: a state group needs a fresh slot for a restore
    ///         (a queued copy still reads the request's own) and has none.
    ///     InvalidArgumentError: a length is negative or past the request's
    ///         length, mismatched lengths, duplicate handle.
    fn truncate(
        &self,
        py: Python<'_>,
        handles: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
    ) -> Result<()> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        let l = int_arg(py, lengths, "lengths")?;
        Ok(self.run(py, |c| c.truncate(&h, counts_of(&l)))?)
    }

    /// roll_back_extend(handles, lengths) -> None
    ///
    /// Shortens requests to lengths[i] tokens (or lengths for all) in every
    /// group, as truncate does (the same window and checkpoint rules),
    /// except that each request keeps the prompt it was opened with
    /// (open_with_prefix): the next extend takes the prompt's token ids
    /// again and cache() registers them in every group. For an extend whose
    /// step never ran, or for prefix hits cut back to the batch's shortest.
    /// A state group's slot is the state at the new length, restored from
    /// the checkpoint there. Atomic.
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    ///     RollbackUnavailableError: a group cannot restore a request at its
    ///         new length (the message names the group and why).
    ///     PoolExhaustedError: a state group needs a fresh slot for a restore
    ///         (a queued copy still reads the request's own) and has none.
    ///     InvalidArgumentError: a length is negative or past the request's
    ///         length, mismatched lengths, duplicate handle.
    fn roll_back_extend(
        &self,
        py: Python<'_>,
        handles: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
    ) -> Result<()> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        let l = int_arg(py, lengths, "lengths")?;
        Ok(self.run(py, |c| c.roll_back_extend(&h, counts_of(&l)))?)
    }
}
