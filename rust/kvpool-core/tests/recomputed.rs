//! A request whose hit was shorter than what the index holds recomputes
//! pages whose content is registered already. Where the registered copy is
//! one nobody holds, the request's own copy takes over its registration:
//! otherwise eviction would take the unheld copy first, while the request
//! still holds the same content, and the prompt would stop hitting there.

use std::collections::HashMap;

use kvpool_core::{
    Counts, Events, HostPolicy, Options, SlotAllocator, EVENT_CLEARED, EVENT_STORED,
};

/// 11 usable pages of `ps` slots.
const PAGES: usize = 12;

fn allocator(ps: usize, opts: Options) -> SlotAllocator {
    let opts = Options {
        hash_seed: Some(7),
        kv_events: true,
        manual_clock: true,
        ..opts
    };
    SlotAllocator::with_options(PAGES, ps, 8, PAGES * ps, opts).unwrap()
}

fn seq(n: usize, from: i64) -> Vec<i64> {
    (from..from + n as i64).collect()
}

/// What a router learns from the events: the page of each stored hash,
/// per medium.
#[derive(Default)]
struct Mirror(HashMap<(u8, u64, u64), i32>);

impl Mirror {
    fn apply(&mut self, e: &Events) {
        for i in 0..e.len() {
            let key = (e.medium[i], e.hash_hi[i], e.hash_lo[i]);
            match e.kind[i] {
                EVENT_CLEARED => self.0.clear(),
                EVENT_STORED => {
                    assert!(self.0.insert(key, e.page[i]).is_none(), "stored twice");
                }
                _ => {
                    assert!(self.0.remove(&key).is_some(), "removed but not stored");
                }
            }
        }
    }

    /// Device pages the events say hold a registered page.
    fn device_pages(&self) -> Vec<i32> {
        let mut v: Vec<i32> = self
            .0
            .iter()
            .filter(|(k, _)| k.0 == 0)
            .map(|(_, &p)| p)
            .collect();
        v.sort_unstable();
        v
    }
}

/// Page ids, sorted.
fn sorted(v: &[i32]) -> Vec<i32> {
    let mut v = v.to_vec();
    v.sort_unstable();
    v
}

/// The scenario: prompt `full` (4 full pages and one token) served and
/// cached, then request B opened on its first 2 pages and one token and
/// extended over the rest with the same token ids, so its pages 2 and 3
/// recompute cached content; B caches. Returns B's handle.
fn recompute(
    ps: usize,
    a: &mut SlotAllocator,
    m: &mut Mirror,
    cache_a: impl Fn(&mut SlotAllocator, &[i64]),
) -> i64 {
    let full = seq(4 * ps + 1, 100);
    let (h, _) = a
        .open_with_prefix(&full, &[full.len() as i64], Counts::Each(0))
        .unwrap();
    a.extend(&h, Counts::Each(full.len() as i64), None).unwrap();
    cache_a(a, &h);
    a.close(&h, false).unwrap();
    a.check().unwrap();
    let short = &full[..2 * ps + 1];
    let (b, hit) = a
        .open_with_prefix(short, &[short.len() as i64], Counts::Each(0))
        .unwrap();
    assert_eq!(hit[0] as usize, 2 * ps);
    a.extend(&b, Counts::Each(1), None).unwrap();
    a.extend(&b, Counts::Each(2 * ps as i64), Some(&full[2 * ps + 1..]))
        .unwrap();
    a.cache(&b).unwrap();
    a.check().unwrap();
    m.apply(&a.take_events());
    b[0]
}

/// Every registered device page is one of B's full pages (its hits and
/// its recomputed pages), and the events say so.
fn registered_are_bs(a: &SlotAllocator, m: &Mirror, b: i64) {
    let n = full_pages(a.page_size());
    assert_eq!(a.cached_pages(), n);
    assert_eq!(m.device_pages(), sorted(&a.pages(b).unwrap()[..n]));
}

/// Full pages of the full prompt (at page size 1 its last token is one).
fn full_pages(ps: usize) -> usize {
    (4 * ps + 1) / ps
}

/// A filler request takes every page an extend can have (evicting every
/// evictable page), then closes without caching.
fn fill(a: &mut SlotAllocator, m: &mut Mirror) {
    let n = a.free_pages() * a.page_size();
    let (f, _) = a
        .open_with_prefix(&seq(n, 9000), &[n as i64], Counts::Each(0))
        .unwrap();
    a.extend(&f, Counts::Each(n as i64), None).unwrap();
    a.check().unwrap();
    a.close(&f, false).unwrap();
    a.check().unwrap();
    m.apply(&a.take_events());
}

/// Opens the full prompt and returns its hit (then closes it uncached).
fn hit_of_full(a: &mut SlotAllocator, ps: usize) -> i64 {
    let full = seq(4 * ps + 1, 100);
    let (h, hit) = a
        .open_with_prefix(&full, &[full.len() as i64], Counts::Each(0))
        .unwrap();
    a.close(&h, false).unwrap();
    a.check().unwrap();
    hit[0]
}

fn run(ps: usize, opts: Options, cache_a: impl Fn(&mut SlotAllocator, &[i64])) -> SlotAllocator {
    let mut a = allocator(ps, opts);
    let mut m = Mirror::default();
    let b = recompute(ps, &mut a, &mut m, cache_a);
    fill(&mut a, &mut m);
    assert_eq!(
        hit_of_full(&mut a, ps),
        4 * ps as i64,
        "while B is open (page size {ps})"
    );
    a.close(&[b], true).unwrap();
    a.check().unwrap();
    m.apply(&a.take_events());
    assert_eq!(m.device_pages().len(), a.cached_pages());
    fill(&mut a, &mut m);
    // The filler evicted what was cached; B's pages were the ones.
    assert_eq!(a.cached_pages(), 0);
    assert_eq!(m.device_pages(), Vec::<i32>::new());
    a
}

#[test]
fn a_recomputed_page_takes_over_an_unheld_copy() {
    for ps in [1, 4, 16] {
        let mut a = allocator(ps, Options::new());
        let mut m = Mirror::default();
        let b = recompute(ps, &mut a, &mut m, |a, h| a.cache(h).unwrap());
        fill(&mut a, &mut m);
        assert_eq!(hit_of_full(&mut a, ps), 4 * ps as i64, "page size {ps}");
        // A's copies of the recomputed pages went back FREE: B's are
        // registered.
        registered_are_bs(&a, &m, b);
        assert_eq!(a.evictable_pages(), 0);
        a.close(&[b], true).unwrap();
        a.check().unwrap();
        m.apply(&a.take_events());
        assert_eq!(m.device_pages().len(), full_pages(ps));
        assert_eq!(
            hit_of_full(&mut a, ps),
            4 * ps as i64,
            "after B closed (page size {ps})"
        );
    }
}

#[test]
fn the_registration_keeps_its_priority_when_it_moves() {
    let a = run(4, Options::new(), |a, h| {
        a.cache_with_priority(h, Counts::Each(60), Some(30.0))
            .unwrap();
    });
    assert_eq!(a.evictable_pages_by_priority()[60], 0);
    // Before the fill evicted them, B's closed pages sat at priority 60
    // (checked on a twin that skips the last fill).
    let mut a = allocator(4, Options::new());
    let mut m = Mirror::default();
    let b = recompute(4, &mut a, &mut m, |a, h| {
        a.cache_with_priority(h, Counts::Each(60), Some(30.0))
            .unwrap();
    });
    registered_are_bs(&a, &m, b);
    a.close(&[b], true).unwrap();
    a.check().unwrap();
    assert_eq!(a.evictable_pages_by_priority()[60], 4);
    // The moved durations still end.
    a.set_clock(31.0).unwrap();
    a.check().unwrap();
    assert_eq!(a.evictable_pages_by_priority()[60], 0);
}

#[test]
fn a_moved_pin_stays_a_pin() {
    let opts = Options {
        max_pinned_pages: Some(8),
        ..Options::new()
    };
    let mut a = allocator(4, opts);
    let mut m = Mirror::default();
    let b = recompute(4, &mut a, &mut m, |a, h| {
        a.cache_with_priority(h, Counts::Each(100), None).unwrap();
    });
    assert_eq!(a.pinned_pages(), 4);
    // Pinned copies are never evicted, and the pins followed the
    // registrations to B's pages: A's copies are FREE.
    assert_eq!(a.free_pages(), PAGES - 1 - 5);
    fill(&mut a, &mut m);
    a.close(&[b], true).unwrap();
    a.check().unwrap();
    assert_eq!(a.pinned_pages(), 4);
    assert_eq!(hit_of_full(&mut a, 4), 16);
}

#[test]
fn a_moved_registration_keeps_its_host_copy() {
    for policy in [HostPolicy::WriteBack, HostPolicy::WriteThrough] {
        let opts = Options {
            host_pages: 8,
            host_policy: policy,
            ..Options::new()
        };
        let mut a = run(4, opts, |a, h| a.cache(h).unwrap());
        a.take_offloads();
        a.take_loads();
        a.check().unwrap();
        // Evicted from the device, the prompt still hits from the host.
        assert_eq!(hit_of_full(&mut a, 4), 16, "{policy:?}");
    }
}
