//! Page states and their transitions, each O(1):
//!
//! ```text
//! FREE   --take-->            HELD (refcount 1)
//! CACHED --take (evict)-->    HELD (refcount 1), Removed event
//! CACHED --hit-->             HELD (leaves the LRU list)
//! HELD   --release last-->    CACHED if registered (newest in LRU), else FREE
//! CACHED --evict-->           FREE, Removed event
//! ```
//!
//! A FREE page is on the free stack; a CACHED page is registered with
//! refcount 0 and on the LRU list; a HELD page has refcount >= 1.

use crate::allocator::SlotAllocator;

/// How many LRU victims ahead `evict` prefetches.
const EVICT_AHEAD: usize = 4;

impl SlotAllocator {
    /// Pages an extend can take now: FREE + CACHED.
    #[inline]
    pub(crate) fn available_pages(&self) -> usize {
        self.free_pages.len() + self.index.lru_len
    }

    /// Takes a page for a new holder: FREE first, else the oldest CACHED page.
    /// The caller checked `available_pages`; 0 only if that check was skipped.
    #[inline]
    pub(crate) fn take_page(&mut self) -> u32 {
        let p = match self.free_pages.pop() {
            Some(p) => p,
            None => self.evict_one().unwrap_or(0),
        };
        self.refcount[p as usize] = 1;
        p
    }

    /// Evicts the oldest CACHED page (it becomes unregistered, refcount 0,
    /// on no list: the caller makes it FREE or HELD).
    pub(crate) fn evict_one(&mut self) -> Option<u32> {
        let p = self.index.lru_pop_oldest()?;
        // Evictions come in runs (an extend short of FREE pages, evict(n)),
        // and each chases pointers: LRU link -> registration -> entry ->
        // table bucket. Start loading the next victim's link and
        // registration now, so those misses overlap this eviction's. (Two
        // victims ahead measured no better and slowed short runs.)
        let next = self.index.lru_next[0] as usize;
        crate::memory::prefetch(&self.index.lru_next, next);
        crate::memory::prefetch(&self.index.page_entry, next);
        self.unregister_page(p);
        Some(p)
    }

    /// Drops `p`'s registration and reports it.
    pub(crate) fn unregister_page(&mut self, p: u32) {
        if let Some(e) = self.index.unregister(p) {
            self.events.removed(e.hash, p, e.salt);
        }
    }

    /// One more holder of a HELD or CACHED page.
    #[inline]
    pub(crate) fn hold_page(&mut self, p: u32) {
        let rc = &mut self.refcount[p as usize];
        if *rc == 0 {
            self.index.lru_remove(p);
        }
        self.refcount[p as usize] += 1;
    }

    /// One holder fewer. Pass a request's pages last-first: freed pages then
    /// come back off the stack in their old order, and cached tail pages are
    /// older in the LRU than their parents, so eviction takes them first.
    #[inline]
    pub(crate) fn release_page(&mut self, p: u32) {
        let rc = &mut self.refcount[p as usize];
        *rc -= 1;
        if *rc == 0 {
            if self.index.is_registered(p) {
                self.index.lru_push(p);
            } else {
                self.free_pages.push(p);
            }
        }
    }

    /// Evicts up to `n` CACHED pages, least recently used first; returns
    /// how many were evicted. They become FREE.
    ///
    /// The victims are the first `n` pages of the LRU list, so the run is
    /// cut off the list in one relink instead of unlinking page by page,
    /// and each victim's registration is prefetched a few pages ahead (the
    /// list is walked anyway), so the index misses overlap.
    pub fn evict(&mut self, n: usize) -> usize {
        let n = n.min(self.index.lru_len);
        let mut p = self.index.lru_next[0];
        let mut ahead = p;
        for _ in 0..EVICT_AHEAD.min(n) {
            ahead = self.index.lru_next[ahead as usize];
            crate::memory::prefetch(&self.index.page_entry, ahead as usize);
        }
        for _ in 0..n {
            let ix = &mut self.index;
            let next = ix.lru_next[p as usize];
            ahead = ix.lru_next[ahead as usize];
            crate::memory::prefetch(&ix.page_entry, ahead as usize);
            ix.lru_prev[p as usize] = 0;
            ix.lru_next[p as usize] = 0;
            self.unregister_page(p);
            self.free_pages.push(p);
            p = next;
        }
        let ix = &mut self.index;
        ix.lru_next[0] = p;
        ix.lru_prev[p as usize] = 0;
        ix.lru_len -= n;
        n
    }

    /// Drops every index entry: CACHED pages become FREE, HELD pages stay
    /// with their holders, unregistered. Emits one Cleared event. Costs
    /// O(registered pages + max_requests).
    pub fn clear_cache(&mut self) {
        while let Some(p) = self.index.lru_pop_oldest() {
            self.index.unregister(p);
            self.free_pages.push(p);
        }
        self.index.clear();
        for c in self.cold.iter_mut() {
            c.restart_chain();
        }
        self.events.cleared();
    }
}
