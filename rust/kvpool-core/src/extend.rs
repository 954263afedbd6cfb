//! The growing side: extend. A batch is validated whole first
//! (`prepare_extend`, which counts copy-on-write pages and the CACHED pages
//! it may evict); the commit pass after it cannot fail on caller input.
//!
//! The decode step's common case (one token into the request's own last
//! page) touches only the request's 16-byte hot row: no page changes hands,
//! so no refcount is read or written. Anything else takes `grow_row`.

use crate::allocator::{Counts, SlotAllocator};
use crate::error::{PoolError, Result};
use crate::handle::handle_row;
use crate::memory::reserve;
use crate::rows::SLOW;

/// What an extend did to one request, passed to `extend_into`'s callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grown<'a> {
    /// Index of the request in the batch.
    pub index: usize,
    /// Its row (request-to-token table index).
    pub row: usize,
    /// Its length before the call.
    pub start: usize,
    /// Its new slots (positions `start..start + slots.len()`).
    pub slots: &'a [i64],
    /// Positions `start - moved .. start` moved to a new page by
    /// copy-on-write; their slots are now `slots[0] - moved .. slots[0]`
    /// (the same page as the first new slot). 0 almost always.
    pub moved: usize,
}

/// Writes `first, first + 1, ...` into `dst` (the slots of one page run).
#[inline]
fn fill_run(dst: &mut [i64], first: usize) {
    if let [d] = dst {
        // The decode step's single slot: skip the vector loop's set-up.
        *d = first as i64;
        return;
    }
    for (j, d) in dst.iter_mut().enumerate() {
        *d = (first + j) as i64;
    }
}

impl SlotAllocator {
    /// Appends `counts[i]` tokens to request `handles[i]` and returns the new
    /// slot ids, flattened in request order. All-or-nothing.
    ///
    /// `tokens`, when given, holds the token ids of the new positions,
    /// flattened like the slots (one per new position, each in
    /// [0, 2^31)). Positions covered by the request's prompt
    /// (`open_with_prefix`) take their ids from it (given ids must agree);
    /// other positions without ids are unknown and make their pages
    /// uncacheable. Extending into a page that another request (or the
    /// prefix cache) still needs copies it first: see [`Self::take_copies`].
    ///
    /// Errors (nothing changed): `InvalidHandle`, `InvalidArgument` (negative
    /// count, a handle twice, counts/tokens of the wrong length, a token id
    /// out of range or disagreeing with the prompt), `ContextTooLong`,
    /// `Exhausted` (counting FREE + CACHED pages, copy-on-write included).
    pub fn extend(
        &mut self,
        handles: &[i64],
        counts: Counts<'_>,
        tokens: Option<&[i64]>,
    ) -> Result<Vec<i64>> {
        let total = self.prepare_extend(handles, counts, tokens)?;
        let mut out = Vec::new();
        reserve(&mut out, total, "extend output")?;
        out.resize(total, 0);
        self.commit_extend(handles, counts, tokens, &mut out, |_| {})?;
        Ok(out)
    }

    /// Like [`Self::extend`] (no token ids), also returning each request's
    /// length before the call.
    pub fn extend_with_starts(
        &mut self,
        handles: &[i64],
        counts: Counts<'_>,
    ) -> Result<(Vec<i64>, Vec<i64>)> {
        let total = self.prepare_extend(handles, counts, None)?;
        let (mut out, mut starts) = (Vec::new(), Vec::new());
        reserve(&mut out, total, "extend output")?;
        reserve(&mut starts, handles.len(), "extend output")?;
        out.resize(total, 0);
        self.commit_extend(handles, counts, None, &mut out, |g| {
            starts.push(g.start as i64)
        })?;
        Ok((out, starts))
    }

    /// Like [`Self::extend`], writing the new slots into `out`, which must
    /// have exactly as many entries as the batch adds (otherwise
    /// `InvalidArgument`, after the batch's own checks, nothing changed).
    ///
    /// `on_request` runs once per request, in batch order, right after it
    /// grew (see [`Grown`]), e.g. to write a request-to-token table row
    /// while the slots are in cache.
    pub fn extend_into<F>(
        &mut self,
        handles: &[i64],
        counts: Counts<'_>,
        tokens: Option<&[i64]>,
        out: &mut [i64],
        on_request: F,
    ) -> Result<()>
    where
        F: FnMut(&Grown<'_>),
    {
        let total = self.prepare_extend(handles, counts, tokens)?;
        if total != out.len() {
            return Err(PoolError::InvalidArgument(format!(
                "output has {} entries but the batch adds {total} slots",
                out.len()
            )));
        }
        self.commit_extend(handles, counts, tokens, out, on_request)
    }

    /// Pages a request's next extend needs beyond its length's own: 1 when
    /// its partly filled last page has other holders (copy-on-write).
    #[inline]
    fn cow_pages(&self, row: usize) -> usize {
        let r = self.rows[row];
        if self.offset_in_page(r.len as usize) == 0 {
            return 0;
        }
        (self.refcount[(r.last & !SLOW) as usize] > 1) as usize
    }

    /// Validates a whole extend batch without changing the pool (beyond the
    /// batch stamps); returns the number of slots it adds.
    fn prepare_extend(
        &mut self,
        handles: &[i64],
        counts: Counts<'_>,
        tokens: Option<&[i64]>,
    ) -> Result<usize> {
        counts.check_len("counts", handles.len())?;
        self.begin_batch();
        let mut needed_pages = 0usize;
        let mut total = 0usize;
        let mut any_slow = false;
        for (i, &h) in handles.iter().enumerate() {
            let row = self.resolve_unique(h, i)?;
            let c = counts.get(i);
            if c < 0 {
                return Err(PoolError::InvalidArgument(format!(
                    "counts[{i}] = {c} is negative; counts must be >= 0"
                )));
            }
            let r = self.rows[row];
            let new_len = r.len as u64 + c as u64;
            if new_len > self.max_context_len as u64 {
                return Err(PoolError::ContextTooLong {
                    handle: h,
                    length: new_len,
                    max: self.max_context_len,
                });
            }
            needed_pages += self.pages_for(new_len as usize) - self.pages_for(r.len as usize);
            if r.last & SLOW != 0 && c > 0 {
                any_slow = true;
                needed_pages += self.cow_pages(row);
            }
            total += c as usize;
        }
        if let Some(t) = tokens {
            self.check_tokens(handles, counts, t, total, any_slow)?;
        }
        let available = self.available_pages();
        if needed_pages > available {
            return Err(PoolError::Exhausted {
                needed_pages,
                free_pages: available,
                page_size: self.page_size,
                free_slots: available * self.page_size,
            });
        }
        Ok(total)
    }

    /// Token ids must be one per new position, in range, and agree with
    /// the prompt where the prompt covers the position.
    fn check_tokens(
        &self,
        handles: &[i64],
        counts: Counts<'_>,
        t: &[i64],
        total: usize,
        any_slow: bool,
    ) -> Result<()> {
        if t.len() != total {
            return Err(PoolError::InvalidArgument(format!(
                "tokens has {} entries but the batch adds {total} positions; pass one token id \
                 per new position, flattened like the slots",
                t.len()
            )));
        }
        if let Some(j) = t.iter().position(|&x| !(0..=i32::MAX as i64).contains(&x)) {
            return Err(PoolError::InvalidArgument(format!(
                "tokens[{j}] = {} is not a token id; ids must be in [0, {}]",
                t[j],
                i32::MAX
            )));
        }
        if !any_slow {
            return Ok(());
        }
        let mut k = 0usize;
        for (i, &h) in handles.iter().enumerate() {
            let row = handle_row(h) as usize;
            let c = counts.get(i) as usize;
            let start = self.rows[row].len as usize;
            let prompt = &self.cold[row].prompt;
            if prompt.len() > start {
                let n = c.min(prompt.len() - start);
                let given = &t[k..k + n];
                if let Some(j) = (0..n).find(|&j| given[j] != prompt[start + j] as i64) {
                    return Err(PoolError::InvalidArgument(format!(
                        "tokens[{}] = {} for handle {h} disagrees with its prompt's token {} \
                         at position {}",
                        k + j,
                        given[j],
                        prompt[start + j],
                        start + j
                    )));
                }
            }
            k += c;
        }
        Ok(())
    }

    /// Grows every request of a batch that `prepare_extend` accepted; `out`
    /// holds exactly its slots.
    fn commit_extend<F>(
        &mut self,
        handles: &[i64],
        counts: Counts<'_>,
        tokens: Option<&[i64]>,
        out: &mut [i64],
        mut on_request: F,
    ) -> Result<()>
    where
        F: FnMut(&Grown<'_>),
    {
        let ps = self.page_size;
        let mut k = 0usize;
        for (i, &h) in handles.iter().enumerate() {
            let row = handle_row(h) as usize;
            let c = counts.get(i) as usize;
            let Some(dst) = out.get_mut(k..k + c) else {
                return Err(PoolError::Invariant(
                    "extend output shorter than validated".into(),
                ));
            };
            let toks = tokens.and_then(|t| t.get(k..k + c));
            k += c;
            let r = self.rows[row];
            let start = r.len as usize;
            let off = self.offset_in_page(start);
            let mut moved = 0;
            if c == 0 {
            } else if r.last & SLOW == 0 && off != 0 && c <= ps - off {
                // Stays in the request's own last page: no page changes hands.
                fill_run(dst, r.last as usize * ps + off);
                self.rows[row].len = (start + c) as u32;
                if let Some(t) = toks {
                    self.record_tokens(row, start, dst, Some(t));
                }
            } else {
                moved = self.grow_row(row, start, dst);
                self.record_tokens(row, start, dst, toks);
                let (len, last) = (start + c, self.rows[row].last);
                self.rows[row].last = last | self.slow_bit(row, len, last);
            }
            on_request(&Grown {
                index: i,
                row,
                start,
                slots: dst,
                moved,
            });
        }
        Ok(())
    }

    /// Appends `dst.len()` tokens to `row`, taking pages as needed and
    /// copying (or unregistering) a last page it must not write in place.
    /// Returns how many positions moved to a copied page. Leaves `SLOW` clear.
    fn grow_row(&mut self, row: usize, start: usize, dst: &mut [i64]) -> usize {
        let ps = self.page_size;
        let c = dst.len();
        let base = row * self.row_pages;
        let np = self.pages_for(start);
        let off = self.offset_in_page(start);
        let mut last = self.rows[row].last & !SLOW;
        let mut moved = 0;
        if off != 0 {
            if self.refcount[last as usize] > 1 {
                // Shared: the others keep the page, this request gets a copy.
                let q = self.take_page();
                let (src, dstp) = (last as usize * ps, q as usize * ps);
                self.index.tokens.copy_within(src..src + off, dstp);
                self.copy_src.extend((src..src + off).map(|s| s as i64));
                self.copy_dst.extend((dstp..dstp + off).map(|s| s as i64));
                self.refcount[last as usize] -= 1;
                self.page_lists[base + np - 1] = q;
                last = q;
                moved = off;
            } else if self.index.is_registered(last) {
                // Only the cache shares it: drop the entry, then write in place.
                self.unregister_page(last);
            }
        }
        let room = if off == 0 { 0 } else { ps - off };
        let (head, rest) = dst.split_at_mut(room.min(c));
        if !head.is_empty() {
            fill_run(head, last as usize * ps + off);
        }
        for (j, run) in rest.chunks_mut(ps).enumerate() {
            let p = self.take_page();
            self.page_lists[base + np + j] = p;
            fill_run(run, p as usize * ps);
            last = p;
        }
        self.rows[row].len = (start + c) as u32;
        self.rows[row].last = last;
        moved
    }

    /// Stores the token ids of the new positions `start..` whose slots are
    /// `slots` (given ids, else the prompt's) and advances the known prefix.
    fn record_tokens(&mut self, row: usize, start: usize, slots: &[i64], toks: Option<&[i64]>) {
        let cold = &mut self.cold[row];
        let tokens = &mut self.index.tokens;
        let known = match toks {
            Some(t) => {
                for (&s, &x) in slots.iter().zip(t) {
                    tokens[s as usize] = x as i32;
                }
                slots.len()
            }
            None => {
                let n = slots.len().min(cold.prompt.len().saturating_sub(start));
                for (j, &s) in slots[..n].iter().enumerate() {
                    tokens[s as usize] = cold.prompt[start + j];
                }
                n
            }
        };
        if cold.known_len as usize == start {
            cold.known_len = (start + known) as u32;
        }
    }

    /// `SLOW` if `row` (length `len`, last page `last`) must take the slow
    /// path next: prompt positions still ahead, or a partly filled last page
    /// that others hold or the cache has registered.
    pub(crate) fn slow_bit(&self, row: usize, len: usize, last: u32) -> u32 {
        let last = last & !SLOW;
        let pending = self.cold[row].prompt.len() > len;
        let shared = self.offset_in_page(len) != 0
            && (self.refcount[last as usize] > 1 || self.index.is_registered(last));
        if pending || shared {
            SLOW
        } else {
            0
        }
    }

    /// Drains the queued copy-on-write copies: `(src_slots, dst_slots)`.
    /// Run them (every layer's K and V, slot `src[i]` to `dst[i]`) before
    /// the next write to the destination pages and before any call that
    /// could free the source pages; `KVPool.extend` does this itself.
    pub fn take_copies(&mut self) -> (Vec<i64>, Vec<i64>) {
        (
            std::mem::take(&mut self.copy_src),
            std::mem::take(&mut self.copy_dst),
        )
    }

    /// Queued copy-on-write copies not yet taken.
    pub fn pending_copies(&self) -> usize {
        self.copy_src.len()
    }
}
