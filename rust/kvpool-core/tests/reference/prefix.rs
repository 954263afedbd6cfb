//! The reference model's prefix index: registering a request's full pages
//! under their exact content, evicting cached pages and clearing the index.

use super::{Entry, Kind, Model};

impl Model {
    pub fn cache(&mut self, hs: &[i64]) -> Result<(), Kind> {
        let rows = self.rows(hs)?;
        if rows.iter().any(|r| self.reqs[r].swapped) {
            return Err(Kind::Swapped);
        }
        self.register_rows(&rows);
        Ok(())
    }

    /// `cache()` of `rows`: every dead chain restarts first (as the core
    /// does before it registers anything), then each row registers.
    pub fn register_rows(&mut self, rows: &[usize]) {
        for &r in rows {
            self.restart_dead_chain(r);
        }
        for &r in rows {
            self.register(r);
        }
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
        let mut through = req.through.clone();
        while k < known / self.ps {
            if chain_reg != 0 && !self.reg.contains_key(&chain_reg) {
                // The chain's tip registration is gone: the chain stops.
                broken = true;
                break;
            }
            let p = req.pages[k];
            let key = (req.salt, req.known()[..(k + 1) * self.ps].to_vec());
            let mut found = self.find(&key);
            if let Some(e) = &found {
                if e.dev != Some(p) && !self.is_registered(p) && !self.parent_live(e.reg) {
                    // An orphan of this content gives way to this page.
                    self.drop_orphan(e.reg);
                    found = None;
                }
            }
            let reg = match found {
                None if !self.is_registered(p) => {
                    // A ghost of this content under this parent comes back
                    // with its id (its children chain on it again).
                    let ghost = self
                        .ghosts
                        .iter()
                        .find(|(_, g)| g.0 == key && g.1 == chain_reg)
                        .map(|(&g, _)| g);
                    let reg = match ghost {
                        Some(g) => {
                            self.ghosts.remove(&g);
                            self.revived += 1;
                            g
                        }
                        None => {
                            self.next_reg += 1;
                            self.next_reg - 1
                        }
                    };
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
                    // Its old parent may be a ghost it was the last child of.
                    self.prune_ghosts();
                    Some(e.reg)
                }
                Some(e) if e.parent_reg == chain_reg => {
                    // A duplicate; one whose only copy is on the host, or
                    // on a device page nobody holds, takes this page as its
                    // device copy (the unheld page goes FREE, its priority
                    // moving along).
                    if !self.is_registered(p) {
                        match e.dev {
                            None => self.reg.get_mut(&e.reg).unwrap().dev = Some(p),
                            Some(q) if self.holders(q) == 0 => self.take_over(e.reg, q, p),
                            Some(_) => {}
                        }
                    }
                    Some(e.reg)
                }
                _ => None,
            };
            match reg {
                Some(reg) => {
                    chain_reg = reg;
                    regs.push(reg);
                    through.push(reg);
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
        req.through = through;
        if k > from && self.writes_through() {
            self.write_through(r, from, k);
        }
    }

    /// Whether every registration `r`'s chain stands for is live, and none
    /// of them is a duplicate's entry whose only copy is on the host (the
    /// core then restarts the chain, so its registration makes the row's
    /// page that entry's device copy).
    pub fn chain_stands(&self, r: usize) -> bool {
        let req = &self.reqs[&r];
        req.through
            .iter()
            .zip(&req.pages)
            .all(|(g, &p)| match self.reg.get(g) {
                None => false,
                Some(e) => e.dev.is_some() || self.entry_at(p).is_some(),
            })
    }

    /// A chain whose tip registration is gone (its tip was another
    /// request's entry, which was evicted) resumes after the longest run of
    /// the request's own registered pages from page 0 that still chains;
    /// returns whether it restarted.
    pub fn restart_dead_chain(&mut self, r: usize) -> bool {
        let req = &self.reqs[&r];
        // Any registration the chain stands for gone (the tip, or a page
        // duplicating another request's entry inside it).
        if req.broken || self.chain_stands(r) {
            return false;
        }
        let (mut chain, mut walked) = (0, Vec::new());
        for &p in &req.pages[..req.hashed] {
            match self.reg.values().find(|e| e.dev == Some(p)) {
                Some(e) if e.parent_reg == chain && e.key.0 == req.salt => chain = e.reg,
                _ => break,
            }
            walked.push(chain);
        }
        let k = walked.len();
        let req = self.reqs.get_mut(&r).unwrap();
        req.hashed = k;
        req.chain_reg = chain;
        // The groups' pages stay filed under the ids they were registered
        // with (`regs`); the chain stands on the ids the walk reached, or
        // the next cache() would find an old one gone and restart again
        // where the core's chain, walked and live, goes on.
        req.regs.truncate(k);
        req.through = walked;
        true
    }

    /// Orphan `reg` leaves the index with its copies: an unheld device copy
    /// goes FREE (a held one stays with its holders, unregistered), its
    /// priority ends, and its host copy goes FREE once nobody holds it.
    fn drop_orphan(&mut self, reg: u64) {
        let e = self.reg[&reg].clone();
        self.forget(reg);
        if let Some(q) = e.dev {
            self.prio.remove(&q);
            if self.holders(q) == 0 {
                self.lru.retain(|&x| x != q);
                self.free.push(q);
            }
        }
        if let Some(h) = e.host {
            if self.host_holders(h) == 0 {
                let t = self.tier.as_mut().unwrap();
                t.lru.retain(|&x| x != h);
                t.free.push(h);
            }
        }
        self.orphans_replaced += 1;
    }

    /// Entry `reg`'s device copy moves from CACHED page `q` to page `p`;
    /// `q` goes FREE. A priority's end counts as given now.
    fn take_over(&mut self, reg: u64, q: usize, p: usize) {
        self.lru.retain(|&x| x != q);
        if let Some(mut x) = self.prio.remove(&q) {
            if x.until.is_some() {
                self.ends_given += 1;
                x.seq = self.ends_given;
            }
            self.prio.insert(p, x);
        }
        self.reg.get_mut(&reg).unwrap().dev = Some(p);
        self.free.push(q);
        self.taken_over += 1;
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
        self.ghosts.clear();
        self.prio.clear();
        for r in self.reqs.values_mut() {
            r.hashed = 0;
            r.chain_reg = 0;
            r.broken = false;
            r.regs.clear();
            r.through.clear();
        }
    }
}
