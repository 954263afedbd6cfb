//! The operations the property test (`model.rs`) generates: what each does,
//! how likely it is, and the token ids its extends pass.

use crate::reference::Model;
use proptest::prelude::*;

#[derive(Debug, Clone)]
pub enum Op {
    Open(usize),
    /// Prompts as (base sequence, length, last token changed), one salt for all.
    OpenPrefix(Vec<(usize, usize, bool)>, i64),
    /// (handle pick, count); token ids: None, or Some(seed, corrupt).
    Extend(Vec<(usize, i64)>, Option<(u8, bool)>),
    /// One token each (`Counts::Each(1)`, the decode step's own loop).
    Decode(Vec<usize>, Option<(u8, bool)>),
    Truncate(Vec<(usize, i64)>),
    /// A rollback and a new continuation: drop the last `back` tokens, then
    /// extend by `n` with ids from `seed` (mostly not the prompt's).
    Rollback(usize, usize, usize, u8),
    Close(Vec<usize>, bool),
    Cache(Vec<usize>),
    Fork(usize, usize),
    /// Parallel sampling: fork `n` children, then the children and the
    /// parent each write one token (copying a shared partly filled page).
    Sample(usize, usize),
    /// Extends a request by the rest of its prompt (no token ids passed).
    Prefill(usize),
    Evict(usize),
    ClearCache,
    /// Every queue drained: the copies from `n % (pending + 1)` first.
    Drain(usize),
    Reset,
    SwapOut(Vec<usize>),
    SwapIn(Vec<usize>),
    /// Prompts the harness saw registered (text pick, drop the last token),
    /// asked for again: hits on whichever tier holds them by then.
    Reopen(Vec<(u8, u8)>),
    /// What `Reopen` becomes: (prompt, salt) each.
    Prompts(Vec<(Vec<i32>, i64)>),
    /// swap_out, swap_in, swap_out, swap_in of one request with nothing
    /// drained in between: pages a queued load has yet to fill are swapped
    /// out again, host pages swap_in lets go are wanted by write-backs.
    Bounce(usize),
    /// `cache_with_priority` (`close_with_priority` when the flag is set):
    /// handle picks, priorities (one for all, else one per handle), a
    /// duration in whole seconds.
    Prio(Vec<usize>, Vec<i64>, Option<u8>, bool),
    Unpin(Vec<usize>),
    /// Moves the manual clock on by this many seconds.
    Tick(u8),
}

impl Op {
    pub fn with_prompts(self, prompts: Vec<(Vec<i32>, i64)>) -> Op {
        Op::Prompts(prompts)
    }
}

/// Two prompt bases sharing their first 4 tokens, from a 3-letter alphabet
/// so that generated decode tokens often repeat a cached prefix.
const BASES: [[i32; 14]; 2] = [
    [1, 2, 1, 0, 2, 2, 1, 0, 0, 1, 2, 0, 1, 1],
    [1, 2, 1, 0, 0, 0, 2, 1, 2, 2, 0, 1, 0, 2],
];

pub fn prompt(base: usize, len: usize, changed: bool) -> Vec<i32> {
    let mut p = BASES[base][..len].to_vec();
    if changed {
        if let Some(t) = p.last_mut() {
            *t = (*t + 1) % 3;
        }
    }
    p
}

/// Handle picks below OPEN_PICKS name an open request (if any); the rest name
/// any handle ever issued, so stale, closed and bogus handles show up too.
pub const OPEN_PICKS: usize = 14;

pub fn op() -> impl Strategy<Value = Op> {
    let pick = 0usize..16;
    let value = prop_oneof![1 => Just(-1i64), 12 => 0i64..7];
    let prompt = (0usize..2, 0usize..14, prop::bool::weighted(0.2));
    let toks = prop::option::of((any::<u8>(), prop::bool::weighted(0.05)));
    prop_oneof![
        2 => (0usize..3).prop_map(Op::Open),
        5 => (prop::collection::vec(prompt, 0..3), 0i64..2).prop_map(|(p, s)| Op::OpenPrefix(p, s)),
        5 => (prop::collection::vec((pick.clone(), value.clone()), 0..4), toks.clone()).prop_map(|(v, t)| Op::Extend(v, t)),
        2 => prop::collection::vec((pick.clone(), value), 0..3).prop_map(Op::Truncate),
        3 => (pick.clone(), 1usize..6, 0usize..5, any::<u8>()).prop_map(|(p, b, n, s)| Op::Rollback(p, b, n, s)),
        4 => (prop::collection::vec(pick.clone(), 1..3), prop::bool::weighted(0.75)).prop_map(|(v, c)| Op::Close(v, c)),
        3 => prop::collection::vec(pick.clone(), 0..3).prop_map(Op::Cache),
        3 => pick.clone().prop_map(Op::Prefill),
        3 => (prop::collection::vec(pick.clone(), 1..5), toks).prop_map(|(v, t)| Op::Decode(v, t)),
        3 => (pick.clone(), 1usize..3).prop_map(|(p, n)| Op::Fork(p, n)),
        3 => (pick.clone(), 1usize..3).prop_map(|(p, n)| Op::Sample(p, n)),
        3 => prop_oneof![3 => 0usize..6, 1 => Just(usize::MAX)].prop_map(Op::Evict),
        1 => Just(Op::ClearCache),
        2 => prop_oneof![2 => Just(0usize), 1 => 1usize..8].prop_map(Op::Drain),
        1 => Just(Op::Reset),
        1 => prop::collection::vec(pick.clone(), 1..3).prop_map(Op::SwapOut),
        2 => prop::collection::vec(pick.clone(), 1..3).prop_map(Op::SwapIn),
        4 => prop::collection::vec((any::<u8>(), any::<u8>()), 1..3).prop_map(Op::Reopen),
        1 => pick.clone().prop_map(Op::Bounce),
        4 => (prop::collection::vec(pick.clone(), 0..3), prop::collection::vec(priority(), 1..3),
              prop::option::of(prop_oneof![8 => 1u8..3, 1 => Just(0u8)]), prop::bool::weighted(0.5))
            .prop_map(|(v, q, r, c)| Op::Prio(v, q, r, c)),
        1 => prop::collection::vec(pick, 0..3).prop_map(Op::Unpin),
        3 => (0u8..3).prop_map(Op::Tick),
    ]
}

/// A retention priority: pins and the default often, now and then one out
/// of range.
fn priority() -> impl Strategy<Value = i64> {
    prop_oneof![
        4 => Just(100i64),
        2 => Just(kvpool_core::DEFAULT_PRIORITY as i64),
        4 => 0i64..100,
        1 => Just(101i64),
        1 => Just(-1i64),
    ]
}

/// Token ids for an extend batch: the prompt's where it covers a position
/// (one wrong id when `corrupt`), else pseudo-random ids in 0..3.
pub fn batch_tokens(m: &Model, hs: &[i64], cs: &[i64], seed: u8, corrupt: bool) -> Vec<i64> {
    let mut out = Vec::new();
    let mut x = seed as i64;
    for (&h, &c) in hs.iter().zip(cs) {
        let (start, prompt) = match m.row(h) {
            Some(r) => (m.reqs[&r].len(), m.reqs[&r].prompt.clone()),
            None => (0, Vec::new()),
        };
        for j in 0..c.max(0) as usize {
            x = (x * 7 + 3) % 11;
            out.push(prompt.get(start + j).map_or(x % 3, |&t| t as i64));
        }
    }
    if corrupt {
        if let Some(t) = out.last_mut() {
            *t = if seed % 2 == 0 { -1 } else { *t + 1 };
        }
    }
    out
}
