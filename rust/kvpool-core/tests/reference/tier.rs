//! The reference model's host tier, the obvious way: host holders counted
//! by scanning the swapped-out requests and the transfer queues, the free
//! stack and the eviction list plain Vecs, the queues Vecs of page pairs.
//! Same policies as the allocator (`host/`, `allocator/tier.rs`,
//! `prefix_host.rs`, `swap.rs`).

use kvpool_core::HostPolicy;

use super::{Kind, Model};

/// Marks a host page in a request's page list (and in a match).
pub const HOST: usize = 1 << 31;

#[derive(Debug, Clone)]
pub struct Tier {
    pub policy: HostPolicy,
    /// FREE host pages; the top (end) goes first.
    pub free: Vec<usize>,
    /// CACHED host pages, oldest first.
    pub lru: Vec<usize>,
    /// Queued (device, host) offloads and (host, device) loads.
    pub offloads: Vec<(usize, usize)>,
    pub loads: Vec<(usize, usize)>,
    pub hit: u64,
    pub offloaded: u64,
    pub loaded: u64,
}

impl Tier {
    pub fn new(host_pages: usize, policy: HostPolicy) -> Self {
        Tier {
            policy,
            free: (1..host_pages).rev().collect(),
            lru: Vec::new(),
            offloads: Vec::new(),
            loads: Vec::new(),
            hit: 0,
            offloaded: 0,
            loaded: 0,
        }
    }
}

/// What swap_out does with one device page.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Plan {
    Stay,
    Reuse(usize),
    Offload,
}

impl Model {
    fn t(&mut self) -> &mut Tier {
        self.tier.as_mut().expect("a host tier")
    }

    pub fn writes_through(&self) -> bool {
        self.tier
            .as_ref()
            .is_some_and(|t| t.policy == HostPolicy::WriteThrough)
    }

    fn writes_back(&self) -> bool {
        self.tier
            .as_ref()
            .is_some_and(|t| t.policy == HostPolicy::WriteBack)
    }

    /// The registration whose host copy is host page `h`.
    pub fn entry_on_host(&self, h: usize) -> Option<u64> {
        self.reg.values().find(|e| e.host == Some(h)).map(|e| e.reg)
    }

    /// Swapped-out requests naming host page `h`, plus the queued
    /// transfers that pin it.
    pub fn host_holders(&self, h: usize) -> usize {
        let named: usize = self
            .reqs
            .values()
            .map(|r| r.pages.iter().filter(|&&p| p == h | HOST).count())
            .sum();
        let t = self.tier.as_ref().expect("a host tier");
        named
            + t.loads.iter().filter(|l| l.0 == h).count()
            + t.offloads.iter().filter(|o| o.1 == h).count()
    }

    /// One more holder of `h` (a CACHED one leaves the list).
    fn host_hold(&mut self, h: usize) {
        self.t().lru.retain(|&x| x != h);
    }

    /// One holder of `h` gone (already out of its list or queue).
    pub(crate) fn host_release(&mut self, h: usize) {
        if self.host_holders(h) > 0 {
            return;
        }
        let registered = self.entry_on_host(h).is_some();
        let t = self.t();
        if registered {
            t.lru.push(h);
        } else {
            t.free.push(h);
        }
    }

    pub(crate) fn parent_live(&self, reg: u64) -> bool {
        let p = self.reg[&reg].parent_reg;
        p == 0 || self.reg.contains_key(&p)
    }

    /// Device page `p` leaves the index (evicted, or written in place).
    pub(crate) fn drop_device_copy(&mut self, p: usize, offload: bool) {
        let Some(reg) = self.entry_at(p) else {
            return;
        };
        if self.reg[&reg].host.is_none() && offload && self.writes_back() {
            self.new_host_copy(reg, p);
        }
        let e = self.reg.get_mut(&reg).unwrap();
        e.dev = None;
        if e.host.is_none() {
            self.forget(reg);
        }
    }

    /// A host copy for `reg` (on device page `p`), offloaded.
    fn new_host_copy(&mut self, reg: u64, p: usize) -> Option<usize> {
        if !self.parent_live(reg) {
            return None;
        }
        let h = self.take_host_page()?;
        if !self.parent_live(reg) {
            self.t().free.push(h);
            return None;
        }
        self.reg.get_mut(&reg).unwrap().host = Some(h);
        self.t().offloads.push((p, h));
        Some(h)
    }

    /// FREE first, else the oldest CACHED host page (its copy goes).
    fn take_host_page(&mut self) -> Option<usize> {
        let t = self.tier.as_mut()?;
        if let Some(h) = t.free.pop() {
            return Some(h);
        }
        if t.lru.is_empty() {
            return None;
        }
        let h = t.lru.remove(0);
        let reg = self
            .entry_on_host(h)
            .expect("a CACHED host page holds a copy");
        let e = self.reg.get_mut(&reg).unwrap();
        e.host = None;
        if e.dev.is_none() {
            self.forget(reg);
        }
        Some(h)
    }

    /// cache()'s pages `from..to` of row `r`, just registered, get host copies.
    pub(crate) fn write_through(&mut self, r: usize, from: usize, to: usize) {
        for k in from..to {
            let p = self.reqs[&r].pages[k];
            if let Some(reg) = self.entry_at(p) {
                if self.reg[&reg].host.is_none() {
                    self.new_host_copy(reg, p);
                }
            }
        }
    }

    /// open_with_prefix when a match reaches host-only entries: hold and
    /// pin every hit in batch order while a page is left for each load,
    /// then the loads, then the requests.
    pub(crate) fn open_with_host_hits(
        &mut self,
        prompts: &[Vec<i32>],
        salts: &[i64],
        found: Vec<(Vec<usize>, u64)>,
    ) -> (Vec<i64>, Vec<i64>) {
        let mut pending: Vec<u64> = Vec::new();
        let mut kept = Vec::new();
        for (pages, _) in &found {
            let mut k = 0;
            for &loc in pages {
                let spare = self.free.len() + self.evictable() > pending.len();
                if loc & HOST != 0 {
                    let reg = self.entry_on_host(loc & !HOST).unwrap();
                    if !pending.contains(&reg) {
                        if !spare {
                            break;
                        }
                        self.host_hold(loc & !HOST);
                        pending.push(reg);
                    }
                } else {
                    // A pinned page was never available: holding it uses up no page.
                    if self.lru.contains(&loc)
                        && !spare
                        && self.list(loc) != super::priorities::PINNED
                    {
                        break;
                    }
                    self.hold(loc);
                }
                k += 1;
            }
            kept.push(k);
        }
        for &reg in &pending {
            let h = self.reg[&reg].host.unwrap();
            let q = self.take_page();
            self.reg.get_mut(&reg).unwrap().dev = Some(q);
            self.t().loads.push((h, q));
        }
        let (mut hs, mut cached) = (Vec::new(), Vec::new());
        for (((p, &salt), (pages, prev)), k) in prompts.iter().zip(salts).zip(found).zip(kept) {
            let mut loaded = 0;
            let mine: Vec<usize> = pages[..k]
                .iter()
                .map(|&l| {
                    if l & HOST == 0 {
                        return l;
                    }
                    loaded += 1;
                    let reg = self.entry_on_host(l & !HOST).unwrap();
                    self.reg[&reg].dev.unwrap()
                })
                .collect();
            let prev = match mine.last() {
                _ if k == pages.len() => prev,
                Some(&q) => self.entry_at(q).unwrap(),
                None => 0,
            };
            let (h, len) = self.open_on(p, salt, mine, prev);
            let ps = self.ps as u64;
            self.t().hit += loaded * ps;
            hs.push(h);
            cached.push(len as i64);
        }
        (hs, cached)
    }

    fn plan(&self, p: usize) -> Plan {
        let t = self.tier.as_ref().unwrap();
        if self.holders(p) != 1
            || self.queue.iter().any(|c| c.dst == p)
            || t.loads.iter().any(|l| l.1 == p)
        {
            return Plan::Stay;
        }
        match self.entry_at(p).and_then(|g| self.reg[&g].host) {
            Some(h) => Plan::Reuse(h),
            None => Plan::Offload,
        }
    }

    pub fn swap_out(&mut self, hs: &[i64]) -> Result<(), Kind> {
        if self.tier.is_none() {
            return Err(Kind::Arg);
        }
        let rows = self.rows(hs)?;
        if rows.iter().any(|r| self.reqs[r].swapped) {
            return Err(Kind::Swapped);
        }
        let (mut fresh, mut cached) = (0, 0);
        for r in &rows {
            for &p in &self.reqs[r].pages {
                match self.plan(p) {
                    Plan::Stay => {}
                    Plan::Reuse(h) => {
                        cached += self.tier.as_ref().unwrap().lru.contains(&h) as usize
                    }
                    Plan::Offload => fresh += 1,
                }
            }
        }
        let t = self.tier.as_ref().unwrap();
        if fresh + cached > t.free.len() + t.lru.len() {
            return Err(Kind::HostFull);
        }
        for r in &rows {
            for p in self.reqs[r].pages.clone() {
                if let Plan::Reuse(h) = self.plan(p) {
                    self.host_hold(h);
                }
            }
        }
        for r in rows {
            let mut released = Vec::new();
            for k in 0..self.reqs[&r].pages.len() {
                let p = self.reqs[&r].pages[k];
                let h = match self.plan(p) {
                    Plan::Stay => continue,
                    Plan::Reuse(h) => h,
                    Plan::Offload => {
                        let h = self.take_host_page().expect("counted");
                        self.t().offloads.push((p, h));
                        if let Some(reg) = self.entry_at(p) {
                            if self.parent_live(reg) {
                                self.reg.get_mut(&reg).unwrap().host = Some(h);
                            }
                        }
                        h
                    }
                };
                self.reqs.get_mut(&r).unwrap().pages[k] = h | HOST;
                released.push(p);
            }
            for &p in released.iter().rev() {
                self.release(p);
            }
            self.reqs.get_mut(&r).unwrap().swapped = true;
        }
        Ok(())
    }

    /// The device page of the entry host page `h` is a copy of, if it still
    /// has one.
    fn device_copy(&self, h: usize) -> Option<usize> {
        self.entry_on_host(h).and_then(|reg| self.reg[&reg].dev)
    }

    pub fn swap_in(&mut self, hs: &[i64]) -> Result<(), Kind> {
        if self.tier.is_none() {
            return Err(Kind::Arg);
        }
        let rows = self.rows(hs)?;
        if rows.iter().any(|r| !self.reqs[r].swapped) {
            return Err(Kind::Arg);
        }
        // Loads, plus each evictable device copy re-taken (once, however
        // many of the requests hold its host copy).
        let mut need = 0;
        let mut copies = std::collections::BTreeSet::new();
        for r in &rows {
            for &p in &self.reqs[r].pages {
                if p & HOST != 0 {
                    match self.device_copy(p & !HOST) {
                        None => need += 1,
                        Some(d) => {
                            copies.insert(d);
                        }
                    }
                }
            }
        }
        need += copies
            .iter()
            .filter(|&&d| self.lru.contains(&d) && self.list(d) != super::priorities::PINNED)
            .count();
        if need > self.free.len() + self.evictable() {
            return Err(Kind::Exhausted);
        }
        // Device copies still there are re-taken first: no load, and no
        // page taken for a load evicts them.
        for &r in &rows {
            for k in (0..self.reqs[&r].pages.len()).rev() {
                let loc = self.reqs[&r].pages[k];
                if loc & HOST == 0 {
                    continue;
                }
                if let Some(d) = self.device_copy(loc & !HOST) {
                    self.lru.retain(|&x| x != d);
                    self.reqs.get_mut(&r).unwrap().pages[k] = d;
                    self.host_release(loc & !HOST);
                }
            }
        }
        for r in rows {
            for k in 0..self.reqs[&r].pages.len() {
                let loc = self.reqs[&r].pages[k];
                if loc & HOST == 0 {
                    continue;
                }
                let h = loc & !HOST;
                let q = self.take_page();
                if let Some(reg) = self.entry_on_host(h) {
                    if self.reg[&reg].dev.is_none() && self.parent_live(reg) {
                        self.reg.get_mut(&reg).unwrap().dev = Some(q);
                    }
                }
                self.t().loads.push((h, q));
                self.reqs.get_mut(&r).unwrap().pages[k] = q;
            }
            self.reqs.get_mut(&r).unwrap().swapped = false;
        }
        Ok(())
    }

    /// Closes swapped-out `r`: its pages let go one by one, last first.
    pub(crate) fn close_swapped(&mut self, r: usize) {
        while let Some(p) = self.reqs.get_mut(&r).unwrap().pages.pop() {
            if self.release(p) {
                self.drop_copy_into(p);
            }
        }
        self.reqs.get_mut(&r).unwrap().tokens.clear();
    }

    pub fn take_offloads(&mut self) -> (Vec<i64>, Vec<i64>) {
        let Some(t) = self.tier.as_mut() else {
            return (Vec::new(), Vec::new());
        };
        let q = std::mem::take(&mut t.offloads);
        t.offloaded += q.len() as u64;
        let d = q.iter().map(|&(dp, _)| dp as i64).collect();
        let h = q.iter().map(|&(_, hp)| hp as i64).collect();
        // A chain's tail goes older on the host than its parents: write_back
        // queued device victims tail first, write_through cache()'s pages head first.
        let mut order: Vec<usize> = (0..q.len()).collect();
        if self.writes_through() {
            order.reverse();
        }
        for (n, &i) in order.iter().enumerate() {
            self.t().offloads = order[n + 1..].iter().map(|&j| q[j]).collect();
            self.host_release(q[i].1);
        }
        self.t().offloads.clear();
        (d, h)
    }

    pub fn take_loads(&mut self) -> (Vec<i64>, Vec<i64>) {
        let Some(t) = self.tier.as_mut() else {
            return (Vec::new(), Vec::new());
        };
        let q = std::mem::take(&mut t.loads);
        t.loaded += q.len() as u64;
        let h = q.iter().map(|&(hp, _)| hp as i64).collect();
        let d = q.iter().map(|&(_, dp)| dp as i64).collect();
        // Last first: loads are queued in chain order, and a chain's tail goes older.
        for i in (0..q.len()).rev() {
            self.t().loads = q[..i].to_vec();
            self.host_release(q[i].0);
        }
        self.t().loads.clear();
        (h, d)
    }

    /// Host pages an offload can take now.
    pub fn host_free_pages(&self) -> usize {
        self.tier.as_ref().map_or(0, |t| t.free.len() + t.lru.len())
    }

    /// Host pages holding an entry's copy.
    pub fn host_registered(&self) -> usize {
        self.reg.values().filter(|e| e.host.is_some()).count()
    }
}
