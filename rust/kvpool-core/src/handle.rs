//! Request handles: `(generation << 32) | row`, carried as i64.
//!
//! The row indexes a request-to-token table directly; the generation (31 bits,
//! never 0) makes a handle kept past `close` detectable instead of silently
//! naming the next request that reuses the row.
//!
//! Handles identify their allocator: each allocator draws a random
//! generation base in [1, 2^31 - 1) (derived from `Options::handle_seed`
//! when given, so tensor-parallel ranks agree), and every row's first
//! request gets that generation. A handle of another allocator carries that allocator's
//! generations, so it names an open request here only if its generation
//! equals the row's current one: probability about 1 in 2^31 per handle for
//! two independently seeded allocators. (The row bits stay a plain row, so
//! `handle & 0xFFFFFFFF` keeps indexing req_to_token.)
//!
//! Wraparound: a row's generation advances base, base+1, ..., 2^31-1, 1, 2, ...
//! A row whose next generation would come back to the base (after 2^31 - 1
//! requests on that one row) is retired instead of reopened, so no handle
//! ever becomes valid again. The pool loses that row's capacity, which takes
//! at least 2^31 - 1 opens per row to happen.

/// Largest generation; generations wrap from here back to 1.
pub const MAX_GENERATION: u32 = 0x7FFF_FFFF;

#[inline]
pub fn make_handle(generation: u32, row: u32) -> i64 {
    ((generation as i64) << 32) | row as i64
}

#[inline]
pub fn handle_row(handle: i64) -> u32 {
    (handle as u64 & 0xFFFF_FFFF) as u32
}

#[inline]
pub fn handle_generation(handle: i64) -> u32 {
    ((handle as u64) >> 32) as u32
}

/// Generation that follows `g` (skips 0 so a zeroed handle is never valid).
#[inline]
pub(crate) fn next_generation(g: u32) -> u32 {
    if g >= MAX_GENERATION {
        1
    } else {
        g + 1
    }
}

/// Steps from `base` to `g` along the generation ring 1..=MAX_GENERATION.
#[inline]
pub(crate) fn steps_from(base: u32, g: u32) -> u32 {
    (g + MAX_GENERATION - base) % MAX_GENERATION
}

/// A random generation base in [1, MAX_GENERATION - 1] from the std hasher's
/// per-process random keys (no extra dependency; not for cryptography).
pub(crate) fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    // The address of a local makes two allocators built in the same
    // RandomState key window differ as well.
    let marker = 0u8;
    h.write_usize(&marker as *const u8 as usize);
    h.finish()
}

/// SplitMix64's finalizer: spreads a handle seed over all 64 bits, so that
/// nearby seeds (0, 1, 2, ...) give unrelated generation bases.
pub(crate) fn mix64(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
