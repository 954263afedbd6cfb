//! `GroupedAllocator::roll_back_extend`: `truncate` in every group that
//! keeps each request's prompt, so the positions it gives back are
//! registered again, in every group, once they are recomputed.

use kvpool_core::{Counts, GroupSpec, GroupedAllocator, Options, PoolError};

const FULL: usize = 0;
const SLIDING: usize = 1;
const STATE: usize = 1;

fn pool(specs: &[GroupSpec]) -> GroupedAllocator {
    let opts = Options {
        hash_seed: Some(7),
        handle_seed: Some(3),
        ..Options::new()
    };
    GroupedAllocator::new(specs, 8, 64, opts, None).unwrap()
}

/// full (page 4) and state (checkpoints every 4 tokens).
fn full_and_state() -> GroupedAllocator {
    pool(&[GroupSpec::full(64, 4), GroupSpec::state(16, 0)])
}

fn seq(n: usize, from: i64) -> Vec<i64> {
    (from..from + n as i64).collect()
}

fn ids(v: &[i64]) -> Vec<i32> {
    v.iter().map(|&t| t as i32).collect()
}

fn drain(a: &mut GroupedAllocator) {
    for g in 0..a.num_groups() {
        a.take_copies(g).unwrap();
    }
}

/// Prefills `prompt[..at]` then the rest in one step, caching after each
/// (checkpoints at `at` and at the prompt's end), and closes with cache.
fn serve(a: &mut GroupedAllocator, prompt: &[i64], at: usize) {
    let (h, _) = a.admit(&[at as i64], Some(&prompt[..at]), &mut []).unwrap();
    a.cache(&h).unwrap();
    let rest = prompt.len() - at;
    a.extend(&h, Counts::Each(rest as i64), Some(&prompt[at..]), &mut [])
        .unwrap();
    a.cache(&h).unwrap();
    a.close(&h, true).unwrap();
    drain(a);
    a.check().unwrap();
}

/// The hit of a fresh request on `prompt` (closed again).
fn hit(a: &mut GroupedAllocator, prompt: &[i64]) -> i64 {
    let (h, cached) = a
        .open_with_prefix(prompt, &[prompt.len() as i64], Counts::Each(0))
        .unwrap();
    a.close(&h, false).unwrap();
    drain(a);
    cached[0]
}

#[test]
fn a_hit_cut_back_keeps_its_prompt_and_publishes_it_again() {
    let mut a = full_and_state();
    let prompt = seq(16, 1);
    serve(&mut a, &prompt, 8);
    let mut probe = prompt.clone();
    probe.push(99);
    let (h, cached) = a.open_with_prefix(&probe, &[17], Counts::Each(0)).unwrap();
    assert_eq!(cached, vec![16]);
    drain(&mut a);
    a.roll_back_extend(&h, Counts::Each(8)).unwrap();
    assert_eq!(a.length(h[0]).unwrap(), 8);
    // The state is the checkpoint at the cut, restored in the live slot.
    let live = a.state_slots(STATE, &h).unwrap()[0];
    let (src, dst) = a.take_copies(STATE).unwrap();
    assert_eq!(dst, vec![live]);
    assert!(src[0] > 0 && src[0] != live);
    a.check().unwrap();
    // Nothing of the prompt past the cut stays cached: the pages and the
    // checkpoint at 16 must come from the recomputed positions.
    a.evict(FULL, 64).unwrap();
    a.evict(STATE, 16).unwrap();
    assert_eq!(a.evictable_pages(FULL).unwrap(), 0);
    assert_eq!(a.evictable_pages(STATE).unwrap(), 0);
    // Ids that are not the prompt's are refused; the prompt's are taken.
    let e = a.extend(&h, Counts::Each(1), Some(&[7]), &mut []);
    assert!(matches!(e, Err(PoolError::InvalidArgument(_))), "{e:?}");
    a.extend(&h, Counts::Each(8), None, &mut []).unwrap();
    assert_eq!(a.known_tokens(h[0]).unwrap(), ids(&prompt));
    a.cache(&h).unwrap();
    a.close(&h, true).unwrap();
    drain(&mut a);
    a.check().unwrap();
    assert_eq!(hit(&mut a, &probe), 16);
}

#[test]
fn truncate_forgets_the_prompt_where_roll_back_keeps_it() {
    // The same steps with truncate: the recomputed positions are unknown,
    // so neither the pages past the cut nor a checkpoint at 16 are
    // registered again (and the checkpoint at 8 was evicted: no hit).
    let mut a = full_and_state();
    let prompt = seq(16, 1);
    serve(&mut a, &prompt, 8);
    let mut probe = prompt.clone();
    probe.push(99);
    let (h, _) = a.open_with_prefix(&probe, &[17], Counts::Each(0)).unwrap();
    a.truncate(&h, Counts::Each(8)).unwrap();
    drain(&mut a);
    a.evict(FULL, 64).unwrap();
    a.evict(STATE, 16).unwrap();
    a.extend(&h, Counts::Each(8), None, &mut []).unwrap();
    assert_eq!(a.known_tokens(h[0]).unwrap(), ids(&prompt[..8]));
    a.cache(&h).unwrap();
    a.close(&h, true).unwrap();
    drain(&mut a);
    assert_eq!(hit(&mut a, &probe), 0);
}

#[test]
fn a_roll_back_a_group_cannot_serve_is_refused_and_changes_nothing() {
    // No checkpoint at 12 (the prompt was prefilled 8 then 8): the state
    // group refuses, and the request keeps its length, pages and prompt.
    let mut a = full_and_state();
    let prompt = seq(16, 1);
    serve(&mut a, &prompt, 8);
    let mut probe = prompt.clone();
    probe.push(99);
    let (h, _) = a.open_with_prefix(&probe, &[17], Counts::Each(0)).unwrap();
    drain(&mut a);
    let pages = a.pages(FULL, h[0]).unwrap();
    let e = a.roll_back_extend(&h, Counts::Each(12)).unwrap_err();
    assert!(
        matches!(&e, PoolError::RollbackUnavailable(r) if r.group == STATE && r.length == 12),
        "{e}"
    );
    assert_eq!(a.length(h[0]).unwrap(), 16);
    assert_eq!(a.pages(FULL, h[0]).unwrap(), pages);
    assert_eq!(a.pending_copies(STATE).unwrap(), 0);
    // truncate's argument errors, with nothing changed.
    let e = a.roll_back_extend(&h, Counts::Each(17)).unwrap_err();
    assert!(matches!(e, PoolError::InvalidArgument(_)), "{e}");
    let e = a
        .roll_back_extend(&[h[0], h[0]], Counts::Each(8))
        .unwrap_err();
    assert!(matches!(e, PoolError::InvalidArgument(_)), "{e}");
    let e = a
        .roll_back_extend(&[h[0] ^ 1 << 40], Counts::Each(8))
        .unwrap_err();
    assert!(matches!(e, PoolError::InvalidHandle { .. }), "{e}");
    assert_eq!(a.length(h[0]).unwrap(), 16);
    a.check().unwrap();
    // Back to 0 always works (the empty state), and keeps the prompt.
    a.roll_back_extend(&h, Counts::Each(0)).unwrap();
    assert_eq!(a.take_copies(STATE).unwrap().0, vec![-1]);
    let e = a.extend(&h, Counts::Each(1), Some(&[7]), &mut []);
    assert!(matches!(e, Err(PoolError::InvalidArgument(_))), "{e:?}");
    a.extend(&h, Counts::Each(4), None, &mut []).unwrap();
    assert_eq!(a.known_tokens(h[0]).unwrap(), ids(&probe[..4]));
    a.check().unwrap();
}

#[test]
fn a_sliding_window_takes_back_the_cached_pages_it_released() {
    // A hit holds only its window in a sliding group; going back to a
    // length whose window it released takes those pages back from the
    // cache (filed under the request's own anchor chain).
    let mut a = pool(&[GroupSpec::full(64, 4), GroupSpec::sliding(64, 4, 5)]);
    let prompt = seq(16, 1);
    serve(&mut a, &prompt, 8);
    let mut probe = prompt.clone();
    probe.push(99);
    let (h, cached) = a.open_with_prefix(&probe, &[17], Counts::Each(0)).unwrap();
    assert_eq!(cached, vec![16]);
    let held = |a: &GroupedAllocator| {
        a.pages(SLIDING, h[0])
            .unwrap()
            .iter()
            .filter(|&&p| p != 0)
            .count()
    };
    assert_eq!(held(&a), 1);
    let evictable = a.evictable_pages(SLIDING).unwrap();
    // Length 8 attends back to position 4: page 1, released before the hit.
    a.roll_back_extend(&h, Counts::Each(8)).unwrap();
    let pages = a.pages(SLIDING, h[0]).unwrap();
    assert!(pages[0] == 0 && pages[1] != 0, "{pages:?}");
    // Page 1 is held again, page 3 (past the cut) went back to the cache.
    assert_eq!(a.evictable_pages(SLIDING).unwrap(), evictable);
    a.check().unwrap();
    a.extend(&h, Counts::Each(8), None, &mut []).unwrap();
    a.cache(&h).unwrap();
    a.close(&h, true).unwrap();
    a.check().unwrap();
    assert_eq!(hit(&mut a, &probe), 16);

    // Once the released page is evicted, the same roll-back is refused with
    // nothing changed, and back to 0 (no window to hold) still works.
    let (h, _) = a.open_with_prefix(&probe, &[17], Counts::Each(0)).unwrap();
    a.evict(SLIDING, 64).unwrap();
    let before = (
        a.pages(FULL, h[0]).unwrap(),
        a.pages(SLIDING, h[0]).unwrap(),
    );
    let e = a.roll_back_extend(&h, Counts::Each(8)).unwrap_err();
    assert!(
        matches!(&e, PoolError::RollbackUnavailable(r) if r.group == SLIDING && r.length == 8),
        "{e}"
    );
    let e = a.truncate(&h, Counts::Each(8)).unwrap_err();
    assert!(matches!(&e, PoolError::RollbackUnavailable(_)), "{e}");
    assert_eq!(
        (
            a.pages(FULL, h[0]).unwrap(),
            a.pages(SLIDING, h[0]).unwrap()
        ),
        before
    );
    a.check().unwrap();
    a.roll_back_extend(&h, Counts::Each(0)).unwrap();
    a.evict(FULL, 64).unwrap();
    a.extend(&h, Counts::Each(16), None, &mut []).unwrap();
    a.cache(&h).unwrap();
    a.close(&h, true).unwrap();
    a.check().unwrap();
    assert_eq!(hit(&mut a, &probe), 16);
}
