//! The life of cached pages: eviction order (least recently used, a
//! chain's tail first), eviction under an extend's pressure, and
//! `clear_cache`.

mod common;

use common::{pool, pool_of_context, seq, serve};
use kvpool_core::{Counts, Options, SlotAllocator, EVENT_CLEARED, EVENT_REMOVED};

#[test]
fn eviction_takes_least_recent_chains_tail_first() {
    let mut a = pool(9, 2); // 8 usable pages
    serve(&mut a, &seq(7, 0), 0); // pages 1,2,3 registered, 4 (partial) freed
    serve(&mut a, &seq(5, 100), 0); // FREE pages first: 4,5 registered, 6 freed
    assert_eq!(a.evictable_pages(), 5);
    a.take_events();
    assert_eq!(a.evict(2), 2);
    let ev = a.take_events();
    assert_eq!(ev.kind, vec![EVENT_REMOVED; 2]);
    // The older chain goes first, its last page before its first.
    let first_chain = {
        let (h, _) = a
            .open_with_prefix(&seq(7, 0), &[7], Counts::Each(0))
            .unwrap();
        let c = a.length(h[0]).unwrap();
        a.close(&h, false).unwrap();
        c
    };
    assert_eq!(
        first_chain, 2,
        "pages 2 and 3 of the first chain were evicted, page 1 kept"
    );
    assert_eq!(a.evict(100), 3); // pages 5, 4 of the second chain, then page 1
    a.check().unwrap();
}

/// With more than 8192 registered pages evictions warm the victims ahead of
/// them (`allocator/evict.rs`: a walk running eight victims ahead of the
/// removals, and at page sizes above 1 one eviction at a time); the order
/// must stay exactly LRU, chain tail first, whether `evict(n)` or an extend
/// short of FREE pages evicts, warmed or not, and however many victims a
/// walk takes.
#[test]
fn eviction_order_holds_on_an_index_big_enough_to_warm_victims() {
    for ps in [1usize, 2] {
        eviction_order_on_a_big_index(ps);
    }
}

fn eviction_order_on_a_big_index(ps: usize) {
    let n = 4000usize;
    let opts = Options {
        hash_seed: Some(7),
        ..Options::new()
    };
    let mut a = SlotAllocator::with_options(3 * n + 1, ps, 4, 2 * n * ps, opts).unwrap();
    let chains: Vec<Vec<i64>> = (0..3).map(|c| seq(n * ps, 100_000 * c)).collect();
    // Every page of each chain is full, so every one is registered; a
    // page's id is its first slot over the page size.
    let pages: Vec<Vec<i64>> = chains
        .iter()
        .map(|c| {
            let slots = serve(&mut a, c, 0);
            slots.iter().step_by(ps).map(|&s| s / ps as i64).collect()
        })
        .collect();
    assert_eq!(
        (a.cached_pages(), a.free_pages() - a.evictable_pages()),
        (3 * n, 0)
    );
    a.take_events();
    let removed = |a: &mut SlotAllocator| {
        let ev = a.take_events();
        assert!(ev.kind.iter().all(|&k| k == EVENT_REMOVED));
        ev.page.iter().map(|&p| p as i64).collect::<Vec<_>>()
    };
    assert_eq!(a.evict(1000), 1000);
    let tail: Vec<i64> = pages[0][n - 1000..].iter().rev().copied().collect();
    assert_eq!(
        removed(&mut a),
        tail,
        "evict(n) at page {ps}: the oldest chain, last page first"
    );
    let h = a.open(1).unwrap();
    // 1000 FREE pages, then 1500 evicted.
    a.extend(&h, Counts::Each((2500 * ps) as i64), None)
        .unwrap();
    let next: Vec<i64> = pages[0][n - 2500..n - 1000].iter().rev().copied().collect();
    assert_eq!(
        removed(&mut a),
        next,
        "extend at page {ps}: evicts on where evict(n) stopped"
    );
    a.close(&h, false).unwrap();
    a.check().unwrap();
    // Fewer victims than the walk runs ahead (16), as many, and one more.
    let mut end = n - 2500;
    for k in [1usize, 7, 8, 9, 15, 16, 17] {
        assert_eq!(a.evict(k), k);
        let want: Vec<i64> = pages[0][end - k..end].iter().rev().copied().collect();
        assert_eq!(removed(&mut a), want, "evict({k}) at page {ps}");
        end -= k;
    }
    a.check().unwrap();
    for (c, want) in [(0usize, end), (1, n - 1)] {
        let (h, cached) = a
            .open_with_prefix(&chains[c], &[(n * ps) as i64], Counts::Each(0))
            .unwrap();
        assert_eq!(cached[0] as usize, want * ps);
        a.close(&h, false).unwrap();
    }
    a.check().unwrap();
}

/// A page-1 decode step short of FREE pages: the rows take the free stack's
/// pages first, in pop order, then the victims in eviction order (the
/// oldest chain's last page first), as one eviction a page would give them,
/// though the victims are evicted in one walk before the rows take them.
#[test]
fn a_decode_step_past_the_free_stack_takes_victims_in_order() {
    let n = 12usize;
    let mut a = pool_of_context(n + 1, 1, 64); // every page used by one chain
    let chain = serve(&mut a, &seq(n, 0), 0);
    assert_eq!(
        (a.cached_pages(), a.free_pages() - a.evictable_pages()),
        (n, 0)
    );
    assert_eq!(a.evict(2), 2); // the chain's last two pages, pushed in that order
    a.take_events();
    let h = a.open(5).unwrap();
    let slots = a
        .extend(&h, Counts::Each(1), Some(&[7, 7, 7, 7, 7]))
        .unwrap();
    let ev = a.take_events();
    assert_eq!(ev.kind, vec![EVENT_REMOVED; 3]);
    let removed: Vec<i64> = ev.page.iter().map(|&p| p as i64).collect();
    assert_eq!(removed, vec![chain[n - 3], chain[n - 4], chain[n - 5]]);
    assert_eq!(
        slots,
        vec![
            chain[n - 2],
            chain[n - 1],
            chain[n - 3],
            chain[n - 4],
            chain[n - 5]
        ],
        "the free stack's pages in pop order, then the victims in eviction order"
    );
    a.close(&h, false).unwrap();
    a.check().unwrap();
}

/// A pool of 40 pages of `ps` slots whose every page is CACHED (one
/// chain): no FREE page left.
fn full_pool(ps: usize) -> SlotAllocator {
    let n = 40usize;
    let mut a = pool_of_context(n + 1, ps, ps * n);
    serve(&mut a, &seq(ps * n, 0), 0);
    assert_eq!(a.free_pages() - a.evictable_pages(), 0);
    a
}

/// A page-1 decode step on a pool with no FREE page at all, a row in the
/// middle still reading its prompt (it grows the general way): the rows
/// take the same victims, in the same order, and the Removed events come
/// in the same order, as when each request extends on its own.
#[test]
fn a_decode_step_on_a_full_pool_matches_one_request_at_a_time() {
    let mut a = full_pool(1);
    let plain = a.open(2).unwrap();
    let prompt = [500i64, 501, 502];
    let (slow, cached) = a.open_with_prefix(&prompt, &[3], Counts::Each(0)).unwrap();
    assert_eq!(cached[0], 0);
    let last = a.open(1).unwrap();
    let batch = [plain[0], plain[1], slow[0], last[0]];
    a.take_events();
    let mut b = a.clone();
    let slots = a.extend(&batch, Counts::Each(1), None).unwrap();
    let mut one_by_one = Vec::new();
    for h in batch {
        one_by_one.extend(b.extend(&[h], Counts::Each(1), None).unwrap());
    }
    assert_eq!(slots, one_by_one);
    let (ea, eb) = (a.take_events(), b.take_events());
    assert_eq!(ea.kind, vec![EVENT_REMOVED; 4]);
    assert_eq!((ea.kind, ea.page), (eb.kind, eb.page));
    a.check().unwrap();
    // With token ids: the fast rows store them (a hit on them proves it).
    let h = a.open(2).unwrap();
    let out = a.extend(&h, Counts::Each(1), Some(&[900, 901])).unwrap();
    a.check().unwrap();
    a.cache(&h).unwrap();
    a.close(&h, false).unwrap();
    let (h2, cached) = a
        .open_with_prefix(&[901, 3], &[2], Counts::Each(0))
        .unwrap();
    assert_eq!(cached[0], 1);
    assert_eq!(a.slots(h2[0]).unwrap()[0], out[1]);
    a.check().unwrap();
}

/// The same at page size 4, lengths staggered so that some rows start a
/// page (they take victims) and the others write into their own (applied
/// by the general pass): with token ids, and with a row still reading its
/// prompt at a page boundary (then the one-walk eviction stands aside and
/// the rows grow one by one).
#[test]
fn a_page4_decode_step_on_a_full_pool_matches_one_request_at_a_time() {
    for with_slow in [false, true] {
        let mut a = full_pool(4);
        let h = a.open(6).unwrap();
        // Lengths 0, 1, 2, 3, 4, 5: rows 0 and 4 start a page next. Known
        // token ids (row i's are 100 * i + j), so full pages register.
        let known: Vec<i64> = (0..6i64)
            .flat_map(|i| (0..i).map(move |j| 100 * i + j))
            .collect();
        a.extend(&h, Counts::PerRequest(&[0, 1, 2, 3, 4, 5]), Some(&known))
            .unwrap();
        let mut batch = h.clone();
        if with_slow {
            let (s, _) = a
                .open_with_prefix(&[600, 601, 602, 603, 604, 605], &[6], Counts::Each(0))
                .unwrap();
            a.extend(&s, Counts::Each(4), None).unwrap();
            batch.insert(2, s[0]); // at its page boundary, its prompt ahead
        }
        a.take_events();
        let mut b = a.clone();
        let tokens: Vec<i64> = (0..batch.len() as i64).map(|i| 900 + i).collect();
        let tokens = if with_slow {
            let mut t = tokens;
            t[2] = 604; // the prompt's token at that position
            t
        } else {
            tokens
        };
        let slots = a.extend(&batch, Counts::Each(1), Some(&tokens)).unwrap();
        let mut one_by_one = Vec::new();
        for (i, &x) in batch.iter().enumerate() {
            one_by_one.extend(
                b.extend(&[x], Counts::Each(1), Some(&tokens[i..=i]))
                    .unwrap(),
            );
        }
        assert_eq!(slots, one_by_one, "with a slow row: {with_slow}");
        let (ea, eb) = (a.take_events(), b.take_events());
        assert_eq!((ea.kind, ea.page), (eb.kind, eb.page));
        for &x in &batch {
            assert_eq!(a.slots(x).unwrap(), b.slots(x).unwrap());
        }
        a.check().unwrap();
        // The tokens were stored and the known counts advanced: row 3,
        // which the general pass applied (it stayed in its page), filled
        // its page with the step's token, and that page registers and hits.
        let t3 = tokens[if with_slow { 4 } else { 3 }];
        a.cache(&h[3..4]).unwrap();
        let prompt = [300, 301, 302, t3, 7];
        let (o, cached) = a.open_with_prefix(&prompt, &[5], Counts::Each(0)).unwrap();
        assert_eq!(cached[0], 4);
        assert_eq!(a.slots(o[0]).unwrap()[..4], a.slots(h[3]).unwrap()[..4]);
        a.close(&o, false).unwrap();
        // Row 0 started a page past the free stack (listed, then given a
        // victim): its token is there too once the page is full.
        a.extend(&h[..1], Counts::Each(3), Some(&[41, 42, 43]))
            .unwrap();
        a.cache(&h[..1]).unwrap();
        let prompt = [tokens[0], 41, 42, 43, 7];
        let (o, cached) = a.open_with_prefix(&prompt, &[5], Counts::Each(0)).unwrap();
        assert_eq!(cached[0], 4);
        assert_eq!(a.slots(o[0]).unwrap()[..4], a.slots(h[0]).unwrap()[..4]);
        a.check().unwrap();
    }
}

/// A decode step that fails validation on a pool with no FREE page evicts
/// nothing: the error leaves the cache, the events and the rows as they
/// were.
#[test]
fn a_failing_decode_step_on_a_full_pool_evicts_nothing() {
    for ps in [1, 4] {
        let mut a = full_pool(ps);
        let h = a.open(3).unwrap();
        // At page 4 the third row stays in its page (the general pass
        // applies it before the bad handle turns up).
        a.extend(&h[2..], Counts::Each(1), None).unwrap();
        a.take_events();
        let cached = a.cached_pages();
        for bad in [vec![h[0], h[2], h[1], -3], vec![h[0], h[2], h[1], h[0]]] {
            assert!(a
                .extend(&bad, Counts::Each(1), Some(&[1, 2, 3, 4]))
                .is_err());
            assert_eq!(a.cached_pages(), cached);
            assert!(a.take_events().kind.is_empty());
            assert_eq!(a.lengths(&h).unwrap(), vec![0, 0, 1]);
            a.check().unwrap();
        }
    }
}

#[test]
fn extend_under_pressure_evicts_instead_of_failing() {
    let mut a = pool(5, 2); // 4 usable pages
    serve(&mut a, &seq(8, 0), 0);
    assert_eq!((a.free_pages(), a.evictable_pages()), (4, 4));
    let h = a.open(1).unwrap();
    a.extend(&h, Counts::Each(7), None).unwrap();
    assert_eq!((a.free_pages(), a.cached_pages()), (0, 0));
    let e = a.extend(&h, Counts::Each(2), None).unwrap_err();
    assert!(matches!(
        e,
        kvpool_core::PoolError::Exhausted {
            needed_pages: 1,
            free_pages: 0,
            ..
        }
    ));
    a.check().unwrap();
}

/// `clear_cache` walks what was registered, not the whole table, while
/// only a few pages are registered (the table is sized for the pool), and
/// memsets it when many are: both leave no entry behind, keep requests'
/// held pages, and let the same prompts register again from scratch.
#[test]
fn clear_cache_forgets_every_entry_whether_few_or_many_are_registered() {
    // 1024 pages: a 2048-bucket table, dense past 256 keys.
    for (prompts, what) in [(2usize, "few (sparse table)"), (200, "many (dense table)")] {
        let opts = Options {
            hash_seed: Some(7),
            ..Options::new()
        };
        let mut a = SlotAllocator::with_options(1024, 4, 128, 64, opts).unwrap();
        let mut held = Vec::new();
        for i in 0..prompts {
            let p = seq(8, 100 * i as i64);
            if i % 3 == 0 {
                // Still held at the clear: registered, not CACHED.
                let (h, _) = a.open_with_prefix(&p, &[8], Counts::Each(0)).unwrap();
                a.extend(&h, Counts::Each(8), None).unwrap();
                a.cache(&h).unwrap();
                held.push((h[0], a.pages(h[0]).unwrap()));
            } else {
                serve(&mut a, &p, 0);
            }
        }
        // Freed slab slots among the live ones: evict some cached pages.
        a.evict(prompts / 2);
        a.check().unwrap();
        a.take_events();
        a.clear_cache();
        a.check().unwrap();
        assert_eq!(a.cached_pages(), 0, "{what}");
        assert_eq!(a.take_events().kind, vec![EVENT_CLEARED], "{what}");
        for (h, pages) in &held {
            assert_eq!(&a.pages(*h).unwrap(), pages, "{what}: held pages stay");
        }
        // Nothing hits, and the held requests' pages can register again.
        let (h, cached) = a
            .open_with_prefix(&seq(8, 0), &[8], Counts::Each(0))
            .unwrap();
        assert_eq!(cached, vec![0], "{what}");
        a.close(&h, false).unwrap();
        let hs: Vec<i64> = held.iter().map(|(h, _)| *h).collect();
        a.cache(&hs).unwrap();
        assert_eq!(a.cached_pages(), 2 * hs.len(), "{what}");
        a.check().unwrap();
    }
}
