//! A naive reference model of `GroupedAllocator`: the anchor is the
//! allocator's own reference model (`reference/`), each other page group a
//! plain page list per request (`None` where a window released the page),
//! a free stack, an LRU Vec and a registration map, each state group a map
//! of live slots, a Vec of queued copies searched front to back, holders
//! counted by scanning. The hit rule tries every length from the longest
//! down. Same policies as the allocator, written the obvious way.

#![allow(dead_code)]

mod pages;
mod state;

use std::collections::BTreeMap;

use crate::reference::{Kind, Model};
pub use pages::GPages;
pub use state::GState;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GKind {
    Full,
    Sliding(usize),
    /// checkpoint_every (resolved)
    State(usize),
}

pub enum GGroup {
    Anchor,
    Pages(GPages),
    State(GState),
}

pub struct GModel {
    pub anchor: Model,
    pub anchor_group: Option<usize>,
    pub a: usize,
    pub step: usize,
    pub groups: Vec<GGroup>,
    pub kinds: Vec<GKind>,
    pub sizes: Vec<usize>,
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl GModel {
    /// `specs`: (kind, num_pages, page_size); checkpoint_every 0 = the step.
    pub fn new(specs: &[(GKind, usize, usize)], anchor_pages: usize) -> Self {
        let a = specs
            .iter()
            .filter(|s| !matches!(s.0, GKind::State(_)))
            .map(|s| s.2)
            .reduce(gcd)
            .unwrap();
        let step = specs
            .iter()
            .filter(|s| !matches!(s.0, GKind::State(_)))
            .fold(a, |l, s| l / gcd(l, s.2) * s.2);
        let anchor_group = specs.iter().position(|s| s.0 == GKind::Full && s.2 == a);
        let anchor = match anchor_group {
            Some(g) => Model::new(specs[g].1, a),
            None => Model::new(anchor_pages, a),
        };
        let mut groups = Vec::new();
        let mut kinds = Vec::new();
        for (g, &(k, n, ps)) in specs.iter().enumerate() {
            let k = match k {
                GKind::State(0) => GKind::State(step),
                k => k,
            };
            kinds.push(k);
            groups.push(match k {
                _ if Some(g) == anchor_group => GGroup::Anchor,
                GKind::Full => GGroup::Pages(GPages::new(n, ps, None)),
                GKind::Sliding(w) => GGroup::Pages(GPages::new(n, ps, Some(w))),
                GKind::State(every) => GGroup::State(GState::new(n, every)),
            });
        }
        GModel {
            anchor,
            anchor_group,
            a,
            step,
            groups,
            kinds,
            sizes: specs.iter().map(|s| s.2).collect(),
        }
    }

    fn anchor_index(&self) -> usize {
        self.anchor_group.unwrap_or(self.groups.len())
    }

    fn anchor_room(&self, need: usize) -> Result<(), Kind> {
        if need > self.anchor.free.len() + self.anchor.lru.len() {
            return Err(Kind::GroupExhausted(self.anchor_index()));
        }
        Ok(())
    }

    fn len(&self, row: usize) -> usize {
        self.anchor.reqs[&row].len()
    }

    fn regs(&self, row: usize) -> Vec<u64> {
        self.anchor.reqs[&row].regs.clone()
    }

    fn state_room(&self, n: usize) -> Result<(), Kind> {
        for (g, e) in self.groups.iter().enumerate() {
            if let GGroup::State(e) = e {
                if n > e.available() {
                    return Err(Kind::GroupExhausted(g));
                }
            }
        }
        Ok(())
    }

    fn open_row(&mut self, row: usize) {
        for g in self.groups.iter_mut() {
            match g {
                GGroup::Anchor => {}
                GGroup::Pages(e) => e.open_row(row),
                GGroup::State(e) => e.open_row(row),
            }
        }
    }

    pub fn open(&mut self, n: usize) -> Result<Vec<i64>, Kind> {
        if n > self.anchor.free_rows.len() {
            return Err(Kind::TooMany);
        }
        self.state_room(n)?;
        let hs = self.anchor.open(n)?;
        for &h in &hs {
            self.open_row((h & 0xFFFF_FFFF) as usize);
        }
        Ok(hs)
    }

    /// Per group: the batch's new slots (empty for a state group).
    pub fn extend(
        &mut self,
        hs: &[i64],
        cs: &[i64],
        tokens: Option<&[i64]>,
    ) -> Result<Vec<Vec<i64>>, Kind> {
        let need = self.anchor.extend_checks(hs, cs, tokens)?;
        let batch: Vec<(usize, usize, usize)> = hs
            .iter()
            .zip(cs)
            .map(|(&h, &c)| {
                let row = (h & 0xFFFF_FFFF) as usize;
                (row, self.len(row), c as usize)
            })
            .collect();
        for g in 0..self.groups.len() {
            match &self.groups[g] {
                GGroup::Anchor => self.anchor_room(need)?,
                GGroup::Pages(e) => {
                    if !e.has_room(&batch) {
                        return Err(Kind::GroupExhausted(g));
                    }
                }
                GGroup::State(_) => {}
            }
        }
        if self.anchor_group.is_none() {
            self.anchor_room(need)?;
        }
        let anchor_out = self.anchor.extend(hs, cs, tokens).expect("checked");
        if self.anchor_group.is_none() {
            self.anchor.take_copies_from(0);
        }
        Ok(self.grow_groups(&batch, anchor_out))
    }

    fn grow_groups(
        &mut self,
        batch: &[(usize, usize, usize)],
        anchor_out: Vec<i64>,
    ) -> Vec<Vec<i64>> {
        let mut outs = Vec::new();
        for g in self.groups.iter_mut() {
            outs.push(match g {
                GGroup::Anchor => anchor_out.clone(),
                GGroup::Pages(e) => e.grow_batch(batch),
                GGroup::State(_) => Vec::new(),
            });
        }
        outs
    }

    pub fn admit(
        &mut self,
        cs: &[i64],
        tokens: Option<&[i64]>,
    ) -> Result<(Vec<i64>, Vec<Vec<i64>>), Kind> {
        if cs.len() > self.anchor.free_rows.len() {
            return Err(Kind::TooMany);
        }
        for &c in cs {
            if c < 0 {
                return Err(Kind::Arg);
            }
            if c as usize > crate::reference::MAX_CTX {
                return Err(Kind::TooLong);
            }
        }
        if let Some(t) = tokens {
            let total: i64 = cs.iter().sum();
            if t.len() as i64 != total || t.iter().any(|&x| x < 0 || x > i32::MAX as i64) {
                return Err(Kind::Arg);
            }
        }
        let need: usize = cs.iter().map(|&c| (c as usize).div_ceil(self.a)).sum();
        let fresh: Vec<(usize, usize, usize)> =
            cs.iter().map(|&c| (usize::MAX, 0, c as usize)).collect();
        for g in 0..self.groups.len() {
            match &self.groups[g] {
                GGroup::Anchor => self.anchor_room(need)?,
                GGroup::Pages(e) => {
                    if !e.has_room(&fresh) {
                        return Err(Kind::GroupExhausted(g));
                    }
                }
                GGroup::State(e) => {
                    if cs.len() > e.available() {
                        return Err(Kind::GroupExhausted(g));
                    }
                }
            }
        }
        if self.anchor_group.is_none() {
            self.anchor_room(need)?;
        }
        let hs = self.anchor.open(cs.len()).expect("checked");
        let anchor_out = self.anchor.extend(&hs, cs, tokens).expect("checked");
        let batch: Vec<(usize, usize, usize)> = hs
            .iter()
            .zip(cs)
            .map(|(&h, &c)| ((h & 0xFFFF_FFFF) as usize, 0, c as usize))
            .collect();
        for r in &batch {
            self.open_row(r.0);
        }
        Ok((hs, self.grow_groups(&batch, anchor_out)))
    }

    /// The checkpoint a state group restores `row` from at `len` (-1: the
    /// empty state).
    fn checkpoint_at(&self, e: &GState, row: usize, len: usize) -> Option<i64> {
        if len == 0 {
            return Some(-1);
        }
        let regs = self.regs(row);
        if len % self.a != 0 || regs.len() * self.a < len {
            return None;
        }
        e.checkpoint(regs[len / self.a - 1]).map(|s| s as i64)
    }

    pub fn truncate(&mut self, hs: &[i64], ls: &[i64]) -> Result<(), Kind> {
        for i in 0..hs.len() {
            let r = self.anchor.rows(&hs[..=i])?[i];
            if ls[i] < 0 || ls[i] as usize > self.len(r) {
                return Err(Kind::Arg);
            }
        }
        let batch: Vec<(usize, usize, usize)> = hs
            .iter()
            .zip(ls)
            .map(|(&h, &l)| {
                let row = (h & 0xFFFF_FFFF) as usize;
                (row, self.len(row), l as usize)
            })
            .collect();
        let mut sources: BTreeMap<usize, Vec<i64>> = BTreeMap::new();
        for &(row, len, l) in &batch {
            if l >= len {
                continue;
            }
            for (g, e) in self.groups.iter().enumerate() {
                match e {
                    GGroup::Anchor => {}
                    GGroup::Pages(e) => {
                        if !e.rollback_ok(row, l) {
                            return Err(Kind::Rollback(g));
                        }
                    }
                    GGroup::State(e) => match self.checkpoint_at(e, row, l) {
                        Some(s) => sources.entry(g).or_default().push(s),
                        None => return Err(Kind::Rollback(g)),
                    },
                }
            }
        }
        for (g, e) in self.groups.iter().enumerate() {
            let GGroup::State(e) = e else { continue };
            let fresh = batch
                .iter()
                .filter(|r| r.2 < r.1 && e.reading(e.live[&r.0]) > 0)
                .count();
            let mut src: Vec<i64> = sources.get(&g).cloned().unwrap_or_default();
            src.retain(|&s| s > 0);
            src.sort();
            src.dedup();
            let cached = src
                .iter()
                .filter(|&&s| e.lru.contains(&(s as usize)))
                .count();
            if fresh > e.available() - cached {
                return Err(Kind::GroupExhausted(g));
            }
        }
        self.anchor.truncate(hs, ls).expect("checked");
        let a = self.a;
        for g in 0..self.groups.len() {
            match &mut self.groups[g] {
                GGroup::Anchor => {}
                GGroup::Pages(e) => {
                    for &(row, len, l) in &batch {
                        let chain = self.anchor.reqs[&row].regs.len() * a;
                        e.clamp_progress(row, chain / e.ps);
                        e.shrink(row, len, l);
                    }
                }
                GGroup::State(e) => {
                    let src = sources.get(&g).cloned().unwrap_or_default();
                    for &s in src.iter().filter(|&&s| s > 0) {
                        e.pin(s as usize);
                    }
                    let mut k = 0;
                    for &(row, len, l) in &batch {
                        if l < len {
                            e.restore(row, src[k]);
                            k += 1;
                        }
                    }
                    for &s in src.iter().filter(|&&s| s > 0) {
                        e.unpin(s as usize);
                    }
                }
            }
        }
        Ok(())
    }

    pub fn cache(&mut self, hs: &[i64]) -> Result<(), Kind> {
        let rows = self.anchor.rows(hs)?;
        self.register(&rows);
        Ok(())
    }

    fn register(&mut self, rows: &[usize]) {
        for &r in rows {
            self.anchor.register(r);
        }
        let a = self.a;
        for g in self.groups.iter_mut() {
            match g {
                GGroup::Anchor => {}
                GGroup::Pages(e) => {
                    for &r in rows {
                        let req = &self.anchor.reqs[&r];
                        e.register(r, req.len(), &req.regs, a);
                    }
                }
                GGroup::State(e) => {
                    for &r in rows {
                        let req = &self.anchor.reqs[&r];
                        let len = req.len();
                        if len > 0 && len % e.every == 0 && req.regs.len() * a >= len {
                            e.take_checkpoint(r, req.regs[len / a - 1]);
                        }
                    }
                }
            }
        }
    }

    pub fn close(&mut self, hs: &[i64], cache: bool) -> Result<(), Kind> {
        let rows = self.anchor.rows(hs)?;
        if cache {
            self.register(&rows);
        }
        let lens: Vec<usize> = rows.iter().map(|&r| self.len(r)).collect();
        self.anchor.close(hs, false).expect("checked");
        self.close_rows(&rows, &lens);
        Ok(())
    }

    fn close_rows(&mut self, rows: &[usize], lens: &[usize]) {
        for g in self.groups.iter_mut() {
            match g {
                GGroup::Anchor => {}
                GGroup::Pages(e) => {
                    for (&r, &len) in rows.iter().zip(lens) {
                        e.shrink(r, len, 0);
                    }
                }
                GGroup::State(e) => {
                    for &r in rows {
                        e.close_row(r);
                    }
                }
            }
        }
    }

    pub fn reset(&mut self) {
        let rows: Vec<usize> = self.anchor.reqs.keys().copied().collect();
        let lens: Vec<usize> = rows.iter().map(|&r| self.len(r)).collect();
        self.anchor.reset();
        self.close_rows(&rows, &lens);
    }

    pub fn fork(&mut self, h: i64, n: usize) -> Result<Vec<i64>, Kind> {
        let parent = self.anchor.row(h).ok_or(Kind::Handle)?;
        if n > self.anchor.free_rows.len() {
            return Err(Kind::TooMany);
        }
        self.state_room(n)?;
        let kids = self.anchor.fork(h, n).expect("checked");
        let len = self.len(parent);
        for &k in &kids {
            let row = (k & 0xFFFF_FFFF) as usize;
            for g in self.groups.iter_mut() {
                match g {
                    GGroup::Anchor => {}
                    GGroup::Pages(e) => e.fork_row(parent, row, len),
                    GGroup::State(e) => e.fork_row(parent, row),
                }
            }
        }
        Ok(kids)
    }

    /// Whether group `g` serves a hit of length `l` whose anchor ids are
    /// `regs`.
    fn serves(&self, g: usize, regs: &[u64], l: usize) -> bool {
        let reg = |end: usize| regs[end / self.a - 1];
        match &self.groups[g] {
            GGroup::Anchor => true,
            GGroup::Pages(e) => {
                let first = e.window_start(l) / e.ps;
                (first..l / e.ps).all(|k| e.find(reg((k + 1) * e.ps)).is_some())
            }
            GGroup::State(e) => l == 0 || e.checkpoint(reg(l)).is_some(),
        }
    }

    pub fn open_with_prefix(
        &mut self,
        prompts: &[Vec<i32>],
        salt: i64,
    ) -> Result<(Vec<i64>, Vec<i64>), Kind> {
        if prompts.iter().any(|p| p.len() > crate::reference::MAX_CTX) {
            return Err(Kind::TooLong);
        }
        if prompts.len() > self.anchor.free_rows.len() {
            return Err(Kind::TooMany);
        }
        let mut hits = Vec::new();
        for p in prompts {
            let (pages, regs) = self.anchor.match_prompt(p, salt);
            let max = p.len().saturating_sub(1).min(regs.len() * self.a) / self.step * self.step;
            let l = (0..=max / self.step)
                .rev()
                .map(|k| k * self.step)
                .find(|&l| (0..self.groups.len()).all(|g| self.serves(g, &regs, l)))
                .unwrap_or(0);
            let n = l / self.a;
            hits.push((l, pages[..n].to_vec(), regs[..n].to_vec()));
        }
        let n = prompts.len();
        for (g, e) in self.groups.iter().enumerate() {
            let GGroup::State(e) = e else { continue };
            let mut src: Vec<i64> = hits
                .iter()
                .map(|(l, _, regs)| {
                    if *l == 0 {
                        -1
                    } else {
                        e.checkpoint(regs[l / self.a - 1]).unwrap() as i64
                    }
                })
                .filter(|&s| s > 0)
                .collect();
            src.sort();
            src.dedup();
            let cached = src
                .iter()
                .filter(|&&s| e.lru.contains(&(s as usize)))
                .count();
            if n > e.available() - cached {
                return Err(Kind::GroupExhausted(g));
            }
        }
        let a = self.a;
        let srcs: Vec<Vec<i64>> = self
            .groups
            .iter()
            .map(|e| match e {
                GGroup::State(e) => hits
                    .iter()
                    .map(|(l, _, regs)| {
                        if *l == 0 {
                            -1
                        } else {
                            e.checkpoint(regs[l / a - 1]).unwrap() as i64
                        }
                    })
                    .collect(),
                _ => Vec::new(),
            })
            .collect();
        for (g, e) in self.groups.iter_mut().enumerate() {
            if let GGroup::State(e) = e {
                for &s in srcs[g].iter().filter(|&&s| s > 0) {
                    e.pin(s as usize);
                }
            }
        }
        let (mut hs, mut cached) = (Vec::new(), Vec::new());
        for (i, (p, (l, pages, regs))) in prompts.iter().zip(&hits).enumerate() {
            let (h, _) = self.anchor.open_matched(p, salt, pages, regs);
            let row = (h & 0xFFFF_FFFF) as usize;
            for (g, e) in self.groups.iter_mut().enumerate() {
                match e {
                    GGroup::Anchor => {}
                    GGroup::Pages(e) => e.start_hit(row, *l, regs, a),
                    GGroup::State(e) => e.start_hit(row, srcs[g][i]),
                }
            }
            hs.push(h);
            cached.push(*l as i64);
        }
        for (g, e) in self.groups.iter_mut().enumerate() {
            if let GGroup::State(e) = e {
                for &s in srcs[g].iter().filter(|&&s| s > 0) {
                    e.unpin(s as usize);
                }
            }
        }
        Ok((hs, cached))
    }

    pub fn evict(&mut self, g: usize, n: usize) -> usize {
        match &mut self.groups[g] {
            GGroup::Anchor => self.anchor.evict(n),
            GGroup::Pages(e) => e.evict(n),
            GGroup::State(e) => e.evict(n),
        }
    }

    pub fn clear_cache(&mut self) {
        self.anchor.clear_cache();
        for g in self.groups.iter_mut() {
            match g {
                GGroup::Anchor => {}
                GGroup::Pages(e) => e.clear(),
                GGroup::State(e) => e.clear(),
            }
        }
    }

    pub fn take_copies(&mut self, g: usize) -> (Vec<i64>, Vec<i64>) {
        match &mut self.groups[g] {
            GGroup::Anchor => self.anchor.take_copies_from(0),
            GGroup::Pages(e) => e.take_copies(),
            GGroup::State(e) => e.take_copies(),
        }
    }

    /// (free + evictable, registered, evictable, pending copies) of group g.
    pub fn counters(&self, g: usize) -> (usize, usize, usize, usize) {
        match &self.groups[g] {
            GGroup::Anchor => (
                self.anchor.free.len() + self.anchor.lru.len(),
                self.anchor.reg.len(),
                self.anchor.lru.len(),
                self.anchor.pending_copies(),
            ),
            GGroup::Pages(e) => (
                e.free.len() + e.lru.len(),
                e.reg.len(),
                e.lru.len(),
                e.pending_copies(),
            ),
            GGroup::State(e) => (e.available(), e.reg.len(), e.lru.len(), e.queue.len()),
        }
    }

    /// Group g's slots of an open row (page groups).
    pub fn slots(&self, g: usize, row: usize) -> Vec<i64> {
        match &self.groups[g] {
            GGroup::Anchor => self.anchor.slots(row),
            GGroup::Pages(e) => e.slots(row, self.len(row)),
            GGroup::State(_) => unreachable!(),
        }
    }

    /// The last position below `row`'s length where its first state group
    /// keeps a checkpoint of its prefix.
    pub fn checkpointed(&self, row: usize) -> Option<usize> {
        let e = self.groups.iter().find_map(|g| match g {
            GGroup::State(e) => Some(e),
            _ => None,
        })?;
        let regs = self.regs(row);
        (1..self.len(row)).rev().find(|&l| {
            l % self.a == 0
                && regs.len() * self.a >= l
                && e.checkpoint(regs[l / self.a - 1]).is_some()
        })
    }

    pub fn state_slot(&self, g: usize, row: usize) -> i64 {
        match &self.groups[g] {
            GGroup::State(e) => e.live[&row] as i64,
            _ => unreachable!(),
        }
    }
}
