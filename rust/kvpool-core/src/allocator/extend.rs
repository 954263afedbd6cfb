//! The growing side: extend. One pass validates the whole batch (counting
//! copy-on-write pages and the CACHED pages it may evict) while applying
//! requests that stay in their own last page; if anything is wrong those are
//! undone. The second pass, which cannot fail on caller input, grows the rest.
//!
//! The decode step's common case (one token into the request's own last
//! page) touches only the request's 16-byte hot row: no page changes hands,
//! so no refcount is read or written. Its loops are the requests' own
//! (`requests/decode.rs`), the batch-wide checks in `extend_checks.rs`;
//! anything else takes `grow_row` (`grow.rs`).
//! With a [`SlotTable`] the new slots also go into the caller's
//! request-to-token table in the same pass (`table.rs`).

use super::decode_past_free::PastFree;
use super::options::Counts;
use super::SlotAllocator;
use crate::error::{PoolError, Result};
use crate::geometry::fill_run;
use crate::handle::handle_row;
use crate::memory::reserve;
use crate::table::SlotTable;

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
    /// `Exhausted` (counting FREE + CACHED pages, copy-on-write included),
    /// `RequestSwappedOut`.
    pub fn extend(
        &mut self,
        handles: &[i64],
        counts: Counts<'_>,
        tokens: Option<&[i64]>,
    ) -> Result<Vec<i64>> {
        let total = self.batch_total(handles, counts)?;
        let mut out = self.output_for(handles, counts, tokens, total)?;
        self.extend_into(handles, counts, tokens, &mut out, |_| {})?;
        Ok(out)
    }

    /// Like [`Self::extend`] (no token ids), also returning each request's
    /// length before the call.
    pub fn extend_with_starts(
        &mut self,
        handles: &[i64],
        counts: Counts<'_>,
    ) -> Result<(Vec<i64>, Vec<i64>)> {
        let total = self.batch_total(handles, counts)?;
        let mut out = self.output_for(handles, counts, None, total)?;
        let mut starts = Vec::new();
        reserve(&mut starts, handles.len(), "extend output")?;
        self.extend_into(handles, counts, None, &mut out, |g| {
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
        self.extend_into_table(handles, counts, tokens, out, None, on_request)
    }

    /// [`Self::extend_into`] that also writes each request's new slots into
    /// `table[row, start..]` (and the entries of positions a copy-on-write
    /// moved), in the same pass. The table must hold `[max_requests,
    /// max_context_len]` (otherwise `InvalidArgument`, nothing changed); on
    /// any error it is left as it was.
    pub fn extend_into_table<F>(
        &mut self,
        handles: &[i64],
        counts: Counts<'_>,
        tokens: Option<&[i64]>,
        out: &mut [i64],
        table: Option<&mut SlotTable<'_>>,
        on_request: F,
    ) -> Result<()>
    where
        F: FnMut(&Grown<'_>),
    {
        counts.check_len("counts", handles.len())?;
        if let Some(t) = &table {
            self.check_table(t)?;
        }
        // One monomorphized loop per count form: no match per request.
        match counts {
            Counts::Each(1) => {
                self.extend_fused::<_, _, true>(handles, |_| 1, tokens, out, table, on_request)
            }
            Counts::Each(c) => {
                self.extend_fused::<_, _, false>(handles, |_| c, tokens, out, table, on_request)
            }
            Counts::PerRequest(v) => {
                self.extend_fused::<_, _, false>(handles, |i| v[i], tokens, out, table, on_request)
            }
        }
    }

    /// Slots a batch would add if valid (negative counts count 0; an
    /// invalid batch fails in `extend_into` whatever this says).
    fn batch_total(&self, handles: &[i64], counts: Counts<'_>) -> Result<usize> {
        counts.check_len("counts", handles.len())?;
        let mut total = 0u64;
        for i in 0..handles.len() {
            total = total.saturating_add(counts.get(i).max(0) as u64);
        }
        Ok(total.min(self.num_slots() as u64 + 1) as usize)
    }

    /// A Vec for `total` slots; a total past the pool's size cannot succeed,
    /// so the batch's own error is returned instead of allocating for it.
    fn output_for(
        &mut self,
        handles: &[i64],
        counts: Counts<'_>,
        tokens: Option<&[i64]>,
        total: usize,
    ) -> Result<Vec<i64>> {
        if total > self.num_slots() {
            self.extend_into(handles, counts, tokens, &mut [], |_| {})?;
        }
        let mut out = Vec::new();
        reserve(&mut out, total, "extend output")?;
        out.resize(total, 0);
        Ok(out)
    }

    /// extend's single validating pass: a request that stays in its own last
    /// page is applied right away (its 16-byte row is in hand); the others
    /// are listed and only counted. If anything in the batch is wrong, the
    /// applied lengths are undone, so the call changes nothing. Then a
    /// second pass grows the listed requests and reports every request.
    fn extend_fused<G, F, const ONE_EACH: bool>(
        &mut self,
        handles: &[i64],
        get: G,
        tokens: Option<&[i64]>,
        out: &mut [i64],
        table: Option<&mut SlotTable<'_>>,
        mut on_request: F,
    ) -> Result<()>
    where
        G: Fn(usize) -> i64,
        F: FnMut(&Grown<'_>),
    {
        self.requests.begin_batch();
        let has_table = table.is_some();
        let mut no_table = SlotTable::new(&mut [], 0);
        let table = table.unwrap_or(&mut no_table);
        let ps = self.geo.page_size;
        let max_len = self.geo.max_context_len as u64;
        let mut slow = self.requests.take_slow_scratch();
        let mut needed_pages = 0usize;
        // Requests that may copy their last page (`pages/copies.rs` makes
        // room), and those pages (`shared_copies` counts the copies exactly).
        let mut copies = 0usize;
        let mut shared_last: Vec<u32> = Vec::new();
        // The decode run may already take pages (undone on error): an
        // Exhausted error must still report the batch's need against what
        // was available before the call.
        let available_before = self.pages.available();
        let (first, mut k) = if ONE_EACH {
            let (rq, pages, prefix) = (&mut self.requests, &mut self.pages, &mut self.prefix);
            let take = || pages.pop_free();
            // Rows past the free stack are listed, not applied (`slow`).
            let defer = Some(&mut slow);
            let n = match tokens {
                Some(x) => rq.decode_one::<true, false>(
                    handles,
                    x,
                    out,
                    take,
                    |s, t| prefix.set_token(s, t),
                    defer,
                ),
                None => rq.decode_one::<false, false>(handles, &[], out, take, |_, _| {}, defer),
            };
            needed_pages = slow.len();
            (n, n)
        } else {
            let pages = &mut self.pages;
            self.requests
                .decode_run(handles, &get, out, || pages.pop_free())
        };
        // The one-token loop stores the token ids of the requests it applied.
        let mut recorded = if ONE_EACH && tokens.is_some() {
            first
        } else {
            0
        };
        let taken_early = available_before.saturating_sub(self.pages.available());
        let mut error = None;
        let mut done = first;
        for (i, &h) in handles.iter().enumerate().skip(first) {
            let row = match self.requests.resolve_unique(h, i) {
                Ok(row) => row,
                Err(e) => {
                    error = Some(e);
                    break;
                }
            };
            let c = get(i);
            if c < 0 {
                error = Some(PoolError::InvalidArgument(format!(
                    "counts[{i}] = {c} is negative; counts must be >= 0"
                )));
                break;
            }
            let (len, last, is_slow) = self.requests.tail(row);
            if is_slow && self.requests.is_swapped(row) {
                error = Some(PoolError::RequestSwappedOut { handle: h });
                break;
            }
            let new_len = len as u64 + c as u64;
            if new_len > max_len {
                error = Some(PoolError::ContextTooLong {
                    handle: h,
                    length: new_len,
                    max: self.geo.max_context_len,
                });
                break;
            }
            let c = c as usize;
            let off = self.geo.offset_in_page(len);
            if !is_slow && off != 0 && c <= ps - off && k + c <= out.len() {
                // Stays in its own last page: apply now (undone on error).
                self.requests.set_len(row, new_len as usize);
                fill_run(&mut out[k..k + c], last as usize * ps + off);
            } else {
                needed_pages += self.geo.pages_for(new_len as usize) - self.geo.pages_for(len);
                if is_slow && c > 0 && self.cow_pages(row) > 0 {
                    if let Err(e) = reserve(&mut shared_last, 1, "shared pages") {
                        error = Some(e);
                        break;
                    }
                    shared_last.push(last);
                    needed_pages += 1;
                    copies += 1;
                }
                slow.push(i as u32);
            }
            k += c;
            done = i + 1;
        }
        if error.is_none() && copies > 1 {
            // Requests of one fork family growing together: fewer copies.
            let exact = self.shared_copies(&mut shared_last);
            needed_pages -= copies - exact;
            copies = exact;
        }
        if error.is_none() {
            error = self
                .check_batch(
                    handles,
                    &get,
                    tokens,
                    &slow,
                    k,
                    needed_pages,
                    out.len(),
                    taken_early,
                )
                .err();
        }
        if error.is_none() && copies > 0 {
            error = self.pages.prepare_copies(copies).err();
        }
        if let Some(e) = error {
            let pages = &mut self.pages;
            self.requests
                .undo_applied(handles, &get, &slow, done, |p| pages.unpop_free(p));
            self.requests.put_slow_scratch(slow);
            return Err(e);
        }
        if ONE_EACH && !slow.is_empty() {
            // A decode step on a pool out of FREE pages (`decode_past_free.rs`).
            let past = PastFree {
                first,
                slow: &mut slow,
                needed_pages: &mut needed_pages,
                recorded: &mut recorded,
            };
            self.apply_past_free(handles, tokens, out, past);
        }
        if slow.is_empty() && (tokens.is_none() || recorded == handles.len()) {
            // Every request was applied in the first pass (or, on a pool out
            // of FREE pages, the fast loop's way once the victims were
            // evicted): only fill the table and report. Two loops: with a
            // no-op callback the report loop compiles away, as it must for a
            // plain decode step.
            if ONE_EACH && has_table {
                self.requests.write_decode(table, handles, out);
            } else if has_table {
                let mut k = 0usize;
                for (i, &h) in handles.iter().enumerate() {
                    let c = get(i) as usize;
                    let row = handle_row(h) as usize;
                    let start = self.requests.len(row) - c;
                    table.write(row, start, &out[k..k + c], 0);
                    k += c;
                }
            }
            let mut k = 0usize;
            for (i, &h) in handles.iter().enumerate() {
                let row = handle_row(h) as usize;
                let c = get(i) as usize;
                let start = self.requests.len(row) - c;
                on_request(&Grown {
                    index: i,
                    row,
                    start,
                    slots: &out[k..k + c],
                    moved: 0,
                });
                k += c;
            }
            self.requests.put_slow_scratch(slow);
            return Ok(());
        }
        // Past the free stack the second pass takes victims. At page size 1
        // (every new token a page) they are evicted here in one walk, the
        // batch being valid: nothing after this point is undone. (At larger
        // sizes a row may also unregister a page it writes into, whose
        // Removed event must stay in its place among the victims'.)
        let short = needed_pages.saturating_sub(self.pages.free_len());
        if short > 1 && ps == 1 {
            self.evict_beneath_free(short);
        }
        // Second pass: grow the listed requests, report everyone in order.
        let runs_before = self.pages.queued_runs();
        let mut s = slow.iter().peekable();
        let mut k = 0usize;
        for (i, &h) in handles.iter().enumerate() {
            let row = handle_row(h) as usize;
            let c = get(i) as usize;
            let dst = &mut out[k..k + c];
            let toks = tokens.map(|t| &t[k..k + c]);
            k += c;
            let mut moved = 0;
            let start;
            if s.peek() == Some(&&(i as u32)) {
                s.next();
                let was_slow;
                (start, _, was_slow) = self.requests.tail(row);
                if c > 0 {
                    // Without the slow mark there is no prompt ahead and the
                    // new last page is the request's own: skip the cold row.
                    moved = self.grow_row(row, start, dst);
                    if was_slow || toks.is_some() {
                        self.record_tokens(row, start, dst, toks);
                    }
                    if was_slow {
                        let (_, last, _) = self.requests.tail(row);
                        if self.needs_slow(row, start + c, last) {
                            self.requests.mark_slow(row);
                        }
                    }
                }
            } else {
                start = self.requests.len(row) - c;
                if toks.is_some() && i >= recorded {
                    self.record_tokens(row, start, dst, toks);
                }
            }
            if has_table {
                table.write(row, start, dst, moved);
            }
            on_request(&Grown {
                index: i,
                row,
                start,
                slots: dst,
                moved,
            });
        }
        if self.pages.queued_runs() > runs_before {
            let rows = slow
                .iter()
                .map(|&i| handle_row(handles[i as usize]) as usize);
            self.hold_copy_sources(runs_before, rows);
        }
        self.requests.put_slow_scratch(slow);
        Ok(())
    }
}
