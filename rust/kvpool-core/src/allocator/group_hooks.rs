//! What a grouped pool (`groups/`) asks of the allocator that carries its
//! request table and anchor chain. Read-only checks that mirror an
//! operation's own (so that every group can be checked before any changes),
//! and the anchor's side of registration and prefix hits with the
//! registration ids that tie the other groups' pages to the chain.
//!
//! Nothing here is on an ungrouped pool's path: these are extra entry
//! points, and the operations they mirror keep their own code.

use super::options::Counts;
use super::SlotAllocator;
use crate::error::{PoolError, Result};
use crate::handle::handle_row;
use crate::memory::reserve;
use crate::prefix::hashing::check_token_ids;
use crate::prefix::tip::{ChainTip, Match};

/// One request of a checked batch: its row, its length and its count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BatchRow {
    pub(crate) row: usize,
    pub(crate) len: usize,
    pub(crate) count: usize,
}

impl SlotAllocator {
    /// extend's checks without extend: handles (open, each once), counts
    /// (>= 0, within max_context_len), then token ids (count, range, the
    /// prompt's where it covers a position), in extend's order. Returns the
    /// batch's rows and the pages extend would need here (copy-on-write
    /// included); the caller compares them with `free_pages`.
    pub(crate) fn group_extend_checks(
        &mut self,
        handles: &[i64],
        counts: Counts<'_>,
        tokens: Option<&[i64]>,
    ) -> Result<(Vec<BatchRow>, usize)> {
        counts.check_len("counts", handles.len())?;
        let mut rows = Vec::new();
        reserve(&mut rows, handles.len(), "batch rows")?;
        self.requests.begin_batch();
        let mut need = 0usize;
        let mut total = 0usize;
        let mut shared_last = Vec::new();
        for (i, &h) in handles.iter().enumerate() {
            let row = self.requests.resolve_unique(h, i)?;
            let c = counts.get(i);
            if c < 0 {
                return Err(PoolError::InvalidArgument(format!(
                    "counts[{i}] = {c} is negative; counts must be >= 0"
                )));
            }
            let len = self.requests.len(row);
            let new_len = len as u64 + c as u64;
            if new_len > self.geo.max_context_len as u64 {
                return Err(PoolError::ContextTooLong {
                    handle: h,
                    length: new_len,
                    max: self.geo.max_context_len,
                });
            }
            let c = c as usize;
            need += self.geo.pages_for(len + c) - self.geo.pages_for(len);
            if c > 0 && self.cow_pages(row) > 0 {
                reserve(&mut shared_last, 1, "shared pages")?;
                shared_last.push(self.requests.tail(row).1);
            }
            total += c;
            rows.push(BatchRow { row, len, count: c });
        }
        need += self.shared_copies(&mut shared_last);
        if let Some(t) = tokens {
            let all: Vec<u32> = (0..handles.len() as u32).collect();
            let get = |i: usize| counts.get(i);
            // Needs 0 pages and an output of the batch's size: only the
            // token checks can fail here.
            self.check_batch(handles, &get, Some(t), &all, total, 0, total, 0)?;
        }
        Ok((rows, need))
    }

    /// admit's checks without admit: rows free, counts (>= 0, within
    /// max_context_len), token ids (count, range). Returns the pages the
    /// new requests would need here.
    pub(crate) fn group_admit_checks(
        &self,
        counts: &[i64],
        tokens: Option<&[i64]>,
    ) -> Result<usize> {
        self.requests.check_available(counts.len(), "admit")?;
        let mut need = 0usize;
        let mut total = 0usize;
        for (i, &c) in counts.iter().enumerate() {
            if c < 0 {
                return Err(PoolError::InvalidArgument(format!(
                    "counts[{i}] = {c} is negative; counts must be >= 0"
                )));
            }
            if c as u64 > self.geo.max_context_len as u64 {
                return Err(PoolError::ContextTooLong {
                    handle: -1,
                    length: c as u64,
                    max: self.geo.max_context_len,
                });
            }
            need += self.geo.pages_for(c as usize);
            total += c as usize;
        }
        if let Some(t) = tokens {
            if t.len() != total {
                return Err(PoolError::InvalidArgument(format!(
                    "tokens has {} entries but the batch adds {total} positions; pass one token \
                     id per new position, flattened like the slots",
                    t.len()
                )));
            }
            check_token_ids(t)?;
        }
        Ok(need)
    }

    /// truncate's checks without truncate, in its order: each handle open
    /// and named once, each length in [0, current length]. Returns the rows
    /// with their current lengths (`count` is the new length).
    pub(crate) fn group_truncate_checks(
        &mut self,
        handles: &[i64],
        lengths: Counts<'_>,
    ) -> Result<Vec<BatchRow>> {
        lengths.check_len("lengths", handles.len())?;
        let mut rows = Vec::new();
        reserve(&mut rows, handles.len(), "batch rows")?;
        self.requests.begin_batch();
        for (i, &h) in handles.iter().enumerate() {
            let row = self.requests.resolve_unique(h, i)?;
            let l = lengths.get(i);
            let cur = self.requests.len(row);
            if l < 0 || l as u64 > cur as u64 {
                return Err(PoolError::InvalidArgument(format!(
                    "lengths[{i}] = {l} for handle {h} must be in [0, {cur}] (its current length); \
                     truncate only shortens"
                )));
            }
            rows.push(BatchRow {
                row,
                len: cur,
                count: l as usize,
            });
        }
        Ok(rows)
    }

    /// close's and cache's check: each handle open and named once.
    pub(crate) fn group_resolve_batch(&mut self, handles: &[i64]) -> Result<Vec<BatchRow>> {
        self.requests.resolve_batch(handles)?;
        let mut rows = Vec::new();
        reserve(&mut rows, handles.len(), "batch rows")?;
        for &h in handles {
            let row = handle_row(h) as usize;
            rows.push(BatchRow {
                row,
                len: self.requests.len(row),
                count: 0,
            });
        }
        Ok(rows)
    }

    /// The row of an open request.
    pub(crate) fn group_resolve(&self, handle: i64) -> Result<usize> {
        self.requests.resolve(handle)
    }

    /// Rows free for `n` new requests (`TooManyRequests` otherwise).
    pub(crate) fn group_check_available(&self, n: usize, call: &'static str) -> Result<()> {
        self.requests.check_available(n, call)
    }

    /// Rows an open can take now.
    pub(crate) fn group_free_rows(&self) -> usize {
        self.requests.free_rows()
    }

    /// Whether row `row` holds an open request, and its length.
    pub(crate) fn group_row_len(&self, row: usize) -> Option<usize> {
        self.requests.is_open(row).then(|| self.requests.len(row))
    }

    /// Leading pages of `row`'s chain: registered here, or verified
    /// duplicates of registered pages.
    pub(crate) fn group_chain_pages(&self, row: usize) -> usize {
        self.requests.chain(row).pages
    }

    /// open_with_prefix's checks without opening anything, in its order:
    /// salts, lengths, tokens, rows, token ids. Returns the prompts.
    pub(crate) fn group_prompts(
        &self,
        tokens: &[i64],
        lengths: &[i64],
        salt: Counts<'_>,
    ) -> Result<Vec<Vec<i32>>> {
        let n = lengths.len();
        self.check_prompt_batch(tokens, lengths, salt)?;
        check_token_ids(tokens)?;
        let mut prompts = Vec::new();
        reserve(&mut prompts, n, "prompts")?;
        let mut k = 0usize;
        for &l in lengths {
            let mut p = Vec::new();
            reserve(&mut p, l as usize, "prompt tokens")?;
            p.extend(tokens[k..k + l as usize].iter().map(|&t| t as i32));
            prompts.push(p);
            k += l as usize;
        }
        Ok(prompts)
    }

    /// The longest verified cached prefix of `prompt` (at most
    /// `(len - 1) / page_size` pages), its pages and the registration id of
    /// each one's entry. Read-only (the hash scratch aside).
    pub(crate) fn group_match(
        &mut self,
        prompt: &[i32],
        salt: i64,
    ) -> Result<(Vec<u32>, Vec<u64>)> {
        let mut pages = Vec::new();
        reserve(
            &mut pages,
            prompt.len() / self.geo.page_size,
            "prefix matches",
        )?;
        self.prefix.match_prompt(prompt, salt, &mut pages);
        let mut regs = Vec::new();
        reserve(&mut regs, pages.len(), "prefix matches")?;
        for &p in &pages {
            // A matched page is registered: its entry is the match.
            match self.prefix.tip_at(self.pages.entry(p)) {
                Some((tip, _)) => regs.push(tip.reg),
                None => break,
            }
        }
        pages.truncate(regs.len());
        Ok((pages, regs))
    }

    /// Opens one request on the first `pages` of a match (`group_match`'s
    /// pages, cut to the hit), with prompt `prompt`; returns its handle.
    /// The caller checked that a row is free.
    pub(crate) fn group_open_matched(&mut self, prompt: Vec<i32>, salt: i64, pages: &[u32]) -> i64 {
        let tip = match pages.last() {
            Some(&p) => self
                .prefix
                .tip_at(self.pages.entry(p))
                .map_or_else(|| ChainTip::root(salt), |(t, _)| t),
            None => ChainTip::root(salt),
        };
        let m = Match {
            pages: pages.len(),
            tip,
        };
        let row = self.requests.nth_free_row(0);
        self.requests.set_prompt(row, prompt);
        self.open_matched(salt, &m, pages).0
    }

    /// `restart_dead_chain` of each row; returns whether any restarted (the
    /// groups then follow the anchor chain again, `GroupedAllocator::sync_rows`).
    pub(crate) fn group_restart_dead_chains(&mut self, rows: &[BatchRow]) -> bool {
        let mut any = false;
        for r in rows {
            any |= self.restart_dead_chain(r.row);
        }
        any
    }

    /// Registers the rows' full pages of known tokens (as `cache`), and
    /// appends to `regs[row]` the registration id of the entry each newly
    /// chained page stands for (its own, or the one it duplicates). Each
    /// `regs[row]` holds the row's chain so far on entry (its length is the
    /// chain's pages). The rows are resolved already.
    pub(crate) fn group_register(
        &mut self,
        rows: &[BatchRow],
        regs: &mut [Vec<u64>],
    ) -> Result<()> {
        let mut todo = 0usize;
        for r in rows {
            let more = self
                .registrable_pages(r.row)
                .saturating_sub(self.requests.chain(r.row).pages);
            reserve(&mut regs[r.row], more, "anchor registrations")?;
            todo += more;
        }
        let todo = todo.min(self.prefix.room());
        self.reserve_registrations(todo)?;
        for r in rows {
            self.register_row_recording(r.row, &mut regs[r.row]);
        }
        Ok(())
    }

    /// `register_row` one page at a time, recording each page's tip.
    fn register_row_recording(&mut self, row: usize, regs: &mut Vec<u64>) {
        let upto = self.registrable_pages(row);
        let chain = self.requests.chain(row);
        if upto > chain.pages {
            self.requests.set_shared(row);
        }
        let salt = self.requests.salt(row);
        let mut tip = chain.tip;
        let mut k = chain.pages;
        let (mut broken, mut foreign) = (false, false);
        let checked = super::cache::walked_at(&self.prefix, &chain);
        while k < upto {
            let p = self.requests.page(row, k);
            let h = self.prefix.page_hash(tip.hash, p);
            let Self {
                pages,
                prefix,
                events,
                host,
                ..
            } = self;
            let next = super::register_page::register_page(
                prefix,
                pages,
                events,
                host,
                p,
                k == 0,
                h,
                &tip,
                salt,
            )
            .or_else(|| {
                super::register_page::register_past_orphan(
                    prefix,
                    pages,
                    events,
                    host,
                    p,
                    k == 0,
                    h,
                    &tip,
                    salt,
                )
            });
            match next {
                Some(next) => {
                    tip = next;
                    foreign |= self.pages.entry(p) != tip.entry;
                }
                None => {
                    broken = true;
                    break;
                }
            }
            regs.push(tip.reg);
            k += 1;
        }
        self.requests
            .set_chain(row, k, tip, broken, foreign, checked);
    }

    /// Discards queued copy-on-write copies (an anchor without device
    /// memory has nothing to copy); their source pages are let go.
    pub(crate) fn group_drop_copies(&mut self) {
        if self.pages.pending_copies() > 0 {
            self.take_copies();
        }
    }
}
