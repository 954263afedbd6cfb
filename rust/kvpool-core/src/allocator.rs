//! The allocator state, handle resolution and open. Extending lives in
//! `extend.rs`, freeing in `release.rs`, queries in `queries.rs`, invariants
//! in `check.rs`.

use crate::error::{HandleProblem, PoolError, Result};
use crate::handle::{handle_generation, handle_row, make_handle, next_generation};

/// `owner` value of a page on the free stack.
pub(crate) const FREE: u32 = u32::MAX;
/// `owner` value of page 0, the padding sink that is never handed out.
pub(crate) const RESERVED: u32 = u32::MAX - 1;

/// Per-row request state. A closed row keeps its page Vec's capacity so the
/// next request on that row does not reallocate (bounded by max_context_len).
#[derive(Debug, Clone, Default)]
pub(crate) struct Request {
    pub(crate) generation: u32,
    pub(crate) open: bool,
    pub(crate) len: usize,
    pub(crate) pages: Vec<u32>,
}

/// Per-request token counts (or target lengths) of a batch call: one value
/// broadcast to every handle, or one value per handle.
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
                "{what} has {} entries but there are {n} handles; pass one per handle or a single int",
                v.len()
            ))),
            _ => Ok(()),
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
    /// Owner row of every page, or FREE / RESERVED.
    pub(crate) owner: Vec<u32>,
    /// Free pages; the top (end) is handed out next.
    pub(crate) free_pages: Vec<u32>,
    pub(crate) requests: Vec<Request>,
    /// Closed rows; the top (end) is opened next.
    pub(crate) free_rows: Vec<u32>,
    /// Per-row stamp of the batch that last named it: finds duplicate handles
    /// in a batch in O(batch) without clearing a set each call.
    pub(crate) stamp: Vec<u32>,
    pub(crate) epoch: u32,
    pub(crate) open_count: usize,
}

impl SlotAllocator {
    /// `num_pages` includes the reserved page 0, so `num_pages - 1` pages are usable.
    pub fn new(
        num_pages: usize,
        page_size: usize,
        max_requests: usize,
        max_context_len: usize,
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
        match num_pages.checked_mul(page_size) {
            Some(s) if s <= i64::MAX as usize => {}
            _ => {
                return bad(format!(
                    "num_pages * page_size = {num_pages} * {page_size} overflows"
                ))
            }
        }
        if max_requests == 0 || max_requests > i32::MAX as usize {
            return bad(format!(
                "max_requests must be in [1, {}], got {max_requests}",
                i32::MAX
            ));
        }
        if max_context_len == 0 || max_context_len > i32::MAX as usize {
            return bad(format!(
                "max_context_len must be in [1, {}], got {max_context_len}",
                i32::MAX
            ));
        }
        // Fallible reservations: a pool too big for memory is an error for the
        // caller, not an abort of the whole process.
        let (mut owner, mut free_pages) = (Vec::new(), Vec::new());
        if owner.try_reserve_exact(num_pages).is_err()
            || free_pages.try_reserve_exact(num_pages - 1).is_err()
        {
            return bad(format!(
                "cannot allocate allocator metadata for {num_pages} pages ({} bytes)",
                num_pages * 8
            ));
        }
        owner.resize(num_pages, FREE);
        owner[0] = RESERVED;
        // Reversed so that pop() hands out 1, 2, 3, ... on a fresh pool.
        free_pages.extend((1..num_pages as u32).rev());
        let free_rows: Vec<u32> = (0..max_requests as u32).rev().collect();
        Ok(Self {
            page_size,
            page_shift: page_size
                .is_power_of_two()
                .then(|| page_size.trailing_zeros()),
            num_pages,
            max_requests,
            max_context_len,
            owner,
            free_pages,
            requests: vec![Request::default(); max_requests],
            free_rows,
            stamp: vec![0; max_requests],
            epoch: 0,
            open_count: 0,
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

    /// Row of an open request, or why `handle` does not name one.
    #[inline]
    pub(crate) fn resolve(&self, handle: i64) -> Result<usize> {
        let row = handle_row(handle) as usize;
        let generation = handle_generation(handle);
        if handle < 0 || row >= self.max_requests || generation == 0 {
            return Err(PoolError::InvalidHandle {
                handle,
                problem: HandleProblem::Unknown,
            });
        }
        let req = &self.requests[row];
        if req.generation != generation {
            // A generation the row has not reached yet was never issued.
            let problem = if generation < req.generation {
                HandleProblem::Stale
            } else {
                HandleProblem::Unknown
            };
            return Err(PoolError::InvalidHandle { handle, problem });
        }
        if !req.open {
            return Err(PoolError::InvalidHandle {
                handle,
                problem: HandleProblem::Closed,
            });
        }
        Ok(row)
    }

    /// Starts a batch for duplicate detection with [`Self::resolve_unique`].
    pub(crate) fn begin_batch(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            // Stamps from 2^32 batches ago could collide: clear once per wrap.
            self.stamp.iter_mut().for_each(|s| *s = 0);
            self.epoch = 1;
        }
    }

    /// Like `resolve`, and rejects a handle named twice in the same batch.
    #[inline]
    pub(crate) fn resolve_unique(&mut self, handle: i64, i: usize) -> Result<usize> {
        let row = self.resolve(handle)?;
        if self.stamp[row] == self.epoch {
            return Err(PoolError::InvalidArgument(format!(
                "handle {handle} appears more than once in the batch (again at index {i}); \
                 pass each request once with its total count"
            )));
        }
        self.stamp[row] = self.epoch;
        Ok(row)
    }

    /// Opens `n` requests and appends their handles to `out`.
    pub fn open_into(&mut self, n: usize, out: &mut Vec<i64>) -> Result<()> {
        if n > self.free_rows.len() {
            return Err(PoolError::TooManyRequests {
                requested: n,
                open: self.open_count,
                max: self.max_requests,
            });
        }
        out.reserve(n);
        for _ in 0..n {
            let Some(row) = self.free_rows.pop() else {
                return Err(PoolError::Invariant("free row stack ran out early".into()));
            };
            let req = &mut self.requests[row as usize];
            req.generation = next_generation(req.generation);
            req.open = true;
            req.len = 0;
            req.pages.clear();
            out.push(make_handle(req.generation, row));
        }
        self.open_count += n;
        Ok(())
    }

    pub fn open(&mut self, n: usize) -> Result<Vec<i64>> {
        let mut out = Vec::with_capacity(n);
        self.open_into(n, &mut out)?;
        Ok(out)
    }
}
