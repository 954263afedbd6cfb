//! The freeing side: truncate, close and reset. A request lets go of its
//! pages last-first: FREE pages then come back off the stack in their old
//! order, and CACHED tail pages end up older in the LRU than their parents,
//! so eviction takes a chain's tail first (as vLLM frees in reverse order).

use crate::allocator::{Counts, SlotAllocator};
use crate::error::{PoolError, Result};
use crate::handle::{handle_row, next_generation};
use crate::rows::OPEN;

impl SlotAllocator {
    /// Shortens each request to `lengths[i]` tokens (<= its current length),
    /// releasing pages past the new end. Truncating into a page that others
    /// (or the cache) hold makes it copy-on-write for the next extend.
    /// A request shortened to inside its prompt (`open_with_prefix`) forgets
    /// the prompt from there: later positions take the token ids extend is
    /// given (or are unknown), and `cache` registers what they hold. The
    /// current length as the new one changes nothing.
    /// All-or-nothing. Errors: `InvalidHandle`, `InvalidArgument`.
    pub fn truncate(&mut self, handles: &[i64], lengths: Counts<'_>) -> Result<()> {
        lengths.check_len("lengths", handles.len())?;
        self.begin_batch();
        for (i, &h) in handles.iter().enumerate() {
            let row = self.resolve_unique(h, i)?;
            let l = lengths.get(i);
            let cur = self.rows[row].len;
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
            if l < self.rows[row].len as usize {
                // Rolled back (an edited turn, a retried call, rejected
                // draft tokens): what follows need not be the prompt.
                self.cold[row].prompt.truncate(l);
            }
            self.shrink_row(row, l);
        }
        Ok(())
    }

    /// Closes each request, releasing its pages; the handles become invalid.
    /// With `cache`, first registers each request's full pages of known
    /// tokens (as [`Self::cache`]), so they stay reusable as CACHED pages.
    /// All-or-nothing. Errors: `InvalidHandle`, `InvalidArgument` (a handle
    /// twice; the prefix index cannot grow).
    pub fn close(&mut self, handles: &[i64], cache: bool) -> Result<()> {
        self.resolve_batch(handles)?;
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
        for row in 0..self.max_requests {
            if self.rows[row].generation & OPEN != 0 {
                self.close_row(row);
            }
        }
        // Same row order as a fresh allocator: rows 0, 1, 2, ... open next.
        self.free_rows.clear();
        let base = self.generation_base;
        let rows = &self.rows;
        self.free_rows.extend(
            (0..self.max_requests as u32)
                .rev()
                .filter(|&r| !Self::row_retired(base, rows[r as usize].generation)),
        );
    }

    /// A closed row whose next generation would be its allocator's base.
    pub(crate) fn row_retired(base: u32, generation: u32) -> bool {
        generation != 0 && generation & OPEN == 0 && next_generation(generation) == base
    }

    fn close_row(&mut self, row: usize) {
        self.shrink_row(row, 0);
        let r = &mut self.rows[row];
        r.generation &= !OPEN;
        r.last = 0;
        let cold = &mut self.cold[row];
        // Keep small prompt buffers for the row's next request; return big ones.
        if cold.prompt.capacity() > 4096 {
            cold.prompt = Vec::new();
        }
        cold.prompt.clear();
        self.open_count -= 1;
        if Self::row_retired(self.generation_base, self.rows[row].generation) {
            self.retired_rows += 1;
        } else {
            self.free_rows.push(row as u32);
        }
    }

    /// Drops tokens past `new_len`, releasing pages past the new last page.
    fn shrink_row(&mut self, row: usize, new_len: usize) {
        let keep = self.pages_for(new_len);
        let np = self.pages_for(self.rows[row].len as usize);
        let base = row * self.row_pages;
        if self.cold[row].exclusive {
            // Sole holder of unregistered pages: their refcounts are 1, a
            // FREE page's count already (see `pages.rs`), so freeing reads
            // and writes nothing per page but the free stack. (No copy
            // waits on them: a request that never shared never copied.)
            let freed = &self.page_lists[base + keep..base + np];
            self.free_pages.extend(freed.iter().rev());
        } else {
            let marked = if self.index.len() == 0 {
                // Nothing is registered: a last holder frees the page outright.
                let queued = !self.copies.is_empty();
                let mut marked = false;
                for k in (keep..np).rev() {
                    let p = self.page_lists[base + k];
                    let s = &mut self.index.state[p as usize];
                    if s.extra == 0 {
                        self.free_pages.push(p); // FREE keeps its count 1
                        if queued {
                            marked |= Self::mark_released(&mut self.copies.into, p);
                        }
                    } else {
                        s.extra -= 1;
                    }
                }
                marked
            } else {
                self.release_pages(base + keep..base + np)
            };
            if marked {
                // Pages nobody holds any more were waiting copies'
                // destinations: nobody reads those copies now.
                self.drop_released_copies(base + keep..base + np);
            }
        }
        let last = if keep == 0 {
            0
        } else {
            self.page_lists[base + keep - 1]
        };
        self.rows[row].len = new_len as u32;
        self.rows[row].last = last;
        self.rows[row].last = last | self.slow_bit(row, new_len, last);
        let full = new_len / self.page_size;
        let cold = &mut self.cold[row];
        self.known_len[row] = self.known_len[row].min(new_len as u32);
        if cold.hashed_pages as usize > full {
            // Resume the chain at the last full page kept when its entry is
            // at hand (a registered page's hash is its chain hash here);
            // otherwise recompute it from page 0 at the next cache().
            let tip = (full > 0)
                .then(|| self.index.tip_of(self.page_lists[base + full - 1]))
                .flatten();
            let cold = &mut self.cold[row];
            match tip {
                Some((tip, salt)) if salt == cold.salt => {
                    cold.hashed_pages = full as u32;
                    cold.tip = tip;
                    cold.chain_broken = false;
                }
                _ => cold.restart_chain(),
            }
        }
    }
}
