//! Registration: filing pages in the index, relinking them under a new
//! parent, removing them, and clearing the whole index. The page records
//! (`pages/`) that name each entry are the allocator's to keep in step.

use super::index::{Entry, Identity, PrefixIndex, DEAD, SLAB_MAP_BYTES, TABLE_FLOOR_KEYS};
use super::keys::key_of;
use super::links::{CHILDREN, GHOST_KIDS, KEYED};
use super::tip::ChainTip;
use crate::error::Result;
use crate::location::{is_host, on_host};
use crate::memory::{reserve, reserve_mapped};

impl PrefixIndex {
    /// Registrations still possible: entries the index can still hold (one
    /// per page of the pool and of its host tier, see `enable_host`).
    pub(crate) fn room(&self) -> usize {
        self.max_entries.saturating_sub(self.live)
    }

    /// Room for `n` more registrations, or a typed error (nothing changed).
    /// `n` is an upper bound (forked requests count their shared pages once
    /// each); a page is registered at most once, so no more than the room
    /// left (`room`) is reserved and the index's memory stays bounded by the
    /// pool's size (and its host tier's) however requests share.
    pub(crate) fn reserve(&mut self, n: usize) -> Result<()> {
        let n = n.min(self.room());
        let first = n > 0 && self.map_slab_first && self.entries.capacity() == 0;
        if first {
            self.map_slab();
        }
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
        self.runs.reserve(
            self.entries.len() + n.saturating_sub(spare),
            self.max_entries,
        );
        if first {
            // Four 4-byte values a slot, to the slab's two 32-byte records.
            self.runs.map(SLAB_MAP_BYTES / 8);
        }
        // The table is sized at once for the pool's pages, up to
        // TABLE_FLOOR_KEYS; only past that does it double. That sizing is
        // an optimization: if it cannot be allocated, room for `n` more
        // keys is what the call needs, plus one for every unkeyed live
        // entry, which an eviction may have to key (`links.rs`) without a
        // reservation of its own.
        let need = n + (self.live - self.table.len());
        let floor = (self.len() + self.room()).min(TABLE_FLOOR_KEYS);
        let want = floor.saturating_sub(self.table.len());
        if !(n > 0 && want > need && self.table.reserve(want).is_ok()) {
            self.table.reserve(need)?;
        }
        // A growth of the table under way moves keys in step with the
        // registrations (`key_table/migrate.rs`).
        self.table.drain(n);
        Ok(())
    }

    /// Reserves the entry slab for every page at once and maps its start:
    /// growing by doubling, the slab's pushes would fault in a fresh 4 KiB
    /// page every 64 registrations, a cost that at page size 1 lands on
    /// the steps that fill the index. Like the table's first sizing, an
    /// optimization: if the memory is not there, the slab grows as needed.
    #[cold]
    fn map_slab(&mut self) {
        let n = self.max_entries;
        let what = "prefix index entries";
        if reserve_mapped(&mut self.entries, n, SLAB_MAP_BYTES, what).is_ok() {
            let _ = reserve_mapped(&mut self.idents, n, SLAB_MAP_BYTES, what);
        }
    }

    /// Registers `page` (chain hash `hash`) as the child of `parent`;
    /// returns its tip, whose `entry` the page's record takes. The caller
    /// reserved room and checked that `page` is unregistered and that the
    /// hash's key is absent, or that `parent` is `childless` (then the
    /// entry is left unkeyed when `keyed` is false, see `links.rs`), and
    /// that no ghost of it is to revive (`revive_or_register`).
    // Inlined into `cache()`'s loop, as `register_page` is: out of line, the
    // returned tip comes back through memory once a page.
    #[inline(always)]
    pub(crate) fn register(
        &mut self,
        page: u32,
        hash: u128,
        parent: &ChainTip,
        salt: i64,
        keyed: bool,
    ) -> ChainTip {
        self.register_at(page, hash, parent, self.live_tip(parent), salt, keyed)
    }

    /// `register` with `live`, the parent's `live_tip`, in hand (the
    /// registration loop has looked it up for its own tests): the new
    /// entry's slot is free, never the live parent's, so registering
    /// leaves it as it was, and it serves every test here.
    #[inline(always)]
    pub(crate) fn register_at(
        &mut self,
        page: u32,
        hash: u128,
        parent: &ChainTip,
        live: Option<u32>,
        salt: i64,
        keyed: bool,
    ) -> ChainTip {
        debug_assert_eq!(live, self.live_tip(parent));
        // Only a hinted child may go unkeyed: a chain's first page has no
        // parent entry to hint it (nor would a gone parent, which
        // `register_page` never registers under).
        let keyed = keyed || live.is_none();
        let tip = self.file(page, hash, parent, salt, if keyed { KEYED } else { 0 });
        if keyed {
            self.table.insert(key_of(hash), tip.entry - 1);
        }
        self.adopt_at(parent, live);
        self.set_hint_at(live, tip.entry - 1);
        tip
    }

    /// Registers `page` (chain hash `hash`) under `parent`, an entry the
    /// call before registered anew, nothing having been registered under
    /// it or removed since, while no orphan exists: the usual page from a
    /// chain's second new one on (`cache.rs`). What `register_at` does,
    /// minus its tests: the page cannot be a duplicate and goes unkeyed
    /// (`links.rs`), and its parent, which has no child and no hint yet,
    /// counts and hints it with two stores.
    #[inline(always)]
    pub(crate) fn register_only_child(
        &mut self,
        page: u32,
        hash: u128,
        parent: &ChainTip,
        salt: i64,
    ) -> ChainTip {
        let p = (parent.entry - 1) as usize;
        debug_assert_eq!(self.live_tip(parent), Some(p as u32));
        debug_assert!(self.orphans == 0 && self.children(p as u32) == 0);
        debug_assert_eq!(self.entries[p].child, 0);
        let tip = self.file(page, hash, parent, salt, 0);
        self.idents[p].links += 1;
        self.entries[p].child = tip.entry;
        tip
    }

    /// A new live entry for `page` under `parent`, with `links` (its key
    /// flag): the caller files its key and has its parent count and hint
    /// it.
    #[inline(always)]
    fn file(
        &mut self,
        page: u32,
        hash: u128,
        parent: &ChainTip,
        salt: i64,
        links: u32,
    ) -> ChainTip {
        let reg = self.next_reg;
        self.next_reg += 1;
        let e = Entry {
            reg,
            parent_reg: parent.reg,
            page,
            first_token: self.tokens[page as usize * self.page_size],
            child: 0,
            host: 0,
        };
        let id = Identity {
            hash,
            salt,
            parent: parent.entry,
            links,
        };
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
        self.live += 1;
        ChainTip {
            hash,
            reg,
            entry: idx + 1,
        }
    }

    /// Makes entry `child` the hint of the tip's entry, if that entry is
    /// still the tip's registration; an unkeyed child the hint named
    /// before is keyed first (`links.rs`).
    #[inline]
    pub(crate) fn set_hint(&mut self, tip: &ChainTip, child: u32) {
        self.set_hint_at(self.live_tip(tip), child);
    }

    /// `set_hint` for the tip whose `live_tip` is `live`.
    #[inline]
    fn set_hint_at(&mut self, live: Option<u32>, child: u32) {
        if let Some(p) = live {
            let e = &mut self.entries[p as usize];
            let old = e.child;
            // No hint yet (a parent's first child, the usual case): written
            // through the one bounds-checked reference.
            if old == 0 {
                e.child = child + 1;
            } else if old != child + 1 {
                self.key_hinted_child(p, child);
                self.entries[p as usize].child = child + 1;
            }
        }
    }

    /// Links live entry `i`, the registration of a page whose content was
    /// computed on `parent`'s prefix, under `parent`.
    pub(crate) fn relink(&mut self, i: u32, parent: &ChainTip) {
        self.runs.cut(i);
        self.disown(i);
        self.entries[i as usize].parent_reg = parent.reg;
        self.idents[i as usize].parent = parent.entry;
        debug_assert!(
            parent.reg == 0 || self.live_tip(parent).is_some(),
            "registration stops at a gone tip (`register_page`)"
        );
        self.adopt(parent);
        self.set_hint(parent, i);
    }

    /// Removes the registration `entry` (index + 1, taken from its page's
    /// record); returns its hash and salt. One with children leaves a
    /// ghost (`ghosts.rs`).
    // Inlined into eviction's loop: as a call, the 32-byte identity comes
    // back through memory, which an eviction run feels.
    #[inline(always)]
    pub(crate) fn unregister(&mut self, entry: u32) -> Identity {
        self.unregister_as::<true>(entry)
    }

    /// `unregister` without a ghost: the whole index is about to go
    /// (`clear_cache`).
    pub(crate) fn unregister_no_ghost(&mut self, entry: u32) -> Identity {
        self.unregister_as::<false>(entry)
    }

    #[inline(always)]
    fn unregister_as<const GHOST: bool>(&mut self, entry: u32) -> Identity {
        let i = entry - 1;
        let e = self.idents[i as usize];
        // Eviction takes a chain's tail first: mostly an entry without
        // children, for which this is one test.
        let ghost = e.links & (CHILDREN | GHOST_KIDS) != 0 && self.leave_children::<GHOST>(i);
        if !ghost {
            // (A ghost keeps its slot, `ghosts.rs`.)
            self.free_entries.push(i);
        }
        self.runs.cut(i);
        self.disown(i);
        if e.links & KEYED != 0 {
            self.table.remove(key_of(e.hash), i);
        }
        self.entries[i as usize].parent_reg = DEAD;
        self.idents[i as usize].links = 0;
        self.live -= 1;
        self.removals = self.removals.wrapping_add(1);
        e
    }

    /// Live entry `i`, with live or ghost children, is being removed: its
    /// live children become orphans, which only keys can reach, and it
    /// leaves a ghost if `GHOST` and room allow (`ghosts.rs`); returns
    /// whether it did. Before `disown(i)`, so that a ghost parent's count
    /// never passes through 0.
    #[cold]
    #[inline(never)]
    fn leave_children<const GHOST: bool>(&mut self, i: u32) -> bool {
        let children = self.idents[i as usize].links & CHILDREN;
        if children > 0 {
            self.key_hinted_child(i, u32::MAX);
            self.orphans += children as usize;
        }
        GHOST && self.ghost_out(i, children)
    }

    /// Drops every registration; `unlink(location, entry)` clears a page's
    /// record (device or host, `location.rs`) if it names `entry` (its
    /// index + 1) and says whether it did (the slab's other slots are
    /// stale). An entry on both tiers unlinks both pages.
    ///
    /// Costs what was registered, not what the pool could hold: the table
    /// is sized up front for the pool's pages, up to TABLE_FLOOR_KEYS, so
    /// a sweep of it would make clearing a few pages cost a full pass. The
    /// slab holds only what was ever registered; a live entry is the one
    /// its page's record points back to.
    pub(crate) fn clear(&mut self, mut unlink: impl FnMut(u32, u32) -> bool) {
        // Past an eighth full, one memset beats a probe per key.
        let sparse = self.table.len().saturating_mul(8) < self.table.buckets();
        for (i, (e, id)) in self.entries.iter().zip(&self.idents).enumerate() {
            let mut live = unlink(e.page, i as u32 + 1);
            if e.host != 0 && !is_host(e.page) {
                live |= unlink(on_host(e.host), i as u32 + 1);
            }
            if live && sparse && id.links & KEYED != 0 {
                self.table.remove(key_of(id.hash), i as u32);
            }
        }
        self.live = 0;
        self.orphans = 0;
        self.ghosts.clear();
        self.removals = self.removals.wrapping_add(1);
        if !sparse || self.table.len() != 0 {
            // Dense, or keys the slab did not account for (only a corrupted
            // index has those): the whole table.
            self.table.clear();
        }
        self.runs.clear(self.entries.len());
        self.entries.clear();
        self.idents.clear();
        self.free_entries.clear();
    }
}
