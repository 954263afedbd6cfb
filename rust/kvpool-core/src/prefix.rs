//! Prefix caching on top of the index: `open_with_prefix` (lookup + hits)
//! and `cache` (registration of a request's full pages of known tokens).

use crate::allocator::{Counts, SlotAllocator};
use crate::error::{PoolError, Result};
use crate::handle::handle_row;
use crate::hashing::{check_token_ids, push_token_ids};
use crate::index::LOOKAHEAD;
use crate::lookup::{ChainTip, Match};
use crate::memory::{reserve, reserve_exact};

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
        self.check_rows_available(n)?;
        // Everything that allocates happens before the first change. Each
        // prompt goes straight into the buffer of the row it will open in
        // (rows are taken from the top of the free stack): a free row's
        // prompt means nothing, so filling it changes nothing observable,
        // and the prompt is converted and copied once.
        let (mut handles, mut cached) = (Vec::new(), Vec::new());
        reserve(&mut handles, n, "handles")?;
        reserve(&mut cached, n, "cached lengths")?;
        let mut matches = Vec::new();
        reserve(&mut matches, n, "prefix matches")?;
        let mut hit_pages = Vec::new();
        reserve(&mut hit_pages, total / self.page_size, "prefix matches")?;
        // Each row's old prompt capacity, given back if a later prompt has a
        // bad token id or cannot be allocated: a failed call leaves even
        // `metadata_bytes` as it was.
        let mut caps = Vec::new();
        reserve(&mut caps, n, "prompt buffers")?;
        let mut k = 0usize;
        for (i, &l) in lengths.iter().enumerate() {
            let row = self.nth_free_row(i);
            let mut p = std::mem::take(&mut self.cold[row].prompt);
            caps.push(p.capacity());
            p.clear();
            let filled = reserve_exact(&mut p, l as usize, "prompt tokens").and_then(|()| {
                match push_token_ids(&mut p, &tokens[k..k + l as usize]) {
                    true => Ok(self.match_prefix(&p, salt.get(i), &mut hit_pages)),
                    // Names the first bad id (one is there: the pass saw it).
                    false => check_token_ids(tokens).and_then(|()| {
                        Err(PoolError::InvalidArgument(
                            "a token id is out of range".into(),
                        ))
                    }),
                }
            });
            self.cold[row].prompt = p;
            match filled {
                Ok(m) => matches.push(m),
                Err(e) => {
                    self.restore_prompt_capacity(&caps);
                    return Err(e);
                }
            }
            k += l as usize;
        }
        // Apply: nothing below can fail.
        let mut hp = 0usize;
        for (i, m) in matches.into_iter().enumerate() {
            let (handle, len) = self.open_matched(salt.get(i), &m, &hit_pages[hp..]);
            hp += m.pages;
            handles.push(handle);
            cached.push(len as i64);
        }
        Ok((handles, cached))
    }

    /// Gives the next `caps.len()` free rows their old prompt capacities.
    fn restore_prompt_capacity(&mut self, caps: &[usize]) {
        for (j, &cap) in caps.iter().enumerate() {
            let r = self.nth_free_row(j);
            let p = &mut self.cold[r].prompt;
            p.clear();
            p.shrink_to(cap);
        }
    }

    /// Opens one request on the matched pages `hit_pages[..m.pages]`, in
    /// the next free row (the caller checked there is one), whose prompt
    /// buffer holds the request's prompt. Returns `(handle, cached_len)`.
    pub(crate) fn open_matched(&mut self, salt: i64, m: &Match, hit_pages: &[u32]) -> (i64, usize) {
        let next = self.nth_free_row(0);
        let prompt = std::mem::take(&mut self.cold[next].prompt);
        let (row, handle) = self.take_row();
        let base = row * self.row_pages;
        let len = m.pages * self.page_size;
        let hits = &hit_pages[..m.pages];
        self.hold_pages(hits);
        self.page_lists[base..base + m.pages].copy_from_slice(hits);
        self.hit_tokens += len as u64;
        self.miss_tokens += prompt.len().saturating_sub(len) as u64;
        let cold = &mut self.cold[row];
        cold.reset(salt);
        cold.prompt = prompt;
        cold.hashed_pages = m.pages as u32;
        cold.tip = m.tip;
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
        let base = row * self.row_pages;
        let mut ring = std::mem::take(&mut self.index.hash_scratch);
        // The chain's tip and length live in locals while the row grows:
        // each page's registration starts from the one before.
        let (salt, mut tip) = (self.cold[row].salt, self.cold[row].tip);
        let mut k = self.cold[row].hashed_pages as usize;
        let mut broken = false;
        'restart: while k < upto {
            // The chain hash is serial (each page's waits on the one
            // before), so it runs a chunk of LOOKAHEAD pages ahead of the
            // registrations, in the same loop: the CPU overlaps the next
            // chunk's hashing with this page's probe and inserts instead
            // of doing one after the other (cache_4096 at page 16, once keys
            // were the chain hash: 5.5 -> 5.0 us). Each chunk's buckets and
            // registrations are prefetched together as it starts: a big
            // index misses cache and TLB on each, and those misses overlap
            // only when the prefetches are issued back to back (prefetching
            // each bucket as its hash came out, one per registration,
            // measured 145 -> 212 us at page 1). Page k's hash is
            // `ring[(k - k0) % LOOKAHEAD]`.
            let k0 = k;
            let ix = &self.index;
            let first = &self.page_lists[base + k..base + upto.min(k + LOOKAHEAD)];
            let mut last = tip.hash;
            ring.clear();
            for &p in first {
                last = ix.hasher.page(last, ix.page_tokens(p));
                ring.push(last);
            }
            while k < upto {
                let j = k - k0;
                let ix = &self.index;
                if j % LOOKAHEAD == 0 {
                    let end = upto.min(k + LOOKAHEAD);
                    // A chunk starts at slot 0: its pages' hashes are ring[..].
                    for (&h, &p) in ring.iter().zip(&self.page_lists[base + k..base + end]) {
                        ix.table.prefetch(crate::keys::key_of(h));
                        crate::memory::prefetch(&ix.state, p as usize);
                    }
                    let next = &self.page_lists[base + end..base + upto.min(end + LOOKAHEAD)];
                    for &p in next {
                        crate::memory::prefetch(&ix.tokens, p as usize * self.page_size);
                    }
                }
                let slot = j % LOOKAHEAD;
                let h = ring[slot];
                if k + LOOKAHEAD < upto {
                    let p = self.page_lists[base + k + LOOKAHEAD];
                    last = ix.hasher.page(last, ix.page_tokens(p));
                    ring[slot] = last;
                }
                let p = self.page_lists[base + k];
                match self.register_page(p, k == 0, h, &tip, salt) {
                    Some(next) => tip = next,
                    None => {
                        broken = true;
                        break 'restart;
                    }
                }
                k += 1;
                if tip.hash != h {
                    // The tip is an entry found under this hash's key whose
                    // own hash differs (only a test's weak hash gets here):
                    // chain the rest on from the entry, as a lookup would.
                    continue 'restart;
                }
            }
        }
        let c = &mut self.cold[row];
        c.tip = tip;
        c.hashed_pages = k as u32;
        c.chain_broken |= broken;
        self.index.hash_scratch = ring;
    }

    /// Registers page `p` (chain hash `h`; `first`: page 0 of its chain)
    /// as the child of `parent`; returns the chain's new tip, or None when
    /// the chain must stop there (a collision).
    fn register_page(
        &mut self,
        p: u32,
        first: bool,
        h: u128,
        parent: &ChainTip,
        salt: i64,
    ) -> Option<ChainTip> {
        let ix = &mut self.index;
        match ix.lookup(crate::keys::key_of(h)).map(|(i, e)| (i, *e)) {
            None if !ix.is_registered(p) => {
                let tip = ix.register(p, h, parent, salt);
                let parent_hash = if first { 0 } else { parent.hash };
                self.events
                    .stored(h, parent_hash, p, salt, ix.page_tokens(p));
                Some(tip)
            }
            Some((i, e)) if e.page == p && ix.idents[i as usize].salt == salt => {
                // This very page: its content was computed on this
                // request's prefix, so (re)link it to the current parent.
                ix.entries[i as usize].parent_reg = parent.reg;
                ix.set_hint(parent, i);
                Some(ix.tip(i))
            }
            Some((i, _)) if ix.verify(i, ix.page_tokens(p), salt, parent.reg) => {
                // A duplicate: keep the existing copy (its chain hash is
                // the one this page would get: same tokens, same salt).
                ix.set_hint(parent, i);
                Some(ix.tip(i))
            }
            _ => None,
        }
    }
}
