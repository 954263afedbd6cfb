//! The host tier: host pages that keep registered pages' content (and
//! swapped-out requests' pages) below the device pool, and the transfers
//! that move pages between the two.
//!
//! The core never moves bytes. It decides which device page goes to which
//! host page and queues the transfer; the caller runs them before a step's
//! K/V writes, in the order offloads (device -> host, `take_offloads`),
//! loads (host -> device, `take_loads`), copies (`take_copies`).
//!
//! Every host page is, like a device page (`pages/`), in one state:
//!
//! - FREE: on the free stack; content meaningless;
//! - HELD: `holders >= 1`: swapped-out requests name it, or a queued
//!   transfer reads it (a load's source) or writes it (an offload's
//!   destination). A queued transfer's page is pinned so: it is never
//!   evicted or handed out again before the transfer is taken, which is
//!   what keeps one call's queue safe to run in the documented order (a
//!   load's source is never also an offload's destination);
//! - CACHED: holders 0, registered (the host copy of a prefix-index entry),
//!   on the host's own eviction list (a second instance of `Eviction`).
//!
//! Host page 0 is reserved (the eviction list's sentinel), so host page ids
//! index the torch layer's host buffer directly.
//!
//! This owner keeps the records, the free stack, the eviction list, the
//! policy, the two transfer queues and the tier's counters. Which entry a
//! host page holds is filled in by the allocator, which keeps it in step
//! with the prefix index (whose entries name their host copy, and which
//! keeps the host pages' token ids, `prefix/index.rs`).

pub(crate) mod check;
mod queues;
pub(crate) mod record;

use crate::error::Result;
use crate::eviction::Eviction;
use crate::memory::{reserve, zeroed_vec};
use queues::Transfer;
use record::HostPage;

/// When a registered page gets a host copy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum HostPolicy {
    /// When device eviction would otherwise drop a CACHED page: it is
    /// offloaded instead, and its entry lives on the host.
    #[default]
    WriteBack,
    /// When `cache()` registers the page: a later device eviction then
    /// drops the device copy and moves nothing.
    WriteThrough,
}

#[derive(Debug, Clone)]
pub(crate) struct HostTier {
    policy: HostPolicy,
    /// One record per host page, page 0 the eviction list's sentinel.
    records: Vec<HostPage>,
    /// FREE host pages; the top (end) is handed out next.
    free: Vec<u32>,
    /// Which CACHED host page goes next.
    eviction: Eviction,
    /// Host pages holding an entry's copy (HELD or CACHED).
    registered: usize,
    /// Prefix-index entries whose only copy is on the host.
    host_only: usize,
    /// Queued offloads (device page -> host page), oldest first.
    offloads: Vec<Transfer>,
    /// Queued loads (host page -> device page), oldest first.
    loads: Vec<Transfer>,
    /// Per device page: queued loads that write it.
    load_into: Vec<u32>,
    /// Pages handed out by `take_offloads` / `take_loads`, cumulative.
    offloaded: u64,
    loaded: u64,
    /// Prompt tokens `open_with_prefix` served from host copies, cumulative.
    hit_tokens: u64,
}

impl HostTier {
    /// `host_pages` pages (page 0 reserved, so at least 2) below a device
    /// pool of `num_pages` pages.
    pub(crate) fn new(host_pages: usize, num_pages: usize, policy: HostPolicy) -> Result<Self> {
        let mut free = Vec::new();
        reserve(&mut free, host_pages - 1, "host free stack")?;
        // Allocated before the stack is written (4 bytes a host page), so a
        // refusal costs no resident memory (as in PagePool::new).
        let records = zeroed_vec(host_pages, "host page states")?;
        let load_into = zeroed_vec(num_pages, "host load map")?;
        // Reversed so that pop() hands out 1, 2, 3, ... on a fresh tier.
        free.extend((1..host_pages as u32).rev());
        Ok(HostTier {
            policy,
            records,
            free,
            eviction: Eviction::default(),
            registered: 0,
            host_only: 0,
            offloads: Vec::new(),
            loads: Vec::new(),
            load_into,
            offloaded: 0,
            loaded: 0,
            hit_tokens: 0,
        })
    }

    #[inline]
    pub(crate) fn policy(&self) -> HostPolicy {
        self.policy
    }

    /// Host pages, the reserved page 0 included.
    #[inline]
    pub(crate) fn num_pages(&self) -> usize {
        self.records.len()
    }

    /// Host pages an offload can take now: FREE + CACHED.
    #[inline]
    pub(crate) fn available(&self) -> usize {
        self.free.len() + self.eviction.len()
    }

    /// Host pages holding an entry's copy.
    #[inline]
    pub(crate) fn registered(&self) -> usize {
        self.registered
    }

    // ---- holders ----

    #[inline]
    pub(crate) fn holders(&self, h: u32) -> u32 {
        self.records[h as usize].holders
    }

    /// One more holder of `h`: a CACHED page leaves the eviction list.
    /// `h` is HELD, CACHED, or just taken (`pop_free` / `pop_victim`, its
    /// entry taken).
    pub(crate) fn hold(&mut self, h: u32) {
        let r = self.records[h as usize];
        if r.holders == 0 && r.entry != 0 {
            self.eviction.remove_run(&mut self.records, h, h, 1);
            self.records[h as usize].links = Default::default();
        }
        self.records[h as usize].holders += 1;
    }

    /// One holder fewer of `h`: its last one leaves it CACHED if it holds
    /// an entry's copy, else FREE.
    pub(crate) fn release(&mut self, h: u32) {
        let r = &mut self.records[h as usize];
        r.holders -= 1;
        if r.holders == 0 {
            if r.entry != 0 {
                self.eviction.insert(&mut self.records, h);
            } else {
                self.free.push(h);
            }
        }
    }

    // ---- taking pages ----

    /// A FREE page for a new use (unregistered, holders 0).
    #[inline]
    pub(crate) fn pop_free(&mut self) -> Option<u32> {
        self.free.pop()
    }

    /// Gives back a page taken with `pop_free` or `pop_victim` and not used
    /// (unregistered, holders 0).
    #[inline]
    pub(crate) fn push_free(&mut self, h: u32) {
        self.free.push(h);
    }

    /// Takes the next CACHED page off the eviction list. It still names
    /// its entry: the caller takes it (`take_entry`) and fixes the index.
    pub(crate) fn pop_victim(&mut self) -> Option<u32> {
        let h = self.eviction.pop_victim(&mut self.records)?;
        self.records[h as usize].links = Default::default();
        Some(h)
    }

    // ---- registration ----

    /// Index + 1 of the entry whose copy `h` holds (0: none).
    #[inline]
    pub(crate) fn entry(&self, h: u32) -> u32 {
        self.records[h as usize].entry
    }

    /// `h` (HELD) now holds entry `entry`'s copy.
    pub(crate) fn set_entry(&mut self, h: u32, entry: u32) {
        let r = &mut self.records[h as usize];
        self.registered += (r.entry == 0) as usize;
        r.entry = entry;
    }

    /// Clears `h`'s registration and returns it (0: it had none).
    pub(crate) fn take_entry(&mut self, h: u32) -> u32 {
        let e = std::mem::replace(&mut self.records[h as usize].entry, 0);
        self.registered -= (e != 0) as usize;
        e
    }

    /// Host page `h` stops holding its entry's copy (the entry leaves the
    /// index): a CACHED page leaves the eviction list FREE; a held one goes
    /// FREE when its last holder lets it go (`release`).
    pub(crate) fn drop_copy(&mut self, h: u32) {
        self.take_entry(h);
        if self.records[h as usize].holders == 0 {
            self.eviction.remove_run(&mut self.records, h, h, 1);
            self.records[h as usize].links = Default::default();
            self.free.push(h);
        }
    }

    /// Clears `h`'s registration if it is `entry`; returns whether it was.
    pub(crate) fn clear_entry_if(&mut self, h: u32, entry: u32) -> bool {
        match self.records.get(h as usize) {
            Some(r) if r.entry == entry => {
                self.take_entry(h);
                true
            }
            _ => false,
        }
    }

    /// Entries whose only copy is on the host.
    #[inline]
    pub(crate) fn host_only(&self) -> usize {
        self.host_only
    }

    /// An entry's device copy went and its host copy stays (+1), or a
    /// host-only entry went or got a device copy (-1).
    #[inline]
    pub(crate) fn count_host_only(&mut self, up: bool) {
        if up {
            self.host_only += 1;
        } else {
            self.host_only -= 1;
        }
    }

    /// `clear_cache`: every CACHED page becomes FREE, keeping its
    /// registration for the index's sweep to clear (`clear_entry_if`);
    /// HELD pages stay with their holders.
    pub(crate) fn clear(&mut self) {
        while let Some(h) = self.pop_victim() {
            self.free.push(h);
        }
        self.host_only = 0;
    }

    // ---- counters ----

    #[inline]
    pub(crate) fn hit_tokens(&self) -> u64 {
        self.hit_tokens
    }

    #[inline]
    pub(crate) fn add_hit_tokens(&mut self, n: u64) {
        self.hit_tokens += n;
    }

    #[inline]
    pub(crate) fn uncount_hit_tokens(&mut self, n: u64) {
        self.hit_tokens = self.hit_tokens.saturating_sub(n);
    }

    #[inline]
    pub(crate) fn offloaded(&self) -> u64 {
        self.offloaded
    }

    #[inline]
    pub(crate) fn loaded(&self) -> u64 {
        self.loaded
    }

    /// Heap bytes: records, free stack, queues, the load map.
    pub(crate) fn capacity_bytes(&self) -> usize {
        self.records.capacity() * std::mem::size_of::<HostPage>()
            + self.free.capacity() * 4
            + (self.offloads.capacity() + self.loads.capacity()) * std::mem::size_of::<Transfer>()
            + self.load_into.capacity() * 4
    }
}
