//! The grouped model's prefix index: registering each group's pages under
//! the anchor's ids, the hit rule (every length, longest first), evicting
//! and clearing.

use super::{GGroup, GModel};
use crate::reference::Kind;

impl GModel {
    pub fn cache(&mut self, hs: &[i64]) -> Result<(), Kind> {
        let rows = self.anchor.rows(hs)?;
        self.register(&rows);
        Ok(())
    }

    pub(crate) fn register(&mut self, rows: &[usize]) {
        let a = self.a;
        for &r in rows {
            // A restarted anchor chain: the groups file again from there.
            if self.anchor.restart_dead_chain(r) {
                let chain = self.anchor.reqs[&r].regs.len() * a;
                for g in self.groups.iter_mut() {
                    if let GGroup::Pages(e) = g {
                        e.clamp_progress(r, chain / e.ps);
                    }
                }
            }
        }
        for &r in rows {
            self.anchor.register(r);
        }
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
}
