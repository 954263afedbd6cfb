//! The prefix index files a page under its key only where its parent's
//! hint cannot reach it (`prefix/links.rs`). These walks put unkeyed pages
//! through every way they can lose their hint (a sibling at a branch
//! point, their parent's eviction while they stay, a chain whose tip is
//! evicted) and check that every cached page is still found where it
//! should be and nowhere else; `check()` verifies after each call that
//! every live entry is keyed or hinted and that children and orphans are
//! counted right.

mod common;

use common::seq;
use kvpool_core::{Counts, Options, SlotAllocator};

/// Page size 1, 63 usable pages, a manual clock (priorities).
fn pool() -> SlotAllocator {
    let opts = Options {
        hash_seed: Some(3),
        manual_clock: true,
        ..Options::new()
    };
    SlotAllocator::with_options(64, 1, 8, 64, opts).unwrap()
}

/// Opens `prompt`, prefills what missed, closes it with priority `prio`
/// (cache=true); returns the cached length it was opened with.
fn serve(a: &mut SlotAllocator, prompt: &[i64], prio: i64) -> i64 {
    let (h, cached) = a
        .open_with_prefix(prompt, &[prompt.len() as i64], Counts::Each(0))
        .unwrap();
    a.extend(&h, Counts::Each(prompt.len() as i64 - cached[0]), None)
        .unwrap();
    a.cache(&h).unwrap();
    a.check().unwrap();
    a.close_with_priority(&h, Counts::Each(prio), None).unwrap();
    a.check().unwrap();
    cached[0]
}

/// The cached length a fresh request for `prompt` would get (the request
/// is closed again without caching).
fn probe(a: &mut SlotAllocator, prompt: &[i64]) -> i64 {
    let (h, cached) = a
        .open_with_prefix(prompt, &[prompt.len() as i64], Counts::Each(0))
        .unwrap();
    a.close(&h, false).unwrap();
    a.check().unwrap();
    cached[0]
}

fn cat(a: &[i64], b: &[i64]) -> Vec<i64> {
    [a, b].concat()
}

#[test]
fn a_branch_keys_the_child_its_parent_stops_hinting() {
    let mut a = pool();
    let base = seq(10, 0);
    let (x, y) = (seq(6, 100), seq(6, 200));
    assert_eq!(serve(&mut a, &cat(&base, &x), 50), 0);
    // One key (the chain's first page); the other 15 pages ride on hints.
    assert_eq!(a.index_links_for_tests(), (16, 1, 0));
    // A sibling under base's last page moves that page's hint off x's
    // first page, which was unkeyed: it must be keyed now.
    assert_eq!(serve(&mut a, &cat(&base, &y), 50), 10);
    assert_eq!(a.index_links_for_tests(), (22, 3, 0));
    assert_eq!(probe(&mut a, &cat(&cat(&base, &x), &[7])), 16);
    assert_eq!(probe(&mut a, &cat(&cat(&base, &y), &[7])), 16);
    // Back and forth: each walk re-verifies its branch and moves the hint.
    assert_eq!(serve(&mut a, &cat(&cat(&base, &x), &[1, 2]), 50), 16);
    assert_eq!(probe(&mut a, &cat(&cat(&base, &y), &[7])), 16);
    // A prompt that leaves the chain mid-way hits up to the branch only.
    let mut off = cat(&base, &x[..3]);
    off.extend([999, 998]);
    assert_eq!(probe(&mut a, &off), 13);
}

#[test]
fn a_child_outliving_its_parent_is_keyed_and_counted() {
    // Page size 4: truncating into a registered page unregisters it, while
    // its child (unkeyed, reached by its hint) stays cached.
    let opts = Options {
        hash_seed: Some(3),
        ..Options::new()
    };
    let mut a = SlotAllocator::with_options(32, 4, 8, 64, opts).unwrap();
    let old = seq(12, 100);
    let (h, _) = a.open_with_prefix(&old, &[12], Counts::Each(0)).unwrap();
    a.extend(&h, Counts::Each(12), None).unwrap();
    a.cache(&h).unwrap();
    assert_eq!(a.index_links_for_tests(), (3, 1, 0));
    a.truncate(&h, Counts::Each(6)).unwrap();
    a.check().unwrap();
    let new_tail = seq(6, 200);
    a.extend(&h, Counts::Each(6), Some(&new_tail)).unwrap();
    a.check().unwrap();
    // Writing into page 1 unregistered it; page 2, its child, is an
    // orphan now, and keyed.
    assert_eq!(a.index_links_for_tests(), (2, 2, 1));
    a.cache(&h).unwrap();
    a.check().unwrap();
    // With an orphan about, registrations are keyed as before.
    assert_eq!(a.index_links_for_tests(), (4, 4, 1));
    // With an orphan about, registrations are keyed as before.
    a.close(&h, false).unwrap();
    let diverged = [old[..6].to_vec(), new_tail].concat();
    assert_eq!(probe(&mut a, &cat(&diverged, &[1])), 12);
    assert_eq!(probe(&mut a, &cat(&old, &[1])), 4);
    a.evict(a.evictable_pages());
    a.check().unwrap();
    assert_eq!(a.index_links_for_tests(), (0, 0, 0));
    // Once the orphan is gone, a new chain rides on hints again.
    assert_eq!(serve(&mut a, &seq(13, 500), 50), 0);
    assert_eq!(a.index_links_for_tests(), (3, 1, 0));
}

#[test]
fn long_chains_survive_churn_and_clear() {
    let mut a = pool();
    for round in 0..6 {
        let p = cat(&seq(20, 0), &seq(20, 1000 * (round + 1)));
        serve(&mut a, &p, 50);
        assert_eq!(probe(&mut a, &cat(&p, &[1])), 40);
        assert_eq!(probe(&mut a, &cat(&seq(20, 0), &[7])), 20);
    }
    a.clear_cache();
    a.check().unwrap();
    assert_eq!(probe(&mut a, &cat(&seq(20, 0), &[7])), 0);
}
