//! Property test: random operation sequences, shared pages and a host tier
//! included, run against the allocator and against the naive reference
//! model in `reference/`; results, errors and observable state (slots,
//! known tokens, page-state counters of both tiers, the queued copies,
//! offloads and loads, hit counts) must agree, and check() must pass after
//! every operation. A router fed the KV events, drained every third
//! operation so that undrained events outlive evictions, truncations and
//! clears, must know exactly the registered pages of each tier.
//!
//! The transfer queues are drained after every operation, every third, or
//! only by an explicit `Drain` (copies: all of them, or the newest part
//! first) or when a step writes a page a queued transfer touches, so
//! queued transfers outlive closes, truncations (into prompts too, which
//! then diverge), evictions, swaps, hits and resets: the model knows which
//! survive, and that their pages stay held until taken. Their content is
//! checked too (`contents/`): run on a simulated store in the documented
//! order, they leave every open request reading exactly what it wrote or
//! was served, and every swapped-out request's host pages holding it.
//!
//! Retention priorities ride along: caches and closes with priorities
//! (pins, durations, per-request arrays, out-of-range values), unpins and
//! ticks of a manual clock, on pools whose pin bound is 0 to 4 pages; the
//! eviction order, the pinned count and the evictable pages per priority
//! must agree with the model's, with and without
//! a host tier (eviction by priority picks the device victim; the tier
//! then keeps or offloads its entry).

mod cases;
mod contents;
mod model_coverage;
mod model_harness;
mod model_ops;
mod reference;
mod router;
mod store;

use contents::Contents;
use kvpool_core::{make_handle, Counts, HostPolicy, SlotTable, MEDIUM_DEVICE, MEDIUM_HOST};
use model_coverage::{
    count, count_runs, BOUNCED, COPIES, DIVERGED, DROPPED, ENDED, HIT_TOKENS, HOST_HITS,
    HOST_STORED, MOVED, OK_CALLS, ORPHANS_REPLACED, PINNED_ENDS, PRIO_OKS, REVIVED, STORED, SWAPS,
    TAKEN_OVER,
};
use model_harness::{agrees, new_allocator, report, table_after, STRIDE};
use model_ops::{batch_tokens, op, prompt, Op, OPEN_PICKS};
use proptest::prelude::*;
use reference::{same, Model, Tier, MAX_REQ};

// Miri interprets every step (~1000x slower): a handful of cases there.
fn case_count() -> u32 {
    cases::from_env(if cfg!(miri) { 6 } else { 3000 })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(case_count()))]
    #[test]
    fn allocator_matches_model(ps in 1usize..4, pages in prop_oneof![2usize..8, 8usize..24], host in prop_oneof![2 => Just(0usize), 3 => 2usize..20], through in any::<bool>(), drain_every in prop_oneof![1 => Just(1usize), 1 => Just(3), 2 => Just(usize::MAX)], max_pinned in prop_oneof![1 => Just(0usize), 3 => 1usize..5], ops in prop::collection::vec(op(), 1..95)) {
        let policy = if through { HostPolicy::WriteThrough } else { HostPolicy::WriteBack };
        let max_pinned = max_pinned.min(pages - 1);
        let mut a = new_allocator(pages, ps, host, policy, max_pinned);
        let mut m = Model::with_tier(pages, ps, (host > 0).then(|| Tier::new(host, policy)));
        m.max_pinned = max_pinned;
        let mut now_s = 0u64;
        let mut c = Contents::new(&a);
        // Every handle ever issued, plus two that never were.
        let mut issued: Vec<i64> = vec![-5, make_handle(3, 1)];
        let mut oks = 0usize;
        // A caller's request-to-token table, written by extend_into_table:
        // exactly the reported slots on success, untouched on any error.
        let mut table = vec![-7i32; MAX_REQ * STRIDE];
        let mut router = router::Router::new(a.hash_seed(), ps);
        // Known tokens (and salt) of requests that registered pages, for
        // `Reopen` to ask for again once they may have moved to the host.
        let mut texts: Vec<(Vec<i32>, i64)> = Vec::new();
        for (step, op) in ops.into_iter().enumerate() {
            let op_name = format!("{op:?}");
            let open: Vec<i64> = issued.iter().copied().filter(|&x| m.row(x).is_some()).collect();
            let h = |i: usize| {
                if i < OPEN_PICKS && !open.is_empty() { open[i % open.len()] } else { issued[i % issued.len()] }
            };
            if let Op::Cache(v) | Op::Close(v, true) | Op::Prio(v, _, _, _) = &op {
                // An engine runs its step (the queued transfers, then the
                // K/V writes) before it publishes pages.
                c.drain(&mut a, &mut m);
                for &i in v {
                    if let Some(r) = m.row(h(i)) {
                        let r = &m.reqs[&r];
                        if texts.len() < 16 && r.known().len() > 1 {
                            texts.push((r.known(), r.salt));
                        }
                    }
                }
            }
            let op = match op {
                Op::Reopen(picks) if !texts.is_empty() => {
                    let prompts = picks.iter().map(|&(t, cut)| {
                        let (text, salt) = &texts[t as usize % texts.len()];
                        (text[..text.len() - cut as usize % 2].to_vec(), *salt)
                    }).collect();
                    Op::Reopen(vec![]).with_prompts(prompts)
                }
                op => op,
            };
            let runs_before = if ps == 1 { a.index_runs_for_tests() } else { vec![] };
            match op {
                Op::Open(n) => {
                    let (r, mr) = (a.open(n), m.open(n));
                    if let Ok(hs) = &mr { issued.extend(hs); }
                    oks += same(r, mr) as usize;
                }
                Op::OpenPrefix(..) | Op::Reopen(..) | Op::Prompts(..) => {
                    let (prompts, salts): (Vec<Vec<i32>>, Vec<i64>) = match op {
                        Op::OpenPrefix(ps_, salt) => ps_.iter().map(|&(b, l, c)| (prompt(b, l, c), salt)).unzip(),
                        Op::Prompts(v) => v.into_iter().unzip(),
                        _ => (vec![], vec![]),
                    };
                    let flat: Vec<i64> = prompts.iter().flatten().map(|&t| t as i64).collect();
                    let lens: Vec<i64> = prompts.iter().map(|p| p.len() as i64).collect();
                    let r = a.open_with_prefix(&flat, &lens, Counts::PerRequest(&salts));
                    let mr = m.open_with_prefix(&prompts, &salts);
                    if let Ok((hs, cached)) = &mr {
                        issued.extend(hs);
                        count(&HIT_TOKENS, cached.iter().sum::<i64>() as u64);
                        for (&x, &n) in hs.iter().zip(cached) {
                            c.hit(&m, x, n as usize);
                        }
                    }
                    oks += same(r, mr) as usize;
                }
                Op::Extend(v, toks) => {
                    let (hs, cs): (Vec<i64>, Vec<i64>) = v.iter().map(|&(i, c)| (h(i), c)).unzip();
                    let tokens = toks.map(|(seed, corrupt)| batch_tokens(&m, &hs, &cs, seed, corrupt));
                    let before: Vec<usize> = hs.iter().map(|&x| m.row(x).map_or(0, |r| m.reqs[&r].len())).collect();
                    let mr = m.extend(&hs, &cs, tokens.as_deref());
                    let r = if hs.len() % 2 == 0 {
                        a.extend(&hs, Counts::PerRequest(&cs), tokens.as_deref())
                    } else {
                        // extend_into must agree, and report each request's row,
                        // old length and new slots in batch order.
                        let mut out = vec![-1; cs.iter().filter(|&&c| c > 0).sum::<i64>() as usize];
                        let mut seen = Vec::new();
                        let (before_table, mut reports) = (table.clone(), Vec::new());
                        let mut view = SlotTable::new(&mut table, STRIDE);
                        let r = a.extend_into_table(&hs, Counts::PerRequest(&cs), tokens.as_deref(), &mut out, Some(&mut view), |g| {
                            seen.push((g.index, g.row as i64, g.start, g.slots.to_vec()));
                            reports.push(report(g));
                        });
                        let want_table = if r.is_ok() { table_after(&before_table, &reports) } else { before_table };
                        prop_assert!(table == want_table, "slot table after {:?}", r);
                        r.map(|()| {
                            let mut k = 0;
                            let want: Vec<_> = (0..hs.len()).map(|i| {
                                let n = cs[i] as usize;
                                k += n;
                                (i, hs[i] & 0xFFFF_FFFF, before[i], out[k - n..k].to_vec())
                            }).collect();
                            assert_eq!(seen, want);
                            out
                        })
                    };
                    if same(r, mr) {
                        oks += 1;
                        c.write(&mut a, &mut m, &hs);
                    }
                }
                Op::Truncate(v) => {
                    let (hs, ls): (Vec<i64>, Vec<i64>) = v.iter().map(|&(i, l)| (h(i), l)).unzip();
                    let into_prompt = hs.iter().zip(&ls).any(|(&x, &l)| {
                        m.row(x).is_some_and(|r| (l as usize) < m.reqs[&r].len().min(m.reqs[&r].prompt.len()))
                    });
                    let ok = same(a.truncate(&hs, Counts::PerRequest(&ls)), m.truncate(&hs, &ls));
                    if ok {
                        for (&x, &l) in hs.iter().zip(&ls) {
                            c.truncate(x, l as usize);
                        }
                        if into_prompt {
                            count(&DIVERGED, 1);
                        }
                    }
                    oks += ok as usize;
                }
                Op::Rollback(i, back, n, seed) => {
                    let x = h(i);
                    let (len, prompt) = m.row(x).map_or((0, 0), |r| (m.reqs[&r].len(), m.reqs[&r].prompt.len()));
                    let l = len.saturating_sub(back) as i64;
                    if same(a.truncate(&[x], Counts::Each(l)), m.truncate(&[x], &[l])) {
                        oks += 1;
                        c.truncate(x, l as usize);
                    }
                    let toks: Vec<i64> = (0..n).map(|j| (seed as usize + 2 * j) as i64 % 3).collect();
                    let r = a.extend(&[x], Counts::Each(n as i64), Some(&toks));
                    if same(r, m.extend(&[x], &[n as i64], Some(&toks))) {
                        oks += 1;
                        c.write(&mut a, &mut m, &[x]);
                    }
                    if (l as usize) < len.min(prompt) {
                        count(&DIVERGED, 1);
                    }
                }
                Op::Close(v, cache) => {
                    let hs: Vec<i64> = v.iter().map(|&i| h(i)).collect();
                    if same(a.close(&hs, cache), m.close(&hs, cache)) {
                        oks += 1;
                        for &x in &hs {
                            c.forget(x);
                        }
                    }
                }
                Op::Cache(v) => {
                    let hs: Vec<i64> = v.iter().map(|&i| h(i)).collect();
                    oks += same(a.cache(&hs), m.cache(&hs)) as usize;
                }
                Op::Fork(i, n) => {
                    let parent = h(i);
                    let (r, mr) = (a.fork(parent, n), m.fork(parent, n));
                    if let Ok(hs) = &mr {
                        issued.extend(hs);
                        c.fork(parent, hs);
                    }
                    oks += same(r, mr) as usize;
                }
                Op::Sample(i, n) => {
                    let parent = h(i);
                    let (r, mr) = (a.fork(parent, n), m.fork(parent, n));
                    if let Ok(kids) = &mr {
                        c.fork(parent, kids);
                        let mut hs = kids.clone();
                        hs.push(parent);
                        let ones = vec![1i64; hs.len()];
                        if same(a.extend(&hs, Counts::Each(1), None), m.extend(&hs, &ones, None)) {
                            oks += 1;
                            c.write(&mut a, &mut m, &hs);
                        }
                        issued.extend(kids);
                    }
                    oks += same(r, mr) as usize;
                }
                Op::Prefill(i) => {
                    let hs = [h(i)];
                    let c_ = m.row(hs[0]).map_or(1, |r| (m.reqs[&r].prompt.len() as i64 - m.reqs[&r].len() as i64).max(0));
                    if same(a.extend(&hs, Counts::Each(c_), None), m.extend(&hs, &[c_], None)) {
                        oks += 1;
                        c.write(&mut a, &mut m, &hs);
                    }
                }
                Op::Decode(v, toks) => {
                    let hs: Vec<i64> = v.iter().map(|&i| h(i)).collect();
                    let ones = vec![1i64; hs.len()];
                    let tokens = toks.map(|(seed, corrupt)| batch_tokens(&m, &hs, &ones, seed, corrupt));
                    let mr = m.extend(&hs, &ones, tokens.as_deref());
                    // Half the decode steps write a slot table in the loop itself.
                    let r = if hs.len() % 2 == 1 {
                        let mut out = vec![-1; hs.len()];
                        let (before_table, mut reports) = (table.clone(), Vec::new());
                        let mut view = SlotTable::new(&mut table, STRIDE);
                        let r = a.extend_into_table(&hs, Counts::Each(1), tokens.as_deref(), &mut out, Some(&mut view), |g| reports.push(report(g)));
                        let want_table = if r.is_ok() { table_after(&before_table, &reports) } else { before_table };
                        prop_assert!(table == want_table, "slot table after {:?}", r);
                        r.map(|()| out)
                    } else {
                        a.extend(&hs, Counts::Each(1), tokens.as_deref())
                    };
                    if same(r, mr) {
                        oks += 1;
                        c.write(&mut a, &mut m, &hs);
                    }
                }
                Op::SwapOut(v) => {
                    let hs: Vec<i64> = v.iter().map(|&i| h(i)).collect();
                    let before = m.tier.as_ref().map_or(0, |t| t.offloads.len());
                    if same(a.swap_out(&hs), m.swap_out(&hs)) {
                        oks += 1;
                        count(&SWAPS, 1 + m.tier.as_ref().map_or(0, |t| t.offloads.len()) - before);
                    }
                }
                Op::SwapIn(v) => {
                    // Mostly swapped-out requests (the others are refused).
                    let swapped: Vec<i64> = open.iter().copied().filter(|&x| m.reqs[&m.row(x).unwrap()].swapped).collect();
                    let hs: Vec<i64> = v.iter().map(|&i| if i < OPEN_PICKS && !swapped.is_empty() { swapped[i % swapped.len()] } else { h(i) }).collect();
                    oks += same(a.swap_in(&hs), m.swap_in(&hs)) as usize;
                }
                Op::Bounce(i) => {
                    let x = [h(i)];
                    for k in 0..4 {
                        let ok = if k % 2 == 0 {
                            same(a.swap_out(&x), m.swap_out(&x))
                        } else {
                            same(a.swap_in(&x), m.swap_in(&x))
                        };
                        oks += ok as usize;
                        a.check().unwrap();
                        if !ok {
                            break;
                        }
                        count(&BOUNCED, (k == 3) as usize);
                    }
                }
                Op::Evict(n) => {
                    prop_assert_eq!(a.evict(n), m.evict(n));
                }
                Op::ClearCache => {
                    a.clear_cache();
                    m.clear_cache();
                }
                Op::Drain(n) => {
                    // The newest copies first (a caller taking its own
                    // call's), then the rest; run in queue order.
                    let from = n % (m.pending_copies() + 1);
                    let newer = a.take_copies_from(from);
                    prop_assert_eq!(&newer, &m.take_copies_from(from));
                    let mut d = store::Drained {
                        offloads: a.take_offloads(),
                        loads: a.take_loads(),
                        copies: a.take_copies(),
                    };
                    prop_assert_eq!(&d.offloads, &m.take_offloads());
                    prop_assert_eq!(&d.loads, &m.take_loads());
                    prop_assert_eq!(&d.copies, &m.take_copies_from(0));
                    d.copies.0.extend(newer.0);
                    d.copies.1.extend(newer.1);
                    c.run(&d);
                }
                Op::Reset => {
                    a.reset();
                    m.reset();
                    c.want.clear();
                }
                Op::Prio(v, qs, retain, close) => {
                    let hs: Vec<i64> = v.iter().map(|&i| h(i)).collect();
                    let counts = if qs.len() == 1 { Counts::Each(qs[0]) } else { Counts::PerRequest(&qs) };
                    let (secs, ns) = (retain.map(f64::from), retain.map(|s| s as u64 * 1_000_000_000));
                    let ok = if close {
                        let ok = same(a.close_with_priority(&hs, counts, secs), m.close_with_priority(&hs, &qs, ns));
                        if ok {
                            for &x in &hs {
                                c.forget(x);
                            }
                        }
                        ok
                    } else {
                        same(a.cache_with_priority(&hs, counts, secs), m.cache_with_priority(&hs, &qs, ns))
                    };
                    oks += ok as usize;
                    count(&PRIO_OKS, ok as usize);
                }
                Op::Unpin(v) => {
                    let hs: Vec<i64> = v.iter().map(|&i| h(i)).collect();
                    oks += same(a.unpin(&hs), m.unpin(&hs)) as usize;
                }
                Op::Tick(s) => {
                    now_s += s as u64;
                    let before = m.prio.len();
                    a.set_clock(now_s as f64).unwrap();
                    m.set_clock(now_s * 1_000_000_000);
                    count(&ENDED, before - m.prio.len());
                }
            }
            count(&PINNED_ENDS, m.pinned());
            if ps == 1 {
                count_runs(&runs_before, &a.index_runs_for_tests());
            }
            a.check().unwrap();
            if step % 3 == 2 {
                let events = a.take_events();
                count(&STORED, events.kind.iter().filter(|&&k| k == kvpool_core::EVENT_STORED).count());
                count(&HOST_STORED, events.kind.iter().zip(&events.medium).filter(|&(&k, &md)| k == kvpool_core::EVENT_STORED && md == MEDIUM_HOST).count());
                prop_assert_eq!(router.apply(&events), Ok(()));
                prop_assert_eq!(router.len(MEDIUM_DEVICE), a.cached_pages(), "the router's device pages");
                prop_assert_eq!(router.len(MEDIUM_HOST), a.host_cached_pages(), "the router's host pages");
            }
            if drain_every != usize::MAX && step % drain_every == drain_every - 1 {
                c.drain(&mut a, &mut m);
                a.check().unwrap();
            }
            agrees(&a, &m, &issued)?;
            if let Err(e) = c.verify(&a, &m) {
                prop_assert!(false, "after {:?}: {}", op_name, e);
            }
        }
        let events = a.take_events();
        prop_assert_eq!(router.apply(&events), Ok(()));
        prop_assert_eq!(router.len(MEDIUM_DEVICE), a.cached_pages(), "the router's pages at the end");
        prop_assert_eq!(router.len(MEDIUM_HOST), a.host_cached_pages(), "the router's host pages at the end");
        count(&OK_CALLS, oks);
        count(&DROPPED, m.dropped);
        count(&TAKEN_OVER, m.taken_over);
        count(&ORPHANS_REPLACED, m.orphans_replaced);
        count(&REVIVED, m.revived);
        count(&COPIES, m.queued);
        if let Some(t) = m.tier.as_ref() {
            count(&HOST_HITS, t.hit);
        }
        MOVED.with(|x| {
            let mut v = x.get();
            v[0] += a.offloaded_pages() as usize + a.pending_offloads();
            v[1] += a.loaded_pages() as usize + a.pending_loads();
            v[2] += c.ran[2];
            x.set(v);
        });
    }
}
