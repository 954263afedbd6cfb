//! Arbitrary operation sequences against kvpool-core, shared pages included.
//! After every operation (see `model.rs`): `check()` passes; every open
//! request still reads back exactly the KV it wrote or was served (so no page
//! is written while another request or the cache needs it); pages are shared
//! only at the same list position; used/free/cached/evictable pages agree
//! with the page lists and with the replayed KV events; a prefix hit serves
//! only pages computed for the same salt and the same tokens at every
//! position up to it; and a call that returned an error changed nothing
//! observable (counters, every handle's slots/pages/tokens, no events, no
//! copies, and the same free-stack and LRU order on a probe).
//!
//! Half the runs leave copy-on-write copies, offloads and loads queued across
//! operations (closes, truncations, evictions, swaps, hits, resets in
//! between) until a step writes a slot one touches, pages are registered,
//! or `Drain`: what each request reads is then what it will hold once the
//! queued transfers run in the documented order (offloads, loads, copies),
//! so a source page reused while its transfer waits shows up as overwritten
//! KV. Some runs have a host tier (write_back or write_through) and swap
//! requests out and in.
#![no_main]

mod apply;
mod extend;
mod model;

use apply::apply;
use arbitrary::Arbitrary;
use extend::Toks;
use kvpool_core::{Options, SlotAllocator};
use libfuzzer_sys::fuzz_target;
use model::{Model, Snapshot};

#[derive(Arbitrary, Debug)]
struct Config {
    num_pages: u8,
    page_size: u8,
    max_requests: u8,
    max_context_len: u8,
    /// Low bits pick a weak (colliding) test-only hash now and then.
    hash: u8,
    /// Host pages (none below 2), and the policy (the top bit).
    host: u8,
}

/// Handles are named by index into every handle ever issued (open, closed or
/// stale), or raw, so invalid handles get exercised as much as valid ones.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum H {
    /// The i-th open request (in handle order), if any.
    Open(u8),
    Issued(u8),
    Raw(i64),
}

/// A count: mostly 0..=8, now and then negative.
#[derive(Arbitrary, Debug, Clone, Copy)]
struct N(u8);

impl N {
    fn get(self) -> i64 {
        if self.0 >= 250 {
            249 - self.0 as i64
        } else {
            (self.0 % 9) as i64
        }
    }
}

/// A prompt: optionally the known tokens of an issued request, cut short,
/// then a suffix, all from a 3-token alphabet so prefixes repeat.
#[derive(Arbitrary, Debug)]
struct Prompt {
    reuse: Option<u8>,
    cut: u8,
    suffix: Vec<u8>,
}

#[derive(Arbitrary, Debug)]
enum Salt {
    Each(u8),
    Per(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum Op {
    Open(u8),
    OpenWithPrefix(Vec<Prompt>, Salt),
    Extend(Vec<(H, N)>, Toks),
    ExtendEach(Vec<H>, N),
    ExtendWithStarts(Vec<(H, N)>),
    /// Every open request grows by one token (a decode step).
    Decode(Vec<u8>),
    /// A request grows to the end of its prompt (a prefill), then is cached.
    Prefill(H, bool),
    /// A whole request: open_with_prefix, prefill, `decode` steps with
    /// tokens, close with cache. Fails (changing nothing) only if the open
    /// does; a later step that runs out of pages just ends the request early.
    Serve(Prompt, u8, u8),
    /// Parallel sampling: fork `n` children, then parent and children each
    /// take one (different) sampled token, copying a shared partial page.
    /// Fails (changing nothing) only if the fork does.
    Sample(H, u8, Vec<u8>),
    /// Each request drops its last `n` tokens (negative: a bad length).
    Truncate(Vec<(H, N)>),
    Close(Vec<H>, bool),
    Cache(Vec<H>),
    Fork(H, u8),
    Evict(u8),
    ClearCache,
    Reset,
    Queries(Vec<H>),
    /// Take and run every queued transfer.
    Drain,
    SwapOut(Vec<H>),
    SwapIn(Vec<H>),
    /// Retention priorities: `cache_with_priority` (a priority out of range
    /// past 100; a duration in seconds), `unpin`, and the manual clock
    /// moved on.
    CachePriority(Vec<H>, u8, Option<u8>),
    Unpin(Vec<H>),
    Tick(u8),
}

/// Ops that register pages: an engine runs its step (the queued copies,
/// then the K/V writes) before it publishes pages.
fn registers(op: &Op) -> bool {
    matches!(
        op,
        Op::Cache(_)
            | Op::Close(_, true)
            | Op::Prefill(_, true)
            | Op::Serve(..)
            | Op::CachePriority(..)
    )
}

fuzz_target!(|input: (Config, Vec<Op>)| {
    let (cfg, ops) = input;
    let host_pages = (cfg.host & 0x7f) as usize % 24;
    let opts = Options {
        hash_seed: Some(7),
        host_pages: if host_pages < 2 { 0 } else { host_pages },
        host_policy: if cfg.host & 0x80 != 0 {
            kvpool_core::HostPolicy::WriteThrough
        } else {
            kvpool_core::HostPolicy::WriteBack
        },
        weak_hash_bits: if cfg.hash % 4 == 0 {
            1 + (cfg.hash / 4) as u32 % 3
        } else {
            0
        },
        manual_clock: true,
        max_pinned_pages: Some((cfg.hash as usize % 4).min(1 + cfg.num_pages as usize % 30)),
        ..Options::new()
    };
    let Ok(mut a) = SlotAllocator::with_options(
        2 + cfg.num_pages as usize % 30,
        1 + cfg.page_size as usize % 4,
        1 + cfg.max_requests as usize % 8,
        1 + cfg.max_context_len as usize % 40,
        opts,
    ) else {
        panic!("a small valid config was refused");
    };
    let mut m = Model::new(&a);
    // A bit the sizes above leave unused.
    m.defer = cfg.max_requests & 8 != 0;
    let mut issued: Vec<i64> = Vec::new();
    for op in ops.iter().take(64) {
        if registers(op) {
            m.drain(&mut a);
        }
        let before = Snapshot::of(&a, &issued);
        let ok = apply(&mut a, &mut m, &mut issued, op);
        let events = a.take_events();
        // Closes, truncations and resets drop the copies into the pages
        // they release.
        m.pending = a.pending_copies();
        if ok {
            if !m.defer {
                assert_eq!(m.pending, 0, "copies left after {op:?}");
            }
            m.apply_events(&events, &a);
        } else {
            assert!(events.is_empty(), "failed {op:?} emitted events");
            assert_eq!(
                before,
                Snapshot::of(&a, &issued),
                "failed {op:?} changed the allocator"
            );
        }
        m.verify(&a);
    }
});
