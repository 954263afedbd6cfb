//! `open_with_chain` with a `length`: the open and the extend to `length` in
//! one atomic call. The room for the pages beyond the matched ones is what is
//! FREE or evictable once the matched pages are held: a matched CACHED page
//! stops being room when it is held, a pinned one never was room. A refusal
//! changes nothing, eviction order included (an open that was closed again
//! would put the matched pages back at the LRU's newest end).

use kvpool_core::{page_hashes, Counts, Options, PoolError, SlotAllocator};

mod common;

/// `err` is `Exhausted` for `needed` pages against `room`.
fn assert_exhausted(err: &PoolError, needed: usize, room: usize) {
    assert!(
        matches!(err, PoolError::Exhausted { needed_pages, free_pages, .. }
            if *needed_pages == needed && *free_pages == room),
        "{err:?}"
    );
}

use common::{seq, serve};

const PS: usize = 4;

/// Pages 1..=7: prompt A's two pages cached (oldest), prompt B's two cached
/// (newer), the three FREE ones held by an open request. So `free_pages` is
/// 4, all of it evictable, and A's chain matches 2 pages. With `pin_a`, A's
/// pages are pinned instead (not room: `free_pages` is 2).
fn setup(pin_a: bool) -> (SlotAllocator, Vec<u128>, Vec<i64>) {
    let opts = Options {
        hash_seed: Some(7),
        max_pinned_pages: Some(4),
        ..Options::new()
    };
    let mut a = SlotAllocator::with_options(8, PS, 8, 64, opts).unwrap();
    let prompt_a = seq(8, 100);
    if pin_a {
        let (h, _) = a
            .open_with_prefix(&prompt_a, &[8], Counts::Each(0))
            .unwrap();
        a.extend(&h, Counts::Each(8), None).unwrap();
        a.close_with_priority(&h, Counts::Each(100), None).unwrap();
    } else {
        serve(&mut a, &prompt_a, 0);
    }
    serve(&mut a, &seq(8, 200), 0);
    let h = a.open(1).unwrap();
    a.extend(&h, Counts::Each(12), None).unwrap();
    assert_eq!(a.free_pages(), if pin_a { 2 } else { 4 });
    let hashes = page_hashes(7, 0, PS, &prompt_a).unwrap();
    (a, hashes, prompt_a)
}

/// What a caller can observe of a pool without changing it.
fn counters(a: &SlotAllocator) -> [u64; 8] {
    [
        a.free_pages() as u64,
        a.used_pages() as u64,
        a.evictable_pages() as u64,
        a.cached_pages() as u64,
        a.open_requests() as u64,
        a.hit_tokens(),
        a.miss_tokens(),
        a.used_slots() as u64,
    ]
}

/// `a` is exactly as `before`: same counters, and the next allocation that
/// must evict takes the same pages (eviction order unchanged).
fn assert_unchanged(mut a: SlotAllocator, mut before: SlotAllocator) {
    a.check().unwrap();
    assert_eq!(counters(&a), counters(&before));
    let n = a.free_pages() as i64 * PS as i64;
    let (_, got) = a.admit(&[n], None).unwrap();
    let (_, want) = before.admit(&[n], None).unwrap();
    assert_eq!(got, want, "the same victims, in the same order");
}

#[test]
fn refused_when_the_only_room_is_the_matched_pages_own() {
    let (mut a, hs, toks) = setup(false);
    let before = a.clone();
    // 5 pages: 2 matched + 3 new; held, the matched ones leave 2 of the 4.
    let err = a
        .open_with_chain(&hs, &toks, 0, usize::MAX, Some(17))
        .unwrap_err();
    assert_exhausted(&err, 3, 2);
    assert_unchanged(a, before);
}

#[test]
fn fits_exactly_in_what_is_left_after_the_hold() {
    let (mut a, hs, toks) = setup(false);
    let a_slots: Vec<i64> = (4..12).collect(); // A's pages 1, 2
    let (h, cached) = a
        .open_with_chain(&hs, &toks, 0, usize::MAX, Some(16))
        .unwrap();
    assert_eq!((cached, a.length(h).unwrap()), (8, 16));
    assert_eq!(a.slots(h).unwrap()[..8], a_slots[..]);
    assert_eq!((a.free_pages(), a.evictable_pages()), (0, 0));
    assert_eq!(
        a.known_tokens(h).unwrap(),
        seq(8, 100).iter().map(|&t| t as i32).collect::<Vec<_>>()
    );
    a.check().unwrap();
}

#[test]
fn pinned_matched_pages_were_never_room() {
    let (mut a, hs, toks) = setup(true);
    let before = a.clone();
    let err = a
        .open_with_chain(&hs, &toks, 0, usize::MAX, Some(17))
        .unwrap_err();
    assert_exhausted(&err, 3, 2);
    assert_unchanged(a.clone(), before);
    // Holding the pinned pages takes nothing from the 2 pages of room.
    let (h, cached) = a
        .open_with_chain(&hs, &toks, 0, usize::MAX, Some(16))
        .unwrap();
    assert_eq!((cached, a.length(h).unwrap(), a.free_pages()), (8, 16, 0));
    a.check().unwrap();
}

#[test]
fn held_matched_pages_take_no_room() {
    let (mut a, hs, toks) = setup(false);
    // Another request holds A's pages: the room is B's 2 pages either way.
    let longer = [toks.clone(), vec![1]].concat();
    let (o, c) = a.open_with_prefix(&longer, &[9], Counts::Each(0)).unwrap();
    assert_eq!((c[0], a.free_pages()), (8, 2));
    let before = a.clone();
    let err = a
        .open_with_chain(&hs, &toks, 0, usize::MAX, Some(17))
        .unwrap_err();
    assert_exhausted(&err, 3, 2);
    assert_unchanged(a.clone(), before);
    let (h, _) = a
        .open_with_chain(&hs, &toks, 0, usize::MAX, Some(16))
        .unwrap();
    assert_eq!(a.slots(h).unwrap()[..8], a.slots(o[0]).unwrap()[..8]);
    a.check().unwrap();
}

#[test]
fn max_pages_caps_the_match_and_length_may_end_mid_page() {
    let (mut a, hs, toks) = setup(false);
    let (h, cached) = a.open_with_chain(&hs, &toks, 0, 1, Some(5)).unwrap();
    assert_eq!((cached, a.length(h).unwrap()), (4, 5));
    // Its new page evicted A's second page (a chain's tail goes first); the
    // length the match already gives: nothing to extend.
    assert_eq!(a.match_chain(&hs, &toks, 0).unwrap(), 1);
    let (h2, cached) = a.open_with_chain(&hs, &toks, 0, 2, Some(4)).unwrap();
    assert_eq!((cached, a.length(h2).unwrap()), (4, 4));
    a.check().unwrap();
}

#[test]
fn bad_lengths_are_typed_errors_and_change_nothing() {
    let (mut a, hs, toks) = setup(false);
    let before = a.clone();
    let e = a
        .open_with_chain(&hs, &toks, 0, usize::MAX, Some(-1))
        .unwrap_err();
    assert!(
        matches!(&e, PoolError::InvalidArgument(m) if m.contains("[8, 64]")),
        "{e}"
    );
    let e = a
        .open_with_chain(&hs, &toks, 0, usize::MAX, Some(7))
        .unwrap_err();
    assert!(
        matches!(&e, PoolError::InvalidArgument(m) if m.contains("[8, 64]")),
        "{e}"
    );
    // With max_pages the range starts at the capped match.
    let e = a.open_with_chain(&hs, &toks, 0, 1, Some(3)).unwrap_err();
    assert!(
        matches!(&e, PoolError::InvalidArgument(m) if m.contains("[4, 64]")),
        "{e}"
    );
    let e = a
        .open_with_chain(&hs, &toks, 0, usize::MAX, Some(65))
        .unwrap_err();
    assert!(
        matches!(
            e,
            PoolError::ContextTooLong {
                handle: -1,
                length: 65,
                max: 64
            }
        ),
        "{e}"
    );
    assert_unchanged(a, before);
}
