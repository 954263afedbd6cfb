//! A fresh pool maps the metadata its first burst of requests writes (the
//! request page lists, the token ids of the lowest slots, the page records)
//! when it is built, so the first admission takes no page faults there, and
//! the index's entry slab at its first `cache()`, so later registrations
//! take none either; `lazy_metadata` leaves them to be mapped on first use.
//! Linux only: faults are read from /proc/thread-self/stat. Not under Miri,
//! which can neither spawn the child processes nor build 1M-slot pools in
//! any reasonable time.
//!
//! Each measurement runs in a fresh process (this test binary, running the
//! ignored `child` test): in a process that has freed memory before, the C
//! allocator may hand a new pool recycled memory, already mapped, and a lazy
//! pool would then look eager.

#![cfg(all(target_os = "linux", not(miri)))]

use kvpool_core::{Options, SlotAllocator, SlotTable};

const ROWS: usize = 256;
const CTX: usize = 4096;
const STRIDE: usize = 4112;

fn thread_minor_faults() -> u64 {
    let s = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
    let rest = &s[s.rfind(')').unwrap() + 2..];
    rest.split_whitespace().nth(7).unwrap().parse().unwrap()
}

/// Run by `faults` in a child process: the minor faults of the first
/// admission of 256 x 2048 tokens at page 1 into a fresh 1M-slot pool, with
/// `FIRST_BURST_LAZY` / `FIRST_BURST_IDS` ("1" or "0") choosing the options;
/// the table and slot buffer are resident, as an engine's are.
#[test]
#[ignore = "a helper: run in a fresh process by the_first_admission_writes_into_memory_mapped_at_construction"]
fn child() {
    let flag = |k: &str| std::env::var(k).as_deref() == Ok("1");
    let (lazy, ids) = (flag("FIRST_BURST_LAZY"), flag("FIRST_BURST_IDS"));
    let counts = vec![2048i64; ROWS];
    let total = 2048 * ROWS;
    let mut table = vec![-1i32; (ROWS + 1) * STRIDE];
    let mut out = vec![-1i64; total];
    let tokens: Vec<i64> = (0..total as i64).map(|i| i % 32000).collect();
    let opts = Options {
        lazy_metadata: lazy,
        ..Options::new()
    };
    let mut a = SlotAllocator::with_options(1 << 20, 1, ROWS, CTX, opts).unwrap();
    let mut handles = Vec::with_capacity(ROWS);
    let before = thread_minor_faults();
    let mut view = SlotTable::new(&mut table, STRIDE);
    a.admit_into(
        &counts,
        ids.then_some(&tokens[..]),
        &mut out,
        Some(&mut view),
        &mut handles,
        |_| {},
    )
    .unwrap();
    let faults = thread_minor_faults() - before;
    a.check().unwrap();
    println!("FAULTS={faults}");
}

/// Run by `cache_faults` in a child process: the minor faults of the second
/// `cache()` of a fresh 1M-slot pool at page 1, which registers 128 x 2048
/// more pages after the first registered as many (`FIRST_BURST_LAZY`
/// choosing the options; no event log).
#[test]
#[ignore = "a helper: run in a fresh process by registrations_write_into_memory_mapped_by_the_first_cache"]
fn cache_child() {
    let lazy = std::env::var("FIRST_BURST_LAZY").as_deref() == Ok("1");
    let (rows, len) = (ROWS / 2, 2048usize);
    // No event log: undrained, it grows with the registrations too.
    let opts = Options {
        lazy_metadata: lazy,
        kv_events: false,
        ..Options::new()
    };
    let mut a = SlotAllocator::with_options(1 << 20, 1, ROWS, CTX, opts).unwrap();
    let counts = vec![len as i64; rows];
    let mut out = vec![-1i64; rows * len];
    let mut round = |a: &mut SlotAllocator, first: i64| {
        let tokens: Vec<i64> = (0..(rows * len) as i64).map(|i| first + i).collect();
        let mut handles = Vec::with_capacity(rows);
        a.admit_into(
            &counts,
            Some(&tokens[..]),
            &mut out,
            None,
            &mut handles,
            |_| {},
        )
        .unwrap();
        handles
    };
    let h = round(&mut a, 0);
    a.cache(&h).unwrap();
    let h = round(&mut a, (rows * len) as i64);
    let before = thread_minor_faults();
    a.cache(&h).unwrap();
    let faults = thread_minor_faults() - before;
    a.check().unwrap();
    println!("FAULTS={faults}");
}

fn faults(lazy: bool, ids: bool) -> u64 {
    run_child("child", lazy, ids)
}

fn run_child(name: &str, lazy: bool, ids: bool) -> u64 {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            name,
            "--nocapture",
            "--test-threads=1",
        ])
        .env("FIRST_BURST_LAZY", if lazy { "1" } else { "0" })
        .env("FIRST_BURST_IDS", if ids { "1" } else { "0" })
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .find_map(|l| l.split_once("FAULTS=").map(|(_, n)| n))
        .unwrap_or_else(|| panic!("no FAULTS= in the child's output: {stdout}"))
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn the_first_admission_writes_into_memory_mapped_at_construction() {
    // 524288 page-list entries (2 MiB) and as many token ids: ~512 faults each
    // when left to the first write of every 4 KiB.
    let eager = faults(false, true);
    assert!(
        eager < 64,
        "{eager} page faults in the first admission of a fresh pool"
    );
    let lazy = faults(true, true);
    assert!(
        lazy > 800,
        "lazy_metadata maps on first use: expected ~1000 faults, got {lazy}"
    );
    let lazy_lists = faults(true, false);
    assert!(
        (400..800).contains(&lazy_lists),
        "page lists alone: {lazy_lists} faults"
    );
}

#[test]
fn registrations_write_into_memory_mapped_by_the_first_cache() {
    // 262144 registrations: 16 MiB of slab entries (~4096 faults when each
    // 4 KiB is left to its first push) and 4 MiB of page records.
    let eager = run_child("cache_child", false, true);
    assert!(
        eager < 64,
        "{eager} page faults in the second cache() of a fresh pool"
    );
    let lazy = run_child("cache_child", true, true);
    assert!(
        lazy > 2000,
        "lazy_metadata grows the slab as pages register: expected ~4000 faults, got {lazy}"
    );
}
