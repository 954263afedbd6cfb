//! The slow side of extend: requests that take pages, copy a shared last
//! page (copy-on-write, queued in `copies.rs`) or unregister a cached one
//! before writing into it, or take token ids from their prompt.

use crate::allocator::SlotAllocator;
use crate::rows::SLOW;

/// Writes `first, first + 1, ...` into `dst` (the slots of one page run).
#[inline]
pub(crate) fn fill_run(dst: &mut [i64], first: usize) {
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
    /// Pages a request's next extend needs beyond its length's own: 1 when
    /// its partly filled last page has other holders (copy-on-write).
    #[inline]
    pub(crate) fn cow_pages(&self, row: usize) -> usize {
        let r = self.rows[row];
        if self.offset_in_page(r.len as usize) == 0 {
            return 0;
        }
        self.index.state[(r.last & !SLOW) as usize].is_shared() as usize
    }

    /// Appends `dst.len()` tokens to `row`, taking pages as needed and
    /// copying (or unregistering) a last page it must not write in place.
    /// Returns how many positions moved to a copied page. Leaves `SLOW` clear.
    pub(crate) fn grow_row(&mut self, row: usize, start: usize, dst: &mut [i64]) -> usize {
        let ps = self.page_size;
        let c = dst.len();
        let base = row * self.row_pages;
        let np = self.pages_for(start);
        let off = self.offset_in_page(start);
        if off == 0 && c <= ps {
            // One new page from the free stack (a decode step at a page
            // boundary; every step at page size 1): the short way.
            if let Some(p) = self.free_pages.pop() {
                self.page_lists[base + np] = p;
                fill_run(dst, p as usize * ps);
                self.rows[row].len = (start + c) as u32;
                self.rows[row].last = p;
                return 0;
            }
        }
        let mut last = self.rows[row].last & !SLOW;
        let mut moved = 0;
        if off != 0 {
            if self.index.state[last as usize].is_shared() {
                // Shared: the others keep the page, this request gets a copy.
                let q = self.take_page();
                let (src, dstp) = (last as usize * ps, q as usize * ps);
                self.index.tokens.copy_within(src..src + off, dstp);
                self.queue_copy(last, q, off);
                self.index.state[last as usize].extra -= 1;
                self.page_lists[base + np - 1] = q;
                last = q;
                moved = off;
            } else if self.index.is_registered(last) {
                // Only the cache shares it: drop the entry, then write in place.
                self.unregister_page(last);
            }
        }
        let room = if off == 0 { 0 } else { ps - off };
        let (head, rest) = dst.split_at_mut(room.min(c));
        if !head.is_empty() {
            fill_run(head, last as usize * ps + off);
        }
        // New pages: the top of the free stack in one go (pop order), then
        // evicted cached pages if the stack runs out.
        let new_pages = rest.len().div_ceil(ps);
        let from_stack = new_pages.min(self.free_pages.len());
        let top = self.free_pages.len() - from_stack;
        let list = &mut self.page_lists[base + np..base + np + new_pages];
        let taken = self.free_pages[top..].iter().rev();
        if ps == 1 {
            for ((d, slot), &p) in list.iter_mut().zip(rest.iter_mut()).zip(taken) {
                *d = p;
                *slot = p as i64;
            }
        } else {
            for ((d, run), &p) in list.iter_mut().zip(rest.chunks_mut(ps)).zip(taken) {
                *d = p;
                fill_run(run, p as usize * ps);
            }
        }
        self.free_pages.truncate(top);
        for (j, run) in rest.chunks_mut(ps).enumerate().skip(from_stack) {
            let p = self.take_page();
            self.page_lists[base + np + j] = p;
            fill_run(run, p as usize * ps);
        }
        if new_pages > 0 {
            last = self.page_lists[base + np + new_pages - 1];
        }
        self.rows[row].len = (start + c) as u32;
        self.rows[row].last = last;
        moved
    }

    /// Stores the token ids of the new positions `start..` whose slots are
    /// `slots` (given ids, else the prompt's) and advances the known prefix.
    pub(crate) fn record_tokens(
        &mut self,
        row: usize,
        start: usize,
        slots: &[i64],
        toks: Option<&[i64]>,
    ) {
        let cold = &mut self.cold[row];
        let tokens = &mut self.index.tokens;
        let known = match toks {
            Some(t) => {
                for (&s, &x) in slots.iter().zip(t) {
                    tokens[s as usize] = x as i32;
                }
                slots.len()
            }
            None => {
                let n = slots.len().min(cold.prompt.len().saturating_sub(start));
                for (j, &s) in slots[..n].iter().enumerate() {
                    tokens[s as usize] = cold.prompt[start + j];
                }
                n
            }
        };
        let known_len = &mut self.known_len[row];
        if *known_len as usize == start {
            *known_len = (start + known) as u32;
        }
    }

    /// `SLOW` if `row` (length `len`, last page `last`) must take the slow
    /// path next: prompt positions still ahead, or a partly filled last page
    /// that others hold (requests, or a waiting copy of it) or the cache has
    /// registered.
    pub(crate) fn slow_bit(&self, row: usize, len: usize, last: u32) -> u32 {
        let last = last & !SLOW;
        let pending = self.cold[row].prompt.len() > len;
        let shared = self.offset_in_page(len) != 0 && {
            let s = self.index.state[last as usize];
            s.is_shared() || s.is_registered()
        };
        if pending || shared {
            SLOW
        } else {
            0
        }
    }
}
