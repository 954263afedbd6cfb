//! Retention priorities: the CACHED pages in one least-recently-used list
//! per priority 0..=100, plus a list of pinned pages that is never a
//! victim. The lists are threaded through the same record links as
//! `lru.rs` (0 ends a list here: each list keeps its own ends instead of a
//! sentinel record), so a page still joins or leaves a list in O(1). A
//! victim is the oldest page of the lowest non-empty priority, found in a
//! 128-bit mask of the non-empty lists: O(1) whatever the pool's size.
//!
//! What each page's priority is, how callers change it and when a duration
//! ends is `retention.rs`; this file keeps the lists (their `check()` is
//! `levels/check.rs`).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::lru::{Append, Linked, Links};
use crate::error::Result;
use crate::memory::zeroed_vec;

mod check;

/// The highest priority; given with no duration, it pins the page.
pub const MAX_PRIORITY: u8 = 100;
/// The priority of a page no caller gave one (TensorRT-LLM's default on
/// the same 0..=100 scale).
pub const DEFAULT_PRIORITY: u8 = 35;
/// The list of pinned pages.
pub(super) const PINNED: usize = MAX_PRIORITY as usize + 1;
const LISTS: usize = PINNED + 1;
/// The duration heap is first compacted at this length.
pub(super) const MIN_COMPACT: usize = 4096;

/// A pending end: when (clock nanoseconds), then the latest given first
/// (`u64::MAX - ` the count of durations given before it), then the page.
pub(super) type End = (u64, u64, u32);

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Ends {
    oldest: u32,
    newest: u32,
}

#[derive(Debug, Clone)]
pub(crate) struct Levels {
    ends: [Ends; LISTS],
    lens: [usize; LISTS],
    /// Bit `l` set: priority list `l` (0..=100) holds a page.
    nonempty: u128,
    /// Pages on the priority lists (the pinned list aside).
    evictable: usize,
    /// Per page: 0 when no caller gave it a priority (it has the default),
    /// else the priority given + 1. Meaningful for registered pages: a new
    /// registration starts at 0 (`retention.rs`).
    pub(super) given: Vec<u8>,
    /// Per page: 0 when its priority has no end, else the end (clock
    /// nanoseconds) + 1.
    pub(super) until: Vec<u64>,
    /// Every priority given with a duration, soonest end first (see
    /// `retention.rs`). An entry whose page's end has changed since is
    /// stale and skipped.
    pub(super) heap: BinaryHeap<Reverse<End>>,
    /// Durations given so far (orders the ends that fall together).
    pub(super) given_ends: u64,
    /// Heap length at which stale entries are dropped (`retention.rs`).
    pub(super) compact_at: usize,
    /// Registered pages that are pinned, held or cached.
    pub(super) pinned: usize,
    pub(super) max_pinned: usize,
}

/// The list a page with `given` / `until` (as stored) belongs on.
#[inline]
pub(super) fn list_for(given: u8, until: u64) -> usize {
    match given {
        0 => DEFAULT_PRIORITY as usize,
        g if g == MAX_PRIORITY + 1 && until == 0 => PINNED,
        g => g as usize - 1,
    }
}

impl Levels {
    /// Takes over an LRU list (record 0 its sentinel, `len` pages) as the
    /// default priority's list: every page cached so far has the default.
    /// O(1) besides the per-page arrays, which are mapped lazily.
    pub(super) fn from_lru<R: Linked>(
        recs: &mut [R],
        len: usize,
        max_pinned: usize,
    ) -> Result<Self> {
        let n = recs.len();
        let given = zeroed_vec::<u8>(n, "page priorities")?;
        let until = zeroed_vec::<u64>(n, "page priority ends")?;
        let mut lv = Levels {
            ends: [Ends::default(); LISTS],
            lens: [0; LISTS],
            nonempty: 0,
            evictable: 0,
            given,
            until,
            heap: BinaryHeap::new(),
            given_ends: 0,
            compact_at: MIN_COMPACT,
            pinned: 0,
            max_pinned,
        };
        let s = *recs[0].links();
        // The sentinel's links are the ends; the end pages' links to it
        // (0) already read as "none" here.
        *recs[0].links_mut() = Links::UNLINKED;
        let d = DEFAULT_PRIORITY as usize;
        lv.ends[d] = Ends {
            oldest: s.newer,
            newest: s.older,
        };
        lv.grew(d, len);
        Ok(lv)
    }

    #[inline]
    pub(super) fn list_of(&self, p: u32) -> usize {
        // The end is read only for a priority of 100 (a pin has none): the
        // other pages' lists come from one byte each.
        match self.given[p as usize] {
            0 => DEFAULT_PRIORITY as usize,
            g if g == MAX_PRIORITY + 1 => list_for(g, self.until[p as usize]),
            g => g as usize - 1,
        }
    }

    #[inline]
    fn grew(&mut self, l: usize, n: usize) {
        if n == 0 {
            return;
        }
        self.lens[l] += n;
        if l < PINNED {
            self.evictable += n;
            self.nonempty |= 1 << l;
        }
    }

    #[inline]
    fn shrank(&mut self, l: usize, n: usize) {
        self.lens[l] -= n;
        if l < PINNED {
            self.evictable -= n;
            if self.lens[l] == 0 {
                self.nonempty &= !(1 << l);
            }
        }
    }

    /// Appends `p` as list `l`'s newest page.
    #[inline]
    pub(super) fn push<R: Linked>(&mut self, recs: &mut [R], l: usize, p: u32) {
        let newest = self.ends[l].newest;
        *recs[p as usize].links_mut() = Links {
            older: newest,
            newer: 0,
        };
        if newest == 0 {
            self.ends[l].oldest = p;
        } else {
            recs[newest as usize].links_mut().newer = p;
        }
        self.ends[l].newest = p;
        self.grew(l, 1);
    }

    /// Takes `p` off list `l` (its links become UNLINKED).
    #[inline]
    pub(super) fn unlink<R: Linked>(&mut self, recs: &mut [R], l: usize, p: u32) {
        let Links { older, newer } =
            std::mem::replace(recs[p as usize].links_mut(), Links::UNLINKED);
        self.relink(recs, l, older, newer);
        self.shrank(l, 1);
    }

    /// Joins `older` and `newer` (0: the list's end) on list `l`.
    #[inline]
    fn relink<R: Linked>(&mut self, recs: &mut [R], l: usize, older: u32, newer: u32) {
        if older == 0 {
            self.ends[l].oldest = newer;
        } else {
            recs[older as usize].links_mut().newer = newer;
        }
        if newer == 0 {
            self.ends[l].newest = older;
        } else {
            recs[newer as usize].links_mut().older = older;
        }
    }

    /// Whether `p`, whose list is `l` by its priority, is on it (a page on
    /// no list has UNLINKED links and no list's end names it).
    #[inline]
    pub(super) fn is_listed<R: Linked>(&self, recs: &[R], l: usize, p: u32) -> bool {
        recs[p as usize].links().older != 0 || self.ends[l].oldest == p
    }

    /// Whether CACHED page `p` counts as evictable (its list is not the
    /// pinned one).
    #[inline]
    pub(crate) fn is_evictable(&self, p: u32) -> bool {
        self.list_of(p) < PINNED
    }

    /// Evictable pages (the pinned ones are not).
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.evictable
    }

    /// Cached pages that are pinned.
    #[inline]
    pub(crate) fn pinned_cached(&self) -> usize {
        self.lens[PINNED]
    }

    /// Evictable pages at each priority.
    pub(crate) fn by_priority(&self) -> [usize; MAX_PRIORITY as usize + 1] {
        let mut out = [0; MAX_PRIORITY as usize + 1];
        out.copy_from_slice(&self.lens[..PINNED]);
        out
    }

    /// The oldest page of the lowest non-empty priority (0: none).
    #[inline]
    pub(crate) fn victim(&self) -> u32 {
        match self.nonempty {
            0 => 0,
            m => self.ends[m.trailing_zeros() as usize].oldest,
        }
    }

    /// The victim after `p`, the newest page of its list: the oldest page of
    /// the next non-empty priority above its own (0: none). Not inlined:
    /// the eviction loops that reach it also serve the one-list policy.
    #[inline(never)]
    pub(crate) fn next_list(&self, p: u32) -> u32 {
        let l = self.list_of(p);
        if l >= PINNED {
            return 0;
        }
        match self.nonempty & (!0u128 << (l + 1)) {
            0 => 0,
            m => self.ends[m.trailing_zeros() as usize].oldest,
        }
    }

    pub(crate) fn pop_victim<R: Linked>(&mut self, recs: &mut [R]) -> Option<u32> {
        if self.nonempty == 0 {
            return None;
        }
        let l = self.nonempty.trailing_zeros() as usize;
        let p = self.ends[l].oldest;
        self.unlink(recs, l, p);
        Some(p)
    }

    /// A victim, else a pinned page (for `clear_cache`).
    pub(crate) fn pop_cached<R: Linked>(&mut self, recs: &mut [R]) -> Option<u32> {
        self.pop_victim(recs).or_else(|| {
            let p = self.ends[PINNED].oldest;
            (p != 0).then(|| {
                self.unlink(recs, PINNED, p);
                p
            })
        })
    }

    pub(crate) fn insert<R: Linked>(&mut self, recs: &mut [R], p: u32) {
        let l = self.list_of(p);
        self.push(recs, l, p);
    }

    /// Files the pages a bulk insertion staged: `Lru::append` strung them
    /// from record 0 (whose links are otherwise unused here), in release
    /// order; each goes to the newest end of its own list, in that order.
    /// A run of staged pages bound for the same list (a request's pages
    /// mostly share a priority) is already linked in order, so it joins its
    /// list in one splice. O(pages released). Not inlined into the release
    /// loop, which also serves the one-list policy.
    #[inline(never)]
    pub(crate) fn end_insert<R: Linked>(&mut self, recs: &mut [R], ins: Append) {
        let n = ins.added;
        let mut p = recs[0].links().newer;
        let mut k = 0;
        while k < n {
            let l = self.list_of(p);
            let (first, mut last, mut run) = (p, p, 1);
            k += 1;
            // The last staged page's `newer` link is not written yet: the
            // next page is read only while there is one.
            let mut next = 0;
            while k < n {
                next = recs[last as usize].links().newer;
                if self.list_of(next) != l {
                    break;
                }
                last = next;
                next = 0;
                k += 1;
                run += 1;
            }
            self.splice(recs, l, first, last);
            self.grew(l, run);
            p = next;
        }
        *recs[0].links_mut() = Links::UNLINKED;
    }

    /// Joins the linked run `first..=last` to list `l`'s newest end (the
    /// caller counts it).
    #[inline]
    fn splice<R: Linked>(&mut self, recs: &mut [R], l: usize, first: u32, last: u32) {
        let newest = self.ends[l].newest;
        recs[first as usize].links_mut().older = newest;
        if newest == 0 {
            self.ends[l].oldest = first;
        } else {
            recs[newest as usize].links_mut().newer = first;
        }
        recs[last as usize].links_mut().newer = 0;
        self.ends[l].newest = last;
    }

    /// Removes the run of `n` pages from `newest` down to `oldest`, each the
    /// older neighbour of the one before (so on one list), in one relink.
    /// Not inlined into the hold loop, which also serves the one-list policy.
    #[inline(never)]
    pub(crate) fn remove_run<R: Linked>(
        &mut self,
        recs: &mut [R],
        newest: u32,
        oldest: u32,
        n: usize,
    ) {
        let l = self.list_of(newest);
        let newer = recs[newest as usize].links().newer;
        let older = recs[oldest as usize].links().older;
        self.relink(recs, l, older, newer);
        self.shrank(l, n);
    }

    /// Removes the `n` next victims (walked with `victim` / `next_victim`,
    /// their links since cleared by the caller), `rest` being the one after
    /// them: whole lists from the lowest priority up, then the first pages
    /// of the list `rest` is on. O(lists emptied).
    pub(crate) fn cut_oldest<R: Linked>(&mut self, recs: &mut [R], n: usize, rest: u32) {
        let mut left = n;
        while left > 0 {
            let l = self.nonempty.trailing_zeros() as usize;
            let len = self.lens[l];
            if len <= left {
                self.ends[l] = Ends::default();
                self.shrank(l, len);
                left -= len;
            } else {
                self.ends[l].oldest = rest;
                recs[rest as usize].links_mut().older = 0;
                self.shrank(l, left);
                left = 0;
            }
        }
    }

    /// Every page has left the lists (`clear_cache`): nothing is pinned
    /// and no duration is pending.
    pub(crate) fn clear(&mut self) {
        debug_assert_eq!(self.lens.iter().sum::<usize>(), 0);
        self.pinned = 0;
        self.heap.clear();
    }

    pub(crate) fn capacity_bytes(&self) -> usize {
        self.given.capacity()
            + self.until.capacity() * 8
            + self.heap.capacity() * std::mem::size_of::<Reverse<End>>()
    }
}
