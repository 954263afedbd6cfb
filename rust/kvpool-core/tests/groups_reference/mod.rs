//! A naive reference model of `GroupedAllocator`: the anchor is the
//! allocator's own reference model (`reference/`), each other page group a
//! plain page list per request (`None` where a window released the page),
//! a free stack, an LRU Vec and a registration map, each state group a map
//! of live slots, a Vec of queued copies searched front to back, holders
//! counted by scanning. The hit rule tries every length from the longest
//! down. Same policies as the allocator, written the obvious way.

#![allow(dead_code)]

mod extend;
mod pages;
mod prefix;
mod requests;
mod state;

use crate::reference::{Kind, Model};
pub use pages::GPages;
pub use state::GState;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GKind {
    Full,
    Sliding(usize),
    /// checkpoint_every (resolved)
    State(usize),
}

pub enum GGroup {
    Anchor,
    Pages(GPages),
    State(GState),
}

pub struct GModel {
    pub anchor: Model,
    pub anchor_group: Option<usize>,
    pub a: usize,
    pub step: usize,
    pub groups: Vec<GGroup>,
    pub kinds: Vec<GKind>,
    pub sizes: Vec<usize>,
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl GModel {
    /// `specs`: (kind, num_pages, page_size); checkpoint_every 0 = the step.
    pub fn new(specs: &[(GKind, usize, usize)], anchor_pages: usize) -> Self {
        let a = specs
            .iter()
            .filter(|s| !matches!(s.0, GKind::State(_)))
            .map(|s| s.2)
            .reduce(gcd)
            .unwrap();
        let step = specs
            .iter()
            .filter(|s| !matches!(s.0, GKind::State(_)))
            .fold(a, |l, s| l / gcd(l, s.2) * s.2);
        let anchor_group = specs.iter().position(|s| s.0 == GKind::Full && s.2 == a);
        let anchor = match anchor_group {
            Some(g) => Model::new(specs[g].1, a),
            None => Model::new(anchor_pages, a),
        };
        let mut groups = Vec::new();
        let mut kinds = Vec::new();
        for (g, &(k, n, ps)) in specs.iter().enumerate() {
            let k = match k {
                GKind::State(0) => GKind::State(step),
                k => k,
            };
            kinds.push(k);
            groups.push(match k {
                _ if Some(g) == anchor_group => GGroup::Anchor,
                GKind::Full => GGroup::Pages(GPages::new(n, ps, None)),
                GKind::Sliding(w) => GGroup::Pages(GPages::new(n, ps, Some(w))),
                GKind::State(every) => GGroup::State(GState::new(n, every)),
            });
        }
        GModel {
            anchor,
            anchor_group,
            a,
            step,
            groups,
            kinds,
            sizes: specs.iter().map(|s| s.2).collect(),
        }
    }

    fn anchor_index(&self) -> usize {
        self.anchor_group.unwrap_or(self.groups.len())
    }

    fn anchor_room(&self, need: usize) -> Result<(), Kind> {
        if need > self.anchor.free.len() + self.anchor.lru.len() {
            return Err(Kind::GroupExhausted(self.anchor_index()));
        }
        Ok(())
    }

    fn len(&self, row: usize) -> usize {
        self.anchor.reqs[&row].len()
    }

    fn regs(&self, row: usize) -> Vec<u64> {
        self.anchor.reqs[&row].regs.clone()
    }

    fn state_room(&self, n: usize) -> Result<(), Kind> {
        for (g, e) in self.groups.iter().enumerate() {
            if let GGroup::State(e) = e {
                if n > e.available() {
                    return Err(Kind::GroupExhausted(g));
                }
            }
        }
        Ok(())
    }

    fn open_row(&mut self, row: usize) {
        for g in self.groups.iter_mut() {
            match g {
                GGroup::Anchor => {}
                GGroup::Pages(e) => e.open_row(row),
                GGroup::State(e) => e.open_row(row),
            }
        }
    }

    pub fn take_copies(&mut self, g: usize) -> (Vec<i64>, Vec<i64>) {
        match &mut self.groups[g] {
            GGroup::Anchor => self.anchor.take_copies_from(0),
            GGroup::Pages(e) => e.take_copies(),
            GGroup::State(e) => e.take_copies(),
        }
    }

    /// (free + evictable, registered, evictable, pending copies) of group g.
    pub fn counters(&self, g: usize) -> (usize, usize, usize, usize) {
        match &self.groups[g] {
            GGroup::Anchor => (
                self.anchor.free.len() + self.anchor.lru.len(),
                self.anchor.reg.len(),
                self.anchor.lru.len(),
                self.anchor.pending_copies(),
            ),
            GGroup::Pages(e) => (
                e.free.len() + e.lru.len(),
                e.reg.len(),
                e.lru.len(),
                e.pending_copies(),
            ),
            GGroup::State(e) => (e.available(), e.reg.len(), e.lru.len(), e.queue.len()),
        }
    }

    /// Group g's slots of an open row (page groups).
    pub fn slots(&self, g: usize, row: usize) -> Vec<i64> {
        match &self.groups[g] {
            GGroup::Anchor => self.anchor.slots(row),
            GGroup::Pages(e) => e.slots(row, self.len(row)),
            GGroup::State(_) => unreachable!(),
        }
    }

    /// The last position below `row`'s length where its first state group
    /// keeps a checkpoint of its prefix.
    pub fn checkpointed(&self, row: usize) -> Option<usize> {
        let e = self.groups.iter().find_map(|g| match g {
            GGroup::State(e) => Some(e),
            _ => None,
        })?;
        let regs = self.regs(row);
        (1..self.len(row)).rev().find(|&l| {
            l % self.a == 0
                && regs.len() * self.a >= l
                && e.checkpoint(regs[l / self.a - 1]).is_some()
        })
    }

    pub fn state_slot(&self, g: usize, row: usize) -> i64 {
        match &self.groups[g] {
            GGroup::State(e) => e.live[&row] as i64,
            _ => unreachable!(),
        }
    }
}
