//! A request whose chain ends on another request's entry (it computed a
//! cached page again while that page was held elsewhere, so its own copy is
//! an unregistered duplicate) outlives that entry: once eviction takes it,
//! the request's chain restarts after its own registered pages, and its
//! later pages are registered and hit (they used to stay unregistered).

use kvpool_core::{Counts, Options, SlotAllocator, EVENT_STORED};

fn pool(ps: usize) -> SlotAllocator {
    let opts = Options {
        hash_seed: Some(1),
        ..Options::new()
    };
    SlotAllocator::with_options(16, ps, 4, 32, opts).unwrap()
}

#[test]
fn a_chain_ending_on_an_evicted_duplicate_restarts() {
    for ps in [1usize, 2] {
        let mut a = pool(ps);
        let prompt: Vec<i64> = (1..=3 * ps as i64).collect();
        let len = prompt.len() as i64;
        let (first, _) = a
            .open_with_prefix(&prompt, &[len], Counts::Each(0))
            .unwrap();
        a.extend(&first, Counts::Each(len), None).unwrap();
        a.cache(&first).unwrap();
        // Fully cached: the last page is computed again, a duplicate of the
        // first request's, whose entry becomes the second's chain tip.
        let (second, cached) = a
            .open_with_prefix(&prompt, &[len], Counts::Each(0))
            .unwrap();
        assert_eq!(cached[0], len - ps as i64);
        a.extend(&second, Counts::Each(ps as i64), None).unwrap();
        a.cache(&second).unwrap();
        a.close(&first, false).unwrap();
        assert_eq!(
            a.evict(1),
            1,
            "the first request's last page: the chain's tail"
        );
        a.take_events();
        let more: Vec<i64> = (50..50 + 2 * ps as i64).collect();
        a.extend(&second, Counts::Each(2 * ps as i64), Some(&more))
            .unwrap();
        a.close(&second, true).unwrap();
        // The duplicate and the two new pages were registered (Stored).
        let ev = a.take_events();
        let stored = ev.kind.iter().filter(|&&k| k == EVENT_STORED).count();
        assert_eq!(stored, 3, "page size {ps}");
        a.check().unwrap();
        let full = [prompt.clone(), more, vec![7]].concat();
        let (h, again) = a
            .open_with_prefix(&full, &[full.len() as i64], Counts::Each(0))
            .unwrap();
        assert_eq!(again[0], full.len() as i64 - 1, "page size {ps}");
        a.close(&h, false).unwrap();
        a.check().unwrap();
    }
}

/// A request with a duplicate page inside its chain (not at its tip): its
/// own later pages are filed under the other request's entry. Once that
/// entry is evicted, a `cache()` restarts the chain there, registering the
/// duplicate and relinking the pages after it, so a prompt of the whole
/// chain hits it again. `truncate` first keeps that duplicate inside the
/// chain.
#[test]
fn a_chain_through_an_evicted_duplicate_restarts_at_the_duplicate() {
    for (ps, truncate) in [(1usize, false), (1, true), (2, false), (2, true)] {
        let mut a = pool(ps);
        let head: Vec<i64> = (1..=ps as i64).collect();
        let (first, _) = a
            .open_with_prefix(&head, &[ps as i64], Counts::Each(0))
            .unwrap();
        a.extend(&first, Counts::Each(ps as i64), None).unwrap();
        a.cache(&first).unwrap();
        // The second request computes the same first page while the first
        // holds it (an unregistered duplicate), then three pages of its own.
        let body: Vec<i64> = (1..=4 * ps as i64).collect();
        let second = a.open(1).unwrap();
        a.extend(&second, Counts::Each(4 * ps as i64), Some(&body))
            .unwrap();
        a.cache(&second).unwrap();
        if truncate {
            a.truncate(&second, Counts::Each(3 * ps as i64)).unwrap();
        }
        let kept = if truncate { 3 } else { 4 } * ps as i64;
        a.close(&first, false).unwrap();
        // The first request's page (after the page truncate let go, cached).
        let evicted = if truncate { 2 } else { 1 };
        assert_eq!(a.evict(evicted), evicted);
        a.check().unwrap();
        a.cache(&second).unwrap();
        a.check().unwrap();
        let prompt = [body[..kept as usize].to_vec(), vec![99]].concat();
        let (h, cached) = a
            .open_with_prefix(&prompt, &[prompt.len() as i64], Counts::Each(0))
            .unwrap();
        assert_eq!(cached[0], kept, "page size {ps}, truncated {truncate}");
        a.close(&h, false).unwrap();
        a.close(&second, false).unwrap();
        a.check().unwrap();
    }
}
