//! Arbitrary layer-group pools (full, sliding, state groups with their own
//! page sizes, a token-only anchor where no full group nests, weak hashes
//! now and then) and arbitrary operation sequences against
//! `GroupedAllocator`. After every operation: `check()` passes; a call that
//! returned an error changed nothing observable in any group (counters,
//! every handle's slots and state slots, queued copies); and every open
//! request reads exactly its own token prefix in every slot it holds and in
//! its state slot, with queued copies run after each call as an engine runs
//! them (a shadow of what each slot holds), so a hit that served K/V or a
//! state computed for other tokens, in any group, is caught.
#![no_main]

use std::collections::HashMap;

use arbitrary::Arbitrary;
use kvpool_core::{Counts, GroupKind, GroupSpec, GroupedAllocator, Options};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Group {
    kind: u8,
    pages: u8,
    page_size: u8,
    window: u8,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Serve(Vec<u8>, u8),
    Open(u8),
    Admit(Vec<u8>),
    Step(Vec<u8>, u8),
    Chunk(u8, Vec<u8>),
    Truncate(u8, u8),
    Fork(u8, u8),
    Close(u8, bool),
    Cache(u8),
    Evict(u8, u8),
    ClearCache,
    Reset,
}

fn spec(g: &Group) -> GroupSpec {
    let pages = 2 + g.pages as usize % 24;
    let ps = 1 + g.page_size as usize % 3;
    match g.kind % 3 {
        0 => GroupSpec::full(pages, ps),
        1 => GroupSpec::sliding(pages, ps, 1 + g.window as usize % 6),
        _ => GroupSpec::state(
            2 + g.pages as usize % 10,
            [0, 1, 2, 4][g.window as usize % 4],
        ),
    }
}

struct Run {
    a: GroupedAllocator,
    /// Per group: slot -> the token prefix that computed its K/V (state).
    shadow: Vec<HashMap<i64, Vec<i64>>>,
    /// Open requests and their tokens.
    reqs: Vec<(i64, Vec<i64>)>,
}

impl Run {
    fn is_state(&self, g: usize) -> bool {
        matches!(self.a.group_spec(g).unwrap().kind, GroupKind::State { .. })
    }

    /// Runs every group's queued copies on the shadow (a state batch reads
    /// all its sources before it writes).
    fn drain(&mut self) {
        for g in 0..self.a.num_groups() {
            let (src, dst) = self.a.take_copies(g).unwrap();
            let map = &mut self.shadow[g];
            let vals: Vec<Option<Vec<i64>>> = src
                .iter()
                .map(|&s| {
                    if s < 0 {
                        Some(Vec::new())
                    } else {
                        map.get(&s).cloned()
                    }
                })
                .collect();
            for (d, v) in dst.iter().zip(vals) {
                match v {
                    Some(v) => map.insert(*d, v),
                    None => map.remove(d),
                };
            }
        }
    }

    /// The step after request `i` grew from `start`: new K/V, new state.
    fn write(&mut self, i: usize, start: usize, outs: &[Vec<i64>], at: usize) {
        let (h, toks) = self.reqs[i].clone();
        for (g, out) in outs.iter().enumerate() {
            if self.is_state(g) {
                let s = self.a.state_slots(g, &[h]).unwrap()[0];
                self.shadow[g].insert(s, toks.clone());
                continue;
            }
            for (j, &slot) in out[at..at + toks.len() - start].iter().enumerate() {
                self.shadow[g].insert(slot, toks[..start + j + 1].to_vec());
            }
        }
    }

    fn verify(&self) {
        for (h, toks) in &self.reqs {
            assert_eq!(self.a.length(*h).unwrap(), toks.len());
            for g in 0..self.a.num_groups() {
                if self.is_state(g) {
                    let s = self.a.state_slots(g, &[*h]).unwrap()[0];
                    assert_eq!(self.shadow[g].get(&s), Some(toks), "group {g} state");
                    continue;
                }
                let ps = self.a.group_spec(g).unwrap().page_size as i64;
                for (t, &slot) in self.a.slots(g, *h).unwrap().iter().enumerate() {
                    if slot >= ps {
                        assert_eq!(
                            self.shadow[g].get(&slot),
                            Some(&toks[..=t].to_vec()),
                            "group {g} pos {t}"
                        );
                    }
                }
            }
        }
    }

    /// Everything observable, to compare around a refused call.
    fn snapshot(&self) -> Vec<String> {
        let mut out = vec![format!("{}", self.a.open_requests())];
        for g in 0..self.a.num_groups() {
            out.push(format!(
                "{g}: {:?} {:?} {:?} {:?}",
                self.a.free_pages(g),
                self.a.cached_pages(g),
                self.a.evictable_pages(g),
                self.a.pending_copies(g)
            ));
            for (h, _) in &self.reqs {
                out.push(if self.is_state(g) {
                    format!("{:?}", self.a.state_slots(g, &[*h]))
                } else {
                    format!("{:?}", self.a.slots(g, *h))
                });
            }
        }
        out
    }

    fn extend(&mut self, is: &[usize], new: &[Vec<i64>]) -> bool {
        let hs: Vec<i64> = is.iter().map(|&i| self.reqs[i].0).collect();
        let cs: Vec<i64> = new.iter().map(|t| t.len() as i64).collect();
        let flat: Vec<i64> = new.concat();
        let starts: Vec<usize> = is.iter().map(|&i| self.reqs[i].1.len()).collect();
        let Ok(outs) = self
            .a
            .extend(&hs, Counts::PerRequest(&cs), Some(&flat), &mut [])
        else {
            return false;
        };
        for (&i, t) in is.iter().zip(new) {
            self.reqs[i].1.extend_from_slice(t);
        }
        self.drain();
        let mut at = 0;
        for (k, &i) in is.iter().enumerate() {
            self.write(i, starts[k], &outs, at);
            at += new[k].len();
        }
        true
    }
}

fn toks(v: &[u8]) -> Vec<i64> {
    v.iter().take(16).map(|&t| (t % 3) as i64).collect()
}

fuzz_target!(|input: (Vec<Group>, u8, Vec<Op>)| {
    let (groups, hash, ops) = input;
    let specs: Vec<GroupSpec> = groups.iter().take(4).map(spec).collect();
    let opts = Options {
        hash_seed: Some(3),
        weak_hash_bits: if hash % 2 == 0 {
            1 + (hash / 2) as u32 % 6
        } else {
            0
        },
        ..Options::new()
    };
    let Ok(a) = GroupedAllocator::new(&specs, 6, 20, opts, Some(4 + hash as usize % 60)) else {
        return;
    };
    let n = a.num_groups();
    let mut r = Run {
        a,
        shadow: vec![HashMap::new(); n],
        reqs: Vec::new(),
    };
    for op in ops.iter().take(48) {
        let before = r.snapshot();
        let pick = |i: u8, r: &Run| (!r.reqs.is_empty()).then(|| i as usize % r.reqs.len());
        let ok = match op {
            Op::Serve(p, salt) => {
                let p = toks(p);
                match r
                    .a
                    .open_with_prefix(&p, &[p.len() as i64], Counts::Each(*salt as i64 % 2))
                {
                    Ok((h, cached)) => {
                        let l = cached[0] as usize;
                        r.reqs.push((h[0], p[..l].to_vec()));
                        r.drain();
                        let i = r.reqs.len() - 1;
                        for &t in &p[l..] {
                            if !r.extend(&[i], &[vec![t]]) {
                                break;
                            }
                            r.a.cache(&h).unwrap();
                            r.drain();
                        }
                        true
                    }
                    Err(_) => false,
                }
            }
            Op::Open(k) => match r.a.open(*k as usize % 3) {
                Ok(hs) => {
                    r.reqs.extend(hs.iter().map(|&h| (h, Vec::new())));
                    r.drain();
                    for i in r.reqs.len() - hs.len()..r.reqs.len() {
                        r.write(i, 0, &vec![Vec::new(); n], 0);
                    }
                    true
                }
                Err(_) => false,
            },
            Op::Admit(cs) => {
                let cs: Vec<i64> = cs.iter().take(3).map(|&c| (c % 6) as i64).collect();
                let flat: Vec<i64> = (0..cs.iter().sum::<i64>()).map(|t| t % 3).collect();
                match r.a.admit(&cs, Some(&flat), &mut []) {
                    Ok((hs, outs)) => {
                        let mut at = 0;
                        r.drain();
                        for (&h, &c) in hs.iter().zip(&cs) {
                            r.reqs.push((h, flat[at..at + c as usize].to_vec()));
                            let i = r.reqs.len() - 1;
                            r.write(i, 0, &outs, at);
                            at += c as usize;
                        }
                        true
                    }
                    Err(_) => false,
                }
            }
            Op::Step(v, t) => {
                let mut is: Vec<usize> = v.iter().take(4).filter_map(|&i| pick(i, &r)).collect();
                is.sort_unstable();
                is.dedup();
                let new: Vec<Vec<i64>> = is
                    .iter()
                    .map(|&i| vec![(i as i64 + *t as i64) % 3])
                    .collect();
                let ok = r.extend(&is, &new);
                if ok {
                    let hs: Vec<i64> = is.iter().map(|&i| r.reqs[i].0).collect();
                    r.a.cache(&hs).unwrap();
                    r.drain();
                }
                ok
            }
            Op::Chunk(i, t) => match pick(*i, &r) {
                Some(i) => r.extend(&[i], &[toks(t)]),
                None => true,
            },
            Op::Truncate(i, back) => match pick(*i, &r) {
                Some(i) => {
                    let l = r.reqs[i].1.len().saturating_sub(*back as usize % 6);
                    let ok = r.a.truncate(&[r.reqs[i].0], Counts::Each(l as i64)).is_ok();
                    if ok {
                        r.reqs[i].1.truncate(l);
                        r.drain();
                    }
                    ok
                }
                None => true,
            },
            Op::Fork(i, k) => match pick(*i, &r) {
                Some(i) => match r.a.fork(r.reqs[i].0, 1 + *k as usize % 2) {
                    Ok(kids) => {
                        let t = r.reqs[i].1.clone();
                        r.reqs.extend(kids.iter().map(|&h| (h, t.clone())));
                        r.drain();
                        true
                    }
                    Err(_) => false,
                },
                None => true,
            },
            Op::Close(i, cache) => match pick(*i, &r) {
                Some(i) => {
                    let (h, _) = r.reqs.remove(i);
                    r.a.close(&[h], *cache).unwrap();
                    r.drain();
                    true
                }
                None => true,
            },
            Op::Cache(i) => {
                if let Some(i) = pick(*i, &r) {
                    r.a.cache(&[r.reqs[i].0]).unwrap();
                    r.drain();
                }
                true
            }
            Op::Evict(g, k) => {
                r.a.evict(*g as usize % n, *k as usize % 4).unwrap();
                true
            }
            Op::ClearCache => {
                r.a.clear_cache();
                r.drain();
                true
            }
            Op::Reset => {
                r.a.reset();
                r.reqs.clear();
                r.drain();
                true
            }
        };
        if !ok {
            assert_eq!(before, r.snapshot(), "refused {op:?} changed the pool");
        }
        r.a.check().unwrap();
        r.verify();
    }
});
