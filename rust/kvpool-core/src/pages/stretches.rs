//! Holder counts of a stretch of consecutive page ids in one pass over
//! their records (`holders.rs`).
//!
//! A prefix registered at page size 1 is usually a stretch of consecutive
//! page ids: its pages came off the free stack one after another (a fresh
//! pool's stack is in order, and a request's pages go back on it in
//! reverse, to come off in order again). Every request that hits a shared
//! system prompt adds a holder to each of its pages, and takes it away at
//! close: at page size 1 thousands of pages a request, whose records lie
//! next to each other. Tested and counted as one slice of records, eight
//! pages cost a compare of their ids against a count and one vector pass,
//! where the page-by-page loop reads each id and indexes each record.
//!
//! Only pages that keep their state qualify (HELD before and after), so
//! nothing here touches an eviction list and the order of pages does not
//! matter. Where a stretch covers whole aligned blocks of pages that three
//! or more requests hold, a block's count takes the holder instead of its
//! eight records (`blocks.rs`): these functions move a stretch onto a
//! block boundary, and `BlockHolds::hold_run` / `release_run` then take
//! the blocks one count each.

use super::blocks::{ids_from, BlockHolds, BLOCK};
use super::record::{PageState, UNHELD};

/// Pages per try: two cache lines of records, one aligned block.
pub(super) const SPAN: usize = BLOCK;

/// The `SPAN` pages of `list` from `at`, if there are as many.
#[inline(always)]
pub(super) fn block_at(list: &[u32], at: usize) -> Option<&[u32; SPAN]> {
    list.get(at..at + SPAN)?.try_into().ok()
}

/// Whether the pages are `q[0]`, `q[0] + 1`, ...: one fold of xors, not a
/// search, so it compiles to a vector compare. Four of them after a shared
/// block tell `holders.rs` the list may go on as a stretch.
#[inline(always)]
pub(super) fn consecutive<const N: usize>(q: &[u32; N]) -> bool {
    ids_from(q, q[0])
}

/// One more holder for each page of the stretch `list` starts with, if its
/// first eight ids are consecutive and each page already has holders (HELD stays
/// HELD); returns how many pages took one (0: none, nothing changed, and
/// the caller takes them its own way). An aligned block whose records each
/// hold their page twice or more takes it in its block count
/// (`blocks.rs`); other pages take it in their records, eight at a time,
/// or, for such a stretch starting inside a block, up to the next block's
/// start, so that the next call finds it aligned.
#[inline(always)]
pub(super) fn hold_held(st: &mut [PageState], blocks: &mut BlockHolds, list: &[u32]) -> usize {
    let Some(ids) = block_at(list, 0) else {
        return 0;
    };
    let first = ids[0] as usize;
    let recs = match st.get_mut(first..first + SPAN) {
        Some(recs) if consecutive(ids) => recs,
        _ => return 0,
    };
    // Blocks with holders have their records shared already: one count
    // each, for as many whole blocks as the list goes on with, and no
    // record read.
    if first % BLOCK == 0 {
        let n = blocks.hold_run(list);
        if n > 0 {
            return n;
        }
    }
    // (A CACHED page: the caller's way.)
    if !recs.iter().fold(true, |a, r| a & (r.extra < UNHELD)) {
        return 0;
    }
    // Each held twice by its record or more: a block may take the holder.
    let shared = recs.iter().fold(true, |a, r| a & (r.extra != 0));
    match (shared, first % BLOCK) {
        (false, _) => {
            for r in recs {
                r.extra += 1;
            }
            SPAN
        }
        (true, 0) => {
            blocks.add(ids[0]);
            SPAN
        }
        (true, lead) => align(&mut recs[..SPAN - lead]),
    }
}

/// `hold_held` of the pages `recs`, up to the next block's start, of a
/// stretch that a block could hold from there on.
#[cold]
#[inline(never)]
fn align(recs: &mut [PageState]) -> usize {
    for r in recs.iter_mut() {
        r.extra += 1;
    }
    recs.len()
}

/// One holder fewer for each page of the stretch `list` ends with
/// (`release` goes from the end), if its last eight ids are consecutive and no
/// page loses its last holder (HELD stays HELD); returns how many pages,
/// from the end, let one go (0: none, nothing changed). An aligned block
/// with a block count lets go of one of those; otherwise the records count
/// down, none of a block with holders to one (`blocks.rs`), and the pages
/// of such a block only, where the stretch ends inside it, so that the
/// next call finds the block aligned. `BLOCKS`: some block has holders.
#[inline(always)]
pub(super) fn release_shared<const BLOCKS: bool>(
    st: &mut [PageState],
    blocks: &mut BlockHolds,
    list: &[u32],
) -> usize {
    let Some(ids) = list
        .len()
        .checked_sub(SPAN)
        .and_then(|at| block_at(list, at))
    else {
        return 0;
    };
    if !consecutive(ids) {
        return 0;
    }
    let end = ids[SPAN - 1] as usize + 1;
    let tail = end % BLOCK;
    // Records that must keep two holders: those of a block with holders.
    let mut keep_two = false;
    if BLOCKS {
        if tail == 0 {
            // Whole blocks with holders: one count each, no record.
            let n = blocks.release_run(list);
            if n > 0 {
                return n;
            }
        } else if blocks.of(ids[SPAN - 1]) != 0 {
            return release_tail(st, end - tail..end);
        } else {
            keep_two = blocks.of(ids[0]) != 0;
        }
    }
    // (`extra` is never unheld here: every page listed is held.)
    let Some(recs) = st.get_mut(end - SPAN..end) else {
        return 0;
    };
    let ok = match keep_two {
        false => recs.iter().fold(true, |a, r| a & (r.extra != 0)),
        true => recs.iter().fold(true, |a, r| a & (r.extra >= 2)),
    };
    if !ok {
        return 0;
    }
    for r in recs {
        r.extra -= 1;
    }
    SPAN
}

/// `release_shared` of the pages `range`, where a stretch ends inside a
/// block with holders: in their records, none left holding its page once.
#[cold]
#[inline(never)]
fn release_tail(st: &mut [PageState], range: std::ops::Range<usize>) -> usize {
    match st.get_mut(range) {
        Some(recs) if recs.iter().all(|r| r.extra >= 2) => {
            for r in recs.iter_mut() {
                r.extra -= 1;
            }
            recs.len()
        }
        _ => 0,
    }
}
