//! Registering one page of a chain: `register_page`, the registration
//! loop's per-page step (`cache.rs`, and the grouped allocator's recording
//! of an anchor chain, `group_hooks.rs`), and its two cold ways out: an
//! orphan of the page's content that gives way (`orphans.rs`), and a ghost
//! of it that comes back (`prefix/ghosts.rs`).

use super::orphans::drop_orphan;
use crate::events::EventLog;
use crate::host::HostTier;
use crate::location::is_host;
use crate::pages::PagePool;
use crate::prefix::index::PrefixIndex;
use crate::prefix::tip::ChainTip;

/// Registers page `p` (chain hash `h`; `first`: page 0 of its chain) as
/// the child of `parent`; returns the chain's new tip, or None when the
/// chain must stop there (a collision, or a parent registration that is
/// gone) unless the entry in the way is an orphan of the same content
/// (then `register_past_orphan` registers `p`).
// Inlined: as a call, the returned tip comes back through memory, and its
// reload stalls on the stores that wrote it, once per page.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn register_page(
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
    register_page_named(ix, pages, events, host, p, first, h, parent, salt, false).map(|r| r.tip)
}

/// What `register_page_named` did.
pub(super) struct Registered {
    /// The chain's new tip.
    pub(super) tip: ChainTip,
    /// Whether `p`'s record names the tip (`pages.entry(p) == tip.entry`;
    /// false for a duplicate that leaves the page unregistered, which the
    /// chain then passes through as another's entry). Each way out knows
    /// it: the caller's reload of the record, after the event pushes that
    /// the compiler cannot tell from the records, would cost a bounds
    /// check, a load and a compare per page.
    pub(super) named: bool,
    /// Whether the tip is the entry just registered anew for `p`: live
    /// until something removes a registration, which nothing between one
    /// page of `register_row` and the next does, so that next page's call
    /// may pass `fresh` and skip looking its parent up.
    pub(super) fresh: bool,
}

/// `register_page`, saying more of what it did (`Registered`). `fresh`:
/// `parent` is the `fresh` tip of the call before, nothing having been
/// removed since (its live entry is then `parent.entry - 1`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn register_page_named(
    ix: &mut PrefixIndex,
    pages: &mut PagePool,
    events: &mut EventLog,
    host: &mut Option<HostTier>,
    p: u32,
    first: bool,
    h: u128,
    parent: &ChainTip,
    salt: i64,
    fresh: bool,
) -> Option<Registered> {
    // The parent's live entry, looked up once for every test below: none
    // of them, nor the registration, changes it (`register_at`).
    let live = if fresh {
        Some(parent.entry - 1)
    } else {
        ix.live_tip(parent)
    };
    debug_assert_eq!(live, ix.live_tip(parent));
    if live.is_none() && parent.reg != 0 {
        // The chain's tip is gone: nothing registered under it could be
        // reached by a lookup, whose verification wants the tip's
        // registration. (`restart_dead_chain` moves a row's chain off a
        // tip that was gone before the call; one can still go during it,
        // when another row's registration replaces it as an orphan, and the
        // chain then stops here, as the models' does.)
        return None;
    }
    let own = pages.entry(p).checked_sub(1);
    if let Some(i) = own {
        if ix.same_key(i, h) && ix.salt_of(i) == salt {
            // This very page: its content was computed on this request's
            // prefix, so (re)link it to the current parent.
            ix.relink(i, parent);
            // (Its record names entry `i`: `own`.)
            return Some(Registered {
                tip: ix.tip(i),
                named: true,
                fresh: false,
            });
        }
    }
    // An unregistered page under a parent with no child yet (and no orphan
    // anywhere) cannot be a duplicate: skip the probe and leave it
    // unkeyed, for its parent's hint to reach (`prefix/links.rs`). (The
    // usual case, a chain's next new page under a fresh parent while no
    // orphan exists, is `register_row`'s own, `register_only_child`; other
    // callers, e.g. the grouped allocator's anchor chain, come here.)
    // (A fresh parent has no child yet: it was registered with none, and
    // only a registration under it, this one, would add one.)
    let childless = own.is_none()
        && if fresh {
            debug_assert!(ix.childless_at(live) || ix.orphans() != 0);
            ix.orphans() == 0
        } else {
            ix.childless_at(live)
        };
    let found = if childless {
        None
    } else {
        match ix.child_of(parent, h) {
            // A ghost exists only while an orphan does, never under a
            // childless tip: the usual registration reads no more.
            None if own.is_none() && ix.has_ghosts() => {
                // (`register_or_revive` sets the page's record to the tip.)
                return Some(Registered {
                    tip: register_or_revive(ix, pages, events, p, first, h, parent, salt),
                    named: true,
                    fresh: false,
                });
            }
            found => found,
        }
    };
    match found {
        None if own.is_none() => {
            let tip = ix.register_at(p, h, parent, live, salt, !childless);
            pages.set_entry(p, tip.entry);
            let parent_hash = if first { 0 } else { parent.hash };
            events.stored(h, parent_hash, p, salt, ix.page_tokens(p));
            Some(Registered {
                tip,
                named: true,
                fresh: true,
            })
        }
        Some((i, loc)) if ix.verify(i, ix.page_tokens(p), salt, parent.reg) => {
            // A duplicate: keep the existing entry (its chain hash is the one
            // this page would get: same tokens, same salt), and its copy
            // where someone holds that.
            if is_host(loc) && own.is_none() {
                // Its only copy is on the host: this page becomes its
                // device copy, as if registered now (a later hit needs no
                // load).
                if let Some(host) = host.as_mut() {
                    ix.set_location(i, p);
                    pages.set_entry(p, i + 1);
                    host.count_host_only(false);
                    let parent_hash = if first { 0 } else { parent.hash };
                    events.stored(h, parent_hash, p, salt, ix.page_tokens(p));
                }
            } else if own.is_none() && pages.holders(loc) == 0 {
                take_over(ix, pages, events, i, loc, p, first, parent);
            }
            ix.set_hint(parent, i);
            Some(Registered {
                tip: ix.tip(i),
                named: pages.entry(p) == i + 1,
                fresh: false,
            })
        }
        _ => None,
    }
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

/// Page `p`, unregistered, duplicates entry `i`'s device copy `q`, which
/// nobody holds (CACHED): `p` becomes the entry's copy and `q` goes back
/// FREE. Kept, `q` would be the first to go under pressure while the
/// request still holds the same content in `p`: the entry would go with
/// it, and with it the chain the request continues from. The entry stays
/// (its registration id, children, host copy and hash), so nothing below
/// it is lost; the page's priority moves along. Events: Removed for `q`,
/// Stored for `p`, the same hash, so a router that maps hashes to pages
/// follows (one that only tracks hashes sees it stay cached).
#[cold]
#[inline(never)]
#[allow(clippy::too_many_arguments)]
fn take_over(
    ix: &mut PrefixIndex,
    pages: &mut PagePool,
    events: &mut EventLog,
    i: u32,
    q: u32,
    p: u32,
    first: bool,
    parent: &ChainTip,
) {
    let entry = pages.move_registration(q, p);
    debug_assert_eq!(entry, i + 1);
    ix.set_location(i, p);
    let (hash, salt) = ix.identity(i);
    events.removed(hash, q, salt);
    let parent_hash = if first { 0 } else { parent.hash };
    events.stored(hash, parent_hash, p, salt, ix.page_tokens(p));
}
