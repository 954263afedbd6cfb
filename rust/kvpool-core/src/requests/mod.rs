//! The requests: one row per open request, its page list, its prompt and
//! prefix-chain progress, the free-row stack and the handle generations.
//!
//! Everything here is per request; the pages a list names belong to the
//! page pool, whose holder counts the allocator keeps in step with the
//! lists. Handles are made and checked here (`handle.rs` has the format).

mod check;
mod decode;
mod handles;
mod lifecycle;
pub(crate) mod row;

use crate::error::{PoolError, Result};
use crate::geometry::Geometry;
use crate::handle::next_generation;
use crate::memory::{fault_in, filled_vec, reserve, zeroed_vec};
use crate::prefix::tip::ChainTip;
use row::{Row, RowCold, OPEN, SLOW, SWAPPED};

/// A request's prefix-chain progress (see `RowCold`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Chain {
    /// Leading full pages whose chain hash is computed.
    pub(crate) pages: usize,
    /// The entry the last of them matched (the root when none).
    pub(crate) tip: ChainTip,
    /// Nothing past `pages` can be registered (a collision).
    pub(crate) broken: bool,
    /// The chain passes through another request's entry (`RowCold::foreign`).
    pub(crate) foreign: bool,
    /// The index's `removals` when the chain was last walked.
    pub(crate) checked: u32,
}

#[derive(Debug, Clone)]
pub(crate) struct Requests {
    geo: Geometry,
    /// Each row's stride in `page_lists`: the pages a request of
    /// max_context_len tokens holds, rounded up to a cache line plus one more
    /// line, so that rows never sit a power of two apart (a 2^k stride maps
    /// every row's list end to the same cache sets, and a decode step that
    /// touches 256 rows then misses L1 and L2 on each).
    row_pages: usize,
    /// Hot per-row state, 16 bytes: what a decode step reads and writes.
    rows: Vec<Row>,
    /// Cold per-row state: prompt tokens and prefix-chain progress.
    cold: Vec<RowCold>,
    /// Per row: positions `0..known_len` have known token ids (in the prefix
    /// index's slot token array). Apart from the cold rows because a decode
    /// step with token ids updates it for every request: 4 bytes a row stay
    /// in L1.
    known_len: Vec<u32>,
    /// Page lists of all rows, `[max_requests, row_pages]`, row-major.
    page_lists: Vec<u32>,
    /// Closed rows; the top (end) is opened next.
    free_rows: Vec<u32>,
    /// Rows retired because their generation would wrap to its base.
    retired_rows: usize,
    generation_base: u32,
    /// Generation of each row's first request (the base, except in tests).
    generation_start: u32,
    /// Stamp of the current batch (see `begin_batch`).
    epoch: u32,
    open_count: usize,
    /// extend's list of slow-path requests; capacity max_requests, reserved
    /// at construction (a valid batch names each open request at most once).
    slow_scratch: Vec<u32>,
}

impl Requests {
    /// Rows for `max_requests` requests of up to `geo.max_context_len`
    /// tokens, all reserved now (the metadata's worst case). With
    /// `fault_in_lists`, the page lists are mapped now rather than at the
    /// first burst of requests (see `memory::fault_in`).
    pub(crate) fn new(
        geo: Geometry,
        max_requests: usize,
        generation_base: u32,
        generation_start: u32,
        epoch: u32,
        fault_in_lists: bool,
    ) -> Result<Self> {
        let row_pages = geo.max_context_len.div_ceil(geo.page_size).div_ceil(16) * 16 + 16;
        let Some(list_len) = max_requests.checked_mul(row_pages) else {
            return Err(PoolError::InvalidArgument(format!(
                "max_requests * pages per request = {max_requests} * {row_pages} overflows"
            )));
        };
        let mut page_lists = zeroed_vec::<u32>(list_len, "request page lists")?;
        if fault_in_lists {
            fault_in(&mut page_lists, usize::MAX);
        }
        let rows = filled_vec(max_requests, Row::default(), "request rows")?;
        let cold = filled_vec(max_requests, RowCold::default(), "request rows")?;
        let known_len = zeroed_vec(max_requests, "request rows")?;
        let mut free_rows = Vec::new();
        reserve(&mut free_rows, max_requests, "free row stack")?;
        free_rows.extend((0..max_requests as u32).rev());
        let mut slow_scratch = Vec::new();
        reserve(&mut slow_scratch, max_requests, "extend scratch")?;
        Ok(Requests {
            geo,
            row_pages,
            rows,
            cold,
            known_len,
            page_lists,
            free_rows,
            retired_rows: 0,
            generation_base,
            generation_start,
            epoch,
            open_count: 0,
            slow_scratch,
        })
    }

    /// Rows, open or not (`max_requests`).
    #[inline]
    pub(crate) fn capacity(&self) -> usize {
        self.rows.len()
    }

    #[inline]
    pub(crate) fn open_count(&self) -> usize {
        self.open_count
    }

    // ---- a row's length and pages ----

    #[inline]
    pub(crate) fn len(&self, row: usize) -> usize {
        self.rows[row].len as usize
    }

    /// `(length, last page, whether the next extend takes the slow path)`.
    #[inline]
    pub(crate) fn tail(&self, row: usize) -> (usize, u32, bool) {
        let r = self.rows[row];
        (r.len as usize, r.last & !SLOW, r.last & SLOW != 0)
    }

    /// Grows `row` inside its own last page (the fast path: no page moves).
    #[inline]
    pub(crate) fn set_len(&mut self, row: usize, len: usize) {
        self.rows[row].len = len as u32;
    }

    /// Sets `row`'s length and last page, with the slow path off.
    #[inline]
    pub(crate) fn set_tail(&mut self, row: usize, len: usize, last: u32) {
        self.rows[row].len = len as u32;
        self.rows[row].last = last;
    }

    /// The next extend of `row` must take the slow path.
    #[inline]
    pub(crate) fn mark_slow(&mut self, row: usize) {
        self.rows[row].last |= SLOW;
    }

    /// Whether `row`'s request is swapped out (`row::SWAPPED`).
    #[inline]
    pub(crate) fn is_swapped(&self, row: usize) -> bool {
        self.rows[row].last == SWAPPED
    }

    /// Marks `row`'s request swapped out (its page list names where each
    /// page is); `set_tail` puts it back on the device.
    #[inline]
    pub(crate) fn set_swapped(&mut self, row: usize) {
        self.rows[row].last = SWAPPED;
    }

    /// `RequestSwappedOut` if `row` (of `handle`) is swapped out.
    #[inline]
    pub(crate) fn check_resident(&self, row: usize, handle: i64) -> Result<()> {
        if self.is_swapped(row) {
            return Err(PoolError::RequestSwappedOut { handle });
        }
        Ok(())
    }

    /// The first `n` entries of `row`'s page list.
    #[inline]
    pub(crate) fn pages(&self, row: usize, n: usize) -> &[u32] {
        let base = row * self.row_pages;
        &self.page_lists[base..base + n]
    }

    /// The pages of `row`'s length, in token order.
    #[inline]
    pub(crate) fn held_pages(&self, row: usize) -> &[u32] {
        self.pages(row, self.geo.pages_for(self.rows[row].len as usize))
    }

    /// Entries `from..from + n` of `row`'s page list, to fill.
    #[inline]
    pub(crate) fn pages_mut(&mut self, row: usize, from: usize, n: usize) -> &mut [u32] {
        let base = row * self.row_pages + from;
        &mut self.page_lists[base..base + n]
    }

    #[inline]
    pub(crate) fn page(&self, row: usize, k: usize) -> u32 {
        self.page_lists[row * self.row_pages + k]
    }

    #[inline]
    pub(crate) fn set_page(&mut self, row: usize, k: usize, p: u32) {
        self.page_lists[row * self.row_pages + k] = p;
    }

    // ---- prompt, known tokens, salt and chain ----

    #[inline]
    pub(crate) fn prompt(&self, row: usize) -> &[i32] {
        &self.cold[row].prompt
    }

    /// A rollback into the prompt: what follows need not be the prompt.
    pub(crate) fn truncate_prompt(&mut self, row: usize, len: usize) {
        self.cold[row].prompt.truncate(len);
    }

    /// Takes `row`'s prompt buffer (a free row's means nothing) to fill
    /// and put back with `put_prompt`.
    pub(crate) fn take_prompt(&mut self, row: usize) -> Vec<i32> {
        std::mem::take(&mut self.cold[row].prompt)
    }

    pub(crate) fn put_prompt(&mut self, row: usize, prompt: Vec<i32>) {
        self.cold[row].prompt = prompt;
    }

    /// Copies `prompt` into `row`'s buffer (see `RowCold::set_prompt`).
    pub(crate) fn set_prompt(&mut self, row: usize, prompt: Vec<i32>) {
        self.cold[row].set_prompt(prompt);
    }

    #[inline]
    pub(crate) fn known_len(&self, row: usize) -> usize {
        self.known_len[row] as usize
    }

    /// Positions `start..start + n` got known token ids: the known prefix
    /// grows if it reached `start`.
    #[inline]
    pub(crate) fn record_known(&mut self, row: usize, start: usize, n: usize) {
        let known_len = &mut self.known_len[row];
        if *known_len as usize == start {
            *known_len = (start + n) as u32;
        }
    }

    #[inline]
    pub(crate) fn salt(&self, row: usize) -> i64 {
        self.cold[row].salt
    }

    #[inline]
    pub(crate) fn chain(&self, row: usize) -> Chain {
        let c = &self.cold[row];
        Chain {
            pages: c.hashed_pages as usize,
            tip: c.tip,
            broken: c.chain_broken,
            foreign: c.foreign,
            checked: c.checked,
        }
    }

    /// The chain now reaches `pages` pages ending at `tip`, walked when the
    /// index had made `checked` removals; `broken` stops it there for good;
    /// `foreign`: a page just chained is a duplicate of another's entry.
    pub(crate) fn set_chain(
        &mut self,
        row: usize,
        pages: usize,
        tip: ChainTip,
        broken: bool,
        foreign: bool,
        checked: u32,
    ) {
        let c = &mut self.cold[row];
        c.tip = tip;
        c.hashed_pages = pages as u32;
        c.chain_broken |= broken;
        c.foreign |= foreign;
        c.checked = checked;
    }

    /// The chain was walked whole when the index had made `checked` removals.
    pub(crate) fn set_checked(&mut self, row: usize, checked: u32) {
        self.cold[row].checked = checked;
    }

    /// Resumes the chain at `pages` pages ending at `tip`, a registered
    /// page of the row's own salt; `foreign`: whether those pages may
    /// include a duplicate of another request's entry.
    pub(crate) fn resume_chain(&mut self, row: usize, pages: usize, tip: ChainTip, foreign: bool) {
        let c = &mut self.cold[row];
        c.hashed_pages = pages as u32;
        c.tip = tip;
        c.chain_broken = false;
        c.foreign = foreign;
    }

    pub(crate) fn restart_chain(&mut self, row: usize) {
        self.cold[row].restart_chain();
    }

    /// Every row's chain starts over (the index was cleared).
    pub(crate) fn restart_chains(&mut self) {
        for c in self.cold.iter_mut() {
            c.restart_chain();
        }
    }

    /// Whether no other request or cache entry can hold `row`'s pages.
    #[inline]
    pub(crate) fn is_exclusive(&self, row: usize) -> bool {
        self.cold[row].exclusive
    }

    /// Another holder (a fork, the cache) may now share `row`'s pages.
    pub(crate) fn set_shared(&mut self, row: usize) {
        self.cold[row].exclusive = false;
    }

    /// No position at or past `len` has a known token id any more.
    pub(crate) fn truncate_known(&mut self, row: usize, len: usize) {
        self.known_len[row] = self.known_len[row].min(len as u32);
    }

    // ---- extend's scratch ----

    pub(crate) fn take_slow_scratch(&mut self) -> Vec<u32> {
        let mut s = std::mem::take(&mut self.slow_scratch);
        s.clear();
        s
    }

    pub(crate) fn put_slow_scratch(&mut self, s: Vec<u32>) {
        self.slow_scratch = s;
    }

    /// Heap bytes (capacities): rows, page lists, prompts, stacks.
    pub(crate) fn capacity_bytes(&self) -> usize {
        let u32s =
            self.free_rows.capacity() + self.known_len.capacity() + self.page_lists.capacity();
        let prompts: usize = self.cold.iter().map(|c| c.prompt.capacity() * 4).sum();
        u32s * 4
            + self.rows.capacity() * std::mem::size_of::<Row>()
            + self.cold.capacity() * std::mem::size_of::<RowCold>()
            + prompts
    }
}

/// A closed row whose next generation would be its allocator's base.
fn row_retired(base: u32, generation: u32) -> bool {
    generation != 0 && generation & OPEN == 0 && next_generation(generation) == base
}

#[cfg(any(test, feature = "test-hooks"))]
impl Requests {
    /// Test only: every closed row's last generation becomes `g`; refused
    /// while a request is open (its handle would stop resolving).
    pub(crate) fn set_generations_for_tests(&mut self, g: u32) -> Result<()> {
        if self.open_count > 0 {
            return Err(PoolError::InvalidArgument(
                "close every request before moving generations".into(),
            ));
        }
        for r in self.rows.iter_mut() {
            r.generation = g & !OPEN;
        }
        Ok(())
    }

    /// Test only: the batch-stamp epoch.
    pub(crate) fn set_epoch_for_tests(&mut self, e: u32) {
        self.epoch = e;
    }
}
