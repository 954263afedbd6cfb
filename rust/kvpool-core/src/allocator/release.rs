//! The freeing side: truncate (and an extend's roll-back), close and reset. A request lets go of its
//! pages last-first: FREE pages then come back off the stack in their old
//! order, and CACHED tail pages end up older in the LRU than their parents,
//! so eviction takes a chain's tail first (as vLLM frees in reverse order).

use super::options::Counts;
use super::SlotAllocator;
use crate::error::{PoolError, Result};
use crate::handle::handle_row;
use crate::prefix::tip::ChainTip;

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
            // Resume the chain at the last full page kept where its
            // registration is known (`kept_tip`); otherwise recompute it
            // from page 0 at the next cache().
            match (full > 0).then(|| self.kept_tip(row, full)).flatten() {
                Some((tip, foreign)) => self.requests.resume_chain(row, full, tip, foreign),
                None => self.requests.restart_chain(row),
            }
        }
    }

    /// Where a truncation to `full` full pages resumes `row`'s chain (the
    /// walked chain is longer), and whether the pages kept may include a
    /// duplicate of another request's entry: the last page's own entry
    /// where it is registered (of the row's salt; a registered page's hash
    /// is its chain hash here); where it duplicated content (the index kept
    /// another request's copy, which this row does not hold), the entry of
    /// that copy, found by the walk `cache` checks chains with, but only
    /// while the whole chain still holds: every registration it passes is
    /// the one `cache` chained through (none went since it was last walked,
    /// or a walk now reaches the same tip), so the registrations already
    /// recorded for the pages kept (the grouped allocator's) stay right.
    /// If the copy goes later, the next `cache()` restarts the chain as for
    /// any chain through another's entry (`restart_dead_chain`, which
    /// compares the removals with those of the last walk that found the
    /// chain whole), and a cached prefix's walk (`unpin`, priorities) stops
    /// where it went. None: restart the chain.
    fn kept_tip(&mut self, row: usize, full: usize) -> Option<(ChainTip, bool)> {
        let p = self.requests.page(row, full - 1);
        if let Some((tip, salt)) = self.prefix.tip_at(self.pages.entry(p)) {
            // (A duplicate among the pages kept still counts.)
            let foreign = self.requests.chain(row).foreign;
            return (salt == self.requests.salt(row)).then_some((tip, foreign));
        }
        let chain = self.requests.chain(row);
        let intact = !chain.broken
            && self.prefix.is_live(&chain.tip)
            && ((chain.foreign && chain.checked == self.prefix.removals())
                || self.chain_holds(row));
        intact
            .then(|| self.walk_chain(row, full))
            .flatten()
            .map(|tip| (tip, true))
    }
}
