//! The common case of a registration pass (`cache.rs`): a stretch of the
//! row's unregistered pages, each filed as the only child of the page
//! filed just before it.

use crate::events::EventLog;
use crate::pages::PagePool;
use crate::prefix::index::{PrefixIndex, LOOKAHEAD};
use crate::prefix::run_builder::RunBuilder;
use crate::prefix::tip::ChainTip;

/// Where `register_row` is in its chunk of hashes: page `list[k]`'s hash is
/// `ring[k - start]`, and the pages before `refill_end` put the hash of the
/// page LOOKAHEAD ahead of them in their ring slot once they have read
/// their own (`last` is the latest hash put there).
pub(super) struct Chunk<'a> {
    pub(super) ring: &'a mut [u128],
    pub(super) last: u128,
    pub(super) start: usize,
    pub(super) end: usize,
    pub(super) refill_end: usize,
}

impl Chunk<'_> {
    /// Page `list[k]`'s hash, its ring slot refilled with the hash of the
    /// page LOOKAHEAD ahead (`ONE`: one token a page, hashed by its id).
    #[inline(always)]
    pub(super) fn take<const ONE: bool>(
        &mut self,
        prefix: &PrefixIndex,
        list: &[u32],
        k: usize,
    ) -> u128 {
        let slot = k - self.start;
        let h = self.ring[slot];
        if k < self.refill_end {
            let next = list[k + LOOKAHEAD];
            self.last = if ONE {
                prefix.token_page_hash(self.last, next)
            } else {
                prefix.page_hash(self.last, next)
            };
            self.ring[slot] = self.last;
        }
        h
    }
}

/// Registers `list[k..]` from page `k` on, up to the chunk's end, while
/// each page is unregistered: the tip is an entry this pass filed anew (so
/// it has no child yet) and no orphan exists, so each page is the only
/// child of the one before (`register_only_child`). Returns the index of
/// the first page it did not register.
///
/// Out of line, on purpose, and one copy for each of events on or off and
/// page size 1 or not: inside `register_row`'s loop, which also calls
/// `register_page_named` and the orphan path, the compiler kept this
/// stretch's values on the stack and reloaded them, and tested the page
/// size and the event log, once a page (about a third of a page-1
/// registration's 190 instructions). One call a stretch, not a page.
#[allow(clippy::too_many_arguments)]
pub(super) fn file_fresh_stretch(
    prefix: &mut PrefixIndex,
    pages: &mut PagePool,
    events: &mut EventLog,
    chunk: &mut Chunk<'_>,
    list: &[u32],
    k: usize,
    tip: &mut ChainTip,
    salt: i64,
    run: &mut RunBuilder,
) -> usize {
    let args = (prefix, pages, events, chunk, list, k, tip, salt, run);
    match (args.2.enabled(), args.0.token_pages()) {
        (true, true) => stretch::<true, true>(args),
        (true, false) => stretch::<true, false>(args),
        (false, true) => stretch::<false, true>(args),
        (false, false) => stretch::<false, false>(args),
    }
}

type Args<'a, 'c> = (
    &'a mut PrefixIndex,
    &'a mut PagePool,
    &'a mut EventLog,
    &'a mut Chunk<'c>,
    &'a [u32],
    usize,
    &'a mut ChainTip,
    i64,
    &'a mut RunBuilder,
);

/// `file_fresh_stretch` with events on or off (`EVENTS`) and one token a
/// page or not (`ONE`).
#[inline(never)]
fn stretch<const EVENTS: bool, const ONE: bool>(args: Args<'_, '_>) -> usize {
    let (prefix, pages, events, chunk, list, mut k, tip, salt, run) = args;
    debug_assert_eq!(prefix.orphans(), 0);
    debug_assert_eq!((events.enabled(), prefix.token_pages()), (EVENTS, ONE));
    let end = chunk.end.min(list.len());
    let mut t = *tip;
    while k < end {
        let p = list[k];
        if pages.entry(p) != 0 {
            break;
        }
        let h = chunk.take::<ONE>(prefix, list, k);
        let parent = t;
        t = prefix.register_only_child(p, h, &parent, salt);
        run.filed(prefix, &parent, &t, list, k);
        pages.set_entry(p, t.entry);
        if EVENTS {
            events.stored(h, parent.hash, p, salt, prefix.page_tokens(p));
        }
        k += 1;
    }
    *tip = t;
    k
}
