//! The copy-on-write queue between the call that queues a copy and the
//! `take_copies` that hands it to the caller: a waiting copy keeps its source
//! page held, and the copies of a destination page its holders let go of are
//! dropped, so the queue stays bounded by the pool.

use kvpool_core::{Counts, SlotAllocator};

mod common;

use common::{pool, seq};

/// A parent of 6 tokens at page size 4 (pages 1 and 2, page 2 half full)
/// and one fork, which then writes one token: it copies slots 8, 9 of the
/// shared page 2 to 12, 13 of a new page 3, and the copy stays queued.
fn forked_and_copied() -> (SlotAllocator, i64, i64) {
    let mut a = pool(32, 4);
    let h = a.open(1).unwrap();
    a.extend(&h, Counts::Each(6), Some(&seq(6, 0))).unwrap();
    let k = a.fork(h[0], 1).unwrap();
    a.extend(&k, Counts::Each(1), None).unwrap();
    assert_eq!(a.pending_copies(), 2);
    assert_eq!(a.pages(k[0]).unwrap(), vec![1, 3]);
    a.check().unwrap();
    (a, h[0], k[0])
}

#[test]
fn closing_the_destination_drops_its_copies() {
    for cache in [false, true] {
        let (mut a, _, k) = forked_and_copied();
        a.close(&[k], cache).unwrap();
        assert_eq!(a.pending_copies(), 0);
        a.check().unwrap();
        // Page 3 goes to the next request; no copy may land in it.
        let n = a.open(1).unwrap();
        assert_eq!(a.extend(&n, Counts::Each(4), None).unwrap(), seq(4, 12));
        assert_eq!(a.take_copies(), (vec![], vec![]));
        a.check().unwrap();
    }
}

#[test]
fn truncating_off_the_destination_drops_its_copies() {
    let (mut a, _, k) = forked_and_copied();
    // Keeping part of page 3 keeps the copy: the request still needs it.
    a.truncate(&[k], Counts::Each(5)).unwrap();
    assert_eq!(a.pending_copies(), 2);
    a.check().unwrap();
    a.truncate(&[k], Counts::Each(4)).unwrap(); // page 3 released
    assert_eq!(a.pending_copies(), 0);
    assert_eq!(a.take_copies(), (vec![], vec![]));
    a.check().unwrap();
}

#[test]
fn reset_empties_the_queue_and_frees_every_source() {
    let (mut a, _, _) = forked_and_copied();
    a.reset();
    assert_eq!(a.pending_copies(), 0);
    assert_eq!(a.take_copies(), (vec![], vec![]));
    assert_eq!(a.free_pages(), a.capacity_pages());
    a.check().unwrap();
}

#[test]
fn a_waiting_copy_keeps_its_source_page_held() {
    let (mut a, h, _) = forked_and_copied();
    let free = a.free_pages();
    // The parent goes (page 1 stays with the fork); page 2 is the copy's
    // source, so it is not freed.
    a.close(&[h], false).unwrap();
    assert_eq!(a.free_pages(), free, "page 2 is still held");
    a.check().unwrap();
    // A new admission takes the top of the free stack, never page 2.
    let (_, slots) = a.admit(&[8], None).unwrap();
    assert!(slots.iter().all(|&s| s / 4 != 2), "{slots:?}");
    // Nor does eviction or clear_cache reach it.
    a.clear_cache();
    assert_eq!(a.evict(usize::MAX), 0);
    assert_eq!(a.take_copies(), (vec![8, 9], vec![12, 13]));
    // Taken, the copy lets page 2 go.
    assert_eq!(a.free_pages(), free - 2 + 1);
    a.check().unwrap();
}

#[test]
fn a_waiting_copy_keeps_its_source_page_from_being_written_in_place() {
    let (mut a, h, _) = forked_and_copied();
    // The parent is page 2's only request, but the copy still reads slots
    // 8 and 9: writing slot 9 again must go to a copy of the page.
    a.truncate(&[h], Counts::Each(5)).unwrap();
    let s = a.extend(&[h], Counts::Each(1), Some(&[77])).unwrap();
    assert_ne!(s[0] / 4, 2, "wrote slot {} in place", s[0]);
    let (src, dst) = a.take_copies();
    assert_eq!(src, vec![8, 9, 8]);
    assert_eq!(dst[..2], [12, 13]);
    assert_eq!(dst[2] / 4, s[0] / 4);
    a.check().unwrap();
}

#[test]
fn within_one_call_the_last_holder_still_writes_in_place() {
    // The copy runs before the step's writes, so inside the call that
    // queues it the parent, now alone, writes its page in place past the
    // copied slots; only afterwards does the waiting copy hold the page.
    let mut a = pool(32, 4);
    let h = a.open(1).unwrap();
    a.extend(&h, Counts::Each(6), Some(&seq(6, 0))).unwrap();
    let k = a.fork(h[0], 1).unwrap();
    let s = a.extend(&[k[0], h[0]], Counts::Each(1), None).unwrap();
    assert_eq!(s, vec![14, 10]);
    assert_eq!(a.pending_copies(), 2);
    a.check().unwrap();
    // The next write into page 2 while the copy waits goes to a copy.
    let s = a.extend(&h, Counts::Each(1), None).unwrap();
    assert_eq!(s, vec![19]);
    let dst: Vec<i64> = seq(2, 12).into_iter().chain(seq(3, 16)).collect();
    assert_eq!(a.take_copies(), (vec![8, 9, 8, 9, 10], dst));
    a.check().unwrap();
    // Drained, the page has one holder again: written in place.
    let mut b = pool(32, 4);
    let h = b.open(1).unwrap();
    b.extend(&h, Counts::Each(6), Some(&seq(6, 0))).unwrap();
    let k = b.fork(h[0], 1).unwrap();
    b.extend(&[k[0], h[0]], Counts::Each(1), None).unwrap();
    let _ = b.take_copies();
    assert_eq!(b.extend(&h, Counts::Each(1), None).unwrap(), vec![11]);
    assert_eq!(b.pending_copies(), 0);
    b.check().unwrap();
}

#[test]
fn a_chain_of_waiting_copies_is_dropped_from_its_end() {
    // k copies page 2 to page 3; k's fork k2 copies page 3 to page 4. Page
    // 3 is the second copy's source, so closing k keeps it and its copy.
    let (mut a, h, k) = forked_and_copied();
    let k2 = a.fork(k, 1).unwrap()[0];
    a.extend(&[k2], Counts::Each(1), None).unwrap();
    assert_eq!(a.pending_copies(), 5);
    a.close(&[k, h], false).unwrap();
    assert_eq!(a.pending_copies(), 5, "k2 still needs both copies");
    a.check().unwrap();
    a.close(&[k2], false).unwrap();
    assert_eq!(a.pending_copies(), 0);
    assert_eq!(a.free_pages(), a.capacity_pages());
    a.check().unwrap();
}

#[test]
fn take_copies_from_leaves_the_earlier_copies_and_their_holds() {
    let (mut a, h, k) = forked_and_copied();
    let before = a.pending_copies();
    let k2 = a.fork(h, 1).unwrap()[0];
    a.extend(&[k2], Counts::Each(1), None).unwrap();
    let (src, dst) = a.take_copies_from(before);
    assert_eq!((src, dst.len()), (vec![8, 9], 2));
    assert_eq!(a.pending_copies(), 2);
    a.close(&[h, k2], false).unwrap();
    // k holds pages 1 and 3; page 2 waits for k's copy, page 4 went with k2.
    assert_eq!(a.used_pages(), 3);
    assert_eq!(a.pages(k).unwrap(), vec![1, 3]);
    a.check().unwrap();
    assert_eq!(a.take_copies(), (vec![8, 9], vec![12, 13]));
    assert_eq!(a.used_pages(), 2);
    a.check().unwrap();
}

#[test]
fn a_copy_taken_before_the_copy_that_fills_its_source_reads_that_copys_source() {
    // k copies slots 8, 9 of page 2 to page 3 and writes slot 14; that copy
    // stays queued. k's fork k2 then copies page 3 (slots 12..15) to page 4,
    // and the caller takes only that second copy, to run it now: slots 12,
    // 13 do not hold their K/V until the first copy runs, so they are read
    // from page 2 (8, 9), and slot 14, written in place, from page 3.
    let (mut a, _h, k) = forked_and_copied();
    let before = a.pending_copies();
    let k2 = a.fork(k, 1).unwrap()[0];
    a.extend(&[k2], Counts::Each(1), None).unwrap();
    assert_eq!(a.pages(k2).unwrap(), vec![1, 4]);
    let (src, dst) = a.take_copies_from(before);
    assert_eq!((src, dst), (vec![8, 9, 14], vec![16, 17, 18]));
    a.check().unwrap();
    // Then k lets go of page 3 (nothing reads it now): its copy goes too.
    a.truncate(&[k], Counts::Each(4)).unwrap();
    assert_eq!(a.pending_copies(), 0);
    assert_eq!(a.take_copies(), (vec![], vec![]));
    a.check().unwrap();
}

#[test]
fn copies_never_drained_stay_bounded() {
    // An engine that never drains: each cycle forks two children of a
    // request with a half-full page, both write (two copies), both close.
    let mut a = pool(32, 4);
    let h = a.open(1).unwrap();
    a.extend(&h, Counts::Each(6), Some(&seq(6, 0))).unwrap();
    let mut settled = 0;
    for cycle in 0..100_000 {
        let kids = a.fork(h[0], 2).unwrap();
        a.extend(&kids, Counts::Each(1), None).unwrap();
        assert!(a.pending_copies() <= 4);
        a.close(&kids, cycle % 2 == 0).unwrap();
        assert_eq!(a.pending_copies(), 0);
        if cycle == 10 {
            settled = a.metadata_bytes();
        } else if cycle > 10 {
            assert_eq!(a.metadata_bytes(), settled, "cycle {cycle}");
        }
    }
    a.check().unwrap();
}
