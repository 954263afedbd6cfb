//! `check()`: walks the whole pool and verifies every invariant. O(pool size)
//! by nature; meant for tests and debugging, cheap enough to run after every op.
//!
//! - every page is in exactly one state: FREE (free stack, stored
//!   refcount 1), HELD (refcount >= 1) or CACHED (refcount 0, registered,
//!   on the LRU list);
//!   FREE + HELD + CACHED = capacity; page 0 is in none;
//! - each refcount equals the number of open requests whose page list names it,
//!   plus the queued copies that read it (`copies.rs`);
//! - every queued copy writes into a held page of its own, and the queue's
//!   counts and page map agree with its runs;
//! - the index and the page registrations agree both ways;
//! - the LRU list is well linked and is exactly the CACHED set;
//! - rows: lengths, last pages, the SLOW bit wherever it is needed, row stacks.

use crate::allocator::SlotAllocator;
use crate::error::{PoolError, Result};
use crate::index::DEAD;
use crate::lookup::ChainTip;
use crate::rows::{OPEN, SLOW};

impl SlotAllocator {
    pub fn check(&self) -> Result<()> {
        self.check_pages()?;
        self.check_copies()?;
        self.check_index()?;
        self.check_rows()
    }

    fn check_pages(&self) -> Result<()> {
        let fail = |m: String| Err(PoolError::Invariant(m));
        let n = self.num_pages;
        let st = &self.index.state;
        if st.len() != n {
            return fail("the per-page state array has the wrong length".into());
        }
        // Holders counted from the open requests' page lists.
        let mut holders = vec![0u32; n];
        for row in 0..self.max_requests {
            if self.rows[row].generation & OPEN == 0 {
                continue;
            }
            for &p in self.row_pages_of(row) {
                if p == 0 || p as usize >= n {
                    return fail(format!("row {row} holds out-of-range page {p}"));
                }
                holders[p as usize] += 1;
            }
        }
        // A waiting copy holds its source (checked in range by check_copies).
        for r in self.copies.live() {
            if let Some(h) = holders.get_mut(r.src as usize) {
                *h += 1;
            }
        }
        // 0 unseen, 1 free stack, 2 LRU.
        let mut listed = vec![0u8; n];
        for &p in &self.free_pages {
            let p = p as usize;
            if p == 0 || p >= n || listed[p] != 0 {
                return fail(format!("free stack entry {p} is out of range or repeated"));
            }
            listed[p] = 1;
        }
        let mut walked = 0usize;
        let mut p = st[0].next as usize;
        let mut prev = 0usize;
        while p != 0 {
            if p >= n || listed[p] != 0 || walked >= n {
                return fail(format!(
                    "LRU list entry {p} is out of range, repeated or on the free stack"
                ));
            }
            if st[p].prev as usize != prev {
                return fail(format!("LRU list back link of page {p} is broken"));
            }
            listed[p] = 2;
            walked += 1;
            prev = p;
            p = st[p].next as usize;
        }
        if st[0].prev as usize != prev || walked != self.index.lru_len {
            return fail(format!(
                "LRU list walks {walked} pages but counts {}",
                self.index.lru_len
            ));
        }
        let (mut free, mut held, mut cached) = (0usize, 0usize, 0usize);
        for p in 1..n {
            // A FREE page stores refcount 1, the count its taker needs (see
            // `pages.rs`); it has no holder.
            if listed[p] == 1 && st[p].holders() != 1 {
                return fail(format!(
                    "FREE page {p} stores refcount {} instead of 1 (taking it would \
                     leave that count)",
                    st[p].holders()
                ));
            }
            let rc = if listed[p] == 1 { 0 } else { st[p].holders() };
            let reg = st[p].is_registered();
            if rc != holders[p] {
                return fail(format!(
                    "page {p} has refcount {rc} but {} holders",
                    holders[p]
                ));
            }
            match (rc, reg, listed[p]) {
                (0, false, 1) => free += 1,
                (0, true, 2) => cached += 1,
                (r, _, 0) if r > 0 => held += 1,
                _ => {
                    return fail(format!(
                        "page {p} is in no single state (refcount {rc}, registered {reg}, list {})",
                        listed[p]
                    ))
                }
            }
        }
        // A released destination's copy is dropped: every queued copy
        // writes into a HELD page.
        for r in self.copies.live() {
            if listed.get(r.dst as usize).is_some_and(|&l| l != 0) {
                return fail(format!(
                    "a queued copy writes into page {}, which nobody holds",
                    r.dst
                ));
            }
        }
        if st[0].holders() != 0 || st[0].is_registered() || holders[0] != 0 {
            return fail("page 0 is held or registered".into());
        }
        if free + held + cached != n - 1 {
            return fail(format!(
                "FREE {free} + HELD {held} + CACHED {cached} != capacity {}",
                n - 1
            ));
        }
        Ok(())
    }

    fn check_copies(&self) -> Result<()> {
        let fail = |m: String| Err(PoolError::Invariant(m));
        let q = &self.copies;
        let (mut slots, mut dead) = (0usize, 0usize);
        for (i, r) in q.runs.iter().enumerate() {
            if r.len == 0 {
                dead += 1;
                continue;
            }
            let in_range = |p: u32| p != 0 && (p as usize) < self.num_pages;
            if !in_range(r.src) || !in_range(r.dst) || r.src == r.dst {
                return fail(format!(
                    "queued copy {i} runs from page {} to {}",
                    r.src, r.dst
                ));
            }
            if r.len as usize >= self.page_size {
                return fail(format!("queued copy {i} copies {} slots of a page", r.len));
            }
            if q.into[r.dst as usize] != i as u32 + 1 {
                return fail(format!(
                    "queued copy {i} into page {} is not the page's copy",
                    r.dst
                ));
            }
            slots += r.len as usize;
        }
        if slots != q.slots || dead != q.dead || dead * 2 > q.runs.len() {
            return fail(format!(
                "copy queue counts {} slots and {} dropped runs of {}, has {slots} and {dead}",
                q.slots,
                q.dead,
                q.runs.len()
            ));
        }
        for (p, &i) in q.into.iter().enumerate() {
            let ok = i == 0
                || q.runs
                    .get(i as usize - 1)
                    .is_some_and(|r| r.len > 0 && r.dst as usize == p);
            if !ok {
                return fail(format!(
                    "page {p} names queued copy {i}, which does not write it"
                ));
            }
        }
        Ok(())
    }

    fn check_index(&self) -> Result<()> {
        let fail = |m: String| Err(PoolError::Invariant(m));
        let ix = &self.index;
        let mut listed = 0usize;
        for i in ix.table.entries() {
            let Some(e) = ix.entries.get(i as usize) else {
                return fail(format!("index entry {i} is out of range"));
            };
            let Some(id) = ix.idents.get(i as usize) else {
                return fail(format!("index entry {i} has no hash"));
            };
            if ix.find(crate::keys::key_of(id.hash)) != Some(i)
                || ix.state.get(e.page as usize).map(|s| s.entry) != Some(i + 1)
            {
                return fail(format!(
                    "index entry {i} (page {}) disagrees with its page or key",
                    e.page
                ));
            }
            if e.first_token != ix.page_tokens(e.page)[0] {
                return fail(format!(
                    "index entry {i} keeps first token {} but page {} starts with {}",
                    e.first_token,
                    e.page,
                    ix.page_tokens(e.page)[0]
                ));
            }
            listed += 1;
        }
        let registered = ix.state.iter().filter(|s| s.is_registered()).count();
        if registered != ix.len() || listed != ix.len() {
            return fail(format!(
                "{registered} pages are registered but the index has {} entries ({listed} listed)",
                ix.len()
            ));
        }
        for (p, e) in ix.state.iter().map(|s| s.entry).enumerate() {
            if e == 0 {
                continue;
            }
            match (
                ix.entries.get(e as usize - 1),
                ix.idents.get(e as usize - 1),
            ) {
                (Some(en), Some(id))
                    if en.page as usize == p
                        && ix.find(crate::keys::key_of(id.hash)) == Some(e - 1) => {}
                _ => return fail(format!("registration of page {p} is not in the index")),
            }
        }
        if ix.entries.len() != ix.len() + ix.free_entries.len()
            || ix.idents.len() != ix.entries.len()
        {
            return fail("index entry slab leaks entries".into());
        }
        // A hinted walk does not read a child's salt (`lookup.rs`): every
        // entry must have its live parent's.
        let live: std::collections::HashMap<u64, u32> = ix
            .table
            .entries()
            .map(|i| (ix.entries[i as usize].reg, i))
            .collect();
        for i in ix.table.entries() {
            let e = &ix.entries[i as usize];
            if let Some(&p) = live.get(&e.parent_reg) {
                if ix.idents[p as usize].salt != ix.idents[i as usize].salt {
                    return fail(format!(
                        "index entry {i} has salt {} under a parent (entry {p}) of salt {}",
                        ix.idents[i as usize].salt, ix.idents[p as usize].salt
                    ));
                }
            }
        }
        // A freed slot must never verify as anybody's child (`lookup.rs`).
        for &i in &ix.free_entries {
            match ix.entries.get(i as usize) {
                Some(e) if e.parent_reg == DEAD && ix.state[e.page as usize].entry != i + 1 => {}
                _ => return fail(format!("free index slot {i} is live or not marked dead")),
            }
        }
        Ok(())
    }

    fn check_rows(&self) -> Result<()> {
        let fail = |m: String| Err(PoolError::Invariant(m));
        let mut open = 0usize;
        let mut retired = 0usize;
        let mut row_free = vec![false; self.max_requests];
        for &r in &self.free_rows {
            let r = r as usize;
            if r >= self.max_requests || row_free[r] || self.rows[r].generation & OPEN != 0 {
                return fail(format!("free row stack entry {r} is invalid or repeated"));
            }
            row_free[r] = true;
        }
        for (row, r) in self.rows.iter().enumerate() {
            let len = r.len as usize;
            if r.generation & OPEN == 0 {
                if len != 0 || r.last != 0 {
                    return fail(format!("closed row {row} has length {len}"));
                }
                if !row_free[row] {
                    if !Self::row_retired(self.generation_base, r.generation) {
                        return fail(format!("closed row {row} is neither free nor retired"));
                    }
                    retired += 1;
                }
                continue;
            }
            open += 1;
            if r.generation & !OPEN == 0 || len > self.max_context_len {
                return fail(format!("open row {row} has generation 0 or length {len}"));
            }
            let pages = self.row_pages_of(row);
            let last = pages.last().copied().unwrap_or(0);
            if r.last & !SLOW != last {
                return fail(format!(
                    "row {row} last page {} but holds {last} last",
                    r.last & !SLOW
                ));
            }
            if self.slow_bit(row, len, last) != 0 && r.last & SLOW == 0 {
                return fail(format!("row {row} needs the slow path but SLOW is clear"));
            }
            let c = &self.cold[row];
            if c.exclusive
                && pages.iter().any(|&p| {
                    self.index.state[p as usize].holders() != 1
                        || self.index.is_registered(p)
                        || self.copies.run_into(p) != 0
                })
            {
                return fail(format!("row {row} is marked exclusive but shares a page"));
            }
            if c.hashed_pages == 0 && c.tip != ChainTip::root(c.salt) {
                return fail(format!(
                    "row {row} hashed no page but its chain tip is not the root"
                ));
            }
            let known = self.known_len[row];
            if known as usize > len || c.hashed_pages as usize > len / self.page_size {
                return fail(format!(
                    "row {row} knows {known} tokens / hashed {} pages of length {len}",
                    c.hashed_pages
                ));
            }
        }
        if open != self.open_count || retired != self.retired_rows {
            return fail(format!(
                "{open} rows open / {retired} retired, counters say {} / {}",
                self.open_count, self.retired_rows
            ));
        }
        if self.free_rows.len() + open + retired != self.max_requests {
            return fail(format!(
                "{} free rows + {open} open + {retired} retired != max_requests {}",
                self.free_rows.len(),
                self.max_requests
            ));
        }
        Ok(())
    }
}
