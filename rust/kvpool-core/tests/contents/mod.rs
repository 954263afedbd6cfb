//! What the property test's requests must read (`model.rs`): the simulated
//! store (`store/mod.rs`) driven by what the allocator hands out, checked
//! against the reference model after every operation.
//!
//! The engine it plays writes a step's positions after running every
//! queued transfer that touches the pages it writes (offloads, loads,
//! copies, in the documented order), and otherwise leaves transfers queued
//! across calls, so a queue lives through closes, truncations, evictions,
//! swaps and hits; a drain compares each queue with the model's before
//! running it. Each open request then reads, once the transfers still
//! queued have run, exactly what it wrote or was served.

#![allow(dead_code)]

use std::collections::HashMap;

use kvpool_core::SlotAllocator;

use crate::reference::{Model, HOST};
use crate::store::{content, unique, Drained, Store};

pub struct Contents {
    pub store: Store,
    /// Per handle: the content each position must read (None: not written).
    pub want: HashMap<i64, Vec<Option<u64>>>,
    writes: u64,
    /// Transfers run, by kind (for the generator's guard).
    pub ran: [usize; 3],
}

impl Contents {
    pub fn new(a: &SlotAllocator) -> Self {
        Contents {
            store: Store::new(a),
            want: HashMap::new(),
            writes: 0,
            ran: [0; 3],
        }
    }

    /// Request `h` (open in `m`) starts on a prefix hit of `len` tokens.
    pub fn hit(&mut self, m: &Model, h: i64, len: usize) {
        let r = &m.reqs[&m.row(h).expect("open")];
        let w = (0..len)
            .map(|i| Some(content(r.salt, &r.prompt[..=i])))
            .collect();
        self.want.insert(h, w);
    }

    pub fn fork(&mut self, parent: i64, kids: &[i64]) {
        let w = self.want.get(&parent).cloned().unwrap_or_default();
        for &k in kids {
            self.want.insert(k, w.clone());
        }
    }

    pub fn truncate(&mut self, h: i64, len: usize) {
        if let Some(w) = self.want.get_mut(&h) {
            w.truncate(len);
        }
    }

    pub fn forget(&mut self, h: i64) {
        self.want.remove(&h);
    }

    /// Takes every queued transfer from both, checks they agree, runs them.
    pub fn drain(&mut self, a: &mut SlotAllocator, m: &mut Model) {
        let d = Drained {
            offloads: a.take_offloads(),
            loads: a.take_loads(),
            copies: a.take_copies(),
        };
        assert_eq!(d.offloads, m.take_offloads(), "offloads");
        assert_eq!(d.loads, m.take_loads(), "loads");
        assert_eq!(d.copies, m.take_copies_from(0), "copies");
        self.run(&d);
    }

    pub fn run(&mut self, d: &Drained) {
        self.ran[0] += d.offloads.0.len();
        self.ran[1] += d.loads.0.len();
        self.ran[2] += d.copies.0.len();
        self.store.run(d);
    }

    /// The step of the requests `hs` (those open and on the device): their
    /// positions not written yet get their content, after the queued
    /// transfers if any of them touches a page written.
    pub fn write(&mut self, a: &mut SlotAllocator, m: &mut Model, hs: &[i64]) {
        let ps = m.ps;
        let mut todo: Vec<(usize, u64)> = Vec::new();
        for &h in hs {
            let Some(row) = m.row(h) else { continue };
            let r = &m.reqs[&row];
            if r.swapped {
                continue;
            }
            let w = self.want.entry(h).or_default();
            if w.len() > r.len() {
                w.truncate(r.len());
            }
            w.resize(r.len(), None);
            let slots = m.slots(row);
            for i in 0..r.len() {
                if w[i].is_some() {
                    continue;
                }
                let ctx: Option<Vec<i32>> = r.tokens[..=i].iter().copied().collect();
                let c = match ctx {
                    Some(ctx) => content(r.salt, &ctx),
                    None => {
                        self.writes += 1;
                        unique(self.writes)
                    }
                };
                w[i] = Some(c);
                todo.push((slots[i] as usize, c));
            }
        }
        // A copy reads and writes its slots `0..len` of each page (a step's
        // writes into the copy's destination come after them); a load
        // writes, an offload reads, a whole page.
        let touched = |s: usize| {
            let (p, o) = (s / ps, s % ps);
            m.queue
                .iter()
                .any(|c| (c.src == p || c.dst == p) && o < c.len)
                || m.tier.as_ref().is_some_and(|t| {
                    t.offloads.iter().any(|x| x.0 == p) || t.loads.iter().any(|x| x.1 == p)
                })
        };
        if todo.iter().any(|&(s, _)| touched(s)) {
            self.drain(a, m);
        }
        for (s, c) in todo {
            self.store.dev[s] = c;
        }
    }

    /// Every open request on the device reads what it must once the queued
    /// transfers have run; a swapped-out one's host pages hold it already
    /// or will once they have.
    pub fn verify(&self, a: &SlotAllocator, m: &Model) -> Result<(), String> {
        let s = self.store.settled(a);
        let ps = m.ps;
        for (&h, w) in &self.want {
            let Some(row) = m.row(h) else { continue };
            let r = &m.reqs[&row];
            for (i, want) in w.iter().enumerate() {
                let Some(want) = want else { continue };
                let loc = r.pages[i / ps];
                let got = if loc & HOST != 0 {
                    s.host[(loc & !HOST) * ps + i % ps]
                } else {
                    s.dev[loc * ps + i % ps]
                };
                if got != *want {
                    return Err(format!(
                        "request {h:#x} position {i} (page {loc:#x}) reads {got:#x}, must read {want:#x}"
                    ));
                }
            }
        }
        Ok(())
    }
}
