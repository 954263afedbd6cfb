//! The eviction room: which CACHED page goes when the pool needs a page
//! and has no FREE one.
//!
//! The page pool (`pages/`) tells this room about every page that enters
//! or leaves CACHED, inside its own transitions, and the allocator asks it
//! for victims. The room keeps its state in its own fields and in the
//! [`Links`] of each page record, which nothing else writes.
//!
//! A policy is a variant of [`Eviction`], dispatched by a match (no dyn on
//! the hot paths), and each call is O(pages it moves):
//!
//! - `Lru` (`lru.rs`): least recently used, one list;
//! - `Levels` (`levels.rs`, `retention.rs`): retention priorities 0..=100,
//!   the lowest priority first and least recently used within one, pins
//!   that are never victims, and priorities that end after a duration.
//!
//! A pool starts with `Lru` and switches to `Levels` the first time a
//! caller gives a priority (`use_levels`): its cached pages so far become
//! the default priority's list, in order, in O(1). A pool that never gives
//! one keeps the one-list code, priority bookkeeping and all left out.

pub(crate) mod levels;
pub(crate) mod lru;
mod retention;

use crate::error::Result;
use levels::Levels;
pub use levels::{DEFAULT_PRIORITY, MAX_PRIORITY};
use lru::{Append, Linked, Lru};

/// The pool's eviction policy and its bookkeeping.
#[derive(Debug, Clone)]
pub(crate) enum Eviction {
    Lru(Lru),
    Levels(Box<Levels>),
}

/// A bulk insertion in progress (see [`Eviction::begin_insert`]).
pub(crate) struct Insert(Append);

impl Default for Eviction {
    fn default() -> Self {
        Eviction::Lru(Lru::default())
    }
}

impl Eviction {
    /// Evictable pages (every CACHED page but the pinned ones).
    #[inline]
    pub(crate) fn len(&self) -> usize {
        match self {
            Eviction::Lru(l) => l.len(),
            Eviction::Levels(v) => v.len(),
        }
    }

    /// The page the next eviction takes (0: none).
    #[inline]
    pub(crate) fn victim<R: Linked>(&self, recs: &[R]) -> u32 {
        match self {
            Eviction::Lru(l) => l.oldest(recs),
            Eviction::Levels(v) => v.victim(),
        }
    }

    /// The page evicted after `p`, a victim (0: none): its newer neighbour
    /// on its list where it has one, else (with priorities) the oldest page
    /// of the next list.
    #[inline]
    pub(crate) fn next_victim<R: Linked>(&self, recs: &[R], p: u32) -> u32 {
        let n = recs[p as usize].links().newer();
        match self {
            _ if n != 0 => n,
            Eviction::Lru(_) => 0,
            Eviction::Levels(v) => v.next_list(p),
        }
    }

    /// `p`'s newer neighbour on its list (0: none); with one list, the
    /// victim after `p`.
    #[inline]
    pub(crate) fn newer<R: Linked>(recs: &[R], p: u32) -> u32 {
        recs[p as usize].links().newer()
    }

    /// Takes the next victim off its list.
    #[inline]
    pub(crate) fn pop_victim<R: Linked>(&mut self, recs: &mut [R]) -> Option<u32> {
        match self {
            Eviction::Lru(l) => l.pop_oldest(recs),
            Eviction::Levels(v) => v.pop_victim(recs),
        }
    }

    /// Takes a victim, or else a pinned page, off its list: `clear_cache`
    /// empties the room with it.
    pub(crate) fn pop_cached<R: Linked>(&mut self, recs: &mut [R]) -> Option<u32> {
        match self {
            Eviction::Lru(l) => l.pop_oldest(recs),
            Eviction::Levels(v) => v.pop_cached(recs),
        }
    }

    /// `p` became CACHED (one page; a release's pages come in bulk, below).
    pub(crate) fn insert<R: Linked>(&mut self, recs: &mut [R], p: u32) {
        match self {
            Eviction::Lru(l) => l.push(recs, p),
            Eviction::Levels(v) => v.insert(recs, p),
        }
    }

    /// Starts inserting the pages a release makes CACHED, in release order.
    /// (With priorities, the pages are strung from record 0 meanwhile and
    /// filed by `end_insert`.)
    #[inline]
    pub(crate) fn begin_insert<R: Linked>(&self, recs: &[R]) -> Insert {
        // Either policy: an append after record 0's newer end (with
        // priorities, record 0 is unlinked, so the staging list starts
        // empty). No branch: a release's loop keeps the newest page in a
        // register.
        Insert(Lru::begin_append(recs))
    }

    #[inline]
    pub(crate) fn insert_next<R: Linked>(recs: &mut [R], ins: &mut Insert, p: u32) {
        Lru::append(recs, &mut ins.0, p);
    }

    /// `insert_next` of four pages, in this order.
    #[inline]
    pub(crate) fn insert_next4<R: Linked>(recs: &mut [R], ins: &mut Insert, pages: [u32; 4]) {
        Lru::append4(recs, &mut ins.0, pages);
    }

    #[inline]
    pub(crate) fn end_insert<R: Linked>(&mut self, recs: &mut [R], ins: Insert) {
        match self {
            Eviction::Lru(l) => l.end_append(recs, ins.0),
            Eviction::Levels(v) => v.end_insert(recs, ins.0),
        }
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
        match self {
            Eviction::Lru(l) => l.remove_run(recs, newest, oldest, n),
            Eviction::Levels(v) => v.remove_run(recs, newest, oldest, n),
        }
    }

    /// Removes the `n` next victims (walked with `victim` / `next_victim`),
    /// `rest` being the one after them (0: none), in one relink. Their own
    /// links are left for the caller to clear.
    #[inline]
    pub(crate) fn remove_victims<R: Linked>(&mut self, recs: &mut [R], n: usize, rest: u32) {
        match self {
            Eviction::Lru(l) => l.cut_oldest(recs, n, rest),
            Eviction::Levels(v) => v.cut_oldest(recs, n, rest),
        }
    }

    /// Verifies the lists' links and counts; `visit` sees every listed page
    /// and returns false for one that may not be listed. Returns the pages
    /// listed.
    pub(crate) fn check<R: Linked>(
        &self,
        recs: &[R],
        visit: impl FnMut(u32) -> bool,
    ) -> std::result::Result<usize, String> {
        match self {
            Eviction::Lru(l) => l.check(recs, visit),
            Eviction::Levels(v) => v.check(recs, visit),
        }
    }

    // ---- retention priorities (the `Levels` policy) ----

    /// Switches to the `Levels` policy if the pool is not on it yet. Errors:
    /// `InvalidArgument` when its per-page arrays cannot be allocated
    /// (nothing changed then).
    pub(crate) fn use_levels<R: Linked>(
        &mut self,
        recs: &mut [R],
        max_pinned: usize,
    ) -> Result<()> {
        if let Eviction::Lru(l) = self {
            let v = Levels::from_lru(recs, l.len(), max_pinned)?;
            *self = Eviction::Levels(Box::new(v));
        }
        Ok(())
    }

    /// The priority bookkeeping, once a priority was given.
    #[inline]
    pub(crate) fn levels(&self) -> Option<&Levels> {
        match self {
            Eviction::Lru(_) => None,
            Eviction::Levels(v) => Some(v),
        }
    }

    #[inline]
    pub(crate) fn levels_mut(&mut self) -> Option<&mut Levels> {
        match self {
            Eviction::Lru(_) => None,
            Eviction::Levels(v) => Some(v),
        }
    }

    /// `p` was just registered: a new registration has the default priority.
    #[inline]
    pub(crate) fn registered(&mut self, p: u32) {
        if let Eviction::Levels(v) = self {
            v.registered(p);
        }
    }

    /// Registered page `q`'s priority moves to page `p`, which took over
    /// its registration (`q` is on no list, `p` held).
    #[inline]
    pub(crate) fn moved(&mut self, q: u32, p: u32) {
        if let Eviction::Levels(v) = self {
            v.moved(q, p);
        }
    }

    /// Heap bytes beyond the page records.
    pub(crate) fn capacity_bytes(&self) -> usize {
        self.levels().map_or(0, Levels::capacity_bytes)
    }
}
