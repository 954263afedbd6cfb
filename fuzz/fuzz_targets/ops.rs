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

mod extend;
mod model;

use arbitrary::Arbitrary;
use extend::{extend, extend_need, extend_tokens, record_extend, tok, Toks};
use kvpool_core::{Counts, Options, SlotAllocator};
use libfuzzer_sys::fuzz_target;
use model::{Model, Req, Snapshot};

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

/// Replays the events so far into the model (between the steps of one op).
fn settle(a: &mut SlotAllocator, m: &mut Model) {
    let e = a.take_events();
    m.apply_events(&e, a);
}

fn resolve(issued: &[i64], m: &Model, a: &SlotAllocator, h: H) -> i64 {
    match h {
        H::Open(i) => {
            let mut open: Vec<i64> = m.reqs.keys().copied().collect();
            open.sort_unstable();
            match open.len() {
                0 => resolve(issued, m, a, H::Issued(i)),
                n => open[i as usize % n],
            }
        }
        H::Issued(i) if !issued.is_empty() => issued[i as usize % issued.len()],
        H::Issued(i) => i as i64,
        H::Raw(r) => r,
    }
}

fn handles(issued: &[i64], m: &Model, a: &SlotAllocator, v: &[H]) -> Vec<i64> {
    v.iter()
        .take(8)
        .map(|&h| resolve(issued, m, a, h))
        .collect()
}

fn split(issued: &[i64], m: &Model, a: &SlotAllocator, v: &[(H, N)]) -> (Vec<i64>, Vec<i64>) {
    v.iter()
        .take(8)
        .map(|&(h, c)| (resolve(issued, m, a, h), c.get()))
        .unzip()
}

/// Runs one op and updates the model; returns whether it succeeded. Every
/// successful result is checked against what the op promised.
fn apply(a: &mut SlotAllocator, m: &mut Model, issued: &mut Vec<i64>, op: &Op) -> bool {
    match op {
        Op::Open(n) => {
            let Ok(hs) = a.open(*n as usize % 4) else {
                return false;
            };
            for &h in &hs {
                m.reqs.insert(h, Req::default());
            }
            issued.extend(hs);
            true
        }
        Op::OpenWithPrefix(prompts, salt) => open_with_prefix(a, m, issued, prompts, salt),
        Op::Extend(v, toks) => {
            let (hs, cs) = split(issued, m, a, v);
            let t = extend_tokens(m, &hs, &cs, toks);
            extend(a, m, &hs, &cs, t.as_deref(), false)
        }
        Op::ExtendEach(v, c) => {
            let hs = handles(issued, m, a, v);
            let cs = vec![c.get(); hs.len()];
            extend(a, m, &hs, &cs, None, true)
        }
        Op::ExtendWithStarts(v) => {
            let (hs, cs) = split(issued, m, a, v);
            let old: Vec<i64> = hs
                .iter()
                .map(|&h| a.length(h).unwrap_or(0) as i64)
                .collect();
            let mut b = a.clone();
            let pre = extend_need(a, m, &hs, &cs);
            let Ok((slots, starts)) = a.extend_with_starts(&hs, Counts::PerRequest(&cs)) else {
                return false;
            };
            assert_eq!(starts, old);
            // Same slots as a plain extend of the same batch on a clone.
            assert_eq!(
                b.extend(&hs, Counts::PerRequest(&cs), None),
                Ok(slots.clone())
            );
            let copies = pre.expect("an invalid batch succeeded").copies;
            assert_eq!(record_extend(a, m, &hs, &cs, None, &slots), copies);
            true
        }
        Op::Decode(v) => {
            let mut hs: Vec<i64> = m.reqs.keys().copied().collect();
            hs.sort_unstable();
            let cs = vec![1; hs.len()];
            let t = extend_tokens(m, &hs, &cs, &Toks::Follow(v.clone()));
            extend(a, m, &hs, &cs, t.as_deref(), false)
        }
        Op::Prefill(h, cache) => {
            let h = resolve(issued, m, a, *h);
            let Some(r) = m.reqs.get(&h) else {
                return false;
            };
            let c = (r.prompt.len().max(r.tokens.len()) - r.tokens.len()) as i64;
            let (hs, cs) = (vec![h], vec![c]);
            let t = extend_tokens(m, &hs, &cs, &Toks::Follow(vec![1, 2]));
            if !extend(
                a,
                m,
                &hs,
                &cs,
                if *cache { t.as_deref() } else { None },
                false,
            ) {
                return false;
            }
            if *cache {
                m.drain(a);
                a.cache(&hs).expect("cache of a request just extended");
            }
            true
        }
        Op::Serve(p, salt, decode) => {
            let n = issued.len();
            let prompt = std::slice::from_ref(p);
            if !open_with_prefix(a, m, issued, prompt, &Salt::Each(*salt)) {
                return false;
            }
            let h = issued[n];
            settle(a, m);
            if apply(a, m, issued, &Op::Prefill(H::Raw(h), true)) {
                for step in 0..decode % 6 {
                    let hs = [h];
                    let t =
                        extend_tokens(m, &hs, &[1], &Toks::Follow(vec![decode.wrapping_add(step)]));
                    if !extend(a, m, &hs, &[1], t.as_deref(), false) {
                        break;
                    }
                }
            }
            settle(a, m);
            m.drain(a);
            a.close(&[h], true).expect("close of an open request");
            m.close(h);
            true
        }
        Op::Sample(h, n, toks) => {
            let before = issued.len();
            let parent = resolve(issued, m, a, *h);
            if !apply(a, m, issued, &Op::Fork(H::Raw(parent), *n)) {
                return false;
            }
            let mut hs = vec![parent];
            hs.extend_from_slice(&issued[before..]);
            let cs = vec![1; hs.len()];
            let t = extend_tokens(m, &hs, &cs, &Toks::Follow(toks.clone()));
            extend(a, m, &hs, &cs, t.as_deref(), false);
            true
        }
        Op::Truncate(v) => {
            let (hs, cut) = split(issued, m, a, v);
            let ls: Vec<i64> = hs
                .iter()
                .zip(&cut)
                .map(|(&h, &c)| a.length(h).map_or(c, |l| l as i64 - c))
                .collect();
            if a.truncate(&hs, Counts::PerRequest(&ls)).is_err() {
                return false;
            }
            for (&h, &l) in hs.iter().zip(&ls) {
                let r = m
                    .reqs
                    .get_mut(&h)
                    .expect("truncated a request the model lacks");
                if (l as usize) < r.tokens.len() {
                    // Rolled back into its prompt, the request may diverge.
                    r.prompt.truncate(l as usize);
                }
                r.tokens.truncate(l as usize);
                r.writes.truncate(l as usize);
            }
            true
        }
        Op::Close(v, cache) => {
            let hs = handles(issued, m, a, v);
            if a.close(&hs, *cache).is_err() {
                return false;
            }
            for h in &hs {
                assert!(!a.is_open(*h));
                m.close(*h);
            }
            true
        }
        Op::Cache(v) => a.cache(&handles(issued, m, a, v)).is_ok(),
        Op::Fork(h, n) => {
            let h = resolve(issued, m, a, *h);
            let Ok(kids) = a.fork(h, *n as usize % 4) else {
                return false;
            };
            assert_eq!(kids.len(), *n as usize % 4);
            let parent = m.reqs[&h].clone();
            for &k in &kids {
                assert_eq!(
                    a.pages(k),
                    a.pages(h),
                    "a fork does not share its parent's pages"
                );
                m.reqs.insert(k, parent.clone());
            }
            issued.extend(kids);
            true
        }
        Op::Evict(n) => {
            // 255 stands for "everything" (usize::MAX).
            let n = if *n == 255 {
                usize::MAX
            } else {
                *n as usize % 8
            };
            let want = n.min(a.evictable_pages());
            assert_eq!(a.evict(n), want);
            true
        }
        Op::ClearCache => {
            a.clear_cache();
            assert_eq!(a.cached_pages(), 0);
            true
        }
        Op::Reset => {
            a.reset();
            m.reqs.clear();
            assert_eq!(a.open_requests(), 0);
            true
        }
        Op::Queries(v) => queries(a, &handles(issued, m, a, v)),
        Op::Drain => {
            m.drain(a);
            true
        }
        Op::SwapOut(v) => {
            let hs = handles(issued, m, a, v);
            let offloads = a.pending_offloads();
            if a.swap_out(&hs).is_err() {
                return false;
            }
            for &h in &hs {
                assert_eq!(a.is_swapped(h), Ok(true));
            }
            assert!(a.pending_offloads() >= offloads);
            true
        }
        Op::SwapIn(v) => {
            let hs = handles(issued, m, a, v);
            if a.swap_in(&hs).is_err() {
                return false;
            }
            for &h in &hs {
                assert_eq!(a.is_swapped(h), Ok(false));
            }
            true
        }
        Op::CachePriority(v, q, secs) => {
            let hs = handles(issued, m, a, v);
            let r = a.cache_with_priority(&hs, Counts::Each(*q as i64), secs.map(f64::from));
            assert!(a.pinned_pages() <= a.max_pinned_pages());
            r.is_ok()
        }
        Op::Unpin(v) => a.unpin(&handles(issued, m, a, v)).is_ok(),
        Op::Tick(s) => {
            let t = a.clock() + *s as f64;
            a.set_clock(t).is_ok()
        }
    }
}

fn open_with_prefix(
    a: &mut SlotAllocator,
    m: &mut Model,
    issued: &mut Vec<i64>,
    prompts: &[Prompt],
    salt: &Salt,
) -> bool {
    let mut tokens = Vec::new();
    let mut lengths = Vec::new();
    let mut texts: Vec<Vec<i32>> = Vec::new();
    for p in prompts.iter().take(4) {
        let mut t: Vec<i32> = match p.reuse {
            Some(i) if !m.texts.is_empty() => m.texts[i as usize % m.texts.len()].clone(),
            _ => Vec::new(),
        };
        t.truncate(p.cut as usize % (t.len() + 1 + 4));
        t.extend(p.suffix.iter().take(24).map(|&b| tok(b)));
        tokens.extend(t.iter().map(|&x| x as i64));
        lengths.push(t.len() as i64);
        texts.push(t);
    }
    let salts: Vec<i64> = match salt {
        Salt::Each(s) => vec![(*s % 3) as i64; texts.len()],
        Salt::Per(v) => v.iter().map(|&s| (s % 3) as i64).collect(),
    };
    let salt_arg = match salt {
        Salt::Each(s) => Counts::Each((*s % 3) as i64),
        Salt::Per(_) => Counts::PerRequest(&salts),
    };
    let (hits0, misses0) = (a.hit_tokens(), a.miss_tokens());
    let Ok((hs, cached)) = a.open_with_prefix(&tokens, &lengths, salt_arg) else {
        return false;
    };
    assert_eq!((hs.len(), cached.len()), (texts.len(), texts.len()));
    let ps = a.page_size() as i64;
    let mut hit = 0u64;
    // A host hit's page is filled by its queued load.
    let settled = m.settled(a);
    for ((&h, &c), (t, &s)) in hs.iter().zip(&cached).zip(texts.iter().zip(&salts)) {
        let cap = ((t.len() as i64 - 1).max(0) / ps) * ps;
        assert!(
            c >= 0 && c <= cap && c % ps == 0,
            "cached_len {c} for a {}-token prompt",
            t.len()
        );
        assert_eq!(a.length(h), Ok(c as usize));
        let slots = a.slots(h).expect("open");
        let mut r = Req {
            salt: s,
            prompt: t.clone(),
            ..Req::default()
        };
        for (i, &slot) in slots.iter().enumerate() {
            // The hit page must hold KV computed for this salt and exactly
            // this prompt's tokens at positions 0..=i.
            let cell = settled[slot as usize]
                .as_ref()
                .unwrap_or_else(|| panic!("hit slot {slot} was never written"));
            assert_eq!(cell.salt, s, "prefix hit served another salt's page");
            assert_eq!(
                cell.ctx.as_deref(),
                Some(&t[..=i]),
                "prefix hit served another prompt's KV"
            );
            r.tokens.push(Some(t[i]));
            r.writes.push(cell.write);
        }
        m.reqs.insert(h, r);
        hit += c as u64;
    }
    let total: u64 = texts.iter().map(|t| t.len() as u64).sum();
    assert_eq!(a.hit_tokens() - hits0, hit);
    assert_eq!(a.miss_tokens() - misses0, total - hit);
    issued.extend(hs);
    true
}

fn queries(a: &SlotAllocator, hs: &[i64]) -> bool {
    let pt = a.page_table(hs);
    let rows = a.rows(hs);
    let lens = a.lengths(hs);
    // All three agree on whether the batch is valid, except that a
    // swapped-out request has a row and a length but no page table.
    assert_eq!(rows.is_ok(), lens.is_ok());
    if rows.is_ok() && hs.iter().any(|&h| a.is_swapped(h) == Ok(true)) {
        assert!(pt.is_err(), "page_table of a swapped-out request");
        return true;
    }
    assert_eq!(pt.is_ok(), rows.is_ok());
    if let (Ok(pt), Ok(lens)) = (pt, lens) {
        assert_eq!(pt.indptr.len(), hs.len() + 1);
        for (i, &h) in hs.iter().enumerate() {
            let pages = a.pages(h).expect("open");
            let (lo, hi) = (pt.indptr[i] as usize, pt.indptr[i + 1] as usize);
            assert_eq!(&pt.indices[lo..hi], &pages[..]);
            let ps = a.page_size();
            let want = if lens[i] == 0 {
                0
            } else {
                (lens[i] as usize - 1) % ps + 1
            };
            assert_eq!(pt.last_page_len[i] as usize, want);
        }
    }
    true
}
