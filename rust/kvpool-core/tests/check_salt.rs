//! `check()` finds a registration whose salt differs from its live parent's:
//! a hinted prefix walk does not read a child's salt (`lookup.rs`), so such
//! an entry could serve one tenant's KV to another.

use kvpool_core::{PoolError, SlotAllocator};

mod common;

use common::{pool, seq, serve};

/// A pool with one three-page chain (pages 1, 2, 3) registered under salt 5.
fn chain() -> SlotAllocator {
    let mut a = pool(32, 4);
    serve(&mut a, &seq(13, 40), 5);
    assert_eq!(a.cached_pages(), 3);
    a.check().unwrap();
    a
}

#[test]
fn check_reports_an_entry_salted_unlike_its_parent() {
    // The root (unlike its child), the middle (unlike both), the tail.
    for page in [1u32, 2, 3] {
        let mut a = chain();
        a.set_registration_salt_for_tests(page, 6).unwrap();
        match a.check() {
            Err(PoolError::Invariant(m)) => assert!(m.contains("salt"), "page {page}: {m}"),
            other => panic!("page {page}: check() gave {other:?}"),
        }
        // Put back, the chain is consistent again: the check read that field.
        a.set_registration_salt_for_tests(page, 5).unwrap();
        a.check().unwrap();
    }
}

#[test]
fn an_entry_whose_parent_is_gone_may_have_any_salt() {
    // Evicting the chain's tail first, then its middle, leaves the root
    // alone: nothing to disagree with.
    let mut a = chain();
    assert_eq!(a.evict(2), 2);
    a.set_registration_salt_for_tests(1, 6).unwrap();
    a.check().unwrap();
    assert!(matches!(
        a.set_registration_salt_for_tests(2, 6),
        Err(PoolError::InvalidArgument(_))
    ));
}
