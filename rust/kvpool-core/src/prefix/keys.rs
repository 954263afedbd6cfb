//! Lookup keys: the prefix index files a page under its 128-bit chain value
//! (`hashing.rs`) folded to 64 bits, `key_of(h_i)`. The chain is the xxh3
//! chain hash where the pool records KV events, and the internal chain
//! (64-bit values, folded to themselves) where it does not.
//!
//! One chain a page, never two: with events, the chain hash itself, because
//! lookups follow child hints (`lookup.rs`) and hash only where a hint
//! fails, a few pages per prompt, while `cache()` would have to compute
//! both chains for every page it registers. With one chain a page, the
//! serial chain runs ahead of the inserts instead (`allocator/cache.rs`).
//!
//! A key is not trusted: every hit is verified against the entry's tokens,
//! salt and parent registration (`index.rs`), so two pages that share a key
//! cost a miss, never wrong KV. Keys stay inside the pool; nothing outside
//! sees them.

/// The lookup key of the page whose chain hash is `hash`. xxh3's output is
/// already well mixed, so folding its halves keeps every bit of both.
#[inline]
pub(crate) fn key_of(hash: u128) -> u64 {
    (hash as u64) ^ ((hash >> 64) as u64)
}
