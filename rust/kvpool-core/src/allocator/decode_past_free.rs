//! A page-1 decode step on a pool out of FREE pages: extend's fast loop
//! (`requests/decode.rs`) stops at the first request, since each one needs
//! a page and the free stack has none, and the general pass validates the
//! rest without applying any. Once the batch is known to be valid, the
//! victims are evicted in one walk, and the fast loop applies the requests
//! after all: the second pass's per-request growth (a `grow_row` call and
//! the table and token writes for each) was most of such a step.

use super::SlotAllocator;

impl SlotAllocator {
    /// Applies the leading requests of `slow` (the batch's indices from the
    /// first the fast loop did not apply: all of them, consecutive, at page
    /// size 1) with the fast loop, after evicting the victims the batch
    /// needs past the free stack (`needed_pages` in all) beneath it, as the
    /// second pass would; returns how many it applied. The rest (from a row
    /// that must grow the general way) are left to the second pass, which
    /// takes the next pages off the same stack, so every request gets the
    /// page it would have got one by one.
    pub(super) fn decode_past_free(
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
            Some(x) => rq
                .decode_one::<true, true>(hs, &x[from..], dst, take, |s, t| prefix.set_token(s, t)),
            None => rq.decode_one::<false, true>(hs, &[], dst, take, |_, _| {}),
        }
    }
}
