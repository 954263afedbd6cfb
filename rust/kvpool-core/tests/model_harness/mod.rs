//! What the property test (`model.rs`) runs on besides the model: the
//! allocator it builds, how it compares a call's result with the model's,
//! and the slot table that extend_into_table writes.

use crate::reference::{kind, Kind, MAX_CTX, MAX_REQ};
use kvpool_core::{Grown, HostPolicy, Options, PoolError, SlotAllocator};

/// Asserts agreement; returns whether the call succeeded.
pub fn same<T: PartialEq + std::fmt::Debug>(
    real: Result<T, PoolError>,
    model: Result<T, Kind>,
) -> bool {
    match (real, model) {
        (Ok(a), Ok(b)) => {
            assert_eq!(a, b);
            return true;
        }
        (Err(e), Err(k)) => assert_eq!(kind(&e), k, "{e}"),
        (a, b) => panic!("allocator {a:?} but model {b:?}"),
    }
    false
}

/// Row stride of the test's slot table: wider than MAX_CTX, as KVPool pads.
pub const STRIDE: usize = MAX_CTX + 3;

/// What extend reported for one request: (row, start, moved, slots).
pub type Report = (usize, usize, usize, Vec<i64>);

pub fn report(g: &Grown<'_>) -> Report {
    (g.row, g.start, g.moved, g.slots.to_vec())
}

/// The slot table `before` with what a successful extend reported written
/// in: each request's new slots at its new positions, and the positions
/// copy-on-write moved onto the new page (the slots just before the first
/// new one).
pub fn table_after(before: &[i32], reports: &[Report]) -> Vec<i32> {
    let mut t = before.to_vec();
    for (row, start, moved, slots) in reports {
        let at = row * STRIDE + start;
        for (j, &s) in slots.iter().enumerate() {
            t[at + j] = s as i32;
        }
        for j in 0..*moved {
            t[at - moved + j] = (slots[0] - (moved - j) as i64) as i32;
        }
    }
    t
}

pub fn new_allocator(
    pages: usize,
    ps: usize,
    host: usize,
    policy: HostPolicy,
    max_pinned: usize,
) -> SlotAllocator {
    let opts = Options {
        generation_base: Some(1),
        host_pages: host,
        host_policy: policy,
        manual_clock: true,
        max_pinned_pages: Some(max_pinned),
        ..Options::new()
    };
    SlotAllocator::with_options(pages, ps, MAX_REQ, MAX_CTX, opts).unwrap()
}
