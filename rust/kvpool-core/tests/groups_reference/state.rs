//! The model of a state group.

use std::collections::BTreeMap;

pub struct GState {
    pub every: usize,
    pub free: Vec<usize>,
    /// CACHED checkpoints, oldest first.
    pub lru: Vec<usize>,
    /// checkpoint slot -> the anchor id it is filed under.
    pub reg: BTreeMap<usize, u64>,
    pub live: BTreeMap<usize, usize>,
    /// Queued copies (source, -1 for zeros; destination), oldest first.
    pub queue: Vec<(i64, usize)>,
    pub pins: Vec<usize>,
}

impl GState {
    pub fn new(slots: usize, every: usize) -> Self {
        GState {
            every,
            free: (1..slots).rev().collect(),
            lru: Vec::new(),
            reg: BTreeMap::new(),
            live: BTreeMap::new(),
            queue: Vec::new(),
            pins: Vec::new(),
        }
    }

    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    pub fn checkpoint(&self, reg: u64) -> Option<usize> {
        self.reg.iter().find(|(_, &r)| r == reg).map(|(&s, _)| s)
    }

    pub fn reading(&self, s: usize) -> usize {
        self.queue.iter().filter(|c| c.0 == s as i64).count()
    }

    fn holders(&self, s: usize) -> usize {
        self.live.values().filter(|&&x| x == s).count()
            + self.reading(s)
            + self.pins.iter().filter(|&&x| x == s).count()
    }

    fn release(&mut self, s: usize) {
        if self.holders(s) > 0 {
            return;
        }
        if self.reg.contains_key(&s) {
            self.lru.push(s);
        } else {
            self.free.push(s);
        }
    }

    fn drop_into(&mut self, dst: usize) {
        if let Some(i) = self.queue.iter().position(|c| c.1 == dst) {
            let (src, _) = self.queue.remove(i);
            if src > 0 {
                self.release(src as usize);
            }
        }
    }

    fn take_slot(&mut self) -> usize {
        if let Some(s) = self.free.pop() {
            return s;
        }
        let s = self.lru.remove(0);
        self.reg.remove(&s);
        self.drop_into(s);
        s
    }

    fn queue(&mut self, src: i64, dst: usize) {
        let src = match self.queue.iter().find(|c| c.1 as i64 == src) {
            Some(c) if src > 0 => c.0,
            _ => src,
        };
        if src > 0 {
            self.lru.retain(|&x| x != src as usize);
        }
        self.queue.push((src, dst));
    }

    pub fn open_row(&mut self, row: usize) {
        let s = self.take_slot();
        self.live.insert(row, s);
        self.queue(-1, s);
    }

    pub fn close_row(&mut self, row: usize) {
        let s = self.live.remove(&row).unwrap();
        if self.holders(s) == 0 {
            self.release(s);
            self.drop_into(s);
        }
    }

    pub fn fork_row(&mut self, parent: usize, child: usize) {
        let s = self.take_slot();
        self.live.insert(child, s);
        let src = self.live[&parent] as i64;
        self.queue(src, s);
    }

    pub fn pin(&mut self, s: usize) {
        self.lru.retain(|&x| x != s);
        self.pins.push(s);
    }

    pub fn unpin(&mut self, s: usize) {
        let i = self.pins.iter().position(|&x| x == s).unwrap();
        self.pins.remove(i);
        self.release(s);
    }

    pub fn restore(&mut self, row: usize, from: i64) {
        let s = self.live[&row];
        if self.reading(s) > 0 {
            let fresh = self.take_slot();
            self.queue(from, fresh);
            self.live.insert(row, fresh);
            self.release(s);
        } else {
            self.drop_into(s);
            self.queue(from, s);
        }
    }

    pub fn start_hit(&mut self, row: usize, from: i64) {
        let s = self.take_slot();
        self.live.insert(row, s);
        self.queue(from, s);
    }

    pub fn take_checkpoint(&mut self, row: usize, reg: u64) {
        if self.checkpoint(reg).is_some() || self.available() == 0 {
            return;
        }
        let c = self.take_slot();
        self.reg.insert(c, reg);
        let src = self.live[&row] as i64;
        self.queue(src, c);
        self.release(c);
    }

    pub fn evict(&mut self, n: usize) -> usize {
        // An eviction can let a checkpoint go that a dropped copy read:
        // the list is re-read each time.
        let mut k = 0;
        while k < n && !self.lru.is_empty() {
            k += 1;
            let s = self.lru.remove(0);
            self.reg.remove(&s);
            self.free.push(s);
            self.drop_into(s);
        }
        k
    }

    pub fn clear(&mut self) {
        self.evict(usize::MAX);
        self.reg.clear();
    }

    pub fn take_copies(&mut self) -> (Vec<i64>, Vec<i64>) {
        let (mut src, mut dst) = (Vec::new(), Vec::new());
        while !self.queue.is_empty() {
            let (s, d) = self.queue.remove(0);
            src.push(s);
            dst.push(d as i64);
            if s > 0 {
                self.release(s as usize);
            }
        }
        (src, dst)
    }
}
