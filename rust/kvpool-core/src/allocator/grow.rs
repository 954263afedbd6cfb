//! The slow side of extend: requests that take pages, copy a shared last
//! page (copy-on-write, queued by the pool) or unregister a cached one
//! before writing into it, or take token ids from their prompt.

use super::SlotAllocator;
use crate::geometry::fill_run;
use crate::pages::copies_of_shared;

impl SlotAllocator {
    /// Pages a request's next extend needs beyond its length's own: 1 when
    /// its partly filled last page has other holders (copy-on-write).
    #[inline]
    pub(super) fn cow_pages(&self, row: usize) -> usize {
        let (len, last, _) = self.requests.tail(row);
        if self.geo.offset_in_page(len) == 0 {
            return 0;
        }
        self.pages.is_shared(last) as usize
    }

    /// How many copies one extend makes of the shared last pages
    /// `shared` (one entry per growing request whose last page is shared
    /// and partly filled): see `copies_of_shared`.
    pub(super) fn shared_copies(&self, shared: &mut [u32]) -> usize {
        copies_of_shared(shared, |p| self.pages.holders(p) as usize)
    }

    /// Appends `dst.len()` tokens to `row`, taking pages as needed and
    /// copying (or unregistering) a last page it must not write in place.
    /// Returns how many positions moved to a copied page. Leaves the row
    /// off the slow path.
    pub(super) fn grow_row(&mut self, row: usize, start: usize, dst: &mut [i64]) -> usize {
        let ps = self.geo.page_size;
        let c = dst.len();
        let np = self.geo.pages_for(start);
        let off = self.geo.offset_in_page(start);
        if off == 0 && c <= ps {
            // One new page from the free stack (a decode step at a page
            // boundary; every step at page size 1): the short way.
            if let Some(p) = self.pages.pop_free() {
                self.requests.set_page(row, np, p);
                fill_run(dst, p as usize * ps);
                self.requests.set_tail(row, start + c, p);
                return 0;
            }
        }
        let (_, mut last, _) = self.requests.tail(row);
        let mut moved = 0;
        if off != 0 {
            if self.pages.is_shared(last) {
                // Shared: the others keep the page, this request gets a copy.
                let q = self.take_page();
                self.prefix
                    .copy_tokens(last as usize * ps, q as usize * ps, off);
                self.pages.queue_copy(last, q, off);
                self.pages.drop_shared_holder(last);
                self.requests.set_page(row, np - 1, q);
                last = q;
                moved = off;
            } else if self.pages.is_registered(last) {
                // Only the cache shares it: drop the entry, then write in place.
                self.pages.unregister_held(last);
                self.unregister_for_write(last);
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
        let taken = self.pages.free_top(new_pages);
        let from_stack = taken.len();
        let list = self.requests.pages_mut(row, np, new_pages);
        for (d, &p) in list.iter_mut().zip(taken.iter().rev()) {
            *d = p;
        }
        if ps == 1 {
            for (slot, &p) in rest.iter_mut().zip(&list[..from_stack]) {
                *slot = p as i64;
            }
        } else {
            for (run, &p) in rest.chunks_mut(ps).zip(&list[..from_stack]) {
                fill_run(run, p as usize * ps);
            }
        }
        self.pages.drop_free_top(from_stack);
        for (j, run) in rest.chunks_mut(ps).enumerate().skip(from_stack) {
            let p = self.take_page();
            self.requests.set_page(row, np + j, p);
            fill_run(run, p as usize * ps);
        }
        if new_pages > 0 {
            last = self.requests.page(row, np + new_pages - 1);
        }
        self.requests.set_tail(row, start + c, last);
        moved
    }

    /// Stores the token ids of the new positions `start..` whose slots are
    /// `slots` (given ids, else the prompt's) and advances the known prefix.
    pub(super) fn record_tokens(
        &mut self,
        row: usize,
        start: usize,
        slots: &[i64],
        toks: Option<&[i64]>,
    ) {
        let known = match toks {
            Some(t) => {
                for (&s, &x) in slots.iter().zip(t) {
                    self.prefix.set_token(s as usize, x as i32);
                }
                slots.len()
            }
            None => {
                let prompt = self.requests.prompt(row);
                let n = slots.len().min(prompt.len().saturating_sub(start));
                for (j, &s) in slots[..n].iter().enumerate() {
                    self.prefix.set_token(s as usize, prompt[start + j]);
                }
                n
            }
        };
        self.requests.record_known(row, start, known);
    }

    /// Whether `row` (length `len`, last page `last`) must take the slow
    /// path next: prompt positions still ahead, or a partly filled last page
    /// that others hold (requests, or a waiting copy of it) or the cache has
    /// registered.
    pub(super) fn needs_slow(&self, row: usize, len: usize, last: u32) -> bool {
        self.requests.prompt(row).len() > len
            || (self.geo.offset_in_page(len) != 0 && self.pages.is_shared_or_registered(last))
    }
}
