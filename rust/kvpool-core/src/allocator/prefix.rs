//! Prefix hits: `open_with_prefix` looks each prompt up in the index and
//! opens its request on the cached pages found (registration is
//! `cache.rs`).

use super::options::Counts;
use super::SlotAllocator;
use crate::error::{PoolError, Result};
use crate::location::is_host;
use crate::memory::{reserve, reserve_exact};
use crate::prefix::hashing::{check_token_ids, push_token_ids};
use crate::prefix::tip::{ChainTip, Match};

impl SlotAllocator {
    /// The checks of a batch of prompts (`open_with_prefix`'s, in its order):
    /// salts of the right length, each length in [0, max_context_len], the
    /// lengths adding up to `tokens`, a free row per prompt.
    pub(crate) fn check_prompt_batch(
        &self,
        tokens: &[i64],
        lengths: &[i64],
        salt: Counts<'_>,
    ) -> Result<()> {
        let n = lengths.len();
        salt.check_len("salt", n)?;
        let mut total = 0usize;
        for (i, &l) in lengths.iter().enumerate() {
            if l < 0 {
                return Err(PoolError::InvalidArgument(format!(
                    "lengths[{i}] = {l} is negative; prompt lengths must be >= 0"
                )));
            }
            if l as u64 > self.geo.max_context_len as u64 {
                return Err(PoolError::ContextTooLong {
                    handle: -1,
                    length: l as u64,
                    max: self.geo.max_context_len,
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
        self.requests.check_available(n, "open_with_prefix")?;
        Ok(())
    }

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
    /// With a host tier, `cached_lens` counts device and host hits: a
    /// page whose only copy is on the host takes a device page (which may
    /// evict, and under `write_back` offload, another) and queues its load
    /// (`take_loads`). A host hit that cannot get a device page ends that
    /// prompt's match there (a miss, not an error); see `prefix_host.rs`.
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
        self.check_prompt_batch(tokens, lengths, salt)?;
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
        reserve(
            &mut hit_pages,
            tokens.len() / self.geo.page_size,
            "prefix matches",
        )?;
        // Each row's old prompt capacity, given back if a later prompt has a
        // bad token id or cannot be allocated: a failed call leaves even
        // `metadata_bytes` as it was.
        let mut caps = Vec::new();
        reserve(&mut caps, n, "prompt buffers")?;
        let mut k = 0usize;
        for (i, &l) in lengths.iter().enumerate() {
            let row = self.requests.nth_free_row(i);
            let mut p = self.requests.take_prompt(row);
            caps.push(p.capacity());
            p.clear();
            let filled = reserve_exact(&mut p, l as usize, "prompt tokens").and_then(|()| {
                match push_token_ids(&mut p, &tokens[k..k + l as usize]) {
                    true => Ok(self.prefix.match_prompt(&p, salt.get(i), &mut hit_pages)),
                    // Names the first bad id (one is there: the pass saw it).
                    false => check_token_ids(tokens).and_then(|()| {
                        Err(PoolError::InvalidArgument(
                            "a token id is out of range".into(),
                        ))
                    }),
                }
            });
            self.requests.put_prompt(row, p);
            match filled {
                Ok(m) => matches.push(m),
                Err(e) => {
                    self.requests.restore_prompt_capacity(&caps);
                    return Err(e);
                }
            }
            k += l as usize;
        }
        // Host hits (a host tier's entries whose only copy is on the host)
        // take device pages and queue loads: `prefix_host.rs`.
        let host_hits = match self.host {
            Some(_) => hit_pages.iter().filter(|&&l| is_host(l)).count(),
            None => 0,
        };
        if host_hits > 0 {
            let mut pending = Vec::new();
            if let Err(e) = reserve(&mut pending, host_hits, "prefix matches")
                .and_then(|()| self.reserve_host_hits(host_hits))
            {
                self.requests.restore_prompt_capacity(&caps);
                return Err(e);
            }
            // Apply: nothing below can fail.
            self.open_with_host_hits(
                salt,
                &matches,
                &mut hit_pages,
                pending,
                &mut handles,
                &mut cached,
            );
            return Ok((handles, cached));
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

    /// Opens one request on the matched pages `hit_pages[..m.pages]`, in
    /// the next free row (the caller checked there is one), whose prompt
    /// buffer holds the request's prompt. Returns `(handle, cached_len)`.
    pub(super) fn open_matched(&mut self, salt: i64, m: &Match, hit_pages: &[u32]) -> (i64, usize) {
        self.open_on(salt, m.tip, &hit_pages[..m.pages], true)
    }

    /// Takes back what opens counted in `hit_tokens`, `miss_tokens` and
    /// `host_hit_tokens` (`hit`, `miss`, `host_hit` tokens) when their caller
    /// undid them: closed the requests unreturned because its own table write
    /// or a host hit's load failed after this allocator opened them. The
    /// counters feed hit rates, and an undone open served no prompt.
    pub fn uncount_opens(&mut self, hit: u64, miss: u64, host_hit: u64) {
        self.hit_tokens = self.hit_tokens.saturating_sub(hit);
        self.miss_tokens = self.miss_tokens.saturating_sub(miss);
        if let Some(host) = self.host.as_mut() {
            host.uncount_hit_tokens(host_hit);
        }
    }

    /// Opens one request on the device pages `hits` of a match ending at
    /// `tip` (see `open_matched`), taking a hold on each when `hold` (else
    /// the caller took them).
    #[inline]
    pub(super) fn open_on(
        &mut self,
        salt: i64,
        tip: ChainTip,
        hits: &[u32],
        hold: bool,
    ) -> (i64, usize) {
        let next = self.requests.nth_free_row(0);
        let prompt = self.requests.take_prompt(next);
        let (row, handle) = self.requests.take_row();
        let len = hits.len() * self.geo.page_size;
        if hold {
            self.pages.hold(hits);
        }
        self.hit_tokens += len as u64;
        self.miss_tokens += prompt.len().saturating_sub(len) as u64;
        self.requests.start_on(row, salt, prompt, hits, tip, len);
        let (_, last, _) = self.requests.tail(row);
        if self.needs_slow(row, len, last) {
            self.requests.mark_slow(row);
        }
        (handle, len)
    }
}
