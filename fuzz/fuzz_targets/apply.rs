//! Running one op: its handles resolved, the allocator called, the model
//! updated, and every successful result checked against what the op
//! promised (a whole request, a fork, a prefix open, the batch queries).

use crate::extend::{extend, extend_need, extend_tokens, record_extend, tok, Toks};
use crate::model::{Model, Req};
use crate::{Op, Prompt, Salt, H, N};
use kvpool_core::{Counts, SlotAllocator};
use std::collections::HashSet;

/// Replays the events so far into the model (between the steps of one op).
fn settle(a: &mut SlotAllocator, m: &mut Model) {
    let e = a.take_events();
    m.apply_events(&e, a);
}

fn resolve(issued: &[i64], m: &Model, h: H) -> i64 {
    match h {
        H::Open(i) => {
            let mut open: Vec<i64> = m.reqs.keys().copied().collect();
            open.sort_unstable();
            match open.len() {
                0 => resolve(issued, m, H::Issued(i)),
                n => open[i as usize % n],
            }
        }
        H::Issued(i) if !issued.is_empty() => issued[i as usize % issued.len()],
        H::Issued(i) => i as i64,
        H::Raw(r) => r,
    }
}

fn handles(issued: &[i64], m: &Model, v: &[H]) -> Vec<i64> {
    v.iter().take(8).map(|&h| resolve(issued, m, h)).collect()
}

fn split(issued: &[i64], m: &Model, v: &[(H, N)]) -> (Vec<i64>, Vec<i64>) {
    v.iter()
        .take(8)
        .map(|&(h, c)| (resolve(issued, m, h), c.get()))
        .unzip()
}

/// Runs one op and updates the model; returns whether it succeeded. Every
/// successful result is checked against what the op promised.
pub fn apply(a: &mut SlotAllocator, m: &mut Model, issued: &mut Vec<i64>, op: &Op) -> bool {
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
            let (hs, cs) = split(issued, m, v);
            let t = extend_tokens(m, &hs, &cs, toks);
            extend(a, m, &hs, &cs, t.as_deref(), false)
        }
        Op::ExtendEach(v, c) => {
            let hs = handles(issued, m, v);
            let cs = vec![c.get(); hs.len()];
            extend(a, m, &hs, &cs, None, true)
        }
        Op::ExtendWithStarts(v) => {
            let (hs, cs) = split(issued, m, v);
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
            let h = resolve(issued, m, *h);
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
            let parent = resolve(issued, m, *h);
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
            let (hs, cut) = split(issued, m, v);
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
            let hs = handles(issued, m, v);
            if a.close(&hs, *cache).is_err() {
                return false;
            }
            for h in &hs {
                assert!(!a.is_open(*h));
                m.close(*h);
            }
            true
        }
        Op::Cache(v) => a.cache(&handles(issued, m, v)).is_ok(),
        Op::Fork(h, n) => {
            let h = resolve(issued, m, *h);
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
        Op::Queries(v) => queries(a, &handles(issued, m, v)),
        Op::Drain => {
            m.drain(a);
            true
        }
        Op::SwapOut(v) => {
            let hs = handles(issued, m, v);
            let offloads = a.pending_offloads();
            // What swap_out keeps on the device (`allocator/swap.rs`): pages
            // a queued copy (slots) or load (pages) has yet to fill, and
            // shared ones.
            let q = crate::model::queued(a);
            let ps = a.page_size() as i64;
            let to_fill: HashSet<i32> = q
                .copies
                .1
                .iter()
                .map(|&d| (d / ps) as i32)
                .chain(q.loads.1.iter().map(|&p| p as i32))
                .collect();
            let holders = m.holders(a);
            let before: Vec<Vec<i32>> =
                hs.iter().map(|&h| a.pages(h).unwrap_or_default()).collect();
            if a.swap_out(&hs).is_err() {
                return false;
            }
            for (&h, pages) in hs.iter().zip(before) {
                assert_eq!(a.is_swapped(h), Ok(true));
                if let Some(r) = m.reqs.get_mut(&h) {
                    r.kept_on_device = pages
                        .into_iter()
                        .filter(|p| to_fill.contains(p) || holders.get(p).is_some_and(|&n| n > 1))
                        .collect();
                }
            }
            assert!(a.pending_offloads() >= offloads);
            true
        }
        Op::SwapIn(v) => {
            let hs = handles(issued, m, v);
            if a.swap_in(&hs).is_err() {
                return false;
            }
            for &h in &hs {
                assert_eq!(a.is_swapped(h), Ok(false));
                if let Some(r) = m.reqs.get_mut(&h) {
                    r.kept_on_device.clear();
                }
            }
            true
        }
        Op::CachePriority(v, q, secs) => {
            let hs = handles(issued, m, v);
            let r = a.cache_with_priority(&hs, Counts::Each(*q as i64), secs.map(f64::from));
            assert!(a.pinned_pages() <= a.max_pinned_pages());
            r.is_ok()
        }
        Op::Unpin(v) => a.unpin(&handles(issued, m, v)).is_ok(),
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
