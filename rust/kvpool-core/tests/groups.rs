//! Layer groups: window release, cross-group prefix hits, state forks and
//! checkpoints, truncate refusals and restores, and refusals that change
//! nothing in any group.

use kvpool_core::{Counts, GroupKind, GroupSpec, GroupedAllocator, Options, PoolError};

const FULL: usize = 0;
const SLIDING: usize = 1;
const STATE: usize = 2;

fn opts() -> Options {
    Options {
        hash_seed: Some(7),
        handle_seed: Some(3),
        ..Options::new()
    }
}

fn pool(specs: &[GroupSpec]) -> GroupedAllocator {
    GroupedAllocator::new(specs, 8, 64, opts(), None).unwrap()
}

/// full (page 4), sliding (page 4, window 5: the last 4 positions), state.
fn hybrid(state_slots: usize) -> GroupedAllocator {
    pool(&[
        GroupSpec::full(64, 4),
        GroupSpec::sliding(64, 4, 5),
        GroupSpec::state(state_slots, 0),
    ])
}

fn seq(n: usize, from: i64) -> Vec<i64> {
    (from..from + n as i64).collect()
}

/// Opens `prompt[..start]` on whatever hits, then decodes the rest one
/// token at a time, caching after every step (as an engine does once the
/// step ran), and closes with cache. Returns the hit length.
fn serve(a: &mut GroupedAllocator, prompt: &[i64], start: usize) -> i64 {
    let (h, cached) = a
        .open_with_prefix(prompt, &[prompt.len() as i64], Counts::Each(0))
        .unwrap();
    let mut len = cached[0] as usize;
    if start > len {
        a.extend(
            &h,
            Counts::Each((start - len) as i64),
            Some(&prompt[len..start]),
            &mut [],
        )
        .unwrap();
        len = start;
        a.cache(&h).unwrap();
    }
    while len < prompt.len() {
        a.extend(&h, Counts::Each(1), Some(&prompt[len..len + 1]), &mut [])
            .unwrap();
        len += 1;
        a.cache(&h).unwrap();
        a.check().unwrap();
    }
    a.close(&h, true).unwrap();
    a.check().unwrap();
    for g in 0..a.num_groups() {
        a.take_copies(g).unwrap();
    }
    cached[0]
}

#[test]
fn the_anchor_is_the_full_group_whose_page_size_divides_the_others() {
    let a = pool(&[GroupSpec::sliding(64, 8, 5), GroupSpec::full(64, 4)]);
    assert_eq!(
        (a.anchor_group(), a.anchor_page_size(), a.hit_step()),
        (Some(1), 4, 8)
    );
    // No full group: a token-only anchor at the gcd of the page sizes.
    let b = pool(&[GroupSpec::sliding(64, 8, 5), GroupSpec::sliding(64, 12, 9)]);
    assert_eq!(
        (b.anchor_group(), b.anchor_page_size(), b.hit_step()),
        (None, 4, 24)
    );
    // A full group whose page size does not divide the others' is not one.
    let c = pool(&[GroupSpec::full(64, 8), GroupSpec::sliding(64, 4, 5)]);
    assert_eq!((c.anchor_group(), c.anchor_page_size()), (None, 4));
    let bad = |s: &[GroupSpec]| GroupedAllocator::new(s, 8, 64, opts(), None).unwrap_err();
    assert!(matches!(bad(&[]), PoolError::InvalidArgument(_)));
    assert!(matches!(
        bad(&[GroupSpec::sliding(64, 4, 0)]),
        PoolError::InvalidArgument(_)
    ));
    assert!(matches!(
        bad(&[GroupSpec::state(8, 0)]),
        PoolError::InvalidArgument(_)
    ));
    assert!(matches!(
        bad(&[GroupSpec::full(64, 4), GroupSpec::state(8, 6)]),
        PoolError::InvalidArgument(_)
    ));
    let st = GroupSpec {
        kind: GroupKind::State {
            checkpoint_every: 0,
        },
        num_pages: 8,
        page_size: 2,
    };
    assert!(matches!(bad(&[st]), PoolError::InvalidArgument(_)));
}

#[test]
fn extend_releases_the_pages_out_of_the_window() {
    let mut a = hybrid(8);
    let (h, _) = a.admit(&[10], Some(&seq(10, 1)), &mut []).unwrap();
    // A prefill from 0 releases nothing: its first token needs nothing before.
    assert_eq!(a.pages(SLIDING, h[0]).unwrap().len(), 3);
    assert!(a.pages(SLIDING, h[0]).unwrap().iter().all(|&p| p != 0));
    let free = a.free_pages(SLIDING).unwrap();
    // The next token (position 10) attends to positions 6..=10: page 0
    // (positions 0..4) is out.
    a.extend(&h, Counts::Each(1), None, &mut []).unwrap();
    let pages = a.pages(SLIDING, h[0]).unwrap();
    assert_eq!(pages[0], 0, "{pages:?}");
    assert!(pages[1..].iter().all(|&p| p != 0));
    assert_eq!(a.free_pages(SLIDING).unwrap(), free + 1);
    // Released positions read as the null page's slots.
    let slots = a.slots(SLIDING, h[0]).unwrap();
    assert_eq!(&slots[..4], &[0, 1, 2, 3]);
    assert!(slots[4..].iter().all(|&s| s >= 4));
    // The full group keeps everything.
    assert!(a.pages(FULL, h[0]).unwrap().iter().all(|&p| p != 0));
    a.check().unwrap();
    // Decode well past the window: at most window + one page of positions held.
    for _ in 0..40 {
        a.extend(&h, Counts::Each(1), None, &mut []).unwrap();
        a.check().unwrap();
        let len = a.length(h[0]).unwrap();
        let held = a
            .pages(SLIDING, h[0])
            .unwrap()
            .iter()
            .filter(|&&p| p != 0)
            .count();
        assert!(held * 4 <= 5 + 4, "{held} pages held at length {len}");
        let t = a.page_table(SLIDING, &h).unwrap();
        assert_eq!(t.indices.len(), held);
        assert_eq!(t.last_page_len, vec![((len - 1) % 4 + 1) as i32]);
    }
    assert_eq!(a.used_pages(SLIDING).unwrap(), 2);
    assert_eq!(a.used_pages(FULL).unwrap(), 13);
}

#[test]
fn a_long_chunk_keeps_what_its_first_token_attends_to() {
    let mut a = hybrid(8);
    let (h, _) = a.admit(&[8], None, &mut []).unwrap();
    // A chunk of 12 from position 8: its first token attends to 4..=8, so
    // only page 0 goes, though the chunk ends far past the window.
    a.extend(&h, Counts::Each(12), None, &mut []).unwrap();
    let pages = a.pages(SLIDING, h[0]).unwrap();
    assert_eq!(pages.iter().filter(|&&p| p == 0).count(), 1, "{pages:?}");
    a.extend(&h, Counts::Each(1), None, &mut []).unwrap();
    let pages = a.pages(SLIDING, h[0]).unwrap();
    assert_eq!(pages.iter().filter(|&&p| p == 0).count(), 4, "{pages:?}");
    a.check().unwrap();
}

#[test]
fn extend_counts_the_pages_its_window_releases() {
    // 3 usable sliding pages: a request holding all 3 can still cross a
    // page boundary, because the page its window leaves (position 12
    // attends to 4..=12: page 0 goes) is free again.
    let mut a = pool(&[GroupSpec::full(64, 4), GroupSpec::sliding(4, 4, 9)]);
    let (h, _) = a.admit(&[12], None, &mut []).unwrap();
    assert_eq!(a.free_pages(SLIDING).unwrap(), 0);
    a.extend(&h, Counts::Each(1), None, &mut []).unwrap();
    assert_eq!(a.free_pages(SLIDING).unwrap(), 0);
    a.check().unwrap();
}

#[test]
fn window_pages_released_registered_stay_cached() {
    let mut a = hybrid(8);
    let prompt = seq(24, 1);
    serve(&mut a, &prompt, 4);
    // Every full page of the sliding group was registered before its window
    // moved on: all six are cached, none held.
    assert_eq!(a.cached_pages(SLIDING).unwrap(), 6);
    assert_eq!(a.evictable_pages(SLIDING).unwrap(), 6);
    assert_eq!(a.used_pages(SLIDING).unwrap(), 0);
    // Checkpoints at 4, 8, ..., 24 (every = the hit step, 4).
    assert_eq!(a.cached_pages(STATE).unwrap(), 6);
}

#[test]
fn a_hit_needs_every_group_and_restores_the_state() {
    let mut a = hybrid(8);
    let prompt = seq(24, 1);
    assert_eq!(serve(&mut a, &prompt, 4), 0);
    let mut longer = prompt.clone();
    longer.push(99);
    let (h, cached) = a.open_with_prefix(&longer, &[25], Counts::Each(0)).unwrap();
    assert_eq!(cached, vec![24]);
    // The full group holds [0, 24), the sliding group its window [20, 24).
    assert!(a.pages(FULL, h[0]).unwrap().iter().all(|&p| p != 0));
    assert_eq!(
        a.pages(SLIDING, h[0])
            .unwrap()
            .iter()
            .filter(|&&p| p != 0)
            .count(),
        1
    );
    // The state slot is filled from the checkpoint at 24.
    let slot = a.state_slots(STATE, &h).unwrap()[0];
    let (src, dst) = a.take_copies(STATE).unwrap();
    assert_eq!(dst, vec![slot]);
    assert!(src[0] > 0);
    assert_eq!(a.hit_tokens(), 24);
    a.check().unwrap();
}

#[test]
fn an_evicted_full_page_stops_a_hit_the_sliding_group_could_serve() {
    let mut a = hybrid(8);
    let prompt = seq(24, 1);
    serve(&mut a, &prompt, 4);
    assert!(a.evictable_pages(SLIDING).unwrap() > 0);
    a.evict(FULL, 64).unwrap();
    let (_, cached) = a.open_with_prefix(&prompt, &[24], Counts::Each(0)).unwrap();
    assert_eq!(cached, vec![0]);
    a.check().unwrap();
}

#[test]
fn an_evicted_window_page_lowers_the_hit_to_a_window_still_cached() {
    let mut a = hybrid(8);
    let prompt = seq(24, 1);
    serve(&mut a, &prompt, 4);
    // LRU order of the sliding pages: 0, 1, 2, 3 (released as the window
    // moved), then 5, 4 (released last page first at close). Evicting five
    // leaves page 4, the window of a hit at 20.
    a.evict(SLIDING, 5).unwrap();
    let mut longer = prompt.clone();
    longer.push(99);
    let (h, cached) = a.open_with_prefix(&longer, &[25], Counts::Each(0)).unwrap();
    assert_eq!(cached, vec![20]);
    assert_eq!(a.length(h[0]).unwrap(), 20);
    a.check().unwrap();
}

#[test]
fn a_missing_checkpoint_lowers_the_hit() {
    let mut a = hybrid(8);
    let prompt = seq(24, 1);
    serve(&mut a, &prompt, 4);
    // The newest checkpoint (24) is the last evicted; LRU evicts 4..20 first.
    a.evict(STATE, 6).unwrap();
    let (_, cached) = a.open_with_prefix(&prompt, &[24], Counts::Each(0)).unwrap();
    // 24 needs a checkpoint, and so does every shorter length but 0.
    assert_eq!(cached, vec![0]);
    a.check().unwrap();
}

#[test]
fn fork_queues_a_state_copy_from_the_parent() {
    let mut a = hybrid(8);
    let h = a.open(1).unwrap();
    let s = a.state_slots(STATE, &h).unwrap()[0];
    assert_eq!(a.take_copies(STATE).unwrap(), (vec![-1], vec![s]));
    a.extend(&h, Counts::Each(6), None, &mut []).unwrap();
    let kids = a.fork(h[0], 2).unwrap();
    let ks = a.state_slots(STATE, &kids).unwrap();
    assert_eq!(a.take_copies(STATE).unwrap(), (vec![s, s], ks.clone()));
    // A fork of a fork not yet filled copies from where its parent's comes.
    let grand = a.fork(kids[0], 1).unwrap();
    let gs = a.state_slots(STATE, &grand).unwrap()[0];
    let k2 = a.fork(kids[1], 1).unwrap();
    let (src, dst) = a.take_copies(STATE).unwrap();
    assert_eq!(dst, vec![gs, a.state_slots(STATE, &k2).unwrap()[0]]);
    assert_eq!(src, vec![ks[0], ks[1]]);
    let g3 = a.fork(grand[0], 1).unwrap();
    let _ = a.fork(g3[0], 1).unwrap();
    let (src, _) = a.take_copies(STATE).unwrap();
    assert_eq!(
        src,
        vec![gs, gs],
        "sources resolve to the slot that holds the state"
    );
    // Pages are shared: a partly filled last page is copied on write.
    a.extend(&kids[..1], Counts::Each(1), None, &mut [])
        .unwrap();
    for g in [FULL, SLIDING] {
        let (src, dst) = a.take_copies(g).unwrap();
        assert_eq!(src.len(), 2, "group {g}");
        assert_eq!(dst.len(), 2);
    }
    a.check().unwrap();
}

#[test]
fn truncate_restores_state_only_from_a_checkpoint_at_that_length() {
    let mut a = hybrid(8);
    let (h, _) = a.admit(&[8], Some(&seq(8, 1)), &mut []).unwrap();
    a.cache(&h).unwrap();
    a.take_copies(STATE).unwrap();
    let live = a.state_slots(STATE, &h).unwrap()[0];
    a.extend(&h, Counts::Each(3), Some(&seq(3, 9)), &mut [])
        .unwrap();
    // No checkpoint at 9: refused, with nothing changed in any group.
    let full = a.pages(FULL, h[0]).unwrap();
    let e = a.truncate(&h, Counts::Each(9)).unwrap_err();
    assert!(
        matches!(&e, PoolError::RollbackUnavailable(r) if r.group == STATE && r.length == 9),
        "{e}"
    );
    assert_eq!(a.length(h[0]).unwrap(), 11);
    assert_eq!(a.pages(FULL, h[0]).unwrap(), full);
    // The checkpoint at 8 restores the slot in place by a queued copy.
    a.truncate(&h, Counts::Each(8)).unwrap();
    let (src, dst) = a.take_copies(STATE).unwrap();
    assert_eq!(dst, vec![live]);
    assert!(src[0] > 0 && src[0] != live);
    // The current length changes nothing; 0 is the empty state.
    a.truncate(&h, Counts::Each(8)).unwrap();
    assert_eq!(a.pending_copies(STATE).unwrap(), 0);
    a.truncate(&h, Counts::Each(0)).unwrap();
    assert_eq!(a.take_copies(STATE).unwrap(), (vec![-1], vec![live]));
    a.check().unwrap();
}

#[test]
fn truncate_into_a_released_window_is_refused() {
    let mut a = hybrid(8);
    let (h, _) = a.admit(&[4], None, &mut []).unwrap();
    for _ in 0..8 {
        a.extend(&h, Counts::Each(1), None, &mut []).unwrap();
    }
    // Length 12 holds positions 7.. (page 1 on); 10 needs 6.. (page 1): ok;
    // 6 needs 2.. (page 0), released.
    let e = a.truncate(&h, Counts::Each(6)).unwrap_err();
    assert!(
        matches!(&e, PoolError::RollbackUnavailable(r) if r.group == SLIDING),
        "{e}"
    );
    assert_eq!(a.length(h[0]).unwrap(), 12);
    a.truncate(&h, Counts::Each(12)).unwrap();
    // A state rollback has no checkpoint either: the sliding group is named
    // first (group order).
    let e = a.truncate(&h, Counts::Each(10)).unwrap_err();
    assert!(
        matches!(&e, PoolError::RollbackUnavailable(r) if r.group == STATE),
        "{e}"
    );
    a.check().unwrap();
}

/// Everything observable of a pool, to compare before and after a refusal.
fn snapshot(a: &GroupedAllocator, handles: &[i64]) -> Vec<String> {
    let mut out = vec![format!("open {}", a.open_requests())];
    for g in 0..a.num_groups() {
        out.push(format!(
            "g{g} free {} used {} cached {} evictable {} copies {}",
            a.free_pages(g).unwrap(),
            a.used_pages(g).unwrap(),
            a.cached_pages(g).unwrap(),
            a.evictable_pages(g).unwrap(),
            a.pending_copies(g).unwrap()
        ));
        for &h in handles {
            match a.group_spec(g).unwrap().kind {
                GroupKind::State { .. } => {
                    out.push(format!("{h} {:?}", a.state_slots(g, &[h]).unwrap()))
                }
                _ => out.push(format!("{h} {:?}", a.slots(g, h).unwrap())),
            }
        }
    }
    out
}

#[test]
fn a_refusal_in_the_last_group_leaves_the_first_ones_unchanged() {
    // The state group (last) has 2 usable slots.
    let mut a = hybrid(3);
    let h = a.open(2).unwrap();
    a.extend(&h, Counts::Each(5), None, &mut []).unwrap();
    let before = snapshot(&a, &h);
    for e in [
        a.open(1).unwrap_err(),
        a.admit(&[3], None, &mut []).unwrap_err(),
        a.fork(h[0], 1).unwrap_err(),
        a.open_with_prefix(&seq(5, 1), &[5], Counts::Each(0))
            .unwrap_err(),
    ] {
        assert!(
            matches!(&e, PoolError::GroupExhausted(x) if x.group == STATE),
            "{e}"
        );
        assert_eq!(snapshot(&a, &h), before);
        a.check().unwrap();
    }
    // The handles the refused calls did not issue are still the next ones.
    a.close(&h[1..], false).unwrap();
    let next = a.open(1).unwrap();
    assert_eq!(next[0] & 0xFFFF_FFFF, h[1] & 0xFFFF_FFFF);

    // A sliding group (last) short of pages refuses an extend the full
    // group could take.
    let mut b = pool(&[GroupSpec::full(64, 4), GroupSpec::sliding(3, 4, 9)]);
    let (h, _) = b.admit(&[8], None, &mut []).unwrap();
    let before = snapshot(&b, &h);
    let e = b.extend(&h, Counts::Each(1), None, &mut []).unwrap_err();
    assert!(
        matches!(&e, PoolError::GroupExhausted(x) if x.group == 1),
        "{e}"
    );
    assert_eq!(snapshot(&b, &h), before);
    b.check().unwrap();
}

#[test]
fn an_all_sliding_pool_hits_through_its_token_only_anchor() {
    let mut a = pool(&[GroupSpec::sliding(64, 4, 5), GroupSpec::sliding(64, 8, 9)]);
    assert_eq!(a.anchor_group(), None);
    let prompt = seq(33, 1);
    assert_eq!(serve(&mut a, &prompt, 8), 0);
    let (h, cached) = a.open_with_prefix(&prompt, &[33], Counts::Each(0)).unwrap();
    assert_eq!(cached, vec![32]);
    assert_eq!(a.known_tokens(h[0]).unwrap().len(), 32);
    // The token-only anchor is group 2 in errors.
    let mut b =
        GroupedAllocator::new(&[GroupSpec::sliding(64, 4, 5)], 4, 64, opts(), Some(3)).unwrap();
    let e = b.admit(&[9], None, &mut []).unwrap_err();
    assert!(
        matches!(&e, PoolError::GroupExhausted(x) if x.group == 1 && x.kind == "anchor"),
        "{e}"
    );
    a.check().unwrap();
}

#[test]
fn a_hit_never_serves_other_tokens_under_collisions() {
    // Two bits of hash: nearly every page collides in the anchor's index.
    let o = Options {
        weak_hash_bits: 2,
        ..opts()
    };
    let mut a = GroupedAllocator::new(
        &[
            GroupSpec::full(256, 2),
            GroupSpec::sliding(256, 2, 3),
            GroupSpec::state(64, 2),
        ],
        8,
        64,
        o,
        None,
    )
    .unwrap();
    let prompts: Vec<Vec<i64>> = (0..12)
        .map(|i| (0..13).map(|j| ((i * 7 + j * 3) % 4) as i64).collect())
        .collect();
    for p in &prompts {
        serve(&mut a, p, 2);
    }
    for p in &prompts {
        let (h, cached) = a.open_with_prefix(p, &[13], Counts::Each(0)).unwrap();
        let n = cached[0] as usize;
        assert_eq!(
            a.known_tokens(h[0]).unwrap(),
            p[..n].iter().map(|&t| t as i32).collect::<Vec<_>>()
        );
        a.close(&h, false).unwrap();
    }
    a.check().unwrap();
}
