//! `GroupedAllocator`'s calls that open requests on shared pages: fork, and
//! open_with_prefix (a prefix hit in every group).

use pyo3::prelude::*;

use crate::convert::{counts_of, int_arg, int_scalar, usize_arg};
use crate::errors::Result;
use crate::grouped::PyGroupedAllocator;
use crate::output::{filled, new_uninit, Arr};
use crate::token_ids::TokenIds;

#[pymethods]
impl PyGroupedAllocator {
    /// fork(handle, n=1) -> ndarray[int64]
    ///
    /// Creates n requests, each a copy of handle's in every group: the same
    /// pages (a shared partly filled page is copied on write), and in a
    /// state group a fresh slot queued to be filled from the parent's.
    /// Atomic.
    ///
    /// Raises:
    ///     InvalidHandleError: the parent is unknown, closed or stale.
    ///     TooManyRequestsError: not enough free rows.
    ///     PoolExhaustedError: a state group has fewer than n free or
    ///         evictable slots.
    ///     InvalidArgumentError: n is negative.
    #[pyo3(signature = (handle, n=None), text_signature = "($self, handle, n=1)")]
    fn fork<'py>(
        &self,
        py: Python<'py>,
        handle: &Bound<'py, PyAny>,
        n: Option<&Bound<'py, PyAny>>,
    ) -> Result<Arr<'py, i64>> {
        let h = int_scalar(py, handle, "handle")?;
        let n = match n {
            None => 1,
            Some(n) => usize_arg(py, n, "n")?,
        };
        // Allocated first: a MemoryError once the forks are open would lose them.
        let (arr, buf) = new_uninit::<i64>(py, n.min(self.max_requests()))?;
        let v = self.run(py, |c| c.fork(h, n))?;
        Ok(filled(py, arr, buf, &v)?)
    }

    /// open_with_prefix(tokens, lengths, salt=None) -> (handles, cached_lens)
    ///
    /// Opens one request per prompt on the longest prefix every group has
    /// cached (a multiple of hit_step, at most length - 1): full groups'
    /// pages for [0, L), sliding groups' window before L, state groups'
    /// checkpoint at L, each verified through the anchor chain so that a
    /// hash collision costs a miss, never another prompt's K/V or state. A
    /// state group's slot is queued to be filled from the checkpoint (zeroed
    /// when cached_len is 0). Atomic.
    ///
    /// Args:
    ///     tokens: the prompts' token ids concatenated (ints in [0, 2^31)).
    ///     lengths: each prompt's length.
    ///     salt: None (0), an int for all, or one int per prompt.
    ///
    /// Raises:
    ///     InvalidArgumentError: tokens and lengths disagree, a negative length,
    ///         a token id out of range, a salt of the wrong type or count.
    ///     ContextTooLongError: a prompt longer than max_context_len.
    ///     TooManyRequestsError: not enough free rows.
    ///     PoolExhaustedError: a state group has no slot for each request.
    #[pyo3(signature = (tokens, lengths, salt=None))]
    fn open_with_prefix<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        lengths: &Bound<'py, PyAny>,
        salt: Option<&Bound<'py, PyAny>>,
    ) -> Result<(Arr<'py, i64>, Arr<'py, i64>)> {
        let t = TokenIds::extract(py, tokens)?;
        let l = int_arg(py, lengths, "lengths")?.into_vec();
        let s = match salt {
            None => crate::convert::IntArg::Scalar(0),
            Some(s) => int_arg(py, s, "salt")?,
        };
        // Allocated first: a MemoryError once the requests are open would lose them.
        let n = l.len().min(self.max_requests());
        let ((ha, hb), (ca, cb)) = (new_uninit::<i64>(py, n)?, new_uninit::<i64>(py, n)?);
        let (h, c) = self.run(py, |core| core.open_with_prefix(&t, &l, counts_of(&s)))?;
        Ok((filled(py, ha, hb, &h)?, filled(py, ca, cb, &c)?))
    }
}
