//! The reference model growing and shrinking requests: extend (its checks,
//! copy-on-write of a shared last page, new pages) and truncate.

use super::{Kind, Model, QueuedCopy, MAX_CTX};

impl Model {
    /// extend's checks in its order but the pages available: handles,
    /// counts, lengths, then token ids. Returns the pages it needs.
    pub fn extend_checks(
        &self,
        hs: &[i64],
        cs: &[i64],
        tokens: Option<&[i64]>,
    ) -> Result<usize, Kind> {
        let mut rows = Vec::new();
        let mut need = 0;
        // Shared partly filled last pages of growing requests, with how many
        // of them grow: a page of `h` holders is copied by all but the last
        // holder to grow, min(m, h - 1) times.
        let mut shared: Vec<(usize, usize)> = Vec::new();
        for (i, &h) in hs.iter().enumerate() {
            let r = self.row(h).ok_or(Kind::Handle)?;
            if rows.contains(&r) {
                return Err(Kind::Arg);
            }
            rows.push(r);
            if cs[i] < 0 {
                return Err(Kind::Arg);
            }
            let req = &self.reqs[&r];
            if req.swapped {
                return Err(Kind::Swapped);
            }
            let (len, c) = (req.len(), cs[i] as usize);
            if len + c > MAX_CTX {
                return Err(Kind::TooLong);
            }
            need += (len + c).div_ceil(self.ps) - len.div_ceil(self.ps);
            let last = *req.pages.last().unwrap_or(&0);
            if c > 0 && len % self.ps != 0 && self.holders(last) > 1 {
                match shared.iter_mut().find(|(p, _)| *p == last) {
                    Some((_, m)) => *m += 1,
                    None => shared.push((last, 1)),
                }
            }
        }
        need += shared
            .iter()
            .map(|&(p, m)| m.min(self.holders(p) - 1))
            .sum::<usize>();
        if let Some(t) = tokens {
            let total: i64 = cs.iter().sum();
            if t.len() as i64 != total || t.iter().any(|&x| x < 0 || x > i32::MAX as i64) {
                return Err(Kind::Arg);
            }
            let mut k = 0;
            for (i, &r) in rows.iter().enumerate() {
                let req = &self.reqs[&r];
                for j in 0..cs[i] as usize {
                    let pos = req.len() + j;
                    if pos < req.prompt.len() && req.prompt[pos] as i64 != t[k + j] {
                        return Err(Kind::Arg);
                    }
                }
                k += cs[i] as usize;
            }
        }
        Ok(need)
    }

    /// `tokens`: per request, the ids given for its new positions (or None).
    pub fn extend(
        &mut self,
        hs: &[i64],
        cs: &[i64],
        tokens: Option<&[i64]>,
    ) -> Result<Vec<i64>, Kind> {
        let need = self.extend_checks(hs, cs, tokens)?;
        if need > self.free.len() + self.evictable() {
            return Err(Kind::Exhausted);
        }
        let rows = self.rows(hs)?;
        let mut out = Vec::new();
        let mut k = 0;
        for (i, &r) in rows.iter().enumerate() {
            let c = cs[i] as usize;
            let len = self.reqs[&r].len();
            if c > 0 && len % self.ps != 0 {
                let last = *self.reqs[&r].pages.last().unwrap();
                if self.holders(last) > 1 {
                    let q = self.take_page();
                    let off = len % self.ps;
                    self.queued += off;
                    self.queue.push(QueuedCopy {
                        src: last,
                        dst: q,
                        len: off,
                    });
                    *self.reqs.get_mut(&r).unwrap().pages.last_mut().unwrap() = q;
                } else if self.is_registered(last) {
                    self.prio.remove(&last);
                    self.drop_device_copy(last, false);
                }
            }
            for j in 0..c {
                let t = len + j;
                let page = if t % self.ps == 0 {
                    let p = self.take_page();
                    self.reqs.get_mut(&r).unwrap().pages.push(p);
                    p
                } else {
                    *self.reqs[&r].pages.last().unwrap()
                };
                let req = self.reqs.get_mut(&r).unwrap();
                let id = match tokens {
                    Some(tk) => Some(tk[k + j] as i32),
                    None => req.prompt.get(t).copied(),
                };
                req.tokens.push(id);
                out.push((page * self.ps + t % self.ps) as i64);
            }
            k += c;
        }
        // This call's copies hold their sources from now on.
        self.holding = self.queue.len();
        Ok(out)
    }

    pub fn truncate(&mut self, hs: &[i64], ls: &[i64]) -> Result<(), Kind> {
        for i in 0..hs.len() {
            let r = self.rows(&hs[..=i])?[i];
            if self.reqs[&r].swapped {
                return Err(Kind::Swapped);
            }
            if ls[i] < 0 || ls[i] as usize > self.reqs[&r].len() {
                return Err(Kind::Arg);
            }
        }
        let rows = self.rows(hs)?;
        for (&r, &l) in rows.iter().zip(ls) {
            let req = self.reqs.get_mut(&r).unwrap();
            if (l as usize) < req.len() {
                req.prompt.truncate(l as usize);
            }
            self.shrink(r, l as usize);
        }
        Ok(())
    }

    pub(crate) fn shrink(&mut self, r: usize, l: usize) {
        let keep = l.div_ceil(self.ps);
        let req = self.reqs.get_mut(&r).unwrap();
        let dropped: Vec<usize> = req.pages.drain(keep..).collect();
        req.tokens.truncate(l);
        let mut unheld = Vec::new();
        for &p in dropped.iter().rev() {
            if self.release(p) {
                unheld.push(p);
            }
        }
        // Then the copies into the pages nobody holds now, in that order.
        for p in unheld {
            self.drop_copy_into(p);
        }
        let full = l / self.ps;
        let req = &self.reqs[&r];
        if req.hashed > full {
            let entry = (full > 0)
                .then(|| self.entry_at(req.pages[full - 1]).map(|g| self.reg[&g].reg))
                .flatten();
            // The last page kept duplicated another request's entry: the
            // chain resumes at that entry while every registration the
            // chain stands for is live (as restart_dead_chain would keep it).
            let kept = (entry.is_none() && full > 0 && !req.broken && self.chain_stands(r))
                .then(|| req.through[full - 1]);
            let req = self.reqs.get_mut(&r).unwrap();
            req.broken = false;
            match entry.or(kept) {
                Some(reg) => {
                    req.hashed = full;
                    req.chain_reg = reg;
                }
                None => {
                    req.hashed = 0;
                    req.chain_reg = 0;
                }
            }
            req.regs.truncate(req.hashed);
            req.through.truncate(req.hashed);
        }
    }
}
