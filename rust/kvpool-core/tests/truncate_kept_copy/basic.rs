//! The kept copy reached, evicted, or registered anew by another request.

use super::{duplicated_prefix, hit, pool, PROMPT};
use kvpool_core::{Counts, GroupSpec, GroupedAllocator, Options};

#[test]
fn unpin_after_truncating_into_a_duplicate_reaches_the_kept_copies() {
    for keep in [1usize, 2] {
        let mut a = pool(false);
        let (ha, hb) = duplicated_prefix(&mut a, 100);
        assert_eq!(a.pinned_pages(), 3);
        a.truncate(&[hb], Counts::Each(keep as i64)).unwrap();
        a.check().unwrap();
        assert_eq!(a.unpin(&[hb]).unwrap(), keep);
        assert_eq!(a.pinned_pages(), 3 - keep);
        // B's next pages register under the kept copy.
        a.extend(&[hb], Counts::Each(2), Some(&[7, 8])).unwrap();
        a.cache(&[hb]).unwrap();
        a.close(&[ha], false).unwrap();
        a.check().unwrap();
        let mut want = PROMPT[..keep].to_vec();
        want.extend([7, 8, 9]);
        assert_eq!(hit(&mut a, &want), keep as i64 + 2);
    }
}

#[test]
fn kept_copy_evicted_before_the_next_calls_is_not_used() {
    for keep in [1usize, 2] {
        let mut a = pool(false);
        let (ha, hb) = duplicated_prefix(&mut a, 80);
        a.truncate(&[hb], Counts::Each(keep as i64)).unwrap();
        // A goes and eviction takes its copies (B holds only its own,
        // unregistered duplicates); another prompt takes the entries.
        a.close(&[ha], false).unwrap();
        assert_eq!(a.evict(20), 3);
        let (hc, _) = a.admit(&[3], Some(&[50, 51, 52])).unwrap();
        a.cache(&hc).unwrap();
        a.check().unwrap();
        // B's cached prefix is empty now: nothing of A's (or C's) to pin.
        a.cache_with_priority(&hc, Counts::Each(100), None).unwrap();
        assert_eq!(a.pinned_pages(), 3);
        assert_eq!(a.unpin(&[hb]).unwrap(), 0);
        assert_eq!(a.pinned_pages(), 3);
        // The next cache() restarts B's chain: its own pages register.
        a.extend(&[hb], Counts::Each(2), Some(&[7, 8])).unwrap();
        a.cache_with_priority(&[hb], Counts::Each(100), None)
            .unwrap();
        a.check().unwrap();
        assert_eq!(a.pinned_pages(), 3 + keep + 2);
        let own = a.pages(hb).unwrap();
        assert_eq!(a.unpin(&[hb]).unwrap(), keep + 2);
        a.close(&[hb], false).unwrap();
        // B's own pages are what the next prompt hits.
        let mut want = PROMPT[..keep].to_vec();
        want.extend([7, 8, 9]);
        let (h, c) = a
            .open_with_prefix(&want, &[want.len() as i64], Counts::Each(0))
            .unwrap();
        assert_eq!(c[0], keep as i64 + 2);
        assert_eq!(a.pages(h[0]).unwrap()[..keep + 2], own[..]);
        a.close(&h, false).unwrap();
        a.check().unwrap();
    }
}

#[test]
fn kept_copy_replaced_by_a_new_registration_of_the_same_content() {
    for keep in [1usize, 2] {
        let mut a = pool(false);
        let (ha, hb) = duplicated_prefix(&mut a, 80);
        a.truncate(&[hb], Counts::Each(keep as i64)).unwrap();
        a.close(&[ha], false).unwrap();
        assert_eq!(a.evict(20), 3);
        // C computes the prompt again: new registrations of the same content.
        let (hc, _) = a.admit(&[3], Some(&PROMPT)).unwrap();
        a.cache_with_priority(&hc, Counts::Each(100), None).unwrap();
        a.check().unwrap();
        // B's cached prefix is the copy the index keeps now: C's.
        assert_eq!(a.unpin(&[hb]).unwrap(), keep);
        assert_eq!(a.pinned_pages(), 3 - keep);
        // B's next pages register under C's entries, not A's gone ones.
        a.extend(&[hb], Counts::Each(2), Some(&[7, 8])).unwrap();
        a.cache(&[hb]).unwrap();
        a.close(&[hb], false).unwrap();
        a.check().unwrap();
        let mut want = PROMPT[..keep].to_vec();
        want.extend([7, 8, 9]);
        assert_eq!(hit(&mut a, &want), keep as i64 + 2);
    }
}

/// A full group (page 1, the anchor) and a sliding one (page 1, window 2).
fn grouped() -> GroupedAllocator {
    let opts = Options {
        hash_seed: Some(1),
        handle_seed: Some(3),
        ..Options::new()
    };
    let specs = [GroupSpec::full(20, 1), GroupSpec::sliding(20, 1, 2)];
    GroupedAllocator::new(&specs, 8, 64, opts, None).unwrap()
}

/// The grouped hit length of `tokens` (a request opened and closed).
fn grouped_hit(a: &mut GroupedAllocator, tokens: &[i64]) -> i64 {
    let (h, c) = a
        .open_with_prefix(tokens, &[tokens.len() as i64], Counts::Each(0))
        .unwrap();
    a.close(&h, false).unwrap();
    a.check().unwrap();
    c[0]
}

#[test]
fn grouped_truncation_into_a_duplicate_with_and_without_eviction() {
    for (keep, evict) in [(1usize, false), (2, false), (1, true), (2, true)] {
        let mut a = grouped();
        let (ha, _) = a.admit(&[3], Some(&PROMPT), &mut []).unwrap();
        a.cache(&ha).unwrap();
        let (hb, _) = a.admit(&[3], Some(&PROMPT), &mut []).unwrap();
        a.cache(&hb).unwrap();
        a.truncate(&hb, Counts::Each(keep as i64)).unwrap();
        a.check().unwrap();
        a.close(&ha, true).unwrap();
        if evict {
            // Every group's cached pages go: A's copies among them.
            for g in 0..2 {
                a.evict(g, 20).unwrap();
                assert_eq!(a.evictable_pages(g).unwrap(), 0);
            }
            let (hc, _) = a.admit(&[3], Some(&[50, 51, 52]), &mut []).unwrap();
            a.cache(&hc).unwrap();
            a.close(&hc, true).unwrap();
        }
        a.check().unwrap();
        a.extend(&hb, Counts::Each(2), Some(&[7, 8]), &mut [])
            .unwrap();
        a.cache(&hb).unwrap();
        a.check().unwrap();
        a.close(&hb, true).unwrap();
        a.check().unwrap();
        let mut want = PROMPT[..keep].to_vec();
        want.extend([7, 8, 9]);
        assert_eq!(
            grouped_hit(&mut a, &want),
            keep as i64 + 2,
            "keep {keep}, evict {evict}"
        );
    }
}
