//! Opening requests: `open`, and admission in one call, `admit`: open new
//! requests and extend them by their prompt lengths, as `open(n)` followed
//! by `extend(handles, counts)`. A scheduler step that admits requests then
//! crosses into the core once for them instead of twice (a separate `open`
//! runs with cold caches).
//!
//! Atomic like every batch call: the extend validates the whole batch
//! before it changes anything, and if it refuses, the rows just taken go
//! back exactly as they were (generation, free-row order, counters), so a
//! refused admission hands out the same handles as the open that follows.

use super::extend::Grown;
use super::options::Counts;
use super::SlotAllocator;
use crate::error::{PoolError, Result};
use crate::handle::handle_row;
use crate::memory::reserve;
use crate::requests::row::Row;
use crate::table::SlotTable;

impl SlotAllocator {
    /// Opens `n` requests and appends their handles to `out`.
    pub fn open_into(&mut self, n: usize, out: &mut Vec<i64>) -> Result<()> {
        self.requests.check_available(n, "open")?;
        reserve(out, n, "handles")?;
        for _ in 0..n {
            out.push(self.requests.take_row().1);
        }
        Ok(())
    }

    /// Opens `n` empty requests. Errors: `TooManyRequests` if fewer than `n`
    /// rows are free (checked before anything is allocated).
    pub fn open(&mut self, n: usize) -> Result<Vec<i64>> {
        let mut out = Vec::new();
        self.open_into(n, &mut out)?;
        Ok(out)
    }

    /// Opens `counts.len()` requests and extends request `i` by `counts[i]`
    /// tokens (`tokens`, if given, flattened like the slots, as in
    /// [`Self::extend_into_table`]). The new slots go to `out` (at least
    /// `sum(counts)` long), in request order, and to `table` if given; the
    /// handles are appended to `handles`. All-or-nothing.
    ///
    /// Errors (nothing changed): `TooManyRequests` (fewer free rows than
    /// counts), and those of `extend_into_table` that fresh requests can
    /// meet: `InvalidArgument` (a negative count, bad `tokens`, `out` or
    /// table), `ContextTooLong` (a count past `max_context_len`),
    /// `Exhausted`.
    pub fn admit_into<F>(
        &mut self,
        counts: &[i64],
        tokens: Option<&[i64]>,
        out: &mut [i64],
        table: Option<&mut SlotTable<'_>>,
        handles: &mut Vec<i64>,
        on_request: F,
    ) -> Result<()>
    where
        F: FnMut(&Grown<'_>),
    {
        let n = counts.len();
        self.requests.check_available(n, "admit")?;
        let start = handles.len();
        reserve(handles, n, "handles")?;
        // What the rows held before: a refused extend puts them back.
        let mut before: Vec<Row> = Vec::new();
        reserve(&mut before, n, "rows")?;
        for _ in 0..n {
            // The row take_row takes next.
            before.push(self.requests.row_state(self.requests.nth_free_row(0)));
            handles.push(self.requests.take_row().1);
        }
        let r = self.extend_into_table(
            &handles[start..],
            Counts::PerRequest(counts),
            tokens,
            out,
            table,
            on_request,
        );
        if r.is_err() {
            // Last taken first, so the free-row stack regains its order.
            for (&h, old) in handles[start..].iter().zip(&before).rev() {
                self.requests.untake_row(handle_row(h) as usize, *old);
            }
            handles.truncate(start);
        }
        r.map_err(|e| match e {
            // The handle was never issued: name the request as new.
            PoolError::ContextTooLong { length, max, .. } => PoolError::ContextTooLong {
                handle: -1,
                length,
                max,
            },
            e => e,
        })
    }

    /// `admit_into` returning the handles and the slots.
    pub fn admit(
        &mut self,
        counts: &[i64],
        tokens: Option<&[i64]>,
    ) -> Result<(Vec<i64>, Vec<i64>)> {
        let total = counts
            .iter()
            .fold(0u64, |acc, &c| acc.saturating_add(c.max(0) as u64));
        let mut handles = Vec::new();
        if total > self.num_slots() as u64 {
            // Cannot succeed: the batch's own error, without allocating for it.
            self.admit_into(counts, tokens, &mut [], None, &mut handles, |_| {})?;
        }
        let mut slots = Vec::new();
        reserve(&mut slots, total as usize, "slots")?;
        slots.resize(total as usize, 0);
        self.admit_into(counts, tokens, &mut slots, None, &mut handles, |_| {})?;
        Ok((handles, slots))
    }
}
