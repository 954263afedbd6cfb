//! fork: new requests that share all of a parent's pages and known tokens.
//! Full pages are simply shared; a partly filled last page is shared too and
//! becomes copy-on-write (every holder on the slow path): the first holder
//! that extends into it gets a copy of its valid part (see `grow.rs`).

use super::SlotAllocator;
use crate::error::Result;
use crate::memory::reserve;

impl SlotAllocator {
    /// Creates `n` requests, each a copy of `handle`'s request: same length,
    /// same pages (one more holder each), same prompt, salt and known tokens.
    /// Costs O(n * pages). Returns the new handles. All-or-nothing.
    ///
    /// Errors (nothing changed): `InvalidHandle` (closed, stale or unknown
    /// parent), `RequestSwappedOut`, `TooManyRequests`, `InvalidArgument`
    /// (memory for the prompts).
    pub fn fork(&mut self, handle: i64, n: usize) -> Result<Vec<i64>> {
        let parent = self.requests.resolve(handle)?;
        self.requests.check_resident(parent, handle)?;
        self.requests.check_available(n, "fork")?;
        let mut out = Vec::new();
        reserve(&mut out, n, "handles")?;
        let mut prompts = Vec::new();
        reserve(&mut prompts, n, "prompts")?;
        for _ in 0..n {
            let parent_prompt = self.requests.prompt(parent);
            let mut p = Vec::new();
            reserve(&mut p, parent_prompt.len(), "prompt tokens")?;
            p.extend_from_slice(parent_prompt);
            prompts.push(p);
        }
        let (len, last, _) = self.requests.tail(parent);
        let shares_partial_page = self.geo.offset_in_page(len) != 0;
        for prompt in prompts {
            let (row, h) = self.requests.take_row();
            self.requests.fork_row(parent, row, prompt);
            for &p in self.requests.held_pages(row) {
                self.pages.add_holder(p);
            }
            if self.needs_slow(row, len, last) {
                self.requests.mark_slow(row);
            }
            out.push(h);
        }
        if shares_partial_page && n > 0 {
            self.requests.mark_slow(parent);
        }
        Ok(out)
    }
}
