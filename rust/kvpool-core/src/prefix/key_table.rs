//! The prefix index's hash table: an open-addressing map from a page's
//! 64-bit lookup key (`keys.rs`) to its entry in the index's slab.
//!
//! Why not `HashMap`: a prefix lookup knows every key of a prompt before it
//! reads any bucket, so it prefetches them all and the probes overlap
//! instead of queueing one cache miss behind another; the standard map does
//! not expose bucket addresses. Linear probing keeps a probe to one or two
//! cache lines (eight 8-byte buckets per line at load <= 1/2), and
//! backward-shift deletion leaves no tombstones, so eviction-heavy
//! workloads do not degrade it.
//!
//! A bucket holds the key's low 32 bits as a tag and the entry index + 1
//! (0 = empty). The home bucket is the tag's low bits (tables stay below
//! 2^32 buckets), so growing and backward shifts never read an entry; the
//! tag's remaining bits filter probes. The full key lives in the entry:
//! callers confirm a tag match there, which they read anyway to verify the
//! hit.
//!
//! Growth is incremental. A doubling used to move every key inside the one
//! `reserve` that passed load 1/2, and fault the fresh array in right
//! there: for a 16M-page pool, 8.5 ms of rehash and, on hosts that back
//! fresh memory slowly, 300+ ms of first-touch zeroing in one `cache()`
//! call. Now `reserve` only allocates the new array; the old one stays and
//! every later insert, and every page a later call registers (`drain`),
//! drains `MIGRATE_STEP` more of its buckets, in order, into the new one
//! (`migrate.rs` has the invariants and the proofs).

mod migrate;

use crate::error::{PoolError, Result};
use migrate::MIGRATE_STEP;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
struct Bucket {
    tag: u32,
    /// Entry index + 1; 0 when the bucket is empty.
    entry: u32,
}

// SAFETY: two u32s; all zeros is the empty bucket.
unsafe impl crate::memory::Zeroable for Bucket {}

/// 64 bytes on 64-bit targets. Layout-sensitive: at 56 or 72 bytes the
/// registration loop (`register_batch`) measured 2-6 more instructions per
/// page at page size 1 (callgrind, `bench_core`), so check before changing
/// the fields.
#[derive(Debug, Clone, Default)]
pub(crate) struct KeyTable {
    /// The table; while a growth drains `old`, the new, larger array.
    buckets: Vec<Bucket>,
    /// Keys in `buckets` and `old` together.
    len: usize,
    /// While growing: the array being drained into `buckets` (its buckets
    /// below `cursor` are empty); empty otherwise.
    old: Vec<Bucket>,
    cursor: usize,
}

#[inline]
fn tag(key: u64) -> u32 {
    key as u32
}

/// Home bucket in `b` of a key with tag `t` (`b`'s length is a power of two).
#[inline]
fn home(b: &[Bucket], t: u32) -> usize {
    t as usize & b.len().wrapping_sub(1)
}

/// The entry in `b` under tag `t` that `is_key` confirms.
#[inline]
fn probe(b: &[Bucket], t: u32, is_key: &impl Fn(u32) -> bool) -> Option<u32> {
    let mask = b.len() - 1;
    let mut i = t as usize & mask;
    loop {
        let x = b[i];
        if x.entry == 0 {
            return None;
        }
        if x.tag == t && is_key(x.entry - 1) {
            return Some(x.entry - 1);
        }
        i = (i + 1) & mask;
    }
}

/// The bucket of `b` holding `entry` in tag `t`'s probe run.
#[inline]
fn slot_in(b: &[Bucket], t: u32, entry: u32) -> Option<usize> {
    let mask = b.len() - 1;
    let mut i = t as usize & mask;
    loop {
        match b[i].entry {
            0 => return None,
            e if e == entry + 1 => return Some(i),
            _ => i = (i + 1) & mask,
        }
    }
}

/// The first empty bucket of `x`'s probe run in `b` (which has one).
#[inline]
fn free_slot(b: &[Bucket], t: u32) -> usize {
    let mask = b.len() - 1;
    let mut i = t as usize & mask;
    while b[i].entry != 0 {
        i = (i + 1) & mask;
    }
    i
}

/// Empties bucket `i` of `b`, backward-shifting the rest of its probe run
/// so no tombstone is left.
#[inline]
fn shift_out(b: &mut [Bucket], mut i: usize) {
    let mask = b.len() - 1;
    let mut j = i;
    loop {
        j = (j + 1) & mask;
        let x = b[j];
        if x.entry == 0 {
            break;
        }
        // `x` may fill the hole at `i` unless its home lies cyclically in
        // (i, j]: moving it before its home would hide it.
        let h = x.tag as usize & mask;
        if (j.wrapping_sub(h) & mask) >= (j.wrapping_sub(i) & mask) {
            b[i] = x;
            i = j;
        }
    }
    b[i] = Bucket::default();
}

impl KeyTable {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Buckets, empty or not (both arrays while growing).
    pub(crate) fn buckets(&self) -> usize {
        self.buckets.len() + self.old.len()
    }

    pub(crate) fn capacity_bytes(&self) -> usize {
        (self.buckets.capacity() + self.old.capacity()) * std::mem::size_of::<Bucket>()
    }

    /// Room for `additional` more keys at load <= 1/2 in the (new) array,
    /// so inserts never allocate, or a typed error with nothing changed.
    /// A growth allocates the new array only; inserts and `drain` move
    /// the keys (`migrate.rs`). One that needs a bigger array while a
    /// growth is under way first finishes it here, after the allocation
    /// succeeded.
    pub(crate) fn reserve(&mut self, additional: usize) -> Result<()> {
        let need = self.len.saturating_add(additional).saturating_mul(2);
        if need <= self.buckets.len() {
            return Ok(());
        }
        let cap = need
            .max(16)
            .checked_next_power_of_two()
            .filter(|&c| c <= 1 << 32)
            .ok_or_else(|| {
                PoolError::InvalidArgument(format!(
                    "cannot size the prefix index for {} pages",
                    self.len.saturating_add(additional)
                ))
            })?;
        let fresh = crate::memory::zeroed_vec(cap, "prefix index table")?;
        crate::memory::advise_huge(&fresh);
        self.migrate(usize::MAX);
        let old = std::mem::replace(&mut self.buckets, fresh);
        if self.len != 0 {
            self.old = old;
            self.cursor = 0;
        }
        Ok(())
    }

    /// While growing, moves as many old buckets as `keys` inserts would:
    /// the index calls it for the pages a call is about to register
    /// (`migrate.rs`, "Progress").
    #[inline]
    pub(crate) fn drain(&mut self, keys: usize) {
        if !self.old.is_empty() {
            self.drain_growing(keys);
        }
    }

    /// Out of line, so that pools that never grow pay only `drain`'s test.
    #[cold]
    #[inline(never)]
    fn drain_growing(&mut self, keys: usize) {
        self.migrate(keys.saturating_mul(MIGRATE_STEP));
    }

    /// Starts loading `key`'s home bucket into cache (a hint; no effect on
    /// targets without a prefetch instruction). While growing, in both
    /// arrays: with no growth `old` is empty and its prefetch is the
    /// bounds test's one branch.
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        let t = tag(key);
        crate::memory::prefetch(&self.buckets, home(&self.buckets, t));
        crate::memory::prefetch(&self.old, home(&self.old, t));
    }

    /// The entry stored under `key`: one whose tag matches and for which
    /// `is_key(entry)` confirms the full key (of a key stored twice, the
    /// first stored, but mid-growth either).
    #[inline]
    pub(crate) fn find(&self, key: u64, is_key: impl Fn(u32) -> bool) -> Option<u32> {
        if !self.old.is_empty() {
            return self.find_growing(tag(key), &is_key);
        }
        if self.len == 0 {
            return None;
        }
        probe(&self.buckets, tag(key), &is_key)
    }

    /// `find` while growing: a key whose old home is below the cursor is
    /// only in the new array (`migrate.rs`), any other first in the old.
    #[cold]
    #[inline(never)]
    fn find_growing(&self, t: u32, is_key: &impl Fn(u32) -> bool) -> Option<u32> {
        if home(&self.old, t) >= self.cursor {
            if let Some(e) = probe(&self.old, t, is_key) {
                return Some(e);
            }
        }
        probe(&self.buckets, t, is_key)
    }

    /// Whether `entry` is stored under `key`.
    pub(crate) fn contains(&self, key: u64, entry: u32) -> bool {
        let t = tag(key);
        match self.slot_of(t, entry) {
            Some((true, i)) => self.old[i].tag == t,
            Some((false, i)) => self.buckets[i].tag == t,
            None => false,
        }
    }

    /// Where `entry` is in tag `t`'s probe runs: (in `old`, bucket).
    fn slot_of(&self, t: u32, entry: u32) -> Option<(bool, usize)> {
        if self.len == 0 {
            return None;
        }
        if !self.old.is_empty() && home(&self.old, t) >= self.cursor {
            if let Some(i) = slot_in(&self.old, t, entry) {
                return Some((true, i));
            }
        }
        slot_in(&self.buckets, t, entry).map(|i| (false, i))
    }

    /// Stores `entry` under `key`. The caller reserved room; a key stored
    /// twice (for two entries) is found as one of them.
    #[inline]
    pub(crate) fn insert(&mut self, key: u64, entry: u32) {
        let b = Bucket {
            tag: tag(key),
            entry: entry + 1,
        };
        if !self.old.is_empty() {
            return self.insert_growing(b);
        }
        let i = free_slot(&self.buckets, b.tag);
        self.buckets[i] = b;
        self.len += 1;
    }

    /// Removes `entry`, stored under `key`; backward-shifts the rest of its
    /// probe run so no tombstone is left. Returns whether it was there.
    pub(crate) fn remove(&mut self, key: u64, entry: u32) -> bool {
        let Some((in_old, i)) = self.slot_of(tag(key), entry) else {
            return false;
        };
        shift_out(
            if in_old {
                &mut self.old
            } else {
                &mut self.buckets
            },
            i,
        );
        self.len -= 1;
        true
    }

    /// Empties the table, keeping the (new) array's memory.
    pub(crate) fn clear(&mut self) {
        self.old = Vec::new();
        self.cursor = 0;
        self.buckets.fill(Bucket::default());
        self.len = 0;
    }

    /// Every stored entry index, in bucket order (the old array's first).
    pub(crate) fn entries(&self) -> impl Iterator<Item = u32> + '_ {
        self.old
            .iter()
            .chain(&self.buckets)
            .filter(|b| b.entry != 0)
            .map(|b| b.entry - 1)
    }
}

#[cfg(test)]
mod tests;
