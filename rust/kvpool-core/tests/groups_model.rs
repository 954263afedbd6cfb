//! Property test of layer groups: random pools (full, sliding and state
//! groups with their own page sizes, with or without a token-only anchor)
//! and random operation sequences, run against `GroupedAllocator` and the
//! naive model in `groups_reference/`. Results, errors (kind and group),
//! every group's slots, state slots, counters and queued copies must agree,
//! and check() must pass after every operation.

mod cases;
mod groups_reference;
// Only its prompts are used here.
#[allow(dead_code)]
mod model_ops;
mod reference;

use groups_reference::{GGroup, GKind, GModel};
use kvpool_core::{Counts, GroupKind, GroupSpec, GroupedAllocator, Options};
use model_ops::prompt;
use proptest::prelude::*;
use reference::{same, Kind, MAX_CTX, MAX_REQ};
use std::cell::Cell;

#[derive(Debug, Clone)]
enum Op {
    Open(usize),
    OpenPrefix(Vec<(usize, usize, bool)>, i64),
    /// A served request: open a prompt on its hit, prefill the rest one
    /// token at a time with cache() after each step, close with cache.
    Serve((usize, usize, bool), i64),
    Extend(Vec<(usize, i64)>, Option<u8>),
    /// Decode one token each, then cache them (a served step).
    Step(Vec<usize>, u8),
    Admit(Vec<i64>),
    Truncate(Vec<(usize, i64)>),
    /// Truncate by `back` tokens.
    Back(usize, usize),
    /// Truncate to the last position a state group kept a checkpoint of
    /// the request's prefix at (as a rejected draft would).
    Rewind(usize),
    Close(Vec<usize>, bool),
    Cache(Vec<usize>),
    Fork(usize, usize),
    Evict(usize, usize),
    ClearCache,
    Drain(usize),
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    let pick = 0usize..16;
    let value = prop_oneof![1 => Just(-1i64), 12 => 0i64..7];
    let prompt = (0usize..2, 0usize..14, prop::bool::weighted(0.2));
    prop_oneof![
        2 => (0usize..3).prop_map(Op::Open),
        5 => (prop::collection::vec(prompt.clone(), 0..3), 0i64..2).prop_map(|(p, s)| Op::OpenPrefix(p, s)),
        5 => (prompt, 0i64..2).prop_map(|(p, s)| Op::Serve(p, s)),
        4 => (prop::collection::vec((pick.clone(), value.clone()), 0..4), prop::option::of(any::<u8>())).prop_map(|(v, t)| Op::Extend(v, t)),
        6 => (prop::collection::vec(pick.clone(), 1..4), any::<u8>()).prop_map(|(v, s)| Op::Step(v, s)),
        2 => prop::collection::vec(0i64..6, 0..3).prop_map(Op::Admit),
        2 => prop::collection::vec((pick.clone(), value), 0..3).prop_map(Op::Truncate),
        3 => (pick.clone(), 0usize..5).prop_map(|(p, b)| Op::Back(p, b)),
        5 => pick.clone().prop_map(Op::Rewind),
        3 => (prop::collection::vec(pick.clone(), 1..3), prop::bool::weighted(0.75)).prop_map(|(v, c)| Op::Close(v, c)),
        3 => prop::collection::vec(pick.clone(), 0..3).prop_map(Op::Cache),
        2 => (pick, 1usize..3).prop_map(|(p, n)| Op::Fork(p, n)),
        1 => (0usize..4, 0usize..4).prop_map(|(g, n)| Op::Evict(g, n)),
        1 => Just(Op::ClearCache),
        2 => (0usize..4).prop_map(Op::Drain),
        1 => Just(Op::Reset),
    ]
}

/// A pool: each group (kind, num_pages, page size), and the token-only
/// anchor's pages (used when no full group is the anchor).
type Layout = (Vec<(GKind, usize, usize)>, usize);

fn group() -> impl Strategy<Value = (GKind, usize, usize)> {
    prop_oneof![
        3 => (2usize..14, 1usize..4).prop_map(|(n, ps)| (GKind::Full, n, ps)),
        3 => (2usize..14, 1usize..4, 1usize..6).prop_map(|(n, ps, w)| (GKind::Sliding(w), n, ps)),
        2 => (2usize..10, prop_oneof![Just(0usize), Just(1), Just(2)]).prop_map(|(n, e)| (GKind::State(e), n, 1)),
    ]
}

fn layout() -> impl Strategy<Value = Layout> {
    let any = (
        prop::collection::vec(group(), 1..4),
        prop_oneof![Just(100usize), 3usize..12],
    )
        .prop_filter("a page group", |(g, _)| {
            g.iter().any(|s| !matches!(s.0, GKind::State(_)))
        });
    // The hybrid shape of the issue: full, sliding and state groups.
    let hybrid =
        (4usize..14, 1usize..3, 4usize..14, 1usize..6, 3usize..10).prop_map(|(f, ps, s, w, st)| {
            (
                vec![
                    (GKind::Full, f, ps),
                    (GKind::Sliding(w), s, ps),
                    (GKind::State(0), st, 1),
                ],
                100,
            )
        });
    prop_oneof![any, hybrid]
}

fn spec(s: &(GKind, usize, usize)) -> GroupSpec {
    match s.0 {
        GKind::Full => GroupSpec::full(s.1, s.2),
        GKind::Sliding(w) => GroupSpec::sliding(s.1, s.2, w),
        GKind::State(e) => GroupSpec::state(s.1, e),
    }
}

/// Builds both, or None where the allocator refuses the layout (a
/// checkpoint interval that is not a multiple of the anchor page size).
/// Without KV events the anchor's index keys by its internal chain
/// (`prefix/hashing.rs`): the model holds either way.
fn build(l: &Layout, events: bool) -> Option<(GroupedAllocator, GModel)> {
    let specs: Vec<GroupSpec> = l.0.iter().map(spec).collect();
    let opts = Options {
        generation_base: Some(1),
        kv_events: events,
        ..Options::new()
    };
    let a = GroupedAllocator::new(&specs, MAX_REQ, MAX_CTX, opts, Some(l.1)).ok()?;
    Some((a, GModel::new(&l.0, l.1)))
}

fn case_count() -> u32 {
    cases::from_env(if cfg!(miri) { 4 } else { 3000 })
}

thread_local! {
    static OK_CALLS: Cell<usize> = const { Cell::new(0) };
    static HIT_TOKENS: Cell<u64> = const { Cell::new(0) };
    static RESTORES: Cell<usize> = const { Cell::new(0) };
    static RELEASED: Cell<usize> = const { Cell::new(0) };
    static GROUP_REFUSALS: Cell<usize> = const { Cell::new(0) };
    static STATE_HITS: Cell<usize> = const { Cell::new(0) };
    static STATE_RESTORES: Cell<usize> = const { Cell::new(0) };
    static ROLLBACK_REFUSALS: Cell<usize> = const { Cell::new(0) };
    static TAKEN_OVER: Cell<usize> = const { Cell::new(0) };
}

fn count<T: Copy + std::ops::Add<Output = T>>(c: &'static std::thread::LocalKey<Cell<T>>, n: T) {
    c.with(|c| c.set(c.get() + n));
}

fn note_error<T>(r: &Result<T, Kind>) {
    match r {
        Err(Kind::GroupExhausted(_)) => count(&GROUP_REFUSALS, 1),
        Err(Kind::Rollback(_)) => count(&ROLLBACK_REFUSALS, 1),
        _ => {}
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(case_count()))]
    #[test]
    fn grouped_allocator_matches_model(l in layout(), events in any::<bool>(), ops in prop::collection::vec(op(), 1..60)) {
        let Some((mut a, mut m)) = build(&l, events) else { return Ok(()); };
        let n = a.num_groups();
        let has_state = (0..n).any(|g| matches!(a.group_spec(g).unwrap().kind, GroupKind::State { .. }));
        let mut issued: Vec<i64> = vec![-5];
        let mut oks = 0usize;
        for op in ops {
            let open: Vec<i64> = issued.iter().copied().filter(|&x| m.anchor.row(x).is_some()).collect();
            let h = |i: usize| {
                if i < 14 && !open.is_empty() { open[i % open.len()] } else { issued[i % issued.len()] }
            };
            match op {
                Op::Open(k) => {
                    let mr = m.open(k);
                    note_error(&mr);
                    if let Ok(hs) = &mr { issued.extend(hs); }
                    oks += same(a.open(k), mr) as usize;
                }
                Op::OpenPrefix(ps, salt) => {
                    let prompts: Vec<Vec<i32>> = ps.iter().map(|&(b, l, c)| prompt(b, l, c)).collect();
                    let flat: Vec<i64> = prompts.iter().flatten().map(|&t| t as i64).collect();
                    let lens: Vec<i64> = prompts.iter().map(|p| p.len() as i64).collect();
                    let mr = m.open_with_prefix(&prompts, salt);
                    note_error(&mr);
                    if let Ok((hs, cached)) = &mr {
                        issued.extend(hs);
                        count(&HIT_TOKENS, cached.iter().sum::<i64>() as u64);
                    }
                    oks += same(a.open_with_prefix(&flat, &lens, Counts::Each(salt)), mr) as usize;
                }
                Op::Serve((b, len, c), salt) => {
                    let p = prompt(b, len, c);
                    let flat: Vec<i64> = p.iter().map(|&t| t as i64).collect();
                    let mr = m.open_with_prefix(std::slice::from_ref(&p), salt);
                    note_error(&mr);
                    let ok = mr.as_ref().ok().cloned();
                    oks += same(a.open_with_prefix(&flat, &[flat.len() as i64], Counts::Each(salt)), mr) as usize;
                    if let Some((hs, cached)) = ok {
                        issued.extend(&hs);
                        count(&HIT_TOKENS, cached[0] as u64);
                        count(&STATE_HITS, (has_state && cached[0] > 0) as usize);
                        for &tok in &flat[cached[0] as usize..] {
                            let t = [tok];
                            if !same(a.extend(&hs, Counts::Each(1), Some(&t), &mut []), m.extend(&hs, &[1], Some(&t))) {
                                break;
                            }
                            same(a.cache(&hs), m.cache(&hs));
                            a.check().unwrap();
                        }
                        same(a.close(&hs, true), m.close(&hs, true));
                    }
                }
                Op::Extend(v, seed) => {
                    let (hs, cs): (Vec<i64>, Vec<i64>) = v.iter().map(|&(i, c)| (h(i), c)).unzip();
                    let tokens = seed.map(|s| tokens_for(&m, &hs, &cs, s));
                    let mr = m.extend(&hs, &cs, tokens.as_deref());
                    note_error(&mr);
                    oks += same(a.extend(&hs, Counts::PerRequest(&cs), tokens.as_deref(), &mut []), mr) as usize;
                }
                Op::Step(v, seed) => {
                    let mut hs: Vec<i64> = v.iter().map(|&i| h(i)).collect();
                    hs.dedup();
                    let ones = vec![1i64; hs.len()];
                    let tokens = tokens_for(&m, &hs, &ones, seed);
                    let mr = m.extend(&hs, &ones, Some(&tokens));
                    note_error(&mr);
                    if same(a.extend(&hs, Counts::Each(1), Some(&tokens), &mut []), mr) {
                        oks += 1;
                        same(a.cache(&hs), m.cache(&hs));
                    }
                }
                Op::Admit(cs) => {
                    let mr = m.admit(&cs, None);
                    note_error(&mr);
                    if let Ok((hs, _)) = &mr { issued.extend(hs); }
                    oks += same(a.admit(&cs, None, &mut []), mr) as usize;
                }
                Op::Truncate(v) => {
                    let (hs, ls): (Vec<i64>, Vec<i64>) = v.iter().map(|&(i, l)| (h(i), l)).unzip();
                    let mr = m.truncate(&hs, &ls);
                    note_error(&mr);
                    oks += same(a.truncate(&hs, Counts::PerRequest(&ls)), mr) as usize;
                }
                Op::Back(i, back) => {
                    let x = h(i);
                    let len = m.anchor.row(x).map_or(0, |r| m.anchor.reqs[&r].len());
                    let l = len.saturating_sub(back) as i64;
                    let mr = m.truncate(&[x], &[l]);
                    note_error(&mr);
                    let ok = same(a.truncate(&[x], Counts::Each(l)), mr);
                    if ok && (l as usize) < len {
                        count(&RESTORES, 1);
                        count(&STATE_RESTORES, (has_state && l > 0) as usize);
                    }
                    oks += ok as usize;
                }
                Op::Rewind(i) => {
                    let x = h(i);
                    let Some(l) = m.anchor.row(x).and_then(|r| m.checkpointed(r)) else { continue };
                    let mr = m.truncate(&[x], &[l as i64]);
                    note_error(&mr);
                    let ok = same(a.truncate(&[x], Counts::Each(l as i64)), mr);
                    if ok {
                        count(&RESTORES, 1);
                        count(&STATE_RESTORES, (l > 0) as usize);
                    }
                    oks += ok as usize;
                }
                Op::Close(v, cache) => {
                    let hs: Vec<i64> = v.iter().map(|&i| h(i)).collect();
                    oks += same(a.close(&hs, cache), m.close(&hs, cache)) as usize;
                }
                Op::Cache(v) => {
                    let hs: Vec<i64> = v.iter().map(|&i| h(i)).collect();
                    oks += same(a.cache(&hs), m.cache(&hs)) as usize;
                }
                Op::Fork(i, k) => {
                    let parent = h(i);
                    let mr = m.fork(parent, k);
                    note_error(&mr);
                    if let Ok(hs) = &mr { issued.extend(hs); }
                    oks += same(a.fork(parent, k), mr) as usize;
                }
                Op::Evict(g, k) => {
                    if g < n {
                        prop_assert_eq!(a.evict(g, k).unwrap(), m.evict(g, k));
                    } else {
                        prop_assert!(a.evict(g, k).is_err());
                    }
                }
                Op::ClearCache => {
                    a.clear_cache();
                    m.clear_cache();
                }
                Op::Drain(g) => {
                    let g = g % n;
                    prop_assert_eq!(a.take_copies(g).unwrap(), m.take_copies(g));
                }
                Op::Reset => {
                    a.reset();
                    m.reset();
                }
            }
            a.check().unwrap();
            prop_assert_eq!(a.open_requests(), m.anchor.reqs.len());
            prop_assert_eq!((a.hit_tokens(), a.miss_tokens()), (m.anchor.hit, m.anchor.miss));
            for g in 0..n {
                let (free, cached, evictable, pending) = m.counters(g);
                prop_assert_eq!(a.free_pages(g).unwrap(), free, "group {} free", g);
                prop_assert_eq!(a.cached_pages(g).unwrap(), cached, "group {} cached", g);
                prop_assert_eq!(a.evictable_pages(g).unwrap(), evictable, "group {} evictable", g);
                prop_assert_eq!(a.pending_copies(g).unwrap(), pending, "group {} copies", g);
            }
            for &hh in &issued {
                match m.anchor.row(hh) {
                    Some(r) => {
                        prop_assert_eq!(a.length(hh).unwrap(), m.anchor.reqs[&r].len());
                        prop_assert_eq!(a.known_tokens(hh).unwrap(), m.anchor.reqs[&r].known());
                        for g in 0..n {
                            match a.group_spec(g).unwrap().kind {
                                GroupKind::State { .. } => {
                                    prop_assert_eq!(a.state_slots(g, &[hh]).unwrap(), vec![m.state_slot(g, r)]);
                                }
                                _ => {
                                    let s = a.slots(g, hh).unwrap();
                                    count(&RELEASED, s.iter().filter(|&&x| (x as usize) < a.group_spec(g).unwrap().page_size).count());
                                    prop_assert_eq!(s, m.slots(g, r), "group {} slots", g);
                                }
                            }
                        }
                    }
                    None => prop_assert!(!a.is_open(hh)),
                }
            }
        }
        count(&OK_CALLS, oks);
        let groups: usize = m.groups.iter().map(|g| match g {
            GGroup::Pages(e) => e.taken_over,
            _ => 0,
        }).sum();
        count(&TAKEN_OVER, groups);
    }
}

/// Token ids for an extend: the prompt's where it covers a position, else
/// pseudo-random ids in 0..3.
fn tokens_for(m: &GModel, hs: &[i64], cs: &[i64], seed: u8) -> Vec<i64> {
    let mut out = Vec::new();
    let mut x = seed as i64;
    for (&h, &c) in hs.iter().zip(cs) {
        let (start, prompt) = match m.anchor.row(h) {
            Some(r) => (m.anchor.reqs[&r].len(), m.anchor.reqs[&r].prompt.clone()),
            None => (0, Vec::new()),
        };
        for j in 0..c.max(0) as usize {
            x = (x * 7 + 3) % 11;
            out.push(prompt.get(start + j).map_or(x % 3, |&t| t as i64));
        }
    }
    out
}

/// Guards the generator: most calls succeed, prefixes hit, windows release
/// pages, states roll back, and groups refuse now and then.
#[test]
fn generated_sequences_exercise_groups() {
    grouped_allocator_matches_model();
    let cases = case_count();
    let (state_hits, state_restores) = (STATE_HITS.with(Cell::get), STATE_RESTORES.with(Cell::get));
    let (oks, hits, restores, released, refusals, rollbacks) = (
        OK_CALLS.with(Cell::get),
        HIT_TOKENS.with(Cell::get),
        RESTORES.with(Cell::get),
        RELEASED.with(Cell::get),
        GROUP_REFUSALS.with(Cell::get),
        ROLLBACK_REFUSALS.with(Cell::get),
    );
    let taken_over = TAKEN_OVER.with(Cell::get);
    eprintln!(
        "{cases} sequences: {oks} successful calls, {hits} prefix-hit tokens, {restores} rollbacks, \
         {released} released positions seen, {refusals} group refusals, {rollbacks} rollback refusals, \
         {state_hits} hits and {state_restores} rollbacks from a checkpoint, {taken_over} recomputed \
         non-anchor pages that took over an unheld copy's key"
    );
    assert!(
        state_hits > cases as usize / 20,
        "only {state_hits} hits with a state group"
    );
    // Typically 69-105 over random seeds: the guard is for none.
    assert!(
        state_restores > cases as usize / 150,
        "only {state_restores} restores from a checkpoint"
    );
    assert!(oks > cases as usize * 8, "only {oks} successful calls");
    assert!(hits > cases as u64 / 4, "only {hits} prefix-hit tokens");
    assert!(restores > cases as usize / 10, "only {restores} rollbacks");
    assert!(
        released > cases as usize,
        "only {released} released positions"
    );
    assert!(
        refusals > cases as usize / 10,
        "only {refusals} group refusals"
    );
    assert!(
        rollbacks > cases as usize / 20,
        "only {rollbacks} rollback refusals"
    );
    // Typically 1300 over random seeds (the anchor's own are guarded in
    // `model.rs`): the guard is for none.
    assert!(
        taken_over > cases as usize / 10,
        "only {taken_over} non-anchor pages took over an unheld copy's key"
    );
}
