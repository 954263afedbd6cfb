//! The grouped model growing and shrinking requests: extend and admit (the
//! anchor first, then each group's pages or state) and truncate (each group
//! rolled back, a state group to its checkpoint).

use std::collections::BTreeMap;

use super::{GGroup, GModel, GState};
use crate::reference::Kind;

impl GModel {
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
        let mut back: BTreeMap<usize, Vec<(usize, usize, Vec<usize>)>> = BTreeMap::new();
        for &(row, len, l) in &batch {
            if l >= len {
                continue;
            }
            for (g, e) in self.groups.iter().enumerate() {
                match e {
                    GGroup::Anchor => {}
                    GGroup::Pages(e) => {
                        if !e.rollback_ok(row, l) {
                            match e.cached_window(row, l, &self.regs(row), self.a) {
                                Some((first, pages)) => {
                                    back.entry(g).or_default().push((row, first, pages))
                                }
                                None => return Err(Kind::Rollback(g)),
                            }
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
                    for (row, first, pages) in back.get(&g).into_iter().flatten() {
                        e.take_back(*row, *first, pages);
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
}
