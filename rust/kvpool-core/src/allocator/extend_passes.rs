//! extend's two passes over a batch. The first validates every request
//! (counting copy-on-write pages and the CACHED pages the batch may evict)
//! while applying those that stay in their own last page; if anything is
//! wrong it undoes them, so a refused batch changes nothing. The second,
//! which cannot fail on caller input, grows the listed rest. The public
//! calls that drive them are in `extend.rs`.

use super::decode_past_free::PastFree;
use super::extend::Grown;
use super::SlotAllocator;
use crate::error::{PoolError, Result};
use crate::geometry::fill_run;
use crate::handle::handle_row;
use crate::memory::reserve;
use crate::table::SlotTable;

impl SlotAllocator {
    /// extend's single validating pass: a request that stays in its own last
    /// page is applied right away (its 16-byte row is in hand); the others
    /// are listed and only counted. If anything in the batch is wrong, the
    /// applied lengths are undone, so the call changes nothing. Then a
    /// second pass grows the listed requests and reports every request.
    pub(super) fn extend_fused<G, F, const ONE_EACH: bool>(
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
