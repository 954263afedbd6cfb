//! Retention priorities with a host tier: priorities pick the device
//! victim, the tier then keeps or offloads its entry; a pinned page never
//! leaves the device; a page loaded back from the host is a new device
//! registration with the default priority; a swapped-out request's page
//! list names host pages, so priority calls refuse it.

mod common;

use common::seq;
use kvpool_core::{
    Counts, HostPolicy, Options, PoolError, SlotAllocator, DEFAULT_PRIORITY, EVENT_REMOVED,
    MEDIUM_DEVICE,
};

/// Page size 2, 12 usable device pages, 9 host pages under `write_back`, a
/// manual clock.
fn pool() -> SlotAllocator {
    let opts = Options {
        hash_seed: Some(7),
        manual_clock: true,
        host_pages: 10,
        host_policy: HostPolicy::WriteBack,
        ..Options::new()
    };
    SlotAllocator::with_options(13, 2, 8, 64, opts).unwrap()
}

/// Opens `prompt` (its last token never fills a page), prefills it, closes
/// it with priority `q` (None: plain `close(cache=true)`); returns its pages.
fn serve(a: &mut SlotAllocator, prompt: &[i64], q: Option<i64>) -> Vec<i32> {
    let (h, cached) = a
        .open_with_prefix(prompt, &[prompt.len() as i64], Counts::Each(0))
        .unwrap();
    a.extend(&h, Counts::Each(prompt.len() as i64 - cached[0]), None)
        .unwrap();
    let pages = a.pages(h[0]).unwrap();
    match q {
        None => a.close(&h, true).unwrap(),
        Some(q) => a.close_with_priority(&h, Counts::Each(q), None).unwrap(),
    }
    a.check().unwrap();
    pages
}

/// The device pages `evict(n)` took, in order (their device Removed events).
fn evicted(a: &mut SlotAllocator, n: usize) -> Vec<i32> {
    a.take_events();
    let k = a.evict(n);
    a.check().unwrap();
    let ev = a.take_events();
    let out: Vec<i32> = (0..ev.len())
        .filter(|&i| ev.kind[i] == EVENT_REMOVED && ev.medium[i] == MEDIUM_DEVICE)
        .map(|i| ev.page[i])
        .collect();
    assert_eq!(out.len(), k);
    out
}

#[test]
fn priorities_pick_the_victim_and_write_back_offloads_it() {
    let mut a = pool();
    let hi = serve(&mut a, &seq(5, 0), Some(80));
    let lo = serve(&mut a, &seq(5, 100), Some(10));
    let _default = serve(&mut a, &seq(5, 200), None);
    // The lowest priority first, a chain's tail before its parent.
    assert_eq!(evicted(&mut a, 2), [lo[1], lo[0]]);
    let (dev, host) = a.take_offloads();
    assert_eq!(dev, [lo[1] as i64, lo[0] as i64], "each victim offloaded");
    assert_eq!(host.len(), 2);
    assert_eq!(a.host_cached_pages(), 2);
    // The offloaded prefix is still a hit, served from the host.
    let (h, cached) = a
        .open_with_prefix(&seq(5, 100), &[5], Counts::Each(0))
        .unwrap();
    assert_eq!(cached, [4]);
    assert_eq!(a.host_hit_tokens(), 4);
    a.close(&h, false).unwrap();
    a.check().unwrap();
    assert_eq!(a.evictable_pages_by_priority()[80], hi.len() - 1);
}

#[test]
fn a_pinned_page_is_never_offloaded_nor_dropped() {
    let mut a = pool();
    // The two full pages are pinned; the partial third was freed.
    let pinned = serve(&mut a, &seq(5, 0), Some(100))[..2].to_vec();
    let other = serve(&mut a, &seq(5, 100), None);
    assert_eq!(a.pinned_pages(), 2);
    assert_eq!(evicted(&mut a, usize::MAX), [other[1], other[0]]);
    let (dev, _) = a.take_offloads();
    assert!(
        dev.iter().all(|&p| !pinned.contains(&(p as i32))),
        "a pinned page was offloaded: {dev:?}"
    );
    assert_eq!(a.pinned_pages(), 2);
    assert_eq!(a.cached_pages(), 2, "the pinned pages stay on the device");
    let (h, cached) = a
        .open_with_prefix(&seq(5, 0), &[5], Counts::Each(0))
        .unwrap();
    assert_eq!(cached, [4]);
    assert_eq!(a.pages(h[0]).unwrap()[..2], pinned[..]);
    assert_eq!(a.host_hit_tokens(), 0, "served from the device");
    a.check().unwrap();
}

#[test]
fn a_page_loaded_back_from_the_host_has_the_default_priority() {
    let mut a = pool();
    serve(&mut a, &seq(5, 0), Some(80));
    assert_eq!(a.evictable_pages_by_priority()[80], 2);
    assert_eq!(evicted(&mut a, usize::MAX).len(), 2);
    a.take_offloads();
    assert_eq!(a.host_cached_pages(), 2);
    // The host hit loads both pages into new device pages; closing without a
    // priority leaves them at the default: the 80 went with the device copy.
    serve(&mut a, &seq(5, 0), None);
    assert_eq!(a.host_hit_tokens(), 4);
    let by = a.evictable_pages_by_priority();
    assert_eq!((by[80], by[DEFAULT_PRIORITY as usize]), (0, 2));
}

#[test]
fn priority_calls_refuse_a_swapped_out_request_and_change_nothing() {
    let mut a = pool();
    serve(&mut a, &seq(5, 0), Some(100));
    // A request on the pinned prefix with a page of its own past it.
    let (h, _) = a
        .open_with_prefix(&seq(7, 0), &[7], Counts::Each(0))
        .unwrap();
    a.extend(&h, Counts::Each(3), None).unwrap();
    a.swap_out(&h).unwrap();
    let before = (a.pinned_pages(), a.free_pages(), a.host_free_pages());
    let swapped = |r: Result<(), PoolError>| matches!(r, Err(PoolError::RequestSwappedOut { handle }) if handle == h[0]);
    assert!(swapped(a.cache_with_priority(&h, Counts::Each(50), None)));
    assert!(swapped(a.close_with_priority(&h, Counts::Each(50), None)));
    assert!(swapped(a.unpin(&h).map(|_| ())));
    assert_eq!(
        (a.pinned_pages(), a.free_pages(), a.host_free_pages()),
        before
    );
    assert_eq!(a.is_swapped(h[0]), Ok(true));
    a.check().unwrap();
    a.swap_in(&h).unwrap();
    assert_eq!(a.unpin(&h), Ok(2));
    a.check().unwrap();
}
