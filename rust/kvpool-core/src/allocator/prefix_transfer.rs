//! Prefix-aware transfer between pools (the transfer descriptor
//! [`PrefixChain`] and the calls that make and take it): a sender describes a request's
//! leading full pages by chain hash (plus their token ids and the salt), and
//! a receiver finds how many of them it caches already and opens a request
//! on those pages, so only the rest of the K/V has to move.
//!
//! Safety. The receiver never trusts a hash: a page is matched only if the
//! entry found under the sent hash passes the same verification as a local
//! prefix hit (`prefix/index.rs`): its stored token ids equal the sent tokens of
//! that page, its salt equals the sent salt, and its parent registration is
//! the entry matched for the page before. So a matched page holds KV
//! computed for exactly the sent tokens and salt, whatever the hashes are:
//! a collision, a different `hash_seed` or a forged hash costs a miss,
//! never wrong KV. The tokens cost 4 bytes per token on the wire (far below
//! the K/V) and let the received request be cached at the receiver later.

use super::options::Counts;
use super::SlotAllocator;
use crate::error::{PoolError, Result};
use crate::memory::reserve;
use crate::prefix::hashing::{check_token_ids, root};
use crate::prefix::tip::Match;

/// A request's leading full pages of known tokens, as `chain_hashes` gives
/// them: `hashes[k]` is the chain hash of page k (salt in the root),
/// `tokens` the pages' token ids (`hashes.len() * page_size` of them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixChain {
    pub hashes: Vec<u128>,
    pub tokens: Vec<i32>,
    pub salt: i64,
}

impl SlotAllocator {
    /// The chain of `handle`'s leading full pages whose token ids are known,
    /// hashed with this pool's seed. Read-only (the hash scratch aside).
    ///
    /// Errors: `InvalidHandle`; `InvalidArgument` when the result cannot be
    /// allocated.
    pub fn prefix_chain(&mut self, handle: i64) -> Result<PrefixChain> {
        let row = self.requests.resolve(handle)?;
        let ps = self.geo.page_size;
        let n = self.requests.known_len(row).min(self.requests.len(row)) / ps;
        let salt = self.requests.salt(row);
        let mut tokens = Vec::new();
        reserve(&mut tokens, n * ps, "chain tokens")?;
        for &p in self.requests.pages(row, n) {
            // A swapped-out request's page may be on the host.
            tokens.extend_from_slice(self.prefix.location_tokens(p));
        }
        let mut hashes = Vec::new();
        reserve(&mut hashes, n, "chain hashes")?;
        let mut chain = root(salt);
        for t in tokens.chunks_exact(ps) {
            chain = self.prefix.interop_hash(chain, t);
            hashes.push(chain);
        }
        Ok(PrefixChain {
            hashes,
            tokens,
            salt,
        })
    }

    /// How many leading pages of `chain` this pool caches on the device
    /// (registered, CACHED or HELD), each verified by its tokens, salt and
    /// parent.
    /// Read-only.
    ///
    /// Errors: `InvalidArgument` when `tokens` is not `hashes.len() *
    /// page_size` long or holds an id outside [0, 2^31).
    pub fn match_chain(&self, hashes: &[u128], tokens: &[i64], salt: i64) -> Result<usize> {
        let tokens = self.chain_tokens(hashes, tokens)?;
        Ok(self.prefix.walk_chain(hashes, &tokens, salt, None).pages)
    }

    /// Opens one request holding the first `min(match, max_pages)` pages of
    /// `chain` that this pool caches (refcount + 1 each); its length is that
    /// many pages. The chain's tokens become the request's known prompt, so
    /// extending it over the remaining pages records their token ids and a
    /// later `cache` can register them. Returns `(handle, cached_len)`.
    /// All-or-nothing.
    ///
    /// With `length`, the request is also extended to `length` tokens in the
    /// same call (as `extend` would, evicting if it must), or nothing
    /// happens. The room for its new pages is what is FREE or evictable once
    /// the matched pages are held: a matched CACHED page is room before the
    /// open and not after it (a pinned one never is), so checking
    /// `free_pages` before a separate open and extend is not enough, and
    /// closing such an open again would move its pages to the newest end of
    /// the eviction order. `length` must be in [`cached_len`,
    /// `max_context_len`].
    ///
    /// Errors (nothing changed): `InvalidArgument` (see `match_chain`; a
    /// `length` below `cached_len`), `ContextTooLong` (more tokens than
    /// `max_context_len` in the chain or `length`), `TooManyRequests`,
    /// `Exhausted` (not enough room for `length`, counted as above).
    pub fn open_with_chain(
        &mut self,
        hashes: &[u128],
        tokens: &[i64],
        salt: i64,
        max_pages: usize,
        length: Option<i64>,
    ) -> Result<(i64, usize)> {
        let prompt = self.chain_tokens(hashes, tokens)?;
        if prompt.len() > self.geo.max_context_len {
            return Err(PoolError::ContextTooLong {
                handle: -1,
                length: prompt.len() as u64,
                max: self.geo.max_context_len,
            });
        }
        self.requests.check_available(1, "open_with_chain_hashes")?;
        let mut pages = Vec::new();
        reserve(&mut pages, hashes.len(), "matched pages")?;
        let mut m = self
            .prefix
            .walk_chain(hashes, &prompt, salt, Some(&mut pages));
        if m.pages > max_pages {
            // A matched page is registered: its entry is the chain's tip.
            m = match max_pages
                .checked_sub(1)
                .map(|k| self.prefix.tip_at(self.pages.entry(pages[k])))
            {
                Some(Some((tip, _))) => Match {
                    pages: max_pages,
                    tip,
                },
                _ => Match::root(salt),
            };
        }
        let grow = match length {
            Some(l) => self.chain_growth(l, &pages[..m.pages])?,
            None => 0,
        };
        let mut out = Vec::new();
        reserve(&mut out, grow, "extend output")?;
        out.resize(grow, 0);
        // Apply: nothing below can fail (the extend's checks were made above).
        let row = self.requests.nth_free_row(0);
        self.requests.set_prompt(row, prompt);
        let (handle, cached) = self.open_matched(salt, &m, &pages);
        if grow > 0 {
            let r = self.extend_into(&[handle], Counts::Each(grow as i64), None, &mut out, |_| {});
            if let Err(e) = r {
                // Unreachable (a bug): hand nothing out that the caller cannot close.
                let _ = self.close(&[handle], false);
                return Err(PoolError::Invariant(format!(
                    "open_with_chain's extend failed after its checks passed: {e}"
                )));
            }
        }
        Ok((handle, cached))
    }

    /// Tokens to add after opening on the matched pages `held` so that the
    /// request reaches `length`; checked as `extend` will check them once
    /// the matched pages are held. Read-only.
    fn chain_growth(&self, length: i64, held: &[u32]) -> Result<usize> {
        let (ps, max) = (self.geo.page_size, self.geo.max_context_len);
        let cached = held.len() * ps;
        if length < cached as i64 {
            return Err(PoolError::InvalidArgument(format!(
                "length = {length} is shorter than the {cached} tokens of the chain's pages this \
                 pool caches (within max_pages); pass the total tokens the request must reach, \
                 in [{cached}, {max}] (max_context_len = {max})"
            )));
        }
        if length as u64 > max as u64 {
            return Err(PoolError::ContextTooLong {
                handle: -1,
                length: length as u64,
                max,
            });
        }
        let length = length as usize;
        let needed = self.geo.pages_for(length) - held.len();
        // Held, the matched evictable pages are no longer room.
        let room = self.pages.available() - self.pages.evictable_among(held);
        if needed > room {
            return Err(PoolError::Exhausted {
                needed_pages: needed,
                free_pages: room,
                page_size: ps,
                free_slots: room * ps,
            });
        }
        Ok(length - cached)
    }

    /// The tokens of a chain as i32, checked against its hashes.
    fn chain_tokens(&self, hashes: &[u128], tokens: &[i64]) -> Result<Vec<i32>> {
        let want = hashes.len().checked_mul(self.geo.page_size);
        if want != Some(tokens.len()) {
            return Err(PoolError::InvalidArgument(format!(
                "a chain of {} page hashes needs {} * page_size {} token ids, got {}",
                hashes.len(),
                hashes.len(),
                self.geo.page_size,
                tokens.len()
            )));
        }
        check_token_ids(tokens)?;
        let mut out = Vec::new();
        reserve(&mut out, tokens.len(), "chain tokens")?;
        out.extend(tokens.iter().map(|&x| x as i32));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    /// `page_hashes` is the chain a pool registers: the same hashes as the
    /// pool's own `prefix_chain` of a request holding those tokens.
    #[test]
    fn page_hashes_match_a_pools_chain() {
        use crate::{page_hashes, Counts, Options, SlotAllocator};
        let ps = 4;
        let prompt: Vec<i64> = (0..19).map(|t| t * 37 + 5).collect();
        let o = Options {
            hash_seed: Some(7),
            ..Options::new()
        };
        let mut a = SlotAllocator::with_options(64, ps, 4, 64, o).expect("valid config");
        let (h, _) = a.open_with_prefix(&prompt, &[19], Counts::Each(3)).unwrap();
        a.extend(&h, Counts::Each(19), None).unwrap();
        let chain = a.prefix_chain(h[0]).unwrap();
        assert_eq!(chain.hashes.len(), 4);
        assert_eq!(page_hashes(7, 3, ps, &prompt).unwrap(), chain.hashes);
        assert_ne!(
            page_hashes(7, 0, ps, &prompt).unwrap(),
            chain.hashes,
            "salt"
        );
        assert_ne!(
            page_hashes(8, 3, ps, &prompt).unwrap(),
            chain.hashes,
            "seed"
        );
        assert!(page_hashes(7, 0, 0, &prompt).is_err());
        assert!(page_hashes(7, 0, ps, &[1, -1, 2, 3]).is_err());
    }

    /// A pool without KV events keys its index by its internal chain, yet
    /// gives and takes the xxh3 chain hashes: transfers between pools with
    /// and without events hit as between two alike, at page sizes 1 and 4,
    /// and a sender with another seed or a forged hash still misses.
    #[test]
    fn chains_cross_pools_with_and_without_events() {
        use crate::{page_hashes, Counts, Options, SlotAllocator};
        for ps in [1usize, 4] {
            let prompt: Vec<i64> = (0..19).map(|t| t * 37 + 5).collect();
            let pool = |events: bool, seed: u64| {
                let o = Options {
                    hash_seed: Some(seed),
                    kv_events: events,
                    ..Options::new()
                };
                let mut a = SlotAllocator::with_options(64, ps, 4, 64, o).expect("valid config");
                let (h, _) = a.open_with_prefix(&prompt, &[19], Counts::Each(3)).unwrap();
                a.extend(&h, Counts::Each(19), None).unwrap();
                a.cache(&h).unwrap();
                (a, h[0])
            };
            let pages = 18 / ps;
            for (send_events, take_events) in [(false, true), (true, false), (false, false)] {
                let (mut sender, h) = pool(send_events, 7);
                let chain = sender.prefix_chain(h).unwrap();
                assert_eq!(
                    page_hashes(7, 3, ps, &prompt).unwrap()[..pages],
                    chain.hashes[..pages]
                );
                let toks: Vec<i64> = chain.tokens.iter().map(|&t| t as i64).collect();
                let (receiver, _) = pool(take_events, 7);
                assert_eq!(
                    receiver.match_chain(&chain.hashes, &toks, 3).unwrap(),
                    chain.hashes.len()
                );
                assert_eq!(
                    receiver.match_chain(&chain.hashes, &toks, 4).unwrap(),
                    0,
                    "salt"
                );
                let mut forged = chain.hashes.clone();
                forged[2] ^= 1;
                assert_eq!(
                    receiver.match_chain(&forged, &toks, 3).unwrap(),
                    2,
                    "forged hash"
                );
                let (other_seed, _) = pool(take_events, 8);
                assert_eq!(
                    other_seed.match_chain(&chain.hashes, &toks, 3).unwrap(),
                    0,
                    "seed"
                );
                receiver.check().unwrap();
            }
        }
    }
}
