//! A request whose chain passes through another request's entry (an
//! unregistered duplicate page inside it) is walked again at `cache()` when
//! a registration went since its last walk. A registration can also go
//! inside a `cache()` batch, before the request's own turn: another row's
//! write-through host copy may evict the entry's only (host) copy. The
//! request's note of its last walk must not then claim that removal.

use kvpool_core::{Counts, HostPolicy, Options, SlotAllocator, EVENT_REMOVED, MEDIUM_HOST};

#[test]
fn a_removal_by_an_earlier_row_of_the_same_cache_batch_is_rechecked() {
    let opts = Options {
        hash_seed: Some(1),
        host_pages: 5,
        host_policy: HostPolicy::WriteThrough,
        ..Options::new()
    };
    let mut a = SlotAllocator::with_options(32, 1, 4, 32, opts).unwrap();
    let first = a.open(1).unwrap();
    a.extend(&first, Counts::Each(1), Some(&[1])).unwrap();
    a.cache(&first).unwrap();
    // The second request computes the first's page again while the first
    // holds it (a duplicate: its chain goes through the first's entry),
    // then three pages of its own, filed under that entry.
    let body = [1i64, 2, 3, 4];
    let second = a.open(1).unwrap();
    a.extend(&second, Counts::Each(4), Some(&body)).unwrap();
    a.cache(&second).unwrap();
    a.close(&first, false).unwrap();
    // The first request's page leaves the device; its entry lives on, on
    // the host only.
    assert_eq!(a.evict(1), 1);
    a.check().unwrap();
    // A third request's write-through copy takes the host's oldest page
    // (that entry's) in the same batch, before the second's turn.
    a.take_events();
    // (Host pages are pinned until their offloads are taken.)
    a.take_offloads();
    let third = a.open(1).unwrap();
    a.extend(&third, Counts::Each(2), Some(&[10, 11])).unwrap();
    a.cache(&[third[0], second[0]]).unwrap();
    let ev = a.take_events();
    assert!(
        ev.medium
            .iter()
            .zip(&ev.kind)
            .any(|(&m, &k)| m == MEDIUM_HOST && k == EVENT_REMOVED),
        "the host copy went in the batch (a Removed event on the host)"
    );
    a.check().unwrap();
    a.cache(&second).unwrap();
    a.check().unwrap();
    let prompt = [body.to_vec(), vec![99]].concat();
    let (h, cached) = a
        .open_with_prefix(&prompt, &[prompt.len() as i64], Counts::Each(0))
        .unwrap();
    assert_eq!(cached[0], 4, "the second request's whole chain hits again");
    a.close(&h, false).unwrap();
    a.check().unwrap();
}
