//! Each host page's state in one 16-byte record, as the device pages have
//! (`pages/record.rs`): its holder count, its registration and its links in
//! the host's eviction list.

use crate::eviction::lru::{Linked, Links};
use crate::memory::Zeroable;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C, align(16))]
pub(crate) struct HostPage {
    /// Swapped-out requests whose page lists name the page, plus the queued
    /// transfers that read it (a load's source) or write it (an offload's
    /// destination). 0 for a FREE or CACHED page.
    pub(super) holders: u32,
    /// Index + 1 of the prefix-index entry whose host copy the page holds
    /// (0: none).
    pub(super) entry: u32,
    /// The host eviction list's links, meaningful for CACHED pages (record
    /// 0 is the sentinel).
    pub(super) links: Links,
}

// SAFETY: four u32s; all zeros is a valid value (a FREE page, unregistered,
// unlinked).
unsafe impl Zeroable for HostPage {}

impl Linked for HostPage {
    #[inline]
    fn links(&self) -> &Links {
        &self.links
    }

    #[inline]
    fn links_mut(&mut self) -> &mut Links {
        &mut self.links
    }
}
