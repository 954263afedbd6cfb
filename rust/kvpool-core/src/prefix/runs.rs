//! Runs: stretches of consecutive slab slots whose entries were each filed
//! under the slot before, with a contiguous copy of their token ids and
//! locations, so that a page-size-1 walk matches a prompt against a run
//! with one compare of token arrays and one copy of page ids, where a
//! hinted walk reads a 32-byte entry per token (`lookup.rs`).
//!
//! Page size 1 only: there every token is a page and the per-entry hop is
//! most of a cached prompt's walk. At larger page sizes a hop already
//! covers a page of tokens, and the copies would double the index's token
//! memory.
//!
//! What a run guarantees, for its slots `first..first + len`: every slot is
//! a live entry filed into this run (`run_of`), each after the first was
//! filed under the one before it (its `parent_reg` is that entry's `reg`),
//! and `tokens[s]`, `pages[s]` equal entry `s`'s first token and location.
//! So a prompt span equal to a run's token span, starting under a verified
//! entry of the run, is exactly what a hinted walk would verify entry by
//! entry: same tokens, parent by parent, and the salt each child takes from
//! its parent. The run only changes what the walk reads.
//!
//! Kept cheaply. A registration pass of `cache()` or `close()`
//! (`allocator/cache.rs`) says which pages it files anew, each under the
//! one before, in consecutive slots (the usual case: the slab hands out
//! consecutive slots, and reuses freed ones last freed first); it records
//! them as one run when it ends, continuing its parent's run when the
//! parent is that run's last slot (`run_builder.rs`). Other filings (revivals,
//! the grouped allocator's anchor chain) make no run: they are walked by
//! hops, eight at a time where they lie in slab order, as are the slots
//! after a cut. A removal (eviction, a page
//! written again, a duplicate dropped) or a relink cuts the run before the
//! slot. Nothing ever searches runs: `run_of` names a slot's run, trusted
//! only while the slot is inside the run's range, so a cut is one store
//! and a stale `run_of` costs nothing to leave behind.

use crate::error::Result;
use crate::memory::{fault_in, prefetch, zeroed_vec};

#[derive(Debug, Clone, Default)]
pub(super) struct Runs {
    /// Whether runs are kept (page size 1).
    pub(super) on: bool,
    /// Per slab slot: the token and location its entry was filed with (the
    /// location kept in step with `set_location`).
    pub(super) tokens: Vec<i32>,
    pub(super) pages: Vec<u32>,
    /// Per slab slot: the first slot of the run it was filed into, + 1.
    pub(super) run_of: Vec<u32>,
    /// Per slab slot: the length of the run that starts there (0: none).
    /// A run is named by its first slot, so runs need no table of their
    /// own: every array here is one value per slot the slab can have.
    pub(super) len_at: Vec<u32>,
}

impl Runs {
    pub(super) fn new(page_size: usize) -> Self {
        Runs {
            on: page_size == 1,
            ..Default::default()
        }
    }

    /// Room for slab slots `0..end`. The arrays are sized at once for `max`
    /// slots (every entry the index can hold), zero-filled by calloc so
    /// that the slots never filed cost address space only: a registration
    /// then writes its slot's values where a push would test and grow four
    /// vectors. Runs only speed the walk up, so when their memory is not
    /// there the index keeps none from then on (the walk hops entry by
    /// entry, as at larger page sizes), rather than fail the registration.
    pub(super) fn reserve(&mut self, end: usize, max: usize) {
        if !self.on || end <= self.tokens.len() {
            return;
        }
        // Past `max` (ghosts keep slab slots of their own) the arrays double,
        // as the slab does: grown to `end` alone, every registration while
        // ghosts exist would copy them whole.
        let n = end.max(max).max(2 * self.tokens.len());
        let what = "prefix index runs";
        let grown = (|| -> Result<_> {
            Ok((
                zeroed_vec::<i32>(n, what)?,
                zeroed_vec::<u32>(n, what)?,
                zeroed_vec::<u32>(n, what)?,
                zeroed_vec::<u32>(n, what)?,
            ))
        })();
        let Ok(mut grown) = grown else {
            *self = Runs::default();
            return;
        };
        let used = self.tokens.len();
        grown.0[..used].copy_from_slice(&self.tokens);
        grown.1[..used].copy_from_slice(&self.pages);
        grown.2[..used].copy_from_slice(&self.run_of);
        grown.3[..used].copy_from_slice(&self.len_at);
        (self.tokens, self.pages, self.run_of, self.len_at) = grown;
    }

    /// Maps the first `bytes` of each array now (the slab's own
    /// `map_slab`, after a `reserve`): a first burst's registrations then
    /// write into mapped memory.
    pub(super) fn map(&mut self, bytes: usize) {
        fault_in(&mut self.tokens, bytes);
        fault_in(&mut self.pages, bytes);
        fault_in(&mut self.run_of, bytes);
        fault_in(&mut self.len_at, bytes);
    }

    /// Records slots `first..first + pages.len()`, filed just now one after
    /// another (each under the one before) for `pages`, whose token ids
    /// `slot_tokens` holds (page size 1), as a run; `extends`: the first was
    /// filed under the live entry of slot `first - 1`, whose run it
    /// continues if that slot is its last. The pages come from the row's
    /// list and the tokens from the pages' slots, not from the entries: a
    /// long pass has long evicted its first entries from cache.
    pub(super) fn record(&mut self, first: u32, pages: &[u32], slot_tokens: &[i32], extends: bool) {
        let (s, n) = (first as usize, pages.len());
        if s + n > self.tokens.len() {
            self.grow_unreserved(s + n);
        }
        self.pages[s..s + n].copy_from_slice(pages);
        for (t, &p) in self.tokens[s..s + n].iter_mut().zip(pages) {
            *t = slot_tokens[p as usize];
        }
        let head = match self.run_of_slot(first.wrapping_sub(1)) {
            Some(f) if extends && f + self.len_at[f as usize] == first => f,
            _ => first,
        };
        self.len_at[head as usize] += n as u32;
        self.run_of[s..s + n].fill(head + 1);
    }

    /// Room for slot `end - 1`, which a run reaches without a `reserve`
    /// covering it: the slab's own push would grow, so the runs grow too,
    /// rather than fail where no error can be returned.
    #[cold]
    #[inline(never)]
    fn grow_unreserved(&mut self, end: usize) {
        debug_assert!(false, "slot {} filed without a reserve", end - 1);
        let n = end.max(2 * self.tokens.len());
        self.tokens.resize(n, 0);
        self.pages.resize(n, 0);
        self.run_of.resize(n, 0);
        self.len_at.resize(n, 0);
    }

    /// The first slot of the run holding slot `slot`, if any.
    #[inline(always)]
    fn run_of_slot(&self, slot: u32) -> Option<u32> {
        let f = self.run_of.get(slot as usize)?.checked_sub(1)?;
        (slot.wrapping_sub(f) < self.len_at[f as usize]).then_some(f)
    }

    /// Starts loading slot `slot`'s run (what `cut` reads first).
    #[inline(always)]
    pub(super) fn prefetch(&self, slot: u32) {
        prefetch(&self.run_of, slot as usize);
    }

    /// Slot `slot` leaves its run, and the slots after it with it.
    #[inline(always)]
    pub(super) fn cut(&mut self, slot: u32) {
        if let Some(f) = self.run_of_slot(slot) {
            self.len_at[f as usize] = slot - f;
        }
    }

    /// Slot `slot`'s entry is now located at `loc`.
    #[inline]
    pub(super) fn set_page(&mut self, slot: u32, loc: u32) {
        if let Some(p) = self.pages.get_mut(slot as usize) {
            *p = loc;
        }
    }

    /// Starts loading what a walk reads next when it reaches slot `slot` by
    /// a hop: the slot's run, the length there (a run that starts at the
    /// slot), and the first of the tokens and locations after it. Loaded
    /// one after another they are four misses in a row a hop, a prompt's
    /// return after eviction cut its chain into many runs.
    #[inline(always)]
    pub(super) fn prefetch_from(&self, slot: u32) {
        let (s, t) = (slot as usize, slot as usize + 1);
        prefetch(&self.run_of, s);
        prefetch(&self.len_at, s);
        prefetch(&self.tokens, t);
        prefetch(&self.pages, t);
    }

    /// The slots after `slot` in its run (empty if it is in none, or last).
    #[inline(always)]
    pub(super) fn after(&self, slot: u32) -> std::ops::Range<usize> {
        match self.run_of_slot(slot) {
            Some(f) => slot as usize + 1..(f + self.len_at[f as usize]) as usize,
            None => 0..0,
        }
    }

    /// Token ids of slots `range` (a run's).
    #[inline(always)]
    pub(super) fn tokens(&self, range: std::ops::Range<usize>) -> &[i32] {
        &self.tokens[range]
    }

    /// Locations of slots `range` (a run's).
    #[inline(always)]
    pub(super) fn pages(&self, range: std::ops::Range<usize>) -> &[u32] {
        &self.pages[range]
    }

    /// Every run ends (the index is cleared); `used`: the slab's slots.
    pub(super) fn clear(&mut self, used: usize) {
        let used = used.min(self.len_at.len());
        self.len_at[..used].fill(0);
    }

    pub(super) fn capacity_bytes(&self) -> usize {
        (self.tokens.capacity()
            + self.pages.capacity()
            + self.run_of.capacity()
            + self.len_at.capacity())
            * 4
    }
}

/// How many leading elements `a` and `b` share. Blocks of 16 fold their
/// differences and branch once, which the compiler vectorizes; the block
/// that differs is scanned.
#[inline]
pub(super) fn common_prefix(a: &[i32], b: &[i32]) -> usize {
    const BLOCK: usize = 16;
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut k = 0;
    for (x, y) in a.chunks_exact(BLOCK).zip(b.chunks_exact(BLOCK)) {
        if x.iter().zip(y).fold(0, |acc, (p, q)| acc | (p ^ q)) != 0 {
            break;
        }
        k += BLOCK;
    }
    k + a[k..]
        .iter()
        .zip(&b[k..])
        .take_while(|(p, q)| p == q)
        .count()
}

#[cfg(test)]
mod tests {
    use super::common_prefix;

    #[test]
    fn common_prefix_finds_the_first_difference_in_and_past_a_block() {
        let a: Vec<i32> = (0..100).collect();
        for n in [0, 1, 15, 16, 17, 31, 32, 33, 99, 100] {
            let mut b = a.clone();
            if n < b.len() {
                b[n] = -1;
            }
            assert_eq!(common_prefix(&a, &b), n, "difference at {n}");
            assert_eq!(common_prefix(&a[..n], &a), n, "shorter side {n}");
        }
    }
}
