//! Ghost registrations (`prefix/ghosts.rs`): an entry removed while its
//! chain goes on below it leaves a ghost, and a page recomputing its
//! content under the same parent takes its registration back, so the
//! orphans below are served again and the KV events (which kept their
//! Stored events) say what lookups serve.
//!
//! Each test builds the removal one way, recomputes, and checks the hit
//! against the longest prefix the drained events report registered
//! (`oracle/`), what a KV-aware router predicts, plus `check()`, which
//! verifies every ghost's counts.

mod oracle;
mod router;

use std::collections::HashMap;

use kvpool_core::{
    Counts, GroupSpec, GroupedAllocator, Options, SlotAllocator, EVENT_REMOVED, EVENT_STORED,
};
use oracle::{prompt_hashes, Ideal};
use router::Router;

fn pool(ps: usize, pages: usize) -> (SlotAllocator, Router) {
    let opts = Options {
        hash_seed: Some(7),
        manual_clock: true,
        ..Options::new()
    };
    let a = SlotAllocator::with_options(pages, ps, 8, 256, opts).unwrap();
    let r = Router::new(a.hash_seed(), ps);
    (a, r)
}

/// Opens `prompt`, computes what did not hit, closes it with `prio` (None:
/// plain `close(cache=true)`); returns the hit.
fn serve(a: &mut SlotAllocator, prompt: &[i64], prio: Option<i64>) -> usize {
    let (h, cached) = a
        .open_with_prefix(prompt, &[prompt.len() as i64], Counts::Each(0))
        .unwrap();
    a.extend(&h, Counts::Each(prompt.len() as i64 - cached[0]), None)
        .unwrap();
    match prio {
        None => a.close(&h, true).unwrap(),
        Some(q) => a.close_with_priority(&h, Counts::Each(q), None).unwrap(),
    }
    a.check().unwrap();
    cached[0] as usize
}

/// The hit of `prompt` (salt 0), checked to be exactly the longest prefix
/// the drained events report registered.
fn hit_as_registered(a: &mut SlotAllocator, router: &mut Router, prompt: &[i64]) -> usize {
    router.apply(&a.take_events()).unwrap();
    let ids: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
    let hashes = prompt_hashes(a.hash_seed(), a.page_size(), 0, &ids);
    let want = Ideal::new(router).registered(&hashes) * a.page_size();
    let (h, cached) = a
        .open_with_prefix(prompt, &[prompt.len() as i64], Counts::Each(0))
        .unwrap();
    a.check().unwrap();
    assert_eq!(
        cached[0] as usize, want,
        "the events report {want} tokens of {prompt:?} registered"
    );
    a.close(&h, false).unwrap();
    cached[0] as usize
}

fn seq(n: usize, from: i64) -> Vec<i64> {
    (from..from + n as i64).collect()
}

/// A two-page prefix at priority 0 and its one-page continuation at the
/// default: eviction takes the prefix, tail first, leaving two ghosts (the
/// second page's above the live continuation, the first's above it). The
/// prefix recomputed revives both, top-down, and the whole chain is served.
fn two_ghosts_revived_top_down(ps: usize) {
    let (mut a, mut router) = pool(ps, 16);
    let full = seq(3 * ps + 1, 100);
    serve(&mut a, &full[..2 * ps], Some(0));
    assert_eq!(serve(&mut a, &full, None), 2 * ps);
    assert_eq!(a.evict(2), 2);
    assert_eq!(a.index_ghosts_for_tests(), 2);
    assert_eq!(
        a.index_links_for_tests().2,
        1,
        "the continuation is an orphan"
    );
    // Not served while its prefix is gone, and the router agrees.
    assert_eq!(hit_as_registered(&mut a, &mut router, &full), 0);
    // The prefix computed again: no hit, then both registrations return.
    let mut other = full[..2 * ps].to_vec();
    other.push(8);
    assert_eq!(serve(&mut a, &other, None), 0);
    assert_eq!(a.index_ghosts_for_tests(), 0);
    assert_eq!(a.index_links_for_tests().2, 0, "no orphan left");
    assert_eq!(hit_as_registered(&mut a, &mut router, &full), 3 * ps);
}

#[test]
fn two_ghosts_revived_top_down_page_1() {
    two_ghosts_revived_top_down(1);
}

#[test]
fn two_ghosts_revived_top_down_page_16() {
    two_ghosts_revived_top_down(16);
}

/// Only the first page removed (the continuation and the page after it
/// stay): one ghost, revived by a request that recomputes just that page.
#[test]
fn a_lone_ghost_at_the_root_is_revived_page_1_and_16() {
    for ps in [1, 16] {
        let (mut a, mut router) = pool(ps, 16);
        let full = seq(3 * ps + 1, 50);
        let first = full[..ps].to_vec();
        serve(&mut a, &first, Some(0));
        assert_eq!(serve(&mut a, &full, None), ps);
        assert_eq!(a.evict(1), 1);
        assert_eq!(a.index_ghosts_for_tests(), 1);
        assert_eq!(hit_as_registered(&mut a, &mut router, &full), 0);
        serve(&mut a, &first, None);
        assert_eq!(a.index_ghosts_for_tests(), 0);
        assert_eq!(hit_as_registered(&mut a, &mut router, &full), 3 * ps);
    }
}

/// A ghost lives only while something below it does: evicting the last
/// live child drops its ghost, and the ghost above goes with it.
#[test]
fn ghosts_go_with_their_last_child() {
    let (mut a, mut router) = pool(2, 16);
    serve(&mut a, &[0, 1, 2, 3, 9], Some(0));
    serve(&mut a, &[0, 1, 2, 3, 4, 5, 6], None);
    assert_eq!(a.evict(2), 2);
    assert_eq!(a.index_ghosts_for_tests(), 2);
    assert_eq!(a.evict(1), 1); // the continuation [4, 5]
    a.check().unwrap();
    assert_eq!(a.index_ghosts_for_tests(), 0);
    assert_eq!(a.index_links_for_tests(), (0, 0, 0));
    // Recomputed, the prefix is a fresh chain; nothing below it is left.
    serve(&mut a, &[0, 1, 2, 3, 8], None);
    assert_eq!(
        hit_as_registered(&mut a, &mut router, &[0, 1, 2, 3, 4, 5, 6]),
        4
    );
}

/// The same page content under another parent is another prefix: it is
/// registered anew and the ghost (of the first prefix) stays, its chain
/// still unserved; the first prefix recomputed then revives it.
#[test]
fn the_same_page_under_another_parent_does_not_revive() {
    let (mut a, mut router) = pool(2, 24);
    serve(&mut a, &[0, 1, 2, 3, 9], Some(0));
    serve(&mut a, &[0, 1, 2, 3, 4, 5, 6], None);
    assert_eq!(a.evict(2), 2);
    assert_eq!(a.index_ghosts_for_tests(), 2);
    // [2, 3] (the second ghost's tokens) under a parent [7, 7].
    assert_eq!(serve(&mut a, &[7, 7, 2, 3, 4, 5, 6], None), 0);
    assert_eq!(a.index_ghosts_for_tests(), 2);
    assert_eq!(
        hit_as_registered(&mut a, &mut router, &[0, 1, 2, 3, 4, 5, 6]),
        0
    );
    assert_eq!(
        hit_as_registered(&mut a, &mut router, &[7, 7, 2, 3, 4, 5, 6]),
        6
    );
    // Another salt is another prefix too.
    let (h, _) = a
        .open_with_prefix(&[0, 1, 2, 3, 8], &[5], Counts::Each(3))
        .unwrap();
    a.extend(&h, Counts::Each(5), None).unwrap();
    a.close(&h, true).unwrap();
    assert_eq!(a.index_ghosts_for_tests(), 2);
    serve(&mut a, &[0, 1, 2, 3, 8], None);
    assert_eq!(a.index_ghosts_for_tests(), 0);
    assert_eq!(
        hit_as_registered(&mut a, &mut router, &[0, 1, 2, 3, 4, 5, 6]),
        6
    );
}

/// Every Stored and Removed event, in order, against what lookups serve:
/// the continuation's Stored event stood through the removal, the
/// prefix's Removed events went out, and revival re-stores the prefix
/// under the same hashes, so a router's view ends where the pool's does.
#[test]
fn events_agree_with_the_pool_through_removal_and_revival() {
    let (mut a, mut router) = pool(2, 16);
    serve(&mut a, &[0, 1, 2, 3, 9], Some(0));
    serve(&mut a, &[0, 1, 2, 3, 4, 5, 6], None);
    let before = a.take_events();
    router.apply(&before).unwrap();
    assert_eq!(a.evict(2), 2);
    let removal = a.take_events();
    assert_eq!(removal.kind, [EVENT_REMOVED, EVENT_REMOVED]);
    router.apply(&removal).unwrap();
    serve(&mut a, &[0, 1, 2, 3, 8], None);
    let revival = a.take_events();
    assert_eq!(revival.kind, [EVENT_STORED, EVENT_STORED]);
    // The same hashes as the removed ones: the same registrations.
    let mut removed: Vec<_> = (0..2)
        .map(|i| (removal.hash_hi[i], removal.hash_lo[i]))
        .collect();
    let mut stored: Vec<_> = (0..2)
        .map(|i| (revival.hash_hi[i], revival.hash_lo[i]))
        .collect();
    removed.sort_unstable();
    stored.sort_unstable();
    assert_eq!(removed, stored);
    router.apply(&revival).unwrap();
    assert_eq!(router.len(kvpool_core::MEDIUM_DEVICE), a.cached_pages());
    assert_eq!(
        hit_as_registered(&mut a, &mut router, &[0, 1, 2, 3, 4, 5, 6]),
        6
    );
}

/// A grouped pool files every other group's pages under the anchor's
/// registration ids. A revived anchor entry has its old id, so the other
/// group's pages filed under the ids below it (never evicted) serve again
/// without being recomputed.
#[test]
fn a_revived_anchor_entry_serves_the_other_groups_pages_filed_under_its_chain() {
    let opts = Options {
        hash_seed: Some(7),
        handle_seed: Some(3),
        ..Options::new()
    };
    let specs = [GroupSpec::full(32, 4), GroupSpec::full(32, 4)];
    let mut a = GroupedAllocator::new(&specs, 8, 64, opts, None).unwrap();
    let prompt = seq(13, 10);
    let open = |a: &mut GroupedAllocator, p: &[i64]| {
        a.open_with_prefix(p, &[p.len() as i64], Counts::Each(0))
            .unwrap()
    };
    // Cached: three pages in each group.
    let (h, c) = open(&mut a, &prompt);
    assert_eq!(c, [0]);
    a.extend(&h, Counts::Each(13), None, &mut []).unwrap();
    a.close(&h, true).unwrap();
    let (h, c) = open(&mut a, &prompt);
    assert_eq!(c, [12]);
    let other = a.pages(1, h[0]).unwrap();
    // Truncated into its first page and written there in place with other
    // tokens: the anchor's first entry goes (a ghost above the other two).
    a.truncate(&h, Counts::Each(1)).unwrap();
    a.extend(&h, Counts::Each(3), Some(&[90, 91, 92]), &mut [])
        .unwrap();
    a.check().unwrap();
    a.close(&h, false).unwrap();
    assert_eq!(open_close(&mut a, &prompt), 0);
    // The first page computed again by another request revives it.
    let (h, _) = open(&mut a, &prompt[..5]);
    a.extend(&h, Counts::Each(5), None, &mut []).unwrap();
    a.close(&h, true).unwrap();
    a.check().unwrap();
    let (h, c) = open(&mut a, &prompt);
    assert_eq!(c, [12]);
    let now = a.pages(1, h[0]).unwrap();
    assert_eq!(
        now[1..],
        other[1..],
        "the other group's pages past the first are the first request's"
    );
    a.check().unwrap();
}

fn open_close(a: &mut GroupedAllocator, p: &[i64]) -> i64 {
    let (h, c) = a
        .open_with_prefix(p, &[p.len() as i64], Counts::Each(0))
        .unwrap();
    a.close(&h, false).unwrap();
    c[0]
}

/// Forced key collisions (a 2-bit test hash): ghosts of colliding keys
/// abound, and a revival must still check tokens, salt and parent: every
/// hit page holds KV of exactly the prompt's salt and prefix (tracked from
/// the events), and `check()` holds throughout.
#[test]
fn colliding_keys_never_revive_another_prefix() {
    let ps = 2;
    let opts = Options {
        weak_hash_bits: 2,
        hash_seed: Some(1),
        manual_clock: true,
        ..Options::new()
    };
    let mut a = SlotAllocator::with_options(24, ps, 8, 16, opts).unwrap();
    // page -> (salt, every token up to its end), from the events.
    let mut held: HashMap<i32, (i64, Vec<i32>)> = HashMap::new();
    let mut x: u64 = 99;
    let mut rnd = |n: u64| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) % n
    };
    let (mut ghosts_seen, mut hits) = (0usize, 0usize);
    for _ in 0..3000 {
        let len = 2 + rnd(9) as usize;
        let salt = rnd(2) as i64;
        let prompt: Vec<i64> = (0..len).map(|_| rnd(2) as i64).collect();
        let ids: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
        let (h, cached) = a
            .open_with_prefix(&prompt, &[len as i64], Counts::Each(salt))
            .unwrap();
        let pages = a.pages(h[0]).unwrap();
        for (k, p) in pages.iter().enumerate() {
            let want = (salt, ids[..(k + 1) * ps].to_vec());
            assert_eq!(
                held.get(p),
                Some(&want),
                "page {p} served for another prefix"
            );
        }
        hits += cached[0] as usize;
        a.extend(&h, Counts::Each(len as i64 - cached[0]), None)
            .unwrap();
        let pages = a.pages(h[0]).unwrap();
        match rnd(4) {
            0 => a.close_with_priority(&h, Counts::Each(0), None).unwrap(),
            1 => a.close(&h, false).unwrap(),
            _ => a.close(&h, true).unwrap(),
        }
        let ev = a.take_events();
        for i in 0..ev.len() {
            match ev.kind[i] {
                EVENT_STORED => {
                    let k = pages.iter().position(|&p| p == ev.page[i]).unwrap();
                    held.insert(ev.page[i], (salt, ids[..(k + 1) * ps].to_vec()));
                }
                EVENT_REMOVED => {
                    held.remove(&ev.page[i]);
                }
                _ => held.clear(),
            }
        }
        if rnd(3) == 0 {
            a.evict(1 + rnd(3) as usize);
            let ev = a.take_events();
            for i in 0..ev.len() {
                assert_eq!(ev.kind[i], EVENT_REMOVED);
                held.remove(&ev.page[i]);
            }
        }
        a.check().unwrap();
        ghosts_seen = ghosts_seen.max(a.index_ghosts_for_tests());
    }
    assert!(ghosts_seen > 0, "no ghost was ever kept");
    assert!(hits > 0);
}
