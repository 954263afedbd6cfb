//! The index's side of the host tier: where each entry's bytes are (its
//! device page, its host copy), the host pages' token ids, and what an
//! offload needs to report a host copy (its parent's hash). The host
//! pages' states are the host tier's (`host/`); the allocator keeps the
//! two in step.

use super::index::{PrefixIndex, DEAD};
use crate::error::Result;
use crate::location::{host_page, is_host};
use crate::memory::zeroed_vec;

impl PrefixIndex {
    /// Makes room for the token ids of `host_pages` host pages (mapped
    /// lazily: only pages that receive a copy are touched), and for their
    /// entries: an entry whose device page is evicted stays live while its
    /// host copy does, so the index can hold one entry per device page and
    /// per host page (page 0 of each reserved). Counted short, the index
    /// would reserve no room for registrations past the device's pages, and
    /// its key table could fill up, leaving a lookup of an absent key
    /// probing forever.
    pub(crate) fn enable_host(&mut self, host_pages: usize) -> Result<()> {
        let n = host_pages.checked_mul(self.page_size).ok_or_else(|| {
            crate::error::PoolError::InvalidArgument(format!(
                "host_pages * page_size = {host_pages} * {} overflows",
                self.page_size
            ))
        })?;
        self.host_tokens = zeroed_vec(n, "host slot token ids")?;
        self.max_entries += host_pages.saturating_sub(1);
        Ok(())
    }

    /// Entry `i`'s location: its device page, or its host location when it
    /// has no device copy.
    #[inline]
    pub(crate) fn location(&self, i: u32) -> u32 {
        self.entries[i as usize].page
    }

    /// Entry `i`'s host copy (0: none).
    #[inline]
    pub(crate) fn host_copy(&self, i: u32) -> u32 {
        self.entries[i as usize].host
    }

    /// Entry `i`'s device copy is now page `loc` (a device page), or gone
    /// (`loc` its host location).
    #[inline]
    pub(crate) fn set_location(&mut self, i: u32, loc: u32) {
        debug_assert!(!is_host(loc) || host_page(loc) == self.entries[i as usize].host);
        debug_assert!(loc != 0);
        self.entries[i as usize].page = loc;
        self.runs.set_page(i, loc);
    }

    /// Entry `i`'s host copy is now host page `h` (0: none).
    #[inline]
    pub(crate) fn set_host_copy(&mut self, i: u32, h: u32) {
        self.entries[i as usize].host = h;
    }

    /// Entry `i`'s chain hash and salt.
    #[inline]
    pub(crate) fn identity(&self, i: u32) -> (u128, i64) {
        let id = &self.idents[i as usize];
        (id.hash, id.salt)
    }

    /// The chain hash of entry `i`'s parent, 0 at a chain's first page, or
    /// None when the parent is gone from every tier (the entry can no
    /// longer be reached by a lookup, whose verification wants the
    /// parent's registration).
    pub(crate) fn parent_hash(&self, i: u32) -> Option<u128> {
        let e = &self.entries[i as usize];
        if e.parent_reg == 0 {
            return Some(0);
        }
        let p = self.idents[i as usize].parent.checked_sub(1)?;
        match self.entries.get(p as usize) {
            Some(pe) if pe.reg == e.parent_reg && pe.parent_reg != DEAD => {
                Some(self.idents[p as usize].hash)
            }
            _ => None,
        }
    }

    /// Copies device page `page`'s token ids to host page `h` (an offload).
    #[inline]
    pub(crate) fn tokens_to_host(&mut self, page: u32, h: u32) {
        let ps = self.page_size;
        let (s, d) = (page as usize * ps, h as usize * ps);
        self.host_tokens[d..d + ps].copy_from_slice(&self.tokens[s..s + ps]);
    }

    /// Copies host page `h`'s token ids to device page `page` (a load).
    #[inline]
    pub(crate) fn tokens_from_host(&mut self, h: u32, page: u32) {
        let ps = self.page_size;
        let (s, d) = (h as usize * ps, page as usize * ps);
        self.tokens[d..d + ps].copy_from_slice(&self.host_tokens[s..s + ps]);
    }
}

/// The location `open_with_prefix` gives an entry whose load it has
/// decided but not placed yet (host page 0, which no entry has): a second
/// prompt of the batch that hits the entry shares that load.
const LOADING: u32 = crate::location::HOST;

impl PrefixIndex {
    /// Marks entry `i` (host-only) as being loaded by the current call.
    #[inline]
    pub(crate) fn mark_loading(&mut self, i: u32) {
        self.entries[i as usize].page = LOADING;
        self.runs.set_page(i, LOADING);
    }

    /// Whether the current call decided to load entry `i` already.
    #[inline]
    pub(crate) fn is_loading(&self, i: u32) -> bool {
        self.entries[i as usize].page == LOADING
    }

    /// Live entries whose only copy is on the host (for `check`).
    pub(crate) fn count_host_located(&self) -> usize {
        self.live_entries()
            .filter(|&i| is_host(self.entries[i as usize].page))
            .count()
    }
}
