//! What the property test (`model.rs`) runs on besides the model: the
//! allocator it builds, how it compares a call's result with the model's,
//! the slot table that extend_into_table writes, and the state that must
//! agree with the model's after every op.

use crate::model_coverage::{count, HELD_ALONE};
use crate::reference::{Model, MAX_CTX, MAX_REQ};
use kvpool_core::{Grown, HostPolicy, Options, PoolError, SlotAllocator};
use proptest::prelude::*;

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

/// After every op: the allocator's queued transfers, page counters of both
/// tiers and hit counts agree with the model's, and so does every issued
/// handle (slots, length, known tokens; open, swapped out or neither).
pub fn agrees(a: &SlotAllocator, m: &Model, issued: &[i64]) -> Result<(), TestCaseError> {
    prop_assert_eq!(a.pending_copies(), m.pending_copies());
    {
        // The queued transfers themselves, not taken.
        let mut b = a.clone();
        let t = m.tier.as_ref();
        let offloads: Vec<(i64, i64)> = t.map_or(vec![], |t| {
            t.offloads
                .iter()
                .map(|&(d, h)| (d as i64, h as i64))
                .collect()
        });
        let loads: Vec<(i64, i64)> = t.map_or(vec![], |t| {
            t.loads.iter().map(|&(h, d)| (h as i64, d as i64)).collect()
        });
        let (d, hp) = b.take_offloads();
        prop_assert_eq!(d.into_iter().zip(hp).collect::<Vec<_>>(), offloads);
        let (hp, d) = b.take_loads();
        prop_assert_eq!(hp.into_iter().zip(d).collect::<Vec<_>>(), loads);
    }
    // A queued copy whose source no request holds any more: only
    // the queue keeps that page from the free stack.
    let alone = m
        .queue
        .iter()
        .filter(|c| m.reqs.values().all(|r| !r.pages.contains(&c.src)))
        .count();
    count(&HELD_ALONE, alone);
    prop_assert_eq!(a.free_pages(), m.free.len() + m.evictable());
    prop_assert_eq!(a.evictable_pages(), m.evictable());
    prop_assert_eq!(a.pinned_pages(), m.pinned());
    prop_assert_eq!(a.evictable_pages_by_priority(), m.by_priority());
    prop_assert_eq!(
        a.capacity_pages() - a.free_pages() - a.used_pages(),
        m.lru.len() - m.evictable()
    );
    prop_assert_eq!(a.cached_pages(), m.device_registered());
    prop_assert_eq!((a.hit_tokens(), a.miss_tokens()), (m.hit, m.miss));
    prop_assert_eq!(a.open_requests(), m.reqs.len());
    prop_assert_eq!(a.host_free_pages(), m.host_free_pages());
    prop_assert_eq!(a.host_cached_pages(), m.host_registered());
    if let Some(t) = m.tier.as_ref() {
        prop_assert_eq!(
            (a.host_hit_tokens(), a.offloaded_pages(), a.loaded_pages()),
            (t.hit, t.offloaded, t.loaded)
        );
    }
    for &hh in issued {
        match m.row(hh) {
            Some(r) if m.reqs[&r].swapped => {
                prop_assert_eq!(a.is_swapped(hh), Ok(true));
                let refused = matches!(a.slots(hh), Err(PoolError::RequestSwappedOut { .. }));
                prop_assert!(refused, "slots of a swapped-out request");
                prop_assert_eq!(a.length(hh).unwrap(), m.reqs[&r].len());
                prop_assert_eq!(a.known_tokens(hh).unwrap(), m.reqs[&r].known());
            }
            Some(r) => {
                prop_assert_eq!(a.slots(hh).unwrap(), m.slots(r));
                prop_assert_eq!(a.length(hh).unwrap(), m.reqs[&r].len());
                prop_assert_eq!(a.known_tokens(hh).unwrap(), m.reqs[&r].known());
            }
            None => prop_assert!(!a.is_open(hh)),
        }
    }
    Ok(())
}
