//! Swapping requests out to the host tier and back in.
//!
//! `swap_out` moves each page a request holds alone to a host page the
//! request then holds (its page list names it with the host bit,
//! `location.rs`), and lets go of the device page. A registered page's
//! entry keeps the host copy: the request holds the copy the entry has, or
//! the new one becomes the entry's (a Stored event for the host), and the
//! device page stays CACHED (a later hit needs no load). Pages that stay on
//! the device, still held by the request:
//!
//! - shared ones (another request, or a queued copy, holds them);
//! - pages a queued load or copy still has to fill: an offload of one
//!   would run before that transfer (offloads run first) and copy what the
//!   page held before it.
//!
//! A swapped-out request keeps its handle, length, prompt and known
//! tokens; its row is marked (`requests/row.rs`), so extend, truncate,
//! fork, cache and the slot queries refuse it (`RequestSwappedOut`), and
//! `close` releases both tiers' pages.
//!
//! `swap_in` re-takes the device copy of each host page whose entry still
//! has one (`swap_out` left it CACHED, or another request hit it): the
//! bytes are there, so a load would only duplicate the page or, on a full
//! device, evict it to make room. Every other host page gets a device page
//! and a queued load. The request's hold on such a host page becomes the
//! load's pin, released when the load is taken: until then no offload of
//! the same call (or a later one) can be given that host page, which a
//! device page taken by this very call may need when its eviction writes
//! back.

use super::SlotAllocator;
use crate::error::{PoolError, Result};
use crate::events::MEDIUM_HOST;
use crate::handle::handle_row;
use crate::location::{host_page, is_host, on_host};
use crate::memory::reserve;

/// What `swap_out` does with one device page of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// Shared, or still to be filled by a queued transfer.
    Stay,
    /// Registered, and its entry has host copy `h`: hold that.
    Reuse(u32),
    /// Copy it to a new host page.
    Offload,
}

fn no_tier(call: &str) -> PoolError {
    PoolError::InvalidArgument(format!(
        "{call} needs a host tier; this allocator was built with host_pages=0"
    ))
}

impl SlotAllocator {
    fn swap_plan(&self, p: u32) -> Plan {
        let Some(host) = self.host.as_ref() else {
            return Plan::Stay;
        };
        if self.pages.holders(p) != 1
            || self.pages.is_copy_destination(p)
            || host.is_load_destination(p)
        {
            return Plan::Stay;
        }
        match self.pages.entry(p).checked_sub(1) {
            Some(i) if self.prefix.host_copy(i) != 0 => Plan::Reuse(self.prefix.host_copy(i)),
            _ => Plan::Offload,
        }
    }

    /// Moves each request's pages that it holds alone to host pages (see
    /// above) and frees or caches their device pages; the request keeps its
    /// handle and length, and `swap_in` brings it back. Queues the offloads
    /// (`take_offloads`). All-or-nothing.
    ///
    /// Errors (nothing changed): `InvalidHandle`, `RequestSwappedOut` (a
    /// request is swapped out already), `InvalidArgument` (a handle twice;
    /// no host tier), `HostExhausted` (fewer free or evictable host pages
    /// than the pages to move).
    pub fn swap_out(&mut self, handles: &[i64]) -> Result<()> {
        if self.host.is_none() {
            return Err(no_tier("swap_out"));
        }
        self.requests.resolve_batch(handles)?;
        let (mut fresh, mut cached_copies, mut moved) = (0usize, 0usize, 0usize);
        for &h in handles {
            let row = handle_row(h) as usize;
            self.requests.check_resident(row, h)?;
            for &p in self.requests.held_pages(row) {
                match self.swap_plan(p) {
                    Plan::Stay => continue,
                    Plan::Reuse(c) => {
                        // A CACHED copy leaves the host's eviction list.
                        cached_copies +=
                            self.host.as_ref().is_some_and(|t| t.holders(c) == 0) as usize;
                    }
                    Plan::Offload => fresh += 1,
                }
                moved += 1;
            }
        }
        let free = self.host_free_pages();
        if fresh + cached_copies > free {
            return Err(PoolError::HostExhausted {
                needed_pages: fresh + cached_copies,
                free_pages: free,
            });
        }
        let mut released = Vec::new();
        reserve(&mut released, moved, "swapped pages")?;
        self.events.reserve(2 * fresh, self.geo.page_size)?;
        if let Some(t) = self.host.as_mut() {
            t.reserve_transfers(fresh)?;
        }
        // Apply. The copies the requests keep are held first, so that no
        // host page taken below evicts one of them.
        for &h in handles {
            let row = handle_row(h) as usize;
            for k in 0..self.requests.held_pages(row).len() {
                if let Plan::Reuse(c) = self.swap_plan(self.requests.page(row, k)) {
                    if let Some(t) = self.host.as_mut() {
                        t.hold(c);
                    }
                }
            }
        }
        for &h in handles {
            let row = handle_row(h) as usize;
            released.clear();
            for k in 0..self.requests.held_pages(row).len() {
                let p = self.requests.page(row, k);
                let c = match self.swap_plan(p) {
                    Plan::Stay => continue,
                    Plan::Reuse(c) => c,
                    Plan::Offload => self.swap_page_out(p),
                };
                self.requests.set_page(row, k, on_host(c));
                released.push(p);
            }
            if self.pages.release(&released) {
                self.pages.drop_released_copies(&released);
            }
            self.requests.set_swapped(row);
        }
        Ok(())
    }

    /// Copies device page `p` (held by one request alone) to a new host
    /// page, which that request holds; returns it. A registered page whose
    /// entry has no host copy (and whose parent is registered) makes it
    /// the entry's.
    fn swap_page_out(&mut self, p: u32) -> u32 {
        // Counted by swap_out: a host page is there.
        let h = self.take_host_page().unwrap_or(0);
        let parent = self
            .pages
            .entry(p)
            .checked_sub(1)
            .and_then(|i| self.prefix.parent_hash(i).map(|ph| (i, ph)));
        let Self {
            prefix,
            host,
            events,
            ..
        } = self;
        let Some(host) = host.as_mut() else {
            return h;
        };
        prefix.tokens_to_host(p, h);
        host.offload(p, h);
        host.hold(h);
        if let Some((i, ph)) = parent {
            prefix.set_host_copy(i, h);
            host.set_entry(h, i + 1);
            let (hash, salt) = prefix.identity(i);
            events.stored_on(MEDIUM_HOST, hash, ph, h, salt, prefix.host_page_tokens(h));
        }
        h
    }

    /// Brings swapped-out requests back: each host page's entry's device
    /// copy where it still has one, else a device page (evicting, and under
    /// `write_back` offloading, CACHED pages as needed) and a queued load
    /// (`take_loads`); the host pages are let go once re-taken, or once the
    /// loads are taken. After the loads every position holds the K/V it held
    /// before `swap_out`, but a registered page comes back as its entry's
    /// copy, which a duplicate registration of the same tokens may have
    /// replaced meanwhile (the K/V a prefix hit would give). All-or-nothing.
    ///
    /// Errors (nothing changed): `InvalidHandle`, `InvalidArgument` (a
    /// handle twice; a request that is not swapped out; no host tier),
    /// `Exhausted` (fewer FREE + CACHED device pages than the pages to take:
    /// the loads, plus the evictable CACHED copies re-taken).
    pub fn swap_in(&mut self, handles: &[i64]) -> Result<()> {
        if self.host.is_none() {
            return Err(no_tier("swap_in"));
        }
        self.requests.resolve_batch(handles)?;
        let mut host_pages = 0usize;
        for &h in handles {
            let row = handle_row(h) as usize;
            if !self.requests.is_swapped(row) {
                return Err(PoolError::InvalidArgument(format!(
                    "request {h} is not swapped out; swap_in takes requests swap_out moved"
                )));
            }
            let held = self.requests.held_pages(row);
            host_pages += held.iter().filter(|&&l| is_host(l)).count();
        }
        let mut copies = Vec::new();
        reserve(&mut copies, host_pages, "re-taken device copies")?;
        let mut loads = 0usize;
        for &h in handles {
            for &l in self.requests.held_pages(handle_row(h) as usize) {
                if is_host(l) {
                    match self.device_copy(host_page(l)) {
                        Some(d) => copies.push(d),
                        None => loads += 1,
                    }
                }
            }
        }
        // A re-taken copy leaves the eviction list if it was on it, once:
        // requests that hit the same page before their swap_out all hold its
        // entry's host copy, and re-take the one device copy.
        copies.sort_unstable();
        copies.dedup();
        let need = loads + self.pages.evictable_among(&copies);
        let available = self.pages.available();
        if need > available {
            return Err(PoolError::Exhausted {
                needed_pages: need,
                free_pages: available,
                page_size: self.geo.page_size,
                free_slots: available * self.geo.page_size,
            });
        }
        if let Some(t) = self.host.as_mut() {
            t.reserve_transfers(loads)?;
        }
        // The copies first, so that no page taken for a load evicts one; last
        // first, so that a chain's tail is the older of the host copies let go.
        for &h in handles {
            let row = handle_row(h) as usize;
            for k in (0..self.requests.held_pages(row).len()).rev() {
                let loc = self.requests.page(row, k);
                if !is_host(loc) {
                    continue;
                }
                if let Some(d) = self.device_copy(host_page(loc)) {
                    self.pages.hold(std::slice::from_ref(&d));
                    if let Some(t) = self.host.as_mut() {
                        t.release(host_page(loc));
                    }
                    self.requests.set_page(row, k, d);
                }
            }
        }
        for &h in handles {
            let row = handle_row(h) as usize;
            let n = self.requests.held_pages(row).len();
            for k in 0..n {
                let loc = self.requests.page(row, k);
                if is_host(loc) {
                    let q = self.swap_page_in(host_page(loc));
                    self.requests.set_page(row, k, q);
                }
            }
            let len = self.requests.len(row);
            let last = self.requests.held_pages(row).last().copied().unwrap_or(0);
            self.requests.set_tail(row, len, last);
            if self.needs_slow(row, len, last) {
                self.requests.mark_slow(row);
            }
        }
        Ok(())
    }

    /// The device page holding the entry that host page `h` is a copy of,
    /// when that entry still has one.
    fn device_copy(&self, h: u32) -> Option<u32> {
        let i = self.host.as_ref()?.entry(h).checked_sub(1)?;
        let loc = self.prefix.location(i);
        (!is_host(loc)).then_some(loc)
    }

    /// A device page for the swapped-out request's host page `h`, its
    /// token ids and the queued load (the request's hold on `h` becomes the
    /// load's pin). A host-only entry's copy makes the page the entry's
    /// device copy (a Stored event).
    fn swap_page_in(&mut self, h: u32) -> u32 {
        let q = self.take_page();
        self.prefix.tokens_from_host(h, q);
        let Some(host) = self.host.as_mut() else {
            return q;
        };
        host.load_pinned(h, q);
        if let Some(i) = host.entry(h).checked_sub(1) {
            if self.prefix.location(i) == on_host(h) {
                if let Some(parent) = self.prefix.parent_hash(i) {
                    self.prefix.set_location(i, q);
                    self.pages.set_entry(q, i + 1);
                    host.count_host_only(false);
                    let (hash, salt) = self.prefix.identity(i);
                    self.events
                        .stored(hash, parent, q, salt, self.prefix.page_tokens(q));
                }
            }
        }
        q
    }

    /// Whether `handle` names a swapped-out request.
    ///
    /// Errors: `InvalidHandle`.
    pub fn is_swapped(&self, handle: i64) -> Result<bool> {
        Ok(self.requests.is_swapped(self.requests.resolve(handle)?))
    }

    /// Closes swapped-out `row`: its host pages and the device pages it
    /// kept are let go, last first.
    pub(super) fn close_swapped_row(&mut self, row: usize) {
        for k in (0..self.requests.held_pages(row).len()).rev() {
            let loc = self.requests.page(row, k);
            if is_host(loc) {
                if let Some(t) = self.host.as_mut() {
                    t.release(host_page(loc));
                }
            } else if self.pages.release(std::slice::from_ref(&loc)) {
                self.pages.drop_released_copies(std::slice::from_ref(&loc));
            }
        }
        self.requests.set_tail(row, 0, 0);
        self.requests.truncate_known(row, 0);
        self.requests.close_row(row);
    }
}
