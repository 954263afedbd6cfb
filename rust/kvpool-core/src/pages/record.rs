//! Each page's state in one 16-byte record: its holder count, its
//! registration and its eviction links (the transitions are in `mod.rs`).
//!
//! One record and not an array per field, because a page's transition reads
//! and writes several of them at once. A last holder's release to CACHED
//! reads the count and the registration and writes the count and both
//! links; an eviction reads the links and the registration and writes all
//! four. The pages involved (decode pages above all, at page size 1 every
//! token's) sit scattered over the pool, so one record is one cache miss
//! per transition where separate arrays would be up to four, for the same
//! 16 bytes a page.
//!
//! The pool owns the count and the registration field (which the prefix
//! index fills in through the pool), the eviction room the links.

use crate::eviction::lru::{Linked, Links};
use crate::memory::Zeroable;

/// `PageState::extra` of a page nobody holds (a CACHED page, page 0), its
/// low bits aside: `extra >= UNHELD` says unheld, and a CACHED page keeps
/// there the page evicted `HINT_AHEAD` victims after it (`victim_hint`).
/// Holder counts stay far below it: a page's holders are open requests
/// (at most `MAX_REQUESTS`, 2^20) and the copies they wait on.
pub(super) const UNHELD: u32 = 1 << 31;

/// How many victims after a CACHED page the page its hint names comes
/// (`holders.rs` writes the hints, the eviction walk warms them).
pub(crate) const HINT_AHEAD: usize = 8;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C, align(16))]
pub(crate) struct PageState {
    /// Holders beyond the first: `holders - 1`; `UNHELD` or above (the
    /// rest a victim hint) when nobody holds the page. A FREE page stores
    /// 0, the count its next taker needs: taking a page writes nothing, and
    /// a fresh pool's records are all zeros (as `calloc` gives them).
    pub(super) extra: u32,
    /// Index + 1 of the page's registration in the prefix index's entry
    /// slab, 0 when unregistered.
    pub(super) entry: u32,
    /// The eviction room's links, meaningful for CACHED pages (record 0 is
    /// the sentinel).
    pub(super) links: Links,
}

// SAFETY: four u32s; all zeros is a valid value (a FREE page, unregistered,
// unlinked).
unsafe impl Zeroable for PageState {}

impl Linked for PageState {
    #[inline]
    fn links(&self) -> &Links {
        &self.links
    }

    #[inline]
    fn links_mut(&mut self) -> &mut Links {
        &mut self.links
    }
}

impl PageState {
    /// Open requests whose page lists name the page, plus waiting copies
    /// that read it (1 for a FREE page: its next taker).
    #[inline]
    pub(crate) fn holders(&self) -> u32 {
        if self.is_unheld() {
            0
        } else {
            self.extra + 1
        }
    }

    /// More than one holder: writing into the page must copy it first.
    #[inline]
    pub(crate) fn is_shared(&self) -> bool {
        self.extra != 0 && self.extra < UNHELD
    }

    #[inline]
    pub(crate) fn is_registered(&self) -> bool {
        self.entry != 0
    }

    /// Held by nobody: CACHED (or page 0).
    #[inline]
    pub(super) fn is_unheld(&self) -> bool {
        self.extra >= UNHELD
    }

    /// Its last holder let go of it and it joins an eviction list: unheld,
    /// with the page released `HINT_AHEAD` pages after it in the same
    /// release (0: none), which the eviction walk then takes about as many
    /// victims later. Only a hint: holds and evictions in between can make
    /// it name any page (ids past `UNHELD` lose their top bit).
    #[inline(always)]
    pub(super) fn cache_with_hint(&mut self, hint: u32) {
        self.extra = UNHELD | hint;
    }

    /// A CACHED page's victim hint (see `cache_with_hint`).
    #[inline(always)]
    pub(super) fn victim_hint(&self) -> u32 {
        self.extra & !UNHELD
    }

    /// Its first holder takes it off an eviction list: one holder, unlinked.
    #[inline]
    pub(super) fn hold_first(&mut self) {
        self.extra = 0;
        self.links = Links::UNLINKED;
    }
}
