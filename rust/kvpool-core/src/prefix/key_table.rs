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
    buckets: Vec<Bucket>,
    len: usize,
}

#[inline]
fn tag(key: u64) -> u32 {
    key as u32
}

impl KeyTable {
    #[inline]
    fn mask(&self) -> usize {
        self.buckets.len().wrapping_sub(1)
    }

    /// Home bucket of a key with tag `t`.
    #[inline]
    fn home(&self, t: u32) -> usize {
        t as usize & self.mask()
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Buckets, empty or not.
    pub(crate) fn buckets(&self) -> usize {
        self.buckets.len()
    }

    pub(crate) fn capacity_bytes(&self) -> usize {
        self.buckets.capacity() * std::mem::size_of::<Bucket>()
    }

    /// Room for `additional` more keys at load <= 1/2, or a typed error with
    /// nothing changed.
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
        let mut grown = KeyTable {
            buckets: crate::memory::zeroed_vec(cap, "prefix index table")?,
            len: 0,
        };
        crate::memory::advise_huge(&grown.buckets);
        for &b in self.buckets.iter().filter(|b| b.entry != 0) {
            grown.insert_bucket(b);
        }
        *self = grown;
        Ok(())
    }

    /// Starts loading `key`'s home bucket into cache (a hint; no effect on
    /// targets without a prefetch instruction).
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        crate::memory::prefetch(&self.buckets, self.home(tag(key)));
    }

    /// The entry stored under `key`: the first whose tag matches and for
    /// which `is_key(entry)` confirms the full key.
    #[inline]
    pub(crate) fn find(&self, key: u64, is_key: impl Fn(u32) -> bool) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let (mask, t) = (self.mask(), tag(key));
        let mut i = self.home(t);
        loop {
            let b = self.buckets[i];
            if b.entry == 0 {
                return None;
            }
            if b.tag == t && is_key(b.entry - 1) {
                return Some(b.entry - 1);
            }
            i = (i + 1) & mask;
        }
    }

    /// Whether `entry` is stored under `key`.
    pub(crate) fn contains(&self, key: u64, entry: u32) -> bool {
        self.slot_of(key, entry)
            .is_some_and(|i| self.buckets[i].tag == tag(key))
    }

    /// The bucket holding `entry` in `key`'s probe run, if it is there.
    fn slot_of(&self, key: u64, entry: u32) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(tag(key));
        loop {
            match self.buckets[i].entry {
                0 => return None,
                e if e == entry + 1 => return Some(i),
                _ => i = (i + 1) & mask,
            }
        }
    }

    /// Stores `entry` under `key`. The caller reserved room; a key stored
    /// twice (for two entries) is found as the first of them.
    #[inline]
    pub(crate) fn insert(&mut self, key: u64, entry: u32) {
        self.insert_bucket(Bucket {
            tag: tag(key),
            entry: entry + 1,
        });
    }

    #[inline]
    fn insert_bucket(&mut self, b: Bucket) {
        let mask = self.mask();
        let mut i = self.home(b.tag);
        while self.buckets[i].entry != 0 {
            i = (i + 1) & mask;
        }
        self.buckets[i] = b;
        self.len += 1;
    }

    /// Removes `entry`, stored under `key`; backward-shifts the rest of its
    /// probe run so no tombstone is left. Returns whether it was there.
    pub(crate) fn remove(&mut self, key: u64, entry: u32) -> bool {
        let Some(mut i) = self.slot_of(key, entry) else {
            return false;
        };
        let mask = self.mask();
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let b = self.buckets[j];
            if b.entry == 0 {
                break;
            }
            // `b` may fill the hole at `i` unless its home lies cyclically
            // in (i, j]: moving it before its home would hide it.
            let home = self.home(b.tag);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(i) & mask) {
                self.buckets[i] = b;
                i = j;
            }
        }
        self.buckets[i] = Bucket::default();
        self.len -= 1;
        true
    }

    /// Empties the table, keeping its memory.
    pub(crate) fn clear(&mut self) {
        self.buckets.fill(Bucket::default());
        self.len = 0;
    }

    /// Every stored entry index, in bucket order.
    pub(crate) fn entries(&self) -> impl Iterator<Item = u32> + '_ {
        self.buckets
            .iter()
            .filter(|b| b.entry != 0)
            .map(|b| b.entry - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::KeyTable;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        // Against a HashMap, with keys crowded into few home buckets so
        // probe runs wrap around the table and deletions shift entries.
        #[test]
        fn matches_a_hash_map(ops in prop::collection::vec((any::<bool>(), 0u64..64, 0u64..4), 1..300)) {
            let mut keys: Vec<u64> = Vec::new(); // entry index -> key
            let mut t = KeyTable::default();
            let mut m: HashMap<u64, u32> = HashMap::new();
            for (add, k, hi) in ops {
                let key = (hi << 40) | k | (k << 32);
                if add && !m.contains_key(&key) {
                    let e = keys.len() as u32;
                    keys.push(key);
                    t.reserve(1).unwrap();
                    t.insert(key, e);
                    m.insert(key, e);
                } else if let Some(e) = m.remove(&key) {
                    prop_assert!(t.remove(key, e));
                }
                prop_assert_eq!(t.len(), m.len());
                for (&key, &e) in &m {
                    prop_assert_eq!(t.find(key, |x| keys[x as usize] == key), Some(e));
                }
                prop_assert_eq!(t.find(u64::MAX, |x| keys[x as usize] == u64::MAX), None);
            }
        }
    }
}
