//! Core-only timings (no Python):
//!   cargo run --release -p kvpool-core --example bench_core [-- --quick]
//! Prints one line per figure and a JSON object on the last line.
//!
//! - decode extend: 256 requests at page 16, one token each into their own
//!   last page (no page changes hands), per request; warm, and with L1/L2
//!   flushed between calls (a 4 MiB buffer touched, untimed); with token ids;
//!   writing a request-to-token table, also with the requests at 16
//!   different offsets in their pages (each step 1/16 take a new page); 1M
//!   and 16M slots.
//! - open_with_prefix of one fully cached 4096-token prompt (page 16),
//!   hashing included; with and without hit verification.
//! - cache() of a 4096-token request, with KV events recorded (the
//!   default) and without; evict(256).
//! - at page 1 (every token a page): open_with_prefix and cache() of a
//!   4096-token prompt (cache() also without events: the internal chain),
//!   and close() of a request holding it, shared with another request or
//!   the last holder (every page back to CACHED); cache() of 256 requests'
//!   output pages, written by 256 interleaved decode steps (scattered and
//!   cold, as a finished request's are) or appended in one extend.

use std::hint::black_box;
use std::time::Instant;

use kvpool_core::{Counts, Options, SlotAllocator, SlotTable};

fn pool(slots: usize, ps: usize, verify: bool) -> SlotAllocator {
    pool_with(slots, ps, verify, true)
}

fn pool_with(slots: usize, ps: usize, verify: bool, events: bool) -> SlotAllocator {
    let opts = Options {
        hash_seed: Some(1),
        skip_hit_verification: !verify,
        kv_events: events,
        ..Options::new()
    };
    SlotAllocator::with_options(slots / ps, ps, 512, 8192, opts).unwrap()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

struct Flusher(Vec<u64>);
impl Flusher {
    fn flush(&mut self) {
        for x in self.0.iter_mut().step_by(8) {
            *x = x.wrapping_add(1);
        }
        black_box(&self.0);
    }
}

/// ns per request of a decode extend (one token, no new page) of 256 requests;
/// with `table`, also writing a `[512, 8192]` request-to-token table (rows
/// padded to an odd number of cache lines, as KVPool allocates it).
/// With `staggered`, the requests sit at 16 different offsets in their last
/// page, as in a real batch, and each sample runs 3500 steps: each step
/// 1/16 of them take a new page and move to a table line not touched for
/// a whole sample (3.5 MiB of lines, past L2), as a server's growing
/// requests do, in shuffled order; the unstaggered run truncates back to
/// the same lines every 14 steps.
fn decode(
    slots: usize,
    flush: bool,
    tokens: bool,
    table: bool,
    staggered: bool,
    reps: usize,
) -> f64 {
    let ps = 16;
    let mut a = pool(slots, ps, true);
    // Spread the requests over the pool like a long-running server: each
    // request's pages are scattered (other requests' pages in between).
    let h = a.open(512).unwrap();
    for _ in 0..8 {
        a.extend(&h, Counts::Each(ps as i64), None).unwrap();
    }
    let mut h: Vec<i64> = h.iter().step_by(2).copied().collect();
    if staggered {
        // A server's batch lists its requests in no row order (rows come
        // off a free stack): in row order the hardware's stride prefetcher
        // would fetch each next table line ahead.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for i in (1..h.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            h.swap(i, (x % (i as u64 + 1)) as usize);
        }
    }
    let base: Vec<i64> = (0..h.len())
        .map(|i| 8 * ps as i64 + 1 + if staggered { (i % ps) as i64 } else { 0 })
        .collect();
    a.truncate(&h, Counts::Each(8 * ps as i64)).unwrap();
    let start: Vec<i64> = base.iter().map(|b| b - 8 * ps as i64).collect();
    a.extend(&h, Counts::PerRequest(&start), None).unwrap();
    let steps = if staggered { 3500 } else { ps - 2 };
    let mut out = vec![0i64; h.len()];
    let toks = vec![7i64; h.len()];
    let stride = 8192 + 16;
    let mut rows = vec![0i32; 512 * stride];
    let mut f = Flusher(vec![0; 1 << 19]);
    let mut samples = Vec::new();
    for _ in 0..if staggered { reps.div_ceil(20) } else { reps } {
        let mut t = 0f64;
        for _ in 0..steps {
            if flush {
                f.flush();
            }
            let t0 = Instant::now();
            let mut view = SlotTable::new(&mut rows, stride);
            a.extend_into_table(
                &h,
                Counts::Each(1),
                tokens.then_some(&toks[..]),
                &mut out,
                table.then_some(&mut view),
                |_| {},
            )
            .unwrap();
            t += t0.elapsed().as_nanos() as f64;
            black_box(&out);
        }
        samples.push(t / (steps * h.len()) as f64);
        a.truncate(&h, Counts::PerRequest(&base)).unwrap();
    }
    median(samples)
}

fn serve_prompt(a: &mut SlotAllocator, prompt: &[i64]) {
    let (h, c) = a
        .open_with_prefix(prompt, &[prompt.len() as i64], Counts::Each(0))
        .unwrap();
    a.extend(&h, Counts::Each(prompt.len() as i64 - c[0]), None)
        .unwrap();
    a.close(&h, true).unwrap();
}

/// us of open_with_prefix of a fully cached 4096-token prompt at page `ps`;
/// with `shared`, another open request holds the same pages (the hit adds a
/// holder to HELD pages, as a shared system prompt's does), else they are
/// CACHED (the hit takes them off the eviction list).
fn prefix_hit(ps: usize, verify: bool, shared: bool, reps: usize) -> f64 {
    let mut a = pool(1 << 20, ps, verify);
    let prompt: Vec<i64> = (0..4096).map(|i| (i * 7919) % 32000).collect();
    serve_prompt(&mut a, &prompt);
    let other = shared.then(|| {
        a.open_with_prefix(&prompt, &[4096], Counts::Each(0))
            .unwrap()
            .0
    });
    let mut samples = Vec::new();
    for _ in 0..reps {
        let t0 = Instant::now();
        let (h, c) = a
            .open_with_prefix(&prompt, &[4096], Counts::Each(0))
            .unwrap();
        samples.push(t0.elapsed().as_nanos() as f64 / 1e3);
        assert_eq!(c[0], 4096 - ps as i64);
        a.close(&h, false).unwrap();
    }
    black_box(other);
    median(samples)
}

/// us of close() of a request holding a fully cached 4096-token prompt at
/// page `ps`: with `shared`, a second request holds the same pages (each
/// release only drops a reference), else every page becomes CACHED again.
fn close_hit(ps: usize, shared: bool, reps: usize) -> f64 {
    let mut a = pool(1 << 20, ps, true);
    let prompt: Vec<i64> = (0..4096).map(|i| (i * 7919) % 32000).collect();
    serve_prompt(&mut a, &prompt);
    let other = if shared {
        Some(
            a.open_with_prefix(&prompt, &[4096], Counts::Each(0))
                .unwrap()
                .0,
        )
    } else {
        None
    };
    let mut samples = Vec::new();
    for _ in 0..reps {
        let (h, _) = a
            .open_with_prefix(&prompt, &[4096], Counts::Each(0))
            .unwrap();
        let t0 = Instant::now();
        a.close(&h, false).unwrap();
        samples.push(t0.elapsed().as_nanos() as f64 / 1e3);
    }
    black_box(other);
    median(samples)
}

/// us of cache() of a 4096-token request at page `ps` (4096 / ps new
/// registrations); with `events`, each one records a Stored event (the
/// default), else none (`kv_events=False`).
fn cache_4096(ps: usize, events: bool, reps: usize) -> f64 {
    let mut a = pool_with(1 << 20, ps, true, events);
    let prompt: Vec<i64> = (0..4096).map(|i| (i * 7919) % 32000).collect();
    let mut samples = Vec::new();
    for _ in 0..reps {
        let h = a.open(1).unwrap();
        a.extend(&h, Counts::Each(4096), Some(&prompt)).unwrap();
        let t0 = Instant::now();
        a.cache(&h).unwrap();
        samples.push(t0.elapsed().as_nanos() as f64 / 1e3);
        a.close(&h, false).unwrap();
        a.clear_cache();
        a.take_events();
    }
    median(samples)
}

/// ns a page of cache() registering 256 requests' last 256 tokens at page
/// 1: with `decoded`, written one decode step at a time for all 256
/// requests together (each request's output pages lie ~256 pages apart,
/// and were written long before, as at `close(cache=True)`), else
/// appended to each request in one extend just before (a prompt's pages).
fn cache_outputs_page1(decoded: bool, reps: usize) -> f64 {
    const N: usize = 256;
    let mut a = pool(1 << 20, 1, true);
    let mut samples = Vec::new();
    for rep in 0..reps.div_ceil(10) {
        let h = a.open(N).unwrap();
        // Distinct prompts, so that nothing is shared or hit.
        let prompts: Vec<i64> = (0..N * 64)
            .map(|i| ((i + rep * N * 64) * 7919 % 32000) as i64)
            .collect();
        a.extend(&h, Counts::Each(64), Some(&prompts)).unwrap();
        a.cache(&h).unwrap();
        let out: Vec<i64> = (0..N * N).map(|i| (i * 31 % 32000) as i64).collect();
        if decoded {
            for step in out.chunks_exact(N) {
                a.extend(&h, Counts::Each(1), Some(step)).unwrap();
            }
        } else {
            // Request r's outputs in order: out[r * N..(r + 1) * N].
            let by_row: Vec<i64> = (0..N * N).map(|i| out[(i % N) * N + i / N]).collect();
            a.extend(&h, Counts::Each(N as i64), Some(&by_row)).unwrap();
        }
        for &r in &h {
            let t0 = Instant::now();
            a.cache(&[r]).unwrap();
            samples.push(t0.elapsed().as_nanos() as f64 / N as f64);
        }
        a.close(&h, false).unwrap();
        a.clear_cache();
        a.take_events();
    }
    median(samples)
}

/// us of evict(256) with 256 CACHED pages.
fn evict_256(reps: usize) -> f64 {
    evict_pages(16, 256, reps)
}

/// us of evict(n) of a cached prompt's `n` pages at page size `ps` (each a
/// Removed event).
fn evict_pages(ps: usize, n: usize, reps: usize) -> f64 {
    let mut a = pool(1 << 20, ps, true);
    let prompt: Vec<i64> = (0..(n * ps + 1) as i64)
        .map(|i| (i * 7919) % 32000)
        .collect();
    let mut samples = Vec::new();
    for _ in 0..reps {
        serve_prompt(&mut a, &prompt);
        a.take_events();
        let t0 = Instant::now();
        let got = a.evict(n);
        samples.push(t0.elapsed().as_nanos() as f64 / 1e3);
        assert_eq!(got, n);
    }
    median(samples)
}

/// us of one extend by 4096 tokens at page 1 that takes every page by
/// eviction: the free stack is empty and 4096 CACHED pages are the victims
/// (a prompt admitted under memory pressure).
fn extend_evicting_4096_page1(reps: usize) -> f64 {
    const N: usize = 4096;
    // N + 1 pages (page 0 reserved): one served prompt of N tokens fills
    // the pool with CACHED pages.
    let mut a = pool(N + 1, 1, true);
    let mut samples = Vec::new();
    for rep in 0..reps {
        let prompt: Vec<i64> = (0..N as i64)
            .map(|i| (i * 7919 + rep as i64) % 32000)
            .collect();
        serve_prompt(&mut a, &prompt);
        a.take_events();
        let h = a.open(1).unwrap();
        let t0 = Instant::now();
        a.extend(&h, Counts::Each(N as i64), None).unwrap();
        samples.push(t0.elapsed().as_nanos() as f64 / 1e3);
        a.close(&h, false).unwrap();
    }
    median(samples)
}

/// ns a request of a decode step of 256 requests at page `ps` on a pool
/// with no FREE page (every page not held is CACHED), over 64 steps. At
/// page 1 every request takes a page by eviction each step. Above it the
/// requests' lengths are staggered, so each step about 256 / `ps` of them
/// cross a page boundary and take one, as in a long-running server whose
/// cache has filled the pool.
fn decode_evicting(ps: usize, reps: usize) -> f64 {
    const ROWS: usize = 256;
    const STEPS: usize = 64;
    // Page 1: exactly the pages the steps take; above: room for the
    // staggered start and the steps' new pages.
    let pages = if ps == 1 { ROWS * STEPS } else { ROWS * 8 };
    let mut a = SlotAllocator::with_options(
        pages + 1,
        ps,
        ROWS,
        pages * ps,
        Options {
            hash_seed: Some(1),
            ..Options::new()
        },
    )
    .unwrap();
    let tokens = vec![7i64; ROWS];
    let mut samples = Vec::new();
    for rep in 0..reps.div_ceil(10) {
        let prompt: Vec<i64> = (0..(pages * ps) as i64)
            .map(|i| (i * 7919 + rep as i64) % 32000)
            .collect();
        serve_prompt(&mut a, &prompt);
        a.take_events();
        let h = a.open(ROWS).unwrap();
        if ps > 1 {
            let stagger: Vec<i64> = (0..ROWS as i64).map(|i| 1 + i % ps as i64).collect();
            a.extend(&h, Counts::PerRequest(&stagger), None).unwrap();
        }
        let t0 = Instant::now();
        for _ in 0..STEPS {
            a.extend(&h, Counts::Each(1), Some(&tokens)).unwrap();
        }
        samples.push(t0.elapsed().as_nanos() as f64 / (ROWS * STEPS) as f64);
        a.take_events();
        a.close(&h, false).unwrap();
    }
    median(samples)
}

fn main() {
    // An unknown flag (a misspelt --quick) ran the whole full-length run as if it were absent.
    let given: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < given.len() {
        match given[i].as_str() {
            "--quick" | "--decode" | "--prefix" => {}
            "--only" if i + 1 < given.len() => i += 1,
            bad => {
                eprintln!("bench_core: unknown argument {bad:?}; takes --quick, --decode, --prefix and --only NAME");
                std::process::exit(2);
            }
        }
        i += 1;
    }
    let quick = std::env::args().any(|a| a == "--quick");
    let decode_only = std::env::args().any(|a| a == "--decode");
    let reps = if quick { 50 } else { 400 };
    let mut json = Vec::new();
    let mut report = |name: &str, unit: &str, v: f64| {
        println!("{name:<48} {v:>8.2} {unit}");
        json.push(format!("\"{name}\": {v:.3}"));
    };
    // `--only NAME`: that row's work alone (the others return at once), for
    // an instruction count of one row under `valgrind --tool=callgrind`.
    let args: Vec<String> = std::env::args().collect();
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1).cloned());
    let wanted = |name: &str| only.as_deref().map_or(true, |o| o == name);
    macro_rules! row {
        ($name:expr, $unit:expr, $v:expr $(,)?) => {{
            let name: &str = &$name;
            if wanted(name) {
                report(name, $unit, $v);
            }
        }};
    }
    let prefix_only = std::env::args().any(|a| a == "--prefix");
    for (label, slots) in [("1M", 1usize << 20), ("16M", 1 << 24)] {
        if prefix_only {
            break;
        }
        row!(
            &format!("decode_extend_ns_per_req_{label}_warm"),
            "ns",
            decode(slots, false, false, false, false, reps),
        );
        row!(
            &format!("decode_extend_ns_per_req_{label}_flushed"),
            "ns",
            decode(slots, true, false, false, false, reps),
        );
        row!(
            &format!("decode_extend_tokens_ns_per_req_{label}_warm"),
            "ns",
            decode(slots, false, true, false, false, reps),
        );
        row!(
            &format!("decode_extend_table_ns_per_req_{label}_warm"),
            "ns",
            decode(slots, false, false, true, false, reps),
        );
        row!(
            &format!("decode_extend_table_staggered_ns_per_req_{label}_warm"),
            "ns",
            decode(slots, false, false, true, true, reps),
        );
    }
    if decode_only {
        return;
    }
    row!(
        "open_with_prefix_4096_us",
        "us",
        prefix_hit(16, true, false, reps)
    );
    row!(
        "open_with_prefix_4096_unverified_us",
        "us",
        prefix_hit(16, false, false, reps),
    );
    row!("cache_4096_us", "us", cache_4096(16, true, reps));
    row!("cache_4096_no_events_us", "us", cache_4096(16, false, reps));
    // Page 1, where SGLang's radix tree is hardest to beat: every token is
    // a page to hash, look up, hold and release.
    row!(
        "open_with_prefix_4096_page1_us",
        "us",
        prefix_hit(1, true, false, reps),
    );
    row!(
        "open_with_prefix_4096_shared_page1_us",
        "us",
        prefix_hit(1, true, true, reps),
    );
    row!("cache_4096_page1_us", "us", cache_4096(1, true, reps));
    // Without events the index keys by its internal chain (`prefix/hashing.rs`).
    row!(
        "cache_4096_page1_no_events_us",
        "us",
        cache_4096(1, false, reps),
    );
    row!("close_4096_shared_page1_us", "us", close_hit(1, true, reps));
    row!(
        "close_4096_to_cached_page1_us",
        "us",
        close_hit(1, false, reps),
    );
    row!(
        "cache_decoded_outputs_page1_ns_per_page",
        "ns",
        cache_outputs_page1(true, reps),
    );
    row!(
        "cache_appended_outputs_page1_ns_per_page",
        "ns",
        cache_outputs_page1(false, reps),
    );
    row!("evict_256_us", "us", evict_256(reps));
    row!("evict_4096_page1_us", "us", evict_pages(1, 4096, reps));
    row!(
        "decode_evicting_page1_ns_per_req",
        "ns",
        decode_evicting(1, reps),
    );
    row!(
        "decode_evicting_page16_ns_per_req",
        "ns",
        decode_evicting(16, reps),
    );
    row!(
        "extend_evicting_4096_page1_us",
        "us",
        extend_evicting_4096_page1(reps),
    );
    println!("{{{}}}", json.join(", "));
}
