//! The page pool: every page's state and the transitions between them,
//! each O(1):
//!
//! ```text
//! FREE   --take-->            HELD (refcount 1)
//! CACHED --take (evict)-->    HELD (refcount 1), Removed event
//! CACHED --hit-->             HELD (leaves the eviction list)
//! HELD   --release last-->    CACHED if registered (an eviction candidate), else FREE
//! CACHED --evict-->           FREE, Removed event
//! ```
//!
//! A FREE page is on the free stack; a CACHED page is registered with
//! refcount 0 and listed by the eviction room (`eviction/`); a HELD page
//! has refcount >= 1. Each page's count, registration and eviction links
//! share one record (`record.rs`); a request's holds and releases move
//! them in bulk (`holders.rs`). The pool also keeps the copy-on-write
//! queue (`copy_queue.rs`), whose copies hold their source pages
//! (`copies.rs`).
//!
//! A FREE page's stored count is 1, the count of the request that will
//! take it (stored as 0 extra holders, so a fresh pool's records are all
//! zeros), so taking a page off the free stack writes nothing. Pages
//! become FREE where their count is in hand anyway (a last holder's
//! release, an eviction) or keep their 1 untouched (an exclusive request's
//! close). Writing the count at take time would miss cache once per page:
//! pages come off the stack in the order a closed request held them,
//! spread over the pool (decode pages are taken interleaved with the other
//! requests').
//!
//! The pool does not know why a page is registered: the prefix index fills
//! in a record's registration through `set_entry` / `take_entry`, and the
//! allocator unregisters a page it evicts.

mod blocks;
mod check;
mod copies;
mod copy_queue;
mod holders;
mod priorities;
pub(crate) mod record;
mod stretches;

use crate::error::Result;
use crate::eviction::Eviction;
use crate::memory::{fault_in, prefetch, reserve, zeroed_vec};
use blocks::BlockHolds;
pub(crate) use copies::copies_of_shared;
use copy_queue::CopyQueue;
use record::{PageState, UNHELD};

#[derive(Debug, Clone)]
pub(crate) struct PagePool {
    /// FREE pages; the top (end) is handed out next.
    free: Vec<u32>,
    /// Every page's holder count, registration (entry index + 1 in the
    /// prefix index, 0 when unregistered) and eviction links, one record a
    /// page. Page 0 (never handed out) is the eviction list's sentinel.
    records: Vec<PageState>,
    /// Holders of whole aligned blocks of HELD pages, beside the records'
    /// counts (`blocks.rs`).
    blocks: BlockHolds,
    /// Which CACHED page goes next.
    eviction: Eviction,
    /// Queued copy-on-write copies and the pages they hold.
    copies: CopyQueue,
    /// Most registered pages that may be pinned at once (see `eviction/`).
    max_pinned: usize,
}

impl PagePool {
    /// `num_pages` pages, page 0 reserved; the rest FREE, handed out in
    /// order 1, 2, 3, ... With `map_now`, the page records are mapped now
    /// (the first `FAULT_IN_MAX_BYTES` of them), on huge pages, rather than
    /// at the first write of each: the first registrations, holds and
    /// releases on a fresh pool then cost what later ones do.
    pub(crate) fn new(num_pages: usize, map_now: bool) -> Result<Self> {
        let mut free = Vec::new();
        reserve(&mut free, num_pages - 1, "free page stack")?;
        // Everything allocated before the stack is written: filling it
        // touches 4 bytes a page (8 GiB at MAX_PAGES), which a refusal of
        // the records after it would have paid for nothing.
        let records = page_states(num_pages, map_now)?;
        let blocks = BlockHolds::new(num_pages)?;
        // Reversed so that pop() hands out 1, 2, 3, ... on a fresh pool.
        free.extend((1..num_pages as u32).rev());
        Ok(PagePool {
            free,
            records,
            blocks,
            eviction: Eviction::default(),
            copies: CopyQueue::default(),
            max_pinned: (num_pages - 1) / 4,
        })
    }

    /// Sets the most registered pages that may be pinned at once (the pool
    /// has no priorities yet: see `use_priorities`).
    pub(crate) fn set_max_pinned(&mut self, n: usize) {
        self.max_pinned = n;
    }

    /// Pages an extend can take now: FREE + CACHED, pinned pages aside.
    #[inline]
    pub(crate) fn available(&self) -> usize {
        self.free.len() + self.eviction.len()
    }

    /// CACHED pages that can be evicted (all but the pinned ones).
    #[inline]
    pub(crate) fn cached(&self) -> usize {
        self.eviction.len()
    }

    // ---- the free stack ----

    /// A FREE page for a new holder (its count is 1 already).
    #[inline]
    pub(crate) fn pop_free(&mut self) -> Option<u32> {
        self.free.pop()
    }

    /// Pages on the free stack.
    #[inline]
    pub(crate) fn free_len(&self) -> usize {
        self.free.len()
    }

    /// Gives back a page a failed call took with `pop_free` (it kept its
    /// count 1).
    #[inline]
    pub(crate) fn unpop_free(&mut self, p: u32) {
        self.free.push(p);
    }

    /// The top `n` pages of the free stack (fewer if it holds fewer), in
    /// stack order: `pop_free` would return them last first. Taken with
    /// `drop_free_top`.
    #[inline]
    pub(crate) fn free_top(&self, n: usize) -> &[u32] {
        &self.free[self.free.len() - n.min(self.free.len())..]
    }

    /// Takes the `n` pages `free_top(n)` returned for new holders.
    #[inline]
    pub(crate) fn drop_free_top(&mut self, n: usize) {
        self.free.truncate(self.free.len() - n);
    }

    // ---- holders ----

    /// `p`'s holders: its record's and its block's (`blocks.rs`).
    #[inline]
    pub(crate) fn holders(&self, p: u32) -> u32 {
        self.records[p as usize].holders() + self.blocks.of(p)
    }

    /// More than one holder: writing into `p` must copy it first. (A page
    /// with a block holder is HELD by its record too: two at least.)
    #[inline]
    pub(crate) fn is_shared(&self, p: u32) -> bool {
        self.records[p as usize].is_shared() || self.blocks.of(p) != 0
    }

    /// Shared or registered: writing into `p` must copy or unregister it.
    #[inline]
    pub(crate) fn is_shared_or_registered(&self, p: u32) -> bool {
        self.is_shared(p) || self.records[p as usize].is_registered()
    }

    /// One more holder of a HELD page.
    #[inline]
    pub(crate) fn add_holder(&mut self, p: u32) {
        debug_assert!(self.records[p as usize].extra + 1 < UNHELD);
        self.records[p as usize].extra += 1;
    }

    /// One holder fewer of a page others still hold (a copy-on-write
    /// writer moving to its copy). A record about to hold its page once
    /// first takes in its block's holders (`blocks.rs`).
    #[inline]
    pub(crate) fn drop_shared_holder(&mut self, p: u32) {
        if self.records[p as usize].extra == 1 {
            self.blocks.flatten(&mut self.records, p);
        }
        self.records[p as usize].extra -= 1;
    }

    // ---- registration (filled in by the prefix index) ----

    /// Index + 1 of `p`'s registration (0: none).
    #[inline]
    pub(crate) fn entry(&self, p: u32) -> u32 {
        self.records[p as usize].entry
    }

    #[inline]
    pub(crate) fn is_registered(&self, p: u32) -> bool {
        self.records[p as usize].is_registered()
    }

    /// Registers `p` (a new registration: it has the default priority).
    #[inline]
    pub(crate) fn set_entry(&mut self, p: u32, entry: u32) {
        self.records[p as usize].entry = entry;
        self.eviction.registered(p);
    }

    /// Clears `p`'s registration and returns it (0: it had none).
    #[inline]
    pub(crate) fn take_entry(&mut self, p: u32) -> u32 {
        std::mem::replace(&mut self.records[p as usize].entry, 0)
    }

    /// Hands CACHED page `q`'s registration to page `p`, held and
    /// unregistered, which holds the same content: `p` takes `q`'s entry
    /// and priority, and `q` leaves its eviction list FREE. Returns the
    /// entry (index + 1). A held copy is the one to keep: eviction would
    /// take the unheld one first, while the holder still has the content.
    /// A duration moves with its priority: room was made for its end
    /// (`reserve_priority_ends`).
    #[cold]
    #[inline(never)]
    pub(crate) fn move_registration(&mut self, q: u32, p: u32) -> u32 {
        debug_assert!(self.records[q as usize].is_unheld() && !self.is_registered(p));
        self.eviction.remove_run(&mut self.records, q, q, 1);
        let entry = self.take_entry(q);
        self.records[p as usize].entry = entry;
        self.eviction.moved(q, p);
        self.free_evicted(q);
        entry
    }

    /// Evicts CACHED page `q` out of turn: it leaves its eviction list
    /// (pinned or not) with its priority, and goes FREE. Returns its
    /// registration (index + 1), which the caller drops from the index.
    #[cold]
    pub(crate) fn evict_cached(&mut self, q: u32) -> u32 {
        debug_assert!(self.records[q as usize].is_unheld() && self.is_registered(q));
        self.eviction.remove_run(&mut self.records, q, q, 1);
        // Off its list now, as a held page is: its priority ends the same way.
        self.unregister_held(q);
        let entry = self.take_entry(q);
        self.free_evicted(q);
        entry
    }

    /// Clears `p`'s registration if it is `entry`; returns whether it was.
    #[inline]
    pub(crate) fn clear_entry_if(&mut self, p: u32, entry: u32) -> bool {
        match self.records.get_mut(p as usize) {
            Some(s) if s.entry == entry => {
                s.entry = 0;
                true
            }
            _ => false,
        }
    }

    // ---- eviction ----

    /// The page the next eviction takes (0: none).
    #[inline]
    pub(crate) fn victim(&self) -> u32 {
        self.eviction.victim(&self.records)
    }

    /// The victim after `p`, itself a victim (0: none).
    #[inline]
    pub(crate) fn next_victim(&self, p: u32) -> u32 {
        self.eviction.next_victim(&self.records, p)
    }

    /// `p`'s newer neighbour on its eviction list (0: none): the next
    /// victim while the pool keeps one list (no priorities).
    #[inline]
    pub(crate) fn next_on_list(&self, p: u32) -> u32 {
        Eviction::newer(&self.records, p)
    }

    /// Takes the next victim off the eviction list. It is still registered
    /// and its count is 0: the caller unregisters it, then makes it FREE
    /// (`free_evicted`) or gives it a holder (`hold_evicted`).
    #[inline]
    pub(crate) fn pop_victim(&mut self) -> Option<u32> {
        self.eviction.pop_victim(&mut self.records)
    }

    /// An evicted page's first holder.
    #[inline]
    pub(crate) fn hold_evicted(&mut self, p: u32) {
        self.records[p as usize].extra = 0; // one holder
    }

    /// Takes a victim, or else a pinned page, off the eviction lists, for
    /// `clear_cache` (the caller unregisters it and frees it).
    #[inline]
    pub(crate) fn pop_cached(&mut self) -> Option<u32> {
        self.eviction.pop_cached(&mut self.records)
    }

    /// Moves the top `n` pages of the free stack to its bottom, in reverse:
    /// pushed there in the order they should be taken, they now come off the
    /// stack after every other page, in that order.
    pub(crate) fn sink_free_top(&mut self, n: usize) {
        let len = self.free.len();
        let n = n.min(len);
        self.free[len - n..].reverse();
        self.free.rotate_right(n);
    }

    /// Puts an evicted, unregistered page on the free stack with the
    /// refcount 1 a FREE page keeps.
    #[inline]
    pub(crate) fn free_evicted(&mut self, p: u32) {
        self.records[p as usize].hold_first(); // the count 1 of its next taker
        self.free.push(p);
    }

    /// After `n` victims walked with `victim` / `next_victim` were freed
    /// (`free_evicted`), takes them off the eviction list in one relink;
    /// `rest` is the victim after them (0: none).
    #[inline]
    pub(crate) fn remove_victims(&mut self, n: usize, rest: u32) {
        self.eviction.remove_victims(&mut self.records, n, rest);
    }

    /// Starts loading `p`'s record into cache (a hint).
    #[inline]
    pub(crate) fn prefetch_record(&self, p: u32) {
        prefetch(&self.records, p as usize);
    }

    /// Starts loading the record of the victim that CACHED page `p`'s hint
    /// names, about `HINT_AHEAD` victims on (`record.rs`): an eviction walk
    /// that reads each victim's record for its link would otherwise wait
    /// for each one in turn where victims lie apart (a closing request's
    /// output pages, taken one a decode step).
    #[inline(always)]
    pub(crate) fn warm_hinted(&self, p: u32) {
        prefetch(
            &self.records,
            self.records[p as usize].victim_hint() as usize,
        );
    }

    /// Heap bytes: the records, the block counts, the free stack, the copy
    /// queue and the eviction room's own arrays.
    pub(crate) fn capacity_bytes(&self) -> usize {
        self.free.capacity() * 4
            + self.records.capacity() * std::mem::size_of::<PageState>()
            + self.blocks.capacity_bytes()
            + self.copies.capacity_bytes()
            + self.eviction.capacity_bytes()
    }
}

/// Every page FREE (all zeros, see `record.rs`) except page 0, which is
/// never held. Mapped on first use unless `map_now`: until a
/// record is written, every read of it lands on the one shared zero page.
/// The records are advised onto huge pages, so a churning pool's reads of
/// mapped FREE records do not miss the TLB either way.
fn page_states(num_pages: usize, map_now: bool) -> Result<Vec<PageState>> {
    let mut state = zeroed_vec::<PageState>(num_pages, "page states")?;
    if map_now {
        fault_in(&mut state, usize::MAX); // (advises too) before page 0 is set: it writes zeros
    } else {
        crate::memory::advise_huge(&state);
    }
    if let Some(s0) = state.first_mut() {
        s0.extra = UNHELD;
    }
    Ok(state)
}
