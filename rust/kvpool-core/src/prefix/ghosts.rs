//! Ghost registrations: what the index remembers of a removed entry whose
//! chain goes on below it, so that recomputing its content brings the
//! chain back.
//!
//! An entry removed while it has live children (evicted first at a lower
//! retention priority, rewritten in place after a truncation, its last
//! host copy lost, or an orphan giving way) leaves them orphans: their
//! `parent_reg` names a registration no lookup will verify again. When a
//! request recomputed the content, it used to be registered under a new
//! id, so the orphans stayed unreachable for good while their Stored
//! events stood: a KV-aware router believed the pool held a chain it
//! never served.
//!
//! So such an entry leaves a **ghost**: its registration id, hash, salt,
//! parent registration, a copy of its page's token ids, and how many
//! children it has (live entries, which are orphans, and ghosts). It
//! keeps its slab slot (no page, no key): the children name their parent
//! by slot (`Identity::parent`) and registration, and the slot's
//! `parent_reg` stays `DEAD`, so nothing verifies against it meanwhile.
//!
//! **Revival.** A page registered under a live tip `T` with the ghost's
//! key, token ids and salt, where the ghost's parent registration is
//! `T.reg`, is the removed entry's content on the very prefix it stood
//! for: it takes the ghost's slot and registration id, and its children
//! verify again (a child checks `parent_reg == tip.reg`). A full check,
//! never a hash-only match. Revival emits the page's Stored event as any
//! registration does (the Removed event went out at the removal), so the
//! events and what lookups serve agree again. Ids are reused only so: for
//! the same verified prefix (layer groups key their content by them,
//! `groups/regmap.rs`, and that content is exactly this prefix's).
//!
//! **Lifetime.** A ghost lives while it has children: a child leaving
//! (removed without a ghost of its own, relinked, or a ghost child
//! dropped) lowers the count, and at 0 the ghost goes, its slot is freed,
//! and its own parent's count drops in turn. So a ghost exists only above
//! a live orphan, and registration already probes the key table while an
//! orphan exists (`links.rs`): the revival probe costs a check of an
//! empty map otherwise. A live entry's ghost children are counted too
//! (`kids_of_live`, flagged in its `links`): it leaves a ghost when
//! removed with any, and an eviction checks one flag for both.
//!
//! **Bound.** At most one ghost per removed entry with descendants, and
//! at most `max_entries` (one per page of the pool and its host tier)
//! at once; past that, or when its memory cannot be had, an entry goes
//! without a ghost (its children stay orphans, as before ghosts).
//!
//! The maps themselves are `ghost_table.rs`.

use super::ghost_table::Ghost;
use super::index::{Entry, Identity, PrefixIndex, DEAD};
use super::keys::key_of;
use super::links::{GHOST_KIDS, KEYED};
use super::tip::ChainTip;

impl PrefixIndex {
    /// The ghost at slab slot `slot` if it is registration `reg`'s.
    #[inline]
    fn ghost_at(&mut self, slot: u32, reg: u64) -> Option<&mut Ghost> {
        self.ghosts.by_slot.get_mut(&slot).filter(|g| g.reg == reg)
    }

    /// Whether slab slot `i` holds a ghost.
    pub(super) fn is_ghost(&self, i: u32) -> bool {
        self.ghosts.by_slot.contains_key(&i)
    }

    /// Live entry `i` (with `children` live ones) is being removed: keeps
    /// a ghost of it in its slot if it has children and room allows;
    /// returns whether it did. Runs before `disown(i)`, so its parent
    /// counts it as a ghost child before it stops counting it as a live
    /// one (and never drops meanwhile).
    pub(super) fn ghost_out(&mut self, i: u32, children: u32) -> bool {
        let ghost_kids = if self.idents[i as usize].links & GHOST_KIDS != 0 {
            self.idents[i as usize].links &= !GHOST_KIDS;
            self.ghosts.kids_of_live.remove(&i).unwrap_or(0)
        } else {
            0
        };
        if children + ghost_kids == 0 || self.ghosts.len() >= self.max_entries {
            return false;
        }
        let mut tokens = Vec::new();
        if tokens.try_reserve_exact(self.page_size).is_err() || !self.ghosts.room_for_one() {
            return false;
        }
        let e = self.entries[i as usize];
        tokens.extend_from_slice(self.location_tokens(e.page));
        let id = self.idents[i as usize];
        match self.live_parent(i) {
            Some(p) => {
                *self.ghosts.kids_of_live.entry(p).or_insert(0) += 1;
                self.idents[p as usize].links |= GHOST_KIDS;
            }
            None => {
                if let Some(p) = id.parent.checked_sub(1) {
                    if let Some(g) = self.ghost_at(p, e.parent_reg) {
                        g.ghost_kids += 1;
                    }
                }
            }
        }
        self.ghosts.insert(
            i,
            Ghost {
                reg: e.reg,
                parent_reg: e.parent_reg,
                parent: id.parent,
                hash: id.hash,
                salt: id.salt,
                live_kids: children,
                ghost_kids,
                next: 0,
                tokens: tokens.into_boxed_slice(),
            },
        );
        true
    }

    /// A child of the entry that was registration `reg` at slab index
    /// `slot` left it (`live`: a live child, else a ghost child); a ghost
    /// left with no children goes, and so on up its chain.
    #[cold]
    #[inline(never)]
    pub(super) fn kid_gone(&mut self, mut slot: u32, mut reg: u64, mut live: bool) {
        loop {
            let Some(g) = self.ghost_at(slot, reg) else {
                if !live {
                    let e = self.entries.get(slot as usize);
                    if e.is_some_and(|e| e.reg == reg && e.parent_reg != DEAD) {
                        if let Some(n) = self.ghosts.kids_of_live.get_mut(&slot) {
                            *n -= 1;
                            if *n == 0 {
                                self.ghosts.kids_of_live.remove(&slot);
                                self.idents[slot as usize].links &= !GHOST_KIDS;
                            }
                        }
                    }
                }
                return;
            };
            if live {
                g.live_kids -= 1;
            } else {
                g.ghost_kids -= 1;
            }
            if g.live_kids + g.ghost_kids > 0 {
                return;
            }
            let g = self.ghosts.remove(slot).expect("found above");
            self.free_entries.push(slot);
            match (g.parent.checked_sub(1), g.parent_reg) {
                (Some(p), r) if r != 0 => (slot, reg, live) = (p, r, false),
                _ => return,
            }
        }
    }

    /// The ghost a page of `tokens` (chain hash `hash`, salt `salt`)
    /// registered under live tip `parent` revives: same key, token ids and
    /// salt, and its parent registration is the tip's.
    fn ghost_for(&self, hash: u128, page: u32, salt: i64, parent: &ChainTip) -> Option<u32> {
        let tokens = self.page_tokens(page);
        self.ghosts.of_key(key_of(hash)).find(|s| {
            let g = &self.ghosts.by_slot[s];
            g.parent_reg == parent.reg
                && parent.reg != DEAD
                && g.salt == salt
                && g.hash == hash
                && *g.tokens == *tokens
        })
    }

    /// Whether any ghost is kept: only then can a registration revive one
    /// (and only while an orphan exists, so never under a `childless` tip).
    #[inline(always)]
    pub(crate) fn has_ghosts(&self) -> bool {
        !self.ghosts.is_empty()
    }

    /// `register` (keyed), or the revival of the ghost the page's content
    /// under `parent` brings back (`ghost_for`).
    pub(crate) fn revive_or_register(
        &mut self,
        page: u32,
        hash: u128,
        parent: &ChainTip,
        salt: i64,
    ) -> ChainTip {
        match self.ghost_for(hash, page, salt, parent) {
            Some(slot) => self.revive(slot, page, parent),
            None => self.register(page, hash, parent, salt, true),
        }
    }

    /// Registers `page` as the ghost at `slot` come back under live tip
    /// `parent` (`ghost_for`): its slot, id, hash and children.
    fn revive(&mut self, slot: u32, page: u32, parent: &ChainTip) -> ChainTip {
        let g = self.ghosts.remove(slot).expect("a ghost to revive");
        let i = slot as usize;
        self.entries[i] = Entry {
            reg: g.reg,
            parent_reg: parent.reg,
            page,
            first_token: self.tokens[page as usize * self.page_size],
            // The hint it had (never trusted): its children's walk resumes.
            child: self.entries[i].child,
            host: 0,
        };
        self.idents[i] = Identity {
            hash: g.hash,
            salt: g.salt,
            parent: parent.entry,
            links: KEYED | g.live_kids | if g.ghost_kids > 0 { GHOST_KIDS } else { 0 },
        };
        self.table.insert(key_of(g.hash), slot);
        if g.ghost_kids > 0 {
            // Within the capacity `room_for_one` kept.
            self.ghosts.kids_of_live.insert(slot, g.ghost_kids);
        }
        self.live += 1;
        self.orphans -= g.live_kids as usize;
        self.adopt(parent);
        if let Some(p) = parent.entry.checked_sub(1) {
            self.kid_gone(p, parent.reg, false);
        }
        self.set_hint(parent, slot);
        ChainTip {
            hash: g.hash,
            reg: g.reg,
            entry: slot + 1,
        }
    }
}

impl PrefixIndex {
    /// The ghosts' invariants (`check.rs`); `free`: the free slab slots.
    pub(super) fn check_ghosts(
        &self,
        is_live: &dyn Fn(u32) -> bool,
        free: &std::collections::HashSet<u32>,
        entry_of: &dyn Fn(u32) -> Option<u32>,
    ) -> std::result::Result<(), String> {
        let g = &self.ghosts;
        if g.len() > self.max_entries {
            return Err(format!(
                "{} ghosts, over the bound {}",
                g.len(),
                self.max_entries
            ));
        }
        let keyed: usize = g.by_key.keys().map(|&k| g.of_key(k).count()).sum();
        if keyed != g.len()
            || g.by_key.iter().any(|(&k, &s)| {
                g.of_key(k)
                    .any(|x| !g.by_slot.contains_key(&x) || key_of(g.by_slot[&x].hash) != k)
                    || s == u32::MAX
            })
        {
            return Err("the ghosts' key chains do not list every ghost once".into());
        }
        let live_regs: std::collections::HashSet<u64> = (0..self.entries.len() as u32)
            .filter(|&i| is_live(i))
            .map(|i| self.entries[i as usize].reg)
            .collect();
        // Who names slot s as its parent with registration r.
        let names = |s: u32, r: u64, c: u32, pr: u64| c == s + 1 && pr == r;
        for (&s, gh) in &g.by_slot {
            let e = self
                .entries
                .get(s as usize)
                .ok_or("a ghost past the slab")?;
            if free.contains(&s)
                || e.parent_reg != DEAD
                || entry_of(e.page) == Some(s + 1)
                || live_regs.contains(&gh.reg)
                || gh.tokens.len() != self.page_size
            {
                return Err(format!(
                    "ghost {s} (registration {}) is live, free or named",
                    gh.reg
                ));
            }
            let live_kids = (0..self.entries.len() as u32)
                .filter(|&i| is_live(i) && self.live_parent(i).is_none())
                .filter(|&i| {
                    names(
                        s,
                        gh.reg,
                        self.idents[i as usize].parent,
                        self.entries[i as usize].parent_reg,
                    )
                })
                .count() as u32;
            let ghost_kids = g
                .by_slot
                .values()
                .filter(|k| names(s, gh.reg, k.parent, k.parent_reg))
                .count() as u32;
            if (live_kids, ghost_kids) != (gh.live_kids, gh.ghost_kids)
                || live_kids + ghost_kids == 0
            {
                return Err(format!(
                    "ghost {s} counts {} live and {} ghost children but has {live_kids} and {ghost_kids}",
                    gh.live_kids, gh.ghost_kids
                ));
            }
        }
        for i in (0..self.entries.len() as u32).filter(|&i| is_live(i)) {
            let reg = self.entries[i as usize].reg;
            let n = g
                .by_slot
                .values()
                .filter(|k| names(i, reg, k.parent, k.parent_reg))
                .count() as u32;
            let flagged = self.idents[i as usize].links & GHOST_KIDS != 0;
            if g.kids_of_live.get(&i).copied().unwrap_or(0) != n || flagged != (n > 0) {
                return Err(format!(
                    "index entry {i} counts {:?} ghost children (flagged: {flagged}) but has {n}",
                    g.kids_of_live.get(&i)
                ));
            }
        }
        if g.kids_of_live.keys().any(|&i| !is_live(i)) {
            return Err("a ghost-children count of no live entry".into());
        }
        Ok(())
    }
}
