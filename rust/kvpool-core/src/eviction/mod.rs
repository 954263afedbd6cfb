//! The eviction room: which CACHED page goes when the pool needs a page
//! and has no FREE one.
//!
//! The page pool (`pages/`) tells this room about every page that enters
//! or leaves CACHED, inside its own transitions, and the allocator asks it
//! for victims. The room keeps its state in its own fields and in the
//! [`Links`] of each page record, which nothing else writes.
//!
//! A policy is a variant of [`Eviction`], dispatched by a match (no dyn on
//! the hot paths). Today there is one, least recently used (`lru.rs`); a
//! policy with retention priorities (lowest priority first, LRU within a
//! priority, pins, expiry) is another variant behind the same calls, and
//! must keep each call O(pages it moves).

pub(crate) mod lru;

use lru::{Append, Linked, Lru};

/// The pool's eviction policy and its bookkeeping.
#[derive(Debug, Clone)]
pub(crate) enum Eviction {
    Lru(Lru),
}

/// A bulk insertion in progress (see [`Eviction::begin_insert`]).
pub(crate) struct Insert(Append);

impl Default for Eviction {
    fn default() -> Self {
        Eviction::Lru(Lru::default())
    }
}

impl Eviction {
    /// CACHED pages: every one can be evicted.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        let Eviction::Lru(l) = self;
        l.len()
    }

    /// The page the next eviction takes (0: none).
    #[inline]
    pub(crate) fn victim<R: Linked>(&self, recs: &[R]) -> u32 {
        let Eviction::Lru(l) = self;
        l.oldest(recs)
    }

    /// The page evicted after `p`, a listed page (0: none).
    #[inline]
    pub(crate) fn next_victim<R: Linked>(&self, recs: &[R], p: u32) -> u32 {
        recs[p as usize].links().newer()
    }

    /// Takes the next victim off the list.
    #[inline]
    pub(crate) fn pop_victim<R: Linked>(&mut self, recs: &mut [R]) -> Option<u32> {
        let Eviction::Lru(l) = self;
        l.pop_oldest(recs)
    }

    /// `p` became CACHED (one page; a release's pages come in bulk, below).
    pub(crate) fn insert<R: Linked>(&mut self, recs: &mut [R], p: u32) {
        let Eviction::Lru(l) = self;
        l.push(recs, p);
    }

    /// Starts inserting the pages a release makes CACHED, in release order.
    #[inline]
    pub(crate) fn begin_insert<R: Linked>(&self, recs: &[R]) -> Insert {
        let Eviction::Lru(l) = self;
        Insert(l.begin_append(recs))
    }

    #[inline]
    pub(crate) fn insert_next<R: Linked>(recs: &mut [R], ins: &mut Insert, p: u32) {
        Lru::append(recs, &mut ins.0, p);
    }

    #[inline]
    pub(crate) fn end_insert<R: Linked>(&mut self, recs: &mut [R], ins: Insert) {
        let Eviction::Lru(l) = self;
        l.end_append(recs, ins.0);
    }

    /// 0 exactly when `q` is the listed neighbour evicted just before `p`
    /// (so the two can leave the list as one run). A value, not a bool: a
    /// caller folds it into one test with its own bits, which keeps the
    /// compiler from chaining each load on the link just loaded.
    #[inline]
    pub(crate) fn older_xor<R: Linked>(recs: &[R], p: u32, q: u32) -> u32 {
        recs[p as usize].links().older() ^ q
    }

    /// Removes the `n` listed pages from `newest` down to `oldest`, each
    /// the older neighbour of the one before (see `older_xor`), in one
    /// relink. Their own links are left for the caller to clear.
    #[inline]
    pub(crate) fn remove_run<R: Linked>(
        &mut self,
        recs: &mut [R],
        newest: u32,
        oldest: u32,
        n: usize,
    ) {
        let Eviction::Lru(l) = self;
        l.remove_run(recs, newest, oldest, n);
    }

    /// Removes the `n` next victims (walked with `victim` / `next_victim`),
    /// `rest` being the one after them (0: none), in one relink. Their own
    /// links are left for the caller to clear.
    #[inline]
    pub(crate) fn remove_victims<R: Linked>(&mut self, recs: &mut [R], n: usize, rest: u32) {
        let Eviction::Lru(l) = self;
        l.cut_oldest(recs, n, rest);
    }

    /// Verifies the list's links and count; `visit` sees every listed page
    /// and returns false for one that may not be listed.
    pub(crate) fn check<R: Linked>(
        &self,
        recs: &[R],
        visit: impl FnMut(u32) -> bool,
    ) -> std::result::Result<usize, String> {
        let Eviction::Lru(l) = self;
        l.check(recs, visit)
    }
}
