//! The first admission on a fresh allocator against the same admission on a
//! warm one, and the construction time (no Python):
//!   cargo run --release -p kvpool-core --example first_burst [-- --quick] [--lazy]
//! Cases: 256 prompts of 64-4096 tokens (528K in all), 256 x 2048 tokens, and
//! the first again with the prompts' token ids (as a prefix-caching engine),
//! at page 1 and 16, in pools of 1M and 16M slots, each written with its
//! request-to-token table (already resident, as an engine's is). "warm" is
//! the same admission again after closing the first: the allocator's pages
//! are then back on its free stack. Both are timed after the same cache flush
//! (twice the largest cache the kernel reports, at least 64 MiB: cloud VMs
//! report L3s of hundreds of MiB), so the ratio is what being fresh costs,
//! not which admission found its lines in cache. Every run is a fresh process (this
//! program runs itself), as a server builds its pool once at start-up: in a
//! process that has freed an allocator before, the C allocator hands the next
//! one recycled memory, which it zeroes at construction, and the first
//! admission then looks warm. The close of each admission is timed too (its
//! first release of a page reads the page's record). Minor page faults are counted from
//! /proc/self/stat. Prints one line per case and a JSON array on the last line.

use std::time::Instant;

use kvpool_core::{Options, SlotAllocator, SlotTable};

const ROWS: usize = 256;
const CTX: usize = 4096;
const STRIDE: usize = 4112; // an odd number of 64-byte lines, as KVPool pads req_to_token

fn minor_faults() -> u64 {
    // Field 10 of /proc/self/stat (after the parenthesised command name).
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let rest = &s[s.rfind(')')? + 2..];
            rest.split_whitespace().nth(7)?.parse().ok()
        })
        .unwrap_or(0)
}

fn mixed_prompts() -> Vec<i64> {
    // 256 lengths uniform in [64, 4096] from a fixed LCG, scaled to 528K tokens.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let raw: Vec<f64> = (0..ROWS)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            64.0 + ((x >> 33) % 4033) as f64
        })
        .collect();
    let sum: f64 = raw.iter().sum();
    raw.iter()
        .map(|r| (r * 528.0 * 1024.0 / sum) as i64)
        .collect()
}

struct Run {
    build_ms: f64,
    cold_ns: f64,
    warm_ns: f64,
    cold_faults: u64,
    close_cold_ns: f64,
    close_warm_ns: f64,
}

/// Words to write for a cache flush: twice the largest cache level in
/// /sys, at least 64 MiB and at most 2 GiB.
fn flush_words() -> usize {
    let largest = (0..8)
        .filter_map(|i| {
            let path = format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size");
            let text = std::fs::read_to_string(path).ok()?;
            let text = text.trim();
            let (num, scale) = match text.as_bytes().last()? {
                b'K' => (&text[..text.len() - 1], 1usize << 10),
                b'M' => (&text[..text.len() - 1], 1 << 20),
                b'G' => (&text[..text.len() - 1], 1 << 30),
                _ => (text, 1),
            };
            Some(num.parse::<usize>().ok()? * scale)
        })
        .max()
        .unwrap_or(0);
    (2 * largest).clamp(64 << 20, 2 << 30) / 8
}

fn flush(buf: &mut [u64]) {
    for x in buf.iter_mut().step_by(8) {
        *x = x.wrapping_add(1);
    }
    std::hint::black_box(buf);
}

fn run(
    slots: usize,
    ps: usize,
    lazy: bool,
    with_ids: bool,
    counts: &[i64],
    table: &mut [i32],
    out: &mut [i64],
) -> Run {
    let total: i64 = counts.iter().sum();
    // Token ids of every prompt position (what a prefix-caching engine passes).
    let ids: Vec<i64> = (0..total).map(|i| (i * 7919) % 32000).collect();
    let ids = with_ids.then_some(ids.as_slice());
    let t0 = Instant::now();
    let opts = Options {
        lazy_metadata: lazy,
        ..Options::new()
    };
    let mut a = SlotAllocator::with_options(slots / ps, ps, ROWS, CTX, opts).unwrap();
    let build = t0.elapsed();
    // After construction, which it would leave fewer free huge pages.
    let mut cache = vec![1u64; flush_words()];
    let mut handles = Vec::new();
    flush(&mut cache);
    let f0 = minor_faults();
    let t1 = Instant::now();
    {
        let mut t = SlotTable::new(table, STRIDE);
        a.admit_into(counts, ids, out, Some(&mut t), &mut handles, |_| {})
            .unwrap();
    }
    let cold = t1.elapsed();
    let faults = minor_faults() - f0;
    flush(&mut cache);
    let tc = Instant::now();
    a.close(&handles, false).unwrap();
    let close_cold = tc.elapsed();
    handles.clear();
    flush(&mut cache);
    let t2 = Instant::now();
    {
        let mut t = SlotTable::new(table, STRIDE);
        a.admit_into(counts, ids, out, Some(&mut t), &mut handles, |_| {})
            .unwrap();
    }
    let warm = t2.elapsed();
    flush(&mut cache);
    let tc = Instant::now();
    a.close(&handles, false).unwrap();
    let close_warm = tc.elapsed();
    a.check().unwrap();
    Run {
        build_ms: build.as_secs_f64() * 1e3,
        cold_ns: cold.as_secs_f64() * 1e9 / total as f64,
        warm_ns: warm.as_secs_f64() * 1e9 / total as f64,
        cold_faults: faults,
        close_cold_ns: close_cold.as_secs_f64() * 1e9 / total as f64,
        close_warm_ns: close_warm.as_secs_f64() * 1e9 / total as f64,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// One run in this process: `--one <prompts> <slots> <page size> <lazy 0/1>`; prints
/// "build_ms cold_ns warm_ns cold_faults".
fn one(args: &[String]) {
    let counts = if args[0].starts_with("mixed") {
        mixed_prompts()
    } else {
        vec![2048i64; ROWS]
    };
    let with_ids = args[0].ends_with("ids");
    let (slots, ps): (usize, usize) = (args[1].parse().unwrap(), args[2].parse().unwrap());
    let lazy = args[3] == "1";
    let total: i64 = counts.iter().sum();
    // Resident, as an engine's table and slot buffer are (a zeroed Vec is only
    // address space until written).
    let mut table = vec![-1i32; (ROWS + 1) * STRIDE];
    let mut out = vec![-1i64; total as usize];
    let r = run(slots, ps, lazy, with_ids, &counts, &mut table, &mut out);
    println!(
        "{} {} {} {} {} {}",
        r.build_ms, r.cold_ns, r.warm_ns, r.cold_faults, r.close_cold_ns, r.close_warm_ns
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--one") {
        return one(&args[i + 1..]);
    }
    // An unknown flag (a misspelt --lazy) ran the whole default run as if it were absent.
    if let Some(bad) = args[1..]
        .iter()
        .find(|a| !matches!(a.as_str(), "--quick" | "--lazy"))
    {
        eprintln!("first_burst: unknown argument {bad:?}; takes --quick and --lazy");
        std::process::exit(2);
    }
    let quick = args.iter().any(|a| a == "--quick");
    // --lazy: Options::lazy_metadata (the page lists mapped on first use).
    let lazy = if args.iter().any(|a| a == "--lazy") {
        "1"
    } else {
        "0"
    };
    let reps = if quick { 1 } else { 7 };
    let me = std::env::current_exe().unwrap();
    let mut json = Vec::new();
    for name in ["mixed", "2048", "mixed-ids"] {
        let total: i64 = if name.starts_with("mixed") {
            mixed_prompts().iter().sum()
        } else {
            2048 * ROWS as i64
        };
        for slots in [1usize << 20, 1 << 24] {
            for ps in [1usize, 16] {
                let runs: Vec<Vec<f64>> = (0..reps)
                    .map(|_| {
                        let out = std::process::Command::new(&me)
                            .args(["--one", name, &slots.to_string(), &ps.to_string(), lazy])
                            .output()
                            .unwrap();
                        String::from_utf8(out.stdout)
                            .unwrap()
                            .split_whitespace()
                            .map(|x| x.parse().unwrap())
                            .collect()
                    })
                    .collect();
                let col = |i: usize| median(runs.iter().map(|r| r[i]).collect());
                let (build, cold, warm, faults) = (col(0), col(1), col(2), col(3));
                let (close_cold, close_warm) = (col(4), col(5));
                println!(
                    "{name:>5} prompts ({total} tokens), {:>2}M slots, page {ps:>2}: construct {build:7.2} ms, \
                     first admit {cold:5.2} ns/token ({faults:.0} faults), warm {warm:5.2} ns/token, first/warm {:.2}; \
                     first close {close_cold:5.2} ns/token, warm {close_warm:5.2}",
                    slots >> 20,
                    cold / warm
                );
                json.push(format!(
                    "{{\"lazy_metadata\":{},\"prompts\":\"{name}\",\"tokens\":{total},\"slots\":{slots},\"page_size\":{ps},\
                     \"construct_ms\":{build:.3},\"first_ns_per_token\":{cold:.3},\"warm_ns_per_token\":{warm:.3},\
                     \"first_over_warm\":{:.3},\"first_minor_faults\":{faults:.0},\
                     \"first_close_ns_per_token\":{close_cold:.3},\"warm_close_ns_per_token\":{close_warm:.3}}}",
                    lazy == "1",
                    cold / warm
                ));
            }
        }
    }
    println!("[{}]", json.join(","));
}
