//! kvpool-core: the KV-cache slot allocator behind `kvpool._core`.
//!
//! The pool is `num_pages` pages of `page_size` slots, and
//! `slot = page * page_size + offset`. Page 0 is reserved (a padding sink)
//! and never handed out. Each open request holds an ordered list of pages; it
//! grows token by token and takes a new page only when its last page is full.
//!
//! Pages are shared: every page is FREE, HELD by `refcount >= 1` requests, or
//! CACHED (held by nobody, registered in the prefix index, evictable in LRU
//! order). `open_with_prefix` starts requests on cached pages of a common
//! prefix, `cache` registers pages, `fork` shares a request's pages with new
//! requests, and a shared partly filled page is copied on write (the copies
//! are queued for the caller: `take_copies`). See `pages.rs`, `index.rs`,
//! `copies.rs`.
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

mod admit;
mod allocator;
mod chain;
mod check;
mod copies;
mod decode;
mod error;
mod events;
mod extend;
mod extend_checks;
mod fork;
mod grow;
mod handle;
mod hashing;
mod index;
mod key_table;
mod keys;
mod lookup;
mod memory;
mod page_state;
mod pages;
mod prefix;
mod queries;
mod release;
mod rows;
mod table;
#[cfg(any(test, feature = "test-hooks"))]
mod test_hooks;

pub use allocator::{Counts, Options, SlotAllocator};
pub use chain::PrefixChain;
pub use error::{HandleProblem, PoolError, Result};
pub use events::{Events, EVENT_CLEARED, EVENT_REMOVED, EVENT_STORED};
pub use extend::Grown;
pub use handle::{handle_generation, handle_row, make_handle, MAX_GENERATION};
pub use hashing::page_hashes;
pub use memory::{MAX_CONTEXT_LEN, MAX_REQUESTS};
pub use queries::PageTable;
pub use table::SlotTable;

#[cfg(test)]
mod tests;
