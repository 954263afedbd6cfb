//! The decode step's fast paths of extend: loops that apply the leading
//! requests of a batch which stay in (or just start) their own last page,
//! touching only each request's 16-byte hot row, and the undo that puts
//! them back when the rest of the batch turns out invalid. `extend.rs`
//! validates and grows everything else.

use crate::allocator::SlotAllocator;
use crate::grow::fill_run;
use crate::handle::{handle_generation, handle_row};
use crate::rows::{OPEN, SLOW};

impl SlotAllocator {
    /// The decode step's loop, kept tight (few live values, no error
    /// plumbing): applies the leading requests that are valid and stay in
    /// their own last page, and stops at the first that is not (the general
    /// loop takes over there and validates it). Power-of-two page sizes
    /// only. Returns (requests applied, slots written).
    #[inline]
    pub(crate) fn extend_decode_run<G: Fn(usize) -> i64>(
        &mut self,
        handles: &[i64],
        get: &G,
        out: &mut [i64],
    ) -> (usize, usize) {
        if self.page_shift.is_none() {
            return (0, 0);
        }
        let (ps, epoch, max_len, stride) = (
            self.page_size,
            self.epoch,
            self.max_context_len,
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
            let fits = (c as u64) <= room as u64
                && len + room <= max_len
                && (off != 0 || (c > 0 && !self.free_pages.is_empty()));
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
            r.stamp = epoch;
            r.len = (len + c) as u32;
            if new_page {
                // Undone by `undo_applied` if the batch fails later.
                // A FREE page's refcount is 1 already (see `pages.rs`).
                let p = self.free_pages.pop().unwrap_or(0);
                self.page_lists[row * stride + (len >> self.page_shift.unwrap_or(0))] = p;
                r.last = p;
            }
            fill_run(&mut out[k..k + c], r.last as usize * ps + off);
            k += c;
        }
        (handles.len(), k)
    }

    /// `extend_decode_run` for a count of 1 per request, the decode step
    /// itself: request `i` writes `out[i]` (with `tokens`, it stores
    /// `tokens[i]` while the row is in hand), and the few values the loop
    /// keeps live stay in registers. The slot table is written after the
    /// batch (`SlotTable::write_decode`). Returns the requests applied.
    // Not inlined: each form is its own small function, whose loop keeps
    // its registers (inlined into extend's fused pass, the forms cost up
    // to 1 ns more per request).
    #[inline(never)]
    pub(crate) fn extend_decode_one<const TOKENS: bool>(
        &mut self,
        handles: &[i64],
        tokens: &[i64],
        out: &mut [i64],
    ) -> usize {
        let Some(shift) = self.page_shift else {
            return 0;
        };
        if TOKENS && tokens.len() != handles.len() {
            return 0; // the general path reports the length
        }
        let (mask, epoch, max_len) = ((1usize << shift) - 1, self.epoch, self.max_context_len);
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
                | (r.stamp == epoch)
                | (r.last & SLOW != 0)
                | (len >= max_len)
                | (TOKENS && !(0..=i32::MAX as i64).contains(&tokens[i]))
            {
                return i;
            }
            if len & mask == 0 {
                // A page boundary: one page off the free stack (undone by
                // `undo_applied` if the batch fails later).
                // (Its refcount is 1 already: see `pages.rs`.)
                let Some(p) = self.free_pages.pop() else {
                    return i;
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
                self.index.tokens[slot] = tokens[i] as i32;
                let known = &mut self.known_len[row];
                if *known as usize == len {
                    *known += 1;
                }
            }
        }
        n
    }

    /// Undoes the requests a failing batch applied in its first pass (those
    /// before `done` not listed slow), last first, so that pages taken come
    /// back onto the free stack in their old order.
    pub(crate) fn undo_applied<G: Fn(usize) -> i64>(
        &mut self,
        handles: &[i64],
        get: &G,
        slow: &[u32],
        done: usize,
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
            if c > 0 && self.offset_in_page(old) == 0 {
                let base = row * self.row_pages;
                let np = self.pages_for(old);
                // Back on the free stack, with the refcount 1 it kept.
                self.free_pages.push(self.page_lists[base + np]);
                self.rows[row].last = if np == 0 {
                    0
                } else {
                    self.page_lists[base + np - 1]
                };
            }
        }
    }
}
