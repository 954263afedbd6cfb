//! A page group that is not the anchor: full or sliding attention, with its
//! own page pool (`pages/`: records, free stack, LRU eviction, copy-on-write
//! queue), its own page size, a page list per request row, and a cache
//! index keyed by the anchor chain's registration ids (`regmap.rs`).
//!
//! Rows and lengths are the grouped pool's (the anchor's request table);
//! every call here names the row and, where it matters, its length.
//!
//! A sliding group's page list keeps its positions: pages released as the
//! window moved are 0 (the null page) at the front of the list, and
//! `first_held` says where the held ones start. The row's window is
//! `window_start(len)..len`; an extend releases what the step's first token
//! no longer attends to, so a decoding request holds the pages of its last
//! `window` positions. A full group is the same engine with no window
//! (`first_held` stays 0).

use crate::error::Result;
use crate::geometry::{fill_run, Geometry};
use crate::memory::{reserve, zeroed_vec};
use crate::pages::{copies_of_shared, PagePool};
use crate::table::SlotTable;

use super::regmap::RegMap;

mod cache;
mod check;

#[derive(Debug, Clone)]
pub(crate) struct PageEngine {
    pub(super) geo: Geometry,
    /// Sliding window (None: full attention).
    pub(super) window: Option<usize>,
    pub(super) pages: PagePool,
    pub(super) map: RegMap,
    /// Entries per row in `lists`.
    row_pages: usize,
    /// Page lists of all rows, row-major (0: a released position).
    lists: Vec<u32>,
    /// Per row: index of the first held page (sliding groups).
    first_held: Vec<u32>,
    /// Per row: leading pages `cache()` has dealt with (registered, found
    /// duplicated, or released before it could be).
    progress: Vec<u32>,
    /// Pages an extend releases, sorted (a batch's scratch).
    scratch: Vec<u32>,
    /// Shared partly filled last pages of a batch's growing rows, sorted
    /// (a batch's scratch).
    shared_scratch: Vec<u32>,
    /// The scratch capacities when a batch's checks began: metadata_bytes
    /// counts the scratch, so a refused batch gives back what it grew.
    scratch_mark: (usize, usize),
}

impl PageEngine {
    pub(crate) fn new(
        num_pages: usize,
        page_size: usize,
        window: Option<usize>,
        max_requests: usize,
        max_context_len: usize,
    ) -> Result<Self> {
        let geo = Geometry::new(num_pages, page_size, max_context_len);
        let row_pages = geo.pages_for(max_context_len) + 1;
        let n = max_requests.checked_mul(row_pages).ok_or_else(|| {
            crate::error::PoolError::InvalidArgument(format!(
                "max_requests * pages per request = {max_requests} * {row_pages} overflows"
            ))
        })?;
        Ok(PageEngine {
            geo,
            window,
            pages: PagePool::new(num_pages, false)?,
            map: RegMap::new(num_pages)?,
            row_pages,
            lists: zeroed_vec(n, "group page lists")?,
            first_held: zeroed_vec(max_requests, "group rows")?,
            progress: zeroed_vec(max_requests, "group rows")?,
            scratch: Vec::new(),
            shared_scratch: Vec::new(),
            scratch_mark: (0, 0),
        })
    }

    #[inline]
    pub(crate) fn page_size(&self) -> usize {
        self.geo.page_size
    }

    /// The first position a request of length `len` still attends to from
    /// its next token on (0 for full attention).
    #[inline]
    pub(crate) fn window_start(&self, len: usize) -> usize {
        match self.window {
            Some(w) => len.saturating_sub(w - 1),
            None => 0,
        }
    }

    #[inline]
    pub(crate) fn list(&self, row: usize, n: usize) -> &[u32] {
        let base = row * self.row_pages;
        &self.lists[base..base + n]
    }

    #[inline]
    fn entry(&self, row: usize, k: usize) -> u32 {
        self.lists[row * self.row_pages + k]
    }

    #[inline]
    fn set_entry(&mut self, row: usize, k: usize, p: u32) {
        self.lists[row * self.row_pages + k] = p;
    }

    #[inline]
    pub(crate) fn first_held(&self, row: usize) -> usize {
        self.first_held[row] as usize
    }

    #[inline]
    pub(crate) fn progress(&self, row: usize) -> usize {
        self.progress[row] as usize
    }

    /// The held pages of a row of length `len`, in token order.
    #[inline]
    pub(crate) fn held(&self, row: usize, len: usize) -> &[u32] {
        let np = self.geo.pages_for(len);
        &self.list(row, np)[self.first_held(row).min(np)..]
    }

    // ---- taking and letting go of pages ----

    /// A page for a new holder: FREE first, else the LRU victim, which
    /// leaves the index. The caller checked `pages.available()`.
    fn take_page(&mut self) -> u32 {
        if let Some(p) = self.pages.pop_free() {
            return p;
        }
        match self.pages.pop_victim() {
            Some(p) => {
                self.unregister(p);
                self.pages.hold_evicted(p);
                p
            }
            None => 0,
        }
    }

    /// Releases `row`'s pages `from..to` (all held), last first, and drops
    /// the copies into pages nobody holds any more.
    fn release_range(&mut self, row: usize, from: usize, to: usize) {
        if from >= to {
            return;
        }
        let base = row * self.row_pages;
        let freed = &self.lists[base + from..base + to];
        if self.pages.release(freed) {
            self.pages.drop_released_copies(freed);
        }
    }

    // ---- extend ----

    /// Remembers the scratch capacities before a batch's checks.
    pub(crate) fn mark_scratch(&mut self) {
        self.scratch_mark = (self.scratch.capacity(), self.shared_scratch.capacity());
    }

    /// After a refused batch: the scratch back to its marked capacities, so
    /// that the refusal leaves metadata_bytes as it was. (The scratch holds
    /// nothing between batches; shrinking reallocates to exactly the mark.)
    pub(crate) fn restore_scratch(&mut self) {
        let (a, b) = self.scratch_mark;
        for (v, cap) in [(&mut self.scratch, a), (&mut self.shared_scratch, b)] {
            if v.capacity() > cap {
                v.clear();
                v.shrink_to(cap);
            }
        }
    }

    /// Pages the batch `(row, len, count)` needs here, and the pages its
    /// window releases that then have no holder left (FREE or CACHED, so
    /// available again before the new ones are taken).
    pub(crate) fn extend_need(&mut self, batch: &[(usize, usize, usize)]) -> (usize, usize) {
        let ps = self.geo.page_size;
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.clear();
        let mut need = 0usize;
        for &(row, len, c) in batch {
            if c == 0 {
                continue;
            }
            need += self.geo.pages_for(len + c) - self.geo.pages_for(len);
            if self.window.is_some() {
                let to = self.window_start(len) / ps;
                let from = self.first_held(row).min(to);
                scratch.extend_from_slice(&self.list(row, to)[from..]);
            }
        }
        scratch.sort_unstable();
        let releases = |p: u32| -> u32 {
            let lo = scratch.partition_point(|&q| q < p);
            let hi = scratch.partition_point(|&q| q <= p);
            (hi - lo) as u32
        };
        let mut credited = 0usize;
        let mut k = 0;
        while k < scratch.len() {
            let p = scratch[k];
            let n = releases(p);
            if self.pages.holders(p) == n {
                credited += 1;
            }
            k += n as usize;
        }
        let mut shared = std::mem::take(&mut self.shared_scratch);
        shared.clear();
        for &(row, len, c) in batch {
            let off = self.geo.offset_in_page(len);
            if c == 0 || off == 0 {
                continue;
            }
            let last = self.entry(row, self.geo.pages_for(len) - 1);
            if self.pages.holders(last) - releases(last) > 1 {
                shared.push(last);
            }
        }
        // A page that `m` growing rows share, of `h` holders once the
        // windows released theirs, is copied by all but the last holder to
        // grow (which finds it its own): min(m, h - 1) times.
        need += copies_of_shared(&mut shared, |p| {
            (self.pages.holders(p) - releases(p)) as usize
        });
        self.shared_scratch = shared;
        self.scratch = scratch;
        (need, credited)
    }

    /// Makes room for the copies `copies` rows may queue.
    pub(crate) fn prepare_copies(&mut self, copies: usize) -> Result<()> {
        self.pages.prepare_copies(copies)
    }

    /// Releases the pages of `row` that the step starting at `start` no
    /// longer attends to; returns the released positions `from..to` (to
    /// pad in a table).
    pub(crate) fn release_window(&mut self, row: usize, start: usize) -> (usize, usize) {
        let ps = self.geo.page_size;
        let to = self.window_start(start) / ps;
        let from = self.first_held(row);
        if to <= from {
            return (0, 0);
        }
        self.release_range(row, from, to);
        let base = row * self.row_pages;
        self.lists[base + from..base + to].fill(0);
        self.first_held[row] = to as u32;
        (from * ps, to * ps)
    }

    /// Appends `dst.len()` tokens to `row` (length `start`), taking pages
    /// and copying a shared partly filled last page first (or dropping its
    /// registration when only the cache shares it). Returns how many
    /// positions moved to the copy.
    pub(crate) fn grow(&mut self, row: usize, start: usize, dst: &mut [i64]) -> usize {
        let ps = self.geo.page_size;
        let c = dst.len();
        if c == 0 {
            return 0;
        }
        let np = self.geo.pages_for(start);
        let off = self.geo.offset_in_page(start);
        let mut moved = 0;
        let mut head = 0;
        if off != 0 {
            let mut last = self.entry(row, np - 1);
            if self.pages.is_shared(last) {
                let q = self.take_page();
                self.pages.queue_copy(last, q, off);
                self.pages.drop_shared_holder(last);
                self.set_entry(row, np - 1, q);
                last = q;
                moved = off;
            } else if self.pages.is_registered(last) {
                self.unregister(last);
            }
            head = (ps - off).min(c);
            fill_run(&mut dst[..head], last as usize * ps + off);
        }
        for (j, run) in dst[head..].chunks_mut(ps).enumerate() {
            let p = self.take_page();
            self.set_entry(row, np + j, p);
            fill_run(run, p as usize * ps);
        }
        moved
    }

    /// The end of a batch that queued copies `from..`: each holds its
    /// source from now on.
    pub(crate) fn hold_copy_sources(&mut self, from: usize) {
        self.pages.hold_copy_sources(from);
    }

    pub(crate) fn queued_runs(&self) -> usize {
        self.pages.queued_runs()
    }

    // ---- rows opening, shrinking, closing, sharing ----

    /// A new request in `row`.
    pub(crate) fn open_row(&mut self, row: usize) {
        self.first_held[row] = 0;
        self.progress[row] = 0;
    }

    /// Shortens `row` from `len` to `new_len` tokens, releasing the held
    /// pages past the new last page. The caller checked that the new
    /// length's window is held.
    pub(crate) fn shrink(&mut self, row: usize, len: usize, new_len: usize) {
        let keep = self.geo.pages_for(new_len);
        let np = self.geo.pages_for(len);
        let from = keep.max(self.first_held(row));
        self.release_range(row, from, np);
        // Every page before `keep` that was held stays; past it nothing is.
        self.first_held[row] = self.first_held[row].min(keep as u32);
        let full = (new_len / self.geo.page_size) as u32;
        self.progress[row] = self.progress[row].min(full);
    }

    /// Starts `row` on a prefix hit: `pages` are its first pages (0 before
    /// `first`, the matched pages after), `progress` the pages `cache()`
    /// need not look at again.
    pub(crate) fn start_hit(&mut self, row: usize, pages: &[u32], first: usize, progress: usize) {
        let base = row * self.row_pages;
        self.lists[base..base + pages.len()].copy_from_slice(pages);
        self.pages.hold(&pages[first..]);
        self.first_held[row] = first as u32;
        self.progress[row] = progress as u32;
    }

    /// `child` shares all of `parent`'s held pages (length `len`).
    pub(crate) fn fork_row(&mut self, parent: usize, child: usize, len: usize) {
        let np = self.geo.pages_for(len);
        let (pb, cb) = (parent * self.row_pages, child * self.row_pages);
        self.lists.copy_within(pb..pb + np, cb);
        let first = self.first_held(parent);
        for k in first..np {
            self.pages.add_holder(self.lists[cb + k]);
        }
        self.first_held[child] = first as u32;
        self.progress[child] = self.progress[parent];
    }

    /// Gives `row` back `pages`, the pages `first..` it released as its
    /// window moved (taken from the cache: the caller found each filed
    /// under the row's anchor chain), after a `shrink` to a length whose
    /// window starts at page `first`.
    pub(crate) fn take_back(&mut self, row: usize, first: usize, pages: &[u32]) {
        let base = row * self.row_pages + first;
        self.lists[base..base + pages.len()].copy_from_slice(pages);
        self.pages.hold(pages);
        self.first_held[row] = first as u32;
    }

    /// Whether `row` still holds what a truncate to `new_len` needs: the
    /// pages from its window's start on (the partly filled last page
    /// included, which the next extend writes into); nothing at 0.
    pub(crate) fn rollback_ok(&self, row: usize, new_len: usize) -> bool {
        new_len == 0 || self.first_held(row) <= self.window_start(new_len) / self.geo.page_size
    }

    // ---- reading ----

    /// The slots of `row`'s `len` positions; released positions read as
    /// the null page's slots (`position % page_size`).
    pub(crate) fn slots(&self, row: usize, len: usize, out: &mut Vec<i64>) -> Result<()> {
        let ps = self.geo.page_size;
        reserve(out, len, "slots")?;
        for (k, &p) in self.list(row, self.geo.pages_for(len)).iter().enumerate() {
            let n = ps.min(len - k * ps);
            out.extend((0..n).map(|j| (p as usize * ps + j) as i64));
        }
        Ok(())
    }

    /// Writes `row`'s slots into `table[row, 0..len]` (null-page slots at
    /// released positions).
    pub(crate) fn fill_table(&self, row: usize, len: usize, table: &mut SlotTable<'_>) {
        let ps = self.geo.page_size;
        for (k, &p) in self.list(row, self.geo.pages_for(len)).iter().enumerate() {
            table.write_page(row, k * ps, p as usize * ps, ps.min(len - k * ps));
        }
    }

    /// Pads `table[row, from..to]` with the null page's slots.
    pub(crate) fn pad_table(
        table: &mut SlotTable<'_>,
        row: usize,
        from: usize,
        to: usize,
        ps: usize,
    ) {
        let mut pos = from;
        while pos < to {
            let n = (ps - pos % ps).min(to - pos);
            table.write_page(row, pos, pos % ps, n);
            pos += n;
        }
    }

    pub(crate) fn capacity_bytes(&self) -> usize {
        self.pages.capacity_bytes()
            + self.map.capacity_bytes()
            + (self.lists.capacity() + self.first_held.capacity() + self.progress.capacity()) * 4
            + (self.scratch.capacity() + self.shared_scratch.capacity()) * 4
    }
}
