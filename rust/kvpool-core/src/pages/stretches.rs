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
//! matter.

use super::record::{PageState, UNHELD};

/// Pages per block: two cache lines of records.
pub(super) const SPAN: usize = 8;

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
    let off = q
        .iter()
        .enumerate()
        .fold(0, |d, (j, &p)| d | (p ^ q[0].wrapping_add(j as u32)));
    off == 0
}

/// The records of `ids` if the ids are consecutive and in range: one
/// contiguous slice, in list order.
#[inline(always)]
fn records_of<'a>(st: &'a mut [PageState], ids: &[u32; SPAN]) -> Option<&'a mut [PageState]> {
    let first = ids[0] as usize;
    match consecutive(ids) {
        true => st.get_mut(first..first + SPAN),
        false => None,
    }
}

/// One more holder for each of `ids` if they are consecutive and each
/// already has holders (HELD stays HELD); otherwise nothing changes and
/// the caller takes them its own way.
#[inline(always)]
pub(super) fn hold_held(st: &mut [PageState], ids: &[u32; SPAN]) -> bool {
    let Some(recs) = records_of(st, ids) else {
        return false;
    };
    if !recs.iter().fold(true, |a, r| a & (r.extra != UNHELD)) {
        return false;
    }
    for r in recs {
        r.extra += 1;
    }
    true
}

/// One holder fewer for each of `ids` if they are consecutive and none of
/// them is losing its last holder (HELD stays HELD); otherwise nothing
/// changes and the caller takes them its own way.
#[inline(always)]
pub(super) fn release_shared(st: &mut [PageState], ids: &[u32; SPAN]) -> bool {
    let Some(recs) = records_of(st, ids) else {
        return false;
    };
    // (`extra` is never UNHELD here: every page listed is held.)
    if !recs.iter().fold(true, |a, r| a & (r.extra != 0)) {
        return false;
    }
    for r in recs {
        r.extra -= 1;
    }
    true
}
