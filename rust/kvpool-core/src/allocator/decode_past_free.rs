//! A decode step on a pool out of FREE pages. extend's fast loop
//! (`requests/decode.rs`) validates and stamps a request that starts a page
//! when the free stack is empty, and lists it rather than applying it; the
//! general pass validates whatever the loop stopped at. Once the whole
//! batch is known to be valid, the victims are evicted in one walk, and the
//! listed requests are applied the fast loop's way: the second pass's
//! per-request work (a `grow_row` call and the table and token writes for
//! each) was most of such a step. At page size 1 every request takes a
//! page; at larger sizes one in a page's worth of steps does, and the
//! others were applied already.

use super::SlotAllocator;
use crate::handle::handle_row;

/// Where extend's passes left a one-token batch: the fast loop went through
/// the first `first` requests (applying each, or listing it), `slow` lists
/// (ascending) those still to grow, with the pages they need, and the
/// first `recorded` requests have their token ids stored.
pub(super) struct PastFree<'a> {
    pub(super) first: usize,
    pub(super) slow: &'a mut Vec<u32>,
    pub(super) needed_pages: &'a mut usize,
    pub(super) recorded: &'a mut usize,
}

impl SlotAllocator {
    /// Applies what it can of a validated one-token batch whose fast loop
    /// stopped for want of a FREE page, and updates `past` to say what is
    /// left for the second pass.
    pub(super) fn apply_past_free(
        &mut self,
        handles: &[i64],
        tokens: Option<&[i64]>,
        out: &mut [i64],
        past: PastFree<'_>,
    ) {
        if self.geo.page_size == 1 {
            // Every request before `from` was applied by the fast loop, with
            // its token (at page size 1, once the stack is empty every later
            // request is listed).
            let from = past.slow[0] as usize;
            let m = self.decode_past_free(handles, tokens, out, past.slow, *past.needed_pages);
            past.slow.drain(..m);
            *past.needed_pages -= m;
            if tokens.is_some() {
                *past.recorded = from + m;
            }
        } else if self.finish_decode_past_free(
            handles,
            past.first,
            tokens,
            out,
            past.slow,
            *past.needed_pages,
        ) {
            past.slow.clear();
            *past.needed_pages = 0;
            if tokens.is_some() {
                *past.recorded = handles.len();
            }
        }
    }

    /// Applies the leading requests of `slow` (the batch's indices from the
    /// first the fast loop did not apply: all of them, consecutive, at page
    /// size 1, where every request takes a page) with the fast loop, after evicting the victims the batch
    /// needs past the free stack (`needed_pages` in all) beneath it, as the
    /// second pass would; returns how many it applied. The rest (from a row
    /// that must grow the general way) are left to the second pass, which
    /// takes the next pages off the same stack, so every request gets the
    /// page it would have got one by one.
    fn decode_past_free(
        &mut self,
        handles: &[i64],
        tokens: Option<&[i64]>,
        out: &mut [i64],
        slow: &[u32],
        needed_pages: usize,
    ) -> usize {
        let short = needed_pages.saturating_sub(self.pages.free_len());
        if short > 1 {
            self.evict_beneath_free(short);
        }
        let from = slow[0] as usize;
        debug_assert!(slow
            .iter()
            .enumerate()
            .all(|(j, &i)| i as usize == from + j));
        let (rq, pages, prefix) = (&mut self.requests, &mut self.pages, &mut self.prefix);
        let take = || pages.pop_free();
        let (hs, dst) = (&handles[from..], &mut out[from..]);
        // STAMPED: the general pass stamped these rows for this batch.
        match tokens {
            Some(x) => rq.decode_one::<true, true>(
                hs,
                &x[from..],
                dst,
                take,
                |s, t| prefix.set_token(s, t),
                None,
            ),
            None => rq.decode_one::<false, true>(hs, &[], dst, take, |_, _| {}, None),
        }
    }

    /// At page sizes above 1: completes a batch that the fast loop went
    /// through whole (`first`: as far as it went), applying all but the
    /// requests it listed in `slow` (those that start a page), if none of
    /// those is marked slow, after evicting the victims they need past the
    /// free stack (`needed_pages` in all) beneath it. Returns whether it did;
    /// if not, nothing changed and the second pass grows the listed
    /// requests. (The fast loop stops short only at a request that is
    /// invalid, which fails the batch, or marked slow, which is listed.)
    ///
    /// A slow request may copy its shared last page or unregister a cached
    /// one, whose victims and Removed event come in their turn among the
    /// others' one request at a time: then the victims cannot be evicted
    /// in one walk ahead of it. The listed ones here take only new pages, in
    /// request order off the stack the victims were slid beneath, as one
    /// eviction a request would give them.
    fn finish_decode_past_free(
        &mut self,
        handles: &[i64],
        first: usize,
        tokens: Option<&[i64]>,
        out: &mut [i64],
        slow: &[u32],
        needed_pages: usize,
    ) -> bool {
        if self.geo.page_shift.is_none()
            || first != handles.len()
            || needed_pages != slow.len()
            || slow.iter().any(|&i| {
                self.requests
                    .tail(handle_row(handles[i as usize]) as usize)
                    .2
            })
        {
            return false;
        }
        let short = needed_pages.saturating_sub(self.pages.free_len());
        if short > 0 {
            // Does nothing with a host tier or priorities (see there).
            self.evict_beneath_free(short);
        }
        let n = slow.len();
        if self.pages.free_len() < n {
            return false;
        }
        let (rq, pages, prefix) = (&mut self.requests, &mut self.pages, &mut self.prefix);
        let taken = pages.free_top(n);
        match tokens {
            Some(x) => rq
                .finish_decode::<true>(handles, slow, x, out, taken, |s, t| prefix.set_token(s, t)),
            None => rq.finish_decode::<false>(handles, slow, &[], out, taken, |_, _| {}),
        }
        pages.drop_free_top(n);
        true
    }
}
