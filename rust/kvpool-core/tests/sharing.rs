//! Shared pages: prefix hits, fork and copy-on-write, registration, events
//! (eviction and clear_cache: `eviction.rs`).

use kvpool_core::{
    Counts, Options, PoolError, SlotAllocator, EVENT_CLEARED, EVENT_REMOVED, EVENT_STORED,
};

mod common;

use common::{pool, seq, serve};

#[test]
fn a_shared_system_prompt_is_computed_once() {
    let mut a = pool(32, 4);
    let system = seq(8, 100);
    let p1 = [system.clone(), vec![1, 2, 3]].concat();
    let p2 = [system.clone(), vec![4, 5]].concat();
    let s1 = serve(&mut a, &p1, 0);
    assert_eq!((a.cached_pages(), a.evictable_pages()), (2, 2)); // 8 of 11 tokens in full pages
    let (h, cached) = a.open_with_prefix(&p2, &[10], Counts::Each(0)).unwrap();
    assert_eq!(cached, vec![8]);
    assert_eq!(
        a.slots(h[0]).unwrap(),
        s1[..8].to_vec(),
        "the same slots, not a copy"
    );
    assert_eq!((a.hit_tokens(), a.miss_tokens()), (8, 11 + 2));
    assert_eq!(a.evictable_pages(), 0, "hit pages are HELD again");
    // A different salt never shares; a prompt of exactly the cached length
    // keeps its last page to compute.
    let (_, c) = a.open_with_prefix(&p2, &[10], Counts::Each(1)).unwrap();
    assert_eq!(c, vec![0]);
    let (_, c) = a.open_with_prefix(&system, &[8], Counts::Each(0)).unwrap();
    assert_eq!(c, vec![4]);
    a.check().unwrap();
}

#[test]
fn extends_take_prompt_tokens_and_decode_tokens() {
    let mut a = pool(32, 4);
    let prompt = seq(6, 10);
    let (h, _) = a.open_with_prefix(&prompt, &[6], Counts::Each(0)).unwrap();
    a.extend(&h, Counts::Each(6), None).unwrap();
    a.extend(&h, Counts::Each(2), Some(&[7, 8])).unwrap();
    assert_eq!(
        a.known_tokens(h[0]).unwrap(),
        vec![10, 11, 12, 13, 14, 15, 7, 8]
    );
    a.extend(&h, Counts::Each(1), None).unwrap(); // unknown: page 3 uncacheable
    a.extend(&h, Counts::Each(3), Some(&[1, 2, 3])).unwrap();
    a.cache(&h).unwrap();
    assert_eq!(a.cached_pages(), 2);
    assert_eq!(a.known_tokens(h[0]).unwrap().len(), 8);
}

#[test]
fn fork_shares_pages_and_copies_the_partial_page_on_write() {
    let mut a = pool(32, 4);
    let h = a.open(1).unwrap();
    let s = a.extend(&h, Counts::Each(6), Some(&seq(6, 0))).unwrap(); // pages 1, 2 (half)
    let kids = a.fork(h[0], 2).unwrap();
    assert_eq!(a.used_pages(), 2);
    for &k in &kids {
        assert_eq!(a.slots(k).unwrap(), s);
        assert_eq!(
            a.known_tokens(k).unwrap(),
            seq(6, 0).iter().map(|&t| t as i32).collect::<Vec<_>>()
        );
    }
    // First writer into the shared half page gets a copy of its valid part.
    let mut grown = Vec::new();
    let mut out = vec![0; 1];
    a.extend_into(&kids[..1], Counts::Each(1), None, &mut out, |g| {
        grown.push((g.start, g.moved, g.slots.to_vec()))
    })
    .unwrap();
    assert_eq!(grown, vec![(6, 2, vec![14])]); // new page 3: slots 12, 13 copied, 14 new
    assert_eq!(a.take_copies(), (vec![8, 9], vec![12, 13]));
    assert_eq!(a.slots(kids[0]).unwrap(), vec![4, 5, 6, 7, 12, 13, 14]);
    // The parent and the other child still share page 2; then the last
    // holders write: one copies, the other (now alone) writes in place.
    a.extend(&[h[0], kids[1]], Counts::Each(1), None).unwrap();
    let (src, dst) = a.take_copies();
    assert_eq!((src.len(), dst.len()), (2, 2));
    assert_eq!(a.slots(kids[1]).unwrap(), vec![4, 5, 6, 7, 8, 9, 10]);
    a.check().unwrap();
}

#[test]
fn truncate_into_a_shared_page_copies_on_the_next_write() {
    let mut a = pool(32, 4);
    let h = a.open(1).unwrap();
    a.extend(&h, Counts::Each(8), Some(&seq(8, 0))).unwrap();
    let k = a.fork(h[0], 1).unwrap();
    a.truncate(&k, Counts::Each(5)).unwrap(); // into page 2, still held by h
    let s = a.extend(&k, Counts::Each(1), Some(&[99])).unwrap();
    assert_eq!(a.take_copies(), (vec![8], vec![12]));
    assert_eq!(s, vec![13]);
    assert_eq!(
        a.slots(h[0]).unwrap(),
        (4..12).collect::<Vec<i64>>(),
        "the parent's page is untouched"
    );
    a.check().unwrap();
}

#[test]
fn a_registered_page_is_never_written_in_place() {
    let mut a = pool(32, 4);
    let prompt = seq(8, 50);
    let h = a.open(1).unwrap();
    a.extend(
        &h,
        Counts::Each(9),
        Some(&[prompt.clone(), vec![1]].concat()),
    )
    .unwrap();
    a.cache(&h).unwrap();
    assert_eq!(a.cached_pages(), 2);
    // Alone with its registered page 2: truncating into it and writing
    // other tokens unregisters it first, so no later prompt hits stale KV.
    a.truncate(&h, Counts::Each(6)).unwrap();
    a.take_events();
    a.extend(&h, Counts::Each(1), Some(&[7])).unwrap();
    let ev = a.take_events();
    assert_eq!(
        (ev.kind.clone(), ev.page.clone()),
        (vec![EVENT_REMOVED], vec![2])
    );
    assert_eq!(a.cached_pages(), 1);
    let (_, c) = a
        .open_with_prefix(&[prompt.clone(), vec![3]].concat(), &[9], Counts::Each(0))
        .unwrap();
    assert_eq!(c, vec![4], "only the untouched first page hits");
    // Shared with another request instead: the writer copies.
    let mut b = pool(32, 4);
    let h = b.open(1).unwrap();
    b.extend(&h, Counts::Each(8), Some(&prompt)).unwrap();
    b.close(&h, true).unwrap();
    let (h2, c) = b
        .open_with_prefix(&[prompt.clone(), vec![1]].concat(), &[9], Counts::Each(0))
        .unwrap();
    assert_eq!(c, vec![8]);
    let kid = b.fork(h2[0], 1).unwrap();
    b.truncate(&kid, Counts::Each(6)).unwrap();
    b.extend(&kid, Counts::Each(1), None).unwrap(); // the prompt's token 56 again
    assert_eq!(b.cached_pages(), 2, "the cached copy stays registered");
    assert_eq!(b.take_copies().0, vec![8, 9]);
    b.check().unwrap();
}

/// The index's table is sized for the pool at the first registration, not
/// at a `cache()` that has nothing to register.
#[test]
fn a_cache_call_with_no_full_page_allocates_no_index() {
    let mut a = pool(64, 4);
    let h = a.open(1).unwrap();
    a.extend(&h, Counts::Each(3), Some(&[1, 2, 3])).unwrap();
    let before = a.metadata_bytes();
    a.cache(&h).unwrap();
    assert_eq!(a.metadata_bytes(), before);
    a.extend(&h, Counts::Each(1), Some(&[4])).unwrap();
    a.cache(&h).unwrap();
    assert!(
        a.metadata_bytes() > before,
        "one full page: the index is sized now"
    );
    assert_eq!(a.cached_pages(), 1);
    a.check().unwrap();
}

#[test]
fn events_carry_hash_chain_page_and_tokens() {
    let mut a = pool(16, 2);
    serve(&mut a, &seq(5, 10), 3);
    let ev = a.take_events();
    assert_eq!(ev.kind, vec![EVENT_STORED, EVENT_STORED]);
    assert_eq!(ev.page, vec![1, 2]);
    assert_eq!(ev.num_tokens, vec![2, 2]);
    assert_eq!(ev.token_ids, vec![10, 11, 12, 13]);
    assert_eq!(ev.salt, vec![3, 3]);
    assert_eq!(
        (ev.parent_hi[0], ev.parent_lo[0]),
        (0, 0),
        "first page has no parent"
    );
    assert_eq!(
        (ev.parent_hi[1], ev.parent_lo[1]),
        (ev.hash_hi[0], ev.hash_lo[0])
    );
    // Same seed, same hashes: routers and ranks agree.
    let mut b = pool(16, 2);
    serve(&mut b, &seq(5, 10), 3);
    assert_eq!(b.take_events(), ev);
    a.clear_cache();
    let ev = a.take_events();
    assert_eq!(ev.kind, vec![EVENT_CLEARED]);
    assert_eq!((a.cached_pages(), a.free_pages()), (0, 15));
    assert!(a.take_events().is_empty());
    a.check().unwrap();
}

#[test]
fn duplicate_registration_keeps_the_first_copy() {
    let mut a = pool(32, 2);
    let p = seq(4, 0);
    let (h, _) = a.open_with_prefix(&p, &[4], Counts::Each(0)).unwrap();
    let (h2, _) = a.open_with_prefix(&p, &[4], Counts::Each(0)).unwrap();
    a.extend(&[h[0], h2[0]], Counts::Each(4), None).unwrap();
    let first = a.pages(h[0]).unwrap();
    a.cache(&h).unwrap();
    a.take_events();
    a.cache(&h2).unwrap();
    assert!(
        a.take_events().is_empty(),
        "a duplicate is not stored again"
    );
    a.close(&[h[0], h2[0]], true).unwrap();
    assert_eq!(a.cached_pages(), 2);
    let (h3, c) = a
        .open_with_prefix(&[p.clone(), vec![9]].concat(), &[5], Counts::Each(0))
        .unwrap();
    assert_eq!(c, vec![4]);
    assert_eq!(a.pages(h3[0]).unwrap(), first);
    a.check().unwrap();
}

#[test]
fn metadata_settles_once_every_row_held_its_longest_prompt() {
    // A leak check (benchmarks/soak.py) reads metadata_bytes under churn: it
    // must not follow which row last took which prompt, or which call last
    // drained the copy queue.
    let mut a = pool(64, 4);
    let long = seq(40, 1000);
    let rows = 8;
    let (h, _) = a
        .open_with_prefix(&long.repeat(rows), &[40; 8], Counts::Each(0))
        .unwrap();
    a.close(&h, false).unwrap();
    // The index holds every page of the pool once (16 prompts of 16 pages
    // through a 63-page pool: registering evicts the oldest).
    for i in 0..16 {
        serve(&mut a, &seq(64, 10_000 * (i + 1)), 0);
    }
    a.clear_cache();
    let h = a.open(1).unwrap();
    a.extend(&h, Counts::Each(7), None).unwrap();
    let kids = a.fork(h[0], 6).unwrap();
    // The most copies one call below queues: six kids copy 3 slots each.
    a.extend(&kids, Counts::Each(1), None).unwrap();
    assert_eq!(a.pending_copies(), 18);
    let _ = a.take_copies();
    a.close(&h, false).unwrap();
    a.close(&kids, false).unwrap();
    let _ = a.take_events(); // a router drains them; undrained they pile up
    let settled = a.metadata_bytes();
    for round in 0..20usize {
        let short = seq(3 + round % 5, 7 * round as i64);
        let (p, _) = a
            .open_with_prefix(&short, &[short.len() as i64], Counts::Each(0))
            .unwrap();
        a.extend(&p, Counts::Each(short.len() as i64), None)
            .unwrap();
        let kids = a.fork(p[0], 1 + round % 6).unwrap();
        a.extend(&kids, Counts::Each(1), None).unwrap();
        let queued = a.metadata_bytes();
        let (src, _) = a.take_copies();
        assert_eq!(src.len(), kids.len() * (short.len() % 4));
        assert_eq!(
            a.metadata_bytes(),
            queued,
            "draining keeps the queue's memory"
        );
        a.close(&kids, true).unwrap();
        a.close(&p, true).unwrap();
        a.check().unwrap();
        let _ = a.take_events();
        assert_eq!(a.metadata_bytes(), settled, "round {round}");
    }
}

#[test]
fn fill_table_writes_the_slots_a_hit_or_a_fork_gave() {
    // Page 1 takes its own path (the page list is the row).
    for ps in [1, 4] {
        fill_table_case(ps);
    }
}

fn fill_table_case(ps: usize) {
    use kvpool_core::SlotTable;
    let mut a = pool(64, ps);
    let stride = 64 + 5; // max_context_len 64, a padded row
    let mut table = vec![-1i32; 8 * stride];
    let prompt = seq(13, 300);
    serve(&mut a, &prompt, 0);
    let (h, cached) = a.open_with_prefix(&prompt, &[13], Counts::Each(0)).unwrap();
    assert_eq!(cached, vec![12]);
    a.extend(&h, Counts::Each(1), None).unwrap();
    let kids = a.fork(h[0], 2).unwrap();
    let mut all = h.clone();
    all.extend(&kids);
    a.fill_table(&all, &mut SlotTable::new(&mut table, stride))
        .unwrap();
    for &x in &all {
        let row = kvpool_core::handle_row(x) as usize;
        let slots: Vec<i32> = a.slots(x).unwrap().iter().map(|&s| s as i32).collect();
        assert_eq!(&table[row * stride..row * stride + 13], &slots[..]);
        assert!(table[row * stride + 13..(row + 1) * stride]
            .iter()
            .all(|&t| t == -1));
    }
    // A closed handle anywhere, or a table too small, writes nothing.
    let before = table.clone();
    a.close(&kids[1..], false).unwrap();
    let err = a.fill_table(&all, &mut SlotTable::new(&mut table, stride));
    assert!(
        matches!(err, Err(PoolError::InvalidHandle { .. })),
        "{err:?}"
    );
    let mut small = vec![-1i32; 7 * stride + 63];
    let err = a.fill_table(&h, &mut SlotTable::new(&mut small, stride));
    assert!(matches!(err, Err(PoolError::InvalidArgument(_))), "{err:?}");
    assert_eq!(table, before);
    assert!(small.iter().all(|&t| t == -1));
}

#[test]
fn caching_a_prompt_and_its_forks_reserves_as_much_as_caching_the_prompt() {
    // cache() counts a page shared by n forked requests n times; what it
    // reserves (index entries, and event records that the log keeps) must
    // still be bounded by the pages that can be registered.
    let grown = |forks: usize| {
        let opts = Options {
            hash_seed: Some(7),
            ..Options::new()
        };
        let mut a = SlotAllocator::with_options(300, 1, 256, 256, opts).unwrap();
        let (h, _) = a
            .open_with_prefix(&seq(200, 0), &[200], Counts::Each(0))
            .unwrap();
        a.extend(&h, Counts::Each(200), None).unwrap();
        let mut all = h.clone();
        all.extend(a.fork(h[0], forks).unwrap());
        let before = a.metadata_bytes();
        a.cache(&all).unwrap();
        assert_eq!(a.cached_pages(), 200);
        a.metadata_bytes() - before
    };
    // Reservations are capped at the pool's 299 unregistered pages, so 200
    // forks may cost up to 299/200 of the prompt alone, never 201x.
    let (alone, with_forks) = (grown(0), grown(200));
    assert!(
        with_forks <= 2 * alone,
        "200 forks grew metadata by {with_forks} bytes, the prompt alone by {alone}"
    );
}
