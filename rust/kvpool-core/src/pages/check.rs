//! The pool's invariants, given how many open requests name each page:
//!
//! - every page is in exactly one state: FREE (free stack, stored
//!   refcount 1), HELD (refcount >= 1) or CACHED (refcount 0, registered,
//!   on the eviction list); FREE + HELD + CACHED = capacity; page 0 is in
//!   none;
//! - each refcount equals the requests that name the page plus the queued
//!   copies that read it;
//! - every queued copy writes into a held page of its own, and the queue's
//!   counts and page map agree with its runs;
//! - the eviction lists are well linked and are exactly the CACHED set.

use super::blocks::BLOCK;
use super::PagePool;

impl PagePool {
    /// `holders[p]`: open requests whose page lists name page `p` (one
    /// entry per page).
    pub(crate) fn check(
        &self,
        mut holders: Vec<u32>,
        page_size: usize,
    ) -> std::result::Result<(), String> {
        let n = self.records.len();
        let st = &self.records;
        if holders.len() != n {
            return Err("the per-page state array has the wrong length".into());
        }
        self.copies.check(n, page_size)?;
        // A waiting copy holds its source (in range: checked above).
        for r in self.copies.live() {
            holders[r.src as usize] += 1;
        }
        // 0 unseen, 1 free stack, 2 eviction list.
        let mut listed = vec![0u8; n];
        for &p in &self.free {
            let p = p as usize;
            if p == 0 || p >= n || listed[p] != 0 {
                return Err(format!("free stack entry {p} is out of range or repeated"));
            }
            listed[p] = 1;
        }
        self.eviction.check(st, |p| {
            let seen = std::mem::replace(&mut listed[p as usize], 2);
            seen == 0
        })?;
        let (mut free, mut held, mut cached) = (0usize, 0usize, 0usize);
        for p in 1..n {
            // A FREE page stores refcount 1, the count its taker needs; it
            // has no holder.
            if listed[p] == 1 && self.holders(p as u32) != 1 {
                return Err(format!(
                    "FREE page {p} stores refcount {} instead of 1 (taking it would \
                     leave that count)",
                    self.holders(p as u32)
                ));
            }
            let rc = if listed[p] == 1 {
                0
            } else {
                self.holders(p as u32)
            };
            let reg = st[p].is_registered();
            if rc != holders[p] {
                return Err(format!(
                    "page {p} has refcount {rc} but {} holders",
                    holders[p]
                ));
            }
            match (rc, reg, listed[p]) {
                (0, false, 1) => free += 1,
                (0, true, 2) => cached += 1,
                (r, _, 0) if r > 0 => held += 1,
                _ => {
                    return Err(format!(
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
                return Err(format!(
                    "a queued copy writes into page {}, which nobody holds",
                    r.dst
                ));
            }
        }
        self.check_blocks(&listed)?;
        if st[0].holders() != 0 || st[0].is_registered() || holders[0] != 0 {
            return Err("page 0 is held or registered".into());
        }
        if free + held + cached != n - 1 {
            return Err(format!(
                "FREE {free} + HELD {held} + CACHED {cached} != capacity {}",
                n - 1
            ));
        }
        Ok(())
    }

    /// A block with holders has every page held twice or more by its
    /// record too (`blocks.rs`), and `live` counts the blocks with holders.
    fn check_blocks(&self, listed: &[u8]) -> std::result::Result<(), String> {
        let mut live = 0;
        for (b, c) in self.blocks.held() {
            live += 1;
            let pages = b * BLOCK..((b + 1) * BLOCK).min(self.records.len());
            if pages.len() < BLOCK
                || pages
                    .clone()
                    .any(|p| listed[p] != 0 || !self.records[p].is_shared())
            {
                return Err(format!(
                    "block {b} (pages {pages:?}) has {c} block holders but not every page's \
                     record holds it twice"
                ));
            }
        }
        if live != self.blocks.live() {
            return Err(format!(
                "{} blocks are counted as held, {live} have holders",
                self.blocks.live()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
impl PagePool {
    /// Test only: breaks one of the invariants above (or one the allocator
    /// checks across owners), named by `what`.
    pub(crate) fn corrupt_for_tests(&mut self, what: &str) {
        use super::record::UNHELD;
        match what {
            "free and held" => self.free.push(1),
            "page 0 held" => self.records[0].extra = 0,
            "page lost" => {
                self.free.pop();
            }
            "refcount" => self.records[1].extra += 1,
            "free with count 0" => self.records[5].extra = UNHELD,
            "free and cached" => self.eviction.insert(&mut self.records, 5),
            "registration the index lacks" => self.records[2].entry = 1,
            // The queue of `copy_queued()` in the allocator's tests: page
            // 2's slots 8, 9 wait to be copied to page 3.
            "copy hold uncounted" => self.records[2].extra -= 1,
            "copy forgotten" => self.copies.parts_mut().1[3] = 0,
            "copy slots" => *self.copies.parts_mut().2 += 1,
            "copy dropped holding" => {
                let (runs, into, slots, dead) = self.copies.parts_mut();
                runs[0].len = 0;
                *dead += 1;
                *slots -= 2;
                into[3] = 0;
            }
            "copy into free page" => {
                let p = self.free[0];
                let (runs, into, _, _) = self.copies.parts_mut();
                runs[0].dst = p;
                into[3] = 0;
                into[p as usize] = 1;
            }
            "copy of whole page" => self.copies.parts_mut().0[0].len = 4,
            _ => panic!("no corruption {what:?}"),
        }
    }

    /// Test only: live queued copies.
    pub(crate) fn live_copies_for_tests(&self) -> usize {
        self.copies.live().count()
    }
}
