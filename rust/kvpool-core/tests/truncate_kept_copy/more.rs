//! More cases of a truncation whose last page kept duplicated another
//! request's cached content (see basic.rs): the chain resumed
//! at the kept copy after a walk (a removal elsewhere since the last one),
//! a fork truncated into it, part of the copy's chain evicted, truncating
//! twice and computing the content again, a host tier taking the copy, and
//! the grouped allocator with a fork and a walk. Each ends in `check()` and,
//! where it applies, the hits the pages registered afterwards give.

use super::{duplicated_prefix, hit, pool, PROMPT};
use kvpool_core::{Counts, GroupSpec, GroupedAllocator, Options};

/// An unrelated removal since B's last walk: kept_tip walks (chain_holds).
#[test]
fn walk_path_after_unrelated_removal() {
    for keep in [1usize, 2] {
        let mut a = pool(false);
        let (ha, hb) = duplicated_prefix(&mut a, 100);
        let (hd, _) = a.admit(&[2], Some(&[9, 10])).unwrap();
        a.close(&hd, true).unwrap();
        assert_eq!(a.evict(1), 1);
        a.truncate(&[hb], Counts::Each(keep as i64)).unwrap();
        a.check().unwrap();
        assert_eq!(a.unpin(&[hb]).unwrap(), keep, "keep {keep}");
        a.extend(&[hb], Counts::Each(2), Some(&[7, 8])).unwrap();
        a.cache(&[hb]).unwrap();
        a.close(&[ha], false).unwrap();
        a.check().unwrap();
        let mut want = PROMPT[..keep].to_vec();
        want.extend([7, 8, 9]);
        assert_eq!(hit(&mut a, &want), keep as i64 + 2);
        a.close(&[hb], true).unwrap();
        a.check().unwrap();
    }
}

/// A fork of B truncated into the duplicate.
#[test]
fn fork_truncated() {
    for keep in [1usize, 2] {
        let mut a = pool(false);
        let (ha, hb) = duplicated_prefix(&mut a, 100);
        let hc = a.fork(hb, 1).unwrap()[0];
        a.check().unwrap();
        a.truncate(&[hc], Counts::Each(keep as i64)).unwrap();
        a.check().unwrap();
        assert_eq!(a.unpin(&[hc]).unwrap(), keep);
        a.extend(&[hc], Counts::Each(2), Some(&[7, 8])).unwrap();
        a.cache(&[hc]).unwrap();
        a.check().unwrap();
        a.truncate(&[hb], Counts::Each(1)).unwrap();
        a.extend(&[hb], Counts::Each(2), Some(&[5, 6])).unwrap();
        a.cache(&[hb]).unwrap();
        a.check().unwrap();
        a.close(&[ha], false).unwrap();
        a.close(&[hb, hc], true).unwrap();
        a.check().unwrap();
        let mut want = PROMPT[..keep].to_vec();
        want.extend([7, 8, 9]);
        assert_eq!(hit(&mut a, &want), keep as i64 + 2);
        assert_eq!(hit(&mut a, &[2000, 5, 6, 9]), 3);
    }
}

/// Partial eviction of A's chain after the truncation (the leaf past the kept copy).
#[test]
fn partial_eviction_then_cache() {
    let mut a = pool(false);
    let (ha, hb) = duplicated_prefix(&mut a, 0);
    a.truncate(&[hb], Counts::Each(2)).unwrap();
    a.close(&[ha], false).unwrap();
    assert_eq!(a.evict(1), 1); // A's third page (the leaf)
    a.check().unwrap();
    a.extend(&[hb], Counts::Each(2), Some(&[7, 8])).unwrap();
    a.cache(&[hb]).unwrap();
    a.check().unwrap();
    a.close(&[hb], true).unwrap();
    a.check().unwrap();
    assert_eq!(hit(&mut a, &[2000, 2001, 7, 8, 9]), 4);
}

/// Truncate twice, recompute the same content, cache again.
#[test]
fn truncate_twice_and_recompute() {
    let mut a = pool(false);
    let (ha, hb) = duplicated_prefix(&mut a, 0);
    a.truncate(&[hb], Counts::Each(2)).unwrap();
    a.truncate(&[hb], Counts::Each(1)).unwrap();
    a.check().unwrap();
    a.extend(&[hb], Counts::Each(2), Some(&[2001, 2002]))
        .unwrap();
    a.cache(&[hb]).unwrap();
    a.check().unwrap();
    a.close(&[ha], false).unwrap();
    a.check().unwrap();
    a.evict(20);
    a.check().unwrap();
    a.cache(&[hb]).unwrap();
    a.check().unwrap();
    a.close(&[hb], true).unwrap();
    a.check().unwrap();
    assert_eq!(hit(&mut a, &[2000, 2001, 2002, 9]), 3);
}

/// Host tier: A's copies go to the host before B's next cache.
#[test]
fn host_tier_kept_copy_offloaded() {
    for keep in [1usize, 2] {
        let mut a = pool(true);
        let (ha, hb) = duplicated_prefix(&mut a, 0);
        a.truncate(&[hb], Counts::Each(keep as i64)).unwrap();
        a.close(&[ha], false).unwrap();
        let n = a.evict(20);
        assert!(n >= 3);
        let _ = a.take_offloads();
        a.check().unwrap();
        assert_eq!(a.unpin(&[hb]).unwrap(), 0);
        a.extend(&[hb], Counts::Each(2), Some(&[7, 8])).unwrap();
        a.cache(&[hb]).unwrap();
        a.check().unwrap();
        a.close(&[hb], true).unwrap();
        a.check().unwrap();
        let mut want = PROMPT[..keep].to_vec();
        want.extend([7, 8, 9]);
        let h = hit(&mut a, &want);
        assert_eq!(h, keep as i64 + 2, "keep {keep}");
    }
}

fn grouped(sliding: bool) -> GroupedAllocator {
    let opts = Options {
        hash_seed: Some(1),
        handle_seed: Some(3),
        ..Options::new()
    };
    let specs = if sliding {
        vec![GroupSpec::full(20, 1), GroupSpec::sliding(20, 1, 2)]
    } else {
        vec![GroupSpec::full(20, 1), GroupSpec::full(20, 2)]
    };
    GroupedAllocator::new(&specs, 8, 64, opts, None).unwrap()
}

/// Grouped: an unrelated removal between (walk path), a fork, page size 2 in a group.
#[test]
fn grouped_walk_path_and_fork() {
    for sliding in [false, true] {
        for keep in [1usize, 2] {
            let mut a = grouped(sliding);
            let (ha, _) = a
                .admit(&[4], Some(&[2000, 2001, 2002, 2003]), &mut [])
                .unwrap();
            a.cache(&ha).unwrap();
            let (hb, _) = a
                .admit(&[4], Some(&[2000, 2001, 2002, 2003]), &mut [])
                .unwrap();
            a.cache(&hb).unwrap();
            let (hd, _) = a.admit(&[2], Some(&[9, 10]), &mut []).unwrap();
            a.cache(&hd).unwrap();
            a.close(&hd, true).unwrap();
            for g in 0..2 {
                a.evict(g, 20).unwrap();
            }
            a.check().unwrap();
            let hc = a.fork(hb[0], 1).unwrap();
            a.truncate(&hb, Counts::Each(keep as i64)).unwrap();
            a.check().unwrap();
            a.truncate(&hc, Counts::Each(keep as i64 + 1)).unwrap();
            a.check().unwrap();
            a.extend(&hb, Counts::Each(2), Some(&[7, 8]), &mut [])
                .unwrap();
            a.cache(&hb).unwrap();
            a.check().unwrap();
            a.close(&ha, true).unwrap();
            a.check().unwrap();
            a.extend(&hc, Counts::Each(3), Some(&[5, 6, 4]), &mut [])
                .unwrap();
            a.cache(&hc).unwrap();
            a.check().unwrap();
            a.close(&hb, true).unwrap();
            a.close(&hc, true).unwrap();
            a.check().unwrap();
        }
    }
}
