//! The index's invariants, given what the page records say:
//!
//! - the entry slab and the page records (device and host) agree both
//!   ways: the record of a live entry's device page or host copy names it;
//!   every registered page's entry is live and names that page;
//! - an entry without a device copy is located at its host copy;
//! - each entry's first token is its page's, and an entry on both tiers has
//!   the same token ids in both;
//! - every entry has its live parent's salt (a hinted walk relies on it,
//!   `lookup.rs`);
//! - every live entry can be found: keyed, or hinted by its live parent
//!   (`links.rs`), and the table files exactly the keyed ones; each entry
//!   counts its live children, and the orphans are counted;
//! - a freed slab slot is marked dead and named by no page;
//! - every ghost (`ghosts.rs`) holds a dead slot no page names, counts
//!   its live and ghost children right, has some, and its registration is
//!   no live entry's; live entries count their ghost children.

use super::index::{PrefixIndex, DEAD};
use super::keys::key_of;
use super::tip::ChainTip;
use crate::location::{host_page, is_host, on_host};

impl PrefixIndex {
    /// `entry_of(location)`: the registration the record of the page at
    /// `location` (device page or host location, `location.rs`) names
    /// (index + 1, 0 for none; None for a page out of range);
    /// `registered`: every page whose record names one, with it.
    pub(crate) fn check(
        &self,
        entry_of: impl Fn(u32) -> Option<u32>,
        registered: impl Iterator<Item = (u32, u32)>,
    ) -> std::result::Result<(), String> {
        if self.idents.len() != self.entries.len() {
            return Err("index entry slab leaks entries".into());
        }
        let free: std::collections::HashSet<u32> = self.free_entries.iter().copied().collect();
        let is_live =
            |i: u32| (i as usize) < self.entries.len() && !free.contains(&i) && !self.is_ghost(i);
        let mut listed = 0usize;
        let mut keyed = 0usize;
        let mut copies = 0usize;
        for i in (0..self.entries.len() as u32).filter(|&i| is_live(i)) {
            let e = &self.entries[i as usize];
            if e.parent_reg == DEAD || entry_of(e.page) != Some(i + 1) {
                return Err(format!(
                    "index entry {i} (page {:#x}) disagrees with its page",
                    e.page
                ));
            }
            self.check_filed(i)?;
            keyed += self.is_keyed(i) as usize;
            if is_host(e.page) {
                if e.host == 0 || host_page(e.page) != e.host {
                    return Err(format!(
                        "index entry {i} is located on host page {} but its host copy is {}",
                        host_page(e.page),
                        e.host
                    ));
                }
                copies += 1;
            } else {
                copies += 1 + (e.host != 0) as usize;
                if e.host != 0 {
                    if entry_of(on_host(e.host)) != Some(i + 1) {
                        return Err(format!(
                            "index entry {i}'s host copy {} does not name it",
                            e.host
                        ));
                    }
                    if self.page_tokens(e.page) != self.host_page_tokens(e.host) {
                        return Err(format!(
                            "index entry {i}'s device page {} and host copy {} hold different \
                             token ids",
                            e.page, e.host
                        ));
                    }
                }
            }
            let first = self.location_tokens(e.page)[0];
            if e.first_token != first {
                return Err(format!(
                    "index entry {i} keeps first token {} but page {:#x} starts with {first}",
                    e.first_token, e.page
                ));
            }
            listed += 1;
        }
        if self
            .table
            .entries()
            .any(|i| !is_live(i) || !self.is_keyed(i))
            || keyed != self.table.len()
        {
            return Err(format!(
                "the key table files {} entries but {keyed} live entries are keyed",
                self.table.len()
            ));
        }
        let mut pages = 0usize;
        for (loc, e) in registered {
            pages += 1;
            let named = |en: &super::index::Entry| {
                if is_host(loc) {
                    en.host == host_page(loc)
                } else {
                    en.page == loc
                }
            };
            match self.entries.get(e as usize - 1) {
                Some(en) if named(en) && is_live(e - 1) => {}
                _ => return Err(format!("registration of page {loc:#x} is not in the index")),
            }
        }
        if pages != copies || listed != self.len() {
            return Err(format!(
                "{pages} pages are registered but the index has {} entries ({listed} listed) \
                 with {copies} copies",
                self.len()
            ));
        }
        if self.entries.len() != self.len() + self.free_entries.len() + self.ghosts.len()
            || free.len() != self.free_entries.len()
        {
            return Err("index entry slab leaks entries".into());
        }
        self.check_links(&is_live)?;
        self.check_ghosts(&is_live, &free, &entry_of)?;
        self.check_runs()?;
        // A freed slot must never verify as anybody's child, nor be named.
        for &i in &self.free_entries {
            match self.entries.get(i as usize) {
                Some(e)
                    if e.parent_reg == DEAD
                        && entry_of(e.page) != Some(i + 1)
                        && (e.host == 0 || entry_of(on_host(e.host)) != Some(i + 1)) => {}
                _ => return Err(format!("free index slot {i} is live or not marked dead")),
            }
        }
        Ok(())
    }

    /// Live entry `i` can be found: under its key if keyed, else through
    /// its live parent's hint (`links.rs`).
    fn check_filed(&self, i: u32) -> std::result::Result<(), String> {
        let ok = if self.is_keyed(i) {
            self.table.contains(key_of(self.idents[i as usize].hash), i)
        } else {
            self.live_parent(i)
                .is_some_and(|p| self.entries[p as usize].child == i + 1)
        };
        if ok {
            Ok(())
        } else {
            Err(format!(
                "index entry {i} (page {:#x}) cannot be found: {}",
                self.entries[i as usize].page,
                if self.is_keyed(i) {
                    "it is marked keyed but its key does not find it"
                } else {
                    "it is unkeyed and its parent does not hint it"
                }
            ))
        }
    }

    /// Every live entry has its live parent's salt (a hinted walk does not
    /// read a child's, `lookup.rs`), counts its live children, and the
    /// orphans are counted.
    fn check_links(&self, is_live: &dyn Fn(u32) -> bool) -> std::result::Result<(), String> {
        let mut children = vec![0u32; self.entries.len()];
        let mut orphans = 0usize;
        for i in (0..self.entries.len() as u32).filter(|&i| is_live(i)) {
            match self.live_parent(i) {
                Some(p) => {
                    children[p as usize] += 1;
                    if self.idents[p as usize].salt != self.idents[i as usize].salt {
                        return Err(format!(
                            "index entry {i} has salt {} under a parent (entry {p}) of salt {}",
                            self.idents[i as usize].salt, self.idents[p as usize].salt
                        ));
                    }
                }
                None if self.entries[i as usize].parent_reg != 0 => orphans += 1,
                None => {}
            }
        }
        for i in (0..self.entries.len() as u32).filter(|&i| is_live(i)) {
            if self.children(i) != children[i as usize] {
                return Err(format!(
                    "index entry {i} counts {} live children but has {}",
                    self.children(i),
                    children[i as usize]
                ));
            }
        }
        if orphans != self.orphans() {
            return Err(format!(
                "the index counts {} orphans but has {orphans}",
                self.orphans()
            ));
        }
        Ok(())
    }
}

#[cfg(any(test, feature = "test-hooks"))]
impl PrefixIndex {
    /// Test only: overwrites the salt recorded with registration `entry`
    /// (index + 1; its hash, key and chain stay).
    pub(crate) fn set_salt_for_tests(&mut self, entry: u32, salt: i64) {
        self.idents[entry as usize - 1].salt = salt;
    }

    /// `(live entries, keyed entries, orphans)`.
    pub(crate) fn links_for_tests(&self) -> (usize, usize, usize) {
        (self.len(), self.table.len(), self.orphans())
    }

    /// Ghost registrations kept.
    pub(crate) fn ghosts_for_tests(&self) -> usize {
        self.ghosts.len()
    }

    /// `(registration id, parent's registration id)` of the entry `entry`
    /// (index + 1, as a page's record names it).
    pub(crate) fn registration_for_tests(&self, entry: u32) -> (u64, u64) {
        let e = &self.entries[entry as usize - 1];
        (e.reg, e.parent_reg)
    }
}

#[cfg(test)]
impl PrefixIndex {
    /// Test only: breaks one of the invariants above, named by `what`, on
    /// the pool of the allocator's corruption tests (page size 1, pages 1
    /// and 2 held). Returns the `(page, entry)` registrations the page
    /// records are to name, so that only the named invariant is broken.
    pub(crate) fn corrupt_for_tests(&mut self, what: &str) -> Vec<(u32, u32)> {
        use super::tip::ChainTip;
        self.reserve(2).unwrap();
        let root = ChainTip::default();
        match what {
            // registered page 2, but its record is not told
            "registration its page lacks" => {
                self.register(2, 7, &root, 0, true);
                vec![]
            }
            // a registered page rewritten in place
            "first token" => {
                let tip = self.register(2, 7, &root, 0, true);
                self.tokens[2] += 1;
                vec![(2, tip.entry)]
            }
            // a hash that is not the one its key was derived from
            "hash" => {
                let tip = self.register(2, 7, &root, 0, true);
                self.idents[tip.entry as usize - 1].hash ^= 1 << 64;
                vec![(2, tip.entry)]
            }
            // a child whose salt is not its parent's (a hinted walk, which
            // does not read it, would hand it out under the parent's salt)
            "child salt" => {
                let tip = self.register(1, 7, &root, 0, true);
                let child = self.register(2, 8, &tip, 5, true);
                vec![(1, tip.entry), (2, child.entry)]
            }
            // an unkeyed child its parent no longer hints: no lookup finds it
            "unreachable child" => {
                let tip = self.register(1, 7, &root, 0, true);
                let child = self.register(2, 8, &tip, 0, false);
                self.entries[tip.entry as usize - 1].child = 0;
                vec![(1, tip.entry), (2, child.entry)]
            }
            // a parent that miscounts its children
            "children count" => {
                let tip = self.register(1, 7, &root, 0, true);
                let child = self.register(2, 8, &tip, 0, true);
                self.idents[tip.entry as usize - 1].links += 1;
                vec![(1, tip.entry), (2, child.entry)]
            }
            _ => panic!("no corruption {what:?}"),
        }
    }
}

impl PrefixIndex {
    /// The runs' invariants (module docs), for `check()`.
    pub(super) fn check_runs(&self) -> std::result::Result<(), String> {
        let r = &self.runs;
        if !r.on {
            return Ok(());
        }
        let n = self.entries.len();
        if r.tokens.len() < n || r.len_at[n..].iter().any(|&l| l != 0) {
            return Err(format!(
                "the runs record {} slots, or runs past them, but the slab has {n}",
                r.tokens.len(),
            ));
        }
        for f in 0..self.entries.len() as u32 {
            let len = r.len_at[f as usize];
            if len == 0 {
                continue;
            }
            if r.run_of[f as usize] != f + 1 {
                return Err(format!("slot {f} starts a run of {len} it is not in"));
            }
            for s in f..f + len {
                let Some(e) = self.entries.get(s as usize) else {
                    return Err(format!("the run at {f} reaches past the slab, to slot {s}"));
                };
                let i = s as usize;
                if e.parent_reg == DEAD || self.is_ghost(s) || r.run_of[i] != f + 1 {
                    return Err(format!("the run at {f} holds slot {s}, not live in it"));
                }
                if s > f && r.len_at[i] != 0 {
                    return Err(format!("slot {s} starts a run inside the run at {f}"));
                }
                if r.tokens[i] != e.first_token || r.pages[i] != e.page {
                    return Err(format!(
                        "the run at {f} keeps token {} at {:#x} for slot {s}, whose entry has \
                         {} at {:#x}",
                        r.tokens[i], r.pages[i], e.first_token, e.page
                    ));
                }
                if s > f {
                    let p = &self.entries[i - 1];
                    if e.parent_reg != p.reg || self.idents[i].parent != s {
                        return Err(format!(
                            "slot {s} of the run at {f} was not filed under the slot before it"
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

impl PrefixIndex {
    /// Whether the chain ending at `tip` spells `n` pages from the root,
    /// page `k` holding `tokens(k)` under `salt`: read back from the tip
    /// by parent links, each entry live, verified (`verify`), and filed
    /// under the registration before it. By links, not by keys, so a
    /// hash collision that hides an entry from lookups does not count.
    pub(crate) fn check_chain_spells<'t>(
        &self,
        tip: &ChainTip,
        n: usize,
        salt: i64,
        tokens: impl Fn(usize) -> &'t [i32],
    ) -> std::result::Result<(), String> {
        let (mut at, mut reg) = (self.live_tip(tip), tip.reg);
        for k in (0..n).rev() {
            let Some(i) = at else {
                return Err(format!("page {k}'s registration {reg} is gone"));
            };
            let e = &self.entries[i as usize];
            if !self.verify(i, tokens(k), salt, e.parent_reg) {
                return Err(format!(
                    "page {k}'s entry {i} holds other tokens or another salt"
                ));
            }
            let parent = self.idents[i as usize].parent;
            reg = e.parent_reg;
            at = parent
                .checked_sub(1)
                .filter(|&p| self.entries.get(p as usize).is_some_and(|pe| pe.reg == reg));
            if k == 0 && (parent != 0 || reg != 0) {
                return Err(format!(
                    "page 0's entry {i} is filed under registration {reg}, not the root"
                ));
            }
        }
        if n == 0 && tip.reg != 0 {
            return Err(format!("no page leads to registration {}", tip.reg));
        }
        Ok(())
    }
}

#[cfg(any(test, feature = "test-hooks"))]
impl PrefixIndex {
    /// `(first slot, length, parent slot + 1)` of every run, in slab order.
    pub(crate) fn runs_for_tests(&self) -> Vec<(u32, u32, u32)> {
        let r = &self.runs;
        (0..self.entries.len().min(r.len_at.len()))
            .filter(|&s| r.len_at[s] != 0)
            .map(|s| (s as u32, r.len_at[s], self.idents[s].parent))
            .collect()
    }
}
