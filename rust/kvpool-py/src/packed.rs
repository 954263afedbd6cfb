//! The packed int64 layout of `extend_packed` and `admit_packed`, defined
//! here once for the bindings: `[rows | starts | counts | offsets | slots]`.
//! For a batch of `b` requests, each of the first four parts is `b` long
//! and padded to an even length, so that every part (and the slots after
//! them) starts 16-byte aligned: Triton specializes a kernel on each
//! pointer's alignment, and a part at an odd int64 offset whenever the
//! batch size changed parity would compile a new variant while serving.
//! `rows[i]` is request `i`'s row, `starts[i]` its length before the call,
//! `counts[i]` the tokens it grew by, `offsets[i]` where its new slots
//! begin in `slots` (the prefix sum of `counts`).
//!
//! Python reads it with `kvpool.packed.PackedExtend` (`python/kvpool/packed.py`),
//! whose `tests/test_packed.py` checks its reading against this writer.

use kvpool_core::Grown;

/// Padded length of one part of `b` entries: `b` rounded up to even.
#[inline]
fn part_len(b: usize) -> usize {
    b + (b & 1)
}

/// The head of a packed array: `[rows | starts | counts | offsets]`, each
/// `b` long and padded to even (see the module docs), filled as the core
/// reports each request.
pub(crate) struct PackedHead<'a> {
    rows: &'a mut [i64],
    starts: &'a mut [i64],
    counts: &'a mut [i64],
    offsets: &'a mut [i64],
    /// Slots reported so far (the next request's offset).
    at: i64,
}

impl<'a> PackedHead<'a> {
    /// Entries of the head for `b` requests: where the slots begin.
    pub(crate) fn len(b: usize) -> usize {
        4 * part_len(b)
    }

    /// Splits a packed array for `b` requests into its head and its slots.
    pub(crate) fn split(all: &'a mut [i64], b: usize) -> (Self, &'a mut [i64]) {
        let stride = part_len(b);
        let (meta, slots) = all.split_at_mut(Self::len(b).min(all.len()));
        let (rows, rest) = meta.split_at_mut(stride.min(meta.len()));
        let (starts, rest) = rest.split_at_mut(stride.min(rest.len()));
        let (counts, offsets) = rest.split_at_mut(stride.min(rest.len()));
        let head = PackedHead {
            rows,
            starts,
            counts,
            offsets,
            at: 0,
        };
        (head, slots)
    }

    /// Records request `g.index` (< b; `get_mut` keeps it panic-free).
    #[inline]
    pub(crate) fn note(&mut self, g: &Grown<'_>) {
        let n = g.slots.len() as i64;
        for (seg, v) in [
            (&mut *self.rows, g.row as i64),
            (&mut *self.starts, g.start as i64),
            (&mut *self.counts, n),
            (&mut *self.offsets, self.at),
        ] {
            if let Some(x) = seg.get_mut(g.index) {
                *x = v;
            }
        }
        self.at += n;
    }
}
