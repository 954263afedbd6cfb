//! What priority each page has, and how it changes (the lists are
//! `levels.rs`):
//!
//! - a new registration has the default priority (no caller gave one);
//! - a caller's priority `q` (with an end, or none) applies when it is
//!   higher than the one in force, or when the page has the default; at
//!   the same priority the later end wins (no end is the latest). So a
//!   page several requests cached has the highest priority any of them
//!   gave. A lower priority given while a higher one is in force is not
//!   remembered: when the higher one ends, the page has the default;
//! - 100 with no end pins the page, while fewer than `max_pinned`
//!   registered pages are pinned; past that bound the pin is given as 99
//!   with no end instead, so pins can never take the whole pool;
//! - at its end a priority gives way to the default (`expire`), and a
//!   cached page whose list changes moves to the newest end of its new one;
//! - `unpin` gives a pinned page the default.
//!
//! Ends are kept in a heap, so expiry costs O(log n) per priority that
//! ends, paid when the clock is read (before victims are sought, and when
//! a manual clock is set), never a pass over the pool. Pages whose ends
//! fall together rejoin the default list in the reverse of the order they
//! were given their durations: a call gives a prefix's pages theirs from
//! the first page on, so its tail rejoins older than its parents and is
//! still evicted first. A page whose end
//! changes leaves a stale heap entry behind (skipped when it comes up);
//! stale entries are dropped once they could make up half the heap, so
//! the heap stays within twice the pages with a pending end.

use std::cmp::Reverse;

use super::levels::{list_for, Levels, DEFAULT_PRIORITY, MAX_PRIORITY, MIN_COMPACT, PINNED};
use super::lru::Linked;
use crate::error::{PoolError, Result};

/// `given` of a pin (with `until` 0).
const PIN: u8 = MAX_PRIORITY + 1;

impl Levels {
    /// `p` was just registered: it has the default priority.
    #[inline]
    pub(crate) fn registered(&mut self, p: u32) {
        self.given[p as usize] = 0;
        self.until[p as usize] = 0;
    }

    /// `q`'s priority, and its end if it has one, is now `p`'s (`p` took
    /// over `q`'s registration); the pinned count stays. The end is filed
    /// anew for `p` as if given now (room was reserved); `q`'s heap entry
    /// is stale from here on.
    pub(crate) fn moved(&mut self, q: u32, p: u32) {
        let (g, u) = (self.given[q as usize], self.until[q as usize]);
        self.registered(q);
        self.given[p as usize] = g;
        self.until[p as usize] = u;
        if u != 0 {
            self.given_ends += 1;
            self.heap
                .push(Reverse((u - 1, u64::MAX - self.given_ends, p)));
        }
    }

    /// `p`, registered and held (so on no list), loses its registration.
    pub(crate) fn unregistered_held(&mut self, p: u32) {
        if self.list_of(p) == PINNED {
            self.pinned -= 1;
        }
        self.registered(p);
    }

    /// Registered pages that are pinned, held or cached.
    pub(crate) fn pinned(&self) -> usize {
        self.pinned
    }

    /// Whether a priority's end is pending.
    #[inline]
    pub(crate) fn has_ends(&self) -> bool {
        !self.heap.is_empty()
    }

    /// Makes room for `n` more ends, first dropping stale heap entries if
    /// they could be half of it.
    pub(crate) fn reserve_ends(&mut self, n: usize) -> Result<()> {
        if self.heap.len() + n >= self.compact_at {
            let until = &self.until;
            self.heap
                .retain(|&Reverse((end, _, p))| until[p as usize] == end + 1);
            self.compact_at = (2 * (self.heap.len() + n)).max(MIN_COMPACT);
        }
        self.heap.try_reserve(n).map_err(|_| {
            PoolError::InvalidArgument(format!(
                "cannot allocate the ends of {n} page priorities; use shorter requests or no \
                 retain_s"
            ))
        })
    }

    /// A caller gives registered page `p` priority `q` (<= 100) until
    /// `end` (clock nanoseconds; None: no end), under the rules in the
    /// module docs. An end needs room reserved (`reserve_ends`).
    pub(crate) fn raise<R: Linked>(&mut self, recs: &mut [R], p: u32, q: u8, end: Option<u64>) {
        let i = p as usize;
        let (g, u) = (self.given[i], self.until[i]);
        let old = list_for(g, u);
        let mut q1 = q + 1;
        if q1 == PIN && end.is_none() && old != PINNED && self.pinned >= self.max_pinned {
            q1 = PIN - 1;
        }
        let nu = end.map_or(0, |t| t + 1);
        let (ng, nu) = if g == 0 || q1 > g {
            (q1, nu)
        } else if q1 == g {
            (g, if u == 0 || nu == 0 { 0 } else { u.max(nu) })
        } else {
            return;
        };
        if (ng, nu) == (g, u) {
            return;
        }
        let new = list_for(ng, nu);
        let moves = new != old && self.is_listed(recs, old, p);
        if moves {
            self.unlink(recs, old, p);
        }
        self.given[i] = ng;
        self.until[i] = nu;
        if moves {
            self.push(recs, new, p);
        }
        match (old == PINNED, new == PINNED) {
            (false, true) => self.pinned += 1,
            (true, false) => self.pinned -= 1,
            _ => {}
        }
        if nu != 0 && nu != u {
            self.given_ends += 1;
            self.heap
                .push(Reverse((nu - 1, u64::MAX - self.given_ends, p)));
        }
    }

    /// Gives pinned page `p` the default priority; returns whether it was
    /// pinned.
    pub(crate) fn unpin<R: Linked>(&mut self, recs: &mut [R], p: u32) -> bool {
        if self.list_of(p) != PINNED {
            return false;
        }
        let listed = self.is_listed(recs, PINNED, p);
        if listed {
            self.unlink(recs, PINNED, p);
        }
        self.registered(p);
        self.pinned -= 1;
        if listed {
            self.push(recs, DEFAULT_PRIORITY as usize, p);
        }
        true
    }

    /// Ends every priority whose end is at or before `now`, soonest first
    /// (ties: the latest given first): the page gets the default priority.
    pub(crate) fn expire<R: Linked>(&mut self, recs: &mut [R], now: u64) {
        while let Some(&Reverse((end, _, p))) = self.heap.peek() {
            if end > now {
                break;
            }
            self.heap.pop();
            let i = p as usize;
            if self.until[i] != end + 1 {
                continue; // stale: the page's end changed since
            }
            let old = self.list_of(p);
            let moves = old != DEFAULT_PRIORITY as usize && self.is_listed(recs, old, p);
            if moves {
                self.unlink(recs, old, p);
            }
            self.registered(p);
            if moves {
                self.push(recs, DEFAULT_PRIORITY as usize, p);
            }
        }
    }

    /// The priority bookkeeping beside the lists: `registered(p)` says
    /// which pages hold a registration (the others' priorities mean
    /// nothing). The pinned count is the registered pinned pages and within
    /// the bound; every pending end is in the heap; and with a manual clock
    /// at `now`, no end is past (setting the clock ends them).
    pub(crate) fn check_retention(
        &self,
        registered: impl Fn(u32) -> bool,
        now: Option<u64>,
    ) -> std::result::Result<(), String> {
        let mut ends: Vec<(u64, u32)> = self.heap.iter().map(|r| (r.0 .0, r.0 .2)).collect();
        ends.sort_unstable();
        let mut pinned = 0usize;
        for p in 1..self.given.len() as u32 {
            if !registered(p) {
                continue;
            }
            let (g, u) = (self.given[p as usize], self.until[p as usize]);
            if g > PIN || (g == 0 && u != 0) {
                return Err(format!(
                    "page {p} has priority state ({g}, {u}), which no call sets"
                ));
            }
            pinned += (list_for(g, u) == PINNED) as usize;
            if u != 0 {
                if ends.binary_search(&(u - 1, p)).is_err() {
                    return Err(format!(
                        "page {p}'s priority ends at {} but no heap entry says so",
                        u - 1
                    ));
                }
                if now.is_some_and(|t| u - 1 <= t) {
                    return Err(format!(
                        "page {p}'s priority ended at {} but the clock is at {}",
                        u - 1,
                        now.unwrap_or(0)
                    ));
                }
            }
        }
        if pinned != self.pinned || pinned > self.max_pinned {
            return Err(format!(
                "{pinned} registered pages are pinned, the pool counts {} (at most {})",
                self.pinned, self.max_pinned
            ));
        }
        Ok(())
    }
}
