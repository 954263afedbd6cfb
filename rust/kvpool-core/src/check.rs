//! `check()`: walks the whole pool and verifies every invariant. O(pool size)
//! by nature; meant for tests and debugging, cheap enough to run after every op.

use crate::allocator::{SlotAllocator, FREE, RESERVED};
use crate::error::{PoolError, Result};

impl SlotAllocator {
    pub fn check(&self) -> Result<()> {
        let fail = |m: String| Err(PoolError::Invariant(m));
        if self.owner.len() != self.num_pages {
            return fail(format!(
                "owner has {} entries for {} pages",
                self.owner.len(),
                self.num_pages
            ));
        }
        if self.owner[0] != RESERVED {
            return fail(format!("page 0 is not reserved (owner {})", self.owner[0]));
        }
        // Each usable page must be seen exactly once: on the free stack or in one request.
        let mut seen = vec![false; self.num_pages];
        for &p in &self.free_pages {
            let p = p as usize;
            if p == 0 || p >= self.num_pages {
                return fail(format!("page {p} on the free stack is out of range"));
            }
            if seen[p] {
                return fail(format!("page {p} is on the free stack twice"));
            }
            if self.owner[p] != FREE {
                return fail(format!("free page {p} has owner {}", self.owner[p]));
            }
            seen[p] = true;
        }
        let mut open = 0usize;
        let mut held = 0usize;
        for (row, req) in self.requests.iter().enumerate() {
            if !req.open {
                if req.len != 0 || !req.pages.is_empty() {
                    return fail(format!("closed row {row} holds {} pages", req.pages.len()));
                }
                continue;
            }
            open += 1;
            if req.generation == 0 {
                return fail(format!("open row {row} has generation 0"));
            }
            if req.len > self.max_context_len {
                return fail(format!("row {row} length {} > max_context_len", req.len));
            }
            if req.pages.len() != self.pages_for(req.len) {
                return fail(format!(
                    "row {row} has length {} but holds {} pages of {}",
                    req.len,
                    req.pages.len(),
                    self.page_size
                ));
            }
            for &p in &req.pages {
                let p = p as usize;
                if p == 0 || p >= self.num_pages {
                    return fail(format!("row {row} holds out-of-range page {p}"));
                }
                if seen[p] {
                    return fail(format!("page {p} held by row {row} is also elsewhere"));
                }
                if self.owner[p] as usize != row {
                    return fail(format!(
                        "page {p} held by row {row} has owner {}",
                        self.owner[p]
                    ));
                }
                seen[p] = true;
            }
            held += req.pages.len();
        }
        if self.free_pages.len() + held != self.num_pages - 1 {
            return fail(format!(
                "free {} + held {held} != capacity {}",
                self.free_pages.len(),
                self.num_pages - 1
            ));
        }
        if open != self.open_count {
            return fail(format!(
                "{open} rows are open but open_count is {}",
                self.open_count
            ));
        }
        let mut row_seen = vec![false; self.max_requests];
        for &r in &self.free_rows {
            let r = r as usize;
            if r >= self.max_requests || row_seen[r] || self.requests[r].open {
                return fail(format!("free row stack entry {r} is invalid or repeated"));
            }
            row_seen[r] = true;
        }
        if self.free_rows.len() + open != self.max_requests {
            return fail(format!(
                "{} free rows + {open} open != max_requests {}",
                self.free_rows.len(),
                self.max_requests
            ));
        }
        Ok(())
    }
}
