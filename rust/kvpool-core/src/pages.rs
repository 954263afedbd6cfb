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
//! refcount 0 and on the LRU list; a HELD page has refcount >= 1. Each
//! page's count, registration and LRU links share one record
//! (`page_state.rs`), so a transition misses cache once, not once per array.
//!
//! A FREE page's stored count is 1, the count of the request that will
//! take it (stored as 0 extra holders, so a fresh pool's records are all
//! zeros), so taking a page off the free stack writes nothing. Pages
//! become FREE where their count is in hand anyway (a last holder's
//! release, an eviction) or keep their 1 untouched (an exclusive request's
//! close). Writing the count at take time missed cache once per page:
//! pages come off the stack in the order a closed request held them,
//! spread over the pool (decode pages are taken interleaved with the other
//! requests'). Without those misses the page-1 churn step went from about
//! 7 to 5 us.

use crate::allocator::SlotAllocator;
use crate::page_state::UNHELD;

/// Below this many registered pages the index's entries (64 bytes each,
/// in two slabs) fit in a core's L2, so warming victims ahead only costs:
/// `evict(256)` on a small index took 6.2 instead of 5.4 us with it.
const WARM_INDEX_ENTRIES: usize = 8192;

impl SlotAllocator {
    /// Pages an extend can take now: FREE + CACHED.
    #[inline]
    pub(crate) fn available_pages(&self) -> usize {
        self.free_pages.len() + self.index.lru_len
    }

    /// Takes a page for a new holder: FREE first (its refcount is 1
    /// already), else the oldest CACHED page. The caller checked
    /// `available_pages`; 0 only if that check was skipped.
    #[inline]
    pub(crate) fn take_page(&mut self) -> u32 {
        match self.free_pages.pop() {
            Some(p) => p,
            None => match self.evict_one() {
                Some(p) => {
                    self.index.state[p as usize].extra = 0; // one holder
                    p
                }
                None => 0,
            },
        }
    }

    /// Puts a page that has left the index (refcount 0) on the free stack
    /// with the refcount 1 a FREE page keeps.
    #[inline]
    fn push_free(&mut self, p: u32) {
        self.index.state[p as usize].extra = 0; // the count 1 of its next taker
        self.free_pages.push(p);
    }

    /// Evicts the oldest CACHED page (it becomes unregistered, refcount 0,
    /// on no list: the caller makes it FREE or HELD).
    pub(crate) fn evict_one(&mut self) -> Option<u32> {
        let p = self.index.lru_pop_oldest()?;
        self.prefetch_victims(self.index.state[0].next);
        self.unregister_page(p);
        Some(p)
    }

    /// Warms what the next evictions will touch. Evictions come in runs (an
    /// extend short of FREE pages, `evict(n)`), and each chases pointers
    /// that miss cache in a big pool: LRU link -> registration -> entry ->
    /// table bucket. Each address is requested as soon as the step before
    /// it can have arrived, so one eviction's misses overlap the next
    /// three's: the state record (links, registration, count) of the victim
    /// three ahead, the entry of the one two ahead, and the bucket of the
    /// next, `v1` (0: none).
    #[inline]
    fn prefetch_victims(&self, v1: u32) {
        use crate::memory::prefetch;
        let ix = &self.index;
        let v1 = v1 as usize;
        if v1 == 0 || ix.len() < WARM_INDEX_ENTRIES {
            return;
        }
        let v2 = ix.state[v1].next as usize;
        if v2 != 0 {
            prefetch(&ix.state, ix.state[v2].next as usize);
            if let Some(e) = ix.state[v2].entry.checked_sub(1) {
                prefetch(&ix.idents, e as usize);
                prefetch(&ix.entries, e as usize);
            }
        }
        if let Some(e) = ix.state[v1].entry.checked_sub(1) {
            if let Some(id) = ix.idents.get(e as usize) {
                ix.table.prefetch(crate::keys::key_of(id.hash));
            }
        }
    }

    /// Drops `p`'s registration and reports it.
    pub(crate) fn unregister_page(&mut self, p: u32) {
        if let Some(e) = self.index.unregister(p) {
            self.events.removed(e.hash, p, e.salt);
        }
    }

    /// One more holder of each page, HELD or CACHED, in a request's order.
    ///
    /// A run of CACHED pages that sits in the LRU list newest-first (as a
    /// request released them, last page first) leaves the list in one
    /// relink. Unlinking page by page would make each unlink wait on the
    /// links the one before it just wrote (the run's pages are each other's
    /// neighbours); here the run's links are only read, independently.
    pub(crate) fn hold_pages(&mut self, pages: &[u32]) {
        let ix = &mut self.index;
        let st = &mut ix.state;
        let mut k = 0;
        while k < pages.len() {
            let p = pages[k] as usize;
            k += 1;
            if st[p].extra != UNHELD {
                st[p].extra += 1;
                continue;
            }
            // CACHED: `p` and the pages after it that are each the LRU
            // predecessor of the one before form one segment of the list.
            // The test folds into one value: a compare-and-branch would let
            // the compiler take the next page from the link just loaded,
            // chaining every load on the one before.
            let first = k - 1;
            // (`!extra` is 0 exactly for a page nobody holds.)
            while k < pages.len()
                && (st[pages[k - 1] as usize].prev ^ pages[k]) | !st[pages[k] as usize].extra == 0
            {
                k += 1;
            }
            let newer = st[p].next;
            let older = st[pages[k - 1] as usize].prev;
            for &q in &pages[first..k] {
                let s = &mut st[q as usize];
                (s.extra, s.prev, s.next) = (0, 0, 0); // one holder, unlinked
            }
            st[older as usize].next = newer;
            st[newer as usize].prev = older;
            ix.lru_len -= k - first;
        }
    }

    /// One holder fewer of each page in `page_lists[range]`, last page
    /// first: freed pages then come back off the stack in their old order,
    /// and cached tail pages are older in the LRU than their parents, so
    /// eviction takes them first. Pages that become CACHED are appended to
    /// the LRU list with its newest end kept in a register, not re-read
    /// from the sentinel each time.
    ///
    /// Returns whether a page let go was a waiting copy's destination (its
    /// copy is dropped by `drop_released_copies` once the caller is done).
    pub(crate) fn release_pages(&mut self, range: std::ops::Range<usize>) -> bool {
        let ix = &mut self.index;
        let st = &mut ix.state;
        let mut newest = st[0].prev;
        let mut pushed = 0;
        let queued = !self.copies.is_empty();
        let mut marked = false;
        for &p in self.page_lists[range].iter().rev() {
            let s = &mut st[p as usize];
            if s.extra != 0 {
                s.extra -= 1;
                continue;
            }
            if queued {
                marked |= Self::mark_released(&mut self.copies.into, p);
            }
            // The last holder: CACHED (count 0) if registered, else FREE
            // (count stays 1).
            if s.is_registered() {
                (s.extra, s.prev) = (UNHELD, newest);
                st[newest as usize].next = p;
                newest = p;
                pushed += 1;
            } else {
                self.free_pages.push(p);
            }
        }
        st[newest as usize].next = 0;
        st[0].prev = newest;
        ix.lru_len += pushed;
        marked
    }

    /// One holder fewer of page `p` for a hold no page list names (a
    /// waiting copy's source); returns whether that was its last holder
    /// (it is then CACHED if registered, else FREE).
    pub(crate) fn release_held_page(&mut self, p: u32) -> bool {
        let s = &mut self.index.state[p as usize];
        if s.extra != 0 {
            s.extra -= 1;
            return false;
        }
        if s.is_registered() {
            s.extra = UNHELD;
            self.index.lru_push(p);
        } else {
            self.free_pages.push(p); // FREE keeps its count 1
        }
        true
    }

    /// Evicts up to `n` CACHED pages, least recently used first; returns
    /// how many were evicted. They become FREE (refcount 1).
    ///
    /// The victims are the first `n` pages of the LRU list, so the run is
    /// cut off the list in one relink instead of unlinking page by page,
    /// and the next victims are warmed as in `evict_one`.
    pub fn evict(&mut self, n: usize) -> usize {
        let n = n.min(self.index.lru_len);
        let mut p = self.index.state[0].next;
        for _ in 0..n {
            let next = self.index.state[p as usize].next;
            self.prefetch_victims(next);
            let s = &mut self.index.state[p as usize];
            (s.prev, s.next) = (0, 0);
            self.unregister_page(p);
            self.push_free(p);
            p = next;
        }
        let ix = &mut self.index;
        ix.state[0].next = p;
        ix.state[p as usize].prev = 0;
        ix.lru_len -= n;
        n
    }

    /// Drops every index entry: CACHED pages become FREE, HELD pages stay
    /// with their holders, unregistered. Emits one Cleared event. Costs
    /// O(registered pages + max_requests).
    ///
    /// Queued copies stay: each one fills a page an open request still
    /// reads (its own, or through a later copy out of it), so dropping it
    /// would leave that request reading another page's leftovers; its
    /// source stays held until it is taken. The copies of released pages
    /// are gone already (`copies.rs`).
    pub fn clear_cache(&mut self) {
        while let Some(p) = self.index.lru_pop_oldest() {
            self.index.unregister(p);
            self.push_free(p);
        }
        self.index.clear();
        for c in self.cold.iter_mut() {
            c.restart_chain();
        }
        self.events.cleared();
    }
}
