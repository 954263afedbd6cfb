//! Read-only queries and counters. Each validates its handles (a stale
//! handle is an error, never someone else's data) and costs
//! O(handles + pages returned).

use super::SlotAllocator;
use crate::error::{PoolError, Result};
use crate::events::{Drained, EventSink, Events};
use crate::handle::handle_row;
use crate::memory::reserve;
use crate::table::SlotTable;

/// FlashInfer's CSR page table of a batch.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PageTable {
    /// `indptr[i]..indptr[i+1]` indexes request i's pages in `indices`.
    pub indptr: Vec<i32>,
    pub indices: Vec<i32>,
    /// Tokens in each request's last page, in [1, page_size]; 0 for an empty request.
    pub last_page_len: Vec<i32>,
}

impl SlotAllocator {
    pub fn page_size(&self) -> usize {
        self.geo.page_size
    }
    pub fn num_pages(&self) -> usize {
        self.geo.num_pages
    }
    pub fn num_slots(&self) -> usize {
        self.geo.num_slots()
    }
    pub fn max_requests(&self) -> usize {
        self.requests.capacity()
    }
    pub fn max_context_len(&self) -> usize {
        self.geo.max_context_len
    }
    pub fn capacity_pages(&self) -> usize {
        self.geo.num_pages - 1
    }
    pub fn capacity_slots(&self) -> usize {
        self.capacity_pages() * self.geo.page_size
    }
    /// Pages an extend can take now: FREE + CACHED (evictable); pinned
    /// cached pages are not.
    pub fn free_pages(&self) -> usize {
        self.pages.available()
    }
    /// HELD pages (held by at least one open request). With `free_pages`
    /// and the pinned cached pages, they make up `capacity_pages`.
    pub fn used_pages(&self) -> usize {
        self.capacity_pages() - self.pages.available() - self.pages.pinned_cached()
    }
    pub fn free_slots(&self) -> usize {
        self.pages.available() * self.geo.page_size
    }
    /// Slots in held pages (including the unfilled tail of each last page).
    pub fn used_slots(&self) -> usize {
        self.used_pages() * self.geo.page_size
    }
    /// Registered device pages (HELD or CACHED); with a host tier, entries
    /// whose only copy is on the host are `host_cached_pages`.
    pub fn cached_pages(&self) -> usize {
        self.prefix.len() - self.host.as_ref().map_or(0, |h| h.host_only())
    }
    /// CACHED pages: registered, held by nobody, evicted when needed (all
    /// but the pinned ones).
    pub fn evictable_pages(&self) -> usize {
        self.pages.cached()
    }
    /// Prompt tokens served from the cache by `open_with_prefix`, cumulative.
    pub fn hit_tokens(&self) -> u64 {
        self.hit_tokens
    }
    /// Prompt tokens `open_with_prefix` found no cached page for, cumulative.
    pub fn miss_tokens(&self) -> u64 {
        self.miss_tokens
    }
    pub fn open_requests(&self) -> usize {
        self.requests.open_count()
    }
    /// `free_slots`: tokens that fit in whole free or evictable pages (not
    /// pinned ones). One new request of this many tokens fits; a batch needs
    /// `pages_for(len + n) - pages_for(len)` pages per request (a new one
    /// starts a page), plus a copy for each that writes into a partly filled
    /// last page that is shared.
    pub fn admissible_tokens(&self) -> usize {
        self.free_slots()
    }
    /// The hash seed (pass it as `hash_seed` to agree with this pool's hashes).
    pub fn hash_seed(&self) -> u64 {
        self.prefix.hash_seed()
    }

    /// Drains the KV events recorded since the last call (see [`Events`]).
    pub fn take_events(&mut self) -> Events {
        self.events.take()
    }

    /// Undrained events and the token ids of their Stored events: the
    /// sizes of an [`EventSink`] that takes them all.
    pub fn pending_events(&self) -> (usize, usize) {
        self.events.pending()
    }

    /// [`Self::take_events`] into the caller's arrays (a binding's result
    /// buffers): drains the oldest events that fit `out` (all of them when
    /// it was sized by [`Self::pending_events`] and nothing was recorded
    /// since) and keeps the rest, in order. Returns how much it wrote.
    pub fn take_events_into(&mut self, out: EventSink<'_>) -> Drained {
        self.events.take_into(out)
    }

    /// Events dropped because more than max(num_pages, 65536) were left
    /// undrained (each overflow replaces the backlog with one Cleared
    /// event). Cumulative.
    pub fn dropped_events(&self) -> u64 {
        self.events.dropped()
    }

    /// Whether KV events are recorded (`Options::kv_events`, fixed at
    /// construction): tools that learn the cache's contents from
    /// `take_events` need it on.
    pub fn kv_events(&self) -> bool {
        self.events.enabled()
    }

    /// Heap bytes of all bookkeeping (capacities, so the reserved worst case):
    /// per page its state record (holder count, registration, LRU links),
    /// free stack entry and an eighth of a block holder count (20.5 bytes),
    /// 4 per slot of token ids, per row the hot and cold structs, the page
    /// list and the prompt, and the prefix index entries.
    pub fn metadata_bytes(&self) -> usize {
        self.requests.capacity_bytes()
            + self.pages.capacity_bytes()
            + self.events.capacity_bytes()
            + self.prefix.metadata_bytes()
            + self.host.as_ref().map_or(0, |h| h.capacity_bytes())
    }

    pub fn is_open(&self, handle: i64) -> bool {
        self.requests.resolve(handle).is_ok()
    }

    pub fn length(&self, handle: i64) -> Result<usize> {
        Ok(self.requests.len(self.requests.resolve(handle)?))
    }

    pub fn lengths(&self, handles: &[i64]) -> Result<Vec<i64>> {
        let mut out = Vec::new();
        reserve(&mut out, handles.len(), "lengths")?;
        for &h in handles {
            out.push(self.requests.len(self.requests.resolve(h)?) as i64);
        }
        Ok(out)
    }

    /// Rows (request-to-token table indices) of open handles.
    pub fn rows(&self, handles: &[i64]) -> Result<Vec<i64>> {
        let mut out = Vec::new();
        reserve(&mut out, handles.len(), "rows")?;
        for &h in handles {
            out.push(self.requests.resolve(h)? as i64);
        }
        Ok(out)
    }

    /// Row of an open request on the device: `RequestSwappedOut` for a
    /// swapped-out one (its pages are not all device pages).
    fn resolve_resident(&self, handle: i64) -> Result<usize> {
        let row = self.requests.resolve(handle)?;
        self.requests.check_resident(row, handle)?;
        Ok(row)
    }

    /// Every slot of the request, in token order.
    ///
    /// Errors: `InvalidHandle`, `RequestSwappedOut`.
    pub fn slots(&self, handle: i64) -> Result<Vec<i64>> {
        let row = self.resolve_resident(handle)?;
        let len = self.requests.len(row);
        let mut out = Vec::new();
        reserve(&mut out, len, "slots")?;
        for (s, m) in self.slot_runs(row, len) {
            out.extend((s..s + m).map(|x| x as i64));
        }
        Ok(out)
    }

    /// Writes each request's slots into its row of a caller's
    /// request-to-token table: `table[row, 0..len]`. For the calls that give
    /// a request slots it did not extend into (a prefix hit, a fork), so an
    /// engine's table is complete without reading `slots` back. Checks every
    /// handle and the table's extent before writing anything.
    pub fn fill_table(&self, handles: &[i64], table: &mut SlotTable<'_>) -> Result<()> {
        self.check_table(table)?;
        for &h in handles {
            self.resolve_resident(h)?;
        }
        let ps = self.geo.page_size;
        for &h in handles {
            let row = handle_row(h) as usize;
            let len = self.requests.len(row);
            if ps == 1 {
                // Every page is one slot: the row is the page list itself,
                // one flat copy instead of a run per token.
                table.write_pages(row, self.row_pages_of(row));
                continue;
            }
            for (k, (s, m)) in self.slot_runs(row, len).enumerate() {
                table.write_page(row, k * ps, s, m);
            }
        }
        Ok(())
    }

    /// The request's device pages, in token order.
    ///
    /// Errors: `InvalidHandle`, `RequestSwappedOut`.
    pub fn pages(&self, handle: i64) -> Result<Vec<i32>> {
        let row = self.resolve_resident(handle)?;
        Ok(self.row_pages_of(row).iter().map(|&p| p as i32).collect())
    }

    /// Known token ids of the request (positions `0..n` for its known
    /// prefix), swapped out or not.
    pub fn known_tokens(&self, handle: i64) -> Result<Vec<i32>> {
        let row = self.requests.resolve(handle)?;
        let n = self.requests.known_len(row);
        let mut out = Vec::new();
        reserve(&mut out, n, "tokens")?;
        if self.requests.is_swapped(row) {
            let ps = self.geo.page_size;
            for (k, &loc) in self.row_pages_of(row).iter().enumerate() {
                let m = ps.min(n.saturating_sub(k * ps));
                if m == 0 {
                    break;
                }
                out.extend_from_slice(&self.prefix.location_tokens(loc)[..m]);
            }
            return Ok(out);
        }
        for (s, m) in self.slot_runs(row, n) {
            out.extend_from_slice(self.prefix.slot_tokens(s, m));
        }
        Ok(out)
    }

    pub fn page_table(&self, handles: &[i64]) -> Result<PageTable> {
        let mut total = 0usize;
        for &h in handles {
            total += self.row_pages_of(self.resolve_resident(h)?).len();
        }
        if total > i32::MAX as usize {
            // Only reachable by naming the same requests over and over.
            return Err(PoolError::InvalidArgument(format!(
                "page table would hold {total} entries, past int32 indptr range"
            )));
        }
        let mut t = PageTable::default();
        reserve(&mut t.indptr, handles.len() + 1, "page table")?;
        reserve(&mut t.indices, total, "page table")?;
        reserve(&mut t.last_page_len, handles.len(), "page table")?;
        t.indptr.push(0);
        for &h in handles {
            let row = handle_row(h) as usize;
            let len = self.requests.len(row);
            t.indices
                .extend(self.row_pages_of(row).iter().map(|&p| p as i32));
            t.indptr.push(t.indices.len() as i32);
            let last = if len == 0 {
                0
            } else {
                (len - 1) % self.geo.page_size + 1
            };
            t.last_page_len.push(last as i32);
        }
        Ok(t)
    }

    /// `table` can take any slot of this pool at any request position.
    /// `extend_into_table` and `fill_table` check this themselves; a caller
    /// that opens requests (`open_with_prefix`, `fork`) and then fills their
    /// rows checks first, so that a bad table fails before anything opens.
    pub fn check_table(&self, table: &SlotTable<'_>) -> Result<()> {
        if self.num_slots() > i32::MAX as usize + 1 {
            return Err(PoolError::InvalidArgument(format!(
                "num_slots = {} does not fit an int32 slot table",
                self.num_slots()
            )));
        }
        table.check_extent(self.requests.capacity(), self.geo.max_context_len)
    }
}
