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
//! every later insert drains `MIGRATE_STEP` more of its buckets, in order,
//! into the new one (`migrate.rs` has the invariants and the proofs).

mod migrate;

use crate::error::{PoolError, Result};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
struct Bucket {
    tag: u32,
    /// Entry index + 1; 0 when the bucket is empty.
    entry: u32,
}

// SAFETY: two u32s; all zeros is the empty bucket.
unsafe impl crate::memory::Zeroable for Bucket {}

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
    /// A growth allocates the new array only; inserts move the keys
    /// (`migrate.rs`). One that needs a bigger array while a growth is
    /// under way first finishes it here, after the allocation succeeded.
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
mod tests {
    use super::migrate::MIGRATE_STEP;
    use super::KeyTable;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        // Against a HashMap, with keys crowded into few home buckets so
        // probe runs wrap around the table and deletions shift entries,
        // and tables small enough that most operations land mid-growth
        // (tests drain MIGRATE_STEP = 2 buckets per insert): inserts,
        // removes, finds, large reserves (which finish a growth at once
        // and start the next) and clears in between.
        #[test]
        fn matches_a_hash_map(ops in prop::collection::vec((0u8..16, 0u64..96, 0u64..4), 1..400)) {
            let mut keys: Vec<u64> = Vec::new(); // entry index -> key
            let mut t = KeyTable::default();
            let mut m: HashMap<u64, u32> = HashMap::new();
            for (op, k, hi) in ops {
                let key = (hi << 40) | k | (k << 32);
                match op {
                    0..=8 if !m.contains_key(&key) => {
                        let e = keys.len() as u32;
                        keys.push(key);
                        t.reserve(1).unwrap();
                        t.insert(key, e);
                        m.insert(key, e);
                    }
                    13 => {
                        t.reserve(k as usize * 3).unwrap();
                        prop_assert!(2 * (t.len() + k as usize * 3) <= t.buckets.len());
                    }
                    14 if k == 0 => {
                        t.clear();
                        m.clear();
                    }
                    15 => {} // a find alone (below)
                    _ => {
                        if let Some(e) = m.remove(&key) {
                            prop_assert!(t.remove(key, e));
                        }
                        prop_assert!(!t.remove(key, u32::MAX - 1));
                    }
                }
                prop_assert_eq!(t.len(), m.len());
                if let Err(e) = t.check() {
                    return Err(TestCaseError::fail(e));
                }
                for (&key, &e) in &m {
                    prop_assert_eq!(t.find(key, |x| keys[x as usize] == key), Some(e));
                    prop_assert!(t.contains(key, e));
                    prop_assert!(!t.contains(key ^ 1, e));
                }
                prop_assert_eq!(t.find(u64::MAX, |x| keys[x as usize] == u64::MAX), None);
                let mut stored: Vec<u32> = t.entries().collect();
                let mut want: Vec<u32> = m.values().copied().collect();
                stored.sort_unstable();
                want.sort_unstable();
                prop_assert_eq!(stored, want);
                let bytes = (t.buckets.capacity() + t.old.capacity()) * 8;
                prop_assert_eq!(t.capacity_bytes(), bytes);
            }
        }
    }

    fn mix(i: u64) -> u64 {
        let z = i.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z ^ (z >> 31)
    }

    #[test]
    fn a_growth_is_spread_over_the_inserts_after_it() {
        let keys: Vec<u64> = (0..1 << 14).map(mix).collect();
        let find = |t: &KeyTable, i: usize| t.find(keys[i], |e| keys[e as usize] == keys[i]);
        let mut t = KeyTable::default();
        t.reserve(2048).unwrap();
        assert_eq!(t.buckets(), 4096);
        (0..2048).for_each(|i| t.insert(keys[i], i as u32));
        // The growing reserve only allocates; the insert after it drains
        // MIGRATE_STEP old buckets (about half of them hold a key).
        t.reserve(1).unwrap();
        assert_eq!(
            (t.buckets.len(), t.old.len(), t.old_keys()),
            (8192, 4096, 2048)
        );
        t.insert(keys[2048], 2048);
        assert!(t.old_keys() >= 2048 - 2 * MIGRATE_STEP, "{}", t.old_keys());
        assert_eq!(t.capacity_bytes(), (8192 + 4096) * 8);
        assert!((0..=2048).all(|i| find(&t, i) == Some(i as u32)));
        // 4096 / MIGRATE_STEP inserts in all drain it, and free it.
        let end = 2048 + 4096 / MIGRATE_STEP;
        for (i, &key) in keys.iter().enumerate().take(end).skip(2049) {
            assert!(!t.old.is_empty());
            t.insert(key, i as u32);
        }
        assert!(t.old.is_empty() && t.old_keys() == 0);
        assert_eq!(
            (t.buckets(), t.capacity_bytes(), t.len()),
            (8192, 8192 * 8, end)
        );
        assert!((0..end).all(|i| find(&t, i) == Some(i as u32)));
        t.check().unwrap();
    }

    #[test]
    fn a_reserve_past_the_new_array_finishes_the_growth_first() {
        let keys: Vec<u64> = (0..1 << 12).map(mix).collect();
        let mut t = KeyTable::default();
        t.reserve(512).unwrap();
        (0..512).for_each(|i| t.insert(keys[i], i as u32));
        t.reserve(1).unwrap();
        t.insert(keys[512], 512);
        assert!(!t.old.is_empty());
        // Mid-growth, room for 1024 more needs 4096 buckets: the drain
        // ends inside this reserve, which then starts the next growth.
        t.reserve(1024).unwrap();
        assert_eq!(
            (t.buckets.len(), t.old.len(), t.old_keys()),
            (4096, 2048, 513)
        );
        for (i, &key) in keys.iter().enumerate().take(1537).skip(513) {
            assert!(!t.old.is_empty());
            t.insert(key, i as u32);
        }
        assert!(t.old.is_empty());
        t.check().unwrap();
        let big = t.reserve(usize::MAX / 4);
        assert!(big.is_err() && t.len() == 1537 && t.buckets() == 4096);
    }
}
