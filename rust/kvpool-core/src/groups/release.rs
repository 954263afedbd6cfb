//! Shortening and closing requests in every group: `truncate` (and an
//! extend's roll-back), `close`, `reset`.

use super::paged::PageEngine;
use super::{Group, GroupedAllocator};
use crate::allocator::group_hooks::BatchRow;
use crate::allocator::options::Counts;
use crate::error::{PoolError, Result, Rollback};

impl GroupedAllocator {
    /// Shortens each request to `lengths[i]` tokens in every group. A
    /// sliding group needs the new length's window: still held, or, for
    /// the pages it released as the window moved, still cached under the
    /// request's anchor chain (they hold exactly that prefix's K/V; the
    /// request holds them again); a state group restores the request's
    /// slot from a checkpoint at exactly the new length (a queued copy), or
    /// from the empty state at 0. The current length changes nothing.
    /// All-or-nothing.
    ///
    /// Errors (nothing changed, in any group): `InvalidHandle`,
    /// `InvalidArgument` (a length out of [0, current], a handle twice),
    /// `RollbackUnavailable` (the first request, in batch order, that a
    /// group cannot roll back, naming the group), `GroupExhausted` (a state
    /// group needs a fresh slot for a restore, see `state.rs`, and has
    /// none).
    pub fn truncate(&mut self, handles: &[i64], lengths: Counts<'_>) -> Result<()> {
        self.shorten(handles, lengths, true)
    }

    /// Shortens requests back to the lengths they had before an extend whose
    /// step never ran, or to where a batch of prefix hits must start
    /// together, as [`Self::truncate`] does in every group (the same window
    /// and checkpoint rules), except that each request keeps the prompt it
    /// was opened with, as [`SlotAllocator::roll_back_extend`] does: the
    /// positions given back are still that prompt's, so the next extend
    /// takes its token ids again and `cache` registers them in every group.
    /// A state group's slot is the state at the new length (restored from
    /// the checkpoint there): the state at a longer length cannot be turned
    /// back into it. All-or-nothing; the errors of `truncate`.
    ///
    /// [`SlotAllocator::roll_back_extend`]: crate::SlotAllocator::roll_back_extend
    pub fn roll_back_extend(&mut self, handles: &[i64], lengths: Counts<'_>) -> Result<()> {
        self.shorten(handles, lengths, false)
    }

    fn shorten(&mut self, handles: &[i64], lengths: Counts<'_>, forget_prompt: bool) -> Result<()> {
        let batch = self.anchor.group_truncate_checks(handles, lengths)?;
        // Per state group, per request: the restore's source (-1: empty).
        let mut sources: Vec<Vec<i64>> = vec![Vec::new(); self.groups.len()];
        // Per sliding group: (row, first page, pages) it takes back.
        let mut back: Vec<Vec<(usize, usize, Vec<u32>)>> = vec![Vec::new(); self.groups.len()];
        for (i, r) in batch.iter().enumerate() {
            if r.count >= r.len {
                continue;
            }
            for (g, e) in self.groups.iter().enumerate() {
                let refuse = |reason: String| {
                    PoolError::RollbackUnavailable(Box::new(Rollback {
                        handle: handles[i],
                        length: r.count,
                        group: g,
                        kind: self.specs[g].kind.name(),
                        reason,
                    }))
                };
                match e {
                    Group::Anchor => {}
                    Group::Pages(e) => {
                        if !e.rollback_ok(r.row, r.count) {
                            match self.cached_window(e, r.row, r.count) {
                                Some((first, pages)) => back[g].push((r.row, first, pages)),
                                None => {
                                    return Err(refuse(format!(
                                        "released the pages before position {} as the window \
                                         moved, and length {} attends back to position {}, whose \
                                         pages are no longer cached",
                                        e.first_held(r.row) * e.page_size(),
                                        r.count,
                                        e.window_start(r.count)
                                    )))
                                }
                            }
                        }
                    }
                    Group::State(e) => {
                        let from = match self.checkpoint_at(e, r.row, r.count) {
                            Some(s) => s,
                            None => {
                                return Err(refuse(format!(
                                    "keeps no checkpoint of this request's state at {} tokens \
                                     (checkpoints are taken by cache() at multiples of {})",
                                    r.count, e.every
                                )))
                            }
                        };
                        sources[g].push(from);
                    }
                }
            }
        }
        // A restore writes a fresh slot where a queued copy still reads the
        // request's own; each such group must have them.
        for (g, e) in self.groups.iter().enumerate() {
            let Group::State(e) = e else { continue };
            let fresh = batch
                .iter()
                .filter(|r| r.count < r.len && e.restore_needs_slot(r.row))
                .count();
            let mut pinned: Vec<i64> = sources[g].iter().copied().filter(|&s| s > 0).collect();
            pinned.sort_unstable();
            pinned.dedup();
            let cached = pinned
                .iter()
                .filter(|&&s| e.slots.holders(s as u32) == 0)
                .count();
            let free = e.available() - cached;
            if fresh > free {
                return Err(self.exhausted(g, fresh, free));
            }
        }
        for g in self.groups.iter_mut() {
            if let Group::State(e) = g {
                e.prepare(batch.len())?;
            }
        }
        if forget_prompt {
            self.anchor.truncate(handles, lengths)?;
        } else {
            self.anchor.roll_back_extend(handles, lengths)?;
        }
        self.sync_rows(&batch);
        for (g, e) in self.groups.iter_mut().enumerate() {
            match e {
                Group::Anchor => {}
                Group::Pages(e) => {
                    for r in &batch {
                        e.shrink(r.row, r.len, r.count);
                    }
                    for (row, first, pages) in &back[g] {
                        e.take_back(*row, *first, pages);
                    }
                }
                Group::State(e) => {
                    let src = &sources[g];
                    for &s in src.iter().filter(|&&s| s > 0) {
                        e.pin(s as u32);
                    }
                    let shrunk = batch.iter().filter(|r| r.count < r.len);
                    for (r, &from) in shrunk.zip(src) {
                        e.restore(r.row, from);
                    }
                    for &s in src.iter().filter(|&&s| s > 0) {
                        e.unpin(s as u32);
                    }
                }
            }
        }
        Ok(())
    }

    /// The pages a sliding group gives `row` back for the window of length
    /// `len`, which the row released as its window moved: the first page
    /// index and, from there up to the first page it holds (or the new
    /// last page), the page filed under the row's anchor chain at each
    /// page's end. None when one is not cached (or the chain is shorter).
    fn cached_window(&self, e: &PageEngine, row: usize, len: usize) -> Option<(usize, Vec<u32>)> {
        let ps = e.page_size();
        let first = e.window_start(len) / ps;
        let end = e.first_held(row).min(len.div_ceil(ps));
        let regs = &self.regs[row];
        let mut pages = Vec::new();
        pages.try_reserve(end.saturating_sub(first)).ok()?;
        for k in first..end {
            let at = (k + 1) * ps;
            if at > regs.len() * self.a {
                return None;
            }
            pages.push(e.map.get(regs[at / self.a - 1])?);
        }
        Some((first, pages))
    }

    /// The checkpoint a state group restores `row` from at `len` tokens
    /// (-1 for the empty state at 0), if it has one for the row's prefix.
    fn checkpoint_at(&self, e: &super::state::StateEngine, row: usize, len: usize) -> Option<i64> {
        if len == 0 {
            return Some(-1);
        }
        let regs = &self.regs[row];
        if len % self.a != 0 || regs.len() * self.a < len {
            return None;
        }
        e.checkpoint(regs[len / self.a - 1]).map(|s| s as i64)
    }

    /// Closes each request in every group, releasing its pages and state
    /// slots; the handles become invalid. With `cache`, first registers
    /// them as [`Self::cache`] does. All-or-nothing.
    ///
    /// Errors: `InvalidHandle`, `InvalidArgument` (a handle twice; an index
    /// cannot grow).
    pub fn close(&mut self, handles: &[i64], cache: bool) -> Result<()> {
        let batch = self.anchor.group_resolve_batch(handles)?;
        if cache {
            self.register(&batch)?;
        }
        self.anchor.close(handles, false)?;
        self.close_rows(&batch);
        Ok(())
    }

    fn close_rows(&mut self, batch: &[BatchRow]) {
        for r in batch {
            self.regs[r.row].clear();
        }
        for g in self.groups.iter_mut() {
            match g {
                Group::Anchor => {}
                Group::Pages(e) => {
                    for r in batch {
                        e.shrink(r.row, r.len, 0);
                    }
                }
                Group::State(e) => {
                    for r in batch {
                        e.close_row(r.row);
                    }
                }
            }
        }
    }

    /// Closes every open request in every group (nothing registered).
    pub fn reset(&mut self) {
        let open: Vec<BatchRow> = (0..self.anchor.max_requests())
            .filter_map(|row| {
                self.anchor
                    .group_row_len(row)
                    .map(|len| BatchRow { row, len, count: 0 })
            })
            .collect();
        self.anchor.reset();
        self.close_rows(&open);
    }
}
