//! Property test: prefix hits as long as an ideal cache's (`oracle/`).
//!
//! Random serving traces (system prompts shared across requests and
//! salts, chat turns that resend the previous turn's prompt and output
//! plus a new message, resent and cut transcripts, parallel sampling by
//! fork, truncation and recompute, the same output computed twice,
//! `cache()`, closes with and without caching, retention priorities and
//! pins, explicit evictions and a small pool's eviction pressure, a host
//! tier under both policies; page sizes 1, 2 and 16) drive one pool
//! (`hit_trace/`). Every `open_with_prefix` is checked against the
//! oracle's view of the index, built from the KV events alone (`oracle/`):
//! each prompt's hit is at least the longest prefix reachable through
//! live registrations (less is an index or chain break) and at most the
//! longest prefix registered (more is KV nobody registered), and each hit
//! page is the device page registered under that page's chain hash.
//! check() must pass after every operation.
//!
//! After `cache()` on a request whose published pages are each
//! registered on its own pages (so its chain's tip is live), every page it
//! published is served to a prompt of them: an orphan of the same content
//! (a registration whose parent's went) gives way to the recomputed page.
//!
//! What is not served: an orphan whose gone parent nobody recomputes (its
//! Stored event stands, but no lookup reaches it; a router matching from
//! the root stops at its gone parent's hash; recomputed on the same
//! prefix, the parent's registration is revived, `prefix/ghosts.rs`, and
//! the orphan served again), and a page
//! a request holds and published that stayed unregistered because another
//! copy of its content was registered (a duplicate) and went since.

mod cases;
mod hit_trace;
mod oracle;
mod router;

use hit_trace::{Op, World};
use kvpool_core::HostPolicy;
use proptest::prelude::*;

fn op() -> impl Strategy<Value = Op> {
    let b = any::<u8>;
    prop_oneof![
        6 => prop::collection::vec((b(), b(), b(), b(), b(), b()), 1..4).prop_map(Op::Open),
        5 => (prop::collection::vec((b(), b()), 1..4), b()).prop_map(|(v, s)| Op::Extend(v, s)),
        5 => (b(), b()).prop_map(|(h, n)| Op::Prefill(h, n)),
        3 => (b(), prop::option::of(b())).prop_map(|(h, p)| Op::Cache(h, p)),
        5 => (b(), prop::bool::weighted(0.8), prop::option::of(b())).prop_map(|(h, c, p)| Op::Close(h, c, p)),
        1 => (b(), 1u8..3).prop_map(|(h, n)| Op::Fork(h, n)),
        2 => (b(), b(), any::<bool>()).prop_map(|(h, f, d)| Op::Truncate(h, f, d)),
        1 => (0u8..4).prop_map(Op::Evict),
        1 => b().prop_map(Op::Tick),
        1 => b().prop_map(Op::Unpin),
    ]
}

fn run(cfg: (usize, usize, usize, bool, usize), ops: Vec<Op>) -> Result<(), TestCaseError> {
    let (ps, pages, host, through, pins) = cfg;
    let policy = if through {
        HostPolicy::WriteThrough
    } else {
        HostPolicy::WriteBack
    };
    let mut w = World::new(pages, ps, host, policy, pins);
    for op in ops {
        w.apply(op)?;
    }
    Ok(())
}

fn config() -> impl Strategy<Value = (usize, usize, usize, bool, usize)> {
    (
        prop_oneof![Just(1usize), Just(2), Just(16)],
        prop_oneof![4usize..12, 12usize..40],
        prop_oneof![2 => Just(0usize), 1 => 3usize..12],
        any::<bool>(),
        0usize..3,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases::from_env(if cfg!(miri) { 4 } else { 2000 })))]
    #[test]
    fn hits_are_the_longest_reachable_prefix(cfg in config(), ops in prop::collection::vec(op(), 1..120)) {
        run(cfg, ops)?;
    }
}
