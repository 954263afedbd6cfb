//! A pool's construction bounds: bad configurations refused, the metadata
//! its limits cost, and reservations that fail typed instead of aborting.

use super::*;

#[test]
fn bad_configs_are_rejected() {
    for (p, ps, r, c) in [
        (0, 1, 1, 1),
        (1, 1, 1, 1), // only the reserved page: nothing to hand out
        (2, 0, 1, 1),
        (2, 1, 0, 1),
        (2, 1, 1, 0),
        (1 << 31, 1, 1, 1),
    ] {
        assert!(matches!(
            SlotAllocator::new(p, ps, r, c),
            Err(PoolError::InvalidArgument(_))
        ));
    }
    assert_eq!(SlotAllocator::new(2, 1, 1, 1).unwrap().capacity_pages(), 1);
}

#[test]
fn metadata_is_the_documented_worst_case_and_does_not_grow() {
    // Page lists are one flat [max_requests, pages per request] array: a
    // row grown token by token never reallocates, and a 3000-token bound
    // costs ceil(3000 / 16) = 188 entries per row (padded to 208 to stagger
    // rows across cache sets), not a Vec's growth slack.
    let (pages, ps, rows, ctx) = (1 << 12, 16, 64, 3000);
    let mut a = SlotAllocator::new(pages, ps, rows, ctx).unwrap();
    let before = a.metadata_bytes();
    let h = a.open(64).unwrap();
    for _ in 0..40 {
        a.extend(&h, Counts::Each(1), None).unwrap();
    }
    a.close(&h, false).unwrap();
    assert_eq!(a.metadata_bytes(), before, "metadata grew with use");
    let per_page = 16 + 4; // state record (refcount, registration, LRU links), free stack
    let want = pages * per_page - 4 // the free stack has no entry for page 0
        + pages.div_ceil(8) * 4 // a block holder count per eight pages (`pages/blocks.rs`)
        + pages * ps * 4 // token id per slot
        + rows * 4 * 2 // free row stack, known token counts
        + rows * (192 + 16) * 4 // page lists: 188 rounded to a cache line, plus one
        + rows * (16 + std::mem::size_of::<crate::requests::row::RowCold>())
        + crate::prefix::index::LOOKAHEAD * 16; // chain hashes ahead of probes
    assert_eq!(before, want);
}

#[test]
fn fallible_reservations_fail_typed() {
    // 2^20 rows * 2^28 / 1 pages per row: far past memory, must not abort.
    let e = SlotAllocator::new(2, 1, MAX_REQUESTS, MAX_CONTEXT_LEN).unwrap_err();
    assert!(
        matches!(e, PoolError::InvalidArgument(ref m) if m.contains("cannot allocate")),
        "{e}"
    );
    for (r, c) in [
        (MAX_REQUESTS + 1, 1),
        (1, MAX_CONTEXT_LEN + 1),
        ((1 << 31) - 1, 16),
    ] {
        let e = SlotAllocator::new(4, 1, r, c).unwrap_err();
        assert!(
            matches!(e, PoolError::InvalidArgument(ref m) if m.contains("must be in")),
            "{e}"
        );
    }
    let mut a = alloc(4, 1);
    for n in [5usize, 1 << 33, 1 << 62, usize::MAX] {
        assert!(matches!(
            a.open(n).unwrap_err(),
            PoolError::TooManyRequests { .. }
        ));
    }
    a.check().unwrap();
}
