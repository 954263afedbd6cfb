//! extend's batch-wide checks, run after its per-request pass and before
//! anything is grown: token ids (count, range, agreement with the prompt),
//! pages available (copy-on-write and evictable pages counted), output size.

use super::SlotAllocator;
use crate::error::{PoolError, Result};
use crate::handle::handle_row;
use crate::prefix::hashing::check_token_ids;

impl SlotAllocator {
    /// The batch-wide checks after the per-request ones: token ids, pages
    /// available (copy-on-write and evictable pages counted), output size.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn check_batch<G: Fn(usize) -> i64>(
        &self,
        handles: &[i64],
        get: &G,
        tokens: Option<&[i64]>,
        slow: &[u32],
        total: usize,
        needed_pages: usize,
        out_len: usize,
        taken_early: usize,
    ) -> Result<()> {
        if let Some(t) = tokens {
            self.check_tokens(handles, get, slow, t, total)?;
        }
        let available = self.pages.available();
        if needed_pages > available {
            // Counted from before the call: the pages this batch already took
            // in its first pass are part of both sides.
            let (needed_pages, available) = (needed_pages + taken_early, available + taken_early);
            return Err(PoolError::Exhausted {
                needed_pages,
                free_pages: available,
                page_size: self.geo.page_size,
                free_slots: available * self.geo.page_size,
            });
        }
        if total != out_len {
            return Err(PoolError::InvalidArgument(format!(
                "output has {out_len} entries but the batch adds {total} slots"
            )));
        }
        Ok(())
    }

    /// Token ids must be one per new position, in range, and agree with
    /// the prompt where the prompt covers the position.
    fn check_tokens<G: Fn(usize) -> i64>(
        &self,
        handles: &[i64],
        get: &G,
        slow: &[u32],
        t: &[i64],
        total: usize,
    ) -> Result<()> {
        if t.len() != total {
            return Err(PoolError::InvalidArgument(format!(
                "tokens has {} entries but the batch adds {total} positions; pass one token id \
                 per new position, flattened like the slots",
                t.len()
            )));
        }
        check_token_ids(t)?;
        if slow.is_empty() {
            return Ok(());
        }
        // Only listed (slow-path) requests can have prompt tokens ahead;
        // they are not applied yet, so their length is their start.
        let mut s = slow.iter().peekable();
        let mut k = 0usize;
        for (i, &h) in handles.iter().enumerate() {
            let c = get(i) as usize;
            if s.peek() != Some(&&(i as u32)) {
                k += c;
                continue;
            }
            s.next();
            let row = handle_row(h) as usize;
            let start = self.requests.len(row);
            let prompt = self.requests.prompt(row);
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
}
