//! Lookup keys: the 64-bit chained key under which the prefix index files a
//! page, `k_i = mix(k_{i-1} ^ xxh3_64(seed, tokens of page i))`, with
//! `k_{-1}` derived from the request's salt.
//!
//! Why a second chain beside the 128-bit chain hash (`hashing.rs`): the
//! chain hash is the page's identity for events, routers and transfers,
//! and it chains through a whole xxh3-128 per page, so hashing a prompt
//! waits on one page after another (~18 ns a page here). The key hashes
//! each page's tokens independently (the CPU overlaps them) and chains
//! them with one multiply, so a lookup computes a 4096-token prompt's keys
//! in about a third of the time and never computes the 128-bit hash: a hit
//! takes it from the entry. A key is not trusted either: every hit is
//! verified against the entry's tokens, salt and parent registration
//! (`index.rs`), so two pages that share a key cost a miss, never wrong
//! KV. Keys stay inside the pool; nothing outside sees them.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::hashing::le_bytes;

const MUL: u64 = 0x9E37_79B9_7F4A_7C15;
const ROOT: u64 = 0x6b76_706f_6f6c_6b31;

/// One 64x64 -> 128-bit multiply folded to 64 bits: every output bit
/// depends on every input bit.
#[inline]
fn fold(x: u64) -> u64 {
    let m = (x as u128) * (MUL as u128);
    (m as u64) ^ ((m >> 64) as u64)
}

/// `k_{-1}` of a request with `salt`.
#[inline]
pub(crate) fn root_key(salt: i64) -> u64 {
    fold(salt as u64 ^ ROOT)
}

/// Computes keys with a pool's seed; `mask` keeps only the low bits (the
/// test-only weak hash that forces collisions; all ones otherwise).
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyHasher {
    pub(crate) seed: u64,
    pub(crate) mask: u64,
}

impl KeyHasher {
    /// The key of the page with `tokens` after a page keyed `parent`.
    #[inline]
    pub(crate) fn page(&self, parent: u64, tokens: &[i32]) -> u64 {
        #[allow(clippy::needless_borrow)] // a Cow on big-endian targets
        let t = xxh3_64_with_seed(&le_bytes(tokens), self.seed);
        fold(parent ^ t) & self.mask
    }
}
