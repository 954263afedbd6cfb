//! A page group's invariants (`check()`), apart from the engine that keeps them.

use super::PageEngine;

impl PageEngine {
    /// This group's invariants, given the open rows and their lengths: the
    /// page pool's (holders counted from the lists), the index's both ways,
    /// and each row's list (null pages exactly before `first_held`, which
    /// keeps the window).
    pub(crate) fn check(&self, rows: &[(usize, usize)]) -> std::result::Result<(), String> {
        let n = self.geo.num_pages;
        let mut holders = vec![0u32; n];
        for &(row, len) in rows {
            let np = self.geo.pages_for(len);
            let first = self.first_held(row);
            if self.window.is_none() && first != 0 {
                return Err(format!(
                    "full-attention row {row} starts holding at page {first}"
                ));
            }
            if first > self.window_start(len) / self.geo.page_size {
                return Err(format!(
                    "row {row} (length {len}) released page {} of its window",
                    first - 1
                ));
            }
            for (k, &p) in self.list(row, np).iter().enumerate() {
                if (k < first) != (p == 0) {
                    return Err(format!(
                        "row {row} has page {p} at list position {k}, first held {first}"
                    ));
                }
                if p as usize >= n {
                    return Err(format!("row {row} holds out-of-range page {p}"));
                }
                if p != 0 {
                    holders[p as usize] += 1;
                }
            }
            if self.progress(row) > len / self.geo.page_size {
                return Err(format!("row {row}'s cache progress is past its full pages"));
            }
        }
        self.pages.check(holders, self.geo.page_size)?;
        self.map.check(|p| self.pages.is_registered(p))
    }
}
