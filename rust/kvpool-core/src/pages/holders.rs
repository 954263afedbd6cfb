//! Holds and releases in bulk: a request's page list gains or loses one
//! holder a page, and the pages whose count crosses zero move between HELD
//! and CACHED (or FREE) in their eviction list's order (see `mod.rs`).

use super::record::{PageState, UNHELD};
use super::PagePool;
use crate::eviction::{Eviction, Insert};

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
        let mut k = 0;
        while k < pages.len() {
            // Four pages that others hold too (a shared system prompt's)
            // take one more holder each, with one test for the four.
            if let Some(&[q0, q1, q2, q3]) = pages.get(k..k + 4) {
                let q = [q0, q1, q2, q3];
                debug_assert!(distinct(q));
                let e = q.map(|p| st[p as usize].extra);
                if e.iter().all(|&x| x != UNHELD) {
                    for (p, x) in q.into_iter().zip(e) {
                        st[p as usize].extra = x + 1;
                    }
                    k += 4;
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
    /// pages), last page first: freed pages then come back off the stack in their old
    /// order, and cached tail pages enter the eviction list before their
    /// parents, so eviction takes them first.
    ///
    /// Returns whether a page let go was a waiting copy's destination (its
    /// copy is dropped by `drop_released_copies` once the caller is done).
    pub(crate) fn release(&mut self, pages: &[u32]) -> bool {
        let st = &mut self.records[..];
        let mut ins = self.eviction.begin_insert(st);
        let queued = !self.copies.is_empty();
        let mut marked = false;
        let mut rest = pages;
        // Blocks of four first (from the end), where all four pages are
        // released alike: each keeps a holder, or each goes CACHED (a
        // registered page's last holder). One test a block rather than two
        // branches a page: at page size 1 a closing request's prompt and
        // output are thousands of pages. A waiting copy may have to hear of
        // a last holder's release, so with copies queued every page goes
        // the one-by-one way.
        while let (false, [head @ .., p3, p2, p1, p0]) = (queued, rest) {
            let q = [*p0, *p1, *p2, *p3];
            debug_assert!(distinct(q));
            let e = q.map(|p| st[p as usize].extra);
            // (`extra` is never UNHELD here: every page listed is held.)
            if e[0] != 0 && e[1] != 0 && e[2] != 0 && e[3] != 0 {
                for (p, x) in q.into_iter().zip(e) {
                    st[p as usize].extra = x - 1;
                }
            } else if e[0] | e[1] | e[2] | e[3] == 0
                && q.iter().all(|&p| st[p as usize].is_registered())
            {
                for p in q {
                    st[p as usize].extra = UNHELD;
                }
                Eviction::insert_next4(st, &mut ins, q);
            } else {
                for p in q {
                    release_page(st, &mut ins, &mut self.free, p);
                }
            }
            rest = head;
        }
        for &p in rest.iter().rev() {
            if queued && st[p as usize].extra == 0 {
                marked |= self.copies.mark_released(p);
            }
            release_page(st, &mut ins, &mut self.free, p);
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
            let s = &mut self.records[p as usize];
            if s.extra == 0 {
                self.free.push(p); // FREE keeps its count 1
                if queued {
                    marked |= self.copies.mark_released(p);
                }
            } else {
                s.extra -= 1;
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
        let s = &mut self.records[p as usize];
        if s.extra != 0 {
            s.extra -= 1;
            return false;
        }
        if s.is_registered() {
            s.extra = UNHELD;
            self.eviction.insert(&mut self.records, p);
        } else {
            self.free.push(p); // FREE keeps its count 1
        }
        true
    }
}

/// No page twice among four.
fn distinct([a, b, c, d]: [u32; 4]) -> bool {
    a != b && a != c && a != d && b != c && b != d && c != d
}

/// One holder fewer of page `p`: its last holder's release makes it CACHED
/// (count 0, the newest of the insertion `ins`) if registered, else FREE
/// (its count stays 1).
#[inline(always)]
fn release_page(st: &mut [PageState], ins: &mut Insert, free: &mut Vec<u32>, p: u32) {
    let s = &mut st[p as usize];
    if s.extra != 0 {
        s.extra -= 1;
    } else if s.is_registered() {
        s.extra = UNHELD;
        Eviction::insert_next(st, ins, p);
    } else {
        free.push(p);
    }
}

#[cfg(test)]
mod tests {
    use super::PagePool;

    /// A small xorshift: the shapes below must repeat run to run.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % n as u64) as usize
        }
    }

    /// The CACHED pages, oldest first.
    fn eviction_order(pool: &PagePool) -> Vec<u32> {
        let mut out = Vec::new();
        let mut p = pool.victim();
        while p != 0 {
            out.push(p);
            p = pool.next_victim(p);
        }
        out
    }

    /// `hold` takes a CACHED run, and pages others hold, in blocks of four
    /// and the rest page by page. Random page lists cut runs at every
    /// offset inside a block (a HELD page, a page out of list order, a gap,
    /// the list's end) and put HELD pages in blocks or alone, and
    /// the result must be what one holder a page gives: the held pages off
    /// the list, every other CACHED page still on it in its old order.
    #[test]
    fn hold_cuts_cached_runs_anywhere_inside_a_block() {
        const N: usize = 48;
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..400 {
            let mut pool = PagePool::new(N, false).unwrap();
            let all: Vec<u32> = (0..N - 1).map(|_| pool.pop_free().unwrap()).collect();
            for &p in &all {
                pool.set_entry(p, p);
            }
            // Some pages stay HELD by another request; the rest are
            // released in a few calls, each in its own order.
            let mut other = Vec::new();
            let mut released = Vec::new();
            for &p in &all {
                if rng.below(6) == 0 {
                    other.push(p);
                } else {
                    released.push(p);
                }
            }
            for i in (1..released.len()).rev() {
                if rng.below(3) == 0 {
                    released.swap(i, rng.below(i + 1));
                }
            }
            for chunk in released.chunks(1 + rng.below(20)) {
                pool.release(chunk);
            }
            let before = eviction_order(&pool);
            // The list newest first is one long run; take it in pieces,
            // some skipped, some moved, with HELD pages between them.
            let mut newest_first = before.clone();
            newest_first.reverse();
            let mut pieces: Vec<Vec<u32>> = Vec::new();
            let mut at = 0;
            while at < newest_first.len() {
                let len = 1 + rng.below(11);
                let piece = &newest_first[at..(at + len).min(newest_first.len())];
                at += len;
                if rng.below(4) != 0 {
                    pieces.push(piece.to_vec());
                }
            }
            if pieces.len() > 1 && rng.below(2) == 0 {
                let i = rng.below(pieces.len());
                pieces.swap(0, i);
            }
            let mut list = Vec::new();
            for piece in pieces {
                list.extend(piece);
                // Held pages between the pieces, up to a few blocks' worth.
                if !other.is_empty() && rng.below(3) == 0 {
                    for _ in 0..1 + rng.below(9) {
                        let h = other[rng.below(other.len())];
                        if !list.contains(&h) {
                            list.push(h);
                        }
                    }
                }
            }

            pool.hold(&list);

            let mut holders = vec![0u32; N];
            for &p in other.iter().chain(&list) {
                holders[p as usize] += 1;
            }
            pool.check(holders.clone(), 1).unwrap();
            for &p in &list {
                assert_eq!(pool.holders(p), holders[p as usize], "page {p}");
            }
            let kept: Vec<u32> = before.into_iter().filter(|p| !list.contains(p)).collect();
            assert_eq!(eviction_order(&pool), kept);
        }
    }

    /// `release` takes blocks of four alike pages at once and mixed blocks
    /// page by page. Random lists mix pages that keep a holder, registered
    /// pages that go CACHED and unregistered ones that go FREE; the result
    /// must be one-by-one release, last page first: the CACHED ones appended
    /// to the list newest last, the FREE ones pushed on the stack.
    #[test]
    fn release_in_blocks_keeps_the_one_by_one_order() {
        const N: usize = 64;
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        for _ in 0..400 {
            let mut pool = PagePool::new(N, false).unwrap();
            let mut list: Vec<u32> = (0..N - 1).map(|_| pool.pop_free().unwrap()).collect();
            for i in (1..list.len()).rev() {
                list.swap(i, rng.below(i + 1));
            }
            // The pages past the list stay with a request of their own.
            let mut others = vec![0u32; N];
            for &p in &list[1 + rng.below(N - 1)..] {
                others[p as usize] = 1;
            }
            list.retain(|&p| others[p as usize] == 0);
            // Runs of alike pages, so that whole blocks of each kind occur.
            let mut kind = 0;
            let mut shared = [false; N];
            for &p in &list {
                if rng.below(4) == 0 {
                    kind = rng.below(3);
                }
                match kind {
                    0 => {
                        pool.add_holder(p);
                        others[p as usize] = 1;
                        shared[p as usize] = true;
                    }
                    1 => pool.set_entry(p, p),
                    _ => {}
                }
            }
            let mut cached = eviction_order(&pool);
            let mut freed = Vec::new();
            for &p in list.iter().rev() {
                match (shared[p as usize], pool.is_registered(p)) {
                    (true, _) => {}
                    (_, true) => cached.push(p),
                    _ => freed.push(p),
                }
            }

            assert!(!pool.release(&list));

            pool.check(others.clone(), 1).unwrap();
            assert_eq!(eviction_order(&pool), cached);
            let top: Vec<u32> = (0..freed.len()).map(|_| pool.pop_free().unwrap()).collect();
            freed.reverse();
            assert_eq!(top, freed);
            for (p, &n) in others.iter().enumerate().skip(1) {
                if n == 1 {
                    assert_eq!(pool.holders(p as u32), 1, "page {p}");
                }
            }
        }
    }
}
