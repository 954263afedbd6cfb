//! The requests' own invariants (the allocator's `check` adds those that
//! involve the pages' states): the row stacks and counters, each open
//! row's length, last page and chain progress.

use super::row::{OPEN, SLOW};
use super::Requests;
use crate::prefix::tip::ChainTip;

impl Requests {
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        let max = self.rows.len();
        let mut open = 0usize;
        let mut retired = 0usize;
        let mut row_free = vec![false; max];
        for &r in &self.free_rows {
            let r = r as usize;
            if r >= max || row_free[r] || self.rows[r].is_open() {
                return Err(format!("free row stack entry {r} is invalid or repeated"));
            }
            row_free[r] = true;
        }
        for (row, r) in self.rows.iter().enumerate() {
            let len = r.len as usize;
            if !r.is_open() {
                if len != 0 || r.last != 0 {
                    return Err(format!("closed row {row} has length {len}"));
                }
                if !row_free[row] {
                    if !super::row_retired(self.generation_base, r.generation) {
                        return Err(format!("closed row {row} is neither free nor retired"));
                    }
                    retired += 1;
                }
                continue;
            }
            open += 1;
            if r.generation & !OPEN == 0 || len > self.geo.max_context_len {
                return Err(format!("open row {row} has generation 0 or length {len}"));
            }
            let last = self.held_pages(row).last().copied().unwrap_or(0);
            if r.last == super::row::SWAPPED {
                // Swapped out: its list names device and host pages, and
                // the mark stands in for the last page.
            } else if r.last & !SLOW != last {
                return Err(format!(
                    "row {row} last page {} but holds {last} last",
                    r.last & !SLOW
                ));
            }
            let c = &self.cold[row];
            if c.hashed_pages == 0 && c.tip != ChainTip::root(c.salt) {
                return Err(format!(
                    "row {row} hashed no page but its chain tip is not the root"
                ));
            }
            let known = self.known_len[row];
            if known as usize > len || c.hashed_pages as usize > len / self.geo.page_size {
                return Err(format!(
                    "row {row} knows {known} tokens / hashed {} pages of length {len}",
                    c.hashed_pages
                ));
            }
        }
        if open != self.open_count || retired != self.retired_rows {
            return Err(format!(
                "{open} rows open / {retired} retired, counters say {} / {}",
                self.open_count, self.retired_rows
            ));
        }
        if self.free_rows.len() + open + retired != max {
            return Err(format!(
                "{} free rows + {open} open + {retired} retired != max_requests {max}",
                self.free_rows.len(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
impl Requests {
    /// Test only: break one of the invariants above (or one the allocator
    /// checks across owners).
    pub(crate) fn corrupt_for_tests(&mut self, what: &str) {
        match what {
            "len" => self.rows[0].len = 3,
            "last" => self.rows[0].last = 1,
            "open_count" => self.open_count = 0,
            "exclusive" => self.cold[1].exclusive = true,
            _ => panic!("no corruption {what}"),
        }
    }
}
