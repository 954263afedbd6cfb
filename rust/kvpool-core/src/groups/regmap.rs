//! A group's cache index: the registration id of an anchor-chain entry ->
//! the page (or state slot) holding this group's content for exactly that
//! entry's prefix, and back.
//!
//! Keys are registration ids, which the anchor's index reuses only for the
//! very prefix they stood for (a ghost revived by a verified registration
//! of the same tokens, salt and parent, `prefix/ghosts.rs`), and an anchor
//! entry at position e stands for one token sequence [0, e) (its chain is
//! verified page by page: tokens, salt, parent). So a key names one prefix
//! exactly: nothing to hash, nothing to compare, no collision. A page whose
//! anchor entry is gone keeps its key: a lookup produces it again only once
//! that entry is revived, for the same prefix, whose content the page still
//! holds (a page written in place leaves the index first); else it waits
//! for eviction like any cached page.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::error::{PoolError, Result};
use crate::memory::zeroed_vec;

/// Registration ids are consecutive integers: one multiply spreads them
/// over the table's bucket bits (low) and control bits (high).
#[derive(Default)]
pub(crate) struct RegHasher(u64);

impl Hasher for RegHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, x: u64) {
        let m = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = m ^ (m >> 29);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[derive(Debug, Clone)]
pub(crate) struct RegMap {
    map: HashMap<u64, u32, BuildHasherDefault<RegHasher>>,
    /// Per page: the key it is registered under (0: none). Mapped lazily.
    reg_of: Vec<u64>,
}

impl RegMap {
    pub(crate) fn new(num_pages: usize) -> Result<Self> {
        Ok(RegMap {
            map: HashMap::default(),
            reg_of: zeroed_vec(num_pages, "group cache index")?,
        })
    }

    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    #[inline]
    pub(crate) fn get(&self, reg: u64) -> Option<u32> {
        self.map.get(&reg).copied()
    }

    /// The key `p` is registered under (0: none).
    #[inline]
    pub(crate) fn reg_of(&self, p: u32) -> u64 {
        self.reg_of[p as usize]
    }

    /// Room for `n` more keys, or a typed error (nothing changed).
    pub(crate) fn reserve(&mut self, n: usize) -> Result<()> {
        self.map.try_reserve(n).map_err(|_| {
            PoolError::InvalidArgument(format!(
                "cannot allocate the group cache index for {n} more pages"
            ))
        })
    }

    /// Files `p` under `reg`; the caller checked both are free and made
    /// room.
    pub(crate) fn insert(&mut self, reg: u64, p: u32) {
        self.map.insert(reg, p);
        self.reg_of[p as usize] = reg;
    }

    /// Removes `p`'s registration; returns its key (0: it had none).
    pub(crate) fn remove_page(&mut self, p: u32) -> u64 {
        let reg = std::mem::replace(&mut self.reg_of[p as usize], 0);
        if reg != 0 {
            self.map.remove(&reg);
        }
        reg
    }

    /// The registered pages, with their keys.
    pub(crate) fn entries(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.map.iter().map(|(&r, &p)| (r, p))
    }

    pub(crate) fn capacity_bytes(&self) -> usize {
        self.map.capacity() * 16 + self.reg_of.capacity() * 8
    }

    /// Both directions agree, and `is_registered(p)` (the page record's
    /// flag) holds exactly for the filed pages.
    pub(crate) fn check(
        &self,
        is_registered: impl Fn(u32) -> bool,
    ) -> std::result::Result<(), String> {
        for (&reg, &p) in &self.map {
            if reg == 0 || self.reg_of.get(p as usize) != Some(&reg) {
                return Err(format!(
                    "cache key {reg} names page {p}, which is not filed under it"
                ));
            }
        }
        let mut n = 0usize;
        for (p, &reg) in self.reg_of.iter().enumerate() {
            let filed = reg != 0;
            if filed {
                n += 1;
                if self.map.get(&reg) != Some(&(p as u32)) {
                    return Err(format!(
                        "page {p} is filed under key {reg}, which names another page"
                    ));
                }
            }
            if p > 0 && filed != is_registered(p as u32) {
                return Err(format!(
                    "page {p}'s record says registered = {}, the group index says {filed}",
                    is_registered(p as u32)
                ));
            }
        }
        if n != self.map.len() {
            return Err(format!("{n} pages filed but {} keys", self.map.len()));
        }
        Ok(())
    }
}
