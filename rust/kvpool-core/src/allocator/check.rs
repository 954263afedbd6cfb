//! `check()`: walks the whole pool and verifies every invariant. O(pool size)
//! by nature; meant for tests and debugging, cheap enough to run after every op.
//!
//! Each owner checks its own state (`pages/check.rs`, `requests/check.rs`,
//! `prefix/check.rs`); this file adds what ties them together:
//!
//! - each page's refcount counts the open requests whose lists name it;
//! - the page records' registrations and the index agree both ways;
//! - a request on the fast path needs none of the slow path's work (a
//!   pending prompt, a shared or registered last page);
//! - a request marked as never sharing shares nothing;
//! - with retention priorities, each cached page is on its priority's
//!   list, the pinned count is the pinned registered pages and within its
//!   bound, and every pending duration is on record (`pages/`).

use super::SlotAllocator;
use crate::error::{PoolError, Result};

impl SlotAllocator {
    pub fn check(&self) -> Result<()> {
        self.check_inner().map_err(PoolError::Invariant)
    }

    fn check_inner(&self) -> std::result::Result<(), String> {
        let n = self.geo.num_pages;
        // Holders counted from the open requests' page lists.
        let mut holders = vec![0u32; n];
        for row in 0..self.requests.capacity() {
            if !self.requests.is_open(row) {
                continue;
            }
            for &p in self.row_pages_of(row) {
                if p == 0 || p as usize >= n {
                    return Err(format!("row {row} holds out-of-range page {p}"));
                }
                holders[p as usize] += 1;
            }
        }
        self.pages.check(holders, self.geo.page_size)?;
        self.prefix.check(
            |p| ((p as usize) < n).then(|| self.pages.entry(p)),
            (1..n as u32)
                .map(|p| (p, self.pages.entry(p)))
                .filter(|&(_, e)| e != 0),
        )?;
        self.pages.check_priorities(self.clock.manual())?;
        self.requests.check()?;
        for row in 0..self.requests.capacity() {
            if !self.requests.is_open(row) {
                continue;
            }
            let (len, last, slow) = self.requests.tail(row);
            if self.needs_slow(row, len, last) && !slow {
                return Err(format!("row {row} needs the slow path but SLOW is clear"));
            }
            if self.requests.is_exclusive(row)
                && self.row_pages_of(row).iter().any(|&p| {
                    self.pages.holders(p) != 1
                        || self.pages.is_registered(p)
                        || self.pages.is_copy_destination(p)
                })
            {
                return Err(format!("row {row} is marked exclusive but shares a page"));
            }
        }
        Ok(())
    }
}
