//! How registration ids number a chain, which the per-run design
//! (docs/design-per-run-prefix.md) builds on: one registration pass gives a
//! row's new pages consecutive ids, each page's parent the id before its
//! own, so inside such a run page k's id is the run's first + k and its
//! parent is implicit. A later pass continues the chain under its tip but
//! takes ids from the shared counter, so it starts a new run unless nothing
//! registered in between. Ids are never reused, but by a ghost's revival.

mod common;

use std::collections::HashSet;

use common::seq;
use kvpool_core::{Counts, Options, SlotAllocator};

fn pool(ps: usize) -> SlotAllocator {
    let opts = Options {
        hash_seed: Some(11),
        ..Options::new()
    };
    SlotAllocator::with_options(256 / ps + 1, ps, 8, 128, opts).unwrap()
}

/// Opens `prompt` on its cached prefix and prefills the rest.
fn open(a: &mut SlotAllocator, prompt: &[i64]) -> (i64, i64) {
    let (h, cached) = a
        .open_with_prefix(prompt, &[prompt.len() as i64], Counts::Each(0))
        .unwrap();
    a.extend(&h, Counts::Each(prompt.len() as i64 - cached[0]), None)
        .unwrap();
    (h[0], cached[0])
}

/// The registered pages' (id, parent id), in page order, from page `from`.
fn regs(a: &SlotAllocator, h: i64, from: usize) -> Vec<(u64, u64)> {
    let all = a.registrations_for_tests(h).unwrap();
    all[from..].iter().map(|r| r.expect("registered")).collect()
}

/// `r` is one run: consecutive ids, each page's parent the page before.
fn assert_run(r: &[(u64, u64)]) {
    for w in r.windows(2) {
        assert_eq!(w[1].0, w[0].0 + 1, "ids of one pass are consecutive: {r:?}");
        assert_eq!(w[1].1, w[0].0, "a page's parent is the page before: {r:?}");
    }
}

#[test]
fn one_pass_numbers_a_chain_as_one_run() {
    for ps in [1, 16] {
        let mut a = pool(ps);
        let (h, _) = open(&mut a, &seq(96, 5));
        assert!(a
            .registrations_for_tests(h)
            .unwrap()
            .iter()
            .all(Option::is_none));
        a.cache(&[h]).unwrap();
        let r = regs(&a, h, 0);
        assert_eq!(r.len(), 96 / ps);
        assert_eq!(r[0].1, 0, "a chain's first page has no parent");
        assert_run(&r);
        a.check().unwrap();
    }
}

#[test]
fn rows_of_one_call_are_a_run_each() {
    let mut a = pool(1);
    let (x, _) = open(&mut a, &seq(30, 1000));
    let (y, _) = open(&mut a, &seq(20, 2000));
    a.cache(&[x, y]).unwrap();
    let (rx, ry) = (regs(&a, x, 0), regs(&a, y, 0));
    assert_run(&rx);
    assert_run(&ry);
    assert_eq!(
        ry[0],
        (rx[29].0 + 1, 0),
        "the next row starts a run of its own"
    );
}

#[test]
fn a_later_pass_continues_the_chain_and_starts_a_run_when_others_registered_between() {
    for ps in [1, 16] {
        let mut a = pool(ps);
        let (h, _) = open(&mut a, &seq(32, 7));
        a.cache(&[h]).unwrap();
        let first = regs(&a, h, 0);
        // Nothing registered since: the next pass takes the very next ids.
        a.extend(&[h], Counts::Each(32), Some(&seq(32, 300)))
            .unwrap();
        a.cache(&[h]).unwrap();
        let both = regs(&a, h, 0);
        assert_eq!(&both[..first.len()], &first[..]);
        assert_run(&both);
        // Another request registers in between: the chain goes on under
        // its tip, its ids from where the counter stands.
        let (other, _) = open(&mut a, &seq(16, 900));
        a.cache(&[other]).unwrap();
        let between = regs(&a, other, 0);
        a.extend(&[h], Counts::Each(32), Some(&seq(32, 600)))
            .unwrap();
        a.cache(&[h]).unwrap();
        let all = regs(&a, h, 0);
        let (old, new) = all.split_at(both.len());
        assert_eq!(old, &both[..]);
        assert_run(new);
        assert_eq!(
            new[0].1,
            both.last().unwrap().0,
            "the new run hangs under the old tip"
        );
        assert_eq!(new[0].0, between.last().unwrap().0 + 1);
        a.check().unwrap();
    }
}

#[test]
fn a_hit_is_the_cached_run_and_the_rest_a_run_under_its_last_page() {
    let mut a = pool(1);
    let base = seq(40, 50);
    let (h, _) = open(&mut a, &base);
    a.cache(&[h]).unwrap();
    let cached = regs(&a, h, 0);
    a.close(&[h], false).unwrap();
    let prompt = [&base[..], &seq(24, 4000)[..]].concat();
    let (g, hit) = open(&mut a, &prompt);
    assert_eq!(hit, 40);
    a.cache(&[g]).unwrap();
    let r = regs(&a, g, 0);
    assert_eq!(
        &r[..40],
        &cached[..],
        "a hit holds the cached pages, ids and all"
    );
    assert_run(&r[40..]);
    assert_eq!(r[40].1, cached[39].0);
    a.check().unwrap();
}

#[test]
fn ids_are_never_reused_through_eviction() {
    // A small pool that evicts: every id ever registered is new (no ghost
    // comes back here, since no evicted page has a cached child left).
    let mut a = pool(1);
    let mut seen = HashSet::new();
    for round in 0..24i64 {
        let (h, _) = open(&mut a, &seq(60, round % 5 * 1000));
        a.cache(&[h]).unwrap();
        for (reg, _) in regs(&a, h, 0) {
            // A hit re-reads ids it saw; a page registered anew must be new.
            seen.insert(reg);
        }
        a.close(&[h], false).unwrap();
        a.check().unwrap();
    }
    // 5 prompts of 60 pages each do not fit 256 pages together: eviction
    // ran, and re-registered content got ids no page had before.
    assert!(
        seen.len() > 5 * 60,
        "{} ids for 300 distinct pages",
        seen.len()
    );
    let max = *seen.iter().max().unwrap();
    assert_eq!(seen.len() as u64, max, "ids are 1..=max, each used once");
}
