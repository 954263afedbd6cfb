//! Taking pages for new holders, and eviction: a CACHED page leaves the
//! eviction room's list (`pages/`), its registration leaves the index
//! (`prefix/`), and a Removed event reports it (`events.rs`).

use super::SlotAllocator;

/// Below this many registered pages the index's entries (64 bytes each,
/// in two slabs) fit in a core's L2, so warming victims ahead only costs.
const WARM_INDEX_ENTRIES: usize = 8192;

/// How far a walk over eviction victims runs ahead of their removal
/// (`evict_victims`): enough removals in flight to cover a miss. (16 since
/// the walk's own records are warmed by their victim hints: the tiered
/// page-1 trace's extend -6% against 8.)
const VICTIMS_AHEAD: usize = 16;

impl SlotAllocator {
    /// Takes a page for a new holder: FREE first (its refcount is 1
    /// already), else the next eviction victim. The caller checked
    /// `pages.available()`; 0 only if that check was skipped.
    #[inline]
    pub(super) fn take_page(&mut self) -> u32 {
        match self.pages.pop_free() {
            Some(p) => p,
            None => match self.evict_after_expiry() {
                Some(p) => {
                    self.pages.hold_evicted(p);
                    p
                }
                None => 0,
            },
        }
    }

    /// `evict_one` once the priorities whose duration is over have ended
    /// (which reads the clock only when a duration is pending).
    #[inline]
    fn evict_after_expiry(&mut self) -> Option<u32> {
        self.expire_due();
        self.evict_one()
    }

    /// Evicts the next victim (it becomes unregistered, refcount 0, on no
    /// list: the caller makes it FREE or HELD). With a host tier its entry
    /// may live on in a host copy (`tier.rs`).
    fn evict_one(&mut self) -> Option<u32> {
        let p = self.pages.pop_victim()?;
        self.pages.warm_hinted(p);
        if self.host.is_some() {
            self.drop_device_copy(p, true);
            return Some(p);
        }
        self.prefetch_victims(self.pages.victim());
        self.unregister_page(p);
        Some(p)
    }

    /// Drops `p`'s registration before a request writes into it in place:
    /// an entry with a host copy keeps it.
    pub(super) fn unregister_for_write(&mut self, p: u32) {
        if self.host.is_some() {
            self.drop_device_copy(p, false);
        } else {
            self.unregister_page(p);
        }
    }

    /// Warms what the next evictions will touch. Evictions come in runs (an
    /// extend short of FREE pages, `evict(n)`), and each chases pointers
    /// that miss cache in a big pool: eviction link -> registration ->
    /// entry -> table bucket. Each address is requested as soon as the step
    /// before it can have arrived, so one eviction's misses overlap the next
    /// three's: the record (links, registration, count) of the victim three
    /// ahead, the entry of the one two ahead, and the bucket of the next,
    /// `v1` (0: none).
    ///
    /// Not at page size 1, where it costs more than it saves. There a
    /// victim run is a long chain tail, one victim per token, whose entries
    /// a registration pass filed in consecutive slab slots (the hardware
    /// streams them), and the warming's own dependent loads, one call a
    /// victim, come on top: without it the pressure trace's prompt extends
    /// at page 1 take about a third less time (benchmarks/results/history,
    /// stop 61).
    #[inline(always)]
    fn prefetch_victims(&self, v1: u32) {
        if v1 == 0 || self.geo.page_size == 1 || self.prefix.len() < WARM_INDEX_ENTRIES {
            return;
        }
        self.warm_victims(v1);
    }

    /// `prefetch_victims` past its check, a call of its own so that the
    /// check stays a few instructions inside the eviction loops.
    #[inline(never)]
    fn warm_victims(&self, v1: u32) {
        let v2 = self.pages.next_victim(v1);
        if v2 != 0 {
            self.pages.prefetch_record(self.pages.next_victim(v2));
            self.prefix.prefetch_removal(self.pages.entry(v2));
        }
        self.prefix.prefetch_bucket_of(self.pages.entry(v1));
    }

    /// Drops `p`'s registration and reports it.
    pub(super) fn unregister_page(&mut self, p: u32) {
        let entry = self.pages.take_entry(p);
        if entry != 0 {
            let id = self.prefix.unregister(entry);
            self.events.removed(id.hash, p, id.salt);
        }
    }

    /// Evicts up to `n` CACHED pages, the eviction room's victims in order
    /// (the lowest retention priority first, least recently used within
    /// one; pinned pages never); returns how many were evicted. They become
    /// FREE (refcount 1). With a host tier, an entry keeps its host copy,
    /// and under `write_back` an entry without one is offloaded (see
    /// `take_offloads`).
    ///
    /// The victims are walked in order and leave their lists in one relink
    /// instead of one unlink each, and the next victims are warmed as in
    /// `evict_one`.
    pub fn evict(&mut self, n: usize) -> usize {
        self.expire_due();
        if self.host.is_some() {
            return self.evict_tiered(n);
        }
        let n = n.min(self.pages.cached());
        // One loop per policy, chosen once: on one list the next victim is
        // the next link, and the loop reads nothing else to find it.
        if self.pages.has_priorities() {
            self.evict_victims::<false>(n)
        } else {
            self.evict_victims::<true>(n)
        }
    }

    /// Evicts the `n` victims an extend will take once the free stack runs
    /// out, in one walk of the eviction list and one relink (as `evict`
    /// takes them), and slides them beneath the free stack in victim order:
    /// the extend's pages then come off the stack's own pages first and the
    /// victims after them, in order, exactly as one eviction a page would
    /// give them, where that unlinked each victim on its own. Does nothing
    /// where something else can happen between two evictions: with a host
    /// tier (whose copies change what an eviction does) or priorities
    /// (whose ends can move victims between lists); the extend then evicts
    /// page by page as it goes.
    pub(super) fn evict_beneath_free(&mut self, n: usize) {
        if self.host.is_some() || self.pages.has_priorities() {
            return;
        }
        let n = n.min(self.pages.cached());
        self.evict_victims::<true>(n);
        self.pages.sink_free_top(n);
    }

    /// `evict`'s walk over `n` victims (`ONE_LIST`: the pool has no
    /// priorities). Victims stay on their lists until the one relink at the
    /// end, and a removal changes no other victim's record, so walking ahead
    /// of the removals (`evict_warmed`) finds the victims a walk one at a
    /// time would.
    #[inline(always)]
    fn evict_victims<const ONE_LIST: bool>(&mut self, n: usize) -> usize {
        let mut p = self.pages.victim();
        if self.prefix.len() >= WARM_INDEX_ENTRIES {
            p = self.evict_warmed::<ONE_LIST>(p, n);
        } else {
            for _ in 0..n {
                let next = self.walk_victim::<ONE_LIST>(p);
                self.unregister_page(p);
                self.pages.free_evicted(p);
                p = next;
            }
        }
        self.pages.remove_victims(n, p);
        n
    }

    /// `evict_victims` in a big index: evicts the `n` victims from `p` on
    /// and returns the one after them.
    ///
    /// The walk runs VICTIMS_AHEAD victims ahead of the evictions, and warms
    /// what removing each victim reads (its entry, identity and run slot) as
    /// it passes. Only the walk itself is serial, one record a victim (its
    /// link); a removal's own misses, where victims' entries lie scattered
    /// (a closing request's output, filed one decode step at a time), then
    /// overlap the next removals' instead of following each other. The
    /// record the warming reads is the one the walk reads for the link, so
    /// unlike `prefetch_victims` it adds no dependent load, and it pays at
    /// page size 1 too.
    #[inline(never)]
    fn evict_warmed<const ONE_LIST: bool>(&mut self, mut p: u32, n: usize) -> u32 {
        let mut ahead = [0u32; VICTIMS_AHEAD];
        for slot in ahead.iter_mut().take(n) {
            *slot = p;
            p = self.walk_warmed::<ONE_LIST>(p);
        }
        for j in 0..n {
            let v = ahead[j % VICTIMS_AHEAD];
            if j + VICTIMS_AHEAD < n {
                ahead[j % VICTIMS_AHEAD] = p;
                p = self.walk_warmed::<ONE_LIST>(p);
            }
            if j + 1 < n {
                // Its entry was warmed a few victims ago: a keyed one's
                // bucket can be asked for now.
                let next = ahead[(j + 1) % VICTIMS_AHEAD];
                self.prefix.prefetch_bucket_of(self.pages.entry(next));
            }
            self.unregister_page(v);
            self.pages.free_evicted(v);
        }
        p
    }

    /// The victim after `p`.
    #[inline(always)]
    fn walk_victim<const ONE_LIST: bool>(&self, p: u32) -> u32 {
        if ONE_LIST {
            self.pages.next_on_list(p)
        } else {
            self.pages.next_victim(p)
        }
    }

    /// The victim after `p`, once what removing `p` reads is on its way.
    #[inline(always)]
    fn walk_warmed<const ONE_LIST: bool>(&self, p: u32) -> u32 {
        self.pages.warm_hinted(p);
        self.prefix.prefetch_removal(self.pages.entry(p));
        self.walk_victim::<ONE_LIST>(p)
    }

    /// Drops every index entry: CACHED pages become FREE, pinned ones too,
    /// HELD pages stay with their holders, unregistered (so nothing is
    /// pinned or has a priority any more); so do host copies (swapped-out
    /// requests keep their host pages, queued transfers theirs). Emits one
    /// Cleared event. Costs O(registered pages + max_requests).
    ///
    /// Queued copies stay: each one fills a page an open request still
    /// reads (its own, or through a later copy out of it), so dropping it
    /// would leave that request reading another page's leftovers; its
    /// source stays held until it is taken. The copies of released pages
    /// are gone already (`pages/copies.rs`).
    pub fn clear_cache(&mut self) {
        if self.host.is_some() {
            return self.clear_tiered();
        }
        while let Some(p) = self.pages.pop_cached() {
            let entry = self.pages.take_entry(p);
            if entry != 0 {
                self.prefix.unregister_no_ghost(entry);
            }
            self.pages.free_evicted(p);
        }
        self.pages.clear_priorities();
        let pages = &mut self.pages;
        self.prefix
            .clear(|page, entry| pages.clear_entry_if(page, entry));
        self.requests.restart_chains();
        self.events.cleared();
    }
}
