//! Prefix hits across groups: `open_with_prefix` and the hit rule (module
//! docs, `mod.rs`). Everything is looked up before anything changes.

use super::paged::PageEngine;
use super::state::StateEngine;
use super::{Group, GroupedAllocator};
use crate::allocator::options::Counts;
use crate::error::Result;
use crate::handle::handle_row;
use crate::memory::reserve;

/// One prompt's hit, found before anything changes.
struct Hit {
    /// Hit length.
    len: usize,
    /// The anchor's matched pages and their registration ids (cut to the
    /// hit).
    pages: Vec<u32>,
    regs: Vec<u64>,
    /// Per group: a page group's first pages (0 where a sliding window
    /// does not reach) with its first held index; a state group's source
    /// (a checkpoint slot, -1 for the empty state) in `first` as i64.
    groups: Vec<(Vec<u32>, i64)>,
}

impl GroupedAllocator {
    /// Opens one request per prompt and gives each the longest prefix that
    /// every group has cached (the hit rule, module docs), capped so at
    /// least one token is left to compute. Same arguments and results as
    /// `SlotAllocator::open_with_prefix`; each request's length is its
    /// `cached_len`, a multiple of [`Self::hit_step`]. A state group's slot
    /// is queued to be filled from the checkpoint at `cached_len` (zeroed
    /// when it is 0). All-or-nothing.
    ///
    /// Errors (nothing changed): `InvalidArgument` (tokens and lengths
    /// disagree, a negative length, a token id outside [0, 2^31), salts of
    /// the wrong length), `ContextTooLong`, `TooManyRequests`,
    /// `GroupExhausted` (a state group without a slot for each request).
    pub fn open_with_prefix(
        &mut self,
        tokens: &[i64],
        lengths: &[i64],
        salt: Counts<'_>,
    ) -> Result<(Vec<i64>, Vec<i64>)> {
        let prompts = self.anchor.group_prompts(tokens, lengths, salt)?;
        let n = prompts.len();
        let mut hits = Vec::new();
        reserve(&mut hits, n, "prefix matches")?;
        for (i, p) in prompts.iter().enumerate() {
            let (mut pages, mut regs) = self.anchor.group_match(p, salt.get(i))?;
            let len = self.hit_len(p.len(), &regs);
            pages.truncate(len / self.a);
            regs.truncate(len / self.a);
            let groups = self.group_hits(len, &regs)?;
            hits.push(Hit {
                len,
                pages,
                regs,
                groups,
            });
        }
        // Room: a state group takes a slot per request, and may not evict
        // the checkpoints this batch hits.
        for g in 0..self.groups.len() {
            let Group::State(e) = &self.groups[g] else {
                continue;
            };
            let mut src: Vec<i64> = hits
                .iter()
                .map(|h| h.groups[g].1)
                .filter(|&s| s > 0)
                .collect();
            src.sort_unstable();
            src.dedup();
            let pinned = src
                .iter()
                .filter(|&&s| e.slots.holders(s as u32) == 0)
                .count();
            let free = e.available() - pinned;
            if n > free {
                return Err(self.exhausted_holding_back(g, n, free, pinned));
            }
        }
        let (mut handles, mut cached) = (Vec::new(), Vec::new());
        reserve(&mut handles, n, "handles")?;
        reserve(&mut cached, n, "cached lengths")?;
        for g in self.groups.iter_mut() {
            if let Group::State(e) = g {
                e.prepare(n)?;
            }
        }
        // Apply: nothing below can fail.
        self.pin_sources(&hits, true);
        for (i, (prompt, hit)) in prompts.into_iter().zip(&hits).enumerate() {
            let h = self
                .anchor
                .group_open_matched(prompt, salt.get(i), &hit.pages);
            let row = handle_row(h) as usize;
            self.regs[row].clear();
            self.regs[row].extend_from_slice(&hit.regs);
            for (g, e) in self.groups.iter_mut().enumerate() {
                let (pages, first) = &hit.groups[g];
                match e {
                    Group::Anchor => {}
                    Group::Pages(e) => {
                        e.start_hit(row, pages, *first as usize, hit.len / e.page_size())
                    }
                    Group::State(e) => e.start_hit(row, *first),
                }
            }
            handles.push(h);
            cached.push(hit.len as i64);
        }
        self.pin_sources(&hits, false);
        Ok((handles, cached))
    }

    /// Holds (or lets go of) every checkpoint the batch hits, so that the
    /// slots taken for it cannot evict one.
    fn pin_sources(&mut self, hits: &[Hit], pin: bool) {
        for (g, e) in self.groups.iter_mut().enumerate() {
            let Group::State(e) = e else { continue };
            for s in hits.iter().map(|h| h.groups[g].1).filter(|&s| s > 0) {
                if pin {
                    e.pin(s as u32);
                } else {
                    e.unpin(s as u32);
                }
            }
        }
    }

    /// The hit rule: the longest length, a multiple of the hit step, at
    /// most `prompt_len - 1` and what the anchor matched (`regs`), that
    /// every group serves.
    fn hit_len(&self, prompt_len: usize, regs: &[u64]) -> usize {
        let step = self.step;
        let mut l = prompt_len.saturating_sub(1).min(regs.len() * self.a) / step * step;
        // Full groups (monotone): their longest cached prefix caps it.
        for e in self.groups.iter() {
            if let Group::Pages(e) = e {
                if e.window.is_none() {
                    let ps = e.page_size();
                    let k = (0..l / ps)
                        .take_while(|&k| e.map.get(self.reg_at(regs, (k + 1) * ps)).is_some())
                        .count();
                    l = l.min(k * ps / step * step);
                }
            }
        }
        // Sliding and state groups each lower it to the longest length they
        // serve, until none does.
        loop {
            let before = l;
            for e in self.groups.iter() {
                l = match e {
                    Group::Pages(e) if e.window.is_some() => self.sliding_fit(e, regs, l),
                    Group::State(e) => self.state_fit(e, regs, l),
                    _ => l,
                };
            }
            if l == before {
                return l;
            }
        }
    }

    /// The anchor registration id at position `end` (a multiple of `a`).
    #[inline]
    fn reg_at(&self, regs: &[u64], end: usize) -> u64 {
        regs[end / self.a - 1]
    }

    /// The longest hit length at most `l` whose window this sliding group
    /// holds, scanning pages from the end: a missing page k rules out every
    /// length whose window contains it.
    fn sliding_fit(&self, e: &PageEngine, regs: &[u64], mut l: usize) -> usize {
        let (ps, step) = (e.page_size(), self.step);
        while l > 0 {
            let first = e.window_start(l) / ps;
            let mut k = l / ps;
            while k > first && e.map.get(self.reg_at(regs, k * ps)).is_some() {
                k -= 1;
            }
            if k == first {
                return l;
            }
            // Page k - 1 is missing.
            l = (l - step).min((k - 1) * ps) / step * step;
        }
        0
    }

    /// The longest hit length at most `l` at which this state group keeps a
    /// checkpoint (0 always: the empty state).
    fn state_fit(&self, e: &StateEngine, regs: &[u64], mut l: usize) -> usize {
        while l > 0 && e.checkpoint(self.reg_at(regs, l)).is_none() {
            l -= self.step;
        }
        l
    }

    /// Each group's part of a hit of length `len` (see [`Hit`]).
    fn group_hits(&self, len: usize, regs: &[u64]) -> Result<Vec<(Vec<u32>, i64)>> {
        let mut out = Vec::new();
        reserve(&mut out, self.groups.len(), "prefix matches")?;
        for e in self.groups.iter() {
            out.push(match e {
                Group::Anchor => (Vec::new(), 0),
                Group::Pages(e) => {
                    let ps = e.page_size();
                    let first = e.window_start(len) / ps;
                    let mut pages = Vec::new();
                    reserve(&mut pages, len / ps, "prefix matches")?;
                    pages.resize(first, 0);
                    for k in first..len / ps {
                        // Present: hit_len checked every one.
                        pages.push(e.map.get(self.reg_at(regs, (k + 1) * ps)).unwrap_or(0));
                    }
                    (pages, first as i64)
                }
                Group::State(e) => match len {
                    0 => (Vec::new(), -1),
                    _ => (
                        Vec::new(),
                        e.checkpoint(self.reg_at(regs, len))
                            .map_or(-1, |s| s as i64),
                    ),
                },
            });
        }
        Ok(out)
    }
}
