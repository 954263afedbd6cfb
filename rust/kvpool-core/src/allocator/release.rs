//! The freeing side: truncate (and an extend's roll-back), close and reset. A request lets go of its
//! pages last-first: FREE pages then come back off the stack in their old
//! order, and CACHED tail pages end up older in the LRU than their parents,
//! so eviction takes a chain's tail first (as vLLM frees in reverse order).

use super::options::Counts;
use super::SlotAllocator;
use crate::error::{PoolError, Result};
use crate::handle::handle_row;

impl SlotAllocator {
    /// Shortens each request to `lengths[i]` tokens (<= its current length),
    /// releasing pages past the new end. Truncating into a page that others
    /// (or the cache) hold makes it copy-on-write for the next extend.
    /// A request shortened to inside its prompt (`open_with_prefix`) forgets
    /// the prompt from there: later positions take the token ids extend is
    /// given (or are unknown), and `cache` registers what they hold. The
    /// current length as the new one changes nothing.
    /// All-or-nothing. Errors: `InvalidHandle`, `InvalidArgument`,
    /// `RequestSwappedOut`.
    pub fn truncate(&mut self, handles: &[i64], lengths: Counts<'_>) -> Result<()> {
        self.shorten(handles, lengths, true)
    }

    /// Shortens requests back to the lengths they had before an extend whose
    /// step never ran (the caller's table update failed after the extend
    /// committed), as [`Self::truncate`] does, except that each keeps the
    /// prompt it was opened with: the positions given back are still that
    /// prompt's, so a retried extend takes its token ids again and `cache`
    /// can register them. All-or-nothing; the errors of `truncate`.
    pub fn roll_back_extend(&mut self, handles: &[i64], lengths: Counts<'_>) -> Result<()> {
        self.shorten(handles, lengths, false)
    }

    fn shorten(&mut self, handles: &[i64], lengths: Counts<'_>, forget_prompt: bool) -> Result<()> {
        lengths.check_len("lengths", handles.len())?;
        self.requests.begin_batch();
        for (i, &h) in handles.iter().enumerate() {
            let row = self.requests.resolve_unique(h, i)?;
            self.requests.check_resident(row, h)?;
            let l = lengths.get(i);
            let cur = self.requests.len(row);
            if l < 0 || l as u64 > cur as u64 {
                return Err(PoolError::InvalidArgument(format!(
                    "lengths[{i}] = {l} for handle {h} must be in [0, {cur}] (its current length); \
                     truncate only shortens"
                )));
            }
        }
        for (i, &h) in handles.iter().enumerate() {
            let row = handle_row(h) as usize;
            let l = lengths.get(i) as usize;
            if forget_prompt && l < self.requests.len(row) {
                // Rolled back (an edited turn, a retried call, rejected
                // draft tokens): what follows need not be the prompt.
                self.requests.truncate_prompt(row, l);
            }
            self.shrink_row(row, l);
        }
        Ok(())
    }

    /// Closes each request, releasing its pages; the handles become invalid.
    /// With `cache`, first registers each request's full pages of known
    /// tokens (as [`Self::cache`]), so they stay reusable as CACHED pages.
    /// A swapped-out request releases its host pages too. All-or-nothing.
    /// Errors: `InvalidHandle`, `InvalidArgument` (a handle twice; the
    /// prefix index cannot grow), `RequestSwappedOut` (`cache` of a
    /// swapped-out request).
    pub fn close(&mut self, handles: &[i64], cache: bool) -> Result<()> {
        self.requests.resolve_batch(handles)?;
        if cache {
            self.register_batch(handles)?;
        }
        for &h in handles {
            self.close_row(handle_row(h) as usize);
        }
        Ok(())
    }

    /// Closes every open request (nothing registered). Costs
    /// O(max_requests + pages held).
    pub fn reset(&mut self) {
        for row in 0..self.requests.capacity() {
            if self.requests.is_open(row) {
                self.close_row(row);
            }
        }
        // Same row order as a fresh allocator: rows 0, 1, 2, ... open next.
        self.requests.restack_free_rows();
    }

    pub(super) fn close_row(&mut self, row: usize) {
        if self.requests.is_swapped(row) {
            return self.close_swapped_row(row);
        }
        self.shrink_row(row, 0);
        self.requests.close_row(row);
    }

    /// Drops tokens past `new_len`, releasing pages past the new last page.
    fn shrink_row(&mut self, row: usize, new_len: usize) {
        let keep = self.geo.pages_for(new_len);
        let np = self.geo.pages_for(self.requests.len(row));
        let freed = &self.requests.pages(row, np)[keep..];
        if self.requests.is_exclusive(row) {
            // Sole holder of unregistered pages: their refcounts are 1, a
            // FREE page's count already, so freeing reads and writes
            // nothing per page but the free stack.
            self.pages.free_exclusive(freed);
        } else {
            let marked = if self.prefix.len() == 0 {
                self.pages.release_unregistered(freed)
            } else {
                self.pages.release(freed)
            };
            if marked {
                // Pages nobody holds any more were waiting copies'
                // destinations: nobody reads those copies now.
                self.pages.drop_released_copies(freed);
            }
        }
        let last = if keep == 0 {
            0
        } else {
            self.requests.page(row, keep - 1)
        };
        self.requests.set_tail(row, new_len, last);
        if self.needs_slow(row, new_len, last) {
            self.requests.mark_slow(row);
        }
        self.requests.truncate_known(row, new_len);
        let full = new_len / self.geo.page_size;
        if self.requests.chain(row).pages > full {
            // Resume the chain at the last full page kept when its entry is
            // at hand (a registered page's hash is its chain hash here);
            // otherwise recompute it from page 0 at the next cache().
            let tip = (full > 0)
                .then(|| {
                    let p = self.requests.page(row, full - 1);
                    self.prefix.tip_at(self.pages.entry(p))
                })
                .flatten();
            match tip {
                Some((tip, salt)) if salt == self.requests.salt(row) => {
                    // (A duplicate among the pages kept still counts.)
                    let foreign = self.requests.chain(row).foreign;
                    self.requests.resume_chain(row, full, tip, foreign)
                }
                _ => self.requests.restart_chain(row),
            }
        }
    }
}
