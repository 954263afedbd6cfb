//! A row's life: taken by an open (or given back by a refused one),
//! started on a matched prefix or as a fork, closed, retired.

use super::row::{Row, OPEN, SLOW};
use super::{row_retired, Requests};
use crate::error::{PoolError, Result};
use crate::handle::{make_handle, next_generation};
use crate::prefix::tip::ChainTip;

impl Requests {
    /// Rows free for `n` new requests, or `TooManyRequests` naming `call`
    /// (the public call that asked).
    pub(crate) fn check_available(&self, n: usize, call: &'static str) -> Result<()> {
        if n > self.free_rows.len() {
            return Err(PoolError::TooManyRequests {
                call,
                requested: n,
                // (Both at most MAX_REQUESTS, checked at construction.)
                open: u32::try_from(self.open_count).unwrap_or(u32::MAX),
                max: u32::try_from(self.rows.len() - self.retired_rows).unwrap_or(u32::MAX),
            });
        }
        Ok(())
    }

    /// Rows an open can take now.
    #[inline]
    pub(crate) fn free_rows(&self) -> usize {
        self.free_rows.len()
    }

    /// The row the `i`-th next `take_row` takes (`i < free rows`).
    #[inline]
    pub(crate) fn nth_free_row(&self, i: usize) -> usize {
        self.free_rows[self.free_rows.len() - 1 - i] as usize
    }

    /// Row `row`'s hot state, to give back with `untake_row`.
    pub(crate) fn row_state(&self, row: usize) -> Row {
        self.rows[row]
    }

    /// Takes a free row for a new, empty request and returns its handle.
    /// The caller checked `check_available`.
    pub(crate) fn take_row(&mut self) -> (usize, i64) {
        let row = self.free_rows.pop().unwrap_or(0) as usize;
        let r = &mut self.rows[row];
        let cur = r.generation & !OPEN;
        let g = if cur == 0 {
            self.generation_start
        } else {
            next_generation(cur)
        };
        *r = Row {
            generation: g | OPEN,
            len: 0,
            last: 0,
            stamp: r.stamp,
        };
        self.cold[row].reset(0);
        self.known_len[row] = 0;
        self.open_count += 1;
        (row, make_handle(g, row as u32))
    }

    /// Undoes the `take_row` that took `row`, whose row state was `before`:
    /// the row is closed again under its old generation and is the next
    /// one taken. Only for the newest rows taken, last first.
    pub(crate) fn untake_row(&mut self, row: usize, before: Row) {
        self.rows[row] = before;
        self.cold[row].reset(0);
        self.known_len[row] = 0;
        self.open_count -= 1;
        self.free_rows.push(row as u32);
    }

    /// Starts the request just opened in `row` on `pages` (held already)
    /// of a matched prefix: `len` tokens, prompt `prompt`, chain at `tip`.
    pub(crate) fn start_on(
        &mut self,
        row: usize,
        salt: i64,
        prompt: Vec<i32>,
        pages: &[u32],
        tip: ChainTip,
        len: usize,
    ) {
        let base = row * self.row_pages;
        self.page_lists[base..base + pages.len()].copy_from_slice(pages);
        let cold = &mut self.cold[row];
        cold.reset(salt);
        cold.prompt = prompt;
        cold.hashed_pages = pages.len() as u32;
        cold.tip = tip;
        cold.exclusive = pages.is_empty();
        self.known_len[row] = len as u32;
        self.rows[row].len = len as u32;
        self.rows[row].last = pages.last().copied().unwrap_or(0);
    }

    /// Makes the request just opened in `row` a copy of `parent`'s: same
    /// length, pages (whose holders the caller counts), salt, chain and
    /// known tokens, and `prompt` (a copy of the parent's).
    pub(crate) fn fork_row(&mut self, parent: usize, row: usize, prompt: Vec<i32>) {
        let len = self.rows[parent].len as usize;
        let np = self.geo.pages_for(len);
        let (pbase, base) = (parent * self.row_pages, row * self.row_pages);
        self.page_lists.copy_within(pbase..pbase + np, base);
        let mut cold = self.cold[parent].clone_without_prompt();
        cold.prompt = std::mem::take(&mut self.cold[row].prompt);
        cold.set_prompt(prompt);
        self.cold[row] = cold;
        self.known_len[row] = self.known_len[parent];
        self.rows[row].len = len as u32;
        self.rows[row].last = self.rows[parent].last & !SLOW;
        self.cold[parent].exclusive = false;
    }

    /// Closes `row`, whose pages were released already.
    pub(crate) fn close_row(&mut self, row: usize) {
        let r = &mut self.rows[row];
        r.generation &= !OPEN;
        r.last = 0;
        let cold = &mut self.cold[row];
        // Keep small prompt buffers for the row's next request; return big ones.
        if cold.prompt.capacity() > 4096 {
            cold.prompt = Vec::new();
        }
        cold.prompt.clear();
        self.open_count -= 1;
        if row_retired(self.generation_base, self.rows[row].generation) {
            self.retired_rows += 1;
        } else {
            self.free_rows.push(row as u32);
        }
    }

    /// Whether `row` holds an open request.
    #[inline]
    pub(crate) fn is_open(&self, row: usize) -> bool {
        self.rows[row].is_open()
    }

    /// After every row is closed: the free-row stack in a fresh pool's
    /// order (rows 0, 1, 2, ... open next).
    pub(crate) fn restack_free_rows(&mut self) {
        self.free_rows.clear();
        let base = self.generation_base;
        let rows = &self.rows;
        self.free_rows.extend(
            (0..rows.len() as u32)
                .rev()
                .filter(|&r| !row_retired(base, rows[r as usize].generation)),
        );
    }

    /// Gives the next `caps.len()` free rows their old prompt capacities
    /// (a failed call that filled their buffers leaves memory as it was).
    pub(crate) fn restore_prompt_capacity(&mut self, caps: &[usize]) {
        for (j, &cap) in caps.iter().enumerate() {
            let r = self.nth_free_row(j);
            let p = &mut self.cold[r].prompt;
            p.clear();
            p.shrink_to(cap);
        }
    }
}
