//! Each page's sharing state in one 16-byte record: its holder count, its
//! registration and its LRU links (the transitions are in `pages.rs`).
//!
//! Why one record and not four arrays: a page's transition reads and writes
//! several of these at once. A last holder's release to CACHED reads the
//! count and the registration and writes the count and both links; an
//! eviction reads the links and the registration and writes all four. The
//! pages involved (decode pages above all, at page size 1 every token's)
//! sit scattered over the pool, so with four arrays each transition missed
//! cache up to four times, and with one record it misses once. The record
//! costs the same 16 bytes a page as the four arrays did.

use crate::memory::Zeroable;

/// `PageState::extra` of a page nobody holds (a CACHED page, page 0).
pub(crate) const UNHELD: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C, align(16))]
pub(crate) struct PageState {
    /// Holders beyond the first: `holders - 1`, wrapping, so `UNHELD` when
    /// nobody holds the page. A FREE page stores 0, the count its next
    /// taker needs: taking a page writes nothing, and a fresh pool's
    /// records are all zeros (mapped lazily, never written at construction).
    pub(crate) extra: u32,
    /// Index + 1 of the page's registration in the index's entry slab, 0
    /// when unregistered.
    pub(crate) entry: u32,
    /// LRU links, meaningful for CACHED pages (page 0 is the sentinel:
    /// `next` of page 0 is the oldest page, `prev` the newest).
    pub(crate) prev: u32,
    pub(crate) next: u32,
}

// SAFETY: four u32s; all zeros is a valid value (a FREE page, unregistered,
// unlinked).
unsafe impl Zeroable for PageState {}

impl PageState {
    /// Open requests whose page lists name the page (1 for a FREE page: its
    /// next taker).
    #[inline]
    pub(crate) fn holders(&self) -> u32 {
        self.extra.wrapping_add(1)
    }

    /// More than one holder: writing into the page must copy it first.
    #[inline]
    pub(crate) fn is_shared(&self) -> bool {
        self.extra != 0 && self.extra != UNHELD
    }

    #[inline]
    pub(crate) fn is_registered(&self) -> bool {
        self.entry != 0
    }
}
