//! fork: new requests that share all of a parent's pages and known tokens.
//! Full pages are simply shared; a partly filled last page is shared too and
//! becomes copy-on-write (`SLOW` on every holder): the first holder that
//! extends into it gets a copy of its valid part (see `extend.rs`).

use crate::allocator::SlotAllocator;
use crate::error::Result;
use crate::memory::reserve;
use crate::rows::SLOW;

impl SlotAllocator {
    /// Creates `n` requests, each a copy of `handle`'s request: same length,
    /// same pages (one more holder each), same prompt, salt and known tokens.
    /// Costs O(n * pages). Returns the new handles. All-or-nothing.
    ///
    /// Errors (nothing changed): `InvalidHandle` (closed, stale or unknown
    /// parent), `TooManyRequests`, `InvalidArgument` (memory for the prompts).
    pub fn fork(&mut self, handle: i64, n: usize) -> Result<Vec<i64>> {
        let parent = self.resolve(handle)?;
        self.check_rows_available(n)?;
        let mut out = Vec::new();
        reserve(&mut out, n, "handles")?;
        let mut prompts = Vec::new();
        reserve(&mut prompts, n, "prompts")?;
        for _ in 0..n {
            let mut p = Vec::new();
            reserve(&mut p, self.cold[parent].prompt.len(), "prompt tokens")?;
            p.extend_from_slice(&self.cold[parent].prompt);
            prompts.push(p);
        }
        let len = self.rows[parent].len as usize;
        let np = self.pages_for(len);
        let pbase = parent * self.row_pages;
        let shares_partial_page = self.offset_in_page(len) != 0;
        for prompt in prompts {
            let (row, h) = self.take_row();
            let base = row * self.row_pages;
            self.page_lists.copy_within(pbase..pbase + np, base);
            for k in 0..np {
                let p = self.page_lists[pbase + k];
                self.index.state[p as usize].extra += 1;
            }
            let mut cold = self.cold[parent].clone_without_prompt();
            cold.prompt = std::mem::take(&mut self.cold[row].prompt);
            cold.set_prompt(prompt);
            self.cold[row] = cold;
            self.known_len[row] = self.known_len[parent];
            let last = self.rows[parent].last & !SLOW;
            self.rows[row].len = len as u32;
            self.rows[row].last = last | self.slow_bit(row, len, last);
            out.push(h);
        }
        if n > 0 {
            self.cold[parent].exclusive = false;
        }
        if shares_partial_page && n > 0 {
            self.rows[parent].last |= SLOW;
        }
        Ok(out)
    }
}
