//! The prefix index: lookup key -> registered page (`key_table.rs`), the
//! registration of each page (its chain hash, key, salt and parent) and the
//! token ids of every slot.
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
//! matched page (the cache line the hit reads anyway; `bench_core` measures
//! it). The token ids live in a flat per-slot array,
//! 4 bytes per slot, allocated fallibly with lazily mapped zero pages.
//!
//! A page is filed under its lookup key, its chain hash folded to 64 bits
//! (`keys.rs`), unless its parent's hint reaches it (`links.rs`); events
//! and transfers use the 128-bit hash itself.
//!
//! Tiers. An entry is one registered content, wherever its bytes are: its
//! `page` is its device page, or its host page (a `location.rs` host
//! location) when the device copy is gone, and `host` names its host copy
//! (0: none). A host-only entry is verified exactly as a device one (the
//! index keeps every host page's token ids too), and chain verification by
//! induction over parent registrations crosses tiers unchanged: the entry,
//! and its registration id, are the same whichever tier holds the bytes.
//!
//! Duplicates: when `cache()` finds the key already registered for another
//! page with the same content (verified as above), the existing entry is
//! kept: its registration id stays, so the entries already registered below
//! it (its chain's children) stay reachable. Where some holder has the
//! existing copy, the new page stays unregistered (freed when its holders
//! leave) and the holders keep sharing the copy. Where nobody holds it
//! (CACHED), the new page becomes the entry's copy and the old one goes
//! FREE (`allocator/cache.rs`): kept, the unheld copy would be evicted
//! first, taking the entry, while the request still holds the content.
//!
//! Orphans: an entry whose parent registration is gone (`links.rs`) can
//! no longer be hit, but keeps its key. The gone parent left a ghost
//! (`ghosts.rs`): a page registered with its content on its prefix takes
//! its registration back, and the orphans are reached again. Where none
//! was kept, when `cache()` finds an orphan under a page's key with the
//! page's content and salt, the orphan leaves the index (as an eviction
//! takes it) and the page is registered in its place under the current
//! parent (`allocator/orphans.rs`). An entry whose parent is live but not
//! the page's parent stops the chain (a collision).

use super::ghost_table::Ghosts;
use super::hashing::{ChainHasher, ChainKind};
use super::key_table::KeyTable;
use super::keys::key_of;
use super::runs::Runs;
use super::tip::ChainTip;
use crate::error::Result;
use crate::memory::{fault_in, prefetch, reserve, zeroed_vec};

/// Pages registration hashes (and prefetches) ahead of its probes, and the
/// most a lookup does: enough to overlap the probes' cache misses, few
/// enough that a miss early in a long prompt wastes little hashing.
pub(crate) const LOOKAHEAD: usize = 32;

/// Token ids mapped at construction: the first 4M slots, what a first burst of
/// up to 4M prompt tokens writes (16 MiB; the whole array below 4M slots).
const TOKENS_FAULT_IN_BYTES: usize = 16 << 20;

/// Bytes of each slab array (`entries`, `idents`) the first `reserve` maps:
/// 2^20 entries of 32 bytes, every page of a pool up to 1M pages.
pub(super) const SLAB_MAP_BYTES: usize = 32 << 20;

/// Keys the table makes room for when it first grows: every page of the
/// pool, up to 2^20 (a 16 MiB table at load <= 1/2).
///
/// Why not double from small: each doubling moves every key, and its new
/// buckets are fresh zero pages the kernel faults in one by one, so a
/// doubling stalls the step that triggers it, and while the index fills
/// the doublings are a large part of `cache()`'s time. Why a bound: a
/// 16M-page pool's table sized up front would take 256 MiB, which random
/// inserts fault in almost at once; past the bound the table doubles,
/// incrementally (`key_table/migrate.rs`): the growing call only allocates,
/// and the inserts after it move the keys and fault the new array in a few
/// pages at a time.
pub(super) const TABLE_FLOOR_KEYS: usize = 1 << 20;

/// One registered page: what a hinted walk reads at every hop (32 bytes).
/// Its chain hash and salt are an `Identity` at the same slab index.
///
/// Two records, because at page size 1 a cached prompt's walk reads one
/// entry per token, and a chain's entries sit one after another in the
/// slab, so the walk streams them: with the hash and salt inside (64
/// bytes) it would read twice the memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Entry {
    /// Unique id of this registration (0 means none): never reused, but
    /// by a revival of the same verified prefix (`ghosts.rs`).
    pub(super) reg: u64,
    /// `reg` of the parent page's entry when this page was registered.
    pub(super) parent_reg: u64,
    /// The device page, or the host location of the host copy when the
    /// entry has no device copy (`location.rs`).
    pub(super) page: u32,
    /// The page's first token id (its only one at page size 1), kept where
    /// a hinted walk reads anyway: at page size 1 a hop then verifies
    /// from this one cache line, without a dependent load of the token.
    pub(super) first_token: i32,
    /// Entry index + 1 of the latest child registered or re-verified under
    /// this entry (0 = none): a hint for the next lookup (`lookup.rs`),
    /// never trusted.
    pub(super) child: u32,
    /// The host page holding a copy (0: none). In the entry's padding: the
    /// walk's 32 bytes stay 32.
    pub(super) host: u32,
}

/// What names a registered page's content: its chain hash (its identity in
/// events and transfers; its lookup key is `key_of(hash)`, `keys.rs`) and
/// the salt its chain was registered under.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Identity {
    pub(crate) hash: u128,
    pub(crate) salt: i64,
    /// Entry index + 1 of the parent when this page was registered or
    /// relinked (0 at a chain's first page): live while that slot's `reg`
    /// is still `parent_reg` (`parent_hash`).
    pub(crate) parent: u32,
    /// Whether the entry is in the key table (`links::KEYED`) and how many
    /// live children it has (`links.rs`). In the record's padding.
    pub(crate) links: u32,
}

/// `parent_reg` of a freed slab slot: no chain tip has it, so a stale child
/// hint to the slot never verifies.
pub(super) const DEAD: u64 = u64::MAX;

#[derive(Debug, Clone)]
pub(crate) struct PrefixIndex {
    pub(super) table: KeyTable,
    /// Entry slab; `free_entries` lists unused indices. `idents[i]` is
    /// entry `i`'s hash and salt.
    pub(super) entries: Vec<Entry>,
    pub(super) idents: Vec<Identity>,
    pub(super) free_entries: Vec<u32>,
    /// Stretches of the slab filed one under another, with their tokens and
    /// locations side by side (page size 1, `runs.rs`).
    pub(super) runs: Runs,
    /// Token id at every slot (meaningful where a request or entry says so).
    pub(super) tokens: Vec<i32>,
    /// Token id at every host slot (a host tier's pages; empty without one).
    pub(super) host_tokens: Vec<i32>,
    pub(super) hasher: ChainHasher,
    /// The chain hashes of the next pages a lookup or registration probes.
    pub(super) hash_scratch: Vec<u128>,
    pub(super) next_reg: u64,
    /// Live entries, keyed or not (`links.rs`).
    pub(super) live: usize,
    /// Live entries whose parent registration is gone (`links.rs`).
    pub(super) orphans: usize,
    /// Removed entries with children, which a recomputation of their
    /// content revives (`ghosts.rs`).
    pub(super) ghosts: Box<Ghosts>,
    /// Registrations removed so far (evicted, dropped or cleared), and
    /// device copies an entry lost while keeping its host copy, wrapping:
    /// a request whose chain passes through another's entry rechecks it
    /// when this moved (`SlotAllocator::restart_dead_chain`).
    pub(super) removals: u32,
    pub(super) page_size: usize,
    /// Entries that can be live at once: one per page of the pool and of
    /// its host tier, page 0 of each aside (`enable_host`).
    pub(super) max_entries: usize,
    /// Benchmark only (see `Options::skip_hit_verification`).
    pub(super) skip_verify: bool,
    /// The first `reserve` reserves and maps the slab for every page (see
    /// `new`).
    pub(super) map_slab_first: bool,
}

impl PrefixIndex {
    /// With `map_now`, the token ids of the lowest slots (pages are handed
    /// out lowest first) are mapped now rather than at a first burst that
    /// passes its prompts' ids (see `memory::fault_in`), and the first
    /// `reserve` reserves the entry slab for every page and maps its start
    /// (`memory::reserve_mapped`).
    pub(crate) fn new(
        num_pages: usize,
        page_size: usize,
        seed: u64,
        weak_bits: u32,
        skip_verify: bool,
        map_now: bool,
        kind: ChainKind,
    ) -> Result<Self> {
        let mut hash_scratch = Vec::new();
        reserve(&mut hash_scratch, LOOKAHEAD, "chain hashes")?;
        let hasher = ChainHasher::new(seed, weak_bits, kind);
        let mut tokens = zeroed_vec(num_pages * page_size, "slot token ids")?;
        if map_now {
            fault_in(&mut tokens, TOKENS_FAULT_IN_BYTES);
        }
        Ok(PrefixIndex {
            table: KeyTable::default(),
            entries: Vec::new(),
            idents: Vec::new(),
            free_entries: Vec::new(),
            runs: Runs::new(page_size),
            tokens,
            host_tokens: Vec::new(),
            hasher,
            hash_scratch,
            next_reg: 1,
            live: 0,
            orphans: 0,
            ghosts: Box::default(),
            removals: 0,
            page_size,
            max_entries: num_pages.saturating_sub(1),
            skip_verify,
            map_slab_first: map_now,
        })
    }

    /// The seed every chain hash of this index is keyed with.
    pub(crate) fn hash_seed(&self) -> u64 {
        self.hasher.seed()
    }

    /// Registrations removed so far, wrapping (see `removals`).
    #[inline]
    pub(crate) fn removals(&self) -> u32 {
        self.removals
    }

    /// An entry's device copy went and its host copy stayed: chains through
    /// it are walked again at their next `cache()`, where a request's own
    /// duplicate of its content becomes its device copy (see `walk_chain`).
    #[inline]
    pub(crate) fn note_device_copy_lost(&mut self) {
        self.removals = self.removals.wrapping_add(1);
    }

    /// Number of registered pages (live entries).
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    /// The live entries' slab indices.
    pub(super) fn live_entries(&self) -> impl Iterator<Item = u32> + '_ {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.parent_reg != DEAD)
            .map(|(i, _)| i as u32)
    }

    /// Index of the entry filed under `key`.
    #[inline]
    pub(super) fn find(&self, key: u64) -> Option<u32> {
        self.table.find(key, |e| {
            self.idents.get(e as usize).map(|x| key_of(x.hash)) == Some(key)
        })
    }

    /// The entry filed under chain hash `hash`'s key, and its location.
    #[inline]
    pub(crate) fn lookup(&self, hash: u128) -> Option<(u32, u32)> {
        let i = self.find(key_of(hash))?;
        Some((i, self.entries.get(i as usize)?.page))
    }

    /// The salt entry `i` was registered under.
    #[inline]
    pub(crate) fn salt_of(&self, i: u32) -> i64 {
        self.idents[i as usize].salt
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

    /// The chain tip at a page's registration `entry` (index + 1, as its
    /// record names it) and its salt, if it has one.
    #[inline]
    pub(crate) fn tip_at(&self, entry: u32) -> Option<(ChainTip, i64)> {
        let i = entry.checked_sub(1)?;
        let id = self.idents.get(i as usize)?;
        Some((self.tip(i), id.salt))
    }

    // ---- verification ----

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
    pub(super) fn holds(&self, e: &Entry, tokens: &[i32]) -> bool {
        debug_assert_eq!(e.first_token, self.location_tokens(e.page)[0]);
        e.first_token == tokens[0]
            && (self.page_size == 1 || same_tokens(self.location_tokens(e.page), tokens))
    }

    // ---- prefetching ahead of an eviction run ----

    /// Starts loading what removing registration `entry` (index + 1) reads
    /// first: its entry, identity and run slot.
    #[inline]
    pub(crate) fn prefetch_removal(&self, entry: u32) {
        if let Some(e) = entry.checked_sub(1) {
            prefetch(&self.idents, e as usize);
            prefetch(&self.entries, e as usize);
            self.runs.prefetch(e);
        }
    }

    /// Starts loading the table bucket of registration `entry` (index + 1),
    /// if it is filed there: removing an unkeyed entry reads no bucket
    /// (`links.rs`), and at page size 1 most entries are unkeyed, so a
    /// prefetch of theirs only loads a line, and a TLB entry, nobody reads.
    #[inline]
    pub(crate) fn prefetch_bucket_of(&self, entry: u32) {
        if let Some(e) = entry.checked_sub(1) {
            if let Some(id) = self.idents.get(e as usize) {
                if self.is_keyed(e) {
                    self.table.prefetch(key_of(id.hash));
                }
            }
        }
    }

    /// Starts loading the bucket of chain hash `hash`'s key.
    #[inline]
    pub(crate) fn prefetch_bucket(&self, hash: u128) {
        self.table.prefetch(key_of(hash));
    }

    /// Starts loading `page`'s token ids.
    #[inline]
    pub(crate) fn prefetch_tokens(&self, page: u32) {
        prefetch(&self.tokens, page as usize * self.page_size);
    }

    pub(crate) fn metadata_bytes(&self) -> usize {
        self.host_tokens.capacity() * 4
            + self.entries.capacity() * std::mem::size_of::<Entry>()
            + self.idents.capacity() * std::mem::size_of::<Identity>()
            + self.free_entries.capacity() * 4
            + self.runs.capacity_bytes()
            + self.table.capacity_bytes()
            + self.hash_scratch.capacity() * 16
            + self.tokens.capacity() * 4
            + self.ghosts.capacity_bytes(self.page_size)
    }
}

/// Page contents equal. XOR-folding the whole page vectorizes and stays
/// inline, where `==` calls memcmp (a large part of a hit's cost at page 16).
#[inline]
fn same_tokens(a: &[i32], b: &[i32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0, |acc, (x, y)| acc | (x ^ y)) == 0
}
