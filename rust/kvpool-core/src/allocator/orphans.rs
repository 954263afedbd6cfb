//! Orphans met by registration. An orphan is a live entry whose parent
//! registration is gone while it stayed: its parent was evicted first (a
//! lower priority, or another page's entry its chain went on from), or
//! rewritten in place after a truncation, or lost its last host copy. No
//! lookup reaches it: verification wants the parent's registration. The
//! parent usually left a ghost (`prefix/ghosts.rs`): recomputing its
//! content on its prefix revives its registration, and the orphan is
//! reached again. Where no ghost was kept (the bound), a request that
//! recomputes the same content under the parent's new registration finds
//! the orphan under its key, and it cannot stand for that page (its parent
//! differs). Kept, it would stop the request's chain at that page for good.
//!
//! So the orphan gives way (`register_past_orphan` in `cache.rs`): it
//! leaves the index as an eviction would take it, and the recomputed page
//! is registered in its place, continuing the chain. Its device copy goes
//! FREE if nobody holds it, else stays with its holders unregistered (as
//! a page written in place does); its host copy goes too; Removed events
//! report each copy, and the new page's Stored event follows. Its own
//! children were orphans already (registered under its registration,
//! which no lookup reaches); they give way in turn when a chain reaches
//! them.
//!
//! An entry of the same content whose parent is live but another one is
//! not an orphan: the chain still stops there (a collision).

use super::cache::register_page;
use crate::events::{EventLog, MEDIUM_HOST};
use crate::host::HostTier;
use crate::location::is_host;
use crate::pages::PagePool;
use crate::prefix::index::PrefixIndex;
use crate::prefix::tip::ChainTip;

/// Drops orphan entry `i` from the index, with its copies (see above).
#[cold]
#[inline(never)]
pub(super) fn drop_orphan(
    ix: &mut PrefixIndex,
    pages: &mut PagePool,
    events: &mut EventLog,
    host: &mut Option<HostTier>,
    i: u32,
) {
    let (hash, salt) = ix.identity(i);
    let loc = ix.location(i);
    if is_host(loc) {
        if let Some(t) = host.as_mut() {
            t.count_host_only(false);
        }
    } else {
        if pages.holders(loc) == 0 {
            pages.evict_cached(loc);
        } else {
            pages.unregister_held(loc);
            pages.take_entry(loc);
        }
        events.removed(hash, loc, salt);
    }
    let h = ix.host_copy(i);
    if h != 0 {
        if let Some(t) = host.as_mut() {
            t.drop_copy(h);
        }
        ix.set_host_copy(i, 0);
        events.removed_on(MEDIUM_HOST, hash, h, salt);
    }
    ix.unregister(i + 1);
}

/// `register_page` returned None for page `p`: if the entry its key
/// names is an orphan of `p`'s content, it gives way (`orphans.rs`) and
/// `p` is registered after all; returns the new tip, or None when the
/// chain stops there. Out of line, called only where a chain would stop:
/// the registration loop's own path is unchanged.
#[cold]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
pub(super) fn register_past_orphan(
    ix: &mut PrefixIndex,
    pages: &mut PagePool,
    events: &mut EventLog,
    host: &mut Option<HostTier>,
    p: u32,
    first: bool,
    h: u128,
    parent: &ChainTip,
    salt: i64,
) -> Option<ChainTip> {
    if !ix.is_live(parent) || pages.entry(p) != 0 {
        return None;
    }
    loop {
        let (i, _) = ix.child_of(parent, h)?;
        if !ix.is_orphan_of(i, ix.page_tokens(p), salt) {
            return None;
        }
        drop_orphan(ix, pages, events, host, i);
        if let Some(tip) = register_page(ix, pages, events, host, p, first, h, parent, salt) {
            return Some(tip);
        }
    }
}

/// `register_page`'s registration of unregistered page `p` while ghosts
/// exist: the ghost of its content under `parent` comes back, if there is
/// one (`prefix/ghosts.rs`), else a new registration as usual.
#[cold]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
pub(super) fn register_or_revive(
    ix: &mut PrefixIndex,
    pages: &mut PagePool,
    events: &mut EventLog,
    p: u32,
    first: bool,
    h: u128,
    parent: &ChainTip,
    salt: i64,
) -> ChainTip {
    let tip = ix.revive_or_register(p, h, parent, salt);
    pages.set_entry(p, tip.entry);
    let parent_hash = if first { 0 } else { parent.hash };
    events.stored(h, parent_hash, p, salt, ix.page_tokens(p));
    tip
}
