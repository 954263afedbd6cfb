//! Property test: ghost registrations (`prefix/ghosts.rs`) against the
//! reference model (`reference/`), on sequences built to make them: a few
//! prompts over a tiny alphabet served again and again, closed at
//! priority 0 or the default (so a prefix goes before its continuation),
//! pages rewritten in place after a truncation, explicit evictions, small
//! pools, with and without a host tier. Every hit, the registered page
//! counts and the number of ghosts must agree with the model's, and
//! `check()` (which verifies every ghost's counts) must pass after every
//! operation. The general model test (`model.rs`) revives rarely.

mod cases;
mod reference;

use kvpool_core::{Counts, HostPolicy, Options, SlotAllocator};
use proptest::prelude::*;
use reference::{same, Model, Tier, MAX_CTX, MAX_REQ};

/// The model test's allocator (`model_harness/`), pins off.
fn new_allocator(pages: usize, ps: usize, host: usize, policy: HostPolicy) -> SlotAllocator {
    let opts = Options {
        generation_base: Some(1),
        host_pages: host,
        host_policy: policy,
        manual_clock: true,
        max_pinned_pages: Some(0),
        ..Options::new()
    };
    SlotAllocator::with_options(pages, ps, MAX_REQ, MAX_CTX, opts).unwrap()
}

#[derive(Debug, Clone)]
enum Op {
    /// Prompt (base, length), closed at priority 0 (`true`) or cached.
    Serve(u8, u8, bool),
    /// Prompt (base, length) hit, truncated to `at` and recomputed from
    /// there with the token at `at` changed (`bump`), then closed cached.
    Rewrite(u8, u8, u8, u8),
    Evict(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..3, 2u8..=MAX_CTX as u8, any::<bool>()).prop_map(|(b, l, z)| Op::Serve(b, l, z)),
        2 => (0u8..3, 2u8..=MAX_CTX as u8, any::<u8>(), 0u8..2).prop_map(|(b, l, at, d)| Op::Rewrite(b, l, at, d)),
        3 => (1u8..4).prop_map(Op::Evict),
    ]
}

fn prompt(b: u8, l: u8) -> Vec<i64> {
    // Three texts that share their first tokens, then part ways.
    (0..l as i64)
        .map(|i| {
            if i < 3 {
                i % 2
            } else {
                (i * (b as i64 + 1)) % 3
            }
        })
        .collect()
}

/// Opens `p` on both, checks the hit agrees; returns the handle.
fn open(a: &mut SlotAllocator, m: &mut Model, p: &[i64]) -> Option<(i64, i64)> {
    let ids: Vec<i32> = p.iter().map(|&t| t as i32).collect();
    let r = a.open_with_prefix(p, &[p.len() as i64], Counts::Each(0));
    let mr = m.open_with_prefix(&[ids], &[0]);
    let ok = mr.clone().ok();
    same(r, mr);
    ok.map(|(h, c)| (h[0], c[0]))
}

fn extend(a: &mut SlotAllocator, m: &mut Model, h: i64, toks: &[i64]) -> bool {
    let n = toks.len() as i64;
    let mr = m.extend(&[h], &[n], Some(toks));
    let r = a.extend(&[h], Counts::Each(n), Some(toks)).map(|_| ());
    same(r, mr.map(|_| ()))
}

fn close(a: &mut SlotAllocator, m: &mut Model, h: i64, zero: bool) {
    if zero {
        same(
            a.close_with_priority(&[h], Counts::Each(0), None),
            m.close_with_priority(&[h], &[0], None),
        );
    } else {
        same(a.close(&[h], true), m.close(&[h], true));
    }
}

fn run(ps: usize, pages: usize, host: usize, ops: &[Op]) -> Result<usize, TestCaseError> {
    let policy = HostPolicy::WriteBack;
    let mut a = new_allocator(pages, ps, host, policy);
    let mut m = Model::with_tier(pages, ps, (host > 0).then(|| Tier::new(host, policy)));
    m.max_pinned = 0;
    for op in ops {
        match *op {
            Op::Serve(b, l, zero) => {
                let p = prompt(b, l);
                if let Some((h, c)) = open(&mut a, &mut m, &p) {
                    extend(&mut a, &mut m, h, &p[c as usize..]);
                    close(&mut a, &mut m, h, zero);
                }
            }
            Op::Rewrite(b, l, at, bump) => {
                let p = prompt(b, l);
                if let Some((h, c)) = open(&mut a, &mut m, &p) {
                    let at = at as usize % (c as usize + 1);
                    same(
                        a.truncate(&[h], Counts::Each(at as i64)),
                        m.truncate(&[h], &[at as i64]),
                    );
                    let mut rest = p[at..].to_vec();
                    if let Some(t) = rest.first_mut() {
                        *t = (*t + bump as i64) % 3;
                    }
                    extend(&mut a, &mut m, h, &rest);
                    close(&mut a, &mut m, h, false);
                }
            }
            Op::Evict(n) => {
                prop_assert_eq!(a.evict(n as usize), m.evict(n as usize));
            }
        }
        // Queued transfers and copies: an engine runs them before its next
        // step; here nothing reads the pages' contents.
        let _ = a.take_copies();
        let _ = m.take_copies_from(0);
        if host > 0 {
            let _ = (a.take_offloads(), m.take_offloads());
            let _ = (a.take_loads(), m.take_loads());
        }
        a.check()
            .map_err(|e| TestCaseError::fail(format!("after {op:?}: {e}")))?;
        prop_assert_eq!(a.cached_pages(), m.device_registered(), "after {:?}", op);
        prop_assert_eq!(
            a.index_ghosts_for_tests(),
            m.ghosts.len(),
            "ghosts after {:?}",
            op
        );
    }
    Ok(m.revived)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases::from_env(if cfg!(miri) { 4 } else { 1500 })))]
    #[test]
    fn ghosts_match_the_model(ps in 1usize..4, pages in 4usize..16, host in prop_oneof![3 => Just(0usize), 1 => 2usize..8], ops in prop::collection::vec(op(), 1..60)) {
        run(ps, pages, host, &ops)?;
    }
}

/// The sequences above do revive: a fixed set of them, drawn from a seeded
/// generator, revives many registrations (so the test above exercises
/// what it is for).
#[test]
fn the_sequences_revive() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]);
    let mut runner = TestRunner::new_with_rng(Config::default(), rng);
    let strategy = (1usize..4, 4usize..16, prop::collection::vec(op(), 1..60));
    let mut revived = 0;
    for _ in 0..200 {
        let (ps, pages, ops) = strategy.new_tree(&mut runner).unwrap().current();
        revived += run(ps, pages, 0, &ops).unwrap();
    }
    eprintln!("{revived} revivals");
    assert!(revived > 50, "only {revived} revivals");
}
