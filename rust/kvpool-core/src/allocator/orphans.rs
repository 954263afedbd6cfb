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
//! So the orphan gives way (`register_past_orphan` in `register_page.rs`): it
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

use crate::events::{EventLog, MEDIUM_HOST};
use crate::host::HostTier;
use crate::location::is_host;
use crate::pages::PagePool;
use crate::prefix::index::PrefixIndex;

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
