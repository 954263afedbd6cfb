//! A caller's request-to-token table (SGLang's `req_to_token`): one row of
//! slot ids per request row, position by position, as int32. `extend` fills
//! it in the same pass that takes the slots, so an engine needs no second
//! loop over the batch; the decode loop writes a request's slot while its
//! row is in registers (see `decode.rs`), which a write after the call, or
//! in a callback after the batch, costs several times over.
//!
//! Writes made before the batch is known valid are undone from
//! `SlotAllocator::table_saved`, so a failing extend leaves the table as
//! it was.

use crate::allocator::SlotAllocator;
use crate::error::{PoolError, Result};

/// A mutable view of a `[rows, cols]` int32 table whose rows start
/// `row_stride` elements apart (`row_stride >= cols`, e.g. a column slice
/// of a wider array).
#[derive(Debug)]
pub struct SlotTable<'a> {
    data: &'a mut [i32],
    row_stride: usize,
}

impl<'a> SlotTable<'a> {
    /// A view of `data` as rows `row_stride` apart. The allocator checks
    /// the extent against its own shape when the table is passed in.
    pub fn new(data: &'a mut [i32], row_stride: usize) -> Self {
        SlotTable { data, row_stride }
    }

    /// Holds `rows` rows of `cols` positions, or says what is missing.
    pub(crate) fn check_extent(&self, rows: usize, cols: usize) -> Result<()> {
        let need = (rows.saturating_sub(1))
            .saturating_mul(self.row_stride)
            .saturating_add(cols);
        if self.row_stride < cols || self.data.len() < need {
            return Err(PoolError::InvalidArgument(format!(
                "the slot table holds {} entries at a row stride of {}; it needs \
                 [max_requests = {rows}, max_context_len = {cols}] at a row stride >= {cols}",
                self.data.len(),
                self.row_stride
            )));
        }
        Ok(())
    }

    /// Sets table[row, pos] to `slot`, returning the old entry.
    #[inline(always)]
    pub(crate) fn swap(&mut self, row: usize, pos: usize, slot: i64) -> i32 {
        match self.data.get_mut(row * self.row_stride + pos) {
            Some(e) => std::mem::replace(e, slot as i32),
            None => 0, // not reached: the extent was checked against the shape
        }
    }

    /// Puts back an entry `swap` replaced.
    #[inline]
    pub(crate) fn restore(&mut self, row: usize, pos: usize, old: i32) {
        if let Some(e) = self.data.get_mut(row * self.row_stride + pos) {
            *e = old;
        }
    }

    /// Writes table[row, start..start + n] = first_slot, first_slot + 1, ...
    /// (`n` positions of one page).
    #[inline]
    pub(crate) fn write_page(&mut self, row: usize, start: usize, first_slot: usize, n: usize) {
        let at = row * self.row_stride + start;
        if let Some(dst) = self.data.get_mut(at..at + n) {
            for (j, d) in dst.iter_mut().enumerate() {
                *d = (first_slot + j) as i32;
            }
        }
    }

    /// Writes table[row, ..pages.len()] = pages (page size 1: a page is its
    /// slot).
    #[inline]
    pub(crate) fn write_pages(&mut self, row: usize, pages: &[u32]) {
        let at = row * self.row_stride;
        if let Some(dst) = self.data.get_mut(at..at + pages.len()) {
            for (d, &p) in dst.iter_mut().zip(pages) {
                *d = p as i32;
            }
        }
    }

    /// Writes table[row, start..start + slots.len()] = slots, and the
    /// entries of the `moved` positions before `start` that copy-on-write
    /// moved onto the page of `slots[0]`.
    #[inline]
    pub(crate) fn write(&mut self, row: usize, start: usize, slots: &[i64], moved: usize) {
        let at = row * self.row_stride + start;
        if let [s] = slots {
            // A decode step's one slot: skip the vector loop's set-up.
            if let Some(e) = self.data.get_mut(at) {
                *e = *s as i32;
            }
        } else if let Some(dst) = self.data.get_mut(at..at + slots.len()) {
            for (d, &s) in dst.iter_mut().zip(slots) {
                *d = s as i32;
            }
        }
        if moved > 0 {
            if let (Some(&first), Some(dst)) = (slots.first(), self.data.get_mut(at - moved..at)) {
                for (j, d) in dst.iter_mut().enumerate() {
                    *d = (first - (moved - j) as i64) as i32;
                }
            }
        }
    }
}

impl SlotAllocator {
    /// `table` can take any slot of this pool at any request position.
    /// `extend_into_table` and `fill_table` check this themselves; a caller
    /// that opens requests (`open_with_prefix`, `fork`) and then fills their
    /// rows checks first, so that a bad table fails before anything opens.
    pub fn check_table(&self, table: &SlotTable<'_>) -> Result<()> {
        if self.num_slots() > i32::MAX as usize + 1 {
            return Err(PoolError::InvalidArgument(format!(
                "num_slots = {} does not fit an int32 slot table",
                self.num_slots()
            )));
        }
        table.check_extent(self.max_requests, self.max_context_len)
    }
}
