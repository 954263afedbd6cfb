//! Request handles: `(generation << 32) | row`, carried as i64.
//!
//! The row indexes a request-to-token table directly; the generation (31 bits,
//! never 0) makes a handle kept past `close` detectable instead of silently
//! naming the next request that reuses the row.

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
