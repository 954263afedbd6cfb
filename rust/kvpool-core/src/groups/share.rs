//! Sharing across requests in every group: `fork`, the cache (`cache`,
//! `evict`, `clear_cache`).

use super::{Group, GroupedAllocator};
use crate::allocator::group_hooks::BatchRow;
use crate::error::Result;
use crate::handle::handle_row;
use crate::memory::reserve;

impl GroupedAllocator {
    /// Creates `n` requests, each a copy of `handle`'s in every group: the
    /// same pages (one more holder each; a shared partly filled page is
    /// copied on write), and in a state group a fresh slot queued to be
    /// filled from the parent's. Returns the new handles. All-or-nothing.
    ///
    /// Errors (nothing changed): `InvalidHandle`, `TooManyRequests`,
    /// `GroupExhausted` (a state group without `n` free or evictable
    /// slots), `InvalidArgument` (memory for the prompts).
    pub fn fork(&mut self, handle: i64, n: usize) -> Result<Vec<i64>> {
        let parent = self.anchor.group_resolve(handle)?;
        self.anchor.group_check_available(n, "fork")?;
        self.state_room_for(n)?;
        let mut regs = Vec::new();
        reserve(&mut regs, n, "anchor registrations")?;
        for _ in 0..n {
            let mut r = Vec::new();
            reserve(&mut r, self.regs[parent].len(), "anchor registrations")?;
            r.extend_from_slice(&self.regs[parent]);
            regs.push(r);
        }
        for g in self.groups.iter_mut() {
            if let Group::State(e) = g {
                e.prepare(n)?;
            }
        }
        let kids = self.anchor.fork(handle, n)?;
        let len = self.anchor.group_row_len(parent).unwrap_or(0);
        for (&h, r) in kids.iter().zip(regs) {
            let row = handle_row(h) as usize;
            self.regs[row] = r;
            for g in self.groups.iter_mut() {
                match g {
                    Group::Anchor => {}
                    Group::Pages(e) => e.fork_row(parent, row, len),
                    Group::State(e) => e.fork_row(parent, row),
                }
            }
        }
        Ok(kids)
    }

    fn state_room_for(&self, n: usize) -> Result<()> {
        for (g, e) in self.groups.iter().enumerate() {
            if let Group::State(e) = e {
                if n > e.available() {
                    return Err(self.exhausted(g, n, e.available()));
                }
            }
        }
        Ok(())
    }

    /// Registers each request's full pages of known tokens in every group,
    /// so later prompts can hit them: the anchor chain first, then each
    /// group's pages under the chain's ids, and a state group's checkpoint
    /// of the request's slot when its length is a multiple of the group's
    /// `checkpoint_every` that the chain covers. Call it once the step that
    /// wrote those pages and that state has run. All-or-nothing.
    ///
    /// Errors: `InvalidHandle`, `InvalidArgument` (a handle twice; an index
    /// cannot grow).
    pub fn cache(&mut self, handles: &[i64]) -> Result<()> {
        let batch = self.anchor.group_resolve_batch(handles)?;
        self.register(&batch)
    }

    /// `cache` of resolved rows.
    pub(super) fn register(&mut self, batch: &[BatchRow]) -> Result<()> {
        // A chain whose tip's registration is gone restarts further back:
        // the rows' ids and the groups' progress follow it, so the pages
        // after the restart are filed again under their new ids.
        if self.anchor.group_restart_dead_chains(batch) {
            self.sync_rows(batch);
        }
        // Room first, in every group, then the anchor (which reserves its
        // own before registering anything): nothing can fail after it.
        for g in self.groups.iter_mut() {
            match g {
                Group::Anchor => {}
                Group::Pages(e) => {
                    let n: usize = batch
                        .iter()
                        .map(|r| e.registrable(r.row, r.len, r.len))
                        .sum();
                    e.map.reserve(n.min(e.geo.num_pages))?;
                }
                Group::State(e) => {
                    e.map.reserve(batch.len())?;
                    e.prepare(batch.len())?;
                }
            }
        }
        self.anchor.group_register(batch, &mut self.regs)?;
        let a = self.a;
        for g in self.groups.iter_mut() {
            match g {
                Group::Anchor => {}
                Group::Pages(e) => {
                    for r in batch {
                        e.register(r.row, r.len, &self.regs[r.row], a);
                    }
                }
                Group::State(e) => {
                    for r in batch {
                        let regs = &self.regs[r.row];
                        if r.len > 0 && r.len % e.every == 0 && regs.len() * a >= r.len {
                            e.take_checkpoint(r.row, regs[r.len / a - 1]);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Evicts up to `n` CACHED pages (checkpoints of a state group) of group
    /// `group`, least recently used first; returns how many.
    ///
    /// Errors: `InvalidArgument` for a group that does not exist.
    pub fn evict(&mut self, group: usize, n: usize) -> Result<usize> {
        self.group(group)?;
        Ok(match &mut self.groups[group] {
            Group::Anchor => self.anchor.evict(n),
            Group::Pages(e) => e.evict(n),
            Group::State(e) => e.evict(n),
        })
    }

    /// Drops every cache entry of every group (CACHED pages and checkpoints
    /// become FREE; held ones stay with their holders) and restarts every
    /// request's chain.
    pub fn clear_cache(&mut self) {
        self.anchor.clear_cache();
        for r in self.regs.iter_mut() {
            r.clear();
        }
        for g in self.groups.iter_mut() {
            match g {
                Group::Anchor => {}
                Group::Pages(e) => e.clear(),
                Group::State(e) => e.clear(),
            }
        }
    }
}
