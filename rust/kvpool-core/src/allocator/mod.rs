//! The allocator: the owners composed, and every operation that crosses
//! them. Its state is the pool's fixed geometry, the owners and two
//! counters; each owner keeps its own fields private:
//!
//! - `requests/`: rows, page lists, prompts, handles;
//! - `pages/`: page records, free stack, copy-on-write queue, and the
//!   eviction room (`eviction/`) it consults;
//! - `prefix/`: the index of registered pages and every slot's token id;
//! - `events.rs`: the KV event log;
//! - `host/`, with `host_pages > 0`: the host tier (host pages, their
//!   eviction list, the offload and load queues);
//! - `clock.rs`: the time retention priorities end by.
//!
//! The operations live here, one file per group: opening (`open.rs`),
//! growing (`extend.rs`, `extend_passes.rs`, `extend_checks.rs`, `grow.rs`), freeing
//! (`release.rs`), sharing (`fork.rs`, `copies.rs`), the cache
//! (`prefix.rs`, `cache.rs` with `register_page.rs` and `orphans.rs`,
//! `evict.rs`), transfers between pools
//! (`prefix_transfer.rs`), retention priorities (`retention.rs`), reading
//! (`queries.rs`) and `check.rs`; the host tier's: what device eviction
//! and registration do with it (`tier.rs`), host hits (`prefix_host.rs`),
//! swapping requests out and in (`swap.rs`) and its invariants
//! (`tier_check.rs`); `group_hooks.rs` is what a grouped pool (`groups/`)
//! asks of the allocator that carries its request table and anchor chain.

pub(crate) mod cache;
mod check;
mod copies;
mod decode_past_free;
mod evict;
pub(crate) mod extend;
mod extend_checks;
mod extend_passes;
mod fork;
mod fresh_stretch;
pub(crate) mod group_hooks;
mod grow;
mod open;
pub(crate) mod options;
mod orphans;
mod prefix;
mod prefix_host;
pub(crate) mod prefix_transfer;
pub(crate) mod queries;
mod register_page;
mod release;
mod retention;
pub(crate) mod stats;
mod swap;
#[cfg(any(test, feature = "test-hooks"))]
mod test_hooks;
mod tier;
mod tier_check;

use crate::clock::Clock;
use crate::error::{PoolError, Result};
use crate::events::{EventLog, MIN_BACKLOG};
use crate::geometry::Geometry;
use crate::handle::{mix64, random_u64, MAX_GENERATION};
use crate::host::HostTier;
use crate::memory::{MAX_CONTEXT_LEN, MAX_PAGES, MAX_REQUESTS};
use crate::pages::PagePool;
use crate::prefix::hashing::ChainKind;
use crate::prefix::index::PrefixIndex;
use crate::requests::Requests;
use options::Options;

#[derive(Debug, Clone)]
pub struct SlotAllocator {
    geo: Geometry,
    requests: Requests,
    pages: PagePool,
    prefix: PrefixIndex,
    events: EventLog,
    /// The host tier (None: `host_pages = 0`, and nothing of it is paid).
    host: Option<HostTier>,
    clock: Clock,
    /// Prompt tokens `open_with_prefix` served from the cache, cumulative.
    hit_tokens: u64,
    /// Prompt tokens `open_with_prefix` found no cached page for, cumulative.
    miss_tokens: u64,
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
    /// 2^20, `max_context_len` <= 2^28, `num_pages` <= 2^31 - 1,
    /// `max_pinned_pages` <= `num_pages - 1`) or metadata that cannot be
    /// allocated.
    ///
    /// Metadata, all reserved here (the exact worst case, see `metadata_bytes`):
    /// 20 bytes per page (refcount, free stack entry, registration, two LRU
    /// links), 4 per slot (token ids), and per row 16 (hot) + 96 (cold) + 4
    /// (free row stack) + 4 * (ceil(max_context_len / page_size) rounded up
    /// to 16, plus 16) (its page list). On top, from the first `cache()`:
    /// the index table (16-32 bytes per page for up to 2^20 pages, doubling
    /// past that) and its entry slab (64 bytes per page, reserved for every
    /// device and host page, and at page size 1 16 more for its runs, sized
    /// for every such page even under `lazy_metadata`); while in use, 4 per prompt token of each open request; and
    /// once a retention priority is given, 9 bytes per page (mapped on first
    /// use) and 24 per entry of the heap of pending priority ends (stale
    /// entries are dropped once they could be half of it).
    ///
    /// The request page lists (up to 64 MiB), the page records and the token
    /// ids of the lowest 4M slots are mapped into memory here, one write per
    /// 4 KiB, and the first 2^20 entries of the index's slab at the first
    /// `cache()`, so that the pool's first burst of requests and of
    /// registrations costs what later ones do instead of a page fault per
    /// 1024 pages taken or 64 pages registered (`Options::lazy_metadata`
    /// leaves all of them to first use, and lets the slab grow as pages are
    /// registered).
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
        // Page 0 is never handed out: a pool needs one more page to serve anything.
        if !(2..=MAX_PAGES).contains(&num_pages) {
            return bad(format!(
                "num_pages must be in [2, {MAX_PAGES}] (it includes the reserved page 0), got {num_pages}"
            ));
        }
        match num_pages.checked_mul(page_size) {
            Some(s) if s <= i64::MAX as usize => {}
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
        if opts.max_pinned_pages.is_some_and(|m| m > num_pages - 1) {
            return bad(format!(
                "max_pinned_pages must be in [0, {}] (the pool's capacity in pages), got {}",
                num_pages - 1,
                opts.max_pinned_pages.unwrap_or(0)
            ));
        }
        if opts.weak_hash_bits > 128 {
            return bad("weak_hash_bits must be in [0, 128]".into());
        }
        if opts.host_pages == 1 || opts.host_pages > MAX_PAGES {
            return bad(format!(
                "host_pages must be 0 (no host tier) or in [2, {MAX_PAGES}] (it includes the reserved \
                 host page 0), got {}",
                opts.host_pages
            ));
        }
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
        let geo = Geometry::new(num_pages, page_size, max_context_len);
        let requests = Requests::new(
            geo,
            max_requests,
            generation_base,
            generation_start,
            opts.epoch_start,
            !opts.lazy_metadata,
        )?;
        let seed = opts.hash_seed.unwrap_or_else(random_u64);
        let mut prefix = PrefixIndex::new(
            num_pages,
            page_size,
            seed,
            opts.weak_hash_bits,
            opts.skip_hit_verification,
            !opts.lazy_metadata,
            // Only events take chain hashes out of the pool as pages are
            // registered; without them the index keys by its own cheaper
            // chain (`prefix/hashing.rs`).
            if opts.kv_events {
                ChainKind::Interop
            } else {
                ChainKind::Internal
            },
        )?;
        let host = match opts.host_pages {
            0 => None,
            n => {
                prefix.enable_host(n)?;
                Some(HostTier::new(n, num_pages, opts.host_policy)?)
            }
        };
        // The page pool last: it writes its free stack (4 bytes a page), which
        // an allocation refused after it would have cost for nothing.
        let mut pages = PagePool::new(num_pages, !opts.lazy_metadata)?;
        if let Some(m) = opts.max_pinned_pages {
            pages.set_max_pinned(m);
        }
        Ok(Self {
            geo,
            requests,
            pages,
            prefix,
            events: EventLog::new(opts.kv_events, num_pages.max(MIN_BACKLOG)),
            host,
            clock: Clock::new(opts.manual_clock),
            hit_tokens: 0,
            miss_tokens: 0,
        })
    }

    /// The pages of row `row`, in token order.
    #[inline]
    fn row_pages_of(&self, row: usize) -> &[u32] {
        self.requests.held_pages(row)
    }

    /// The slots of `row`'s first `n` positions (`n` <= its length) as one
    /// run per page, `(first slot, count)`; run `k` starts at position
    /// `k * page_size`.
    fn slot_runs(&self, row: usize, n: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let ps = self.geo.page_size;
        self.row_pages_of(row)
            .iter()
            .enumerate()
            .map(move |(k, &p)| (p as usize * ps, ps.min(n.saturating_sub(k * ps))))
            .take_while(|&(_, m)| m > 0)
    }
}

#[cfg(test)]
impl SlotAllocator {
    /// Test only: the owners, to break their invariants on purpose.
    pub(crate) fn pages_for_tests(&mut self) -> &mut PagePool {
        &mut self.pages
    }

    pub(crate) fn requests_for_tests(&mut self) -> &mut Requests {
        &mut self.requests
    }

    pub(crate) fn prefix_for_tests(&mut self) -> &mut PrefixIndex {
        &mut self.prefix
    }

    pub(crate) fn host_for_tests(&mut self) -> &mut HostTier {
        self.host.as_mut().expect("a host tier")
    }
}
