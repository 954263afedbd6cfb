//! Helpers shared by the test files (`sharing.rs`, `eviction.rs`, ...); each
//! uses some of them.

#![allow(dead_code)]

use kvpool_core::{Counts, Options, SlotAllocator};

/// A pool of `pages` pages of `ps` slots (8 requests of up to 64 tokens),
/// with a fixed hash seed.
pub fn pool(pages: usize, ps: usize) -> SlotAllocator {
    pool_of_context(pages, ps, 64)
}

/// `pool`, its 8 requests of up to `context` tokens.
pub fn pool_of_context(pages: usize, ps: usize, context: usize) -> SlotAllocator {
    let opts = Options {
        hash_seed: Some(7),
        ..Options::new()
    };
    SlotAllocator::with_options(pages, ps, 8, context, opts).unwrap()
}

pub fn seq(n: usize, from: i64) -> Vec<i64> {
    (from..from + n as i64).collect()
}

/// Opens `prompt`, prefills it, registers it and closes it.
pub fn serve(a: &mut SlotAllocator, prompt: &[i64], salt: i64) -> Vec<i64> {
    let (h, cached) = a
        .open_with_prefix(prompt, &[prompt.len() as i64], Counts::Each(salt))
        .unwrap();
    a.extend(&h, Counts::Each(prompt.len() as i64 - cached[0]), None)
        .unwrap();
    let slots = a.slots(h[0]).unwrap();
    a.close(&h, true).unwrap();
    a.check().unwrap();
    slots
}

/// Cached length and slots of `prompt` when opened now (then closed
/// without caching).
pub fn hit(a: &mut SlotAllocator, prompt: &[i64]) -> (i64, Vec<i64>) {
    let (h, cached) = a
        .open_with_prefix(prompt, &[prompt.len() as i64], Counts::Each(0))
        .unwrap();
    let slots = a.slots(h[0]).unwrap();
    a.close(&h, false).unwrap();
    a.check().unwrap();
    (cached[0], slots)
}
