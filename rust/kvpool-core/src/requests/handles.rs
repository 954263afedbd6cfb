//! Handles to rows: resolving a handle (and saying why one does not
//! resolve), and the batch stamp that catches a handle named twice.

use super::row::OPEN;
use super::Requests;
use crate::error::{HandleProblem, PoolError, Result};
use crate::handle::{handle_generation, handle_row, steps_from};

impl Requests {
    /// Row of an open request, or why `handle` does not name one.
    #[inline]
    pub(crate) fn resolve(&self, handle: i64) -> Result<usize> {
        let row = handle_row(handle) as usize;
        match self.rows.get(row) {
            Some(r) if handle >= 0 && r.generation == handle_generation(handle) | OPEN => Ok(row),
            _ => Err(self.why_invalid(handle)),
        }
    }

    /// Classifies a handle that `resolve` rejected (off the hot path).
    #[cold]
    pub(crate) fn why_invalid(&self, handle: i64) -> PoolError {
        let row = handle_row(handle) as usize;
        let g = handle_generation(handle);
        let problem = match self.rows.get(row) {
            Some(r) if handle >= 0 && g != 0 => {
                let cur = r.generation & !OPEN;
                let base = self.generation_base;
                if cur == 0 {
                    HandleProblem::Unknown // the row never held a request
                } else if g == cur {
                    HandleProblem::Closed
                } else if steps_from(base, g) < steps_from(base, cur) {
                    // Issued on this row before: the row was reused since.
                    HandleProblem::Stale
                } else {
                    HandleProblem::Unknown
                }
            }
            _ => HandleProblem::Unknown,
        };
        PoolError::InvalidHandle { handle, problem }
    }

    /// Starts a batch for duplicate detection with [`Self::resolve_unique`].
    pub(crate) fn begin_batch(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            // Stamps from 2^32 batches ago could collide: clear once per wrap.
            self.rows.iter_mut().for_each(|r| r.stamp = 0);
            self.epoch = 1;
        }
    }

    /// Like `resolve`, and rejects a handle named twice in the same batch.
    #[inline]
    pub(crate) fn resolve_unique(&mut self, handle: i64, i: usize) -> Result<usize> {
        let row = self.resolve(handle)?;
        let r = &mut self.rows[row];
        if r.stamp == self.epoch {
            return Err(PoolError::InvalidArgument(format!(
                "handle {handle} appears more than once in the batch (again at index {i}); \
                 name each request once (extend: once, with its total count)"
            )));
        }
        r.stamp = self.epoch;
        Ok(row)
    }

    /// Validates and stamps every handle of a batch (no duplicates).
    pub(crate) fn resolve_batch(&mut self, handles: &[i64]) -> Result<()> {
        self.begin_batch();
        for (i, &h) in handles.iter().enumerate() {
            self.resolve_unique(h, i)?;
        }
        Ok(())
    }
}
