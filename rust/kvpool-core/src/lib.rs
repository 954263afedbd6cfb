//! kvpool-core: the KV-cache slot allocator behind `kvpool._core`.
//!
//! The pool is `num_pages` pages of `page_size` slots, and
//! `slot = page * page_size + offset`. Page 0 is reserved (a padding sink)
//! and never handed out. Each open request holds an ordered list of pages; it
//! grows token by token and takes a new page only when its last page is full.
//!
//! Pages are shared: every page is FREE, HELD by `refcount >= 1` requests, or
//! CACHED (held by nobody, registered in the prefix index, evictable in LRU
//! order, or by retention priority once a caller gives priorities; pinned
//! pages are never evicted). `open_with_prefix` starts requests on cached pages of a common
//! prefix, `cache` registers pages, `fork` shares a request's pages with new
//! requests, and a shared partly filled page is copied on write (the copies
//! are queued for the caller: `take_copies`).
//!
//! The state is split by owner, each with private fields: `requests/`
//! (rows, page lists, handles), `pages/` (page records, free stack,
//! copy-on-write queue), `eviction/` (which CACHED page goes next),
//! `prefix/` (the index of registered pages and every slot's token id),
//! `events.rs` and, with `host_pages > 0`, `host/` (a host tier: host
//! pages, their eviction list, the offload and load queues). `allocator/`
//! composes them; an operation that crosses owners is an allocator method
//! that calls theirs.
//!
//! Free pages form a LIFO stack: the pages freed last are reused first (warm
//! in cache), and a fresh pool hands out pages 1, 2, 3, ... in order. Every
//! operation costs O(pages touched + batch size); only construction,
//! `reset`, `clear_cache` and [`SlotAllocator::check`] walk the pool or the rows.
//!
//! Plain integers and slices in, `Result<_, PoolError>` out; batch calls
//! validate the whole batch before changing anything, so an error leaves the
//! allocator exactly as it was. Every allocation whose size a caller controls
//! is fallible (`memory.rs`).

mod allocator;
mod clock;
mod error;
mod events;
mod eviction;
mod geometry;
mod groups;
mod handle;
mod host;
mod location;
mod memory;
mod pages;
mod prefix;
mod requests;
mod rows;
mod table;

pub use allocator::extend::Grown;
pub use allocator::options::{Counts, Options};
pub use allocator::prefix_transfer::PrefixChain;
pub use allocator::queries::PageTable;
pub use allocator::stats::Stats;
pub use allocator::SlotAllocator;
pub use error::{GroupShortage, HandleProblem, PoolError, Result, Rollback};
pub use events::{
    Drained, EventSink, Events, EVENT_CLEARED, EVENT_REMOVED, EVENT_STORED, MEDIUM_DEVICE,
    MEDIUM_HOST,
};
pub use eviction::{DEFAULT_PRIORITY, MAX_PRIORITY};
pub use groups::{GroupKind, GroupSpec, GroupedAllocator, MAX_GROUPS};
pub use handle::{handle_generation, handle_row, make_handle, MAX_GENERATION};
pub use host::HostPolicy;
pub use memory::{MAX_CONTEXT_LEN, MAX_PAGES, MAX_REQUESTS};
pub use prefix::hashing::{chain_page_hash, chain_root, page_hashes};
pub use rows::{check_scatter, scatter_rows, RowCopy};
pub use table::SlotTable;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tier_tests;
