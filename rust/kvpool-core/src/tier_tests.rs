//! `check()` with a host tier: each broken invariant of the tier, or of
//! the index's locations against the host records, is reported.

use crate::location::on_host;
use crate::{Counts, HostPolicy, Options, PoolError, SlotAllocator};

/// A pool whose host tier has a page in every state: a CACHED host copy
/// (of an entry also on the device), a host-only entry, a swapped-out
/// request's page, and an offload and a load still queued.
fn tiered() -> SlotAllocator {
    let o = Options {
        hash_seed: Some(3),
        host_pages: 8,
        host_policy: HostPolicy::WriteBack,
        ..Options::new()
    };
    let mut a = SlotAllocator::with_options(8, 2, 4, 16, o).unwrap();
    let serve = |a: &mut SlotAllocator, p: &[i64]| {
        let (h, _) = a
            .open_with_prefix(p, &[p.len() as i64], Counts::Each(0))
            .unwrap();
        a.extend(&h, Counts::Each(p.len() as i64), None).unwrap();
        a.close(&h, true).unwrap();
    };
    serve(&mut a, &[1, 2, 3, 4, 9]);
    assert_eq!(a.evict(2), 2); // both pages offloaded: host-only
    a.take_offloads();
    // A hit loads the first page back (queued): on both tiers.
    let (_, cached) = a
        .open_with_prefix(&[1, 2, 7], &[3], Counts::Each(0))
        .unwrap();
    assert_eq!(cached, [2]);
    let r = a.open(1).unwrap();
    a.extend(&r, Counts::Each(3), None).unwrap();
    a.swap_out(&r).unwrap(); // its offloads stay queued
    assert!(a.pending_loads() == 1 && a.pending_offloads() == 2);
    a.check().unwrap();
    a
}

type Corrupt = Box<dyn Fn(&mut SlotAllocator)>;

#[test]
fn check_detects_host_tier_corruption() {
    let good = tiered();
    let in_host = |what: &'static str| -> (&'static str, Corrupt) {
        (
            what,
            Box::new(move |a| a.host_for_tests().corrupt_for_tests(what)),
        )
    };
    let corruptions: Vec<(&str, Corrupt)> = vec![
        in_host("host free and held"),
        in_host("host holders"),
        in_host("host registered count"),
        in_host("host only count"),
        in_host("host load map"),
        (
            "an entry's host copy its page does not name",
            Box::new(|a| {
                let pages = a.pages_for_tests();
                let entry = (1..8).map(|p| pages.entry(p)).find(|&e| e != 0).unwrap();
                a.prefix_for_tests().set_host_copy(entry - 1, 7); // a FREE host page
            }),
        ),
        (
            "a resident request naming a host page",
            Box::new(|a| {
                let rq = a.requests_for_tests();
                let row = (0..4)
                    .find(|&r| rq.is_open(r) && !rq.is_swapped(r))
                    .unwrap();
                rq.set_page(row, 0, on_host(3));
            }),
        ),
        (
            "a swapped request naming a host page out of range",
            Box::new(|a| {
                let rq = a.requests_for_tests();
                let row = (0..4).find(|&r| rq.is_open(r) && rq.is_swapped(r)).unwrap();
                rq.set_page(row, 0, on_host(8));
            }),
        ),
    ];
    for (what, corrupt) in &corruptions {
        let mut b = good.clone();
        corrupt(&mut b);
        assert!(
            matches!(b.check(), Err(PoolError::Invariant(_))),
            "corruption {what:?}"
        );
    }
}
