//! Two pools driven by the same calls: one that records KV events, so its
//! index keys pages by the xxh3-128 chain hash events carry, and one that
//! records none, so it keys them by its internal chain
//! (`prefix/hashing.rs`). Which chain keys a page must change the cost of
//! a call, never its result: every call's result (handles, hits, slots,
//! errors, evictions, queued transfers) must be the same in both, and both
//! must pass `check()`. The trace's oracle checks the first pool's hits.

use kvpool_core::{Counts, Events, Options, Result, SlotAllocator};

#[derive(Clone)]
pub struct Twin {
    a: SlotAllocator,
    b: SlotAllocator,
}

/// Runs `$call` on both pools and returns the first's result, after
/// asserting that the second's is the same.
macro_rules! both {
    ($self:ident, $name:ident ( $($arg:expr),* )) => {{
        let x = $self.a.$name($($arg),*);
        let y = $self.b.$name($($arg),*);
        assert_eq!(
            format!("{x:?}"),
            format!("{y:?}"),
            "{}: the pool keyed by the internal chain differs",
            stringify!($name)
        );
        x
    }};
}

impl Twin {
    pub fn new(pages: usize, ps: usize, max_req: usize, max_ctx: usize, opts: Options) -> Self {
        // Same handles in both: a fixed generation base.
        let opts = Options {
            generation_base: Some(1),
            ..opts
        };
        let events_off = Options {
            kv_events: false,
            ..opts.clone()
        };
        let a = SlotAllocator::with_options(pages, ps, max_req, max_ctx, opts).unwrap();
        let b = SlotAllocator::with_options(pages, ps, max_req, max_ctx, events_off).unwrap();
        Twin { a, b }
    }

    pub fn hash_seed(&self) -> u64 {
        self.a.hash_seed()
    }

    pub fn max_context_len(&self) -> usize {
        self.a.max_context_len()
    }

    pub fn free_pages(&self) -> usize {
        both!(self, free_pages())
    }

    pub fn length(&self, h: i64) -> Result<usize> {
        both!(self, length(h))
    }

    pub fn pages(&self, h: i64) -> Result<Vec<i32>> {
        both!(self, pages(h))
    }

    pub fn open_with_prefix(
        &mut self,
        tokens: &[i64],
        lengths: &[i64],
        salt: Counts<'_>,
    ) -> Result<(Vec<i64>, Vec<i64>)> {
        both!(self, open_with_prefix(tokens, lengths, salt))
    }

    pub fn extend(
        &mut self,
        handles: &[i64],
        counts: Counts<'_>,
        tokens: Option<&[i64]>,
    ) -> Result<Vec<i64>> {
        both!(self, extend(handles, counts, tokens))
    }

    pub fn cache(&mut self, handles: &[i64]) -> Result<()> {
        both!(self, cache(handles))
    }

    pub fn cache_with_priority(
        &mut self,
        handles: &[i64],
        priority: Counts<'_>,
        retain_s: Option<f64>,
    ) -> Result<()> {
        both!(self, cache_with_priority(handles, priority, retain_s))
    }

    pub fn close(&mut self, handles: &[i64], cache: bool) -> Result<()> {
        both!(self, close(handles, cache))
    }

    pub fn close_with_priority(
        &mut self,
        handles: &[i64],
        priority: Counts<'_>,
        retain_s: Option<f64>,
    ) -> Result<()> {
        both!(self, close_with_priority(handles, priority, retain_s))
    }

    pub fn fork(&mut self, handle: i64, n: usize) -> Result<Vec<i64>> {
        both!(self, fork(handle, n))
    }

    pub fn truncate(&mut self, handles: &[i64], lengths: Counts<'_>) -> Result<()> {
        both!(self, truncate(handles, lengths))
    }

    pub fn evict(&mut self, n: usize) -> usize {
        both!(self, evict(n))
    }

    pub fn set_clock(&mut self, now_s: f64) -> Result<()> {
        both!(self, set_clock(now_s))
    }

    pub fn unpin(&mut self, handles: &[i64]) -> Result<usize> {
        both!(self, unpin(handles))
    }

    pub fn take_offloads(&mut self) -> (Vec<i64>, Vec<i64>) {
        both!(self, take_offloads())
    }

    pub fn take_loads(&mut self) -> (Vec<i64>, Vec<i64>) {
        both!(self, take_loads())
    }

    pub fn take_copies(&mut self) -> (Vec<i64>, Vec<i64>) {
        both!(self, take_copies())
    }

    /// The first pool's events (the second records none).
    pub fn take_events(&mut self) -> Events {
        let e = self.b.take_events();
        assert!(e.is_empty(), "a pool without KV events recorded some");
        self.a.take_events()
    }

    /// Both pools' invariants; the chain each keys by is its own.
    pub fn check(&self) -> Result<()> {
        self.b.check()?;
        self.a.check()
    }
}
