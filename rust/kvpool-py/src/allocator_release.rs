//! `SlotAllocator`'s calls that give pages back: truncate, roll_back_extend
//! (which keeps the prompt a prefix hit opened the request with) and close.
//! Each may free every page its requests hold, so each runs with the GIL
//! released whatever the batch's size.

use pyo3::prelude::*;

use crate::allocator::PySlotAllocator;
use crate::convert::{counts_of, int_arg, CacheFlag};
use crate::errors::Result;
use crate::retention_args::Retention;

#[pymethods]
impl PySlotAllocator {
    /// truncate(handles, lengths) -> None
    ///
    /// Shortens requests to lengths[i] tokens (or `lengths` for all), freeing
    /// pages no longer needed. A request shortened to inside the prompt it was
    /// opened with (open_with_prefix) forgets the prompt from there: later
    /// positions take the token ids extend is given (or are unknown), and
    /// cache() registers what they hold. Atomic.
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    ///     RequestSwappedOutError: a request is swapped out.
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
        // Frees up to every page of every request: work the handle count does
        // not bound, so always with the GIL released.
        Ok(py.detach(|| self.lock().truncate(&h, counts_of(&l)))?)
    }

    /// roll_back_extend(handles, lengths) -> None
    ///
    /// Shortens requests back to the lengths they had before an extend whose
    /// step never ran (a table update that failed after the extend
    /// committed), as truncate does, except that each request keeps the
    /// prompt it was opened with (open_with_prefix): a retried extend takes
    /// the prompt's token ids again and cache() can register them. Pages the
    /// extend evicted stay evicted, and a copy-on-write copy it made stays
    /// the request's page. Atomic.
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, closed or stale.
    ///     RequestSwappedOutError: a request is swapped out.
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
        Ok(py.detach(|| self.lock().roll_back_extend(&h, counts_of(&l)))?)
    }

    /// close(handles, cache=False, priority=None, retain_s=None) -> None
    ///
    /// Closes requests and releases their pages; their handles become stale.
    /// With cache=True, first registers each request's full pages of known
    /// tokens in the prefix cache (as cache()), so they stay reusable, with
    /// cache()'s priority and retain_s if given. A swapped-out request
    /// releases its host pages too. Atomic.
    ///
    /// Raises:
    ///     InvalidHandleError: a handle is unknown, already closed or stale.
    ///     RequestSwappedOutError: cache=True for a swapped-out request.
    ///     InvalidArgumentError: a duplicate handle; a priority or retain_s
    ///         as cache() refuses them, or given without cache=True.
    #[pyo3(
        signature = (handles, cache=CacheFlag(false), priority=None, retain_s=None),
        text_signature = "($self, handles, cache=False, priority=None, retain_s=None)"
    )]
    fn close(
        &self,
        py: Python<'_>,
        handles: &Bound<'_, PyAny>,
        cache: CacheFlag,
        priority: Option<&Bound<'_, PyAny>>,
        retain_s: Option<&Bound<'_, PyAny>>,
    ) -> Result<()> {
        let h = int_arg(py, handles, "handles")?.into_vec();
        let cache = cache.0;
        let r = Retention::of(py, priority, retain_s)?;
        // As truncate: each request may hold many pages (and cache=True
        // hashes them all).
        match r {
            None => Ok(py.detach(|| self.lock().close(&h, cache))?),
            Some(_) if !cache => Err(crate::errors::invalid_argument(
                py,
                "priority and retain_s apply to the pages close caches: pass cache=True with them",
            )
            .into()),
            Some(r) => {
                Ok(py.detach(|| self.lock().close_with_priority(&h, r.counts(), r.retain_s))?)
            }
        }
    }
}
