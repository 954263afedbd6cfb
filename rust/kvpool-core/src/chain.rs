//! Prefix-aware transfer between pools: a sender describes a request's
//! leading full pages by chain hash (plus their token ids and the salt), and
//! a receiver finds how many of them it caches already and opens a request
//! on those pages, so only the rest of the K/V has to move.
//!
//! Safety. The receiver never trusts a hash: a page is matched only if the
//! entry found under the sent hash passes the same verification as a local
//! prefix hit (`index.rs`): its stored token ids equal the sent tokens of
//! that page, its salt equals the sent salt, and its parent registration is
//! the entry matched for the page before. So a matched page holds KV
//! computed for exactly the sent tokens and salt, whatever the hashes are:
//! a collision, a different `hash_seed` or a forged hash costs a miss,
//! never wrong KV. The tokens cost 4 bytes per token on the wire (far below
//! the K/V) and let the received request be cached at the receiver later.

use crate::error::{PoolError, Result};
use crate::lookup::Match;
use crate::memory::reserve;
use crate::SlotAllocator;

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
        let row = self.resolve(handle)?;
        let ps = self.page_size;
        let c = &self.cold[row];
        let n = (self.known_len[row].min(self.rows[row].len) as usize) / ps;
        let salt = c.salt;
        let mut tokens = Vec::new();
        reserve(&mut tokens, n * ps, "chain tokens")?;
        let base = row * self.row_pages;
        for &p in &self.page_lists[base..base + n] {
            tokens.extend_from_slice(self.index.page_tokens(p));
        }
        let mut hashes = Vec::new();
        reserve(&mut hashes, n, "chain hashes")?;
        let mut chain = crate::hashing::root(salt);
        for t in tokens.chunks_exact(ps) {
            chain = self.index.hasher.page(chain, t);
            hashes.push(chain);
        }
        Ok(PrefixChain {
            hashes,
            tokens,
            salt,
        })
    }

    /// How many leading pages of `chain` this pool caches (registered,
    /// CACHED or HELD), each verified by its tokens, salt and parent.
    /// Read-only.
    ///
    /// Errors: `InvalidArgument` when `tokens` is not `hashes.len() *
    /// page_size` long or holds an id outside [0, 2^31).
    pub fn match_chain(&self, hashes: &[u128], tokens: &[i64], salt: i64) -> Result<usize> {
        let tokens = self.chain_tokens(hashes, tokens)?;
        Ok(self.walk_chain(hashes, &tokens, salt, None).pages)
    }

    /// Opens one request holding the first `min(match, max_pages)` pages of
    /// `chain` that this pool caches (refcount + 1 each); its length is that
    /// many pages. The chain's tokens become the request's known prompt, so
    /// extending it over the remaining pages records their token ids and a
    /// later `cache` can register them. Returns `(handle, cached_len)`.
    /// All-or-nothing.
    ///
    /// Errors (nothing changed): `InvalidArgument` (see `match_chain`),
    /// `ContextTooLong` (more tokens than `max_context_len`),
    /// `TooManyRequests`.
    pub fn open_with_chain(
        &mut self,
        hashes: &[u128],
        tokens: &[i64],
        salt: i64,
        max_pages: usize,
    ) -> Result<(i64, usize)> {
        let prompt = self.chain_tokens(hashes, tokens)?;
        if prompt.len() > self.max_context_len {
            return Err(PoolError::ContextTooLong {
                handle: -1,
                length: prompt.len() as u64,
                max: self.max_context_len,
            });
        }
        self.check_rows_available(1)?;
        let mut pages = Vec::new();
        reserve(&mut pages, hashes.len(), "matched pages")?;
        let mut m = self.walk_chain(hashes, &prompt, salt, Some(&mut pages));
        if m.pages > max_pages {
            // A matched page is registered: its entry is the chain's tip.
            m = match max_pages
                .checked_sub(1)
                .map(|k| self.index.tip_of(pages[k]))
            {
                Some(Some((tip, _))) => Match {
                    pages: max_pages,
                    tip,
                },
                _ => Match::root(salt),
            };
        }
        // Apply: nothing below can fail.
        let row = self.nth_free_row(0);
        self.cold[row].set_prompt(prompt);
        Ok(self.open_matched(salt, &m, &pages))
    }

    /// The tokens of a chain as i32, checked against its hashes.
    fn chain_tokens(&self, hashes: &[u128], tokens: &[i64]) -> Result<Vec<i32>> {
        let want = hashes.len().checked_mul(self.page_size);
        if want != Some(tokens.len()) {
            return Err(PoolError::InvalidArgument(format!(
                "a chain of {} page hashes needs {} * page_size {} token ids, got {}",
                hashes.len(),
                hashes.len(),
                self.page_size,
                tokens.len()
            )));
        }
        crate::hashing::check_token_ids(tokens)?;
        let mut out = Vec::new();
        reserve(&mut out, tokens.len(), "chain tokens")?;
        out.extend(tokens.iter().map(|&x| x as i32));
        Ok(out)
    }

    /// Walks the chain through the index while each entry verifies.
    fn walk_chain(
        &self,
        hashes: &[u128],
        tokens: &[i32],
        salt: i64,
        mut out: Option<&mut Vec<u32>>,
    ) -> Match {
        let mut m = Match::root(salt);
        for (&h, t) in hashes.iter().zip(tokens.chunks_exact(self.page_size)) {
            // Filed under the sent hash's key, and the hash must be the
            // entry's (a sender with another seed misses); verification
            // then checks the page's tokens, salt and parent, so the sent
            // hash is never trusted and this pool need not hash anything.
            let ix = &self.index;
            match ix.lookup(crate::keys::key_of(h)) {
                Some((i, e))
                    if ix.idents[i as usize].hash == h && ix.verify(i, t, salt, m.tip.reg) =>
                {
                    if let Some(o) = out.as_deref_mut() {
                        o.push(e.page);
                    }
                    m.tip = ix.tip(i);
                    m.pages += 1;
                }
                _ => break,
            }
        }
        m
    }
}
