//! The allocator state, construction, handle resolution and open. Extending
//! lives in `extend.rs`, freeing in `release.rs`, page states in `pages.rs`,
//! the prefix cache in `prefix.rs` / `index.rs`, fork in `fork.rs`, queries
//! in `queries.rs`, invariants in `check.rs`.

use crate::copies::CopyQueue;
use crate::error::{HandleProblem, PoolError, Result};
use crate::events::EventLog;
use crate::handle::{
    handle_generation, handle_row, make_handle, mix64, next_generation, random_u64, steps_from,
    MAX_GENERATION,
};
use crate::index::PrefixIndex;
use crate::memory::{fault_in, filled_vec, reserve, zeroed_vec, MAX_CONTEXT_LEN, MAX_REQUESTS};
use crate::rows::{Row, RowCold, OPEN};

/// Per-request token counts (or target lengths, or salts) of a batch call:
/// one value broadcast to every handle, or one value per handle.
#[derive(Debug, Clone, Copy)]
pub enum Counts<'a> {
    Each(i64),
    PerRequest(&'a [i64]),
}

impl Counts<'_> {
    #[inline]
    pub fn get(&self, i: usize) -> i64 {
        match self {
            Counts::Each(c) => *c,
            Counts::PerRequest(v) => v[i],
        }
    }

    pub(crate) fn check_len(&self, what: &str, n: usize) -> Result<()> {
        match self {
            Counts::PerRequest(v) if v.len() != n => Err(PoolError::InvalidArgument(format!(
                "{what} has {} entries but there are {n} requests; pass one per request or a single int",
                v.len()
            ))),
            _ => Ok(()),
        }
    }
}

/// Construction options beyond the four sizes.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Seed of the prefix hash. Random per pool when None; ranks and routers
    /// that must agree on page hashes pass the same seed.
    pub hash_seed: Option<u64>,
    /// Seed of the handle generations. Random per pool when None; a seed makes
    /// the handles a pure function of the seed and the call sequence, so
    /// tensor-parallel ranks that make the same calls get the same handles.
    /// Pools with different seeds still tell each other's handles apart
    /// (about 1 in 2^31), as with random bases.
    pub handle_seed: Option<u64>,
    /// Record Stored/Removed/Cleared events for `take_events`. The caller
    /// drains them; past max(num_pages, 65536) undrained events the backlog
    /// becomes one Cleared event (`dropped_events` counts what went).
    pub kv_events: bool,
    /// Test only: keep just this many low bits of every page hash (0 = all
    /// 128), to force collisions. Not public API.
    #[doc(hidden)]
    pub weak_hash_bits: u32,
    /// Test only: generation of each row's first request (random otherwise).
    #[doc(hidden)]
    pub generation_base: Option<u32>,
    /// Test only: generation of each row's first request when it should
    /// differ from the base (to reach a row's retirement quickly).
    #[doc(hidden)]
    pub generation_start: Option<u32>,
    /// Benchmark only: accept a key's prefix hit without comparing its
    /// token ids (the salt and parent are still checked), to measure what
    /// the compare costs. Unsafe against collisions; not public API.
    #[doc(hidden)]
    pub skip_hit_verification: bool,
    /// Test only: starting value of the batch-stamp epoch.
    #[doc(hidden)]
    pub epoch_start: u32,
    /// Leave the request page lists and slot token ids to be mapped on first
    /// use instead of at construction: for a pool sized far beyond what it
    /// will hold, whose first requests may pay page faults (see
    /// `memory::fault_in`).
    pub lazy_metadata: bool,
}

impl Options {
    /// Defaults: random hash seed, events on.
    pub fn new() -> Self {
        Options {
            kv_events: true,
            ..Default::default()
        }
    }
}

#[derive(Debug, Clone)]
pub struct SlotAllocator {
    pub(crate) page_size: usize,
    /// log2(page_size) when it is a power of two: a shift instead of a
    /// 20-80 cycle integer division on the per-token path.
    pub(crate) page_shift: Option<u32>,
    pub(crate) num_pages: usize,
    pub(crate) max_requests: usize,
    pub(crate) max_context_len: usize,
    /// Each row's stride in `page_lists`: the pages a request of
    /// max_context_len tokens holds, rounded up to a cache line plus one more
    /// line, so that rows never sit a power of two apart (a 2^k stride maps
    /// every row's list end to the same cache sets, and a decode step that
    /// touches 256 rows then misses L1 and L2 on each: 3x slower at page 1).
    pub(crate) row_pages: usize,
    /// Hot per-row state, 16 bytes: what a decode step reads and writes.
    pub(crate) rows: Vec<Row>,
    /// Cold per-row state: prompt tokens and prefix-chain progress.
    pub(crate) cold: Vec<RowCold>,
    /// Per row: positions `0..known_len` have known token ids (in the slot
    /// token array). Apart from the cold rows because a decode step with
    /// token ids updates it for every request: 4 bytes a row stay in L1.
    pub(crate) known_len: Vec<u32>,
    /// Page lists of all rows, `[max_requests, row_pages]`, row-major.
    pub(crate) page_lists: Vec<u32>,
    /// FREE pages; the top (end) is handed out next.
    pub(crate) free_pages: Vec<u32>,
    /// The prefix index, the CACHED pages' LRU list and per-slot token ids.
    pub(crate) index: PrefixIndex,
    /// Queued copy-on-write copies and the source pages they hold.
    pub(crate) copies: CopyQueue,
    pub(crate) events: EventLog,
    pub(crate) hit_tokens: u64,
    pub(crate) miss_tokens: u64,
    /// Closed rows; the top (end) is opened next.
    pub(crate) free_rows: Vec<u32>,
    /// Rows retired because their generation would wrap to its base.
    pub(crate) retired_rows: usize,
    pub(crate) generation_base: u32,
    /// Generation of each row's first request (the base, except in tests).
    pub(crate) generation_start: u32,
    /// Stamp of the current batch (see `begin_batch`).
    pub(crate) epoch: u32,
    pub(crate) open_count: usize,
    /// extend's list of slow-path requests; capacity max_requests, reserved
    /// at construction (a valid batch names each open request at most once).
    pub(crate) slow_scratch: Vec<u32>,
}

impl SlotAllocator {
    /// `num_pages` includes the reserved page 0, so `num_pages - 1` pages are
    /// usable. Defaults for everything else (see [`Options::new`]).
    pub fn new(
        num_pages: usize,
        page_size: usize,
        max_requests: usize,
        max_context_len: usize,
    ) -> Result<Self> {
        Self::with_options(
            num_pages,
            page_size,
            max_requests,
            max_context_len,
            Options::new(),
        )
    }

    /// Like [`Self::new`] with explicit [`Options`].
    ///
    /// Errors: `InvalidArgument` for a size out of range (`max_requests` <=
    /// 2^20, `max_context_len` <= 2^28, `num_pages` <= 2^31 - 1) or metadata
    /// that cannot be allocated.
    ///
    /// Metadata, all reserved here (the exact worst case, see `metadata_bytes`):
    /// 20 bytes per page (refcount, free stack entry, registration, two LRU
    /// links), 4 per slot (token ids), and per row 16 (hot) + 96 (cold) + 4
    /// (free row stack) + 4 * (ceil(max_context_len / page_size) rounded up
    /// to 16, plus 16) (its page list). On top, while in use: the index table (16-32 bytes per
    /// page for up to 2^20 pages at the first `cache()`, doubling past that),
    /// a 64-byte entry per registered page and 4 per prompt token of each
    /// open request.
    ///
    /// The request page lists (up to 64 MiB) and the token ids of the lowest
    /// 4M slots are mapped into memory here, one write per 4 KiB, so that the
    /// pool's first burst of requests costs what later ones do instead of a
    /// page fault per 1024 pages taken (`Options::lazy_metadata` leaves them
    /// to first use). The page records stay mapped on first use: a FREE page's
    /// record is only ever read, and reads of untouched memory all hit one
    /// shared zero page, which keeps a large pool's churn cache-friendly.
    pub fn with_options(
        num_pages: usize,
        page_size: usize,
        max_requests: usize,
        max_context_len: usize,
        opts: Options,
    ) -> Result<Self> {
        let bad = |m: String| Err(PoolError::InvalidArgument(m));
        if page_size == 0 {
            return bad("page_size must be >= 1".into());
        }
        if num_pages == 0 || num_pages > i32::MAX as usize {
            return bad(format!(
                "num_pages must be in [1, {}] (it includes the reserved page 0), got {num_pages}",
                i32::MAX
            ));
        }
        let num_slots = match num_pages.checked_mul(page_size) {
            Some(s) if s <= i64::MAX as usize => s,
            _ => {
                return bad(format!(
                    "num_pages * page_size = {num_pages} * {page_size} overflows"
                ))
            }
        };
        if max_requests == 0 || max_requests > MAX_REQUESTS {
            return bad(format!(
                "max_requests must be in [1, {MAX_REQUESTS}], got {max_requests}"
            ));
        }
        if max_context_len == 0 || max_context_len > MAX_CONTEXT_LEN {
            return bad(format!(
                "max_context_len must be in [1, {MAX_CONTEXT_LEN}], got {max_context_len}"
            ));
        }
        if opts.weak_hash_bits > 128 {
            return bad("weak_hash_bits must be in [0, 128]".into());
        }
        let row_pages = max_context_len.div_ceil(page_size).div_ceil(16) * 16 + 16;
        let Some(list_len) = max_requests.checked_mul(row_pages) else {
            return bad(format!(
                "max_requests * pages per request = {max_requests} * {row_pages} overflows"
            ));
        };
        let mut page_lists = zeroed_vec::<u32>(list_len, "request page lists")?;
        if !opts.lazy_metadata {
            fault_in(&mut page_lists, usize::MAX);
        }
        let rows = filled_vec(max_requests, Row::default(), "request rows")?;
        let cold = filled_vec(max_requests, RowCold::default(), "request rows")?;
        let known_len = zeroed_vec(max_requests, "request rows")?;
        let mut free_pages = Vec::new();
        reserve(&mut free_pages, num_pages - 1, "free page stack")?;
        // Reversed so that pop() hands out 1, 2, 3, ... on a fresh pool.
        free_pages.extend((1..num_pages as u32).rev());
        let mut free_rows = Vec::new();
        reserve(&mut free_rows, max_requests, "free row stack")?;
        free_rows.extend((0..max_requests as u32).rev());
        let mut slow_scratch = Vec::new();
        reserve(&mut slow_scratch, max_requests, "extend scratch")?;
        let seed = opts.hash_seed.unwrap_or_else(random_u64);
        let mut index = PrefixIndex::new(
            num_pages,
            num_slots,
            page_size,
            seed,
            opts.weak_hash_bits,
            !opts.lazy_metadata,
        )?;
        index.skip_verify = opts.skip_hit_verification;
        let generation_base = match opts.generation_base {
            Some(g) if (1..=MAX_GENERATION).contains(&g) => g,
            Some(g) => {
                return bad(format!(
                    "generation_base must be in [1, {MAX_GENERATION}], got {g}"
                ))
            }
            None => {
                let r = opts.handle_seed.map_or_else(random_u64, mix64);
                1 + (r % (MAX_GENERATION as u64 - 1)) as u32
            }
        };
        let generation_start = match opts.generation_start {
            Some(g) if (1..=MAX_GENERATION).contains(&g) => g,
            Some(g) => {
                return bad(format!(
                    "generation_start must be in [1, {MAX_GENERATION}], got {g}"
                ))
            }
            None => generation_base,
        };
        Ok(Self {
            page_size,
            page_shift: page_size
                .is_power_of_two()
                .then(|| page_size.trailing_zeros()),
            num_pages,
            max_requests,
            max_context_len,
            row_pages,
            rows,
            cold,
            known_len,
            page_lists,
            free_pages,
            index,
            copies: CopyQueue::default(),
            events: EventLog::new(opts.kv_events, num_pages.max(crate::events::MIN_BACKLOG)),
            hit_tokens: 0,
            miss_tokens: 0,
            free_rows,
            retired_rows: 0,
            generation_base,
            generation_start,
            epoch: opts.epoch_start,
            open_count: 0,
            slow_scratch,
        })
    }

    /// Pages needed to hold `len` tokens.
    #[inline]
    pub(crate) fn pages_for(&self, len: usize) -> usize {
        match self.page_shift {
            Some(s) => (len + self.page_size - 1) >> s,
            None => len.div_ceil(self.page_size),
        }
    }

    /// Position of token `len` inside its page (0 when it starts a page).
    #[inline]
    pub(crate) fn offset_in_page(&self, len: usize) -> usize {
        match self.page_shift {
            Some(_) => len & (self.page_size - 1),
            None => len % self.page_size,
        }
    }

    /// The pages of row `row`, in token order.
    #[inline]
    pub(crate) fn row_pages_of(&self, row: usize) -> &[u32] {
        let n = self.pages_for(self.rows[row].len as usize);
        let base = row * self.row_pages;
        &self.page_lists[base..base + n]
    }

    /// The slots of `row`'s first `n` positions (`n` <= its length) as one
    /// run per page, `(first slot, count)`; run `k` starts at position
    /// `k * page_size`.
    pub(crate) fn slot_runs(
        &self,
        row: usize,
        n: usize,
    ) -> impl Iterator<Item = (usize, usize)> + '_ {
        let ps = self.page_size;
        self.row_pages_of(row)
            .iter()
            .enumerate()
            .map(move |(k, &p)| (p as usize * ps, ps.min(n.saturating_sub(k * ps))))
            .take_while(|&(_, m)| m > 0)
    }

    /// Row of an open request, or why `handle` does not name one.
    #[inline]
    pub(crate) fn resolve(&self, handle: i64) -> Result<usize> {
        let row = handle_row(handle) as usize;
        match self.rows.get(row) {
            Some(r) if handle >= 0 && r.generation == handle_generation(handle) | OPEN => Ok(row),
            _ => Err(self.why_invalid(handle)),
        }
    }

    /// Classifies a handle that `resolve` rejected (off the hot path).
    #[cold]
    pub(crate) fn why_invalid(&self, handle: i64) -> PoolError {
        let row = handle_row(handle) as usize;
        let g = handle_generation(handle);
        let problem = match self.rows.get(row) {
            Some(r) if handle >= 0 && g != 0 => {
                let cur = r.generation & !OPEN;
                let base = self.generation_base;
                if cur == 0 {
                    HandleProblem::Unknown // the row never held a request
                } else if g == cur {
                    HandleProblem::Closed
                } else if steps_from(base, g) < steps_from(base, cur) {
                    // Issued on this row before: the row was reused since.
                    HandleProblem::Stale
                } else {
                    HandleProblem::Unknown
                }
            }
            _ => HandleProblem::Unknown,
        };
        PoolError::InvalidHandle { handle, problem }
    }

    /// Starts a batch for duplicate detection with [`Self::resolve_unique`].
    pub(crate) fn begin_batch(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            // Stamps from 2^32 batches ago could collide: clear once per wrap.
            self.rows.iter_mut().for_each(|r| r.stamp = 0);
            self.epoch = 1;
        }
    }

    /// Like `resolve`, and rejects a handle named twice in the same batch.
    #[inline]
    pub(crate) fn resolve_unique(&mut self, handle: i64, i: usize) -> Result<usize> {
        let row = self.resolve(handle)?;
        let r = &mut self.rows[row];
        if r.stamp == self.epoch {
            return Err(PoolError::InvalidArgument(format!(
                "handle {handle} appears more than once in the batch (again at index {i}); \
                 pass each request once with its total count"
            )));
        }
        r.stamp = self.epoch;
        Ok(row)
    }

    /// Validates and stamps every handle of a batch (no duplicates).
    pub(crate) fn resolve_batch(&mut self, handles: &[i64]) -> Result<()> {
        self.begin_batch();
        for (i, &h) in handles.iter().enumerate() {
            self.resolve_unique(h, i)?;
        }
        Ok(())
    }

    pub(crate) fn check_rows_available(&self, n: usize) -> Result<()> {
        if n > self.free_rows.len() {
            return Err(PoolError::TooManyRequests {
                requested: n,
                open: self.open_count,
                max: self.max_requests - self.retired_rows,
            });
        }
        Ok(())
    }

    /// The row the `i`-th next `take_row` takes (`i < free_rows.len()`).
    #[inline]
    pub(crate) fn nth_free_row(&self, i: usize) -> usize {
        self.free_rows[self.free_rows.len() - 1 - i] as usize
    }

    /// Takes a free row for a new, empty request and returns its handle.
    /// The caller checked `check_rows_available`.
    pub(crate) fn take_row(&mut self) -> (usize, i64) {
        let row = self.free_rows.pop().unwrap_or(0) as usize;
        let r = &mut self.rows[row];
        let cur = r.generation & !OPEN;
        let g = if cur == 0 {
            self.generation_start
        } else {
            next_generation(cur)
        };
        *r = Row {
            generation: g | OPEN,
            len: 0,
            last: 0,
            stamp: r.stamp,
        };
        self.cold[row].reset(0);
        self.known_len[row] = 0;
        self.open_count += 1;
        (row, make_handle(g, row as u32))
    }

    /// Undoes the `take_row` that took `row`, whose row state was `before`:
    /// the row is closed again under its old generation and is the next
    /// one taken. Only for the newest rows taken, last first.
    pub(crate) fn untake_row(&mut self, row: usize, before: Row) {
        self.rows[row] = before;
        self.cold[row].reset(0);
        self.known_len[row] = 0;
        self.open_count -= 1;
        self.free_rows.push(row as u32);
    }

    /// Opens `n` requests and appends their handles to `out`.
    pub fn open_into(&mut self, n: usize, out: &mut Vec<i64>) -> Result<()> {
        self.check_rows_available(n)?;
        reserve(out, n, "handles")?;
        for _ in 0..n {
            out.push(self.take_row().1);
        }
        Ok(())
    }

    /// Opens `n` empty requests. Errors: `TooManyRequests` if fewer than `n`
    /// rows are free (checked before anything is allocated).
    pub fn open(&mut self, n: usize) -> Result<Vec<i64>> {
        let mut out = Vec::new();
        self.open_into(n, &mut out)?;
        Ok(out)
    }
}
