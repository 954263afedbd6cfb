//! Prefix caching on top of the index: `open_with_prefix` (lookup + hits)
//! and `cache` (registration of a request's full pages of known tokens).

use crate::allocator::{Counts, SlotAllocator};
use crate::error::{PoolError, Result};
use crate::handle::handle_row;
use crate::hashing::root;
use crate::index::LOOKAHEAD;
use crate::keys::root_key;
use crate::memory::reserve;

/// A prompt's longest verified cached prefix, found before anything changes.
pub(crate) struct Match {
    pub(crate) pages: usize,
    pub(crate) chain: u128,
    pub(crate) key: u64,
    pub(crate) chain_reg: u64,
}

impl Match {
    /// No page matched yet.
    pub(crate) fn root(salt: i64) -> Self {
        Match {
            pages: 0,
            chain: root(salt),
            key: root_key(salt),
            chain_reg: 0,
        }
    }
}

impl SlotAllocator {
    /// Opens one request per prompt and gives each the longest cached prefix
    /// of full pages, capped so at least one token is left to compute:
    /// `cached_len <= length - 1`, rounded down to a page boundary.
    ///
    /// `tokens` is the concatenation of the prompts, `lengths[i]` prompt i's
    /// length, `salt` one value for all or one per prompt (requests with
    /// different salts never share). Each request's length is its
    /// `cached_len`; the core keeps its prompt, and later extends take the
    /// prompt's token ids. Returns `(handles, cached_lens)`. All-or-nothing.
    ///
    /// Errors (nothing changed): `InvalidArgument` (tokens and lengths
    /// disagree, a negative length, a token id outside [0, 2^31), salts of the
    /// wrong length), `ContextTooLong`, `TooManyRequests`.
    pub fn open_with_prefix(
        &mut self,
        tokens: &[i64],
        lengths: &[i64],
        salt: Counts<'_>,
    ) -> Result<(Vec<i64>, Vec<i64>)> {
        let n = lengths.len();
        salt.check_len("salt", n)?;
        let mut total = 0usize;
        for (i, &l) in lengths.iter().enumerate() {
            if l < 0 {
                return Err(PoolError::InvalidArgument(format!(
                    "lengths[{i}] = {l} is negative; prompt lengths must be >= 0"
                )));
            }
            if l as u64 > self.max_context_len as u64 {
                return Err(PoolError::ContextTooLong {
                    handle: -1,
                    length: l as u64,
                    max: self.max_context_len,
                });
            }
            total += l as usize;
        }
        if total != tokens.len() {
            return Err(PoolError::InvalidArgument(format!(
                "lengths add up to {total} tokens but tokens has {}; tokens must be the \
                 concatenation of the prompts",
                tokens.len()
            )));
        }
        crate::hashing::check_token_ids(tokens)?;
        self.check_rows_available(n)?;
        // Everything that allocates happens before the first change.
        let mut prompts: Vec<Vec<i32>> = Vec::new();
        reserve(&mut prompts, n, "prompts")?;
        let mut k = 0usize;
        for &l in lengths {
            let mut p = Vec::new();
            reserve(&mut p, l as usize, "prompt tokens")?;
            p.extend(tokens[k..k + l as usize].iter().map(|&x| x as i32));
            prompts.push(p);
            k += l as usize;
        }
        let (mut handles, mut cached) = (Vec::new(), Vec::new());
        reserve(&mut handles, n, "handles")?;
        reserve(&mut cached, n, "cached lengths")?;
        let mut matches = Vec::new();
        reserve(&mut matches, n, "prefix matches")?;
        let mut hit_pages = Vec::new();
        reserve(&mut hit_pages, total / self.page_size, "prefix matches")?;
        for (i, p) in prompts.iter().enumerate() {
            matches.push(self.match_prefix(p, salt.get(i), &mut hit_pages));
        }
        // Apply: nothing below can fail.
        let mut hp = 0usize;
        for (i, (prompt, m)) in prompts.into_iter().zip(matches).enumerate() {
            let (handle, len) = self.open_matched(prompt, salt.get(i), &m, &hit_pages[hp..]);
            hp += m.pages;
            handles.push(handle);
            cached.push(len as i64);
        }
        Ok((handles, cached))
    }

    /// Opens one request on the matched pages `hit_pages[..m.pages]` (a
    /// row is free: the caller checked). Returns `(handle, cached_len)`.
    pub(crate) fn open_matched(
        &mut self,
        prompt: Vec<i32>,
        salt: i64,
        m: &Match,
        hit_pages: &[u32],
    ) -> (i64, usize) {
        let (row, handle) = self.take_row();
        let base = row * self.row_pages;
        let len = m.pages * self.page_size;
        for (k, &p) in hit_pages[..m.pages].iter().enumerate() {
            self.hold_page(p);
            self.page_lists[base + k] = p;
        }
        self.hit_tokens += len as u64;
        self.miss_tokens += prompt.len().saturating_sub(len) as u64;
        let cold = &mut self.cold[row];
        cold.reset(salt);
        cold.set_prompt(prompt);
        cold.hashed_pages = m.pages as u32;
        cold.chain = m.chain;
        cold.chain_key = m.key;
        cold.chain_reg = m.chain_reg;
        cold.exclusive = m.pages == 0;
        self.known_len[row] = len as u32;
        let last = if m.pages == 0 {
            0
        } else {
            self.page_lists[base + m.pages - 1]
        };
        self.rows[row].len = len as u32;
        self.rows[row].last = last | self.slow_bit(row, len, last);
        (handle, len)
    }

    /// Walks `prompt`'s pages through the index while each hit verifies;
    /// appends the hit pages to `out`. Read-only (the key scratch aside).
    ///
    /// Keys are computed `LOOKAHEAD` pages at a time and their buckets
    /// prefetched before the first probe, so the probes' cache misses
    /// overlap. No chain hash is computed: a verified hit's entry holds it.
    fn match_prefix(&mut self, prompt: &[i32], salt: i64, out: &mut Vec<u32>) -> Match {
        let ps = self.page_size;
        let max_pages = prompt.len().saturating_sub(1) / ps;
        let mut m = Match::root(salt);
        let mut keys = std::mem::take(&mut self.index.key_scratch);
        let ix = &self.index;
        'chunks: for chunk in prompt[..max_pages * ps].chunks(LOOKAHEAD * ps) {
            ix.keys_ahead(m.key, chunk.chunks_exact(ps), &mut keys);
            for (&key, page_tokens) in keys.iter().zip(chunk.chunks_exact(ps)) {
                match ix.lookup(key) {
                    Some(e) if ix.verify(e, page_tokens, salt, m.chain_reg) => {
                        out.push(e.page);
                        m.chain = e.hash;
                        m.key = key;
                        m.chain_reg = e.reg;
                        m.pages += 1;
                    }
                    _ => break 'chunks,
                }
            }
        }
        self.index.key_scratch = keys;
        m
    }

    /// Registers every full page of each request whose token ids are all
    /// known and that is not registered yet, so later prompts can hit it.
    /// Call it once the step that wrote those pages has run. All-or-nothing.
    /// Errors: `InvalidHandle` (e.g. a closed request), `InvalidArgument`
    /// (a handle twice; the index cannot grow).
    pub fn cache(&mut self, handles: &[i64]) -> Result<()> {
        self.resolve_batch(handles)?;
        self.register_batch(handles)
    }

    /// Registers the handles' pages; the handles are resolved already.
    pub(crate) fn register_batch(&mut self, handles: &[i64]) -> Result<()> {
        let mut todo = 0usize;
        for &h in handles {
            let row = handle_row(h) as usize;
            todo += self
                .registrable_pages(row)
                .saturating_sub(self.cold[row].hashed_pages as usize);
        }
        // `todo` counts a page shared by forked requests once per holder;
        // no call registers more pages than the pool has unregistered.
        let todo = todo.min(self.index.room());
        self.index.reserve(todo)?;
        self.events.reserve(todo, self.page_size)?;
        for &h in handles {
            self.register_row(handle_row(h) as usize);
        }
        Ok(())
    }

    /// Full pages of `row` whose every token id is known.
    fn registrable_pages(&self, row: usize) -> usize {
        let c = &self.cold[row];
        if c.chain_broken {
            return 0;
        }
        (self.known_len[row].min(self.rows[row].len) as usize) / self.page_size
    }

    /// Continues `row`'s chain over its registrable pages. A page whose hash
    /// is registered already for a different page with the same content and
    /// parent is a duplicate: the existing entry stays (see `index.rs`). A
    /// mismatch (a collision) stops the row's chain for good.
    fn register_row(&mut self, row: usize) {
        let upto = self.registrable_pages(row);
        if upto > self.cold[row].hashed_pages as usize {
            self.cold[row].exclusive = false;
        }
        let (base, ps) = (row * self.row_pages, self.page_size);
        let mut keys = std::mem::take(&mut self.index.key_scratch);
        let mut k = self.cold[row].hashed_pages as usize;
        'chunks: while k < upto {
            // The chunk's keys first, with their buckets and registrations
            // prefetched: a big index misses cache on each, and the misses
            // then overlap instead of queueing (as in `match_prefix`).
            let pages = &self.page_lists[base + k..base + upto.min(k + LOOKAHEAD)];
            let ix = &self.index;
            let tokens = pages
                .iter()
                .map(|&p| &ix.tokens[p as usize * ps..(p as usize + 1) * ps]);
            ix.keys_ahead(self.cold[row].chain_key, tokens, &mut keys);
            for &p in pages {
                crate::memory::prefetch(&ix.page_entry, p as usize);
            }
            for &key in &keys {
                if !self.register_page(row, base, k, key) {
                    self.cold[row].chain_broken = true;
                    break 'chunks;
                }
                k += 1;
            }
        }
        self.index.key_scratch = keys;
    }

    /// Registers page `k` of `row` (lookup key `key`), continuing its chain;
    /// false when the chain must stop there (a collision).
    fn register_page(&mut self, row: usize, base: usize, k: usize, key: u64) -> bool {
        let p = self.page_lists[base + k];
        let (chain, parent_reg, salt) = {
            let c = &self.cold[row];
            (c.chain, c.chain_reg, c.salt)
        };
        let ps = self.page_size;
        let ptoks = &self.index.tokens[p as usize * ps..(p as usize + 1) * ps];
        let h = self.index.hasher.page(chain, ptoks);
        let found = self.index.find(key);
        let reg = match found.map(|i| (i, self.index.entries[i as usize])) {
            None if !self.index.is_registered(p) => {
                let parent_hash = if k == 0 { 0 } else { chain };
                let reg = self.index.register(p, h, key, parent_reg, salt);
                let toks = self.index.page_tokens(p);
                self.events.stored(h, parent_hash, p, salt, toks);
                Some(reg)
            }
            Some((i, e)) if e.page == p && e.salt == salt => {
                // This very page: its content was computed on this
                // request's prefix, so (re)link it to the current parent.
                self.index.entries[i as usize].parent_reg = parent_reg;
                Some(e.reg)
            }
            Some((_, e))
                if self
                    .index
                    .verify(&e, self.index.page_tokens(p), salt, parent_reg) =>
            {
                Some(e.reg) // a duplicate: keep the existing copy
            }
            _ => None,
        };
        let c = &mut self.cold[row];
        match reg {
            Some(reg) => {
                c.chain = h;
                c.chain_key = key;
                c.chain_reg = reg;
                c.hashed_pages = k as u32 + 1;
                true
            }
            None => false,
        }
    }
}
