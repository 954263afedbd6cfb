//! A drain straight into the caller's arrays. A binding that returns one
//! numpy array per field would otherwise get the events as `Events` (ten
//! fresh vectors, filled in one pass) and copy each into its array: a second
//! pass over every byte, and at page size 1, where a router drains thousands
//! of events a step, fresh vectors past malloc's mmap threshold that fault
//! their pages in on every drain. Here the one pass writes the arrays.

use std::mem::MaybeUninit;

use super::{EventLog, Events, Raw};

/// Where a drain writes: one slice per field of [`super::Events`] (the same
/// meaning and order), uninitialized memory allowed. Event `i` goes to row
/// `i` of every per-event slice, the Stored events' token ids one after
/// another into `token_ids`.
#[derive(Debug)]
pub struct EventSink<'a> {
    pub kind: &'a mut [MaybeUninit<u8>],
    pub hash_hi: &'a mut [MaybeUninit<u64>],
    pub hash_lo: &'a mut [MaybeUninit<u64>],
    pub parent_hi: &'a mut [MaybeUninit<u64>],
    pub parent_lo: &'a mut [MaybeUninit<u64>],
    pub page: &'a mut [MaybeUninit<i32>],
    pub num_tokens: &'a mut [MaybeUninit<i32>],
    pub salt: &'a mut [MaybeUninit<i64>],
    pub medium: &'a mut [MaybeUninit<u8>],
    pub token_ids: &'a mut [MaybeUninit<i32>],
}

impl EventSink<'_> {
    /// Events every per-event slice has room for.
    fn rows(&self) -> usize {
        [
            self.kind.len(),
            self.hash_hi.len(),
            self.hash_lo.len(),
            self.parent_hi.len(),
            self.parent_lo.len(),
            self.page.len(),
            self.num_tokens.len(),
            self.salt.len(),
            self.medium.len(),
        ]
        .into_iter()
        .min()
        .unwrap_or(0)
    }
}

/// What a drain wrote: rows `0..events` of the per-event slices and
/// `0..tokens` of `token_ids` are initialized; the rest is untouched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Drained {
    pub events: usize,
    pub tokens: usize,
}

impl Events {
    /// A sink over each column's spare capacity: a drain into it appends
    /// rows (and token ids) to these events, once [`Self::commit_drained`]
    /// counts them.
    pub fn spare_sink(&mut self) -> EventSink<'_> {
        EventSink {
            kind: self.kind.spare_capacity_mut(),
            hash_hi: self.hash_hi.spare_capacity_mut(),
            hash_lo: self.hash_lo.spare_capacity_mut(),
            parent_hi: self.parent_hi.spare_capacity_mut(),
            parent_lo: self.parent_lo.spare_capacity_mut(),
            page: self.page.spare_capacity_mut(),
            num_tokens: self.num_tokens.spare_capacity_mut(),
            salt: self.salt.spare_capacity_mut(),
            medium: self.medium.spare_capacity_mut(),
            token_ids: self.token_ids.spare_capacity_mut(),
        }
    }

    /// Counts the rows and token ids a drain into [`Self::spare_sink`] wrote.
    ///
    /// # Safety
    /// `d` must be what that drain returned (it wrote the first `d.events`
    /// slots of each per-event column's spare capacity and the first
    /// `d.tokens` of `token_ids`'), with no change to the columns since.
    /// Each column grows from its own length: the fields are public, and a
    /// caller's columns of unequal lengths still get only what the drain
    /// wrote into each (a drain writes at most the smallest spare capacity).
    pub unsafe fn commit_drained(&mut self, d: Drained) {
        self.kind.set_len(self.kind.len() + d.events);
        self.hash_hi.set_len(self.hash_hi.len() + d.events);
        self.hash_lo.set_len(self.hash_lo.len() + d.events);
        self.parent_hi.set_len(self.parent_hi.len() + d.events);
        self.parent_lo.set_len(self.parent_lo.len() + d.events);
        self.page.set_len(self.page.len() + d.events);
        self.num_tokens.set_len(self.num_tokens.len() + d.events);
        self.salt.set_len(self.salt.len() + d.events);
        self.medium.set_len(self.medium.len() + d.events);
        self.token_ids.set_len(self.token_ids.len() + d.tokens);
    }
}

impl EventLog {
    /// Undrained events and the token ids their Stored events carry: the
    /// sizes a sink needs to take them all.
    pub(crate) fn pending(&self) -> (usize, usize) {
        (self.raw.len(), self.token_ids.len())
    }

    /// Drains the oldest events that fit `out` (all of them when it was sized
    /// by [`Self::pending`] and nothing was recorded since) into it, and
    /// keeps the rest, in order, for the next drain.
    pub(crate) fn take_into(&mut self, mut out: EventSink<'_>) -> Drained {
        let (rows, ids) = (out.rows(), out.token_ids.len());
        let d = if rows >= self.raw.len() && ids >= self.token_ids.len() {
            Drained {
                events: self.raw.len(),
                tokens: self.token_ids.len(),
            }
        } else {
            fitting(&self.raw, rows, ids)
        };
        fill(&self.raw[..d.events], &mut out);
        // SAFETY: `MaybeUninit<i32>` has i32's layout, and `d.tokens` is at
        // most `out.token_ids.len()` (`fitting`, or the test above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.token_ids.as_ptr(),
                out.token_ids.as_mut_ptr() as *mut i32,
                d.tokens,
            );
        }
        if d.events == self.raw.len() {
            self.raw.clear();
            self.token_ids.clear();
        } else {
            self.raw.drain(..d.events);
            self.token_ids.drain(..d.tokens);
        }
        if d.events > 0 {
            // What is left no longer starts with an overflow's Cleared event.
            self.overflowed = false;
        }
        d
    }
}

/// The longest prefix of `raw` with at most `rows` events whose tokens fit
/// in `ids` token ids.
fn fitting(raw: &[Raw], rows: usize, ids: usize) -> Drained {
    let mut d = Drained::default();
    for r in raw.iter().take(rows) {
        let t = d.tokens + r.num_tokens as usize;
        if t > ids {
            break;
        }
        d = Drained {
            events: d.events + 1,
            tokens: t,
        };
    }
    d
}

/// Writes `raw`'s fields to rows `0..raw.len()` of `out`'s per-event slices
/// (each has at least that many). One pass: a router drains every step,
/// thousands of events at page size 1, and a pass per column read the
/// records nine times (13,000 events in 54 µs, against 20 in one pass).
#[inline]
pub(super) fn fill(raw: &[Raw], out: &mut EventSink<'_>) {
    let n = raw.len();
    // Each slice cut to exactly n: the loop indexes them without bounds checks.
    let kind = &mut out.kind[..n];
    let hash_hi = &mut out.hash_hi[..n];
    let hash_lo = &mut out.hash_lo[..n];
    let parent_hi = &mut out.parent_hi[..n];
    let parent_lo = &mut out.parent_lo[..n];
    let page = &mut out.page[..n];
    let num_tokens = &mut out.num_tokens[..n];
    let salt = &mut out.salt[..n];
    let medium = &mut out.medium[..n];
    for (i, r) in raw.iter().enumerate() {
        kind[i].write(r.kind);
        hash_hi[i].write((r.hash >> 64) as u64);
        hash_lo[i].write(r.hash as u64);
        parent_hi[i].write((r.parent >> 64) as u64);
        parent_lo[i].write(r.parent as u64);
        page[i].write(r.page as i32);
        num_tokens[i].write(r.num_tokens as i32);
        salt[i].write(r.salt);
        medium[i].write(r.medium);
    }
}

#[cfg(test)]
mod tests;
