//! A deliberately naive reference model of the allocator: one page list and
//! one token list per request, holders counted by scanning every request,
//! the prefix index keyed by the exact content (salt, every token up to the
//! end of the page) instead of a hash, each entry naming its device page
//! and its host copy, the LRU list a plain Vec, the copy-on-write queue a
//! Vec of (source page, destination page, slots) searched front to back,
//! retention priorities a map scanned for the lowest (`priorities.rs`),
//! and the host tier (`tier.rs`) the same way. Same policies as the
//! allocator, written the obvious way.

#![allow(dead_code)]

use std::collections::BTreeMap;

use kvpool_core::{make_handle, PoolError};

mod copies;
mod priorities;
mod tier;

pub use copies::QueuedCopy;
pub use priorities::Prio;
pub use tier::{Tier, HOST};

pub const MAX_REQ: usize = 6;
pub const MAX_CTX: usize = 12;

#[derive(Debug, PartialEq, Clone, Copy)]
pub enum Kind {
    Exhausted,
    Handle,
    TooMany,
    TooLong,
    Arg,
    Swapped,
    HostFull,
    /// A grouped pool's group short of pages or slots.
    GroupExhausted(usize),
    /// A grouped pool's group that cannot roll a request back.
    Rollback(usize),
}

pub fn kind(e: &PoolError) -> Kind {
    match e {
        PoolError::Exhausted { .. } => Kind::Exhausted,
        PoolError::InvalidHandle { .. } => Kind::Handle,
        PoolError::TooManyRequests { .. } => Kind::TooMany,
        PoolError::ContextTooLong { .. } => Kind::TooLong,
        PoolError::InvalidArgument(_) => Kind::Arg,
        PoolError::RequestSwappedOut { .. } => Kind::Swapped,
        PoolError::HostExhausted { .. } => Kind::HostFull,
        PoolError::GroupExhausted(e) => Kind::GroupExhausted(e.group),
        PoolError::RollbackUnavailable(e) => Kind::Rollback(e.group),
        PoolError::Invariant(m) => panic!("invariant error from a valid op: {m}"),
    }
}

#[derive(Debug, Clone, Default)]
pub struct Req {
    /// Device pages, and host pages (`| HOST`) while swapped out.
    pub pages: Vec<usize>,
    /// Token id of every position, None when unknown.
    pub tokens: Vec<Option<i32>>,
    pub prompt: Vec<i32>,
    pub salt: i64,
    pub hashed: usize,
    pub chain_reg: u64,
    pub broken: bool,
    pub swapped: bool,
    /// The registration id the chain reached at each of its pages (what a
    /// grouped pool files its other groups' pages under).
    pub regs: Vec<u64>,
}

impl Req {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    pub fn known(&self) -> Vec<i32> {
        self.tokens.iter().map_while(|t| *t).collect()
    }
}

#[derive(Debug, Clone)]
pub struct Entry {
    pub key: (i64, Vec<i32>),
    pub reg: u64,
    pub parent_reg: u64,
    /// Its device page, and its host copy.
    pub dev: Option<usize>,
    pub host: Option<usize>,
}

pub struct Model {
    pub ps: usize,
    pub free: Vec<usize>,
    /// CACHED pages (pinned ones too), in the order they were last filed.
    pub lru: Vec<usize>,
    /// Entries by registration id.
    pub reg: BTreeMap<u64, Entry>,
    pub tier: Option<Tier>,
    /// Registered device pages a caller gave a priority (the others have
    /// the default).
    pub prio: BTreeMap<usize, Prio>,
    /// The manual clock, ns.
    pub now: u64,
    pub max_pinned: usize,
    /// Durations given so far.
    pub ends_given: u64,
    pub next_reg: u64,
    pub free_rows: Vec<usize>,
    pub generation: Vec<u32>,
    pub reqs: BTreeMap<usize, Req>,
    /// Queued copies, oldest first. The first `holding` hold their source
    /// page (those queued by earlier calls; inside extend, its own do not).
    pub queue: Vec<QueuedCopy>,
    pub holding: usize,
    /// Copies dropped because their destination was released.
    pub dropped: usize,
    /// Slots ever queued for copying.
    pub queued: usize,
    pub hit: u64,
    pub miss: u64,
}

impl Model {
    pub fn new(pages: usize, ps: usize) -> Self {
        Self::with_tier(pages, ps, None)
    }

    pub fn with_tier(pages: usize, ps: usize, tier: Option<Tier>) -> Self {
        Model {
            ps,
            free: (1..pages).rev().collect(),
            lru: Vec::new(),
            prio: BTreeMap::new(),
            now: 0,
            max_pinned: (pages - 1) / 4,
            ends_given: 0,
            reg: BTreeMap::new(),
            tier,
            next_reg: 1,
            free_rows: (0..MAX_REQ).rev().collect(),
            generation: vec![0; MAX_REQ],
            reqs: BTreeMap::new(),
            queue: Vec::new(),
            holding: 0,
            dropped: 0,
            queued: 0,
            hit: 0,
            miss: 0,
        }
    }

    pub fn row(&self, h: i64) -> Option<usize> {
        let row = (h & 0xFFFF_FFFF) as usize;
        let open = h >= 0 && row < MAX_REQ && self.reqs.contains_key(&row);
        (open && (h >> 32) as u32 == self.generation[row]).then_some(row)
    }

    /// Requests naming `p`, plus the queued copies that read it.
    pub fn holders(&self, p: usize) -> usize {
        let requests: usize = self
            .reqs
            .values()
            .map(|r| r.pages.iter().filter(|&&q| q == p).count())
            .sum();
        requests
            + self.queue[..self.holding]
                .iter()
                .filter(|c| c.src == p)
                .count()
    }

    pub fn slots(&self, row: usize) -> Vec<i64> {
        let r = &self.reqs[&row];
        (0..r.len())
            .map(|t| (r.pages[t / self.ps] * self.ps + t % self.ps) as i64)
            .collect()
    }

    fn find(&self, key: &(i64, Vec<i32>)) -> Option<Entry> {
        self.reg.values().find(|e| &e.key == key).cloned()
    }

    /// The registration whose device copy is page `p`.
    pub fn entry_at(&self, p: usize) -> Option<u64> {
        self.reg.values().find(|e| e.dev == Some(p)).map(|e| e.reg)
    }

    pub fn is_registered(&self, p: usize) -> bool {
        self.entry_at(p).is_some()
    }

    /// Registered device pages (`cached_pages`).
    pub fn device_registered(&self) -> usize {
        self.reg.values().filter(|e| e.dev.is_some()).count()
    }

    /// Rows of a batch, or the error kind of its first bad handle/duplicate.
    pub fn rows(&self, hs: &[i64]) -> Result<Vec<usize>, Kind> {
        let mut rows: Vec<usize> = Vec::new();
        for &h in hs {
            let r = self.row(h).ok_or(Kind::Handle)?;
            if rows.contains(&r) {
                return Err(Kind::Arg);
            }
            rows.push(r);
        }
        Ok(rows)
    }

    pub fn take_page(&mut self) -> usize {
        if let Some(p) = self.free.pop() {
            return p;
        }
        self.pop_victim()
    }

    /// One holder of `p` gone (already taken out of its list or the
    /// queue): if none is left, `p` is CACHED or FREE. Returns whether.
    /// A host page (`| HOST`) goes to the host tier's lists.
    pub(crate) fn release(&mut self, p: usize) -> bool {
        if p & HOST != 0 {
            self.host_release(p & !HOST);
            return false;
        }
        if self.holders(p) > 0 {
            return false;
        }
        if self.is_registered(p) {
            self.lru.push(p);
        } else {
            self.free.push(p);
        }
        true
    }

    pub fn hold(&mut self, p: usize) {
        self.lru.retain(|&q| q != p);
    }

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
        self.hit += len as u64;
        self.miss += (p.len() - len) as u64;
        (h, len)
    }

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
            if c > 0 && len % self.ps != 0 && self.holders(*req.pages.last().unwrap()) > 1 {
                need += 1;
            }
        }
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

    fn shrink(&mut self, r: usize, l: usize) {
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
                .then(|| {
                    self.entry_at(req.pages[full - 1])
                        .map(|g| self.reg[&g].clone())
                })
                .flatten();
            let req = self.reqs.get_mut(&r).unwrap();
            req.broken = false;
            match entry {
                Some(e) => {
                    req.hashed = full;
                    req.chain_reg = e.reg;
                }
                None => {
                    req.hashed = 0;
                    req.chain_reg = 0;
                }
            }
            req.regs.truncate(req.hashed);
        }
    }

    pub fn cache(&mut self, hs: &[i64]) -> Result<(), Kind> {
        let rows = self.rows(hs)?;
        if rows.iter().any(|r| self.reqs[r].swapped) {
            return Err(Kind::Swapped);
        }
        for r in rows {
            self.register(r);
        }
        Ok(())
    }

    pub fn register(&mut self, r: usize) {
        let req = self.reqs[&r].clone();
        if req.broken {
            return;
        }
        let known = req.known().len().min(req.len());
        let mut chain_reg = req.chain_reg;
        let mut k = req.hashed;
        let mut broken = false;
        let mut regs = req.regs.clone();
        while k < known / self.ps {
            if chain_reg != 0 && !self.reg.contains_key(&chain_reg) {
                // The chain's tip registration is gone: the chain stops.
                broken = true;
                break;
            }
            let p = req.pages[k];
            let key = (req.salt, req.known()[..(k + 1) * self.ps].to_vec());
            let reg = match self.find(&key) {
                None if !self.is_registered(p) => {
                    let reg = self.next_reg;
                    self.next_reg += 1;
                    self.prio.remove(&p);
                    self.reg.insert(
                        reg,
                        Entry {
                            key,
                            reg,
                            parent_reg: chain_reg,
                            dev: Some(p),
                            host: None,
                        },
                    );
                    Some(reg)
                }
                Some(e) if e.dev == Some(p) => {
                    self.reg.get_mut(&e.reg).unwrap().parent_reg = chain_reg;
                    Some(e.reg)
                }
                Some(e) if e.parent_reg == chain_reg => {
                    // A duplicate; one whose only copy is on the host takes
                    // this page as its device copy.
                    if e.dev.is_none() && !self.is_registered(p) {
                        self.reg.get_mut(&e.reg).unwrap().dev = Some(p);
                    }
                    Some(e.reg)
                }
                _ => None,
            };
            match reg {
                Some(reg) => {
                    chain_reg = reg;
                    regs.push(reg);
                    k += 1;
                }
                None => {
                    broken = true;
                    break;
                }
            }
        }
        let req = self.reqs.get_mut(&r).unwrap();
        let from = req.hashed;
        req.hashed = k;
        req.chain_reg = chain_reg;
        req.broken = broken;
        req.regs = regs;
        if k > from && self.writes_through() {
            self.write_through(r, from, k);
        }
    }

    pub fn close(&mut self, hs: &[i64], cache: bool) -> Result<(), Kind> {
        let rows = self.rows(hs)?;
        if cache {
            if rows.iter().any(|r| self.reqs[r].swapped) {
                return Err(Kind::Swapped);
            }
            for &r in &rows {
                self.register(r);
            }
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

    pub fn evict(&mut self, n: usize) -> usize {
        let k = n.min(self.evictable());
        for _ in 0..k {
            let p = self.pop_victim();
            self.free.push(p);
        }
        k
    }

    pub fn clear_cache(&mut self) {
        // Victims first, then the pinned pages, each set in list order.
        let (pinned, rest): (Vec<usize>, Vec<usize>) = std::mem::take(&mut self.lru)
            .into_iter()
            .partition(|&p| self.list(p) == 101);
        let mut rest = rest;
        rest.sort_by_key(|&p| self.list(p)); // stable: LRU order within a priority
        for p in rest.into_iter().chain(pinned) {
            self.free.push(p);
        }
        if let Some(t) = self.tier.as_mut() {
            for h in std::mem::take(&mut t.lru) {
                t.free.push(h);
            }
        }
        self.reg.clear();
        self.prio.clear();
        for r in self.reqs.values_mut() {
            r.hashed = 0;
            r.chain_reg = 0;
            r.broken = false;
            r.regs.clear();
        }
    }
}
