//! Fallible allocation of the metadata arrays. Every array whose size a caller
//! controls (pool size, max_requests, max_context_len, batch sizes) is reserved
//! through here, so a request for too much memory is a typed error instead of
//! an abort of the whole process.

use crate::error::{PoolError, Result};
use std::mem::MaybeUninit;

/// Largest `max_requests`: rows are indexed by u32 and the per-row metadata
/// (16-byte hot row + 96-byte cold row + page list) must stay allocatable.
pub const MAX_REQUESTS: usize = 1 << 20;
/// Largest `max_context_len`: lengths live in u32 fields with the top bits free.
pub const MAX_CONTEXT_LEN: usize = 1 << 28;
/// Largest `num_pages` of a pool (the reserved page 0 included), device or
/// host tier: page ids are i32 in the tables an engine's kernels read.
pub const MAX_PAGES: usize = i32::MAX as usize;

/// Types for which an all-zero bit pattern is a valid value.
///
/// # Safety
/// Implement only for plain integer types or structs made of them.
pub(crate) unsafe trait Zeroable: Copy {}
unsafe impl Zeroable for u8 {}
unsafe impl Zeroable for u32 {}
unsafe impl Zeroable for i32 {}
unsafe impl Zeroable for u64 {}

fn too_big(what: &str, n: usize, size: usize) -> PoolError {
    // The host tier's own arrays are sized by host_pages alone: naming the device sizes would
    // send the caller after the wrong argument.
    // (The host load map is the exception: one entry per device page.)
    let hint = if what == "host free stack"
        || what.starts_with("host page")
        || what.starts_with("host slot")
    {
        "use fewer host_pages (or a smaller host_memory_bytes)"
    } else {
        "use a smaller pool, max_requests or max_context_len"
    };
    PoolError::InvalidArgument(format!(
        "cannot allocate {what}: {n} entries of {size} bytes ({} bytes); {hint}",
        n.saturating_mul(size)
    ))
}

/// A zero-filled Vec of `n` entries, or an error if the memory is not there.
/// Zeroed memory comes from `alloc_zeroed` (calloc): the OS maps it lazily,
/// so the part of a large array never touched (rows never used, the tokens of
/// pages never written) costs address space, not resident memory.
pub(crate) fn zeroed_vec<T: Zeroable>(n: usize, what: &str) -> Result<Vec<T>> {
    let size = std::mem::size_of::<T>();
    if n == 0 || size == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<T>(n).map_err(|_| too_big(what, n, size))?;
    // SAFETY: the layout has non-zero size; a null result is handled; the
    // pointer comes from the global allocator with exactly this layout, holds
    // n zeroed Ts (valid values by `Zeroable`), so from_raw_parts(ptr, n, n)
    // gives a Vec that frees it with the same layout.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout) as *mut T;
        if ptr.is_null() {
            return Err(too_big(what, n, size));
        }
        Ok(Vec::from_raw_parts(ptr, n, n))
    }
}

/// Most bytes of one array that construction faults in (see `fault_in`): what
/// a first burst touches is at the array's start (rows and pages are handed
/// out lowest first), and a pool sized far beyond its use keeps the rest lazy.
pub(crate) const FAULT_IN_MAX_BYTES: usize = 64 << 20;

/// Maps the first `bytes` of a zeroed array (at most `FAULT_IN_MAX_BYTES`)
/// into memory now, one write per 4 KiB, instead of at the first write of
/// each 4 KiB: a fresh pool's first burst of requests would otherwise pay a
/// page fault (and the kernel zeroing a page) every 1024 page-list entries
/// or token ids, several times the cost of the same burst on a warm pool.
pub(crate) fn fault_in<T: Zeroable>(v: &mut [T], bytes: usize) {
    advise_huge(v);
    let len = std::mem::size_of_val(v).min(bytes).min(FAULT_IN_MAX_BYTES);
    let base = v.as_mut_ptr() as *mut u8;
    for off in (0..len).step_by(4096) {
        // SAFETY: `off` is inside `v` (len <= its size in bytes); every entry
        // is zero (the array comes from `zeroed_vec`) and a zero byte keeps
        // it so (`Zeroable`); volatile so the store is not elided as a no-op.
        unsafe { std::ptr::write_volatile(base.add(off), 0) };
    }
}

/// Reserves room for exactly `n` entries in the empty vector `v` and maps
/// the first `bytes` of it (at most `FAULT_IN_MAX_BYTES`) now, on huge
/// pages, for an array that grows by pushes up to a size the pool fixes:
/// growing by doubling, each push onto a fresh 4 KiB page would pay a page
/// fault (and the kernel zeroing the page) in the step that pushed it. Only
/// the mapped part is advised: past it, pushes fault in 4 KiB pages as an
/// unreserved vector's would, not a 2 MiB page at once.
pub(crate) fn reserve_mapped<T>(v: &mut Vec<T>, n: usize, bytes: usize, what: &str) -> Result<()> {
    reserve_exact(v, n, what)?;
    let spare = v.spare_capacity_mut();
    let len = std::mem::size_of_val(spare)
        .min(bytes)
        .min(FAULT_IN_MAX_BYTES);
    // SAFETY: the first `len` bytes of the spare capacity lie inside the
    // vector's allocation, and `MaybeUninit<u8>` may view any bytes.
    let mapped =
        unsafe { std::slice::from_raw_parts_mut(spare.as_mut_ptr() as *mut MaybeUninit<u8>, len) };
    advise_huge(mapped);
    for b in mapped.iter_mut().step_by(4096) {
        // Volatile, so the store to capacity nobody reads is not elided;
        // pushes later write whole values over it.
        // SAFETY: `b` is a valid, exclusive byte of the allocation.
        unsafe { std::ptr::write_volatile(b, MaybeUninit::new(0)) };
    }
    Ok(())
}

/// Reserves room for `additional` more entries in `v`, or a typed error.
pub(crate) fn reserve<T>(v: &mut Vec<T>, additional: usize, what: &str) -> Result<()> {
    v.try_reserve(additional)
        .map_err(|_| too_big(what, additional, std::mem::size_of::<T>()))
}

/// Arrays at least this large get `advise_huge`'s advice.
const HUGE_MIN_BYTES: usize = 4 << 20;

/// Asks the kernel to back the 2 MiB-aligned part of a large array with
/// transparent huge pages (Linux's default mode gives them only to memory
/// that asks). For arrays read at random places, one or two cache lines at
/// a time, that a pool sizes once: the page records, the index's table,
/// and (unless `lazy_metadata`) the page lists and token ids. With 4 KiB
/// pages at a 1M-page pool nearly every such read also misses the TLB, a
/// page walk as costly as the miss itself, and at page size 1 a prompt's
/// bookkeeping is one such read per token. Memory stays mapped on first
/// touch (a 2 MiB page is zeroed when first written, as a 4 KiB one is), so
/// a pool sized far beyond its use grows its resident memory in 2 MiB
/// steps; `lazy_metadata` keeps its page lists and token ids on 4 KiB
/// pages. Growing vectors (event logs, the index's slab under
/// `lazy_metadata`) get no advice: each growth would fault in and zero
/// fresh 2 MiB pages in the step that grows it (`reserve_mapped` maps the
/// slab at the first `cache()` instead). A kernel without THP ignores the advice.
pub(crate) fn advise_huge<T>(v: &[T]) {
    // Miri cannot call into libc; the advice changes no contents anyway.
    #[cfg(all(target_os = "linux", not(miri)))]
    {
        let (ptr, bytes) = (v.as_ptr() as usize, std::mem::size_of_val(v));
        const HUGE: usize = 2 << 20;
        let start = ptr.next_multiple_of(HUGE);
        let end = (ptr + bytes) & !(HUGE - 1);
        if bytes >= HUGE_MIN_BYTES && end > start {
            // SAFETY: [start, end) lies inside `v`'s live allocation;
            // MADV_HUGEPAGE only changes how the kernel backs it, never its
            // contents, and a failure (no THP support) changes nothing.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(all(target_os = "linux", not(miri))))]
    let _ = v;
}

/// Makes room for `additional` more entries in `v` without the amortized
/// doubling: a buffer then never holds more than its largest content.
pub(crate) fn reserve_exact<T>(v: &mut Vec<T>, additional: usize, what: &str) -> Result<()> {
    v.try_reserve_exact(additional)
        .map_err(|_| too_big(what, additional, std::mem::size_of::<T>()))
}

/// A Vec holding `n` clones of `x`, allocated fallibly.
pub(crate) fn filled_vec<T: Clone>(n: usize, x: T, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| too_big(what, n, std::mem::size_of::<T>()))?;
    v.resize(n, x);
    Ok(v)
}

/// Starts loading `v[i]` into cache (a hint; nothing on targets without a
/// prefetch instruction, and nothing when `i` is out of range).
#[inline]
pub(crate) fn prefetch<T>(v: &[T], i: usize) {
    #[cfg(target_arch = "x86_64")]
    if i < v.len() {
        // SAFETY: the pointer is inside `v` (checked); a prefetch never
        // faults and reads nothing architecturally.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>(v.as_ptr().add(i) as *const i8);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (v, i);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(what: &str) -> String {
        // More entries than any layout can hold: refused before the allocator is asked.
        match zeroed_vec::<u64>(usize::MAX / 4, what) {
            Err(PoolError::InvalidArgument(msg)) => msg,
            other => panic!("expected a typed refusal, got {:?}", other.map(|v| v.len())),
        }
    }

    #[test]
    fn a_host_array_too_big_names_host_pages_and_a_device_one_the_pool_sizes() {
        for what in ["host page states", "host free stack"] {
            let host = refusal(what);
            assert!(
                host.contains("host_pages") && !host.contains("max_context_len"),
                "{host}"
            );
        }
        let load_map = refusal("host load map");
        assert!(load_map.contains("smaller pool"), "{load_map}");
        let device = refusal("slot token ids");
        assert!(
            device.contains("max_context_len") && !device.contains("host_pages"),
            "{device}"
        );
    }
}
