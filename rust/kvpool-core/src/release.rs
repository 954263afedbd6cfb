//! The freeing side: truncate, close and reset. Freed pages go back on the
//! LIFO free stack last-page-first, so the next extend takes them back in
//! their old order (and the most recently used pages first).

use crate::allocator::{Counts, SlotAllocator, FREE};
use crate::error::{PoolError, Result};
use crate::handle::handle_row;

impl SlotAllocator {
    /// Shortens each request to `lengths[i]` tokens (<= its current length),
    /// freeing pages past the new end. All-or-nothing.
    pub fn truncate(&mut self, handles: &[i64], lengths: Counts<'_>) -> Result<()> {
        lengths.check_len("lengths", handles.len())?;
        self.begin_batch();
        for (i, &h) in handles.iter().enumerate() {
            let row = self.resolve_unique(h, i)?;
            let l = lengths.get(i);
            let cur = self.requests[row].len;
            if l < 0 || l as u64 > cur as u64 {
                return Err(PoolError::InvalidArgument(format!(
                    "lengths[{i}] = {l} for handle {h} must be in [0, {cur}] (its current length); \
                     truncate only shortens"
                )));
            }
        }
        for (i, &h) in handles.iter().enumerate() {
            let row = handle_row(h) as usize;
            self.shrink_row(row, lengths.get(i) as usize);
        }
        Ok(())
    }

    /// Frees every page of each request; the handles become invalid. All-or-nothing.
    pub fn close(&mut self, handles: &[i64]) -> Result<()> {
        self.begin_batch();
        for (i, &h) in handles.iter().enumerate() {
            self.resolve_unique(h, i)?;
        }
        for &h in handles {
            self.close_row(handle_row(h) as usize);
        }
        Ok(())
    }

    /// Closes every open request. Costs O(max_requests + pages held).
    pub fn reset(&mut self) {
        for row in 0..self.max_requests {
            if self.requests[row].open {
                self.close_row(row);
            }
        }
        // Same row order as a fresh allocator: rows 0, 1, 2, ... open next.
        self.free_rows.clear();
        self.free_rows.extend((0..self.max_requests as u32).rev());
    }

    fn close_row(&mut self, row: usize) {
        self.shrink_row(row, 0);
        self.requests[row].open = false;
        self.free_rows.push(row as u32);
        self.open_count -= 1;
    }

    /// Drops tokens past `new_len`, pushing freed pages last-first so that the
    /// next extend takes them back in their original order.
    fn shrink_row(&mut self, row: usize, new_len: usize) {
        let keep = self.pages_for(new_len);
        let req = &mut self.requests[row];
        if let Some(freed) = req.pages.get(keep..) {
            for &p in freed {
                self.owner[p as usize] = FREE;
            }
            // One extend over the reversed tail: the same order as popping
            // the request's pages one by one onto the stack.
            self.free_pages.extend(freed.iter().rev());
            req.pages.truncate(keep);
        }
        req.len = new_len;
    }
}
