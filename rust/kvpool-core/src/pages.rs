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
//!
//! A FREE page's stored refcount is 1, the count of the request that will
//! take it, so taking a page off the free stack writes nothing. Pages
//! become FREE where their count is in hand anyway (a last holder's
//! release, an eviction) or keep their 1 untouched (an exclusive request's
//! close). Writing the count at take time missed cache once per page:
//! pages come off the stack in the order a closed request held them,
//! spread over the pool (decode pages are taken interleaved with the other
//! requests'). Without those misses the page-1 churn step went from about
//! 7 to 5 us.

use crate::allocator::SlotAllocator;

/// Below this many registered pages the index's entries (64 bytes each)
/// fit in a core's L2, so warming victims ahead only costs: `evict(256)` on
/// a small index took 6.2 instead of 5.4 us with it.
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
                    self.refcount[p as usize] = 1;
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
        self.refcount[p as usize] = 1;
        self.free_pages.push(p);
    }

    /// Evicts the oldest CACHED page (it becomes unregistered, refcount 0,
    /// on no list: the caller makes it FREE or HELD).
    pub(crate) fn evict_one(&mut self) -> Option<u32> {
        let p = self.index.lru_pop_oldest()?;
        self.prefetch_victims(self.index.lru_next[0]);
        self.unregister_page(p);
        Some(p)
    }

    /// Warms what the next evictions will touch. Evictions come in runs (an
    /// extend short of FREE pages, `evict(n)`), and each chases pointers
    /// that miss cache in a big pool: LRU link -> registration -> entry ->
    /// table bucket. Each address is requested as soon as the step before
    /// it can have arrived, so one eviction's misses overlap the next
    /// three's: the links and registration of the victim three ahead, the
    /// entry of the one two ahead, and the bucket and refcount of the next,
    /// `v1` (0: none).
    #[inline]
    fn prefetch_victims(&self, v1: u32) {
        use crate::memory::prefetch;
        let ix = &self.index;
        let v1 = v1 as usize;
        if v1 == 0 || ix.len() < WARM_INDEX_ENTRIES {
            return;
        }
        let v2 = ix.lru_next[v1] as usize;
        if v2 != 0 {
            let v3 = ix.lru_next[v2] as usize;
            prefetch(&ix.lru_next, v3);
            prefetch(&ix.lru_prev, v3);
            prefetch(&ix.page_entry, v3);
            if let Some(e) = ix.page_entry[v2].checked_sub(1) {
                prefetch(&ix.entries, e as usize);
            }
        }
        if let Some(e) = ix.page_entry[v1].checked_sub(1) {
            if let Some(e) = ix.entries.get(e as usize) {
                ix.table.prefetch(e.key);
            }
        }
        prefetch(&self.refcount, v1);
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
        let (rc, ix) = (&mut self.refcount, &mut self.index);
        let mut k = 0;
        while k < pages.len() {
            let p = pages[k] as usize;
            k += 1;
            if rc[p] != 0 {
                rc[p] += 1;
                continue;
            }
            // CACHED: `p` and the pages after it that are each the LRU
            // predecessor of the one before form one segment of the list.
            // The test folds into one value: a compare-and-branch would let
            // the compiler take the next page from the link just loaded,
            // chaining every load on the one before.
            let first = k - 1;
            while k < pages.len()
                && (ix.lru_prev[pages[k - 1] as usize] ^ pages[k]) | rc[pages[k] as usize] == 0
            {
                k += 1;
            }
            let newer = ix.lru_next[p];
            let older = ix.lru_prev[pages[k - 1] as usize];
            for &q in &pages[first..k] {
                rc[q as usize] = 1;
                ix.lru_prev[q as usize] = 0;
                ix.lru_next[q as usize] = 0;
            }
            ix.lru_next[older as usize] = newer;
            ix.lru_prev[newer as usize] = older;
            ix.lru_len -= k - first;
        }
    }

    /// One holder fewer of each page in `page_lists[range]`, last page
    /// first: freed pages then come back off the stack in their old order,
    /// and cached tail pages are older in the LRU than their parents, so
    /// eviction takes them first. Pages that become CACHED are appended to
    /// the LRU list with its newest end kept in a register, not re-read
    /// from the sentinel each time.
    pub(crate) fn release_pages(&mut self, range: std::ops::Range<usize>) {
        let (rc, ix) = (&mut self.refcount, &mut self.index);
        let mut newest = ix.lru_prev[0];
        let mut pushed = 0;
        for &p in self.page_lists[range].iter().rev() {
            if rc[p as usize] != 1 {
                rc[p as usize] -= 1;
                continue;
            }
            // The last holder: CACHED (count 0) if registered, else FREE
            // (count stays 1).
            if ix.page_entry[p as usize] != 0 {
                rc[p as usize] = 0;
                ix.lru_next[newest as usize] = p;
                ix.lru_prev[p as usize] = newest;
                newest = p;
                pushed += 1;
            } else {
                self.free_pages.push(p);
            }
        }
        ix.lru_next[newest as usize] = 0;
        ix.lru_prev[0] = newest;
        ix.lru_len += pushed;
    }

    /// Evicts up to `n` CACHED pages, least recently used first; returns
    /// how many were evicted. They become FREE (refcount 1).
    ///
    /// The victims are the first `n` pages of the LRU list, so the run is
    /// cut off the list in one relink instead of unlinking page by page,
    /// and the next victims are warmed as in `evict_one`.
    pub fn evict(&mut self, n: usize) -> usize {
        let n = n.min(self.index.lru_len);
        let mut p = self.index.lru_next[0];
        for _ in 0..n {
            let next = self.index.lru_next[p as usize];
            self.prefetch_victims(next);
            let ix = &mut self.index;
            ix.lru_prev[p as usize] = 0;
            ix.lru_next[p as usize] = 0;
            self.unregister_page(p);
            self.push_free(p);
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
            self.push_free(p);
        }
        self.index.clear();
        for c in self.cold.iter_mut() {
            c.restart_chain();
        }
        self.events.cleared();
    }
}
