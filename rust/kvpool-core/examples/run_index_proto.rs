//! A standalone per-run (radix-node) prefix index, to bound what per-run
//! bookkeeping could cost at page size 1 (docs/design-per-run-prefix.md;
//! no kvpool internals):
//!   cargo build --release -p kvpool-core --example run_index_proto
//!   target/release/examples/run_index_proto [--quick] [--check] [--only NAME]
//! `--check` runs the randomized self-test (`run_index_proto/check.rs`)
//! first. Timings are medians of reps, as `bench_core`'s; each row's timed
//! work is one `#[inline(never)]` `op_*` function, so
//! `valgrind --tool=callgrind --toggle-collect='*op_match_unlock*' ... --only ROW`
//! counts that work alone.
//!
//! Rows (the prompt is bench_core's, token i = (i * 7919) % 32000):
//! - match_unlock_4096_pageN: match_and_lock + unlock of the cached 4096-token
//!   prompt, matching 4096 - N tokens as open_with_prefix does; `_64runs`:
//!   the cached prefix is 64 runs of 64 tokens (each had a sibling), not one.
//! - insert_4096_pageN[_no_events]: a 4096-token chain under an empty root
//!   (chain hashes and one Stored event per page; without events, no hash;
//!   `_hashes_no_events`: the hashes kept, no events).
//! - insert_tail_264_page1: a 264-token tail under a held 4096-token prefix.
//! - unlock_4096_page1_{shared,to_cached}: the unlock alone.
//! - evict_256_*: 256 pages from one run's tail at page 1, from 256
//!   one-page leaves at page 1, and a whole 256-page run at page 16.

#[path = "run_index_proto/check.rs"]
mod check;
#[path = "run_index_proto/hash.rs"]
mod hash;
#[path = "run_index_proto/tree.rs"]
mod tree;

use std::hint::black_box;
use std::time::Instant;

use tree::Tree;

fn prompt(n: usize) -> Vec<i32> {
    (0..n).map(|i| ((i * 7919) % 32000) as i32).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// A tree (page `ps`) holding `tokens` as one cached, unheld chain.
fn cached(ps: usize, events: bool, tokens: &[i32]) -> Tree {
    let mut t = Tree::new(ps, 1, events, false);
    let (_, root) = t.match_and_lock(0, tokens, 0, &mut Vec::new());
    let pages: Vec<u32> = (0..(tokens.len() / ps) as u32).collect();
    let last = t.insert(root, tokens, 0, &pages, &mut Vec::new());
    t.unlock(last);
    t.events.clear();
    t.event_tokens.clear();
    t
}

#[inline(never)]
fn op_match_unlock(t: &mut Tree, p: &[i32], limit: usize, out: &mut Vec<u32>) -> usize {
    let (m, last) = t.match_and_lock(0, p, limit, out);
    t.unlock(last);
    m
}

#[inline(never)]
fn op_insert(t: &mut Tree, from: u32, p: &[i32], pos: usize, pages: &[u32]) -> u32 {
    t.insert(from, p, pos, pages, &mut Vec::new())
}

#[inline(never)]
fn op_unlock(t: &mut Tree, last: u32) {
    t.unlock(last)
}

#[inline(never)]
fn op_evict(t: &mut Tree, n: usize, freed: &mut Vec<u32>) -> usize {
    t.evict(n, freed)
}

fn match_unlock(ps: usize, runs: bool, reps: usize) -> f64 {
    let p = prompt(4096);
    let mut t = cached(ps, true, &p);
    if runs {
        // Give every 64-token boundary a sibling, so the path is 64 runs.
        for k in 1..64 {
            let mut q = p[..64 * k].to_vec();
            q.extend(std::iter::repeat(-1 - k as i32).take(ps));
            let (pos, last) = t.match_and_lock(0, &q, q.len(), &mut Vec::new());
            let last = t.insert(last, &q, pos, &[100_000 + k as u32], &mut Vec::new());
            t.unlock(last);
        }
    }
    let mut out = Vec::with_capacity(4096);
    let mut samples = Vec::new();
    for _ in 0..reps {
        out.clear();
        let t0 = Instant::now();
        let m = op_match_unlock(&mut t, &p, 4096 - ps, &mut out);
        samples.push(t0.elapsed().as_nanos() as f64 / 1e3);
        assert_eq!(m, 4096 - ps);
        black_box(&out);
    }
    median(samples)
}

fn insert_4096(ps: usize, events: bool, hashes: bool, reps: usize) -> f64 {
    let p = prompt(4096);
    let pages: Vec<u32> = (0..(4096 / ps) as u32).collect();
    let mut t = Tree::new(ps, 1, events, hashes);
    let mut freed = Vec::new();
    let mut samples = Vec::new();
    for _ in 0..reps {
        let (_, root) = t.match_and_lock(0, &p, 0, &mut Vec::new());
        let t0 = Instant::now();
        let last = op_insert(&mut t, root, &p, 0, &pages);
        samples.push(t0.elapsed().as_nanos() as f64 / 1e3);
        t.unlock(last);
        assert_eq!(t.evict(usize::MAX, &mut freed), 4096 / ps);
        freed.clear();
        t.events.clear();
        t.event_tokens.clear();
    }
    median(samples)
}

fn insert_tail(reps: usize) -> f64 {
    let p = prompt(4096 + 264);
    let mut t = cached(1, true, &p[..4096]);
    let pages: Vec<u32> = (5000..5264).collect();
    let (mut out, mut freed) = (Vec::new(), Vec::new());
    let mut samples = Vec::new();
    for _ in 0..reps {
        out.clear();
        let (pos, last) = t.match_and_lock(0, &p, 4096, &mut out);
        let t0 = Instant::now();
        let last = op_insert(&mut t, last, &p, pos, &pages);
        samples.push(t0.elapsed().as_nanos() as f64 / 1e3);
        t.unlock(last);
        assert_eq!(t.evict(264, &mut freed), 264);
        freed.clear();
        t.events.clear();
        t.event_tokens.clear();
    }
    median(samples)
}

fn unlock_only(shared: bool, reps: usize) -> f64 {
    let p = prompt(4096);
    let mut t = cached(1, true, &p);
    let mut out = Vec::new();
    if shared {
        t.match_and_lock(0, &p, 4095, &mut out);
    }
    let mut samples = Vec::new();
    for _ in 0..reps {
        out.clear();
        let (_, last) = t.match_and_lock(0, &p, 4095, &mut out);
        let t0 = Instant::now();
        op_unlock(&mut t, last);
        samples.push(t0.elapsed().as_nanos() as f64 / 1e3);
    }
    median(samples)
}

/// `leaves`: 256 one-page leaves under a 16-token prefix, else one chain of
/// 4096 tokens (page 1: the tail of its run; page 16: all of it).
fn evict_256(ps: usize, leaves: bool, reps: usize) -> f64 {
    let p = prompt(4096);
    let mut freed = Vec::with_capacity(4096);
    let mut samples = Vec::new();
    for _ in 0..reps {
        let mut t = cached(ps, true, &p[..if leaves { 16 } else { 4096 }]);
        if leaves {
            for k in 0..256 {
                let mut q = p[..16].to_vec();
                q.push(40_000 + k);
                let (pos, last) = t.match_and_lock(0, &q, q.len(), &mut Vec::new());
                let last = t.insert(last, &q, pos, &[10_000 + k as u32], &mut Vec::new());
                t.unlock(last);
            }
            t.events.clear();
        }
        freed.clear();
        let t0 = Instant::now();
        let n = op_evict(&mut t, 256, &mut freed);
        samples.push(t0.elapsed().as_nanos() as f64 / 1e3);
        assert_eq!(n, 256);
        assert_eq!(t.events.len(), 256);
    }
    median(samples)
}

/// The randomized self-test (`--check`; also `cargo test`, where the example is
/// built as a test so the prototype cannot rot while the design waits).
fn self_test() {
    // The fast paths (page 1, page 16) hash what the definition does.
    for ps in [1usize, 2, 15, 16, 17, 300] {
        let toks: Vec<i32> = (0..ps as i32).map(|i| i * 7919 - 3).collect();
        let parent = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210u128 ^ ps as u128;
        assert_eq!(
            hash::page(9, parent, &toks),
            hash::reference(9, parent, &toks)
        );
    }
    for seed in 1..=6u64 {
        for ps in [1, 2, 4] {
            check::self_test(seed * 7 + ps as u64, ps, seed % 2 == 1, 1500);
        }
    }
}

#[test]
fn prototype_passes_its_self_test() {
    self_test();
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let has = |f: &str| args.iter().any(|a| a == f);
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1).cloned());
    if has("--check") {
        self_test();
    }
    let reps = if has("--quick") { 50 } else { 400 };
    let mut json = Vec::new();
    let mut row = |name: &str, f: &dyn Fn() -> f64| {
        if only.as_deref().map_or(true, |o| o == name) {
            let v = f();
            println!("{name:<40} {v:>8.2} us");
            json.push(format!("\"{name}\": {v:.3}"));
        }
    };
    row("match_unlock_4096_page1", &|| match_unlock(1, false, reps));
    row("match_unlock_4096_page1_64runs", &|| {
        match_unlock(1, true, reps)
    });
    row("match_unlock_4096_page16", &|| {
        match_unlock(16, false, reps)
    });
    row("insert_4096_page1", &|| insert_4096(1, true, true, reps));
    row("insert_4096_page1_no_events", &|| {
        insert_4096(1, false, false, reps)
    });
    row("insert_4096_page1_hashes_no_events", &|| {
        insert_4096(1, false, true, reps)
    });
    row("insert_4096_page16", &|| insert_4096(16, true, true, reps));
    row("insert_4096_page16_no_events", &|| {
        insert_4096(16, false, false, reps)
    });
    row("insert_tail_264_page1", &|| insert_tail(reps));
    row("unlock_4096_page1_shared", &|| unlock_only(true, reps));
    row("unlock_4096_page1_to_cached", &|| unlock_only(false, reps));
    row("evict_256_page1_run_tail", &|| evict_256(1, false, reps));
    row("evict_256_page1_leaves", &|| evict_256(1, true, reps));
    row("evict_256_page16_run", &|| evict_256(16, false, reps));
    println!("{{{}}}", json.join(", "));
}
