//! Which entries the key table files, and the parent-child counts that
//! decide it.
//!
//! A chain registered page after page is mostly pages that nothing else
//! branches from: page k + 1 is the only child of page k. Such a child
//! needs no key: a lookup reaches it through its parent's child hint
//! (`lookup.rs`), which it is. Filing it would cost a random table probe
//! and insert per page, and its removal one more: at page size 1 that is a
//! cache and TLB miss per token, the largest part of registering a long
//! prompt. So an entry is filed lazily:
//!
//! - **Invariant.** Every live entry is keyed (in the table under its
//!   hash's key), or is the child hint of its live parent.
//! - An entry registered under a parent with no live child, while no entry
//!   anywhere is an orphan (below), is left unkeyed: no other entry can
//!   have its hash, so the key probe that checks for a duplicate is skipped
//!   too. Every other registration is keyed at once, as before.
//! - Moving a parent's hint off an unkeyed child (a sibling registered or
//!   re-verified), or unregistering the parent of an unkeyed hinted child,
//!   keys that child first (`key_entry`).
//!
//! **Orphans.** A live entry whose parent registration is gone (evicted
//! while the child stayed, e.g. at a higher retention priority) can only
//! be found by key, and may still hold the key a new registration of the
//! same content would need (a registration of that content replaces it,
//! `allocator/orphans.rs`, unless its parent's ghost was revived first,
//! `ghosts.rs`, which makes it a live parent's child again). Each entry counts its live children, so the
//! index knows how many orphans exist; while there is one, registrations
//! probe the table as before.
//!
//! **Same key twice.** Keying an entry whose key another entry holds
//! (only an orphan, or a 64-bit key collision, can) files both: the table
//! allows it, a lookup by key finds one of them, and verification rejects
//! the other's content, a miss, never wrong KV.

use super::index::{PrefixIndex, DEAD};
use super::keys::key_of;
use super::tip::ChainTip;

/// `Identity::links`' flag: the entry is filed in the key table.
pub(super) const KEYED: u32 = 1 << 31;
/// `Identity::links`' flag: the entry has ghost children (`ghosts.rs`
/// counts them), so its removal leaves a ghost too.
pub(super) const GHOST_KIDS: u32 = 1 << 30;
/// `Identity::links`' live-children count.
pub(super) const CHILDREN: u32 = GHOST_KIDS - 1;

impl PrefixIndex {
    /// Whether live entry `i` is filed in the key table.
    #[inline]
    pub(crate) fn is_keyed(&self, i: u32) -> bool {
        self.idents[i as usize].links & KEYED != 0
    }

    /// Live entry `i`'s live children.
    #[inline]
    pub(super) fn children(&self, i: u32) -> u32 {
        self.idents[i as usize].links & CHILDREN
    }

    /// Live entries whose parent registration is gone.
    #[inline]
    pub(crate) fn orphans(&self) -> usize {
        self.orphans
    }

    /// Whether a page registered under `tip` can skip the duplicate probe
    /// and stay unkeyed: its parent is live and childless, and no orphan
    /// exists (see the module docs).
    #[inline]
    pub(crate) fn childless(&self, tip: &ChainTip) -> bool {
        self.childless_at(self.live_tip(tip))
    }

    /// `childless` of the tip whose `live_tip` is `live`.
    #[inline]
    pub(crate) fn childless_at(&self, live: Option<u32>) -> bool {
        self.orphans == 0 && live.is_some_and(|i| self.children(i) == 0)
    }

    /// Whether `tip` is the root or a live entry's registration.
    #[inline]
    pub(crate) fn is_live(&self, tip: &ChainTip) -> bool {
        tip.reg == 0 || self.live_tip(tip).is_some()
    }

    /// Whether live entry `i` is filed under chain hash `hash`'s key.
    #[inline]
    pub(crate) fn same_key(&self, i: u32, hash: u128) -> bool {
        key_of(self.idents[i as usize].hash) == key_of(hash)
    }

    /// The live entry index of `tip`'s registration, if it is still live.
    #[inline]
    pub(crate) fn live_tip(&self, tip: &ChainTip) -> Option<u32> {
        let i = tip.entry.checked_sub(1)?;
        let e = self.entries.get(i as usize)?;
        (e.reg == tip.reg && tip.reg != 0 && e.parent_reg != DEAD).then_some(i)
    }

    /// The tip at registered entry `entry` (index + 1, as a page's record
    /// names it; 0: none) if that entry continues the chain at `parent`:
    /// its parent registration is `parent`'s, and its salt is `salt`.
    #[inline]
    pub(crate) fn continues(&self, entry: u32, parent: &ChainTip, salt: i64) -> Option<ChainTip> {
        let i = entry.checked_sub(1)?;
        let e = self.entries.get(i as usize)?;
        (e.parent_reg == parent.reg && e.parent_reg != DEAD && self.idents[i as usize].salt == salt)
            .then(|| self.tip(i))
    }

    /// The live parent entry of live entry `i`, if its parent registration
    /// is still live (None at a chain's first page or for an orphan).
    #[inline]
    pub(super) fn live_parent(&self, i: u32) -> Option<u32> {
        let reg = self.entries[i as usize].parent_reg;
        if reg == 0 {
            return None;
        }
        let p = self.idents[i as usize].parent.checked_sub(1)?;
        let pe = self.entries.get(p as usize)?;
        (pe.reg == reg && pe.parent_reg != DEAD).then_some(p)
    }

    /// Whether live entry `i` is an orphan (its parent registration is
    /// gone) of the same content as a page of `tokens` under `salt`: a
    /// page recomputing that content replaces it (`allocator/orphans.rs`).
    /// An entry whose parent is live, or that is a chain's first page, is
    /// not one.
    pub(crate) fn is_orphan_of(&self, i: u32, tokens: &[i32], salt: i64) -> bool {
        let e = &self.entries[i as usize];
        e.parent_reg != 0
            && self.live_parent(i).is_none()
            && self.idents[i as usize].salt == salt
            && (self.skip_verify || self.holds(e, tokens))
    }

    /// Counts live entry `i` as a child of `tip` (its new parent), or as an
    /// orphan when the tip's registration is gone.
    #[inline]
    pub(super) fn adopt(&mut self, tip: &ChainTip) {
        self.adopt_at(tip, self.live_tip(tip));
    }

    /// `adopt` under the tip whose `live_tip` is `live`.
    #[inline]
    pub(super) fn adopt_at(&mut self, tip: &ChainTip, live: Option<u32>) {
        match live {
            Some(p) => self.idents[p as usize].links += 1,
            // (Never a ghost's tip: registration stops at a gone tip,
            // `register_page`, and relinks go under live ones.)
            None if tip.reg != 0 => self.orphans += 1,
            None => {}
        }
    }

    /// Stops counting live entry `i` under its parent (or as an orphan,
    /// and as its parent's ghost's child, `ghosts.rs`).
    pub(super) fn disown(&mut self, i: u32) {
        match self.live_parent(i) {
            Some(p) => self.idents[p as usize].links -= 1,
            None if self.entries[i as usize].parent_reg != 0 => {
                self.orphans -= 1;
                if !self.ghosts.is_empty() {
                    if let Some(p) = self.idents[i as usize].parent.checked_sub(1) {
                        self.kid_gone(p, self.entries[i as usize].parent_reg, true);
                    }
                }
            }
            None => {}
        }
    }

    /// Files live entry `i` under its hash's key, unless it is filed. The
    /// caller's reservation left room for every live entry.
    pub(super) fn key_entry(&mut self, i: u32) {
        if !self.is_keyed(i) {
            self.table.insert(key_of(self.idents[i as usize].hash), i);
            self.idents[i as usize].links |= KEYED;
        }
    }

    /// Keys the unkeyed child that live entry `p` hints, if it is a live
    /// child of `p` other than `except`: its parent's hint is about to stop
    /// naming it, or its parent is about to go.
    pub(super) fn key_hinted_child(&mut self, p: u32, except: u32) {
        let Some(c) = self.entries[p as usize].child.checked_sub(1) else {
            return;
        };
        if c == except || self.children(p) == 0 {
            return;
        }
        let reg = self.entries[p as usize].reg;
        if self
            .entries
            .get(c as usize)
            .is_some_and(|e| e.parent_reg == reg)
        {
            self.key_entry(c);
        }
    }

    /// The entry registered under `tip` for the page of chain hash `hash`:
    /// the tip's hinted child if it has that hash, else the one filed
    /// under the hash's key (to be verified by the caller).
    #[inline]
    pub(crate) fn child_of(&self, tip: &ChainTip, hash: u128) -> Option<(u32, u32)> {
        if let Some(p) = self.live_tip(tip) {
            if let Some(c) = self.entries[p as usize].child.checked_sub(1) {
                if let Some(e) = self.entries.get(c as usize) {
                    if e.parent_reg == tip.reg && self.idents[c as usize].hash == hash {
                        return Some((c, e.page));
                    }
                }
            }
        }
        self.lookup(hash)
    }
}
