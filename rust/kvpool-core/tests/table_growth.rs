//! The prefix index's key table growing past its first sizing (room for
//! TABLE_FLOOR_KEYS = 2^20 keys) in a pool of 2^20 + 2^16 pages at page
//! size 1: the growing `cache()` only allocates the new array, and later
//! calls drain the old one, 16 buckets per page they register
//! (`prefix/key_table/migrate.rs`). The pool is full when the table grows,
//! so the next admission evicts (keying and unkeying entries) while the
//! old array is still there; every round's prompts are then hit whole, and
//! `check()` (which compares the table with the slab) passes.

#![cfg(not(miri))]

use kvpool_core::{Counts, Options, SlotAllocator};

const ROWS: usize = 256;
const LEN: usize = 1024;
const PAGES: usize = (1 << 20) + (1 << 16);

/// Round `r`'s prompts, concatenated: distinct first tokens, so distinct chains.
fn prompts(r: usize) -> Vec<i64> {
    (0..ROWS)
        .flat_map(|row| {
            (0..LEN).map(move |i| match i {
                0 => (r * ROWS + row) as i64,
                _ => ((i * 31 + r * 7 + row) % 32000) as i64,
            })
        })
        .collect()
}

#[test]
fn a_growing_table_keeps_every_key_findable_while_the_pool_evicts() {
    let opts = Options {
        kv_events: false,
        ..Options::new()
    };
    let mut a = SlotAllocator::with_options(PAGES, 1, ROWS, LEN + 8, opts).unwrap();
    let counts = vec![LEN as i64; ROWS];
    let mut out = vec![-1i64; ROWS * LEN];
    let (mut grew, mut peak) = (0, 0);
    for r in 0..6 {
        let tokens = prompts(r);
        let mut h = Vec::with_capacity(ROWS);
        a.admit_into(&counts, Some(&tokens), &mut out, None, &mut h, |_| {})
            .unwrap();
        // One row per call, as an engine caches a request's prompt.
        for row in &h {
            let before = a.metadata_bytes();
            a.cache(std::slice::from_ref(row)).unwrap();
            if r > 0 {
                // (Round 0's first call maps the index's slab.)
                grew = grew.max(a.metadata_bytes().saturating_sub(before));
            }
            peak = peak.max(a.metadata_bytes());
        }
        a.close(&h, true).unwrap();
        a.check().unwrap();
        // This round's prompts are the last cached: hit whole (capped at
        // length - 1), from chains whose first pages the table files.
        let (h, cached) = a
            .open_with_prefix(&tokens, &counts, Counts::Each(0))
            .unwrap();
        assert!(cached.iter().all(|&c| c == LEN as i64 - 1), "round {r}");
        a.close(&h, false).unwrap();
        a.check().unwrap();
    }
    // The growing call added the 32 MiB array and kept the 16 MiB one (a
    // growth at once would have added 16 MiB); the drain ended, freeing it.
    assert!(
        grew >= 32 << 20,
        "cache() grew metadata by at most {grew} bytes"
    );
    assert!(
        a.metadata_bytes() + (16 << 20) <= peak,
        "the old array is still there"
    );
}
