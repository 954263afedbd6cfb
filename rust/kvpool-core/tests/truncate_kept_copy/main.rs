//! A truncation whose last page kept duplicated content another request
//! cached: request B computed A's prompt apart, so B's `cache()` kept A's
//! copies and B's chain (and cached prefix) runs through A's entries.
//! Truncating B keeps that chain in the pages kept, so `unpin(B)` still
//! reaches the kept copies and B's next pages register under them; and
//! where the kept copy goes before B's next call (A closes, eviction takes
//! it, another request may take its entry or register the same content
//! anew), nothing uses its stale registration: the walk stops or finds the
//! copy the index keeps now, and the next `cache()` restarts the chain.
//!
//! `basic`: those cases; `more`: a walk after a removal elsewhere, forks,
//! partial eviction, truncating twice, a host tier, a grouped fork.

use kvpool_core::{Counts, HostPolicy, Options, SlotAllocator};

mod basic;
mod more;

const PROMPT: [i64; 3] = [2000, 2001, 2002];

/// Page size 1, 20 pages, a manual clock, at most 10 pins; with `host`, a
/// write-back host tier of 64 pages.
fn pool(host: bool) -> SlotAllocator {
    let mut opts = Options {
        hash_seed: Some(1),
        manual_clock: true,
        max_pinned_pages: Some(10),
        ..Options::new()
    };
    if host {
        opts.host_pages = 64;
        opts.host_policy = HostPolicy::WriteBack;
    }
    SlotAllocator::with_options(20, 1, 8, 64, opts).unwrap()
}

/// A caches PROMPT; B computes it apart and caches it (the index keeps A's
/// copies); A's pages get `prio` (100 pins). Returns (A, B).
fn duplicated_prefix(a: &mut SlotAllocator, prio: i64) -> (i64, i64) {
    let (ha, _) = a.admit(&[3], Some(&PROMPT)).unwrap();
    a.cache(&ha).unwrap();
    let (hb, _) = a.admit(&[3], Some(&PROMPT)).unwrap();
    a.cache(&hb).unwrap();
    a.cache_with_priority(&ha, Counts::Each(prio), None)
        .unwrap();
    a.check().unwrap();
    (ha[0], hb[0])
}

/// The tokens a prompt of `tokens` hits (a request opened and closed).
fn hit(a: &mut SlotAllocator, tokens: &[i64]) -> i64 {
    let (h, c) = a
        .open_with_prefix(tokens, &[tokens.len() as i64], Counts::Each(0))
        .unwrap();
    a.close(&h, false).unwrap();
    a.check().unwrap();
    c[0]
}
