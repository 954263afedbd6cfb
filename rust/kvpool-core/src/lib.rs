//! kvpool-core: the KV-cache slot allocator behind `kvpool._core`.
//!
//! The pool is `num_pages` pages of `page_size` slots, and
//! `slot = page * page_size + offset`. Page 0 is reserved (a padding sink) and
//! never handed out. Each open request owns an ordered list of pages; it grows
//! token by token and takes a new page only when its last page is full.
//!
//! Free pages form a LIFO stack: the pages freed last are reused first (warm
//! in cache), and a fresh pool hands out pages 1, 2, 3, ... in order. Every
//! operation costs O(pages touched + batch size); only construction and
//! [`SlotAllocator::check`] walk the whole pool.
//!
//! Plain integers and slices in, `Result<_, PoolError>` out; batch calls
//! validate the whole batch before changing anything, so an error leaves the
//! allocator exactly as it was.

mod allocator;
mod check;
mod error;
mod extend;
mod handle;
mod queries;
mod release;
pub use queries::PageTable;

pub use allocator::{Counts, SlotAllocator};
pub use error::{HandleProblem, PoolError, Result};
pub use handle::{handle_generation, handle_row, make_handle, MAX_GENERATION};

#[cfg(test)]
mod tests;
