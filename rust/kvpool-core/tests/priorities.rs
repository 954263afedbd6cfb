//! Retention priorities: eviction order (lowest priority first, least
//! recently used within one), durations on a manual clock, pins and their
//! bound, the highest priority winning, duplicates, `unpin`, `clear_cache`,
//! and bad input that changes nothing.

mod common;

use common::seq;
use kvpool_core::{
    Counts, Options, PoolError, SlotAllocator, DEFAULT_PRIORITY, EVENT_REMOVED, MAX_PRIORITY,
};

/// Page size 2, 16 usable pages, a manual clock, at most `max_pinned` pins.
fn pool(max_pinned: Option<usize>) -> SlotAllocator {
    let opts = Options {
        hash_seed: Some(7),
        manual_clock: true,
        max_pinned_pages: max_pinned,
        ..Options::new()
    };
    SlotAllocator::with_options(17, 2, 8, 64, opts).unwrap()
}

/// Opens `prompt`, prefills it, closes it with `prio` (None: plain
/// `close(cache=true)`); returns its pages.
fn serve(a: &mut SlotAllocator, prompt: &[i64], prio: Option<(i64, Option<f64>)>) -> Vec<i32> {
    let (h, cached) = a
        .open_with_prefix(prompt, &[prompt.len() as i64], Counts::Each(0))
        .unwrap();
    a.extend(&h, Counts::Each(prompt.len() as i64 - cached[0]), None)
        .unwrap();
    let pages = a.pages(h[0]).unwrap();
    match prio {
        None => a.close(&h, true).unwrap(),
        Some((q, r)) => a.close_with_priority(&h, Counts::Each(q), r).unwrap(),
    }
    a.check().unwrap();
    pages
}

/// The pages `evict(n)` takes, in order.
fn evicted(a: &mut SlotAllocator, n: usize) -> Vec<i32> {
    a.take_events();
    assert_eq!(a.evict(n), n);
    a.check().unwrap();
    let ev = a.take_events();
    assert!(ev.kind.iter().all(|&k| k == EVENT_REMOVED));
    ev.page
}

#[test]
fn lowest_priority_goes_first_least_recent_within_one() {
    let mut a = pool(None);
    let hi = serve(&mut a, &seq(4, 0), Some((80, None)));
    let lo = serve(&mut a, &seq(4, 100), Some((10, None)));
    let d1 = serve(&mut a, &seq(4, 200), None);
    let lo2 = serve(&mut a, &seq(4, 300), Some((10, None)));
    let d2 = serve(&mut a, &seq(4, 400), Some((DEFAULT_PRIORITY as i64, None)));
    let rev = |p: &[i32]| p.iter().rev().copied().collect::<Vec<_>>();
    let want: Vec<i32> = [rev(&lo), rev(&lo2), rev(&d1), rev(&d2), rev(&hi)].concat();
    let mut by = [0usize; 101];
    (by[10], by[DEFAULT_PRIORITY as usize], by[80]) = (4, 4, 2);
    assert_eq!(a.evictable_pages_by_priority(), by);
    assert_eq!(evicted(&mut a, 10), want);
}

#[test]
fn an_extend_short_of_free_pages_evicts_by_priority_too() {
    let mut a = pool(None);
    let keep = serve(&mut a, &seq(8, 0), Some((90, None)));
    let go = serve(&mut a, &seq(8, 100), None);
    // 8 FREE pages left: a 12-page request takes them and the 4 default pages.
    a.take_events();
    let h = a.open(1).unwrap();
    a.extend(&h, Counts::Each(24), None).unwrap();
    let mut gone = a.take_events().page;
    gone.sort();
    let mut want = go.clone();
    want.sort();
    assert_eq!(gone, want);
    assert!(keep.iter().all(|p| !a.pages(h[0]).unwrap().contains(p)));
    a.check().unwrap();
}

#[test]
fn a_duration_ends_on_the_clock_and_the_page_rejoins_the_default_as_newest() {
    let mut a = pool(None);
    let timed = serve(&mut a, &seq(4, 0), Some((90, Some(5.0))));
    let d1 = serve(&mut a, &seq(4, 100), None);
    a.set_clock(4.999).unwrap();
    a.check().unwrap();
    assert_eq!(a.evictable_pages_by_priority()[90], 2, "not over yet");
    a.set_clock(5.0).unwrap();
    a.check().unwrap();
    let by = a.evictable_pages_by_priority();
    assert_eq!((by[90], by[DEFAULT_PRIORITY as usize]), (0, 4));
    // It joined the default list after d1's pages (as its newest).
    let rev = |p: &[i32]| p.iter().rev().copied().collect::<Vec<_>>();
    assert_eq!(evicted(&mut a, 4), [rev(&d1), rev(&timed)].concat());
}

#[test]
fn a_low_priority_with_a_duration_rises_to_the_default_at_its_end() {
    let mut a = pool(None);
    let d1 = serve(&mut a, &seq(4, 0), None);
    let low = serve(&mut a, &seq(4, 100), Some((0, Some(1.0))));
    a.set_clock(2.0).unwrap();
    let rev = |p: &[i32]| p.iter().rev().copied().collect::<Vec<_>>();
    assert_eq!(evicted(&mut a, 4), [rev(&d1), rev(&low)].concat());
}

#[test]
fn the_default_priority_given_with_a_duration_keeps_its_place_at_its_end() {
    // 34 and 36 leave the default list's order when given, and rejoin it as
    // its newest when they end; a page given 35 never left it, so giving it
    // and its end both leave it where it is (the Python reference in
    // tests/test_review_monitoring.py keeps the same rule).
    let rev = |p: &[i32]| p.iter().rev().copied().collect::<Vec<_>>();
    for q in [
        DEFAULT_PRIORITY as i64 - 1,
        DEFAULT_PRIORITY as i64,
        DEFAULT_PRIORITY as i64 + 1,
    ] {
        let mut a = pool(None);
        let timed = serve(&mut a, &seq(4, 0), Some((q, Some(1.0))));
        let d1 = serve(&mut a, &seq(4, 100), None);
        a.set_clock(2.0).unwrap();
        a.check().unwrap();
        let want = if q == DEFAULT_PRIORITY as i64 {
            [rev(&timed), rev(&d1)].concat()
        } else {
            [rev(&d1), rev(&timed)].concat()
        };
        assert_eq!(evicted(&mut a, 4), want, "priority {q}");
    }
}

#[test]
fn priority_100_with_no_duration_pins_until_unpin() {
    let mut a = pool(None);
    let prompt = seq(8, 0);
    let pinned = serve(&mut a, &prompt, Some((100, None)));
    assert_eq!(a.pinned_pages(), 4);
    assert_eq!(a.evictable_pages(), 0);
    assert_eq!(a.free_pages(), 12, "pinned cached pages are not free");
    assert_eq!(a.admissible_tokens(), 24);
    assert_eq!(a.used_pages(), 0, "nor held");
    assert_eq!(a.evict(100), 0);
    // An extend past the free pages is refused, and says why.
    let h = a.open(1).unwrap();
    let e = a.extend(&h, Counts::Each(26), None).unwrap_err();
    assert!(
        matches!(
            e,
            PoolError::Exhausted {
                needed_pages: 13,
                free_pages: 12,
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("pinned cached pages are not free"),
        "{e}"
    );
    a.close(&h, false).unwrap();
    // Reach the pinned prefix through a request opened on it, and unpin.
    let mut longer = prompt.clone();
    longer.push(9);
    let (h, cached) = a.open_with_prefix(&longer, &[9], Counts::Each(0)).unwrap();
    assert_eq!(cached[0], 8);
    assert_eq!(a.unpin(&h).unwrap(), 4);
    assert_eq!(a.unpin(&h).unwrap(), 0);
    a.close(&h, false).unwrap();
    assert_eq!((a.pinned_pages(), a.evictable_pages()), (0, 4));
    let rev: Vec<i32> = pinned.iter().rev().copied().collect();
    assert_eq!(evicted(&mut a, 4), rev);
}

#[test]
fn priority_100_with_a_duration_is_high_not_pinned() {
    let mut a = pool(None);
    serve(&mut a, &seq(4, 0), Some((100, Some(3.0))));
    assert_eq!((a.pinned_pages(), a.evictable_pages()), (0, 2));
    assert_eq!(a.evictable_pages_by_priority()[100], 2);
}

#[test]
fn clear_cache_drops_pins_and_durations() {
    let mut a = pool(None);
    serve(&mut a, &seq(4, 0), Some((100, None)));
    serve(&mut a, &seq(4, 100), Some((70, Some(9.0))));
    // A held pinned page: registered, pinned, held by an open request.
    let (h, _) = a
        .open_with_prefix(&seq(5, 0), &[5], Counts::Each(0))
        .unwrap();
    assert_eq!(a.pinned_pages(), 2);
    a.clear_cache();
    a.check().unwrap();
    assert_eq!(
        (a.pinned_pages(), a.cached_pages(), a.free_pages()),
        (0, 0, 14)
    );
    a.set_clock(10.0).unwrap();
    a.check().unwrap();
    a.close(&h, true).unwrap();
    a.check().unwrap();
    assert_eq!((a.pinned_pages(), a.evictable_pages()), (0, 2));
}

#[test]
fn pins_past_the_bound_are_given_99() {
    let mut a = pool(Some(3));
    assert_eq!(a.max_pinned_pages(), 3);
    // Four pages, taken in order: the first three pinned, the last at 99.
    let p = serve(&mut a, &seq(8, 0), Some((100, None)));
    assert_eq!(a.pinned_pages(), 3);
    let mut by = [0usize; 101];
    by[99] = 1;
    assert_eq!(a.evictable_pages_by_priority(), by);
    assert_eq!(evicted(&mut a, 1), vec![p[3]]);
    // The default bound is a quarter of the pool.
    let b = SlotAllocator::new(17, 2, 8, 64).unwrap();
    assert_eq!(b.max_pinned_pages(), 4);
    let opts = Options {
        max_pinned_pages: Some(17),
        ..Options::new()
    };
    assert!(matches!(
        SlotAllocator::with_options(17, 2, 8, 64, opts),
        Err(PoolError::InvalidArgument(_))
    ));
}

#[test]
fn a_page_keeps_the_highest_priority_and_at_a_tie_the_later_end() {
    let mut a = pool(None);
    let prompt = seq(5, 0); // two full pages, cached by two requests
    let (h, _) = a.open_with_prefix(&prompt, &[5], Counts::Each(0)).unwrap();
    a.extend(&h, Counts::Each(5), None).unwrap();
    a.cache_with_priority(&h, Counts::Each(60), Some(10.0))
        .unwrap();
    let (h2, c2) = a.open_with_prefix(&prompt, &[5], Counts::Each(0)).unwrap();
    assert_eq!(c2[0], 4);
    a.cache_with_priority(&h2, Counts::Each(20), None).unwrap(); // lower: ignored
    a.cache_with_priority(&h2, Counts::Each(60), Some(20.0))
        .unwrap(); // same: later end
    a.close(&h, false).unwrap();
    a.close(&h2, false).unwrap();
    a.set_clock(15.0).unwrap();
    assert_eq!(
        a.evictable_pages_by_priority()[60],
        2,
        "the later end holds"
    );
    a.set_clock(20.0).unwrap();
    assert_eq!(a.evictable_pages_by_priority()[60], 0);
    // Plain cache() leaves a given priority alone; a priority given with no
    // end outlasts one with an end.
    let (h, _) = a.open_with_prefix(&prompt, &[5], Counts::Each(0)).unwrap();
    a.cache_with_priority(&h, Counts::Each(5), Some(1.0))
        .unwrap();
    a.cache(&h).unwrap();
    a.cache_with_priority(&h, Counts::Each(5), None).unwrap();
    a.close(&h, false).unwrap();
    a.set_clock(30.0).unwrap();
    assert_eq!(a.evictable_pages_by_priority()[5], 2);
    a.check().unwrap();
}

#[test]
fn per_request_priorities_and_a_duplicate_gives_its_priority_to_the_cached_copy() {
    let mut a = pool(None);
    // Two requests compute the same prompt; the first to cache keeps its
    // pages, the second's are duplicates.
    let (h, _) = a
        .open_with_prefix(&[seq(4, 0), seq(4, 0)].concat(), &[4, 4], Counts::Each(0))
        .unwrap();
    a.extend(&h, Counts::Each(4), None).unwrap();
    let first = a.pages(h[0]).unwrap();
    a.cache(&h[..1]).unwrap();
    a.cache_with_priority(&h, Counts::PerRequest(&[0, 70]), None)
        .unwrap();
    a.close(&h, false).unwrap();
    a.check().unwrap();
    assert_eq!(a.evictable_pages(), 2);
    assert_eq!(
        a.evictable_pages_by_priority()[70],
        2,
        "the copy has the max of 0 and 70"
    );
    assert_eq!(a.cached_pages(), 2);
    let rev: Vec<i32> = first.iter().rev().copied().collect();
    assert_eq!(evicted(&mut a, 2), rev);
}

type BadCall<'a> = Box<dyn Fn(&mut SlotAllocator) -> PoolError + 'a>;

#[test]
fn bad_priority_input_changes_nothing() {
    let mut a = pool(None);
    let (h, _) = a
        .open_with_prefix(&seq(5, 0), &[5], Counts::Each(0))
        .unwrap();
    a.extend(&h, Counts::Each(5), None).unwrap();
    let before = (
        a.cached_pages(),
        a.metadata_bytes(),
        a.free_pages(),
        a.clock(),
    );
    let bad: Vec<BadCall> = vec![
        Box::new(|a| {
            a.cache_with_priority(&h, Counts::Each(101), None)
                .unwrap_err()
        }),
        Box::new(|a| {
            a.cache_with_priority(&h, Counts::Each(-1), None)
                .unwrap_err()
        }),
        Box::new(|a| {
            a.cache_with_priority(&h, Counts::PerRequest(&[1, 2]), None)
                .unwrap_err()
        }),
        Box::new(|a| {
            a.cache_with_priority(&h, Counts::Each(5), Some(0.0))
                .unwrap_err()
        }),
        Box::new(|a| {
            a.cache_with_priority(&h, Counts::Each(5), Some(-1.0))
                .unwrap_err()
        }),
        Box::new(|a| {
            a.cache_with_priority(&h, Counts::Each(5), Some(f64::NAN))
                .unwrap_err()
        }),
        Box::new(|a| {
            a.cache_with_priority(&h, Counts::Each(5), Some(f64::INFINITY))
                .unwrap_err()
        }),
        Box::new(|a| {
            a.close_with_priority(&h, Counts::Each(200), None)
                .unwrap_err()
        }),
        Box::new(|a| a.set_clock(-1.0).unwrap_err()),
        Box::new(|a| a.set_clock(f64::NAN).unwrap_err()),
        Box::new(|a| a.set_clock(2e9).unwrap_err()),
    ];
    for f in &bad {
        assert!(matches!(f(&mut a), PoolError::InvalidArgument(_)));
        assert_eq!(
            before,
            (
                a.cached_pages(),
                a.metadata_bytes(),
                a.free_pages(),
                a.clock()
            )
        );
        assert!(a.is_open(h[0]));
    }
    assert!(matches!(
        a.cache_with_priority(&[h[0], h[0]], Counts::Each(5), None),
        Err(PoolError::InvalidArgument(_))
    ));
    assert!(matches!(
        a.unpin(&[h[0] + 1]),
        Err(PoolError::InvalidHandle { .. })
    ));
    a.set_clock(3.0).unwrap();
    assert!(matches!(
        a.set_clock(2.0),
        Err(PoolError::InvalidArgument(_))
    ));
    assert_eq!(a.clock(), 3.0);
    // The system clock cannot be set.
    let mut s = SlotAllocator::new(17, 2, 8, 64).unwrap();
    assert!(matches!(
        s.set_clock(1.0),
        Err(PoolError::InvalidArgument(_))
    ));
    a.check().unwrap();
}

#[test]
fn a_pool_that_gives_no_priority_keeps_the_one_list() {
    let (mut a, mut b) = (pool(None), pool(None));
    for x in [&mut a, &mut b] {
        serve(x, &seq(8, 0), None);
        serve(x, &seq(8, 100), None);
    }
    assert_eq!(a.unpin(&[]).unwrap(), 0);
    a.set_clock(1.0).unwrap();
    assert_eq!(
        a.metadata_bytes(),
        b.metadata_bytes(),
        "no per-page priority arrays"
    );
    serve(&mut a, &seq(4, 200), Some((DEFAULT_PRIORITY as i64, None)));
    serve(&mut b, &seq(4, 200), None);
    // The first priority given allocates them: 9 bytes a page.
    assert_eq!(a.metadata_bytes() - b.metadata_bytes(), 17 * 9);
    a.check().unwrap();
}

/// A write into a held, pinned, registered page (its last page, partly
/// filled after a truncation) unregisters it: it no longer counts as pinned.
#[test]
fn a_write_into_a_pinned_page_unpins_it() {
    let mut a = pool(None);
    let (h, _) = a
        .open_with_prefix(&seq(4, 0), &[4], Counts::Each(0))
        .unwrap();
    a.extend(&h, Counts::Each(4), None).unwrap();
    a.cache_with_priority(&h, Counts::Each(MAX_PRIORITY as i64), None)
        .unwrap();
    assert_eq!(a.pinned_pages(), 2);
    a.truncate(&h, Counts::Each(3)).unwrap();
    a.extend(&h, Counts::Each(1), Some(&[50])).unwrap();
    a.check().unwrap();
    assert_eq!((a.pinned_pages(), a.cached_pages()), (1, 1));
}

/// With the system clock, a duration that is over ends when a victim is
/// next sought (any time that passes between two calls is past 1 ns).
#[test]
fn the_system_clock_ends_durations_before_eviction() {
    let opts = Options {
        hash_seed: Some(7),
        ..Options::new()
    };
    let mut a = SlotAllocator::with_options(17, 2, 8, 64, opts).unwrap();
    let short = serve(&mut a, &seq(4, 0), Some((90, Some(1e-9))));
    let d1 = serve(&mut a, &seq(4, 100), None);
    let rev = |p: &[i32]| p.iter().rev().copied().collect::<Vec<_>>();
    assert_eq!(evicted(&mut a, 4), [rev(&d1), rev(&short)].concat());
    assert!(a.clock() > 0.0);
}

/// One close releases pages bound for different lists (a prefix another
/// request gave 80, pages a third gave 10, a tail at the default): each run
/// joins its own list, in release order.
#[test]
fn a_release_files_each_run_of_pages_on_its_own_list() {
    let mut a = pool(None);
    let base = seq(9, 0); // four full pages
    serve(&mut a, &base, Some((80, None)));
    let mut longer = base[..8].to_vec();
    longer.extend(seq(9, 500)); // the same four pages, then four more
    let (h, c) = a.open_with_prefix(&longer, &[17], Counts::Each(0)).unwrap();
    assert_eq!(c[0], 8);
    a.extend(&h, Counts::Each(9), None).unwrap();
    let q = a.pages(h[0]).unwrap();
    a.cache(&h).unwrap();
    // A request on the first six pages gives them 10: the first four keep 80.
    let (g, c) = a
        .open_with_prefix(&longer[..13], &[13], Counts::Each(0))
        .unwrap();
    assert_eq!(c[0], 12);
    a.close_with_priority(&g, Counts::Each(10), None).unwrap();
    a.close(&h, false).unwrap(); // releases q7, q6 (35), q5, q4 (10), q3..q0 (80)
    a.check().unwrap();
    let mut by = [0usize; 101];
    (by[10], by[DEFAULT_PRIORITY as usize], by[80]) = (2, 2, 4);
    assert_eq!(a.evictable_pages_by_priority(), by);
    assert_eq!(
        evicted(&mut a, 8),
        vec![q[5], q[4], q[7], q[6], q[3], q[2], q[1], q[0]]
    );
}
