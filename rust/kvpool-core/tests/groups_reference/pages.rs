//! The model of a page group that is not the anchor.

use std::collections::BTreeMap;

use crate::reference::QueuedCopy;

pub struct GPages {
    pub ps: usize,
    pub window: Option<usize>,
    pub free: Vec<usize>,
    /// CACHED pages, oldest first.
    pub lru: Vec<usize>,
    /// page -> the anchor id it is filed under.
    pub reg: BTreeMap<usize, u64>,
    /// row -> its page list (0 where the window released the page).
    pub lists: BTreeMap<usize, Vec<usize>>,
    pub first: BTreeMap<usize, usize>,
    pub progress: BTreeMap<usize, usize>,
    pub queue: Vec<QueuedCopy>,
    /// The first `holding` queued copies hold their source.
    pub holding: usize,
    /// Keys a recomputed page took over from a copy nobody held.
    pub taken_over: usize,
}

impl GPages {
    pub fn new(pages: usize, ps: usize, window: Option<usize>) -> Self {
        GPages {
            ps,
            window,
            free: (1..pages).rev().collect(),
            lru: Vec::new(),
            reg: BTreeMap::new(),
            lists: BTreeMap::new(),
            first: BTreeMap::new(),
            progress: BTreeMap::new(),
            queue: Vec::new(),
            holding: 0,
            taken_over: 0,
        }
    }

    pub fn window_start(&self, len: usize) -> usize {
        self.window.map_or(0, |w| len.saturating_sub(w - 1))
    }

    pub fn find(&self, reg: u64) -> Option<usize> {
        self.reg.iter().find(|(_, &r)| r == reg).map(|(&p, _)| p)
    }

    pub fn holders(&self, p: usize) -> usize {
        let lists: usize = self
            .lists
            .values()
            .map(|l| l.iter().filter(|&&q| q == p).count())
            .sum();
        lists
            + self.queue[..self.holding]
                .iter()
                .filter(|c| c.src == p)
                .count()
    }

    pub fn pending_copies(&self) -> usize {
        self.queue.iter().map(|c| c.len).sum()
    }

    fn take_page(&mut self) -> usize {
        if let Some(p) = self.free.pop() {
            return p;
        }
        let p = self.lru.remove(0);
        self.reg.remove(&p);
        p
    }

    /// `p` lost a holder: if none is left it is CACHED or FREE.
    fn release(&mut self, p: usize) -> bool {
        if self.holders(p) > 0 {
            return false;
        }
        if self.reg.contains_key(&p) {
            self.lru.push(p);
        } else {
            self.free.push(p);
        }
        true
    }

    fn drop_copy_into(&mut self, mut p: usize) {
        while let Some(i) = self.queue.iter().position(|c| c.dst == p) {
            let c = self.queue.remove(i);
            self.holding -= 1;
            if !self.release(c.src) {
                return;
            }
            p = c.src;
        }
    }

    /// Lets go of `dropped` (already out of their lists), last first, then
    /// drops the copies into the pages nobody holds.
    fn release_all(&mut self, dropped: &[usize]) {
        let mut unheld = Vec::new();
        for &p in dropped.iter().rev() {
            if self.release(p) {
                unheld.push(p);
            }
        }
        for p in unheld {
            self.drop_copy_into(p);
        }
    }

    pub fn open_row(&mut self, row: usize) {
        self.lists.insert(row, Vec::new());
        self.first.insert(row, 0);
        self.progress.insert(row, 0);
    }

    /// Whether a batch `(row, len, count)` fits: new pages and copies
    /// against free + cached + what its windows release to nobody.
    pub fn has_room(&self, batch: &[(usize, usize, usize)]) -> bool {
        let mut released: Vec<usize> = Vec::new();
        let mut need = 0;
        for &(row, len, c) in batch {
            if c == 0 {
                continue;
            }
            need += (len + c).div_ceil(self.ps) - len.div_ceil(self.ps);
            if self.window.is_some() && len > 0 {
                let to = self.window_start(len) / self.ps;
                let first = self.first[&row];
                released.extend(self.lists[&row][first.min(to)..to].iter().copied());
            }
        }
        let count = |p: usize| released.iter().filter(|&&q| q == p).count();
        let mut distinct = released.clone();
        distinct.sort();
        distinct.dedup();
        let credited = distinct
            .iter()
            .filter(|&&p| self.holders(p) == count(p))
            .count();
        // A shared partly filled last page that `m` growing rows hold, of
        // `h` holders after the windows' releases, is copied by all but the
        // last holder to grow: min(m, h - 1) times.
        let mut growing: Vec<usize> = Vec::new();
        for &(row, len, c) in batch {
            if c > 0 && len % self.ps != 0 {
                growing.push(*self.lists[&row].last().unwrap());
            }
        }
        let mut pages = growing.clone();
        pages.sort();
        pages.dedup();
        for p in pages {
            let m = growing.iter().filter(|&&q| q == p).count();
            let h = self.holders(p) - count(p);
            if h > 1 {
                need += m.min(h - 1);
            }
        }
        need <= self.free.len() + self.lru.len() + credited
    }

    /// A checked batch: windows release first (all rows), then each row
    /// grows; returns the new slots in order.
    pub fn grow_batch(&mut self, batch: &[(usize, usize, usize)]) -> Vec<i64> {
        if self.window.is_some() {
            for &(row, len, c) in batch {
                if c == 0 {
                    continue;
                }
                let to = self.window_start(len) / self.ps;
                let first = self.first[&row];
                if to > first {
                    let dropped: Vec<usize> = self.lists[&row][first..to].to_vec();
                    for k in first..to {
                        self.lists.get_mut(&row).unwrap()[k] = 0;
                    }
                    self.first.insert(row, to);
                    self.release_all(&dropped);
                }
            }
        }
        let mut out = Vec::new();
        for &(row, len, c) in batch {
            if c > 0 && len % self.ps != 0 {
                let last = *self.lists[&row].last().unwrap();
                if self.holders(last) > 1 {
                    let q = self.take_page();
                    self.queue.push(QueuedCopy {
                        src: last,
                        dst: q,
                        len: len % self.ps,
                    });
                    *self.lists.get_mut(&row).unwrap().last_mut().unwrap() = q;
                } else {
                    self.reg.remove(&last);
                }
            }
            for t in len..len + c {
                let p = if t % self.ps == 0 {
                    let p = self.take_page();
                    self.lists.get_mut(&row).unwrap().push(p);
                    p
                } else {
                    *self.lists[&row].last().unwrap()
                };
                out.push((p * self.ps + t % self.ps) as i64);
            }
        }
        self.holding = self.queue.len();
        out
    }

    pub fn rollback_ok(&self, row: usize, l: usize) -> bool {
        l == 0 || self.first[&row] <= self.window_start(l) / self.ps
    }

    /// The pages a truncate to `l` takes back from the cache for the
    /// window it released: each page from the window's start up to the
    /// first held one (or the new last page), filed under the chain `regs`.
    pub fn cached_window(
        &self,
        row: usize,
        l: usize,
        regs: &[u64],
        a: usize,
    ) -> Option<(usize, Vec<usize>)> {
        let first = self.window_start(l) / self.ps;
        let end = self.first[&row].min(l.div_ceil(self.ps));
        let mut pages = Vec::new();
        for k in first..end {
            let at = (k + 1) * self.ps;
            if at > regs.len() * a {
                return None;
            }
            pages.push(self.find(regs[at / a - 1])?);
        }
        Some((first, pages))
    }

    pub fn take_back(&mut self, row: usize, first: usize, pages: &[usize]) {
        let list = self.lists.get_mut(&row).unwrap();
        list[first..first + pages.len()].copy_from_slice(pages);
        for &p in pages {
            self.lru.retain(|&q| q != p);
        }
        self.first.insert(row, first);
    }

    pub fn clamp_progress(&mut self, row: usize, pages: usize) {
        let p = self.progress.get_mut(&row).unwrap();
        *p = (*p).min(pages);
    }

    pub fn shrink(&mut self, row: usize, len: usize, l: usize) {
        let keep = l.div_ceil(self.ps);
        let np = len.div_ceil(self.ps);
        let first = self.first[&row];
        let from = keep.max(first);
        let dropped: Vec<usize> = self.lists[&row][from..np].to_vec();
        self.lists.get_mut(&row).unwrap().truncate(keep);
        self.release_all(&dropped);
        self.first.insert(row, first.min(keep));
        self.clamp_progress(row, l / self.ps);
        if l == 0 && len == 0 {
            // (a close of an empty request: nothing held)
        }
    }

    pub fn fork_row(&mut self, parent: usize, child: usize, _len: usize) {
        let list = self.lists[&parent].clone();
        self.lists.insert(child, list.clone());
        for &p in &list {
            if p != 0 {
                self.lru.retain(|&q| q != p);
            }
        }
        self.first.insert(child, self.first[&parent]);
        self.progress.insert(child, self.progress[&parent]);
    }

    pub fn start_hit(&mut self, row: usize, l: usize, regs: &[u64], a: usize) {
        let first = self.window_start(l) / self.ps;
        let mut list = vec![0; first];
        for k in first..l / self.ps {
            let p = self.find(regs[(k + 1) * self.ps / a - 1]).unwrap();
            list.push(p);
            self.lru.retain(|&q| q != p);
        }
        self.lists.insert(row, list);
        self.first.insert(row, first);
        self.progress.insert(row, l / self.ps);
    }

    pub fn register(&mut self, row: usize, len: usize, regs: &[u64], a: usize) {
        let upto = len.min(regs.len() * a) / self.ps;
        for k in self.progress[&row]..upto {
            let p = self.lists[&row][k];
            if p == 0 {
                continue;
            }
            let reg = regs[(k + 1) * self.ps / a - 1];
            match self.find(reg) {
                None => {
                    self.reg.insert(p, reg);
                }
                // A copy nobody holds gives its key to this one, filed
                // nowhere, and goes FREE.
                Some(q) if q != p && self.lru.contains(&q) && !self.reg.contains_key(&p) => {
                    self.lru.retain(|&x| x != q);
                    self.reg.remove(&q);
                    self.free.push(q);
                    self.reg.insert(p, reg);
                    self.taken_over += 1;
                }
                Some(_) => {}
            }
        }
        let pr = self.progress.get_mut(&row).unwrap();
        *pr = (*pr).max(upto);
    }

    pub fn evict(&mut self, n: usize) -> usize {
        let k = n.min(self.lru.len());
        for _ in 0..k {
            let p = self.lru.remove(0);
            self.reg.remove(&p);
            self.free.push(p);
        }
        k
    }

    pub fn clear(&mut self) {
        for p in std::mem::take(&mut self.lru) {
            self.reg.remove(&p);
            self.free.push(p);
        }
        self.reg.clear();
        for p in self.progress.values_mut() {
            *p = 0;
        }
    }

    pub fn take_copies(&mut self) -> (Vec<i64>, Vec<i64>) {
        let (mut src, mut dst) = (Vec::new(), Vec::new());
        while !self.queue.is_empty() {
            let c = self.queue.remove(0);
            self.holding -= 1;
            for j in 0..c.len {
                src.push((c.src * self.ps + j) as i64);
                dst.push((c.dst * self.ps + j) as i64);
            }
            if self.release(c.src) {
                self.drop_copy_into(c.src);
            }
        }
        (src, dst)
    }

    pub fn slots(&self, row: usize, len: usize) -> Vec<i64> {
        let l = &self.lists[&row];
        (0..len)
            .map(|t| (l[t / self.ps] * self.ps + t % self.ps) as i64)
            .collect()
    }
}
