//! The hit-length oracle of `hit_oracle.rs`: what an ideal prefix cache
//! could serve a prompt, computed from outside the allocator.
//!
//! Its view of the index is a router's (`router/`): the pages registered
//! on each tier, learnt only from the drained KV events, each under the
//! chain hash of its salt and token prefix (the router checks that hash
//! against the Stored event's token ids). A prompt's chain hashes are
//! computed here the same way, so "page k of this prompt is registered"
//! is "its hash is", whatever page or entry kvpool keeps it in.
//!
//! kvpool links each registration to its parent's registration, not to
//! its parent's hash: a page registered under a registration that later
//! went (evicted, or dropped before an in-place write) is an orphan, which
//! no lookup reaches (trusting the hash alone is what verification
//! avoids) until the same parent content is registered again on the same
//! prefix, which revives the parent's registration (`prefix/ghosts.rs`).
//! The oracle follows registrations without revival (`Registry`): a page
//! is reachable when its hash is registered and the registration it was
//! stored under is the parent hash's current one, a lower bound.
//!
//! Two ideals, both capped at `(len - 1) / page_size` pages:
//! - `reachable`: the longest prefix whose every page is reachable. kvpool
//!   must serve at least that (a host page needs a device page to load
//!   into: with a host tier the bound holds when the batch's hits cannot
//!   run short of pages). Serving less is a chain break in the index.
//! - `registered`: the longest prefix whose every page's hash is
//!   registered on some tier. kvpool must serve at most that: more is KV
//!   nobody registered. Between the two lie orphans: resident, registered
//!   (a router that reads the events believes them cached), served once
//!   their gone parent is revived (`ghost_revival.rs` checks the hit is
//!   then exactly `registered`), or once a request recomputes their
//!   content, which replaces them.
//!
//! A take-over (a recomputed page becomes the copy of a registration
//! whose page nobody held) is reported as a Removed event and a Stored
//! event of the same hash, back to back: the registration, and what is
//! registered under it, stays.

#![allow(dead_code)]

use std::collections::{HashMap, HashSet};

use kvpool_core::{Events, EVENT_REMOVED, EVENT_STORED};

use crate::router::{chain_hash, root, Router};

/// One prompt's chain hashes, page by page, up to the hit cap.
pub fn prompt_hashes(seed: u64, ps: usize, salt: i64, prompt: &[i32]) -> Vec<u128> {
    let cap = prompt.len().saturating_sub(1) / ps;
    page_hashes(seed, ps, salt, &prompt[..cap * ps])
}

/// The chain hashes of every full page of `tokens`.
pub fn page_hashes(seed: u64, ps: usize, salt: i64, tokens: &[i32]) -> Vec<u128> {
    let mut parent = root(salt);
    tokens
        .chunks_exact(ps)
        .map(|t| {
            parent = chain_hash(seed, parent, t);
            parent
        })
        .collect()
}

/// Registrations as the events tell them: one per hash from its first
/// Stored event on any tier to its last copy's Removed event, and the
/// parent registration each was stored under.
#[derive(Default)]
pub struct Registry {
    pub next: u64,
    /// Live hash -> (registration, its parent's registration, copies).
    pub live: HashMap<u128, (u64, u64, u32)>,
}

impl Registry {
    pub fn apply(&mut self, e: &Events) {
        // The registration the event just before dropped, if it dropped
        // one: a Stored event of the same hash right after it, under the
        // same parent registration, is a take-over (the page changed, the
        // registration stayed, and its children with it). A registration
        // dropped for good and registered again is never reported so: the
        // eviction and the new registration are different calls.
        let mut dropped: Option<(u128, u64, u64)> = None;
        for i in 0..e.len() {
            let hash = (e.hash_hi[i] as u128) << 64 | e.hash_lo[i] as u128;
            let just = dropped.take();
            match e.kind[i] {
                EVENT_STORED => {
                    let parent = (e.parent_hi[i] as u128) << 64 | e.parent_lo[i] as u128;
                    let under = if parent == 0 {
                        0
                    } else {
                        self.live.get(&parent).map_or(u64::MAX, |x| x.0)
                    };
                    let next = &mut self.next;
                    let r = self.live.entry(hash).or_insert_with(|| match just {
                        Some((h, reg, u)) if h == hash && u == under => (reg, under, 0),
                        _ => {
                            *next += 1;
                            (*next, under, 0)
                        }
                    });
                    r.2 += 1;
                }
                EVENT_REMOVED => {
                    let r = self.live.get_mut(&hash).expect("Removed names a live hash");
                    r.2 -= 1;
                    if r.2 == 0 {
                        let (reg, under, _) = self.live.remove(&hash).unwrap();
                        dropped = Some((hash, reg, under));
                    }
                }
                _ => self.live.clear(),
            }
        }
    }

    /// Pages of `hashes` reachable from the first: each registered under
    /// the registration the page before has now.
    pub fn reachable(&self, hashes: &[u128]) -> usize {
        let mut parent = 0u64;
        let mut n = 0;
        for h in hashes {
            match self.live.get(h) {
                Some(&(reg, under, _)) if under == parent => parent = reg,
                _ => break,
            }
            n += 1;
        }
        n
    }
}

/// What the ideal cache holds when a batch of prompts is opened.
pub struct Ideal {
    /// Registered hashes: device page, if any, and whether a host copy is.
    pub reg: HashMap<u128, (Option<i32>, bool)>,
}

impl Ideal {
    pub fn new(router: &Router) -> Self {
        Ideal {
            reg: router.registered(),
        }
    }

    /// Pages of `hashes` registered, from the first, without a gap.
    pub fn registered(&self, hashes: &[u128]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.reg.contains_key(h))
            .count()
    }

    /// Pages a batch's registered hits take out of the pool's available
    /// ones (FREE + evictable) when the batch opens: a host-only hit loads
    /// into one, an unheld device hit stops being evictable. `held_pages`:
    /// device pages open requests hold (a page only a queued copy holds
    /// counts as unheld, which only overstates the need).
    pub fn pages_needed(&self, batch: &[Vec<u128>], held_pages: &HashSet<i32>) -> usize {
        let mut seen = HashSet::new();
        let mut need = 0;
        for hashes in batch {
            for h in &hashes[..self.registered(hashes)] {
                if !seen.insert(*h) {
                    continue;
                }
                match self.reg[h].0 {
                    Some(p) if held_pages.contains(&p) => {}
                    _ => need += 1,
                }
            }
        }
        need
    }
}
