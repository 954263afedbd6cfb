//! Host hits: `open_with_prefix` on a batch whose matches reach entries
//! whose only copy is on the host. Each such entry takes a device page and
//! queues a load (host -> device); the entry is then on both tiers.
//!
//! Hits are served in batch order, each prompt's from its first page, out
//! of the pool's available pages (FREE + CACHED when the call starts). A
//! hit uses one up if it loads (a host-only entry not already loaded by an
//! earlier prompt of the batch) or holds an evictable page (which then can
//! no longer be evicted for a load); a pinned or held page uses none. A hit
//! that needs a page when none is left ends its prompt's match there: a
//! miss, not an error.
//!
//! The order of the phases is what keeps the call's transfers safe:
//!
//! 1. every hit of the batch is held (device) or pinned (host: the load's
//!    pin) before any page is taken, so taking a device page for a load,
//!    which may evict another page and under `write_back` offload it, can
//!    neither evict a page the batch matched nor choose as the offload's
//!    destination the host page a load of this batch reads (the offloads
//!    run first and would overwrite it);
//! 2. each load takes its device page, its token ids and the entry's new
//!    location, and is queued;
//! 3. the requests open on their device pages.

use super::options::Counts;
use super::SlotAllocator;
use crate::error::Result;
use crate::location::{host_page, is_host};
use crate::prefix::tip::{ChainTip, Match};

impl SlotAllocator {
    /// Room for `n` host hits' loads (and as many offloads of the pages
    /// their device pages evict) before anything changes.
    pub(super) fn reserve_host_hits(&mut self, n: usize) -> Result<()> {
        match self.host.as_mut() {
            Some(h) => h.reserve_transfers(n),
            None => Ok(()),
        }
    }

    /// The entry (index) whose host copy is host page `h`.
    #[inline]
    fn host_entry(&self, h: u32) -> u32 {
        self.host.as_ref().map_or(0, |t| t.entry(h)).wrapping_sub(1)
    }

    /// Opens one request per match (see above); `hits` holds the matches'
    /// locations in order, `pending` room for one entry per host hit,
    /// `handles` and `cached` room for one value per match. Cannot fail.
    pub(super) fn open_with_host_hits(
        &mut self,
        salt: Counts<'_>,
        matches: &[Match],
        hits: &mut [u32],
        mut pending: Vec<u32>,
        handles: &mut Vec<i64>,
        cached: &mut Vec<i64>,
    ) {
        let ps = self.geo.page_size;
        // 1. Hold and pin, in batch order, while a page is left for each
        //    load decided so far; `cached[j]` is prompt j's kept hits.
        let mut hp = 0usize;
        for m in matches {
            let mut k = 0usize;
            for &loc in &hits[hp..hp + m.pages] {
                let spare = self.pages.available() > pending.len();
                if is_host(loc) {
                    let i = self.host_entry(host_page(loc));
                    if !self.prefix.is_loading(i) {
                        if !spare {
                            break;
                        }
                        if let Some(host) = self.host.as_mut() {
                            host.hold(host_page(loc));
                        }
                        self.prefix.mark_loading(i);
                        pending.push(i);
                    }
                } else {
                    // Only holding an evictable page uses up one a load could take: a
                    // pinned cached page was never available, and a held one is not.
                    // (Any unheld page counted: a prompt whose device pages were all
                    // pinned hit nothing once no page was free.)
                    let page = std::slice::from_ref(&loc);
                    if !spare && self.pages.evictable_among(page) == 1 {
                        break;
                    }
                    self.pages.hold(page);
                }
                k += 1;
            }
            cached.push(k as i64);
            hp += m.pages;
        }
        // 2. The loads: a device page each, in the order decided.
        for &i in &pending {
            let h = self.prefix.host_copy(i);
            let q = self.take_page();
            self.prefix.tokens_from_host(h, q);
            self.prefix.set_location(i, q);
            self.pages.set_entry(q, i + 1);
            if let Some(host) = self.host.as_mut() {
                host.load_pinned(h, q);
                host.count_host_only(false);
            }
            let (hash, s) = self.prefix.identity(i);
            // A matched entry's parent is the hit before it: registered.
            let parent = self.prefix.parent_hash(i).unwrap_or(0);
            self.events
                .stored(hash, parent, q, s, self.prefix.page_tokens(q));
        }
        // 3. The requests, on their device pages: a loaded page has one
        //    holder per request that uses it (its taker's count is dropped
        //    below).
        let mut hp = 0usize;
        for (j, m) in matches.iter().enumerate() {
            let k = cached[j] as usize;
            let mine = &mut hits[hp..hp + k];
            let mut loaded = 0u64;
            for loc in mine.iter_mut() {
                if is_host(*loc) {
                    *loc = self.prefix.location(self.host_entry(host_page(*loc)));
                    self.pages.add_holder(*loc);
                    loaded += 1;
                }
            }
            let tip = if k == m.pages {
                m.tip
            } else {
                mine.last()
                    .and_then(|&p| self.prefix.tip_at(self.pages.entry(p)))
                    .map_or(ChainTip::root(salt.get(j)), |(t, _)| t)
            };
            let (handle, len) = self.open_on(salt.get(j), tip, mine, false);
            if let Some(host) = self.host.as_mut() {
                host.add_hit_tokens(loaded * ps as u64);
            }
            handles.push(handle);
            cached[j] = len as i64;
            hp += m.pages;
        }
        for &i in &pending {
            self.pages.drop_shared_holder(self.prefix.location(i));
        }
    }
}
