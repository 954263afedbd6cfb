//! Makes a new pool's first burst of result arrays cost what later ones do.
//!
//! A call's result array (`admit`, `extend`: 8 bytes a slot) comes from the
//! C heap through numpy's calloc. In a fresh process, glibc serves any block
//! past its 128 KiB mmap threshold with a fresh mapping, so a first
//! admission of 528K tokens faults its 4 MiB result in page by page: about
//! as long again as the admission itself. Freeing that mapping raises the
//! threshold to its size (glibc's dynamic threshold, up to 32 MiB), and from
//! then on arrays that size come from the heap, whose top stays resident
//! across calls: every later burst is warm.
//!
//! Construction does the same once, at the pool's scale, so the first burst
//! finds the heap as a second one would: one mapping allocated and freed
//! (raising the threshold), then one heap block touched and freed (growing
//! the resident top). This is glibc's own behaviour after any large free,
//! brought forward to start-up; with another C allocator both steps are an
//! allocation and a free of memory nobody reads.

use std::alloc::{alloc, dealloc, Layout};

/// Under glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit (32 MiB, counting the
/// block's header): past it the threshold cannot rise, so larger results
/// are fresh mappings for every burst alike.
const MAX_BYTES: usize = (32 << 20) - (64 << 10);

/// Below this a result array is under glibc's initial mmap threshold
/// (128 KiB) or costs too few faults to matter.
const MIN_BYTES: usize = 1 << 20;

const PAGE: usize = 4096;

/// Primes the C heap for result arrays of up to `slots` slots (int64 each;
/// the most one call can return), capped at [`MAX_BYTES`]. Memory it cannot get is skipped, not an error:
/// this only moves page faults earlier.
pub(crate) fn prime_result_heap(slots: usize) {
    let bytes = slots.saturating_mul(8).min(MAX_BYTES);
    if bytes < MIN_BYTES || !cfg!(all(target_os = "linux", target_env = "gnu")) {
        return;
    }
    // malloc's own alignment: a larger one would go through memalign.
    let Ok(layout) = Layout::from_size_align(bytes, 16) else {
        return;
    };
    // The first block is a fresh mapping: freeing it (untouched, so it
    // costs no faults) raises the threshold. The second comes from the
    // heap; touching one byte a page faults it in, and after the free the
    // heap keeps it (its trim threshold is now twice the block).
    for touch in [false, true] {
        // SAFETY: `layout` has a non-zero size; the block is written only
        // inside its bounds and freed with the layout it was allocated with.
        unsafe {
            let p = alloc(layout);
            if p.is_null() {
                return;
            }
            if touch {
                for off in (0..bytes).step_by(PAGE).chain([bytes - 1]) {
                    std::ptr::write_volatile(p.add(off), 0);
                }
            }
            // Keeps the optimizer from pairing away the allocation and free.
            dealloc(std::hint::black_box(p), layout);
        }
    }
}
