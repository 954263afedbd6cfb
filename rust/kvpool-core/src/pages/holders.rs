//! Holds and releases in bulk: a request's page list gains or loses one
//! holder a page, and the pages whose count crosses zero move between HELD
//! and CACHED (or FREE) in their eviction list's order (see `mod.rs`).

use super::blocks::BlockHolds;
use super::record::{PageState, HINT_AHEAD, UNHELD};
use super::stretches;
use super::PagePool;
use crate::eviction::{Eviction, Insert};
use crate::memory::prefetch;

/// How many pages ahead of its blocks of four `release` asks for records
/// (at least 4: the block asked for lies wholly before the current one).
/// A block of four takes a few ns once its records are in, so 16 pages
/// ahead asked too late for a miss: 64 measured `close` -15% in the tiered
/// page-1 replay and -10% in pressure against 16 (128 gained little more).
const AHEAD: usize = 64;

/// Within this many ids of the current block's first page, the block
/// asked for goes on with the list's run of consecutive pages (it lies
/// `AHEAD` + 4 ids on in such a run), whose records the hardware streams.
const NEAR: u32 = AHEAD as u32 + 8;

/// Starts loading the records of `pages`, four pages some blocks ahead of
/// `release`'s current block (whose first page is `now`), where they lie
/// apart from it. A closing request's output took one page a decode step,
/// so its records are spread over the pool: asked for ahead, their misses
/// overlap rather than follow each other, where a block's loads come only
/// once its test is reached. Consecutive pages (a prompt's) stream without
/// it, and skip its four prefetches. (`hold` measured no gain from the
/// same: its hit pages are mostly consecutive.)
#[inline(always)]
fn warm_records(st: &[PageState], pages: &[u32], now: u32) {
    if pages[0].abs_diff(now) > NEAR {
        for &p in pages {
            prefetch(st, p as usize);
        }
    }
}

impl PagePool {
    /// One more holder of each page, HELD or CACHED, in a request's order.
    /// The pages are distinct, as a request's are (a block of four reads
    /// its counts before writing any).
    ///
    /// A run of CACHED pages that sits in the eviction list oldest-last (as
    /// a request released them, last page first) leaves the list in one
    /// relink. Unlinking page by page would make each unlink wait on the
    /// links the one before it just wrote (the run's pages are each other's
    /// neighbours); here the run's links are only read, independently.
    pub(crate) fn hold(&mut self, pages: &[u32]) {
        let st = &mut self.records[..];
        let blocks = &mut self.blocks;
        let mut k = 0;
        // Whether to try a stretch (`stretches.rs`): from the start, and
        // again after a block of four consecutive pages that others hold,
        // so that a list of scattered or CACHED pages does not pay a failed
        // try every block.
        let mut stretch = true;
        while k < pages.len() {
            // Consecutive pages that others hold too (a shared system
            // prompt's, at page size 1): an aligned block's count, or one
            // slice of records (up to the next block).
            if stretch {
                let n = stretches::hold_held(st, blocks, &pages[k..]);
                if n > 0 {
                    k += n;
                    continue;
                }
                stretch = false;
            }
            // Four pages that others hold too take one more holder each,
            // with one test for the four.
            if let Some(&[q0, q1, q2, q3]) = pages.get(k..k + 4) {
                let q = [q0, q1, q2, q3];
                debug_assert!(distinct(q));
                let e = q.map(|p| st[p as usize].extra);
                if e.iter().all(|&x| x < UNHELD) {
                    for (p, x) in q.into_iter().zip(e) {
                        st[p as usize].extra = x + 1;
                    }
                    k += 4;
                    stretch = stretches::consecutive(&q);
                    continue;
                }
            }
            let p = pages[k];
            k += 1;
            if !st[p as usize].is_unheld() {
                st[p as usize].extra += 1;
                continue;
            }
            // CACHED: `p` and the pages after it that are each the older
            // neighbour of the one before form one segment of the list.
            // Each such page is CACHED too: only listed pages have links (a
            // page that leaves the list is unlinked), and a listed page's
            // older neighbour is listed or the sentinel, never in `pages`.
            // The tests fold into one value: a compare-and-branch would let
            // the compiler take the next page from the link just loaded,
            // chaining every load on the one before. `q` is read from
            // `pages`, never from a link.
            let first = k - 1;
            // The run's inner pages take their holder as the scan leaves
            // them (their links are read once, by the test of the page after
            // them); its two ends keep their links for `remove_run`, then
            // take theirs (one page: the same page twice, which is harmless).
            let mut prev = p;
            // Blocks of four first: one test a block, and the loop's own
            // count, compare and branch once per four pages rather than per
            // page (at page size 1 a cached prompt is thousands of pages, and
            // this scan was most of `open_with_prefix`'s instructions). The
            // block's links are read before any of its records is written.
            while let Some(&[q0, q1, q2, q3]) = pages.get(k..k + 4) {
                let bad = Eviction::older_xor(st, prev, q0)
                    | Eviction::older_xor(st, q0, q1)
                    | Eviction::older_xor(st, q1, q2)
                    | Eviction::older_xor(st, q2, q3);
                if bad != 0 {
                    break;
                }
                debug_assert!([q0, q1, q2, q3].iter().all(|&q| st[q as usize].is_unheld()));
                if prev != p {
                    st[prev as usize].hold_first();
                }
                st[q0 as usize].hold_first();
                st[q1 as usize].hold_first();
                st[q2 as usize].hold_first();
                prev = q3;
                k += 4;
            }
            for &q in &pages[k..] {
                if Eviction::older_xor(st, prev, q) != 0 {
                    break;
                }
                debug_assert!(st[q as usize].is_unheld());
                if prev != p {
                    st[prev as usize].hold_first();
                }
                prev = q;
                k += 1;
            }
            self.eviction.remove_run(st, p, prev, k - first);
            st[p as usize].hold_first();
            st[prev as usize].hold_first();
        }
    }

    /// One holder fewer of each page of `pages` (a request's list: distinct
    /// pages), last page first: freed pages then come back off the stack in
    /// their old order, and cached tail pages enter the eviction list before
    /// their parents, so eviction takes them first.
    ///
    /// Returns whether a page let go was a waiting copy's destination (its
    /// copy is dropped by `drop_released_copies` once the caller is done).
    pub(crate) fn release(&mut self, pages: &[u32]) -> bool {
        // Two copies of the loop: while no block has holders (`blocks.rs`;
        // the pool's state unless three requests at once hold a prompt)
        // none gains one during a release, and its loop has no block tests.
        match self.blocks.live() {
            0 => self.release_in::<false>(pages),
            _ => self.release_in::<true>(pages),
        }
    }

    /// `release`; `BLOCKS`: some block has holders.
    #[inline(always)]
    fn release_in<const BLOCKS: bool>(&mut self, pages: &[u32]) -> bool {
        let st = &mut self.records[..];
        let blocks = &mut self.blocks;
        let mut ins = self.eviction.begin_insert(st);
        let queued = !self.copies.is_empty();
        let mut marked = false;
        let mut rest = pages;
        // Whether to try a stretch, as in `hold`: from the end, and again
        // after a block of four consecutive pages that each keep a holder.
        let mut stretch = true;
        // Blocks of four first (from the end), where all four pages are
        // released alike: each keeps a holder, or each goes CACHED (a
        // registered page's last holder). One test a block rather than two
        // branches a page: at page size 1 a closing request's prompt and
        // output are thousands of pages. A waiting copy may have to hear of
        // a last holder's release, so with copies queued every page goes
        // the one-by-one way.
        while let (false, [head @ .., p3, p2, p1, p0]) = (queued, rest) {
            if stretch {
                // Consecutive pages that keep a holder each.
                let n = stretches::release_shared::<BLOCKS>(st, blocks, rest);
                if n > 0 {
                    rest = &rest[..rest.len() - n];
                    continue;
                }
                stretch = false;
            }
            if let Some(i) = head.len().checked_sub(AHEAD) {
                warm_records(st, &head[i..i + 4], *p0);
            }
            let q = [*p0, *p1, *p2, *p3];
            debug_assert!(distinct(q));
            let e = q.map(|p| st[p as usize].extra);
            // (`extra` is never unheld here: every page listed is held. A
            // record left holding its page once must have no block holders
            // beside it: `blocks.single` sends such pages one by one.)
            if e[0] != 0 && e[1] != 0 && e[2] != 0 && e[3] != 0 && !(BLOCKS && blocks.single(q, e))
            {
                for (p, x) in q.into_iter().zip(e) {
                    st[p as usize].extra = x - 1;
                }
                stretch = stretches::consecutive(&[*p3, *p2, *p1, *p0]);
            } else if e[0] | e[1] | e[2] | e[3] == 0
                && q.iter().all(|&p| st[p as usize].is_registered())
            {
                // Each names the victim HINT_AHEAD after it (`record.rs`).
                // Only here: pages released one by one below name none, as
                // the hint's plumbing there cost the blocks' loop about a
                // tenth (`close_4096_to_cached_page1_us` 2.9 -> 3.3).
                let h = hints4(head);
                for (p, h) in q.into_iter().zip(h) {
                    st[p as usize].cache_with_hint(h);
                }
                Eviction::insert_next4(st, &mut ins, q);
            } else {
                for p in q {
                    release_page::<BLOCKS>(st, blocks, &mut ins, &mut self.free, p);
                }
            }
            rest = head;
        }
        for &p in rest.iter().rev() {
            if queued && st[p as usize].extra == 0 {
                marked |= self.copies.mark_released(p);
            }
            release_page::<BLOCKS>(st, blocks, &mut ins, &mut self.free, p);
        }
        self.eviction.end_insert(st, ins);
        marked
    }

    /// `release` while no page is registered: a last holder frees the page
    /// outright.
    pub(crate) fn release_unregistered(&mut self, pages: &[u32]) -> bool {
        let queued = !self.copies.is_empty();
        let mut marked = false;
        for &p in pages.iter().rev() {
            if self.records[p as usize].extra == 0 {
                self.free.push(p); // FREE keeps its count 1
                if queued {
                    marked |= self.copies.mark_released(p);
                }
            } else {
                self.drop_shared_holder(p);
            }
        }
        marked
    }

    /// Frees `pages`, held by one request alone and unregistered: their
    /// counts are 1, a FREE page's count already, so this writes nothing per
    /// page but the free stack. (No copy waits on them: a request that
    /// never shared never copied.)
    #[inline]
    pub(crate) fn free_exclusive(&mut self, pages: &[u32]) {
        self.free.extend(pages.iter().rev());
    }

    /// One holder fewer of page `p` for a hold no page list names (a
    /// waiting copy's source); returns whether that was its last holder
    /// (it is then CACHED if registered, else FREE).
    pub(crate) fn release_one(&mut self, p: u32) -> bool {
        if self.records[p as usize].extra != 0 {
            self.drop_shared_holder(p);
            return false;
        }
        if self.records[p as usize].is_registered() {
            self.records[p as usize].cache_with_hint(0);
            self.eviction.insert(&mut self.records, p);
        } else {
            self.free.push(p); // FREE keeps its count 1
        }
        true
    }
}

/// The victim hint of the page at `pages[i]` in a release, which goes from
/// the last page to the first: the page released `HINT_AHEAD` after it,
/// whatever becomes of that page (0 past the list's first page). Pages
/// that stay HELD in between put the victim it names further on, and one
/// that stays HELD itself is no victim: a hint only warms a record.
#[inline(always)]
fn hint(pages: &[u32], i: usize) -> u32 {
    match i.checked_sub(HINT_AHEAD) {
        Some(j) => pages[j],
        None => 0,
    }
}

/// `hint` of the block of four pages that follows `head` in a release's
/// list, last page first (as `release` takes them): four ids read from
/// `head`'s end (none where it is shorter than `HINT_AHEAD`).
#[inline(always)]
fn hints4(head: &[u32]) -> [u32; 4] {
    match head.len().checked_sub(HINT_AHEAD) {
        Some(j) => {
            let h = &head[j..j + 4];
            [h[3], h[2], h[1], h[0]]
        }
        None => [3, 2, 1, 0].map(|k| hint(head, head.len() + k)),
    }
}

/// No page twice among four.
fn distinct([a, b, c, d]: [u32; 4]) -> bool {
    a != b && a != c && a != d && b != c && b != d && c != d
}

/// One holder fewer of page `p`: its last holder's release makes it CACHED
/// (count 0, the newest of the insertion `ins`) if registered, else FREE
/// (its count stays 1). A record about to hold its page once first takes
/// in its block's count, if it has one (`blocks.rs`); a record's last
/// holder never has block holders beside it.
#[inline(always)]
fn release_page<const BLOCKS: bool>(
    st: &mut [PageState],
    blocks: &mut BlockHolds,
    ins: &mut Insert,
    free: &mut Vec<u32>,
    p: u32,
) {
    if BLOCKS && st[p as usize].extra == 1 {
        blocks.flatten(st, p);
    }
    let s = &mut st[p as usize];
    if s.extra != 0 {
        s.extra -= 1;
    } else if s.is_registered() {
        s.cache_with_hint(0);
        Eviction::insert_next(st, ins, p);
    } else {
        free.push(p);
    }
}

#[cfg(test)]
mod tests;
