//! Runs (`prefix/runs.rs`): at page size 1 a registration pass records the
//! entries it files one under another as a run, and a lookup matches a
//! prompt against a run's token ids in one compare. These cases shape runs
//! on purpose (a branch inside one, an eviction of its tail, its regrowth,
//! a request truncated into its own) and check that every match is exactly the verified
//! prefix with its own pages, and that `check()` (which verifies the runs
//! slot by slot) holds after each step.

mod common;

use common::{hit, serve};
use kvpool_core::{Counts, Options, SlotAllocator};

/// A page-size-1 pool (a page is a slot: slots name pages).
fn pool(pages: usize) -> SlotAllocator {
    common::pool_of_context(pages, 1, 512)
}

/// Slots the runs cover.
fn in_runs(a: &SlotAllocator) -> u32 {
    a.index_runs_for_tests().iter().map(|r| r.1).sum()
}

#[test]
fn a_cached_prompt_is_one_run_and_hits_whole() {
    let mut a = pool(512);
    let prompt: Vec<i64> = (1000..1200).collect();
    let pages = serve(&mut a, &prompt, 0);
    let live = a.index_links_for_tests().0;
    assert_eq!(live, 200);
    assert_eq!(a.index_runs_for_tests().len(), 1);
    assert_eq!(in_runs(&a), 200);
    assert_eq!(hit(&mut a, &prompt), (199, pages[..199].to_vec()));
}

#[test]
fn a_branch_inside_a_run_hits_both_ways_and_stops_where_a_prompt_leaves_both() {
    let mut a = pool(512);
    let left: Vec<i64> = (0..100).collect();
    let right = [left[..50].to_vec(), (500..550).collect()].concat();
    let lp = serve(&mut a, &left, 0);
    let rp = serve(&mut a, &right, 0); // files under left's 50th entry, mid-run
    assert_eq!(rp[..50], lp[..50]);
    assert_eq!(a.index_runs_for_tests().len(), 2);
    assert_eq!(hit(&mut a, &left), (99, lp[..99].to_vec()));
    assert_eq!(hit(&mut a, &right), (99, rp[..99].to_vec()));
    // Leaves left's run at 70 and matches no branch there.
    let third = [left[..70].to_vec(), vec![999, 998, 997]].concat();
    assert_eq!(hit(&mut a, &third), (70, lp[..70].to_vec()));
    // Leaves right's run one token in.
    let fourth = [right[..51].to_vec(), vec![7, 7]].concat();
    assert_eq!(hit(&mut a, &fourth), (51, rp[..51].to_vec()));
}

#[test]
fn an_eviction_cuts_a_run_from_its_tail_and_a_recomputation_regrows_it() {
    let mut a = pool(512);
    let prompt: Vec<i64> = (0..100).collect();
    let pages = serve(&mut a, &prompt, 0);
    assert_eq!(a.evict(30), 30);
    a.check().unwrap();
    assert_eq!(in_runs(&a), 70);
    assert_eq!(hit(&mut a, &prompt), (70, pages[..70].to_vec()));
    // The tail, cached again under the run's last entry, lands in the slots
    // the eviction freed (last freed, first reused) and continues the run.
    serve(&mut a, &prompt, 0);
    assert_eq!(a.index_runs_for_tests().len(), 1);
    assert_eq!(in_runs(&a), 100);
    assert_eq!(hit(&mut a, &prompt).0, 99);
}

#[test]
fn a_truncated_request_branches_inside_its_own_run() {
    let mut a = pool(512);
    let prompt: Vec<i64> = (0..64).collect();
    let h = a.open(1).unwrap();
    a.extend(&h, Counts::Each(64), Some(&prompt)).unwrap();
    a.cache(&h).unwrap();
    let pages = a.slots(h[0]).unwrap();
    // Truncated to 40 tokens, the request lets its last 24 pages go (they
    // stay cached, in the run) and writes other tokens on new pages, which
    // register under the run's 40th entry.
    a.truncate(&h, Counts::Each(40)).unwrap();
    let other: Vec<i64> = (900..924).collect();
    a.extend(&h, Counts::Each(24), Some(&other)).unwrap();
    a.cache(&h).unwrap();
    a.check().unwrap();
    assert_eq!(a.index_runs_for_tests().len(), 2);
    assert_eq!(in_runs(&a), 88);
    let now = a.slots(h[0]).unwrap();
    a.close(&h, true).unwrap();
    a.check().unwrap();
    assert_eq!(now[..40], pages[..40]);
    let again = [prompt[..40].to_vec(), other.clone(), vec![1]].concat();
    assert_eq!(hit(&mut a, &again), (64, now[..64].to_vec()));
    let old = [prompt.clone(), vec![1]].concat();
    assert_eq!(hit(&mut a, &old), (64, pages[..64].to_vec()));
}

#[test]
fn page_sizes_above_one_keep_no_runs() {
    let mut a = common::pool(64, 4);
    let prompt: Vec<i64> = (0..33).collect();
    serve(&mut a, &prompt, 0);
    assert!(a.index_links_for_tests().0 > 0);
    assert!(a.index_runs_for_tests().is_empty());
}

#[test]
fn a_grouped_pools_anchor_chain_has_no_runs_and_hits_whole_by_hops() {
    use kvpool_core::{GroupSpec, GroupedAllocator};
    // The grouped allocator files its anchor chain page by page, outside
    // `register_row`'s runs: the walk crosses it in blocks of hops.
    let opts = Options {
        hash_seed: Some(5),
        ..Options::new()
    };
    let mut a = GroupedAllocator::new(&[GroupSpec::full(512, 1)], 8, 512, opts, None).unwrap();
    let prompt: Vec<i64> = (3000..3203).collect();
    let (h, cached) = a
        .open_with_prefix(&prompt, &[prompt.len() as i64], Counts::Each(0))
        .unwrap();
    assert_eq!(cached[0], 0);
    a.extend(&h, Counts::Each(203), Some(&prompt), &mut [])
        .unwrap();
    a.cache(&h).unwrap();
    a.close(&h, true).unwrap();
    a.check().unwrap();
    for (tail, want) in [(vec![], 202), (vec![1], 203)] {
        let p = [prompt.clone(), tail].concat();
        let (h, cached) = a
            .open_with_prefix(&p, &[p.len() as i64], Counts::Each(0))
            .unwrap();
        assert_eq!(cached[0], want);
        a.close(&h, false).unwrap();
        a.check().unwrap();
    }
    // A prompt that leaves the chain inside a block of hops.
    let p = [prompt[..100].to_vec(), vec![7; 20]].concat();
    let (h, cached) = a
        .open_with_prefix(&p, &[p.len() as i64], Counts::Each(0))
        .unwrap();
    assert_eq!(cached[0], 100);
    a.close(&h, false).unwrap();
    a.check().unwrap();
}
