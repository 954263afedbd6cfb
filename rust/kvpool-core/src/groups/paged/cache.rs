//! A page group's prefix cache: which of a row's pages `cache()` files under the
//! anchor chain's registrations (`regmap.rs`), and how registered pages leave it
//! (eviction, `clear`), apart from the engine that holds the pages.

use super::PageEngine;

impl PageEngine {
    /// Drops `p`'s registration, if it has one.
    pub(crate) fn unregister(&mut self, p: u32) {
        if self.pages.take_entry(p) != 0 {
            self.map.remove_page(p);
        }
    }

    /// Pages `register` may file for `row`: at most its full pages past
    /// its progress that the anchor chain covers.
    pub(crate) fn registrable(&self, row: usize, len: usize, anchor_end: usize) -> usize {
        (len.min(anchor_end) / self.geo.page_size).saturating_sub(self.progress(row))
    }

    /// Files `row`'s full pages past its progress whose end the anchor
    /// chain covers: page k under `regs[(k + 1) * page_size / a - 1]`,
    /// the chain's entry at the page's end. A page already filed under
    /// another key moves to this one (its content is this prefix's: both
    /// keys name the same tokens); a key already filed for another page
    /// keeps it (a duplicate), unless nobody holds that page and this one
    /// is filed nowhere: then this page takes the key over and the other
    /// goes FREE (kept, the unheld copy would be evicted first while the
    /// row still holds the content). Room was made with `map.reserve`.
    pub(crate) fn register(&mut self, row: usize, len: usize, regs: &[u64], a: usize) {
        let ps = self.geo.page_size;
        let upto = len.min(regs.len() * a) / ps;
        for k in self.progress(row)..upto {
            let p = self.entry(row, k);
            if p == 0 {
                continue;
            }
            let reg = regs[(k + 1) * ps / a - 1];
            match self.map.get(reg) {
                Some(q) => {
                    if q != p && self.pages.holders(q) == 0 && self.map.reg_of(p) == 0 {
                        self.map.remove_page(q);
                        self.map.insert(reg, p);
                        self.pages.move_registration(q, p);
                    }
                }
                None => {
                    if self.map.reg_of(p) != 0 {
                        self.map.remove_page(p);
                    }
                    self.map.insert(reg, p);
                    self.pages.set_entry(p, 1);
                }
            }
        }
        self.progress[row] = self.progress[row].max(upto as u32);
    }

    /// `cache()`'s progress on `row` goes back to `pages` at most (the
    /// anchor chain was cut there).
    pub(crate) fn clamp_progress(&mut self, row: usize, pages: usize) {
        self.progress[row] = self.progress[row].min(pages as u32);
    }

    /// Evicts up to `n` CACHED pages, LRU first; returns how many.
    pub(crate) fn evict(&mut self, n: usize) -> usize {
        let mut k = 0;
        while k < n {
            let Some(p) = self.pages.pop_victim() else {
                break;
            };
            self.unregister(p);
            self.pages.free_evicted(p);
            k += 1;
        }
        k
    }

    /// Drops every registration: CACHED pages become FREE, held ones stay
    /// with their holders; every row's progress starts over.
    pub(crate) fn clear(&mut self) {
        while let Some(p) = self.pages.pop_victim() {
            self.unregister(p);
            self.pages.free_evicted(p);
        }
        let held: Vec<u32> = self.map.entries().map(|(_, p)| p).collect();
        for p in held {
            self.unregister(p);
        }
        self.progress.fill(0);
    }
}
