//! Core timings of retention priorities (no Python):
//!   cargo run --release -p kvpool-core --example bench_priorities [-- --quick]
//! Prints one line per figure and a JSON object on the last line.
//!
//! - evict(256) on a page-1 pool whose cached pages are spread over all 101
//!   priorities (and some pinned), with 16K and with 1M cached pages: the
//!   same work whatever the cache's size (a victim is the oldest page of the
//!   lowest non-empty priority), next to evict(256) on the one-list policy;
//! - an extend of 256 pages that evicts them all (the take-page path);
//! - cache() of a 4096-token request at page 16 with a priority (the walk
//!   over its prefix and a priority per page), next to plain cache();
//! - close() of a request at page 1 holding 4096 cached pages with a
//!   priority (each filed on its priority's list), next to the same close
//!   on the one-list policy;
//! - set_clock ending 4096 durations that end together, per page.

use std::hint::black_box;
use std::time::Instant;

use kvpool_core::{Counts, Options, SlotAllocator};

fn pool(pages: usize, ps: usize) -> SlotAllocator {
    let opts = Options {
        hash_seed: Some(1),
        manual_clock: true,
        max_pinned_pages: Some(pages / 8),
        ..Options::new()
    };
    SlotAllocator::with_options(pages, ps, 512, 1 << 16, opts).unwrap()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// A prompt of `n` tokens no other call uses (seed `k`).
fn prompt(k: usize, n: usize) -> Vec<i64> {
    (0..n)
        .map(|i| ((k * 1_000_003 + i * 7919) % 2_000_000_000) as i64)
        .collect()
}

/// Opens, prefills and closes `prompt` with priority `q` (None: plain).
fn serve(a: &mut SlotAllocator, prompt: &[i64], q: Option<i64>) {
    let (h, c) = a
        .open_with_prefix(prompt, &[prompt.len() as i64], Counts::Each(0))
        .unwrap();
    a.extend(&h, Counts::Each(prompt.len() as i64 - c[0]), None)
        .unwrap();
    match q {
        Some(q) => a.close_with_priority(&h, Counts::Each(q), None).unwrap(),
        None => a.close(&h, true).unwrap(),
    }
}

/// us of evict(256) on a page-1 pool holding `cached` cached pages, spread
/// over the 101 priorities (`levels`) or all on the one list; each sample
/// then caches 256 pages again at the next priority in turn.
fn evict_256(cached: usize, levels: bool, reps: usize) -> f64 {
    let mut a = pool(cached + 4096, 1);
    let chunk = 4096;
    for k in 0..cached / chunk {
        serve(
            &mut a,
            &prompt(k, chunk + 1),
            levels.then_some((k % 101) as i64),
        );
    }
    if levels {
        // Some pins, never victims.
        serve(&mut a, &prompt(usize::MAX / 2, 1025), Some(100));
    }
    a.take_events();
    let mut samples = Vec::new();
    for r in 0..reps {
        let t0 = Instant::now();
        let n = a.evict(256);
        samples.push(t0.elapsed().as_nanos() as f64 / 1e3);
        assert_eq!(n, 256);
        serve(
            &mut a,
            &prompt(1_000_000 + r, 257),
            levels.then_some((r % 101) as i64),
        );
        a.take_events();
    }
    median(samples)
}

/// us of an extend taking 256 new pages at page 1 with no free page left,
/// so each one is evicted (priorities spread as in `evict_256`).
fn extend_evicting_256(cached: usize, reps: usize) -> f64 {
    let mut a = pool(cached + 1, 1);
    let chunk = 4096;
    for k in 0..cached / chunk {
        serve(&mut a, &prompt(k, chunk + 1), Some((k % 101) as i64));
    }
    a.take_events();
    let mut samples = Vec::new();
    for r in 0..reps {
        let h = a.open(1).unwrap();
        let t0 = Instant::now();
        a.extend(&h, Counts::Each(256), None).unwrap();
        samples.push(t0.elapsed().as_nanos() as f64 / 1e3);
        a.close(&h, false).unwrap();
        serve(&mut a, &prompt(1_000_000 + r, 257), Some((r % 101) as i64));
        a.take_events();
    }
    median(samples)
}

/// us of cache() of a 4096-token request at page 16, with priority 60 or
/// without.
fn cache_4096(priority: bool, reps: usize) -> f64 {
    let mut a = pool(1 << 16, 16);
    let p = prompt(7, 4096);
    if priority {
        serve(&mut a, &prompt(8, 33), Some(10)); // on the priority lists
    }
    let mut samples = Vec::new();
    for _ in 0..reps {
        let h = a.open(1).unwrap();
        a.extend(&h, Counts::Each(4096), Some(&p)).unwrap();
        let t0 = Instant::now();
        if priority {
            a.cache_with_priority(&h, Counts::Each(60), None).unwrap();
        } else {
            a.cache(&h).unwrap();
        }
        samples.push(t0.elapsed().as_nanos() as f64 / 1e3);
        a.close(&h, false).unwrap();
        a.clear_cache();
        a.take_events();
    }
    median(samples)
}

/// us of close() of a request holding a cached 4096-token prompt at page 1
/// (every page back to CACHED), the pages at priority 60 or on the one list.
fn close_to_cached(priority: bool, reps: usize) -> f64 {
    let mut a = pool(1 << 20, 1);
    let p = prompt(9, 4097);
    serve(&mut a, &p, priority.then_some(60));
    let mut samples = Vec::new();
    for _ in 0..reps {
        let (h, _) = a.open_with_prefix(&p, &[4097], Counts::Each(0)).unwrap();
        let t0 = Instant::now();
        a.close(&h, false).unwrap();
        samples.push(t0.elapsed().as_nanos() as f64 / 1e3);
    }
    median(samples)
}

/// ns per page of set_clock ending 4096 durations (cached pages at page 1
/// given priority 80 for 1 s, all ending together).
fn expire_4096(reps: usize) -> f64 {
    let mut a = pool(1 << 16, 1);
    let p = prompt(11, 4097);
    serve(&mut a, &p, None);
    let mut samples = Vec::new();
    for r in 0..reps {
        let (h, _) = a.open_with_prefix(&p, &[4097], Counts::Each(0)).unwrap();
        a.close_with_priority(&h, Counts::Each(80), Some(1.0))
            .unwrap();
        let t0 = Instant::now();
        a.set_clock(2.0 * (r + 1) as f64).unwrap();
        samples.push(t0.elapsed().as_nanos() as f64 / 4096.0);
        assert_eq!(a.evictable_pages_by_priority()[80], 0);
    }
    median(samples)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let reps = if quick { 30 } else { 300 };
    let mut json = Vec::new();
    let mut report = |name: &str, unit: &str, v: f64| {
        println!("{name:<48} {v:>8.2} {unit}");
        json.push(format!("\"{name}\": {v:.3}"));
    };
    for (label, cached) in [("16K", 1usize << 14), ("1M", 1 << 20)] {
        report(
            &format!("evict_256_lru_{label}_cached_us"),
            "us",
            evict_256(cached, false, reps),
        );
        report(
            &format!("evict_256_levels_{label}_cached_us"),
            "us",
            evict_256(cached, true, reps),
        );
        report(
            &format!("extend_evicting_256_levels_{label}_cached_us"),
            "us",
            extend_evicting_256(cached, reps),
        );
    }
    report("cache_4096_us", "us", cache_4096(false, reps));
    report("cache_4096_priority_us", "us", cache_4096(true, reps));
    report(
        "close_4096_to_cached_page1_us",
        "us",
        close_to_cached(false, reps),
    );
    report(
        "close_4096_to_cached_page1_priority_us",
        "us",
        close_to_cached(true, reps),
    );
    report("expire_4096_ns_per_page", "ns", expire_4096(reps));
    black_box(&json);
    println!("{{{}}}", json.join(", "));
}
