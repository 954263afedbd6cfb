//! The growing side: extend. One pass validates the whole batch (counting
//! copy-on-write pages and the CACHED pages it may evict) while applying
//! requests that stay in their own last page; if anything is wrong those are
//! undone. The second pass, which cannot fail on caller input, grows the rest
//! (both in `extend_passes.rs`).
//!
//! The decode step's common case (one token into the request's own last
//! page) touches only the request's 16-byte hot row: no page changes hands,
//! so no refcount is read or written. Its loops are the requests' own
//! (`requests/decode.rs`), the batch-wide checks in `extend_checks.rs`;
//! anything else takes `grow_row` (`grow.rs`).
//! With a [`SlotTable`] the new slots also go into the caller's
//! request-to-token table in the same pass (`table.rs`).

use super::options::Counts;
use super::SlotAllocator;
use crate::error::Result;
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
}
