//! A KV-aware router's view of one pool, built only from its drained
//! events, as vLLM's router builds it from a `KVEventBatch`: which pages
//! of each tier (medium) are registered, under which hash. Applying a batch
//! checks what a router relies on:
//! - a Stored event's hash is the chain hash of its own token ids under
//!   its parent (or the salt's root), so the ids are the page's content;
//! - a page or hash is stored once until Removed (or Cleared);
//! - Removed names a page the router holds, under the hash it holds.

use std::collections::HashMap;

use kvpool_core::{Events, EVENT_CLEARED, EVENT_REMOVED, EVENT_STORED, MEDIUM_HOST};
use xxhash_rust::xxh3::xxh3_128_with_seed;

pub struct Router {
    seed: u64,
    page_size: usize,
    /// (medium, page) -> hash of every page the router believes registered.
    pages: HashMap<(u8, i32), u128>,
}

/// The chain's value before its first page (`hashing::root`).
pub fn root(salt: i64) -> u128 {
    (0x6b76_706f_6f6c_0001u128 << 64) | salt as u64 as u128
}

/// The chain hash of a page of token ids `ids` under `parent`.
pub fn chain_hash(seed: u64, parent: u128, ids: &[i32]) -> u128 {
    let mut bytes = parent.to_le_bytes().to_vec();
    for t in ids {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_128_with_seed(&bytes, seed)
}

impl Router {
    pub fn new(seed: u64, page_size: usize) -> Self {
        Router {
            seed,
            page_size,
            pages: HashMap::new(),
        }
    }

    /// Pages of `medium` the router believes registered.
    #[allow(dead_code)]
    pub fn len(&self, medium: u8) -> usize {
        self.pages.keys().filter(|k| k.0 == medium).count()
    }

    /// Every registered hash: its device page, if it has a device copy,
    /// and whether it has a host copy.
    #[allow(dead_code)]
    pub fn registered(&self) -> HashMap<u128, (Option<i32>, bool)> {
        let mut out: HashMap<u128, (Option<i32>, bool)> = HashMap::new();
        for (&(medium, page), &h) in &self.pages {
            let e = out.entry(h).or_default();
            if medium == MEDIUM_HOST {
                e.1 = true;
            } else {
                e.0 = Some(page);
            }
        }
        out
    }

    pub fn apply(&mut self, e: &Events) -> Result<(), String> {
        let mut at = 0usize;
        for i in 0..e.len() {
            let hash = (e.hash_hi[i] as u128) << 64 | e.hash_lo[i] as u128;
            let page = e.page[i];
            let medium = e.medium[i];
            match e.kind[i] {
                EVENT_STORED => {
                    let n = e.num_tokens[i] as usize;
                    let ids = e.token_ids.get(at..at + n).ok_or("token_ids too short")?;
                    at += n;
                    if n != self.page_size {
                        return Err(format!("Stored page {page} has {n} token ids"));
                    }
                    let parent = (e.parent_hi[i] as u128) << 64 | e.parent_lo[i] as u128;
                    let from = if parent == 0 { root(e.salt[i]) } else { parent };
                    if chain_hash(self.seed, from, ids) != hash {
                        return Err(format!(
                            "Stored page {page}: its hash is not that of its token ids {ids:?}"
                        ));
                    }
                    if self.pages.iter().any(|(k, &h)| k.0 == medium && h == hash) {
                        return Err(format!(
                            "hash of page {page} stored twice on medium {medium}"
                        ));
                    }
                    if self.pages.insert((medium, page), hash).is_some() {
                        return Err(format!(
                            "page {page} of medium {medium} stored twice without a Removed"
                        ));
                    }
                }
                EVENT_REMOVED => {
                    if e.num_tokens[i] != 0 {
                        return Err(format!("Removed page {page} carries token ids"));
                    }
                    if self.pages.remove(&(medium, page)) != Some(hash) {
                        return Err(format!(
                            "Removed page {page} of medium {medium} under a hash not stored"
                        ));
                    }
                }
                EVENT_CLEARED => self.pages.clear(),
                k => return Err(format!("unknown event kind {k}")),
            }
        }
        if at != e.token_ids.len() {
            return Err("token_ids longer than the Stored events' counts".into());
        }
        Ok(())
    }
}
