//! The growing side: extend. The whole batch is validated first
//! (`prepare_extend`); the commit pass after it cannot fail on caller input.
//!
//! A request's new pages are the top entries of the free stack, taken in pop
//! order (top first) with one truncate of the stack instead of a pop per page,
//! and its slots are written as whole-page runs: the per-slot work is a tight
//! loop that the compiler vectorizes, and the page size 1 case (one page per
//! token) is one pass over the taken pages.

use crate::allocator::{Counts, SlotAllocator};
use crate::error::{PoolError, Result};
use crate::handle::handle_row;

/// Writes `first, first + 1, ...` into `dst` (the slots of one page run).
#[inline]
fn fill_run(dst: &mut [i64], first: usize) {
    if let [d] = dst {
        // The decode step's single slot: skip the vector loop's set-up.
        *d = first as i64;
        return;
    }
    for (j, d) in dst.iter_mut().enumerate() {
        *d = (first + j) as i64;
    }
}

impl SlotAllocator {
    /// Appends `counts[i]` tokens to request `handles[i]` and returns the new
    /// slot ids, flattened in request order. All-or-nothing.
    pub fn extend(&mut self, handles: &[i64], counts: Counts<'_>) -> Result<Vec<i64>> {
        let total = self.prepare_extend(handles, counts)?;
        let mut out = vec![0; total];
        self.commit_extend(handles, counts, &mut out, |_, _, _, _| {})?;
        Ok(out)
    }

    /// Like [`Self::extend`], also returning each request's length before the call.
    pub fn extend_with_starts(
        &mut self,
        handles: &[i64],
        counts: Counts<'_>,
    ) -> Result<(Vec<i64>, Vec<i64>)> {
        let total = self.prepare_extend(handles, counts)?;
        let mut out = vec![0; total];
        let mut starts = Vec::with_capacity(handles.len());
        self.commit_extend(handles, counts, &mut out, |_, _, start, _| {
            starts.push(start as i64)
        })?;
        Ok((out, starts))
    }

    /// Like [`Self::extend`], writing the new slots into `out`, which must
    /// have exactly as many entries as the batch adds (the sum of the counts;
    /// otherwise `InvalidArgument`, after the batch's own checks, with nothing
    /// changed). Lets a caller write straight into a buffer it allocated once.
    ///
    /// `on_request(i, row, start, slots)` runs once per request, in batch
    /// order, right after request `i` grew: `row` is its row, `start` its
    /// length before the call and `slots` its new slots (the part of `out`
    /// just written, still in cache), e.g. to copy into a request-to-token
    /// table at `[row, start..]`.
    pub fn extend_into<F>(
        &mut self,
        handles: &[i64],
        counts: Counts<'_>,
        out: &mut [i64],
        on_request: F,
    ) -> Result<()>
    where
        F: FnMut(usize, usize, usize, &[i64]),
    {
        let total = self.prepare_extend(handles, counts)?;
        if total != out.len() {
            return Err(PoolError::InvalidArgument(format!(
                "output has {} entries but the batch adds {total} slots",
                out.len()
            )));
        }
        self.commit_extend(handles, counts, out, on_request)
    }

    /// Validates a whole extend batch without changing the pool; returns the
    /// number of slots it adds.
    fn prepare_extend(&mut self, handles: &[i64], counts: Counts<'_>) -> Result<usize> {
        counts.check_len("counts", handles.len())?;
        self.begin_batch();
        let mut needed_pages = 0usize;
        let mut total_tokens = 0usize;
        for (i, &h) in handles.iter().enumerate() {
            let row = self.resolve_unique(h, i)?;
            let c = counts.get(i);
            if c < 0 {
                return Err(PoolError::InvalidArgument(format!(
                    "counts[{i}] = {c} is negative; counts must be >= 0"
                )));
            }
            let req = &self.requests[row];
            let new_len = req.len as u64 + c as u64;
            if new_len > self.max_context_len as u64 {
                return Err(PoolError::ContextTooLong {
                    handle: h,
                    length: new_len,
                    max: self.max_context_len,
                });
            }
            needed_pages += self.pages_for(new_len as usize) - req.pages.len();
            total_tokens += c as usize;
        }
        if needed_pages > self.free_pages.len() {
            return Err(PoolError::Exhausted {
                needed_pages,
                free_pages: self.free_pages.len(),
                page_size: self.page_size,
                free_slots: self.free_pages.len() * self.page_size,
            });
        }
        Ok(total_tokens)
    }

    /// Grows every request of a batch that `prepare_extend` accepted; `out`
    /// holds exactly its slots.
    fn commit_extend<F>(
        &mut self,
        handles: &[i64],
        counts: Counts<'_>,
        out: &mut [i64],
        mut on_request: F,
    ) -> Result<()>
    where
        F: FnMut(usize, usize, usize, &[i64]),
    {
        let (ps, shift) = (self.page_size, self.page_shift);
        let mut k = 0usize;
        for (i, &h) in handles.iter().enumerate() {
            let row = handle_row(h) as usize;
            let c = counts.get(i) as usize;
            let Some(dst) = out.get_mut(k..k + c) else {
                return Err(PoolError::Invariant(
                    "extend output shorter than validated".into(),
                ));
            };
            k += c;
            let req = &mut self.requests[row];
            let start = req.len;
            // Slots left in the last page (0 when it is full or absent) come first.
            let room = req.pages.len() * ps - start;
            let (head, rest) = dst.split_at_mut(room.min(c));
            if let (Some(&last), false) = (req.pages.last(), head.is_empty()) {
                fill_run(head, last as usize * ps + (ps - room));
            }
            let new_pages = match shift {
                Some(s) => (rest.len() + ps - 1) >> s,
                None => rest.len().div_ceil(ps),
            };
            if new_pages == 1 {
                // The decode step's case: a plain pop is cheaper than slicing.
                let Some(p) = self.free_pages.pop() else {
                    return Err(PoolError::Invariant(
                        "free stack ran out after validation".into(),
                    ));
                };
                self.owner[p as usize] = row as u32;
                req.pages.push(p);
                fill_run(rest, p as usize * ps);
            } else if new_pages > 1 {
                let Some(base) = self.free_pages.len().checked_sub(new_pages) else {
                    return Err(PoolError::Invariant(
                        "free stack ran out after validation".into(),
                    ));
                };
                // The stack's top is handed out first, so walk the taken part
                // top-down: the same order as popping one page at a time.
                let taken = &self.free_pages[base..];
                if ps == 1 {
                    for (d, &p) in rest.iter_mut().zip(taken.iter().rev()) {
                        *d = p as i64;
                        self.owner[p as usize] = row as u32;
                    }
                } else {
                    for (run, &p) in rest.chunks_mut(ps).zip(taken.iter().rev()) {
                        self.owner[p as usize] = row as u32;
                        fill_run(run, p as usize * ps);
                    }
                }
                req.pages.extend(taken.iter().rev());
                self.free_pages.truncate(base);
            }
            req.len = start + c;
            on_request(i, row, start, dst);
        }
        Ok(())
    }
}
