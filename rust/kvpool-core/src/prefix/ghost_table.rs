//! The ghost table: the removed entries a recomputation can revive
//! (`ghosts.rs` says when an entry leaves one, how it comes back and when
//! it goes), filed by slab slot and by lookup key, and the live entries'
//! counts of ghost children. Plain maps, apart from the index so that the
//! index can own one without the two files naming each other.

use std::collections::HashMap;

use super::keys::key_of;

/// A removed entry with children (see the module docs).
#[derive(Debug, Clone)]
pub(super) struct Ghost {
    pub(super) reg: u64,
    pub(super) parent_reg: u64,
    /// Slab index + 1 of the parent when it was registered or relinked.
    pub(super) parent: u32,
    pub(super) hash: u128,
    pub(super) salt: i64,
    /// Live children (orphans while this is a ghost).
    pub(super) live_kids: u32,
    /// Ghost children.
    pub(super) ghost_kids: u32,
    /// Slot + 1 of the next ghost of the same key (0: none).
    pub(super) next: u32,
    pub(super) tokens: Box<[i32]>,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Ghosts {
    /// Slab slot -> its ghost.
    pub(super) by_slot: HashMap<u32, Ghost>,
    /// Lookup key -> the first of its ghosts' slots (then `Ghost::next`).
    pub(super) by_key: HashMap<u64, u32>,
    /// Live entries with ghost children: slab slot -> how many.
    pub(super) kids_of_live: HashMap<u32, u32>,
}

impl Ghosts {
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.by_slot.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.by_slot.len()
    }

    pub(super) fn clear(&mut self) {
        self.by_slot.clear();
        self.by_key.clear();
        self.kids_of_live.clear();
    }

    pub(super) fn capacity_bytes(&self, page_size: usize) -> usize {
        self.by_slot.capacity() * (std::mem::size_of::<(u32, Ghost)>() + 4 * page_size)
            + self.by_key.capacity() * 16
            + self.kids_of_live.capacity() * 8
    }

    /// The slots of `key`'s ghosts.
    pub(super) fn of_key(&self, key: u64) -> impl Iterator<Item = u32> + '_ {
        let mut at = self.by_key.get(&key).map_or(0, |&s| s + 1);
        std::iter::from_fn(move || {
            let s = at.checked_sub(1)?;
            at = self.by_slot.get(&s).map_or(0, |g| g.next);
            Some(s)
        })
    }

    /// Files `g` at `slot`; the caller made room (`room_for_one`).
    pub(super) fn insert(&mut self, slot: u32, mut g: Ghost) {
        let key = key_of(g.hash);
        g.next = self.by_key.insert(key, slot).map_or(0, |s| s + 1);
        self.by_slot.insert(slot, g);
    }

    /// Takes the ghost at `slot` out of both maps.
    pub(super) fn remove(&mut self, slot: u32) -> Option<Ghost> {
        let g = self.by_slot.remove(&slot)?;
        let key = key_of(g.hash);
        if self.by_key.get(&key) == Some(&slot) {
            match g.next.checked_sub(1) {
                Some(n) => self.by_key.insert(key, n),
                None => self.by_key.remove(&key),
            };
        } else {
            let mut at = self.by_key.get(&key).copied();
            while let Some(s) = at {
                let prev = self.by_slot.get_mut(&s).expect("a ghost key chain");
                if prev.next == slot + 1 {
                    prev.next = g.next;
                    break;
                }
                at = prev.next.checked_sub(1);
            }
        }
        Some(g)
    }

    /// Room in every map for one more ghost and what it may bring (a
    /// live parent's count, and on revival its own ghost children's): a
    /// live entry with ghost children has at least one, so the counts of
    /// live entries never outnumber the ghosts.
    pub(super) fn room_for_one(&mut self) -> bool {
        let n = self.by_slot.len() + 1;
        self.by_slot.try_reserve(1).is_ok()
            && self.by_key.try_reserve(1).is_ok()
            && self
                .kids_of_live
                .try_reserve(n.saturating_sub(self.kids_of_live.len()))
                .is_ok()
    }
}
