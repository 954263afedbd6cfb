//! Orphans: registrations whose parent registration went while they
//! stayed. No lookup reaches them, since each is verified against its
//! parent's registration, which is gone for good; their Stored events
//! stand (a router that matches from the root never gets past the gone
//! parent's hash unless that content is registered again).
//!
//! Recomputing the gone parent's content under the same prefix revives its
//! registration (`prefix/ghosts.rs`), and the orphans below are served
//! again. Where no ghost was kept (or the parent's own prefix differs), a
//! request that recomputes the same content under the parent's new
//! registration finds the orphan under its key: the orphan gives way
//! (Removed events for its copies) and the recomputed page is registered
//! in its place (a Stored event), so the request's chain goes on past it.
//! Each test builds one way an orphan is born, recomputes its content and
//! then asks for a prompt whose every page the events report registered:
//! the hit must be the longest prefix the events report (`oracle/`),
//! which is what a KV-aware router predicts. On a pool that keeps the
//! orphan, the recomputing request's chain stops there and the hit falls
//! short.

mod oracle;
mod router;

use kvpool_core::{Counts, Options, SlotAllocator};
use oracle::{prompt_hashes, Ideal};
use router::Router;

/// Page size 2, 16 usable pages, a manual clock.
fn pool() -> (SlotAllocator, Router) {
    let opts = Options {
        hash_seed: Some(7),
        manual_clock: true,
        ..Options::new()
    };
    let a = SlotAllocator::with_options(17, 2, 8, 64, opts).unwrap();
    let r = Router::new(a.hash_seed(), 2);
    (a, r)
}

/// Opens `prompt`, prefills it and closes it with `prio` (None: plain
/// `close(cache=true)`).
fn serve(a: &mut SlotAllocator, prompt: &[i64], prio: Option<i64>) {
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
}

/// Opens `prompt` (salt 0) and checks its hit is exactly the longest
/// prefix the drained events report registered; returns the hit.
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
        "prompt {prompt:?}: the events report {want} tokens registered"
    );
    a.close(&h, false).unwrap();
    cached[0] as usize
}

/// A prefix cached at a low priority, its continuation at the default:
/// eviction takes the prefix (lowest priority first) and leaves the
/// continuation, an orphan. Its prefix's removed entries stay as ghosts
/// (`prefix/ghosts.rs`): computing the prefix again revives them, and the
/// continuation is served again without being recomputed.
#[test]
fn a_continuation_outliving_its_low_priority_prefix_is_served_once_the_prefix_is_recomputed() {
    let (mut a, mut router) = pool();
    serve(&mut a, &[0, 1, 2, 3, 9], Some(0));
    // The next turn hits the prefix and registers [4, 5] under it.
    serve(&mut a, &[0, 1, 2, 3, 4, 5, 6], None);
    assert_eq!(a.evict(2), 2);
    // The orphan [4, 5] is not served while its prefix is gone.
    let (h, cached) = a
        .open_with_prefix(&[0, 1, 2, 3, 4, 5, 6], &[7], Counts::Each(0))
        .unwrap();
    assert_eq!(cached, [0]);
    a.close(&h, false).unwrap();
    // The prefix is computed again: its registrations come back.
    serve(&mut a, &[0, 1, 2, 3, 8], None);
    let n = hit_as_registered(&mut a, &mut router, &[0, 1, 2, 3, 4, 5, 6]);
    assert_eq!(n, 6);
    // Recomputed from that hit, nothing changes.
    serve(&mut a, &[0, 1, 2, 3, 4, 5, 6], None);
    let n = hit_as_registered(&mut a, &mut router, &[0, 1, 2, 3, 4, 5, 6]);
    assert_eq!(n, 6);
}

/// A request truncated inside its first page and recomputed writes that
/// page in place, which drops its registration; the pages registered after
/// it stay, orphans, until the recompute reaches them and replaces them.
#[test]
fn pages_after_a_page_rewritten_in_place_are_served_again_once_recomputed() {
    let (mut a, mut router) = pool();
    let prompt = [0, 1, 2, 3, 4, 5, 6];
    serve(&mut a, &prompt, None);
    let (h, cached) = a.open_with_prefix(&prompt, &[7], Counts::Each(0)).unwrap();
    assert_eq!(cached, [6]);
    a.truncate(&h, Counts::Each(1)).unwrap();
    a.extend(&h, Counts::Each(6), Some(&[1, 2, 3, 4, 5, 6]))
        .unwrap();
    a.cache(&h).unwrap();
    a.check().unwrap();
    // While the recomputed request is open, and after it closes.
    assert_eq!(hit_as_registered(&mut a, &mut router, &prompt), 6);
    a.close(&h, true).unwrap();
    assert_eq!(hit_as_registered(&mut a, &mut router, &prompt), 6);
}

/// The same content recomputed under a prefix's new registration, past an
/// orphan of it: the recomputing request's chain goes on, so a prompt
/// that continues it is served to its end.
#[test]
fn a_recomputed_chain_continues_past_an_orphan_of_the_same_content() {
    let (mut a, mut router) = pool();
    serve(&mut a, &[0, 1, 2, 3, 9], Some(0));
    serve(&mut a, &[0, 1, 2, 3, 4, 5, 6], None);
    assert_eq!(a.evict(2), 2);
    // Everything recomputed: the prefix, [4, 5] and a new page [6, 7].
    serve(&mut a, &[0, 1, 2, 3, 4, 5, 6, 7, 8], None);
    let n = hit_as_registered(&mut a, &mut router, &[0, 1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(n, 8, "every page of the recomputed chain was registered");
}

/// An orphan a request still holds: a page registered under another
/// page's copy of its prefix (a duplicate, not taken over while that copy
/// was held), which eviction then took. A recompute of the same content
/// replaces it; the holder keeps the page, unregistered, and it goes FREE
/// when the holder lets it go.
#[test]
fn a_held_orphan_gives_way_and_stays_with_its_holder() {
    let (mut a, mut router) = pool();
    let t = a.open(1).unwrap();
    a.extend(&t, Counts::Each(3), Some(&[0, 1, 2])).unwrap();
    a.cache(&t).unwrap();
    // `s` computes [0, 1] itself while `t` holds the registered copy: its
    // page 1 ([2, 3]) is registered under `t`'s page.
    let s = a.open(1).unwrap();
    a.extend(&s, Counts::Each(5), Some(&[0, 1, 2, 3, 4]))
        .unwrap();
    a.cache(&s).unwrap();
    a.close(&t, true).unwrap();
    assert_eq!(a.evict(1), 1);
    a.check().unwrap();
    // [2, 3], held by `s`, is an orphan now; a new request recomputes it.
    serve(&mut a, &[0, 1, 2, 3, 4], None);
    let n = hit_as_registered(&mut a, &mut router, &[0, 1, 2, 3, 4]);
    assert_eq!(n, 4);
    a.close(&s, false).unwrap();
    a.check().unwrap();
    // `s`'s pages went FREE: only the recompute's two pages are cached.
    assert_eq!(a.cached_pages(), 2);
}
