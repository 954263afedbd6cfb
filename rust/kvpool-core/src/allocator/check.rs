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
//! - a request's chain that `cache()` would trust without walking it
//!   spells the request's pages (`check_chains`);
//! - with a host tier (`tier_check.rs`): host pages are held by exactly the
//!   swapped-out requests that name them and the transfers that pin them,
//!   and the index's locations and the host records agree both ways;
//! - with retention priorities, each cached page is on its priority's
//!   list, the pinned count is the pinned registered pages and within its
//!   bound, and every pending duration is on record (`pages/`).

use super::SlotAllocator;
use crate::error::{PoolError, Result};
use crate::location::{host_page, is_host, on_host};

impl SlotAllocator {
    pub fn check(&self) -> Result<()> {
        self.check_inner().map_err(PoolError::Invariant)
    }

    fn check_inner(&self) -> std::result::Result<(), String> {
        let n = self.geo.num_pages;
        let host_n = self.host.as_ref().map_or(0, |h| h.num_pages());
        // Holders counted from the open requests' page lists (a swapped-out
        // request's host pages apart).
        let mut holders = vec![0u32; n];
        let mut host_holders = vec![0u32; host_n];
        for row in 0..self.requests.capacity() {
            if !self.requests.is_open(row) {
                continue;
            }
            let swapped = self.requests.is_swapped(row);
            for &p in self.row_pages_of(row) {
                if is_host(p) {
                    let h = host_page(p) as usize;
                    if !swapped || h == 0 || h >= host_n {
                        return Err(format!(
                            "row {row} holds host page {h} (swapped out: {swapped}, host pages \
                             {host_n})"
                        ));
                    }
                    host_holders[h] += 1;
                    continue;
                }
                if p == 0 || p as usize >= n {
                    return Err(format!("row {row} holds out-of-range page {p}"));
                }
                holders[p as usize] += 1;
            }
        }
        self.pages.check(holders, self.geo.page_size)?;
        self.check_tier(host_holders)?;
        let host = self.host.as_ref();
        let entry_of = |loc: u32| {
            if is_host(loc) {
                let h = host_page(loc);
                host.and_then(|t| ((h as usize) < t.num_pages()).then(|| t.entry(h)))
            } else {
                ((loc as usize) < n).then(|| self.pages.entry(loc))
            }
        };
        let device = (1..n as u32).map(|p| (p, self.pages.entry(p)));
        let hosted = host
            .into_iter()
            .flat_map(|t| (1..t.num_pages() as u32).map(move |h| (on_host(h), t.entry(h))));
        self.prefix
            .check(entry_of, device.chain(hosted).filter(|&(_, e)| e != 0))?;
        self.pages.check_priorities(self.clock.manual())?;
        self.requests.check()?;
        for row in 0..self.requests.capacity() {
            if !self.requests.is_open(row) || self.requests.is_swapped(row) {
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
        self.check_chains()
    }

    /// Each open row's chain that `restart_dead_chain` trusts without a
    /// walk (not broken, its tip live, and through another's entry only if
    /// no removal went since it was last walked) spells the row's first
    /// pages from the root. A stale chain trusted there would file the
    /// row's next pages under another's content: hits on them would answer
    /// for tokens they were not computed on.
    fn check_chains(&self) -> std::result::Result<(), String> {
        for row in 0..self.requests.capacity() {
            if !self.requests.is_open(row) || self.requests.is_swapped(row) {
                continue;
            }
            let chain = self.requests.chain(row);
            let trusted = !chain.broken
                && self.prefix.is_live(&chain.tip)
                && (!chain.foreign || chain.checked == self.prefix.removals());
            if !trusted {
                continue;
            }
            let pages = self.row_pages_of(row);
            if chain.pages > pages.len() {
                return Err(format!(
                    "row {row}'s chain covers {} pages but the row holds {}",
                    chain.pages,
                    pages.len()
                ));
            }
            let salt = self.requests.salt(row);
            self.prefix
                .check_chain_spells(&chain.tip, chain.pages, salt, |k| {
                    self.prefix.page_tokens(pages[k])
                })
                .map_err(|e| format!("row {row}'s chain of {} pages: {e}", chain.pages))?;
        }
        Ok(())
    }
}
