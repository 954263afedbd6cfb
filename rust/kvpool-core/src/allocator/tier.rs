//! The host tier's side of eviction and registration, and its queues'
//! public calls.
//!
//! - A device page leaves the index (evicted, or rewritten in place): an
//!   entry with a host copy lives on there (Removed for the device only);
//!   under `write_back` an evicted entry without one gets one (an offload
//!   into a FREE host page, else the host's least recently used one);
//!   otherwise the entry goes.
//! - Under `write_through`, `cache()` gives each page it registers a host
//!   copy at once, so a later eviction moves nothing.
//! - A host page taken from the host's eviction list drops the copy it
//!   held: a host-only entry goes with it.
//!
//! Only entries whose parent is still registered (on either tier) get a
//! host copy: one whose parent is gone can no longer be reached by a
//! lookup, and a copy of it would only take room (and its Stored event
//! could not name its parent).

use super::SlotAllocator;
use crate::events::MEDIUM_HOST;
use crate::host::HostPolicy;
use crate::location::{is_host, on_host};

impl SlotAllocator {
    /// Takes `p`'s registration off the device (a CACHED page evicted, or
    /// a page about to be written in place): its entry keeps a host copy
    /// if it has one, or gets one when `offload` and the policy is
    /// `write_back`; otherwise the entry goes. Reports the device copy's
    /// Removed event.
    pub(super) fn drop_device_copy(&mut self, p: u32, offload: bool) {
        let entry = self.pages.take_entry(p);
        if entry == 0 {
            return;
        }
        let i = entry - 1;
        let (hash, salt) = self.prefix.identity(i);
        let mut copy = self.prefix.host_copy(i);
        let write_back = self
            .host
            .as_ref()
            .is_some_and(|h| h.policy() == HostPolicy::WriteBack);
        if copy == 0 && offload && write_back {
            copy = self.new_host_copy(i, p).unwrap_or(0);
        }
        if copy != 0 {
            self.prefix.set_location(i, on_host(copy));
            self.prefix.note_device_copy_lost();
            if let Some(h) = self.host.as_mut() {
                h.count_host_only(true);
            }
        } else {
            self.prefix.unregister(entry);
        }
        self.events.removed(hash, p, salt);
    }

    /// Gives entry `i` (on device page `p`) a host copy: a host page taken
    /// for it, `p`'s token ids, a queued offload `p -> h` and a Stored
    /// event for the host. None (nothing changed but the host pages an
    /// attempt evicted) when the entry's parent is gone, `p` still has a
    /// load queued into it, or no host page can be had.
    pub(super) fn new_host_copy(&mut self, i: u32, p: u32) -> Option<u32> {
        self.prefix.parent_hash(i)?;
        // The queued offloads run before the loads: an offload of `p` now
        // would copy what `p` held before its load (a request swapped back
        // in, cached or evicted before the queues are drained).
        if self.host.as_ref()?.is_load_destination(p) {
            return None;
        }
        let h = self.take_host_page()?;
        // Taking the page may have evicted the parent's only copy.
        let Some(parent) = self.prefix.parent_hash(i) else {
            self.host.as_mut()?.push_free(h);
            return None;
        };
        let Self {
            prefix,
            host,
            events,
            ..
        } = self;
        let host = host.as_mut()?;
        prefix.tokens_to_host(p, h);
        prefix.set_host_copy(i, h);
        host.offload(p, h);
        host.set_entry(h, i + 1);
        let (hash, salt) = prefix.identity(i);
        events.stored_on(
            MEDIUM_HOST,
            hash,
            parent,
            h,
            salt,
            prefix.host_page_tokens(h),
        );
        Some(h)
    }

    /// A host page for a new copy or a swapped-out page: FREE first, else
    /// the host's least recently used CACHED page, whose copy goes (and
    /// with it a host-only entry). It comes back unregistered with no
    /// holder; None when every host page is held.
    pub(super) fn take_host_page(&mut self) -> Option<u32> {
        let host = self.host.as_mut()?;
        if let Some(h) = host.pop_free() {
            return Some(h);
        }
        let h = host.pop_victim()?;
        let entry = host.take_entry(h);
        if let Some(i) = entry.checked_sub(1) {
            let (hash, salt) = self.prefix.identity(i);
            self.prefix.set_host_copy(i, 0);
            if is_host(self.prefix.location(i)) {
                self.prefix.unregister(entry);
                host.count_host_only(false);
            }
            self.events.removed_on(MEDIUM_HOST, hash, h, salt);
        }
        Some(h)
    }

    /// `evict(n)` with a host tier: the victims one by one, in the eviction
    /// room's order (priorities decide which device page goes; the host
    /// copy it gets is then ordered by the host's own LRU), each entry kept
    /// or offloaded as `drop_device_copy` decides.
    pub(super) fn evict_tiered(&mut self, n: usize) -> usize {
        let mut done = 0;
        while done < n {
            let Some(p) = self.pages.pop_victim() else {
                break;
            };
            self.pages.warm_hinted(p);
            self.drop_device_copy(p, true);
            self.pages.free_evicted(p);
            done += 1;
        }
        done
    }

    /// `clear_cache` with a host tier: CACHED pages of both tiers (pinned
    /// ones too) become FREE, then one sweep of the index clears every
    /// record that names an entry (HELD pages of both tiers stay with their
    /// holders), and no page keeps a priority.
    pub(super) fn clear_tiered(&mut self) {
        while let Some(p) = self.pages.pop_cached() {
            self.pages.free_evicted(p);
        }
        self.pages.clear_priorities();
        let Self {
            pages,
            prefix,
            host,
            ..
        } = self;
        if let Some(host) = host.as_mut() {
            host.clear();
            prefix.clear(|loc, entry| {
                if is_host(loc) {
                    host.clear_entry_if(crate::location::host_page(loc), entry)
                } else {
                    pages.clear_entry_if(loc, entry)
                }
            });
        }
        self.requests.restart_chains();
        self.events.cleared();
    }

    /// `write_through`: gives the pages of `row`'s list `from..to` that
    /// `cache()` just registered a host copy each.
    pub(super) fn write_through(&mut self, row: usize, from: usize, to: usize) {
        for k in from..to {
            let p = self.requests.page(row, k);
            let entry = self.pages.entry(p);
            if let Some(i) = entry.checked_sub(1) {
                if self.prefix.host_copy(i) == 0 {
                    self.new_host_copy(i, p);
                }
            }
        }
    }

    /// Whether `cache()` gives registered pages a host copy at once.
    #[inline]
    pub(super) fn writes_through(&self) -> bool {
        self.host
            .as_ref()
            .is_some_and(|h| h.policy() == HostPolicy::WriteThrough)
    }

    // ---- the queues and counters, public ----

    /// Drains the queued offloads: `(device_pages, host_pages)`, oldest
    /// first. Copy every layer's K and V of device page `device_pages[i]`
    /// into host page `host_pages[i]` before the queued loads and copies run
    /// and before the next step's K/V writes (the documented order:
    /// offloads, then `take_loads`, then `take_copies`). Each host page
    /// stays pinned (never reused or evicted) until its offload is taken
    /// here. Empty without a host tier.
    pub fn take_offloads(&mut self) -> (Vec<i64>, Vec<i64>) {
        match self.host.as_mut() {
            Some(h) => h.take_offloads(),
            None => (Vec::new(), Vec::new()),
        }
    }

    /// Drains the queued loads: `(host_pages, device_pages)`, oldest first.
    /// Copy host page `host_pages[i]` into device page `device_pages[i]`
    /// after the offloads and before the copies (see `take_offloads`). Each
    /// host page stays pinned until its load is taken here. Empty without a
    /// host tier.
    pub fn take_loads(&mut self) -> (Vec<i64>, Vec<i64>) {
        match self.host.as_mut() {
            Some(h) => h.take_loads(),
            None => (Vec::new(), Vec::new()),
        }
    }

    /// Offloads queued and not yet taken.
    pub fn pending_offloads(&self) -> usize {
        self.host.as_ref().map_or(0, |h| h.pending_offloads())
    }

    /// Loads queued and not yet taken.
    pub fn pending_loads(&self) -> usize {
        self.host.as_ref().map_or(0, |h| h.pending_loads())
    }

    /// Host pages, the reserved page 0 included (0: no host tier).
    pub fn host_pages(&self) -> usize {
        self.host.as_ref().map_or(0, |h| h.num_pages())
    }

    /// The host tier's policy (None: no host tier).
    pub fn host_policy(&self) -> Option<HostPolicy> {
        self.host.as_ref().map(|h| h.policy())
    }

    /// Host pages an offload or a swap can take now: FREE + CACHED.
    pub fn host_free_pages(&self) -> usize {
        self.host.as_ref().map_or(0, |h| h.available())
    }

    /// Host pages holding a registered page's copy (held or not).
    pub fn host_cached_pages(&self) -> usize {
        self.host.as_ref().map_or(0, |h| h.registered())
    }

    /// Prompt tokens `open_with_prefix` served from host copies (loaded),
    /// cumulative; part of `hit_tokens`.
    pub fn host_hit_tokens(&self) -> u64 {
        self.host.as_ref().map_or(0, |h| h.hit_tokens())
    }

    /// Pages handed out by `take_offloads`, cumulative.
    pub fn offloaded_pages(&self) -> u64 {
        self.host.as_ref().map_or(0, |h| h.offloaded())
    }

    /// Pages handed out by `take_loads`, cumulative.
    pub fn loaded_pages(&self) -> u64 {
        self.host.as_ref().map_or(0, |h| h.loaded())
    }
}
