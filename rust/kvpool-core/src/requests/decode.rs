//! The decode step's fast paths of extend: loops that apply the leading
//! requests of a batch which stay in (or just start) their own last page,
//! touching only each request's 16-byte hot row, and the undo that puts
//! them back when the rest of the batch turns out invalid.
//! `allocator/extend_passes.rs` validates and grows everything else.
//!
//! A request that starts a page takes it from the pool's free stack, and
//! one with token ids stores them in the prefix index's slot array: both
//! through the closures the allocator passes, which inline into the loops.

use super::row::{OPEN, SLOW};
use super::Requests;
use crate::geometry::fill_run;
use crate::handle::{handle_generation, handle_row};
use crate::table::SlotTable;

impl Requests {
    /// The decode step's loop, kept tight (few live values, no error
    /// plumbing): applies the leading requests that are valid and stay in
    /// their own last page, or start exactly one page taken with
    /// `take_free` (None: stop there), and stops at the first that does not (the general loop
    /// takes over there and validates it). Power-of-two page sizes only.
    /// The caller started the batch (`begin_batch`). Returns (requests
    /// applied, slots written).
    #[inline]
    pub(crate) fn decode_run<G: Fn(usize) -> i64>(
        &mut self,
        handles: &[i64],
        get: &G,
        out: &mut [i64],
        mut take_free: impl FnMut() -> Option<u32>,
    ) -> (usize, usize) {
        let Some(shift) = self.geo.page_shift else {
            return (0, 0);
        };
        let (ps, epoch, max_len, stride) = (
            self.geo.page_size,
            self.epoch,
            self.geo.max_context_len,
            self.row_pages,
        );
        let rows = &mut self.rows[..];
        let mut k = 0usize;
        for (i, &h) in handles.iter().enumerate() {
            let row = handle_row(h) as usize;
            let Some(r) = rows.get_mut(row) else {
                return (i, k);
            };
            let c = get(i);
            let len = r.len as usize;
            let off = len & (ps - 1);
            // Stays in its own last page, or starts exactly one new page
            // taken from the free stack (a decode step at a page boundary).
            let room = if off == 0 { ps } else { ps - off };
            let new_page = off == 0 && c > 0;
            let fits = (c as u64) <= room as u64 && len + room <= max_len && (off != 0 || c > 0);
            if h < 0
                || r.generation != handle_generation(h) | OPEN
                || r.stamp == epoch
                || r.last & SLOW != 0
                || !fits
                || k + c as usize > out.len()
            {
                return (i, k);
            }
            let c = c as usize;
            if new_page {
                // Undone by `undo_applied` if the batch fails later. A FREE
                // page's refcount is 1 already (see `pages/`).
                let Some(p) = take_free() else {
                    return (i, k);
                };
                self.page_lists[row * stride + (len >> shift)] = p;
                r.last = p;
            }
            r.stamp = epoch;
            r.len = (len + c) as u32;
            fill_run(&mut out[k..k + c], r.last as usize * ps + off);
            k += c;
        }
        (handles.len(), k)
    }

    /// `decode_run` for a count of 1 per request, the decode step itself:
    /// request `i` writes `out[i]` (with `tokens`, `store_token` stores
    /// `tokens[i]` at its slot while the row is in hand), and the few values
    /// the loop keeps live stay in registers. A page boundary takes a page
    /// with `take_free` (None: see `deferred`). The slot table is written
    /// after the batch (`SlotTable::write_decode`). Returns how many leading
    /// requests it went through: applied, or listed in `deferred`.
    ///
    /// With `deferred`, a request that starts a page when the free stack is
    /// empty is validated and stamped but not applied, and its index goes
    /// on the list (ascending) for extend, which gives it a page once the
    /// whole batch is known to be valid (`allocator/decode_past_free.rs`);
    /// without, the loop stops there.
    ///
    /// `STAMPED`: the requests were validated and stamped for this batch
    /// already, and none of them applied (each needed a page, and the free
    /// stack ran out first), so a row counts only if it carries this
    /// batch's stamp, rather than only if it does not.
    // Not inlined: each form is its own small function, whose loop keeps
    // its few live values in registers; inlined into extend's fused pass it
    // would share them with the rest of the pass.
    #[inline(never)]
    pub(crate) fn decode_one<const TOKENS: bool, const STAMPED: bool>(
        &mut self,
        handles: &[i64],
        tokens: &[i64],
        out: &mut [i64],
        mut take_free: impl FnMut() -> Option<u32>,
        mut store_token: impl FnMut(usize, i32),
        mut deferred: Option<&mut Vec<u32>>,
    ) -> usize {
        let Some(shift) = self.geo.page_shift else {
            return 0;
        };
        if TOKENS && tokens.len() != handles.len() {
            return 0; // the general path reports the length
        }
        let (mask, epoch, max_len) = ((1usize << shift) - 1, self.epoch, self.geo.max_context_len);
        let n = handles.len().min(out.len());
        for i in 0..n {
            let h = handles[i];
            let row = handle_row(h) as usize;
            let Some(r) = self.rows.get(row) else {
                return i;
            };
            let len = r.len as usize;
            if (h < 0)
                | (r.generation != handle_generation(h) | OPEN)
                | ((r.stamp == epoch) != STAMPED)
                | (r.last & SLOW != 0)
                | (len >= max_len)
                | (TOKENS && !(0..=i32::MAX as i64).contains(&tokens[i]))
            {
                return i;
            }
            if len & mask == 0 {
                // A page boundary: one page off the free stack (undone by
                // `undo_applied` if the batch fails later). Its refcount is
                // 1 already (see `pages/`).
                let Some(p) = take_free() else {
                    match deferred.as_deref_mut() {
                        // Out of FREE pages: stamped, not applied, listed
                        // for extend to give a page once the batch is valid.
                        Some(list) => {
                            self.rows[row].stamp = epoch;
                            list.push(i as u32);
                            continue;
                        }
                        None => return i,
                    }
                };
                self.page_lists[row * self.row_pages + (len >> shift)] = p;
                self.rows[row].last = p;
            }
            let r = &mut self.rows[row];
            r.stamp = epoch;
            r.len = len as u32 + 1;
            let slot = ((r.last as usize) << shift) | (len & mask);
            out[i] = slot as i64;
            if TOKENS {
                // Not SLOW: no prompt ahead to agree with. Undone (the
                // known count) by `undo_applied` if the batch fails.
                store_token(slot, tokens[i] as i32);
                let known = &mut self.known_len[row];
                if *known as usize == len {
                    *known += 1;
                }
            }
        }
        n
    }

    /// Completes a one-token batch that the fast loop went through whole:
    /// it applied each request (with its token) but those it listed in
    /// `listed` (ascending), which start a page and are not marked slow.
    /// Each listed request takes the next of `pages` (the free stack's top,
    /// taken in pop order: last first) and, with `TOKENS`, stores its token
    /// and advances its known count, as the fast loop does. Power-of-two
    /// page sizes only; `pages` holds a page for every listed request.
    pub(crate) fn finish_decode<const TOKENS: bool>(
        &mut self,
        handles: &[i64],
        listed: &[u32],
        tokens: &[i64],
        out: &mut [i64],
        pages: &[u32],
        mut store_token: impl FnMut(usize, i32),
    ) {
        let Some(shift) = self.geo.page_shift else {
            return;
        };
        debug_assert_eq!(pages.len(), listed.len());
        let stride = self.row_pages;
        for (&j, &p) in listed.iter().zip(pages.iter().rev()) {
            let i = j as usize;
            let row = handle_row(handles[i]) as usize;
            let r = &mut self.rows[row];
            debug_assert!(r.last & SLOW == 0 && r.len as usize & ((1 << shift) - 1) == 0);
            let len = r.len as usize;
            self.page_lists[row * stride + (len >> shift)] = p;
            r.last = p;
            r.len = len as u32 + 1;
            out[i] = ((p as usize) << shift) as i64;
            if TOKENS {
                store_token(out[i] as usize, tokens[i] as i32);
                let known = &mut self.known_len[row];
                if *known as usize == len {
                    *known += 1;
                }
            }
        }
    }

    /// Undoes the requests a failing batch applied in its first pass (those
    /// before `done` not listed slow), last first, so that pages taken come
    /// back (through `give_back`) onto the free stack in their old order.
    pub(crate) fn undo_applied<G: Fn(usize) -> i64>(
        &mut self,
        handles: &[i64],
        get: &G,
        slow: &[u32],
        done: usize,
        mut give_back: impl FnMut(u32),
    ) {
        let mut s = slow.iter().rev().peekable();
        for i in (0..done).rev() {
            if s.peek() == Some(&&(i as u32)) {
                s.next();
                continue;
            }
            let row = handle_row(handles[i]) as usize;
            let c = get(i) as usize;
            let old = self.rows[row].len as usize - c;
            self.rows[row].len = old as u32;
            self.known_len[row] = self.known_len[row].min(old as u32);
            if c > 0 && self.geo.offset_in_page(old) == 0 {
                let base = row * self.row_pages;
                let np = self.geo.pages_for(old);
                // Back on the free stack, with the refcount 1 it kept.
                give_back(self.page_lists[base + np]);
                self.rows[row].last = if np == 0 {
                    0
                } else {
                    self.page_lists[base + np - 1]
                };
            }
        }
    }

    /// A decode step's table entries, once the whole batch is applied:
    /// request `i` (one new token each) gets `slots[i]` at its last
    /// position, table[row, len - 1].
    pub(crate) fn write_decode(&self, table: &mut SlotTable<'_>, handles: &[i64], slots: &[i64]) {
        for (&h, &slot) in handles.iter().zip(slots) {
            let row = handle_row(h) as usize;
            if let Some(r) = self.rows.get(row) {
                // len >= 1: the request was just extended (the table's
                // extent was checked; the gets only keep it safe).
                table.write_one(row, r.len as usize - 1, slot);
            }
        }
    }
}
