//! The prefix index: lookup key -> registered page (`key_table.rs`), the
//! registration of each page (its chain hash, key, salt and parent), the LRU
//! list of CACHED pages and the token ids of every slot.
//!
//! Verification. Every registration gets a unique id, and records its salt
//! and the id of its parent's registration (0 for a chain's first page). A
//! lookup accepts entry `e` for page `k` of a prompt only if
//! - `e`'s page holds exactly the prompt's tokens of page `k`,
//! - `e.salt` is the request's salt, and
//! - `e.parent_reg` is the id of the entry accepted for page `k - 1` (0 for k = 0).
//!
//! By induction the accepted pages hold KV computed for exactly the prompt's
//! tokens and salt, whatever the hash does: a collision (or an evicted and
//! re-registered parent) fails a check and ends the match, so it costs a
//! miss, never wrong KV. The cost is one compare of page_size token ids per
//! matched page (the cache line the hit reads anyway), measured in
//! examples/bench_core.rs. The token ids live in a flat per-slot array,
//! 4 bytes per slot, allocated fallibly with lazily mapped zero pages.
//!
//! A page is filed under its lookup key, its chain hash folded to 64 bits
//! (`keys.rs`); events and transfers use the 128-bit hash itself.
//!
//! Duplicates: when `cache()` finds the key already registered for another
//! page with the same content (verified as above), the existing entry is
//! kept and the new page stays unregistered (freed when its holders leave).
//! Keeping the first copy keeps its registration id, so the entries already
//! registered below it (its chain's children) stay reachable; routers have
//! already seen its Stored event; and requests holding it keep sharing it.

use crate::error::Result;
use crate::hashing::ChainHasher;
use crate::key_table::KeyTable;
use crate::keys::key_of;
use crate::lookup::ChainTip;
use crate::memory::{fault_in, reserve, zeroed_vec};
use crate::page_state::{PageState, UNHELD};

/// Pages registration hashes (and prefetches) ahead of its probes, and the
/// most a lookup does: enough to overlap the probes' cache misses, few
/// enough that a miss early in a long prompt wastes little hashing.
pub(crate) const LOOKAHEAD: usize = 32;

/// Keys the table makes room for when it first grows: every page of the
/// pool, up to 2^20 (a 16 MiB table at load <= 1/2).
///
/// Why not double from small: each doubling moves every key, and its new
/// buckets are fresh zero pages the kernel faults in one by one, so the
/// doubling at 262K keys stalled a step ~10 ms (page 1, 1M slots), and the
/// doublings took about a third of `cache()`'s time while the index
/// filled (page 1: 184 -> 120 ns per registered page). Why a bound: sizing
/// a 16M-page pool's table up front took 256 MiB, which random inserts
/// fault in almost at once; past the bound the table doubles as before.
pub(crate) const TABLE_FLOOR_KEYS: usize = 1 << 20;

/// One registered page: what a hinted walk reads at every hop (32 bytes).
/// Its chain hash and salt are an `Identity` at the same slab index.
///
/// Why two records: at page size 1 a cached prompt's walk reads one entry
/// per token, and a chain's entries sit one after another in the slab, so
/// the walk streams them. With the hash and salt inside (64 bytes) it read
/// twice the memory, and a prompt's 2.3K entries came from DRAM at every
/// admission of the page-1 prefix trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    /// Unique id of this registration (never reused; 0 means none).
    pub(crate) reg: u64,
    /// `reg` of the parent page's entry when this page was registered.
    pub(crate) parent_reg: u64,
    pub(crate) page: u32,
    /// The page's first token id (its only one at page size 1), kept where
    /// a hinted walk reads anyway: at page size 1 a hop then verifies
    /// from this one cache line, without a dependent load of the token.
    pub(crate) first_token: i32,
    /// Entry index + 1 of the latest child registered or re-verified under
    /// this entry (0 = none): a hint for the next lookup (`lookup.rs`),
    /// never trusted.
    pub(crate) child: u32,
}

/// What names a registered page's content: its chain hash (its identity in
/// events and transfers; its lookup key is `key_of(hash)`, `keys.rs`) and
/// the salt its chain was registered under.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Identity {
    pub(crate) hash: u128,
    pub(crate) salt: i64,
}

/// `parent_reg` of a freed slab slot: no chain tip has it, so a stale child
/// hint to the slot never verifies.
pub(crate) const DEAD: u64 = u64::MAX;

#[derive(Debug, Clone)]
pub(crate) struct PrefixIndex {
    pub(crate) table: KeyTable,
    /// Entry slab; `free_entries` lists unused indices. `idents[i]` is
    /// entry `i`'s hash and salt.
    pub(crate) entries: Vec<Entry>,
    pub(crate) idents: Vec<Identity>,
    pub(crate) free_entries: Vec<u32>,
    /// Every page's holder count, registration (entry index + 1, 0 when
    /// unregistered) and links in the intrusive doubly linked LRU list of
    /// the CACHED pages, one record a page (`page_state.rs`). Page 0 (never
    /// handed out) is the list's sentinel: `state[0].next` is the oldest
    /// page, `state[0].prev` the newest.
    pub(crate) state: Vec<PageState>,
    pub(crate) lru_len: usize,
    /// Token id at every slot (meaningful where a request or entry says so).
    pub(crate) tokens: Vec<i32>,
    pub(crate) hasher: ChainHasher,
    /// The chain hashes of the next pages a lookup or registration probes.
    pub(crate) hash_scratch: Vec<u128>,
    pub(crate) next_reg: u64,
    pub(crate) page_size: usize,
    /// Benchmark only (see `Options::skip_hit_verification`).
    pub(crate) skip_verify: bool,
}

impl PrefixIndex {
    /// With `fault_in_tokens`, the token ids of the lowest slots (pages are
    /// handed out lowest first) are mapped now rather than at a first burst
    /// that passes its prompts' ids (see `memory::fault_in`).
    pub(crate) fn new(
        num_pages: usize,
        num_slots: usize,
        page_size: usize,
        seed: u64,
        weak_bits: u32,
        fault_in_tokens: bool,
    ) -> Result<Self> {
        let mut hash_scratch = Vec::new();
        reserve(&mut hash_scratch, LOOKAHEAD, "chain hashes")?;
        let hasher = ChainHasher::new(seed, weak_bits);
        let mut tokens = zeroed_vec(num_slots, "slot token ids")?;
        if fault_in_tokens {
            fault_in(&mut tokens, TOKENS_FAULT_IN_BYTES);
        }
        Ok(PrefixIndex {
            table: KeyTable::default(),
            entries: Vec::new(),
            idents: Vec::new(),
            free_entries: Vec::new(),
            state: page_states(num_pages)?,
            lru_len: 0,
            tokens,
            hasher,
            hash_scratch,
            next_reg: 1,
            page_size,
            skip_verify: false,
        })
    }

    #[inline]
    pub(crate) fn is_registered(&self, page: u32) -> bool {
        self.state[page as usize].is_registered()
    }

    /// Index of the entry filed under `key`.
    #[inline]
    pub(crate) fn find(&self, key: u64) -> Option<u32> {
        self.table.find(key, |e| {
            self.idents.get(e as usize).map(|x| key_of(x.hash)) == Some(key)
        })
    }

    /// The entry filed under `key`, with its index.
    #[inline]
    pub(crate) fn lookup(&self, key: u64) -> Option<(u32, &Entry)> {
        let i = self.find(key)?;
        Some((i, self.entries.get(i as usize)?))
    }

    /// The chain tip at live entry `i`.
    #[inline]
    pub(crate) fn tip(&self, i: u32) -> ChainTip {
        ChainTip {
            hash: self.idents[i as usize].hash,
            reg: self.entries[i as usize].reg,
            entry: i + 1,
        }
    }

    /// The chain tip at `page`'s registration and its salt, if it has one.
    #[inline]
    pub(crate) fn tip_of(&self, page: u32) -> Option<(ChainTip, i64)> {
        let i = self.state[page as usize].entry.checked_sub(1)?;
        let id = self.idents.get(i as usize)?;
        Some((self.tip(i), id.salt))
    }

    /// The chain hashes of consecutive pages (their token ids, in order)
    /// chained on from `hash`, into `out`; each one's table bucket is
    /// prefetched as soon as its hash is known, so the probes that follow
    /// overlap their misses.
    #[inline]
    pub(crate) fn hashes_ahead<'t>(
        &self,
        mut hash: u128,
        pages: impl Iterator<Item = &'t [i32]>,
        out: &mut Vec<u128>,
    ) {
        out.clear();
        for tokens in pages {
            hash = self.hasher.page(hash, tokens);
            self.table.prefetch(key_of(hash));
            out.push(hash);
        }
    }

    /// Number of registered pages.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    #[inline]
    pub(crate) fn page_tokens(&self, page: u32) -> &[i32] {
        let ps = self.page_size;
        &self.tokens[page as usize * ps..(page as usize + 1) * ps]
    }

    /// Whether entry `i` may stand for a page with `tokens` under a parent
    /// registration `parent_reg` and `salt` (see the module docs).
    #[inline]
    pub(crate) fn verify(&self, i: u32, tokens: &[i32], salt: i64, parent_reg: u64) -> bool {
        let e = &self.entries[i as usize];
        // `skip_verify` skips the token compare only: the parent and salt
        // checks are what a hinted walk's salt relies on (`lookup.rs`).
        e.parent_reg == parent_reg
            && self.idents[i as usize].salt == salt
            && (self.skip_verify || self.holds(e, tokens))
    }

    /// Whether `e`'s page holds `tokens` (one page's worth, never empty).
    #[inline]
    pub(crate) fn holds(&self, e: &Entry, tokens: &[i32]) -> bool {
        debug_assert_eq!(e.first_token, self.page_tokens(e.page)[0]);
        e.first_token == tokens[0]
            && (self.page_size == 1 || same_tokens(self.page_tokens(e.page), tokens))
    }

    /// Registrations still possible: the pool's pages not registered yet
    /// (`state` has one element per page, page 0 included, which is
    /// never registered).
    pub(crate) fn room(&self) -> usize {
        self.state.len().saturating_sub(1 + self.table.len())
    }

    /// Room for `n` more registrations, or a typed error (nothing changed).
    /// `n` is an upper bound (forked requests count their shared pages once
    /// each); a page is registered at most once, so no more than the pool's
    /// unregistered pages are reserved and the index's memory stays bounded
    /// by the pool's size however requests share.
    pub(crate) fn reserve(&mut self, n: usize) -> Result<()> {
        let n = n.min(self.room());
        let spare = self.free_entries.len();
        reserve(
            &mut self.entries,
            n.saturating_sub(spare),
            "prefix index entries",
        )?;
        reserve(
            &mut self.idents,
            n.saturating_sub(spare),
            "prefix index entries",
        )?;
        // The table is sized at once for the pool's pages, up to
        // TABLE_FLOOR_KEYS; only past that does it double. That sizing is
        // an optimization: if it cannot be allocated, room for `n` is all
        // the call needs.
        let floor = (self.len() + self.room()).min(TABLE_FLOOR_KEYS);
        let want = floor.saturating_sub(self.len());
        if n > 0 && want > n && self.table.reserve(want).is_ok() {
            return Ok(());
        }
        self.table.reserve(n)
    }

    /// Registers `page` (chain hash `hash`) as the child of `parent`;
    /// returns its tip. The caller reserved room, checked that the hash's
    /// key is absent and `page` unregistered.
    pub(crate) fn register(
        &mut self,
        page: u32,
        hash: u128,
        parent: &ChainTip,
        salt: i64,
    ) -> ChainTip {
        let reg = self.next_reg;
        self.next_reg += 1;
        let e = Entry {
            reg,
            parent_reg: parent.reg,
            page,
            first_token: self.tokens[page as usize * self.page_size],
            child: 0,
        };
        let id = Identity { hash, salt };
        let idx = match self.free_entries.pop() {
            Some(i) => {
                self.entries[i as usize] = e;
                self.idents[i as usize] = id;
                i
            }
            None => {
                self.entries.push(e);
                self.idents.push(id);
                (self.entries.len() - 1) as u32
            }
        };
        self.table.insert(key_of(hash), idx);
        self.state[page as usize].entry = idx + 1;
        self.set_hint(parent, idx);
        ChainTip {
            hash,
            reg,
            entry: idx + 1,
        }
    }

    /// Removes `page`'s registration (the caller handles LRU membership);
    /// returns its hash and salt.
    // Inlined into eviction's loop: as a call, which returns the 32-byte
    // identity through memory, evict(256) took 2.65 instead of ~2.3 us.
    #[inline(always)]
    pub(crate) fn unregister(&mut self, page: u32) -> Option<Identity> {
        let idx = std::mem::replace(&mut self.state[page as usize].entry, 0);
        if idx == 0 {
            return None;
        }
        let e = self.idents[idx as usize - 1];
        self.table.remove(key_of(e.hash), idx - 1);
        self.entries[idx as usize - 1].parent_reg = DEAD;
        self.free_entries.push(idx - 1);
        Some(e)
    }

    /// Drops every registration (the LRU list must be empty already).
    ///
    /// Costs what was registered, not what the pool could hold: the table
    /// is sized up front for the pool's pages, up to TABLE_FLOOR_KEYS (1 MiB
    /// of buckets at 64K pages, 16 MiB from 1M pages on), so sweeping it
    /// made `clear_cache` of a few pages cost a full pass over it. The slab
    /// holds only what was ever registered; a live entry is the one its
    /// page's record points back to.
    pub(crate) fn clear(&mut self) {
        // Past an eighth full, one memset beats a probe per key.
        let sparse = self.table.len().saturating_mul(8) < self.table.buckets();
        for (i, (e, id)) in self.entries.iter().zip(&self.idents).enumerate() {
            let Some(s) = self.state.get_mut(e.page as usize) else {
                continue;
            };
            if s.entry as usize == i + 1 {
                s.entry = 0;
                if sparse {
                    self.table.remove(key_of(id.hash), i as u32);
                }
            }
        }
        if !sparse || self.table.len() != 0 {
            // Dense, or keys the slab did not account for (only a corrupted
            // index has those): the whole table.
            self.table.clear();
        }
        self.entries.clear();
        self.idents.clear();
        self.free_entries.clear();
    }

    /// Appends `p` as the newest CACHED page (a request's release appends
    /// its pages in bulk, `SlotAllocator::release_pages`; this is for one
    /// page, a waiting copy's source let go; tests corrupt the list with it).
    pub(crate) fn lru_push(&mut self, p: u32) {
        let newest = self.state[0].prev;
        self.state[newest as usize].next = p;
        let s = &mut self.state[p as usize];
        (s.prev, s.next) = (newest, 0);
        self.state[0].prev = p;
        self.lru_len += 1;
    }

    #[inline]
    pub(crate) fn lru_remove(&mut self, p: u32) {
        let s = &mut self.state[p as usize];
        let (prev, next) = (s.prev, s.next);
        (s.prev, s.next) = (0, 0);
        self.state[prev as usize].next = next;
        self.state[next as usize].prev = prev;
        self.lru_len -= 1;
    }

    /// Removes and returns the least recently used CACHED page.
    #[inline]
    pub(crate) fn lru_pop_oldest(&mut self) -> Option<u32> {
        let p = self.state[0].next;
        if p == 0 {
            return None;
        }
        self.lru_remove(p);
        Some(p)
    }

    pub(crate) fn metadata_bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Entry>()
            + self.idents.capacity() * std::mem::size_of::<Identity>()
            + self.free_entries.capacity() * 4
            + self.table.capacity_bytes()
            + self.hash_scratch.capacity() * 16
            + self.state.capacity() * std::mem::size_of::<PageState>()
            + self.tokens.capacity() * 4
    }
}

/// Page contents equal. XOR-folding the whole page vectorizes and stays
/// inline, where `==` calls memcmp (a third of a hit's cost at page 16).
#[inline]
pub(crate) fn same_tokens(a: &[i32], b: &[i32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Token ids mapped at construction: the first 4M slots, what a first burst of
/// up to 4M prompt tokens writes (16 MiB; the whole array below 4M slots).
const TOKENS_FAULT_IN_BYTES: usize = 16 << 20;

/// Every page FREE (all zeros, see `page_state.rs`) except page 0, which
/// is never held. Mapped lazily (unlike the page lists and the lowest token
/// ids, which construction maps): a page's record costs memory once the page
/// is used, and a pool that never caches (no index) never writes the array.
/// Until a record is written, every read of it lands on the one shared zero
/// page, so a churning pool's reads of FREE records stay in cache; written at
/// construction they would be 16 bytes a page read from memory (256 MiB at
/// 16M pages), which slows the page-1 churn step of a large pool.
fn page_states(num_pages: usize) -> Result<Vec<PageState>> {
    let mut state = zeroed_vec::<PageState>(num_pages, "page states")?;
    if let Some(s0) = state.first_mut() {
        s0.extra = UNHELD;
    }
    Ok(state)
}
