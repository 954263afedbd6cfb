//! The reference model's requests: opening them (fresh, on a matched
//! prefix), forking, closing and resetting.

use kvpool_core::make_handle;

use super::{Kind, Model, Req, HOST, MAX_CTX, MAX_REQ};

impl Model {
    pub fn new_row(&mut self, salt: i64) -> (usize, i64) {
        let row = self.free_rows.pop().unwrap();
        self.generation[row] += 1;
        self.reqs.insert(
            row,
            Req {
                salt,
                ..Default::default()
            },
        );
        (row, make_handle(self.generation[row], row as u32))
    }

    pub fn open(&mut self, n: usize) -> Result<Vec<i64>, Kind> {
        if n > self.free_rows.len() {
            return Err(Kind::TooMany);
        }
        Ok((0..n).map(|_| self.new_row(0).1).collect())
    }

    pub fn open_with_prefix(
        &mut self,
        prompts: &[Vec<i32>],
        salts: &[i64],
    ) -> Result<(Vec<i64>, Vec<i64>), Kind> {
        if prompts.iter().any(|p| p.len() > MAX_CTX) {
            return Err(Kind::TooLong);
        }
        if prompts.len() > self.free_rows.len() {
            return Err(Kind::TooMany);
        }
        // Matches first (nothing changes), then hits. A match names each
        // page's location: its device page, or its host copy `| HOST`.
        let mut found = Vec::new();
        for (p, &salt) in prompts.iter().zip(salts) {
            let max = p.len().saturating_sub(1) / self.ps;
            let (mut pages, mut prev) = (Vec::new(), 0u64);
            for k in 0..max {
                match self.find(&(salt, p[..(k + 1) * self.ps].to_vec())) {
                    Some(e) if e.parent_reg == prev => {
                        pages.push(e.dev.unwrap_or_else(|| e.host.unwrap() | HOST));
                        prev = e.reg;
                    }
                    _ => break,
                }
            }
            found.push((pages, prev));
        }
        if found
            .iter()
            .any(|(pages, _)| pages.iter().any(|&l| l & HOST != 0))
        {
            return Ok(self.open_with_host_hits(prompts, salts, found));
        }
        let (mut hs, mut cached) = (Vec::new(), Vec::new());
        for ((p, &salt), (pages, prev)) in prompts.iter().zip(salts).zip(found) {
            let (h, len) = self.open_on(p, salt, pages, prev);
            hs.push(h);
            cached.push(len as i64);
        }
        Ok((hs, cached))
    }

    /// Opens a request of `prompt` on the held device pages `pages` of a
    /// match ending at registration `prev`; returns (handle, cached_len).
    pub(crate) fn open_on(
        &mut self,
        p: &[i32],
        salt: i64,
        pages: Vec<usize>,
        prev: u64,
    ) -> (i64, usize) {
        let regs: Vec<u64> = pages.iter().map(|&q| self.entry_at(q).unwrap()).collect();
        debug_assert_eq!(regs.last().copied().unwrap_or(0), prev);
        // The pages are held already; holding them again changes nothing.
        self.open_matched(p, salt, &pages, &regs)
    }

    /// The device pages of `p`'s longest verified prefix (at most
    /// `(len - 1) / ps` pages) and their registration ids; a match stops
    /// at an entry with no device copy.
    pub fn match_prompt(&self, p: &[i32], salt: i64) -> (Vec<usize>, Vec<u64>) {
        let max = p.len().saturating_sub(1) / self.ps;
        let (mut pages, mut regs, mut prev) = (Vec::new(), Vec::new(), 0u64);
        for k in 0..max {
            match self.find(&(salt, p[..(k + 1) * self.ps].to_vec())) {
                Some(e) if e.parent_reg == prev && e.dev.is_some() => {
                    pages.push(e.dev.unwrap());
                    regs.push(e.reg);
                    prev = e.reg;
                }
                _ => break,
            }
        }
        (pages, regs)
    }

    /// Opens a request with prompt `p` on the matched `pages` (ids `regs`);
    /// returns its handle and length.
    pub fn open_matched(
        &mut self,
        p: &[i32],
        salt: i64,
        pages: &[usize],
        regs: &[u64],
    ) -> (i64, usize) {
        let (row, h) = self.new_row(salt);
        for &q in pages {
            self.hold(q);
        }
        let len = pages.len() * self.ps;
        let r = self.reqs.get_mut(&row).unwrap();
        r.tokens = p[..len].iter().map(|&t| Some(t)).collect();
        r.pages = pages.to_vec();
        r.prompt = p.to_vec();
        r.hashed = pages.len();
        r.chain_reg = regs.last().copied().unwrap_or(0);
        r.regs = regs.to_vec();
        r.through = regs.to_vec();
        self.hit += len as u64;
        self.miss += (p.len() - len) as u64;
        (h, len)
    }

    pub fn close(&mut self, hs: &[i64], cache: bool) -> Result<(), Kind> {
        let rows = self.rows(hs)?;
        if cache {
            if rows.iter().any(|r| self.reqs[r].swapped) {
                return Err(Kind::Swapped);
            }
            self.register_rows(&rows);
        }
        for r in rows {
            self.close_row(r);
            self.free_rows.push(r);
        }
        Ok(())
    }

    fn close_row(&mut self, r: usize) {
        if self.reqs[&r].swapped {
            self.close_swapped(r);
        } else {
            self.shrink(r, 0);
        }
        self.reqs.remove(&r);
    }

    pub fn fork(&mut self, h: i64, n: usize) -> Result<Vec<i64>, Kind> {
        let parent = self.row(h).ok_or(Kind::Handle)?;
        if self.reqs[&parent].swapped {
            return Err(Kind::Swapped);
        }
        if n > self.free_rows.len() {
            return Err(Kind::TooMany);
        }
        let mut out = Vec::new();
        for _ in 0..n {
            let copy = self.reqs[&parent].clone();
            let (row, h) = self.new_row(copy.salt);
            self.reqs.insert(row, copy);
            out.push(h);
        }
        Ok(out)
    }

    /// Closes every open request, in row order; rows then open 0, 1, 2, ...
    pub fn reset(&mut self) {
        let rows: Vec<usize> = self.reqs.keys().copied().collect();
        for r in rows {
            self.close_row(r);
        }
        self.free_rows = (0..MAX_REQ).rev().collect();
    }
}
