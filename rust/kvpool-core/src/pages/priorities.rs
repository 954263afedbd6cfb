//! The page pool's side of retention priorities: the calls the allocator
//! makes to give, end and read them. The eviction room keeps each page's
//! priority beside the lists it files cached pages on (`eviction/`); the
//! pool hands it the records those lists run through. Until the first
//! priority is given (`use_priorities`), none of this costs anything.

use super::PagePool;
use crate::error::Result;
use crate::eviction::{DEFAULT_PRIORITY, MAX_PRIORITY};

impl PagePool {
    /// Keeps priorities from now on (see `Eviction::use_levels`).
    pub(crate) fn use_priorities(&mut self) -> Result<()> {
        self.eviction.use_levels(&mut self.records, self.max_pinned)
    }

    /// Whether the pool keeps priorities (one list per priority).
    #[inline]
    pub(crate) fn has_priorities(&self) -> bool {
        self.eviction.levels().is_some()
    }

    /// Whether some priority's end is pending.
    #[inline]
    pub(crate) fn has_priority_ends(&self) -> bool {
        self.eviction.levels().is_some_and(|v| v.has_ends())
    }

    /// Ends the priorities whose end is at or before `now`.
    pub(crate) fn expire_priorities(&mut self, now: u64) {
        if let Some(v) = self.eviction.levels_mut() {
            v.expire(&mut self.records, now);
        }
    }

    /// Makes room for `n` priority ends (after `use_priorities`).
    pub(crate) fn reserve_priority_ends(&mut self, n: usize) -> Result<()> {
        match self.eviction.levels_mut() {
            Some(v) => v.reserve_ends(n),
            None => Ok(()),
        }
    }

    /// A caller gives registered page `p` priority `q` until `end` (see
    /// `eviction/retention.rs`). After `use_priorities`.
    pub(crate) fn raise_priority(&mut self, p: u32, q: u8, end: Option<u64>) {
        if let Some(v) = self.eviction.levels_mut() {
            v.raise(&mut self.records, p, q, end);
        }
    }

    /// Gives pinned page `p` the default priority; returns whether it was
    /// pinned.
    pub(crate) fn unpin(&mut self, p: u32) -> bool {
        match self.eviction.levels_mut() {
            Some(v) => v.unpin(&mut self.records, p),
            None => false,
        }
    }

    /// Registered page `p`, held, is about to lose its registration (a
    /// write into it): it no longer counts as pinned.
    pub(crate) fn unregister_held(&mut self, p: u32) {
        if let Some(v) = self.eviction.levels_mut() {
            v.unregistered_held(p);
        }
    }

    /// `clear_cache` emptied the lists: no page is pinned, no end pending.
    pub(crate) fn clear_priorities(&mut self) {
        if let Some(v) = self.eviction.levels_mut() {
            v.clear();
        }
    }

    /// Registered pages pinned, held or cached.
    pub(crate) fn pinned(&self) -> usize {
        self.eviction.levels().map_or(0, |v| v.pinned())
    }

    /// Cached pages pinned (no extend can take them).
    pub(crate) fn pinned_cached(&self) -> usize {
        self.eviction.levels().map_or(0, |v| v.pinned_cached())
    }

    /// Of `pages` (distinct), those that count in `available()` now and
    /// would not once held: CACHED (held by nobody) and not pinned.
    pub(crate) fn evictable_among(&self, pages: &[u32]) -> usize {
        let levels = self.eviction.levels();
        let evictable = |p: u32| levels.map_or(true, |v| v.is_evictable(p));
        pages
            .iter()
            .filter(|&&p| self.records[p as usize].is_unheld() && evictable(p))
            .count()
    }

    pub(crate) fn max_pinned(&self) -> usize {
        self.max_pinned
    }

    /// Evictable pages at each priority 0..=100.
    pub(crate) fn evictable_by_priority(&self) -> [usize; MAX_PRIORITY as usize + 1] {
        match self.eviction.levels() {
            Some(v) => v.by_priority(),
            None => {
                let mut out = [0; MAX_PRIORITY as usize + 1];
                out[DEFAULT_PRIORITY as usize] = self.eviction.len();
                out
            }
        }
    }

    /// Checks the priority bookkeeping (see `Levels::check_retention`);
    /// `now`: the clock, when it only moves when set.
    pub(crate) fn check_priorities(&self, now: Option<u64>) -> std::result::Result<(), String> {
        match self.eviction.levels() {
            Some(v) => v.check_retention(|p| self.records[p as usize].is_registered(), now),
            None => Ok(()),
        }
    }
}
