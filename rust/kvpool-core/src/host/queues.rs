//! The transfer queues: offloads (device -> host) and loads (host ->
//! device), queued by the calls that decide them and drained by the caller
//! (`take_offloads`, `take_loads`), who runs them before the step's K/V
//! writes: offloads, then loads, then copy-on-write copies.
//!
//! A queued transfer pins its host page (one holder) until it is taken, so
//! no later decision reuses that page while the transfer waits: a load's
//! source is never an offload's destination, and an offload's destination
//! is never handed out again or evicted. Device pages are not pinned: an
//! offload's device source may be reused at once (as a load's or a copy's
//! destination, or by a new holder, whose writes all run after the
//! offloads), and a device page with a load still queued into it is known
//! here (`is_load_destination`), so that nothing offloads it before the
//! load has filled it.
//!
//! Loads into a device page its holders release meanwhile are not dropped:
//! a later writer of that page (a load, a copy, a step) runs after it, in
//! the documented order. The queues keep their capacity across drains, as
//! the copy-on-write queue does.

use super::{HostPolicy, HostTier};
use crate::error::Result;
use crate::memory::reserve;

/// One queued transfer between a device page and a host page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Transfer {
    pub(super) device: u32,
    pub(super) host: u32,
}

impl HostTier {
    /// Room for `n` more offloads and `n` more loads before a call changes
    /// anything.
    pub(crate) fn reserve_transfers(&mut self, n: usize) -> Result<()> {
        reserve(&mut self.offloads, n, "offload queue")?;
        reserve(&mut self.loads, n, "load queue")
    }

    /// Queues the offload of device page `device` into host page `h` (HELD,
    /// or just taken), which it pins until taken.
    pub(crate) fn offload(&mut self, device: u32, h: u32) {
        self.hold(h);
        self.offloads.push(Transfer { device, host: h });
    }

    /// Queues the load of host page `h` into device page `device`; the
    /// caller already holds `h` for it (the load's pin, released when the
    /// load is taken).
    pub(crate) fn load_pinned(&mut self, h: u32, device: u32) {
        self.loads.push(Transfer { device, host: h });
        self.load_into[device as usize] += 1;
    }

    /// Whether a queued load writes device page `p`.
    #[inline]
    pub(crate) fn is_load_destination(&self, p: u32) -> bool {
        self.load_into.get(p as usize).is_some_and(|&n| n != 0)
    }

    #[inline]
    pub(crate) fn pending_offloads(&self) -> usize {
        self.offloads.len()
    }

    #[inline]
    pub(crate) fn pending_loads(&self) -> usize {
        self.loads.len()
    }

    /// Drains the offloads: `(device_pages, host_pages)`, oldest first;
    /// each host page's pin is released, so that a chain's tail is older
    /// on the host's eviction list than its parents, as on the device:
    /// write_back queues device victims (tail first) and releases them in
    /// that order; write_through queues `cache()`'s pages (head first) and
    /// releases them last first.
    pub(crate) fn take_offloads(&mut self) -> (Vec<i64>, Vec<i64>) {
        let n = self.offloads.len();
        let (mut dev, mut host) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let q = std::mem::take(&mut self.offloads);
        for t in &q {
            dev.push(t.device as i64);
            host.push(t.host as i64);
        }
        if self.policy == HostPolicy::WriteThrough {
            q.iter().rev().for_each(|t| self.release(t.host));
        } else {
            q.iter().for_each(|t| self.release(t.host));
        }
        self.offloads = q;
        self.offloads.clear();
        self.offloaded += n as u64;
        (dev, host)
    }

    /// Drains the loads: `(host_pages, device_pages)`, oldest first; each
    /// host page's pin is released last first (loads are queued in chain
    /// order), so that a chain's tail is the older on the host's eviction
    /// list and goes before the pages a hit needs first.
    pub(crate) fn take_loads(&mut self) -> (Vec<i64>, Vec<i64>) {
        let n = self.loads.len();
        let (mut host, mut dev) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let q = std::mem::take(&mut self.loads);
        for t in &q {
            host.push(t.host as i64);
            dev.push(t.device as i64);
            self.load_into[t.device as usize] -= 1;
        }
        q.iter().rev().for_each(|t| self.release(t.host));
        self.loads = q;
        self.loads.clear();
        self.loaded += n as u64;
        (host, dev)
    }
}
