//! Arbitrary operation sequences against kvpool-core. After every operation:
//! `check()` passes, no slot or page is held twice, held pages add up to
//! `used_pages`, and a call that returned an error left every observable
//! piece of state exactly as it was (all-or-nothing batches).
#![no_main]

use arbitrary::Arbitrary;
use kvpool_core::{Counts, SlotAllocator};
use libfuzzer_sys::fuzz_target;
use std::collections::HashSet;

#[derive(Arbitrary, Debug)]
struct Config {
    num_pages: u8,
    page_size: u8,
    max_requests: u8,
    max_context_len: u8,
}

/// Handles are named by index into every handle ever issued (open, closed or
/// stale), or raw, so invalid handles get exercised as much as valid ones.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum H {
    Issued(u8),
    Raw(i64),
}

#[derive(Arbitrary, Debug)]
enum Op {
    Open(u8),
    Extend(Vec<(H, i8)>),
    ExtendEach(Vec<H>, i8),
    ExtendWithStarts(Vec<(H, i8)>),
    Truncate(Vec<(H, i8)>),
    Close(Vec<H>),
    Reset,
    Queries(Vec<H>),
    // Shared pages (issue 15): once the core has them, add open_with_prefix,
    // cache, fork, copy-on-write, evict and clear_cache here, and extend
    // `Snapshot` with the prefix index and per-page refcounts.
}

fuzz_target!(|input: (Config, Vec<Op>)| {
    let (cfg, ops) = input;
    let Ok(mut a) = SlotAllocator::new(
        2 + cfg.num_pages as usize % 62,
        1 + cfg.page_size as usize % 5,
        1 + cfg.max_requests as usize % 8,
        1 + cfg.max_context_len as usize % 40,
    ) else {
        panic!("a small valid config was refused");
    };
    let mut issued: Vec<i64> = Vec::new();
    for op in ops.iter().take(64) {
        let before = Snapshot::of(&a, &issued);
        let ok = apply(&mut a, &mut issued, op);
        if let Err(e) = a.check() {
            panic!("check() failed after {op:?}: {e}");
        }
        let after = Snapshot::of(&a, &issued);
        if !ok {
            assert_eq!(before, after, "failed {op:?} changed the allocator");
        }
        after.assert_consistent(&a);
    }
});

fn resolve(issued: &[i64], h: H) -> i64 {
    match h {
        H::Issued(i) if !issued.is_empty() => issued[i as usize % issued.len()],
        H::Issued(i) => i as i64,
        H::Raw(r) => r,
    }
}

fn split(issued: &[i64], v: &[(H, i8)]) -> (Vec<i64>, Vec<i64>) {
    v.iter().map(|&(h, c)| (resolve(issued, h), c as i64)).unzip()
}

/// Runs one op; returns whether it succeeded. Every successful result is
/// checked against what the op promised.
fn apply(a: &mut SlotAllocator, issued: &mut Vec<i64>, op: &Op) -> bool {
    match op {
        Op::Open(n) => match a.open(*n as usize % 4) {
            Ok(hs) => {
                for &h in &hs {
                    assert!(a.is_open(h) && a.length(h) == Ok(0));
                }
                issued.extend(hs);
                true
            }
            Err(_) => false,
        },
        Op::Extend(v) | Op::ExtendWithStarts(v) => {
            let (hs, cs) = split(issued, v);
            let old: Vec<usize> = hs.iter().map(|&h| a.length(h).unwrap_or(0)).collect();
            let res = if matches!(op, Op::Extend(_)) {
                a.extend(&hs, Counts::PerRequest(&cs)).map(|s| (s, None))
            } else {
                a.extend_with_starts(&hs, Counts::PerRequest(&cs)).map(|(s, st)| (s, Some(st)))
            };
            let Ok((slots, starts)) = res else { return false };
            assert_eq!(slots.len() as i64, cs.iter().sum::<i64>());
            let mut k = 0;
            for (i, &h) in hs.iter().enumerate() {
                let c = cs[i] as usize;
                assert_eq!(a.length(h), Ok(old[i] + c));
                if let Some(st) = &starts {
                    assert_eq!(st[i] as usize, old[i]);
                }
                // The new slots are the request's last c slots, in order.
                let all = a.slots(h).expect("open");
                assert_eq!(&all[old[i]..], &slots[k..k + c]);
                k += c;
            }
            true
        }
        Op::ExtendEach(v, c) => {
            let hs: Vec<i64> = v.iter().map(|&h| resolve(issued, h)).collect();
            a.extend(&hs, Counts::Each(*c as i64)).is_ok()
        }
        Op::Truncate(v) => {
            let (hs, ls) = split(issued, v);
            let ok = a.truncate(&hs, Counts::PerRequest(&ls)).is_ok();
            if ok {
                for (&h, &l) in hs.iter().zip(&ls) {
                    assert_eq!(a.length(h), Ok(l as usize));
                }
            }
            ok
        }
        Op::Close(v) => {
            let hs: Vec<i64> = v.iter().map(|&h| resolve(issued, h)).collect();
            let ok = a.close(&hs).is_ok();
            if ok {
                assert!(hs.iter().all(|&h| !a.is_open(h)));
            }
            ok
        }
        Op::Reset => {
            a.reset();
            assert_eq!(a.open_requests(), 0);
            assert_eq!(a.free_pages(), a.capacity_pages());
            true
        }
        Op::Queries(v) => {
            let hs: Vec<i64> = v.iter().map(|&h| resolve(issued, h)).collect();
            let pt = a.page_table(&hs);
            let rows = a.rows(&hs);
            let lens = a.lengths(&hs);
            // All three agree on whether the batch is valid.
            assert_eq!(pt.is_ok(), rows.is_ok());
            assert_eq!(pt.is_ok(), lens.is_ok());
            if let (Ok(pt), Ok(lens)) = (pt, lens) {
                assert_eq!(pt.indptr.len(), hs.len() + 1);
                for (i, &h) in hs.iter().enumerate() {
                    let pages = a.pages(h).expect("open");
                    let (lo, hi) = (pt.indptr[i] as usize, pt.indptr[i + 1] as usize);
                    assert_eq!(&pt.indices[lo..hi], &pages[..]);
                    let ps = a.page_size();
                    let want = if lens[i] == 0 { 0 } else { (lens[i] as usize - 1) % ps + 1 };
                    assert_eq!(pt.last_page_len[i] as usize, want);
                }
            }
            true
        }
    }
}

/// Everything a caller can observe.
#[derive(Debug, PartialEq, Eq)]
struct Snapshot {
    free_pages: usize,
    used_pages: usize,
    open: usize,
    requests: Vec<(i64, bool, Option<(Vec<i64>, Vec<i32>)>)>,
}

impl Snapshot {
    fn of(a: &SlotAllocator, issued: &[i64]) -> Self {
        let requests = issued
            .iter()
            .map(|&h| {
                let open = a.is_open(h);
                let detail = open.then(|| (a.slots(h).expect("open"), a.pages(h).expect("open")));
                (h, open, detail)
            })
            .collect();
        Snapshot {
            free_pages: a.free_pages(),
            used_pages: a.used_pages(),
            open: a.open_requests(),
            requests,
        }
    }

    fn assert_consistent(&self, a: &SlotAllocator) {
        let (mut slots, mut pages) = (HashSet::new(), HashSet::new());
        let ps = a.page_size() as i64;
        for (_, _, detail) in &self.requests {
            let Some((s, p)) = detail else { continue };
            for &x in s {
                assert!(x >= ps && x < a.num_slots() as i64, "slot {x} out of range");
                assert!(slots.insert(x), "slot {x} held twice");
                assert!(p.contains(&((x / ps) as i32)), "slot {x} outside its pages");
            }
            for &q in p {
                assert!(q != 0 && pages.insert(q), "page {q} reserved or held twice");
            }
        }
        assert_eq!(pages.len(), a.used_pages());
        assert_eq!(self.free_pages + self.used_pages, a.capacity_pages());
    }
}
