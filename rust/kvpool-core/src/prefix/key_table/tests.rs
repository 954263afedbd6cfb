//! The key table against a HashMap, mid-growth, and how a growth spreads.

use super::{KeyTable, MIGRATE_STEP};
use proptest::prelude::*;
use std::collections::HashMap;

proptest! {
    // Against a HashMap, with keys crowded into few home buckets so
    // probe runs wrap around the table and deletions shift entries,
    // and tables small enough that most operations land mid-growth
    // (tests drain MIGRATE_STEP = 2 buckets per insert): inserts,
    // removes, finds, drains, large reserves (which finish a growth at
    // once and start the next) and clears in between.
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
                12 => t.drain(k as usize % 8),
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
fn drain_moves_as_many_buckets_as_that_many_inserts() {
    let keys: Vec<u64> = (0..2048).map(mix).collect();
    let mut t = KeyTable::default();
    t.reserve(1024).unwrap();
    t.drain(5); // not growing: nothing to do
    (0..1024).for_each(|i| t.insert(keys[i], i as u32));
    t.reserve(1).unwrap();
    assert_eq!((t.old.len(), t.cursor), (2048, 0));
    // Reserves within the new array move nothing; drain(k) moves k *
    // MIGRATE_STEP buckets, and the last one frees the old array.
    t.reserve(1000).unwrap();
    assert_eq!(t.cursor, 0);
    t.drain(100);
    assert_eq!(t.cursor, 100 * MIGRATE_STEP);
    t.check().unwrap();
    t.drain(2048 / MIGRATE_STEP - 101);
    assert_eq!(t.cursor, 2048 - MIGRATE_STEP);
    t.drain(1);
    assert!(t.old.is_empty() && t.buckets() == 4096 && t.len() == 1024);
    t.check().unwrap();
    let find = |i: usize| t.find(keys[i], |e| keys[e as usize] == keys[i]);
    assert!((0..1024).all(|i| find(i) == Some(i as u32)));
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
