//! A caller's request-to-token table (SGLang's `req_to_token`): one row of
//! slot ids per request row, position by position, as int32. `extend` fills
//! it in the same call that takes the slots, so an engine needs no second
//! loop over the batch.
//!
//! The table is written only once the batch is known valid, so a failing
//! extend leaves it as it was with nothing to undo. A decode step writes it
//! in a loop of its own after the batch (`write_one`), not in the loop
//! that takes the slots: there each write would read the entry first (to
//! undo it on an error), and with requests at different offsets in their
//! pages a few of those reads miss cache every step, each one stalling the
//! loop, where stores alone drain in the background.

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

    /// Writes table[row, pos] = slot: a decode step's one new entry per
    /// request (`Requests::write_decode`), after the whole batch is applied.
    /// A store only, so the misses of rows whose entry just moved to a new
    /// cache line do not hold the loop up.
    #[inline]
    pub(crate) fn write_one(&mut self, row: usize, pos: usize, slot: i64) {
        let at = row * self.row_stride + pos;
        if let Some(e) = self.data.get_mut(at) {
            *e = slot as i32;
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
