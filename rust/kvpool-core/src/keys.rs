//! Lookup keys: the prefix index files a page under its 128-bit chain hash
//! (`hashing.rs`) folded to 64 bits, `key_of(h_i)`.
//!
//! Why the chain hash itself, and not a second chain: the index used to key
//! pages by a chain of their own (`xxh3_64` of each page's tokens, chained
//! with one multiply), so that a lookup could hash a prompt's pages in
//! parallel instead of waiting on one 128-bit hash after another. Since
//! lookups follow child hints (`lookup.rs`) they hash only where a hint
//! fails, a few pages per prompt, while `cache()` had to compute both
//! hashes for every page it registers. One hash a page, with the serial
//! chain run ahead of the inserts (`prefix.rs`), took `cache()` of a
//! 4096-token request at page 16 from 5.99 to 5.10 us (`bench_core`'s
//! `cache_4096`, medians of runs alternated on the Xeon VM).
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
