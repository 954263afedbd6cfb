//! The token ids of every slot (device and host) and the chain hashes
//! computed from them: what registration and lookups hash, verify against
//! and send in events. The arrays are `PrefixIndex`'s (`index.rs`).

use super::index::PrefixIndex;
use super::keys::key_of;
use crate::location::{host_page, is_host};

impl PrefixIndex {
    /// The chain hashes of consecutive pages (their token ids, in order)
    /// chained on from `hash`, into `out`; each one's table bucket is
    /// prefetched as soon as its hash is known, so the probes that follow
    /// overlap their misses.
    #[inline]
    pub(crate) fn hashes_ahead<'t>(
        &self,
        mut hash: u128,
        pages: impl Iterator<Item = &'t [i32]>,
        out: &mut Vec<u128>,
    ) {
        out.clear();
        for tokens in pages {
            hash = self.hasher.page(hash, tokens);
            self.table.prefetch(key_of(hash));
            out.push(hash);
        }
    }

    /// The chain hash of `page`'s tokens under a parent of chain hash `parent`.
    #[inline(always)]
    pub(crate) fn page_hash(&self, parent: u128, page: u32) -> u128 {
        if self.page_size == 1 {
            return self.token_page_hash(parent, page);
        }
        self.hasher.page(parent, self.page_tokens(page))
    }

    /// `page_hash` at page size 1: every token a page, hashed once per
    /// token, by its id, without a slice of it and a match on the slice's
    /// length.
    #[inline(always)]
    pub(crate) fn token_page_hash(&self, parent: u128, page: u32) -> u128 {
        debug_assert_eq!(self.page_size, 1);
        self.hasher.token(parent, self.tokens[page as usize])
    }

    /// Whether every page is one token (page size 1).
    #[inline(always)]
    pub(crate) fn token_pages(&self) -> bool {
        self.page_size == 1
    }

    /// The xxh3-128 chain hash (the one events and `page_hashes` give) of a
    /// page of `tokens` under a parent of that hash `parent`, whichever
    /// chain the index keys by (`hashing.rs`).
    #[inline]
    pub(crate) fn interop_hash(&self, parent: u128, tokens: &[i32]) -> u128 {
        self.hasher.interop(parent, tokens)
    }

    /// The key scratch, lent to a walk that hashes ahead (given back with
    /// `put_hash_scratch`).
    #[inline]
    pub(crate) fn take_hash_scratch(&mut self) -> Vec<u128> {
        std::mem::take(&mut self.hash_scratch)
    }

    #[inline]
    pub(crate) fn put_hash_scratch(&mut self, v: Vec<u128>) {
        self.hash_scratch = v;
    }

    #[inline]
    pub(crate) fn page_tokens(&self, page: u32) -> &[i32] {
        let ps = self.page_size;
        &self.tokens[page as usize * ps..(page as usize + 1) * ps]
    }

    /// The token ids of host page `h`.
    #[inline]
    pub(crate) fn host_page_tokens(&self, h: u32) -> &[i32] {
        let ps = self.page_size;
        &self.host_tokens[h as usize * ps..(h as usize + 1) * ps]
    }

    /// The token ids of the page at `loc`, device or host.
    #[inline]
    pub(crate) fn location_tokens(&self, loc: u32) -> &[i32] {
        if is_host(loc) {
            self.host_page_tokens(host_page(loc))
        } else {
            self.page_tokens(loc)
        }
    }

    /// The token ids at slots `start..start + n`.
    #[inline]
    pub(crate) fn slot_tokens(&self, start: usize, n: usize) -> &[i32] {
        &self.tokens[start..start + n]
    }

    #[inline]
    pub(crate) fn set_token(&mut self, slot: usize, token: i32) {
        self.tokens[slot] = token;
    }

    /// Copies the token ids of slots `src..src + n` to `dst..` (a page
    /// copied on write).
    #[inline]
    pub(crate) fn copy_tokens(&mut self, src: usize, dst: usize, n: usize) {
        self.tokens.copy_within(src..src + n, dst);
    }
}
