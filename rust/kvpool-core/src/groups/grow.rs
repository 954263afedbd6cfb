//! Opening and growing requests in every group at once: `open`, `admit`,
//! `extend`. Each checks the anchor's part, then every group's room, and
//! only then changes anything.

use super::{Group, GroupedAllocator};
use crate::allocator::group_hooks::BatchRow;
use crate::allocator::options::Counts;
use crate::error::{PoolError, Result};
use crate::handle::handle_row;
use crate::memory::reserve;
use crate::table::SlotTable;

use super::paged::PageEngine;

/// Per group: the new slots of a batch, flattened in request order (empty
/// for state groups).
pub type GroupSlots = Vec<Vec<i64>>;

impl GroupedAllocator {
    /// Opens `n` empty requests in every group (a state group gives each a
    /// slot, queued to be zeroed). Returns their handles.
    ///
    /// Errors (nothing changed): `TooManyRequests`, `GroupExhausted` (a
    /// state group without `n` free or evictable slots).
    pub fn open(&mut self, n: usize) -> Result<Vec<i64>> {
        self.anchor.group_check_available(n, "open")?;
        self.state_room(n)?;
        self.prepare_states(n)?;
        let handles = self.anchor.open(n)?;
        for &h in &handles {
            self.open_row(handle_row(h) as usize);
        }
        Ok(handles)
    }

    /// A new request's row in every group.
    fn open_row(&mut self, row: usize) {
        self.regs[row].clear();
        for g in self.groups.iter_mut() {
            match g {
                Group::Anchor => {}
                Group::Pages(e) => e.open_row(row),
                Group::State(e) => e.open_row(row),
            }
        }
    }

    /// Every state group has `n` slots free or evictable.
    fn state_room(&self, n: usize) -> Result<()> {
        for (g, e) in self.groups.iter().enumerate() {
            if let Group::State(e) = e {
                if n > e.available() {
                    return Err(self.exhausted(g, n, e.available()));
                }
            }
        }
        Ok(())
    }

    fn prepare_states(&mut self, n: usize) -> Result<()> {
        for g in self.groups.iter_mut() {
            if let Group::State(e) = g {
                e.prepare(n)?;
            }
        }
        Ok(())
    }

    /// Tables must be none, or one per group (None for a state group), each
    /// able to take any slot of its group at any position.
    fn check_tables(&self, tables: &[Option<SlotTable<'_>>]) -> Result<()> {
        if tables.is_empty() {
            return Ok(());
        }
        if tables.len() != self.groups.len() {
            return Err(PoolError::InvalidArgument(format!(
                "tables has {} entries but the pool has {} groups; pass one per group (None for \
                 a state group) or none",
                tables.len(),
                self.groups.len()
            )));
        }
        for (g, t) in tables.iter().enumerate() {
            let Some(t) = t else { continue };
            match &self.groups[g] {
                Group::Anchor => self.anchor.check_table(t)?,
                Group::Pages(_) => {
                    let slots = self.specs[g].num_pages * self.specs[g].page_size;
                    if slots > i32::MAX as usize + 1 {
                        return Err(PoolError::InvalidArgument(format!(
                            "group {g} has {slots} slots, more than an int32 slot table holds"
                        )));
                    }
                    t.check_extent(self.anchor.max_requests(), self.anchor.max_context_len())?;
                }
                Group::State(_) => {
                    return Err(PoolError::InvalidArgument(format!(
                        "group {g} is a state group: it has no slot table (pass None)"
                    )))
                }
            }
        }
        Ok(())
    }

    /// Outputs for a batch adding `total` slots: one Vec per page group.
    fn outputs(&self, total: usize) -> Result<GroupSlots> {
        let mut outs = Vec::new();
        reserve(&mut outs, self.groups.len(), "extend output")?;
        for g in &self.groups {
            let n = if matches!(g, Group::State(_)) {
                0
            } else {
                total
            };
            let mut v = Vec::new();
            reserve(&mut v, n, "extend output")?;
            v.resize(n, 0);
            outs.push(v);
        }
        Ok(outs)
    }

    /// Appends `counts[i]` tokens to request `handles[i]` in every group
    /// and returns each group's new slots (see [`GroupSlots`]). `tables`
    /// (empty, or one per group) get the new slots written as
    /// `extend_into_table` writes them, and a sliding group's table the
    /// null page's slots where the window released pages. All-or-nothing.
    ///
    /// A sliding group first releases the pages wholly before `start -
    /// window + 1` of each request that grows (`start` its length before
    /// the call), so the pages the step no longer needs can be reused by
    /// it; they count as available when checking room.
    ///
    /// Errors (nothing changed, in any group): `InvalidHandle`,
    /// `InvalidArgument` (as `SlotAllocator::extend`, and tables of the
    /// wrong number or shape), `ContextTooLong`, `GroupExhausted` (the
    /// first group, in group order, short of pages).
    pub fn extend(
        &mut self,
        handles: &[i64],
        counts: Counts<'_>,
        tokens: Option<&[i64]>,
        tables: &mut [Option<SlotTable<'_>>],
    ) -> Result<GroupSlots> {
        self.check_tables(tables)?;
        let (batch, anchor_need) = self.anchor.group_extend_checks(handles, counts, tokens)?;
        let rows: Vec<(usize, usize, usize)> =
            batch.iter().map(|r| (r.row, r.len, r.count)).collect();
        if let Err(e) = self.page_room(&rows, anchor_need) {
            self.restore_scratch();
            return Err(e);
        }
        let total: usize = rows.iter().map(|r| r.2).sum();
        let mut outs = self.outputs(total)?;
        let copies = rows.iter().filter(|r| r.2 > 0 && r.1 > 0).count();
        for g in self.groups.iter_mut() {
            if let Group::Pages(e) = g {
                e.prepare_copies(copies)?;
            }
        }
        // The anchor's part: it checks again what was checked (it cannot
        // refuse now) and takes its pages.
        let mut scratch = Vec::new();
        let (anchor_out, anchor_table) = match self.anchor_group {
            Some(g) => (&mut outs[g], tables.get_mut(g).and_then(|t| t.as_mut())),
            None => {
                reserve(&mut scratch, total, "extend output")?;
                scratch.resize(total, 0);
                (&mut scratch, None)
            }
        };
        self.anchor
            .extend_into_table(handles, counts, tokens, anchor_out, anchor_table, |_| {})?;
        if self.anchor_group.is_none() {
            self.anchor.group_drop_copies();
        }
        for (g, e) in self.groups.iter_mut().enumerate() {
            if let Group::Pages(e) = e {
                let table = tables.get_mut(g).and_then(|t| t.as_mut());
                grow_group(e, &batch, &mut outs[g], table);
            }
        }
        Ok(outs)
    }

    /// Every group's room for a batch `(row, len, count)`, in group order;
    /// the anchor needs `anchor_need` pages.
    fn page_room(&mut self, rows: &[(usize, usize, usize)], anchor_need: usize) -> Result<()> {
        for g in self.groups.iter_mut() {
            if let Group::Pages(e) = g {
                e.mark_scratch();
            }
        }
        for g in 0..self.groups.len() {
            match &mut self.groups[g] {
                Group::Anchor => self.anchor_room(anchor_need)?,
                Group::Pages(e) => {
                    let (need, credited) = e.extend_need(rows);
                    let free = e.pages.available() + credited;
                    if need > free {
                        return Err(self.exhausted(g, need, free));
                    }
                }
                Group::State(_) => {}
            }
        }
        if self.anchor_group.is_none() {
            self.anchor_room(anchor_need)?;
        }
        Ok(())
    }

    /// Every page group's scratch back to where `page_room` marked it.
    fn restore_scratch(&mut self) {
        for g in self.groups.iter_mut() {
            if let Group::Pages(e) = g {
                e.restore_scratch();
            }
        }
    }

    /// Opens `counts.len()` requests and extends request `i` by `counts[i]`
    /// tokens, as `open` then `extend`, in one call. Returns the handles
    /// and each group's new slots. All-or-nothing.
    ///
    /// Errors (nothing changed): `TooManyRequests`, `InvalidArgument` (a
    /// negative count, bad `tokens` or tables), `ContextTooLong`,
    /// `GroupExhausted` (pages of a page group, slots of a state group).
    pub fn admit(
        &mut self,
        counts: &[i64],
        tokens: Option<&[i64]>,
        tables: &mut [Option<SlotTable<'_>>],
    ) -> Result<(Vec<i64>, GroupSlots)> {
        self.check_tables(tables)?;
        let anchor_need = self.anchor.group_admit_checks(counts, tokens)?;
        let n = counts.len();
        // Fresh rows: length 0, nothing to release or copy.
        let rows: Vec<(usize, usize, usize)> = counts.iter().map(|&c| (0, 0, c as usize)).collect();
        for g in 0..self.groups.len() {
            match &self.groups[g] {
                Group::Anchor => self.anchor_room(anchor_need)?,
                Group::Pages(e) => {
                    let need: usize = rows.iter().map(|r| e.geo.pages_for(r.2)).sum();
                    if need > e.pages.available() {
                        return Err(self.exhausted(g, need, e.pages.available()));
                    }
                }
                Group::State(e) => {
                    if n > e.available() {
                        return Err(self.exhausted(g, n, e.available()));
                    }
                }
            }
        }
        if self.anchor_group.is_none() {
            self.anchor_room(anchor_need)?;
        }
        let total: usize = rows.iter().map(|r| r.2).sum();
        let mut outs = self.outputs(total)?;
        self.prepare_states(n)?;
        let mut handles = Vec::new();
        let mut scratch = Vec::new();
        let (anchor_out, anchor_table) = match self.anchor_group {
            Some(g) => (&mut outs[g], tables.get_mut(g).and_then(|t| t.as_mut())),
            None => {
                reserve(&mut scratch, total, "extend output")?;
                scratch.resize(total, 0);
                (&mut scratch, None)
            }
        };
        self.anchor.admit_into(
            counts,
            tokens,
            anchor_out,
            anchor_table,
            &mut handles,
            |_| {},
        )?;
        let batch: Vec<BatchRow> = handles
            .iter()
            .zip(counts)
            .map(|(&h, &c)| BatchRow {
                row: handle_row(h) as usize,
                len: 0,
                count: c as usize,
            })
            .collect();
        for r in &batch {
            self.open_row(r.row);
        }
        for (g, e) in self.groups.iter_mut().enumerate() {
            if let Group::Pages(e) = e {
                let table = tables.get_mut(g).and_then(|t| t.as_mut());
                grow_group(e, &batch, &mut outs[g], table);
            }
        }
        Ok((handles, outs))
    }
}

/// One page group's part of a checked batch: a sliding group releases what
/// each growing request's window left behind (padding the table there),
/// then every request grows, its slots to `out` and `table`.
fn grow_group(
    e: &mut PageEngine,
    batch: &[BatchRow],
    out: &mut [i64],
    mut table: Option<&mut SlotTable<'_>>,
) {
    let ps = e.page_size();
    if e.window.is_some() {
        for r in batch.iter().filter(|r| r.count > 0) {
            let (from, to) = e.release_window(r.row, r.len);
            if let Some(t) = table.as_deref_mut() {
                PageEngine::pad_table(t, r.row, from, to, ps);
            }
        }
    }
    let runs_before = e.queued_runs();
    let mut k = 0usize;
    for r in batch {
        let dst = &mut out[k..k + r.count];
        let moved = e.grow(r.row, r.len, dst);
        if let Some(t) = table.as_deref_mut() {
            t.write(r.row, r.len, dst, moved);
        }
        k += r.count;
    }
    if e.queued_runs() > runs_before {
        e.hold_copy_sources(runs_before);
    }
}
