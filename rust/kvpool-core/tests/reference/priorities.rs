//! The reference model's retention priorities, the obvious way: a map from
//! registered device page to the priority a caller gave it (absent: the default),
//! the CACHED pages still one Vec in the order they were last filed (so
//! "least recently used within a priority" is their order in it), the
//! victim found by scanning for the lowest priority, pins counted by
//! scanning, and durations ended by sorting the due ones.

use super::{Kind, Model};
use kvpool_core::{DEFAULT_PRIORITY, MAX_PRIORITY};

/// A priority a caller gave a page: `q`, until `until` (clock ns; None: no
/// end), given as the `seq`-th duration (orders ends that fall together).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prio {
    pub q: u8,
    pub until: Option<u64>,
    pub seq: u64,
}

/// The list a priority files a page on: 0..=100, 101 for a pin.
pub(crate) const PINNED: usize = 101;

impl Model {
    pub fn list(&self, p: usize) -> usize {
        match self.prio.get(&p) {
            None => DEFAULT_PRIORITY as usize,
            Some(x) if x.q == MAX_PRIORITY && x.until.is_none() => PINNED,
            Some(x) => x.q as usize,
        }
    }

    pub fn pinned(&self) -> usize {
        self.prio
            .keys()
            .filter(|&&p| self.list(p) == PINNED)
            .count()
    }

    /// CACHED pages that are not pinned.
    pub fn evictable(&self) -> usize {
        self.lru.iter().filter(|&&p| self.list(p) != PINNED).count()
    }

    pub fn by_priority(&self) -> [usize; 101] {
        let mut out = [0; 101];
        for &p in &self.lru {
            if self.list(p) != PINNED {
                out[self.list(p)] += 1;
            }
        }
        out
    }

    /// Index in `lru` of the next victim: the first page of the lowest
    /// priority.
    pub(crate) fn victim(&self) -> Option<usize> {
        let low = self
            .lru
            .iter()
            .map(|&p| self.list(p))
            .filter(|&l| l != PINNED)
            .min()?;
        self.lru.iter().position(|&p| self.list(p) == low)
    }

    /// Takes the next victim off the cache; it keeps no priority. With a
    /// host tier its entry may live on in a host copy (`tier.rs`).
    pub(crate) fn pop_victim(&mut self) -> usize {
        let i = self.victim().expect("a victim");
        let p = self.lru.remove(i);
        self.prio.remove(&p);
        self.drop_device_copy(p, true);
        p
    }

    /// Files `p` anew if its list changed while it was CACHED.
    fn refile(&mut self, p: usize, old: usize) {
        if old != self.list(p) {
            if let Some(i) = self.lru.iter().position(|&q| q == p) {
                self.lru.remove(i);
                self.lru.push(p);
            }
        }
    }

    /// The rules of `cache_with_priority` for one page.
    fn raise(&mut self, p: usize, mut q: u8, until: Option<u64>) {
        let old = self.list(p);
        if q == MAX_PRIORITY && until.is_none() && old != PINNED && self.pinned() >= self.max_pinned
        {
            q = MAX_PRIORITY - 1;
        }
        let new = match self.prio.get(&p).copied() {
            None => Prio { q, until, seq: 0 },
            Some(x) if q > x.q => Prio { q, until, seq: 0 },
            Some(x) if q == x.q => Prio {
                q,
                until: x.until.zip(until).map(|(a, b)| a.max(b)),
                seq: x.seq,
            },
            Some(_) => return,
        };
        let cur = self.prio.get(&p).copied();
        if cur.map(|x| (x.q, x.until)) == Some((new.q, new.until)) {
            return;
        }
        let seq = match new.until {
            Some(_) if cur.and_then(|x| x.until) != new.until => {
                self.ends_given += 1;
                self.ends_given
            }
            _ => cur.map_or(0, |x| x.seq),
        };
        self.prio.insert(p, Prio { seq, ..new });
        self.refile(p, old);
    }

    /// Each page of row `r`'s cached prefix: its own page where registered,
    /// else the registered copy of the same content under the same parent.
    fn cached_prefix(&self, r: usize) -> Vec<usize> {
        let req = &self.reqs[&r];
        let known = req.known();
        let (mut out, mut prev) = (Vec::new(), 0u64);
        for k in 0..req.hashed {
            let p = req.pages[k];
            // A copy only on the host is gone from the device, where
            // priorities apply.
            let (page, reg) = match self.entry_at(p) {
                Some(g) => (p, g),
                None => match self.find(&(req.salt, known[..(k + 1) * self.ps].to_vec())) {
                    Some(e) if e.parent_reg == prev && e.dev.is_some() => (e.dev.unwrap(), e.reg),
                    _ => break,
                },
            };
            out.push(page);
            prev = reg;
        }
        out
    }

    /// `rows`, then a swapped-out request refused: priorities are the
    /// device's.
    fn resident_rows(&self, hs: &[i64]) -> Result<Vec<usize>, Kind> {
        let rows = self.rows(hs)?;
        if rows.iter().any(|r| self.reqs[r].swapped) {
            return Err(Kind::Swapped);
        }
        Ok(rows)
    }

    fn check_priorities(&self, n: usize, qs: &[i64], retain: Option<u64>) -> Result<(), Kind> {
        let bad_q = qs.len() != 1 && qs.len() != n
            || qs.iter().any(|&q| !(0..=MAX_PRIORITY as i64).contains(&q));
        if bad_q || retain == Some(0) {
            return Err(Kind::Arg);
        }
        Ok(())
    }

    fn give(&mut self, rows: &[usize], qs: &[i64], retain: Option<u64>) {
        let until = retain.map(|d| self.now + d);
        let mut targets = Vec::new();
        for (i, &r) in rows.iter().enumerate() {
            let q = qs[if qs.len() == 1 { 0 } else { i }] as u8;
            targets.extend(self.cached_prefix(r).into_iter().map(|p| (p, q)));
        }
        for (p, q) in targets {
            self.raise(p, q, until);
        }
    }

    /// `qs`: one priority for all or one per handle; `retain`: ns.
    pub fn cache_with_priority(
        &mut self,
        hs: &[i64],
        qs: &[i64],
        retain: Option<u64>,
    ) -> Result<(), Kind> {
        let rows = self.resident_rows(hs)?;
        self.check_priorities(hs.len(), qs, retain)?;
        self.register_rows(&rows);
        self.give(&rows, qs, retain);
        Ok(())
    }

    pub fn close_with_priority(
        &mut self,
        hs: &[i64],
        qs: &[i64],
        retain: Option<u64>,
    ) -> Result<(), Kind> {
        self.cache_with_priority(hs, qs, retain)?;
        self.close(hs, false)
    }

    pub fn unpin(&mut self, hs: &[i64]) -> Result<usize, Kind> {
        let rows = self.resident_rows(hs)?;
        let targets: Vec<usize> = rows.iter().flat_map(|&r| self.cached_prefix(r)).collect();
        let mut n = 0;
        for p in targets {
            if self.list(p) == PINNED {
                self.prio.remove(&p);
                self.refile(p, PINNED);
                n += 1;
            }
        }
        Ok(n)
    }

    /// Moves the clock to `now` ns: the due durations end, soonest first,
    /// the latest given first among those ending together.
    pub fn set_clock(&mut self, now: u64) {
        self.now = now;
        let mut due: Vec<(u64, u64, usize)> = self
            .prio
            .iter()
            .filter_map(|(&p, x)| {
                x.until
                    .filter(|&u| u <= now)
                    .map(|u| (u, u64::MAX - x.seq, p))
            })
            .collect();
        due.sort();
        for (_, _, p) in due {
            let old = self.list(p);
            self.prio.remove(&p);
            self.refile(p, old);
        }
    }
}
