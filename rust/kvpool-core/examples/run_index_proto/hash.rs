//! The interop chain hash, from the core's public functions:
//! `h_i = xxh3_128(seed, h_{i-1} as 16 little-endian bytes || the page's
//! token ids as little-endian i32)`, with `h_{-1}` the salt's root value,
//! and the plain definition for the self-test to check them against.

/// Root value of the chain of a request with `salt`.
#[inline]
pub fn root(salt: i64) -> u128 {
    kvpool_core::chain_root(salt)
}

/// `xxh3_128(seed, parent || tokens)`, with the pool's fast paths.
#[inline(always)]
pub fn page(seed: u64, parent: u128, tokens: &[i32]) -> u128 {
    kvpool_core::chain_page_hash(seed, parent, tokens)
}

/// The plain definition, for the self-test to check `page` against.
pub fn reference(seed: u64, parent: u128, tokens: &[i32]) -> u128 {
    let mut b = parent.to_le_bytes().to_vec();
    for t in tokens {
        b.extend_from_slice(&t.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_128_with_seed(&b, seed)
}
