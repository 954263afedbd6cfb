//! A small engine over the allocator and the simulated store
//! (`store/mod.rs`), for the host tier's tests: it writes each position's
//! content when a step would (after running every queued transfer, as the
//! contract says), and `verify` checks that every open request reads
//! exactly what it wrote or was served, once the transfers still queued
//! have run.

#![allow(dead_code)]

use std::collections::BTreeMap;

use kvpool_core::{Counts, HostPolicy, Options, SlotAllocator};

use crate::store::{content, unique, Drained, Store};

#[derive(Debug, Clone, Default)]
pub struct Req {
    pub salt: i64,
    pub prompt: Vec<i32>,
    /// Token id of each position (None: unknown).
    pub tokens: Vec<Option<i32>>,
    /// Content each position must read (None: not written yet).
    pub want: Vec<Option<u64>>,
}

pub struct Engine {
    pub a: SlotAllocator,
    pub s: Store,
    pub reqs: BTreeMap<i64, Req>,
    writes: u64,
}

pub fn opts(host_pages: usize, policy: HostPolicy) -> Options {
    Options {
        hash_seed: Some(7),
        host_pages,
        host_policy: policy,
        ..Options::new()
    }
}

impl Engine {
    pub fn new(num_pages: usize, ps: usize, host_pages: usize, policy: HostPolicy) -> Self {
        let a = SlotAllocator::with_options(num_pages, ps, 8, 64, opts(host_pages, policy))
            .expect("valid pool");
        let s = Store::new(&a);
        Engine {
            a,
            s,
            reqs: BTreeMap::new(),
            writes: 0,
        }
    }

    /// Opens a batch of prompts; returns `(handle, cached_len)` of each.
    pub fn open_batch(&mut self, prompts: &[(&[i32], i64)]) -> Vec<(i64, usize)> {
        let flat: Vec<i64> = prompts
            .iter()
            .flat_map(|(p, _)| p.iter().map(|&t| t as i64))
            .collect();
        let lens: Vec<i64> = prompts.iter().map(|(p, _)| p.len() as i64).collect();
        let salts: Vec<i64> = prompts.iter().map(|&(_, s)| s).collect();
        let (hs, cached) = self
            .a
            .open_with_prefix(&flat, &lens, Counts::PerRequest(&salts))
            .expect("open_with_prefix");
        let mut out = Vec::new();
        for (((p, salt), &h), &c) in prompts.iter().zip(&hs).zip(&cached) {
            let c = c as usize;
            let want = (0..c).map(|i| Some(content(*salt, &p[..=i]))).collect();
            self.reqs.insert(
                h,
                Req {
                    salt: *salt,
                    prompt: p.to_vec(),
                    tokens: p[..c].iter().map(|&t| Some(t)).collect(),
                    want,
                },
            );
            out.push((h, c));
        }
        self.a.check().expect("check after open_with_prefix");
        out
    }

    pub fn open(&mut self, prompt: &[i32], salt: i64) -> (i64, usize) {
        self.open_batch(&[(prompt, salt)])[0]
    }

    /// Extends `h` by `tokens` (their ids given); with `write`, runs the
    /// step: every queued transfer, then the new positions' K/V.
    pub fn extend(&mut self, h: i64, tokens: &[i32], write: bool) {
        let ids: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
        self.a
            .extend(&[h], Counts::Each(tokens.len() as i64), Some(&ids))
            .expect("extend");
        let r = self.reqs.get_mut(&h).expect("open");
        r.tokens.extend(tokens.iter().map(|&t| Some(t)));
        if write {
            self.write(h);
        }
        self.a.check().expect("check after extend");
    }

    /// Extends `h` over the rest of its prompt and runs the step.
    pub fn prefill(&mut self, h: i64) {
        let r = &self.reqs[&h];
        let rest = r.prompt[r.tokens.len()..].to_vec();
        self.extend(h, &rest, true);
    }

    /// Runs the step of `h`'s unwritten positions: the queued transfers
    /// first, then the writes.
    pub fn write(&mut self, h: i64) {
        self.drain();
        let slots = self.a.slots(h).expect("resident");
        let r = self.reqs.get_mut(&h).expect("open");
        r.want.resize(r.tokens.len(), None);
        for (i, &slot) in slots.iter().enumerate() {
            if r.want[i].is_some() {
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
            r.want[i] = Some(c);
            self.s.dev[slot as usize] = c;
        }
    }

    pub fn drain(&mut self) -> Drained {
        self.s.drain(&mut self.a)
    }

    pub fn cache(&mut self, h: i64) {
        self.a.cache(&[h]).expect("cache");
        self.a.check().expect("check after cache");
    }

    pub fn close(&mut self, h: i64, cache: bool) {
        self.a.close(&[h], cache).expect("close");
        self.reqs.remove(&h);
        self.a.check().expect("check after close");
    }

    /// Opens `prompt`, prefills it, registers it and closes it.
    pub fn serve(&mut self, prompt: &[i32], salt: i64) {
        let (h, _) = self.open(prompt, salt);
        self.prefill(h);
        self.close(h, true);
    }

    pub fn swap_out(&mut self, h: i64) {
        self.a.swap_out(&[h]).expect("swap_out");
        self.a.check().expect("check after swap_out");
    }

    pub fn swap_in(&mut self, h: i64) {
        self.a.swap_in(&[h]).expect("swap_in");
        self.a.check().expect("check after swap_in");
    }

    /// Every open request on the device reads, once the queued transfers
    /// have run, what it wrote or was served.
    pub fn verify(&self) -> Result<(), String> {
        let s = self.s.settled(&self.a);
        self.verify_on(&s)
    }

    /// `verify` against a given store.
    pub fn verify_on(&self, s: &Store) -> Result<(), String> {
        for (&h, r) in &self.reqs {
            if self.a.is_swapped(h) == Ok(true) {
                continue;
            }
            let slots = self.a.slots(h).map_err(|e| e.to_string())?;
            for (i, w) in r.want.iter().enumerate() {
                if let Some(w) = w {
                    let got = s.dev[slots[i] as usize];
                    if got != *w {
                        return Err(format!(
                            "request {h:#x} position {i} (slot {}) reads {got:#x}, wrote {w:#x}",
                            slots[i]
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}
