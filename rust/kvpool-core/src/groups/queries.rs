//! Reading a grouped pool: the request table (the anchor's), each group's
//! slots, pages, tables, state slots and copies, and the counters per group
//! and pool-wide. Each validates its handles and group.

use super::{Group, GroupSpec, GroupedAllocator};
use crate::allocator::queries::PageTable;
use crate::error::{PoolError, Result};
use crate::events::{Drained, EventSink, Events};
use crate::handle::handle_row;
use crate::memory::reserve;
use crate::table::SlotTable;

impl GroupedAllocator {
    // ---- shape ----

    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    /// Group `g`'s spec (`checkpoint_every` resolved).
    pub fn group_spec(&self, g: usize) -> Result<GroupSpec> {
        Ok(match self.group(g)? {
            Group::State(e) => GroupSpec::state(self.specs[g].num_pages, e.every),
            _ => self.specs[g],
        })
    }

    /// The group that carries the anchor chain, None for a token-only
    /// anchor (module docs).
    pub fn anchor_group(&self) -> Option<usize> {
        self.anchor_group
    }

    /// The anchor chain's page size (the gcd of the groups' page sizes).
    pub fn anchor_page_size(&self) -> usize {
        self.a
    }

    /// Pages of the token-only anchor (the anchor group's otherwise).
    pub fn anchor_pages(&self) -> usize {
        self.anchor.num_pages()
    }

    /// Prefix hits are multiples of this: the lcm of every page size.
    pub fn hit_step(&self) -> usize {
        self.step
    }

    pub fn max_requests(&self) -> usize {
        self.anchor.max_requests()
    }

    pub fn max_context_len(&self) -> usize {
        self.anchor.max_context_len()
    }

    pub fn hash_seed(&self) -> u64 {
        self.anchor.hash_seed()
    }

    // ---- the request table ----

    pub fn open_requests(&self) -> usize {
        self.anchor.open_requests()
    }

    pub fn is_open(&self, handle: i64) -> bool {
        self.anchor.is_open(handle)
    }

    pub fn length(&self, handle: i64) -> Result<usize> {
        self.anchor.length(handle)
    }

    pub fn lengths(&self, handles: &[i64]) -> Result<Vec<i64>> {
        self.anchor.lengths(handles)
    }

    /// Rows (request-to-token table indices) of open handles: the same row
    /// in every group's table.
    pub fn rows(&self, handles: &[i64]) -> Result<Vec<i64>> {
        self.anchor.rows(handles)
    }

    pub fn known_tokens(&self, handle: i64) -> Result<Vec<i32>> {
        self.anchor.known_tokens(handle)
    }

    /// Prompt tokens served from the cache by `open_with_prefix`.
    pub fn hit_tokens(&self) -> u64 {
        self.anchor.hit_tokens()
    }

    pub fn miss_tokens(&self) -> u64 {
        self.anchor.miss_tokens()
    }

    /// Takes back the hit and miss tokens of opens the caller undid (see
    /// `SlotAllocator::uncount_opens`).
    pub fn uncount_opens(&mut self, hit: u64, miss: u64) {
        self.anchor.uncount_opens(hit, miss, 0);
    }

    /// The anchor chain's KV events (Stored/Removed/Cleared of its pages):
    /// what a router needs to know which prefixes this pool can serve.
    pub fn take_events(&mut self) -> Events {
        self.anchor.take_events()
    }

    /// The anchor chain's [`crate::SlotAllocator::pending_events`].
    pub fn pending_events(&self) -> (usize, usize) {
        self.anchor.pending_events()
    }

    /// The anchor chain's [`crate::SlotAllocator::take_events_into`].
    pub fn take_events_into(&mut self, out: EventSink<'_>) -> Drained {
        self.anchor.take_events_into(out)
    }

    pub fn dropped_events(&self) -> u64 {
        self.anchor.dropped_events()
    }

    /// Whether the anchor chain's KV events are recorded (`Options::kv_events`).
    pub fn kv_events(&self) -> bool {
        self.anchor.kv_events()
    }

    // ---- per group ----

    /// A page group's engine, or why `g` has no pages.
    fn paged(&self, g: usize) -> Result<Option<&super::paged::PageEngine>> {
        match self.group(g)? {
            Group::Anchor => Ok(None),
            Group::Pages(e) => Ok(Some(e)),
            Group::State(_) => Err(PoolError::InvalidArgument(format!(
                "group {g} is a state group: it has state slots (state_slots), not pages"
            ))),
        }
    }

    /// Every slot of the request in group `g`, in token order; positions a
    /// sliding window released read as the null page's slots
    /// (`position % page_size`, inside the reserved page 0).
    ///
    /// Errors: `InvalidHandle`; `InvalidArgument` (no such page group).
    pub fn slots(&self, g: usize, handle: i64) -> Result<Vec<i64>> {
        match self.paged(g)? {
            None => self.anchor.slots(handle),
            Some(e) => {
                let row = self.anchor.group_resolve(handle)?;
                let mut out = Vec::new();
                e.slots(row, self.anchor.length(handle)?, &mut out)?;
                Ok(out)
            }
        }
    }

    /// The request's page list in group `g`, in token order (0 where a
    /// sliding window released the page).
    pub fn pages(&self, g: usize, handle: i64) -> Result<Vec<i32>> {
        match self.paged(g)? {
            None => self.anchor.pages(handle),
            Some(e) => {
                let row = self.anchor.group_resolve(handle)?;
                let len = self.anchor.length(handle)?;
                let list = e.list(row, e.geo.pages_for(len));
                let mut out = Vec::new();
                reserve(&mut out, list.len(), "pages")?;
                out.extend(list.iter().map(|&p| p as i32));
                Ok(out)
            }
        }
    }

    /// FlashInfer's CSR page table of a batch in group `g`: each request's
    /// held pages only (a sliding group's window), `last_page_len` as for
    /// an ungrouped pool. The kernel's sliding-window mask counts back
    /// from the last position, so dropping whole leading pages changes
    /// nothing it computes.
    pub fn page_table(&self, g: usize, handles: &[i64]) -> Result<PageTable> {
        let Some(e) = self.paged(g)? else {
            return self.anchor.page_table(handles);
        };
        let mut lens = Vec::new();
        reserve(&mut lens, handles.len(), "page table")?;
        let mut total = 0usize;
        for &h in handles {
            let row = self.anchor.group_resolve(h)?;
            let len = self.anchor.length(h)?;
            total += e.held(row, len).len();
            lens.push(len);
        }
        if total > i32::MAX as usize {
            return Err(PoolError::InvalidArgument(format!(
                "page table would hold {total} entries, past int32 indptr range"
            )));
        }
        let mut t = PageTable::default();
        reserve(&mut t.indptr, handles.len() + 1, "page table")?;
        reserve(&mut t.indices, total, "page table")?;
        reserve(&mut t.last_page_len, handles.len(), "page table")?;
        t.indptr.push(0);
        let ps = e.page_size();
        for (&h, &len) in handles.iter().zip(&lens) {
            let row = handle_row(h) as usize;
            t.indices.extend(e.held(row, len).iter().map(|&p| p as i32));
            t.indptr.push(t.indices.len() as i32);
            t.last_page_len.push(if len == 0 {
                0
            } else {
                ((len - 1) % ps + 1) as i32
            });
        }
        Ok(t)
    }

    /// Writes each request's slots in group `g` into its row of `table`
    /// (`[max_requests, max_context_len]`), released positions as the null
    /// page's slots: for the calls that give a request slots it did not
    /// extend into (a prefix hit, a fork). Checks everything first.
    pub fn fill_table(&self, g: usize, handles: &[i64], table: &mut SlotTable<'_>) -> Result<()> {
        let Some(e) = self.paged(g)? else {
            return self.anchor.fill_table(handles, table);
        };
        table.check_extent(self.max_requests(), self.max_context_len())?;
        for &h in handles {
            self.anchor.group_resolve(h)?;
        }
        for &h in handles {
            e.fill_table(handle_row(h) as usize, self.anchor.length(h)?, table);
        }
        Ok(())
    }

    /// Each request's live state slot in state group `g`.
    ///
    /// Errors: `InvalidHandle`; `InvalidArgument` (not a state group).
    pub fn state_slots(&self, g: usize, handles: &[i64]) -> Result<Vec<i64>> {
        let Group::State(e) = self.group(g)? else {
            return Err(PoolError::InvalidArgument(format!(
                "group {g} is a {} group: it has pages, not state slots",
                self.specs[g].kind.name()
            )));
        };
        let mut out = Vec::new();
        reserve(&mut out, handles.len(), "state slots")?;
        for &h in handles {
            out.push(e.live(self.anchor.group_resolve(h)?) as i64);
        }
        Ok(out)
    }

    /// Drains group `g`'s queued copies, `(src, dst)`: slot pairs of a page
    /// group (copy-on-write, as `SlotAllocator::take_copies`), state slot
    /// pairs of a state group, where a source of -1 means "zero the
    /// destination". Run them before the group's next write. A state
    /// group's batch never reads a slot it writes, so it may run as one
    /// parallel copy.
    pub fn take_copies(&mut self, g: usize) -> Result<(Vec<i64>, Vec<i64>)> {
        self.group(g)?;
        Ok(match &mut self.groups[g] {
            Group::Anchor => self.anchor.take_copies(),
            Group::Pages(e) => e.pages.take_copies_from(0, e.page_size()),
            Group::State(e) => e.take_copies(),
        })
    }

    /// Copies queued in group `g` and not taken (slot pairs of a page
    /// group, slot copies of a state group).
    pub fn pending_copies(&self, g: usize) -> Result<usize> {
        Ok(match self.group(g)? {
            Group::Anchor => self.anchor.pending_copies(),
            Group::Pages(e) => e.pages.pending_copies(),
            Group::State(e) => e.pending_copies(),
        })
    }

    // ---- counters ----

    /// Group `g`'s pool: `(capacity, free + evictable, registered,
    /// evictable)` pages (state slots for a state group).
    fn counts(&self, g: usize) -> Result<(usize, usize, usize, usize)> {
        Ok(match self.group(g)? {
            Group::Anchor => (
                self.anchor.capacity_pages(),
                self.anchor.free_pages(),
                self.anchor.cached_pages(),
                self.anchor.evictable_pages(),
            ),
            Group::Pages(e) => (
                e.geo.num_pages - 1,
                e.pages.available(),
                e.map.len(),
                e.pages.cached(),
            ),
            Group::State(e) => (
                self.specs[g].num_pages - 1,
                e.available(),
                e.map.len(),
                e.slots.cached(),
            ),
        })
    }

    /// Pages (state slots) of group `g` a request can ever hold: num_pages - 1.
    pub fn capacity_pages(&self, g: usize) -> Result<usize> {
        Ok(self.counts(g)?.0)
    }

    /// Pages an extend of group `g` can take now: FREE + CACHED.
    pub fn free_pages(&self, g: usize) -> Result<usize> {
        Ok(self.counts(g)?.1)
    }

    /// HELD pages of group `g`.
    pub fn used_pages(&self, g: usize) -> Result<usize> {
        let (cap, free, _, _) = self.counts(g)?;
        Ok(cap - free)
    }

    /// Registered pages (checkpoints) of group `g`, HELD or CACHED.
    pub fn cached_pages(&self, g: usize) -> Result<usize> {
        Ok(self.counts(g)?.2)
    }

    /// CACHED pages (checkpoints) of group `g`: evicted when needed.
    pub fn evictable_pages(&self, g: usize) -> Result<usize> {
        Ok(self.counts(g)?.3)
    }

    /// Tokens group `g` can still take if every new token started a page
    /// (a lower bound, counting evictable pages); for a state group, the
    /// state slots it can still hand out.
    pub fn group_admissible_tokens(&self, g: usize) -> Result<usize> {
        let (_, free, _, _) = self.counts(g)?;
        Ok(free * self.specs[g].page_size)
    }

    /// The pool-wide figure for growing requests: the tokens every page
    /// group (and a token-only anchor) can still take, the least of them.
    /// A request of `n` new tokens fits if `n <= admissible_tokens()`.
    pub fn admissible_tokens(&self) -> usize {
        let mut n = match self.anchor_group {
            Some(_) => usize::MAX,
            None => self.anchor.admissible_tokens(),
        };
        for (g, e) in self.groups.iter().enumerate() {
            if !matches!(e, Group::State(_)) {
                n = n.min(self.group_admissible_tokens(g).unwrap_or(0));
            }
        }
        n
    }

    /// The pool-wide figure for opening requests: how many more can open
    /// now (free rows, and a free or evictable slot in every state group).
    pub fn admissible_requests(&self) -> usize {
        let mut n = self.anchor.group_free_rows();
        for e in self.groups.iter() {
            if let Group::State(e) = e {
                n = n.min(e.available());
            }
        }
        n
    }

    /// Heap bytes of all bookkeeping: the anchor's, every group's and the
    /// rows' registration ids.
    pub fn metadata_bytes(&self) -> usize {
        let groups: usize = self
            .groups
            .iter()
            .map(|g| match g {
                Group::Anchor => 0,
                Group::Pages(e) => e.capacity_bytes(),
                Group::State(e) => e.capacity_bytes(),
            })
            .sum();
        let regs: usize = self.regs.iter().map(|r| r.capacity() * 8).sum();
        self.anchor.metadata_bytes() + groups + regs + self.regs.capacity() * 24
    }
}
